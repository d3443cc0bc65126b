# A cart-pole built from Godot's own bodies (cartpole.tscn): a RigidBody2D cart (character
# mode: it does not rotate) held on a horizontal track by a GrooveJoint2D to a StaticBody2D,
# and a RigidBody2D pole on a PinJoint2D at the cart's centre. Godot's 2D physics move them;
# this script only reads them and pushes the cart. The units are CartPole-v1's (metres,
# m/s, radians, rad/s; SCALE pixels a metre), and so are its numbers: a 1 kg cart, a 0.1 kg
# pole 1 m long, 9.8 m/s^2, a push of 10 N for one 0.02 s physics frame (physics_fps 50),
# the episode terminated at |x| > 2.4 or |theta| > 12 degrees and truncated at 500 steps,
# a reward of 1 a step, a reset uniform in [-0.05, 0.05]. Every body is on collision layer
# 2 and scans no layer (mask 0): the K cart-poles of a process stand in one place and pass
# through one another.
#
# The agent interface of addons/shmrl/shmrl_client.gd: rl_reset, rl_act, rl_observe.
extends Node2D

const SCALE = 100.0                   # pixels a metre
const FORCE = 10.0                    # newtons
const POLE_HALF = 0.5                 # metres from the pin to the pole's centre
const X_LIMIT = 2.4
const THETA_LIMIT = 12 * 2 * PI / 360
const MAX_STEPS = 500

var rng := RandomNumberGenerator.new()
var steps := 0
onready var cart: RigidBody2D = $Cart
onready var pole: RigidBody2D = $Pole


# A new episode: every state variable uniform in [-0.05, 0.05]; its first observation.
func rl_reset() -> Array:
	var s := []
	for _i in 4:
		s.append(rng.randf_range(-0.05, 0.05))
	place(s[0], s[1], s[2], s[3])
	steps = 0
	return s


# Put the bodies in state (x, x_dot, theta, theta_dot), through the physics server (a
# rigid body's node position would be overwritten by the physics step).
func place(x: float, x_dot: float, theta: float, theta_dot: float) -> void:
	var pivot := global_position + Vector2(x * SCALE, 0)
	var v := Vector2(x_dot * SCALE, 0)
	var r := Vector2(sin(theta), -cos(theta)) * POLE_HALF * SCALE      # pin -> the pole's centre
	_set_body(cart, Transform2D(0, pivot), v, 0.0)
	_set_body(pole, Transform2D(theta, pivot + r), v + theta_dot * Vector2(-r.y, r.x), theta_dot)
	cart.applied_force = Vector2.ZERO


func _set_body(body: RigidBody2D, xform: Transform2D, v: Vector2, w: float) -> void:
	var rid := body.get_rid()
	Physics2DServer.body_set_state(rid, Physics2DServer.BODY_STATE_TRANSFORM, xform)
	Physics2DServer.body_set_state(rid, Physics2DServer.BODY_STATE_LINEAR_VELOCITY, v)
	Physics2DServer.body_set_state(rid, Physics2DServer.BODY_STATE_ANGULAR_VELOCITY, w)


# Action 1 pushes right, 0 left, until the next action.
func rl_act(action) -> void:
	cart.applied_force = Vector2(FORCE * SCALE if int(action) == 1 else -FORCE * SCALE, 0)


# The state after the physics frames since rl_act: [obs, reward, terminated, truncated].
func rl_observe() -> Array:
	steps += 1
	var x := (cart.global_position.x - global_position.x) / SCALE
	var theta := wrapf(pole.global_rotation - global_rotation, -PI, PI)
	var obs := [x, cart.linear_velocity.x / SCALE, theta, pole.angular_velocity]
	var terminated := abs(x) > X_LIMIT or abs(theta) > THETA_LIMIT
	return [obs, 1.0, terminated, steps >= MAX_STEPS]
