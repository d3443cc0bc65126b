# The demo's main scene: K cart-poles (cartpole.tscn) and shmrl's client node driving them,
# or a policy of its own with no server (--random N, --balance N). The command line, after
# Godot's own arguments and `--`:
#
#   godot3-server --path clients/godot/demo --fixed-fps 50 -- --port P [--host H] [--agents K]
#       [--codec binary|json] [--seed S] [--name NAME] [--auth-token T] [--frames-per-action N] [--no-progress]
#   godot3-server --path clients/godot/demo --fixed-fps 50 -- --random N | --balance N [--agents K] [--seed S]
#
# --random N plays N episodes with uniformly random actions, --balance N with a hand-coded
# controller (push toward the side the pole falls to), and prints their mean return.
# --no-progress leaves out the client's progress lines (Godot 3 parses every argument, those
# after `--` too: its own --quiet would silence all of stdout, and never reaches the game).
# Exit status: 0 when the server ended the session (or the episodes are played), 1 when it
# could never be reached or broke the protocol, 2 for a bad command line.
extends Node2D

const CartPole = preload("res://cartpole.tscn")
const Client = preload("res://addons/shmrl/shmrl_client.gd")
const USAGE = "usage: godot3-server --path DEMO --fixed-fps 50 -- (--port P [--host H] [--codec binary|json] " \
		+ "[--name NAME] [--auth-token T] [--frames-per-action N] [--no-progress] | --random N | --balance N) [--agents K] [--seed S]"

var opts := {"port": -1, "host": "127.0.0.1", "agents": 4, "codec": "binary", "seed": -1, "name": "",
		"auth-token": "", "random": 0, "balance": 0, "frames-per-action": 1, "no-progress": false}
var carts := []
var rng := RandomNumberGenerator.new()
var own_returns := []          # --random / --balance: the episodes' returns
var _ret := []
var _started := false


func _ready() -> void:
	var error := _parse(OS.get_cmdline_args())
	if error != "":
		printerr("%s\n%s" % [error, USAGE])
		get_tree().quit(2)
		set_physics_process(false)
		return
	var seed_: int = opts["seed"] if opts["seed"] >= 0 else OS.get_unix_time() ^ OS.get_process_id()
	rng.seed = seed_
	for i in opts["agents"]:
		var cart = CartPole.instance()
		cart.position = Vector2(512, 300)
		cart.rng.seed = seed_ * 1009 + i
		add_child(cart)
		carts.append(cart)
	if opts["random"] > 0 or opts["balance"] > 0:
		return                      # _physics_process plays them
	set_physics_process(false)
	var client = Client.new()
	client.host = opts["host"]
	client.port = opts["port"]
	client.codec = opts["codec"]
	client.client_name = opts["name"]
	client.auth_token = opts["auth-token"]
	client.quiet = opts["no-progress"]
	client.frames_per_action = opts["frames-per-action"]
	client.observation_shape = [4]
	client.action_space = {"type": "Discrete", "n": 2}
	for cart in carts:
		client.add_agent(cart)
	add_child(client)


func _parse(args: Array) -> String:
	var i := args.find("--") + 1
	while i < args.size():
		var flag: String = args[i]
		var key := flag.trim_prefix("--")
		if flag == "--no-progress":
			opts["no-progress"] = true
			i += 1
			continue
		if not flag.begins_with("--") or not opts.has(key) or i + 1 >= args.size():
			return "bad argument %s" % flag
		var value: String = args[i + 1]
		if typeof(opts[key]) == TYPE_INT:
			if not value.is_valid_integer():
				return "%s takes an integer, not %s" % [flag, value]
			opts[key] = int(value)
		else:
			opts[key] = value
		i += 2
	if opts["codec"] != "binary" and opts["codec"] != "json":
		return "--codec is binary or json"
	if opts["frames-per-action"] < 1:
		return "--frames-per-action is at least 1"
	if opts["agents"] < 1 or opts["agents"] > 4096:
		return "--agents is 1 to 4096"
	if opts["port"] < 0 and opts["random"] <= 0 and opts["balance"] <= 0:
		return "--port (a learner's), --random N or --balance N is required"
	return ""


# --random N / --balance N: the same steps as the client node takes, with a policy here.
func _physics_process(_delta: float) -> void:
	if not _started:
		_started = true
		for cart in carts:
			_ret.append(0.0)
			_act(cart, cart.rl_reset())
		return
	for i in carts.size():
		var o: Array = carts[i].rl_observe()
		_ret[i] += o[1]
		var obs: Array = o[0]
		if o[2] or o[3]:
			own_returns.append(_ret[i])
			_ret[i] = 0.0
			obs = carts[i].rl_reset()
		_act(carts[i], obs)
	var wanted: int = max(opts["random"], opts["balance"])
	if own_returns.size() >= wanted:
		var total := 0.0
		for r in own_returns.slice(0, wanted - 1):
			total += r
		print("mean return over %d episodes: %.1f (%s policy)" % [wanted, total / wanted,
				"random" if opts["random"] > 0 else "balancing"])
		set_physics_process(false)
		get_tree().quit(0)


func _act(cart, obs: Array) -> void:
	if opts["random"] > 0:
		cart.rl_act(rng.randi_range(0, 1))
	else:
		cart.rl_act(1 if obs[2] + 0.5 * obs[3] > 0 else 0)
