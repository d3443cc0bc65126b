# shmrl_client.gd: an RLlink client for shmrl in GDScript (Godot 3.2.3; no native module).
# The learner runs the policy (server-side inference): the game sends its agents'
# observations and gets their actions back, so the game needs no ONNX runtime. The
# protocol is docs/RLLINK.md (section numbers below are its); docs/CLIENTS.md ("Godot")
# walks through using it.
#
#   framing                 8 ASCII digits, then the body; a reply's header is checked (8
#                           digits, at most MAX_REPLY_BYTES) before its body is read (section 1)
#   one request, one reply  each ACT waits for its ACTIONS, up to REPLY_TIMEOUT_S (sections 2, 6)
#   handshake               PING (codecs, client_name, auth_token, inference: "server") ->
#                           PONG, which must echo inference: "server" (else a clear error,
#                           exit 1); GET_CONFIG declaring the game's spaces -> SET_CONFIG
#                           (sections 3.1, 3.2, 11)
#   codecs                  JSON, and the binary codec (section 7: StreamPeerBuffer,
#                           PoolByteArray) once the PONG agreed on it
#   heartbeats              when the PONG gave heartbeat_s: a HEARTBEAT whenever nothing
#                           went out for heartbeat_s between ACTs (section 5)
#   ACT / ACTIONS           the K agents' observations, then each step's rewards,
#                           terminateds, truncateds and final_obs; K actions back, a Box's
#                           clipped to its bounds (section 11.1)
#   reconnecting            a lost connection is retried after 0.1 s, doubling to 2 s; the
#                           agents are reset (the server forgot their episodes). A server
#                           that stays away GIVE_UP_S after a session ended it: exit 0 (section 2)
#
# How it waits: the node acts in _physics_process, every `frames_per_action` physics
# frames, and blocks there until ACTIONS comes (a poll loop on StreamPeerTCP, sleeping
# 50 us doubling to 2 ms between polls, bounded by REPLY_TIMEOUT_S). So physics never
# advances without the agents' actions: a step is a step, however long the learner takes.
# That is what training wants (headless, with --fixed-fps: no frame to miss); a game shown
# on screen freezes while a reply is held (an update: up to seconds).
#
# The agents: nodes with three methods (clients/godot/demo/cartpole.gd is one):
#   rl_reset() -> Array         start a new episode; its first observation (floats)
#   rl_act(action) -> void      apply the action (an int for a Discrete, an Array otherwise)
#   rl_observe() -> Array       after the physics frames since rl_act: [observation, reward,
#                               terminated, truncated]
extends Node

signal episode_ended(agent, episode_return, length)

const REPLY_TIMEOUT_S = 600     # seconds to wait for a reply: a strict on-policy server holds it through an update
const GIVE_UP_S = 5             # seconds to keep trying a server that went away after a session
const CONNECT_TIMEOUT_S = 5     # seconds for one connection attempt
const MAX_REPLY_BYTES = 16 * 1024 * 1024   # never trust a header (section 1); replies here are small
const MAGIC = [0x93, 0x52, 0x4c, 0x42]     # 0x93 "RLB": a binary body (section 7)
const ITEMSIZE = {"<f4": 4, "<f8": 8, "<i4": 4, "<i8": 8, "|u1": 1, "|b1": 1}

export var host := "127.0.0.1"
export var port := 5556
export var codec := "binary"               # offered in the PING; "json": JSON only
export var client_name := ""               # the server's log names the connection so
export var auth_token := ""                # the learner's --auth-token, if it has one
export(Array, NodePath) var agent_paths = []
export var observation_shape := [4]        # a float32 observation of this shape (section 3.2)
export var action_space := {"type": "Discrete", "n": 2}   # Discrete (n, start), MultiDiscrete (nvec), Box (shape, low, high)
export var frames_per_action := 1          # physics frames each action lasts
export var quiet := false                  # no progress lines (errors and the session's end are printed)
export var log_every_s := 10.0

var agents := []             # the agent nodes (agent_paths, and add_agent's)
var env_steps := 0           # steps stepped over all agents since the node started
var episodes := 0
var returns := []            # the last 100 episodes' returns

var _peer: StreamPeerTCP = null
var _binary := false         # the PONG agreed on the binary codec
var _heartbeat_s := -1.0
var _last_sent_ms := 0
var _acted := false          # actions applied since the last ACT: their outcome goes in the next
var _session_steps := 0      # env steps of this connection (HEARTBEAT's env_steps)
var _frame := 0
var _connected_once := false
var _lost_at_ms := -1        # when the server went away (or the first attempt began)
var _lost := ""              # why the connection ended (a connection-level failure: reconnect)
var _error := ""             # a protocol error: the node stops (exit 1)
var _done := false
var _obs := []               # each agent's current observation
var _ep_return := []
var _ep_length := []
var _last_log_ms := 0
var _seq := -1               # weights_seq_no of the last ACTIONS


class NdArr:                 # an array for the binary codec: dtype, shape, flat values (section 7)
	var dtype: String
	var shape: Array
	var values: Array
	func _init(d, s, v):
		dtype = d
		shape = s
		values = v


func add_agent(agent: Node) -> void:
	agents.append(agent)


func _ready() -> void:
	pause_mode = Node.PAUSE_MODE_PROCESS      # heartbeats go on while the game is paused
	for path in agent_paths:
		agents.append(get_node(path))
	if codec != "binary" and codec != "json":
		_fail("codec must be binary or json, not %s" % codec)
		return


func _process(_delta: float) -> void:
	if not _done and _peer != null:
		_heartbeat()


func _physics_process(_delta: float) -> void:
	if _done or get_tree().paused:
		return
	if agents.empty():
		_fail("no agents: set agent_paths or call add_agent() before the node's first physics frame")
		return
	_frame += 1
	if _acted and _frame % int(max(1, frames_per_action)) != 0:
		return
	_step()


# ------------------------------------------------------------------ one env step of all K agents

func _step() -> void:
	var k := agents.size()
	var outcome = _observe_all() if _acted else null
	_acted = false
	while not _done:
		if _peer == null:
			if not _open_session():
				return
			outcome = null                     # a connection's first ACT carries no outcome (section 11.1)
			_reset_all()
		var msg := {"type": "ACT", "obs": NdArr.new("<f4", [k] + observation_shape, _flat(_obs))}
		if outcome != null:
			for key in outcome:
				msg[key] = outcome[key]
		var reply = _request(msg, "ACTIONS", REPLY_TIMEOUT_S)
		if reply == null:
			if _error != "":
				_fail(_error)
				return
			_drop()
			continue
		var actions = _actions_of(reply, k)
		if actions == null:
			_fail(_error)
			return
		if typeof(reply.get("weights_seq_no")) == TYPE_REAL:
			_seq = int(reply["weights_seq_no"])
		for i in k:
			agents[i].rl_act(actions[i])
		_acted = true
		return


func _reset_all() -> void:
	_obs = []
	_ep_return = []
	_ep_length = []
	for agent in agents:
		_obs.append(_checked_obs(agent.rl_reset(), agent))
		_ep_return.append(0.0)
		_ep_length.append(0)


# The outcome of the last actions; an agent whose episode ended is reset (section 11.1).
func _observe_all() -> Dictionary:
	var k := agents.size()
	var rewards := []
	var terms := []
	var truncs := []
	var final_obs := []
	var any_trunc := false
	for i in k:
		var o: Array = agents[i].rl_observe()
		var obs = _checked_obs(o[0], agents[i])
		var reward := float(o[1])
		var term := bool(o[2])
		var trunc := bool(o[3])
		rewards.append(reward)
		terms.append(term)
		truncs.append(trunc)
		final_obs.append(obs if trunc else _zeros())
		any_trunc = any_trunc or trunc
		_ep_return[i] += reward
		_ep_length[i] += 1
		if term or trunc:
			_episode_ended(i)
			obs = _checked_obs(agents[i].rl_reset(), agents[i])
		_obs[i] = obs
	env_steps += k
	_session_steps += k
	var out := {"rewards": NdArr.new("<f4", [k], rewards), "terminateds": NdArr.new("|b1", [k], terms),
			"truncateds": NdArr.new("|b1", [k], truncs)}
	if any_trunc:                              # every row must fit the env: zeros for the others
		out["final_obs"] = NdArr.new("<f4", [k] + observation_shape, _flat(final_obs))
	_log_progress()
	return out


func _episode_ended(i: int) -> void:
	episodes += 1
	returns.append(_ep_return[i])
	if returns.size() > 100:
		returns.pop_front()
	emit_signal("episode_ended", i, _ep_return[i], _ep_length[i])
	_ep_return[i] = 0.0
	_ep_length[i] = 0


func mean_return() -> float:
	var total := 0.0
	for r in returns:
		total += r
	return total / max(1, returns.size())


func _log_progress() -> void:
	var now := OS.get_ticks_msec()
	if not quiet and now - _last_log_ms >= log_every_s * 1000:
		_last_log_ms = now
		print("env steps %d, episodes %d, mean return of the last %d: %.1f, policy version %d"
				% [env_steps, episodes, returns.size(), mean_return(), _seq])


func _obs_size() -> int:
	var n := 1
	for d in observation_shape:
		n *= int(d)
	return n


func _zeros() -> Array:
	var z := []
	z.resize(_obs_size())
	for j in z.size():
		z[j] = 0.0
	return z


func _checked_obs(obs, agent) -> Array:
	var a: Array = Array(obs)
	if a.size() != _obs_size():
		_error = "%s's observation has %d values, the declared shape %s has %d" % [agent.name, a.size(), observation_shape, _obs_size()]
	for v in a:
		if is_nan(float(v)) or is_inf(float(v)):
			_error = "%s's observation %s is not finite (RLLINK.md section 1 refuses NaN and infinity)" % [agent.name, a]
	return a


func _flat(rows: Array) -> Array:
	var out := []
	for r in rows:
		out += r
	return out


# ACTIONS' K actions (binary: decoded from an array; JSON: a list): an int for a Discrete
# (plus its start), ints for a MultiDiscrete, a Box's floats clipped to its bounds (section 11.1).
func _actions_of(reply: Dictionary, k: int):
	var acts = reply.get("actions")
	var kind: String = action_space["type"]
	if typeof(acts) != TYPE_ARRAY or acts.size() != k:
		_error = "ACTIONS holds %s, expected %d actions" % [str(acts).left(200), k]
		return null
	var out := []
	for a in acts:
		if kind == "Discrete":
			if typeof(a) != TYPE_REAL and typeof(a) != TYPE_INT or int(a) < 0 or int(a) >= int(action_space["n"]):
				_error = "ACTIONS holds %s, not an action of Discrete(%d)" % [str(a), int(action_space["n"])]
				return null
			out.append(int(a) + int(action_space.get("start", 0)))
			continue
		if typeof(a) != TYPE_ARRAY:
			_error = "ACTIONS holds %s where a list goes (%s)" % [str(a), kind]
			return null
		var row := []
		for j in a.size():
			if kind == "Box":
				row.append(clamp(float(a[j]), float(action_space["low"][j]), float(action_space["high"][j])))
			else:
				row.append(int(a[j]))
		out.append(row)
	return out


# ------------------------------------------------------------------ sessions and reconnecting

# Connect and shake hands until it works (true), or the server stays away GIVE_UP_S (false:
# the node quits, 0 after a session, 1 if there never was one).
func _open_session() -> bool:
	var backoff := 0.1
	if _lost_at_ms < 0:
		_lost_at_ms = OS.get_ticks_msec()
	while true:
		if _connect() and _handshake():
			_connected_once = true
			_lost_at_ms = -1
			_session_steps = 0
			if not quiet:
				print("connected to %s:%d (codec %s, server-side inference, %d agents)"
						% [host, port, "binary" if _binary else "json", agents.size()])
			return true
		if _error != "":
			_fail(_error)
			return false
		_drop()
		if OS.get_ticks_msec() - _lost_at_ms > GIVE_UP_S * 1000:
			if _connected_once:
				print("the server ended the session (%s); %d env steps, %d episodes, mean return of the last %d: %.1f"
						% [_lost, env_steps, episodes, returns.size(), mean_return()])
				_quit(0)
			else:
				printerr("shmrl: cannot connect to %s:%d: %s" % [host, port, _lost])
				_quit(1)
			return false
		OS.delay_msec(int(backoff * 1000))
		backoff = min(backoff * 2, 2.0)
	return false


func _connect() -> bool:
	_peer = StreamPeerTCP.new()
	_binary = false
	_heartbeat_s = -1.0
	if _peer.connect_to_host(host, port) != OK:
		_lost = "cannot start a connection to %s:%d" % [host, port]
		return false
	var deadline := OS.get_ticks_msec() + CONNECT_TIMEOUT_S * 1000
	while _peer.get_status() == StreamPeerTCP.STATUS_CONNECTING:
		if OS.get_ticks_msec() > deadline:
			_lost = "no connection in %d s" % CONNECT_TIMEOUT_S
			return false
		OS.delay_msec(1)
	if _peer.get_status() != StreamPeerTCP.STATUS_CONNECTED:
		_lost = "connection refused"
		return false
	_peer.set_no_delay(true)                   # small frames, each waited for (section 1)
	return true


# PING -> PONG, GET_CONFIG (declaring the spaces) -> SET_CONFIG (sections 3.1, 3.2, 11).
func _handshake() -> bool:
	var ping := {"type": "PING"}
	if auth_token != "":
		ping["auth_token"] = auth_token
	if codec == "binary":
		ping["codecs"] = ["binary"]
	if client_name != "":
		ping["client_name"] = client_name
	ping["inference"] = "server"
	var pong = _request(ping, "PONG", REPLY_TIMEOUT_S)
	if pong == null:
		return false
	if pong.has("codec"):
		if pong["codec"] != "binary" or codec != "binary":
			_error = "the PONG names codec %s, which was not offered" % str(pong["codec"])
			return false
		_binary = true
		if typeof(pong.get("heartbeat_s")) == TYPE_REAL and pong["heartbeat_s"] > 0:
			_heartbeat_s = pong["heartbeat_s"]
	if pong.get("inference") != "server":
		_error = "the server does not serve actions (its PONG did not grant 'inference': 'server'): " \
				+ "this client needs shmrl's learner (python -m shmrl.run --tcp-port P), which runs the policy for it"
		return false
	var get_config := {"type": "GET_CONFIG", "observation_shape": observation_shape, "observation_dtype": "<f4",
			"action_space": action_space}
	var config = _request(get_config, "SET_CONFIG", REPLY_TIMEOUT_S)
	if config == null:
		return false
	if config.has("observation_leaves") or config.has("policy_map"):
		_error = "this client does not support Dict observations or multi-agent envs (SET_CONFIG: %s)" % str(config).left(300)
		return false
	if config.has("observation_shape") and not _same_shape(config["observation_shape"], observation_shape):
		_error = "the server trains observations of shape %s, this game's are %s" % [config["observation_shape"], observation_shape]
		return false
	return true


func _same_shape(a, b) -> bool:
	if typeof(a) != TYPE_ARRAY or a.size() != b.size():
		return false
	for i in a.size():
		if int(a[i]) != int(b[i]):
			return false
	return true


func _drop() -> void:
	if _peer != null:
		_peer.disconnect_from_host()
		_peer = null
	_acted = false
	if _connected_once and _lost_at_ms < 0:
		_lost_at_ms = OS.get_ticks_msec()


func _fail(message: String) -> void:
	printerr("shmrl: " + message)
	_quit(1)


func _quit(code: int) -> void:
	_done = true
	if _peer != null:
		_peer.disconnect_from_host()
		_peer = null
	set_physics_process(false)
	set_process(false)
	get_tree().quit(code)


func _heartbeat() -> void:
	if _heartbeat_s > 0 and OS.get_ticks_msec() - _last_sent_ms >= _heartbeat_s * 1000:
		_send({"type": "HEARTBEAT", "env_steps": _session_steps})


# ------------------------------------------------------------------ frames and codecs

func _send(msg: Dictionary) -> bool:
	var body: PoolByteArray = _encode_binary(msg) if _binary else JSON.print(_plain(msg)).to_utf8()
	var frame := ("%08d" % body.size()).to_ascii()
	frame.append_array(body)
	_last_sent_ms = OS.get_ticks_msec()
	if _peer.put_data(frame) != OK:
		_lost = "cannot send to the server"
		return false
	return true


# Send `msg` and read its reply, which must be of type `expect`: the reply, or null (then
# _error says why for a protocol error; _lost for a connection that ended or timed out).
func _request(msg: Dictionary, expect: String, timeout_s: float):
	if _error != "" or not _send(msg):
		return null
	var deadline := OS.get_ticks_msec() + int(timeout_s * 1000)
	var header = _read_exactly(8, deadline)
	if header == null:
		return null
	for b in header:
		if b < 48 or b > 57:
			_error = "bad frame header %s (RLLINK.md section 1: 8 ASCII digits)" % str(header)
			return null
	var length := int(header.get_string_from_ascii())
	if length > MAX_REPLY_BYTES:
		_error = "a reply of %d bytes is too large (at most %d)" % [length, MAX_REPLY_BYTES]
		return null
	var body = _read_exactly(length, deadline)
	if body == null:
		return null
	var reply = _decode(body)
	if reply == null:
		return null
	if reply.get("type") != expect:
		_error = "expected %s, got %s" % [expect, str(reply).left(300)]
		return null
	return reply


func _read_exactly(n: int, deadline: int):
	var out := PoolByteArray()
	var wait_us := 50
	while out.size() < n:
		var available := _peer.get_available_bytes()
		if available > 0:
			var got: Array = _peer.get_partial_data(min(available, n - out.size()))
			if got[0] != OK:
				_lost = "the connection broke"
				return null
			out.append_array(got[1])
			wait_us = 50
			continue
		if _peer.get_status() != StreamPeerTCP.STATUS_CONNECTED:
			_lost = "the server closed the connection"
			return null
		if OS.get_ticks_msec() > deadline:
			_lost = "no reply in time (the reply timeout, %d s)" % REPLY_TIMEOUT_S
			return null
		OS.delay_usec(wait_us)
		wait_us = min(wait_us * 2, 2000)
	return out


# The message with each NdArr as nested lists (the JSON codec).
func _plain(msg: Dictionary) -> Dictionary:
	var out := {}
	for key in msg:
		var v = msg[key]
		if typeof(v) == TYPE_OBJECT and v is NdArr:
			v = _nest(v.values, v.shape)
		out[key] = v
	return out


func _nest(values: Array, shape: Array) -> Array:
	if shape.size() <= 1:
		return values
	var n := int(shape[0])
	var width: int = 0 if n == 0 else values.size() / n
	var rows := []
	for i in n:
		rows.append(_nest(values.slice(i * width, i * width + width - 1), shape.slice(1, shape.size() - 1)))
	return rows


# A binary body (section 7): magic, u32 head length, the JSON head with a descriptor
# {"__nd__": [dtype, shape, offset, nbytes]} for each NdArr, zeros to a multiple of 8,
# then the arrays, each 8-aligned.
func _encode_binary(msg: Dictionary) -> PoolByteArray:
	var head := {}
	var data := StreamPeerBuffer.new()        # little-endian (big_endian is false)
	for key in msg:
		var v = msg[key]
		if typeof(v) == TYPE_OBJECT and v is NdArr:
			var offset := data.get_size()
			for x in v.values:
				if v.dtype == "<f4":
					data.put_float(float(x))
				else:
					data.put_u8(1 if x else 0)
			head[key] = {"__nd__": [v.dtype, v.shape, offset, data.get_size() - offset]}
			while data.get_size() % 8 != 0:
				data.put_u8(0)
		else:
			head[key] = v
	var head_bytes := JSON.print(head).to_utf8()
	var out := StreamPeerBuffer.new()
	out.put_data(PoolByteArray(MAGIC))
	out.put_u32(head_bytes.size())
	out.put_data(head_bytes)
	while out.get_size() % 8 != 0:
		out.put_u8(0)
	out.put_data(data.data_array)
	return out.data_array


# A reply body, JSON or binary, as a Dictionary (binary arrays become nested Arrays); null
# with _error set if it is neither.
func _decode(body: PoolByteArray):
	var text := ""
	var data_start := 0
	var binary: bool = body.size() >= 4 and body[0] == MAGIC[0] and body[1] == MAGIC[1] and body[2] == MAGIC[2] and body[3] == MAGIC[3]
	if binary:
		if body.size() < 8:
			_error = "a binary body shorter than its preamble"
			return null
		var buf := StreamPeerBuffer.new()
		buf.data_array = body
		buf.seek(4)
		var head_len := buf.get_u32()
		data_start = (8 + head_len + 7) / 8 * 8
		if head_len == 0 or 8 + head_len > body.size():
			_error = "a binary head of %d bytes overruns the body of %d" % [head_len, body.size()]
			return null
		text = body.subarray(8, 7 + head_len).get_string_from_utf8()
	else:
		text = body.get_string_from_utf8()
	var parsed := JSON.parse(text)
	if parsed.error != OK or typeof(parsed.result) != TYPE_DICTIONARY or typeof(parsed.result.get("type")) != TYPE_STRING:
		_error = "a reply that is not a JSON object with a type: %s" % text.left(200)
		return null
	if not binary:
		return parsed.result
	var reply = _arrays(parsed.result, body, data_start)
	return null if _error != "" else reply


func _arrays(v, body: PoolByteArray, data_start: int):
	if typeof(v) == TYPE_DICTIONARY:
		if v.has("__nd__"):
			return _read_nd(v["__nd__"], body, data_start)
		for key in v.keys():
			v[key] = _arrays(v[key], body, data_start)
	elif typeof(v) == TYPE_ARRAY:
		for i in v.size():
			v[i] = _arrays(v[i], body, data_start)
	return v


# {"__nd__": [dtype, shape, offset, nbytes]} read from the data section: nested Arrays.
func _read_nd(d, body: PoolByteArray, data_start: int):
	if typeof(d) != TYPE_ARRAY or d.size() != 4 or not ITEMSIZE.has(d[0]) or typeof(d[1]) != TYPE_ARRAY:
		_error = "a bad array descriptor %s" % str(d)
		return null
	var count := 1
	for n in d[1]:
		count *= int(n)
	var start := data_start + int(d[2])
	if count * ITEMSIZE[d[0]] != int(d[3]) or int(d[2]) % 8 != 0 or start + int(d[3]) > body.size():
		_error = "an array descriptor %s that does not fit its body of %d bytes" % [str(d), body.size()]
		return null
	var buf := StreamPeerBuffer.new()
	buf.data_array = body
	buf.seek(start)
	var values := []
	for _i in count:
		match d[0]:
			"<f4": values.append(buf.get_float())
			"<f8": values.append(buf.get_double())
			"<i4": values.append(buf.get_32())
			"<i8": values.append(buf.get_64())
			"|b1": values.append(buf.get_u8() != 0)
			_: values.append(buf.get_u8())
	return _nest(values, d[1])
