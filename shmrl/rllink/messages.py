"""RLlink messages: their types and schema validation (the bytes are ``codec``'s, the
episodes' fields ``episodes``', the shared field checks ``fields``').

See docs/RLLINK.md for the protocol. After validation, the ``episodes`` of a request are
always an ``EpisodeBatch`` (or ``MultiAgentBatch``), whichever form and codec they came in.

This module knows nothing of sockets, shared memory or torch.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import numpy as np

from shmrl.core.episode import EpisodeBatch, MultiAgentBatch
from shmrl.rllink.codec import MAGIC, Columns, MultiColumns, ProtocolError, decode, show
from shmrl.rllink.act import act_request, actions_reply, binary_act_arrays, inference_mode
from shmrl.rllink.episodes import columns_batch, episode_fields, episodes_batch
from shmrl.rllink.fields import count, is_bool, is_int, module_id, require


class MessageType(str, enum.Enum):
    PING = "PING"
    PONG = "PONG"
    GET_CONFIG = "GET_CONFIG"
    SET_CONFIG = "SET_CONFIG"
    GET_STATE = "GET_STATE"
    SET_STATE = "SET_STATE"
    EPISODES = "EPISODES"
    EPISODES_AND_GET_STATE = "EPISODES_AND_GET_STATE"
    # shmrl's extension: a client that offered codecs in its PING sends this (no reply) at
    # least every PONG["heartbeat_s"] seconds while it samples, with the env steps it has
    # stepped so far; the server closes a connection that falls silent (RLlib's client never
    # offers codecs, so it is never asked for one).
    HEARTBEAT = "HEARTBEAT"
    # shmrl's extension, server-side inference (a client that asked for it in its PING):
    # ACT carries K envs' observations and their last step's outcome, ACTIONS K actions.
    ACT = "ACT"
    ACTIONS = "ACTIONS"


_T = MessageType
REQUEST_TYPES = frozenset({_T.PING, _T.GET_CONFIG, _T.GET_STATE, _T.EPISODES, _T.EPISODES_AND_GET_STATE,
                           _T.HEARTBEAT, _T.ACT})
_ACT = _T.ACT.value
_MAX_CODECS = 16   # offered in a PING
REPLY_TYPES = frozenset({_T.PONG, _T.SET_CONFIG, _T.SET_STATE, _T.ACTIONS})
_REQUEST_FIELDS = {
    _T.PING: frozenset({"type", "auth_token", "codecs", "client_name", "inference", "action_dists"}),
    # optional: the client's spaces, declared in SET_CONFIG's format (docs/RLLINK.md §3.2)
    _T.GET_CONFIG: frozenset({"type", "observation_shape", "observation_dtype", "observation_leaves",
                              "action_space"}),
    _T.GET_STATE: frozenset({"type"}),
    _T.EPISODES: frozenset({"type", "episodes", "timesteps", "env_steps"}),
    _T.EPISODES_AND_GET_STATE: frozenset({"type", "episodes", "timesteps", "env_steps"}),
    _T.HEARTBEAT: frozenset({"type", "env_steps"}),
}


@dataclass(frozen=True)
class MessageLimits:
    """The most chunks and env steps one EPISODES message may carry (a server's bound on
    the work and memory of one message); None: no bound."""
    max_chunks: int | None = None
    max_steps: int | None = None


def decode_request(body, limits: MessageLimits | None = None) -> dict:
    """The validated request in ``body`` (either codec; a binary ACT's fields are arrays)."""
    msg = decode(body)
    out = validate(msg, "request", limits)
    if out["type"] == _ACT and "obs" in out and memoryview(body).cast("B")[:4] == MAGIC:
        binary_act_arrays(msg)
    return out


def decode_reply(body) -> dict:
    return validate(decode(body), "reply")


def _request(msg: dict, t: MessageType, limits: MessageLimits | None = None) -> dict:
    if t is _T.ACT:
        return act_request(msg)
    for key in msg:
        if key not in _REQUEST_FIELDS[t]:
            raise ProtocolError(f"{t.value}: unexpected field {show(key)}")
    out = {"type": t.value}
    if t is _T.PING and "auth_token" in msg:
        if not isinstance(msg["auth_token"], str):
            raise ProtocolError(f"PING: 'auth_token' must be a string, got {type(msg['auth_token']).__name__}")
        out["auth_token"] = msg["auth_token"]
    # codecs: unknown ones are not an error (the server picks one it knows); action_dists: the
    # distributions beyond RLlib's that the client samples (docs/RLLINK.md §3.1)
    for key in ("codecs", "action_dists"):
        if t is _T.PING and key in msg:
            names = msg[key]
            if (type(names) is not list or len(names) > _MAX_CODECS
                    or not all(isinstance(n, str) and len(n) <= 32 for n in names)):
                raise ProtocolError(f"PING: {key!r} must be a list of at most {_MAX_CODECS} short strings, "
                                    f"got {show(names)}")
            out[key] = names
    if t is _T.PING and "client_name" in msg:
        name = msg["client_name"]
        if not (isinstance(name, str) and 0 < len(name) <= 64 and name.isprintable()):
            raise ProtocolError(f"PING: 'client_name' must be a printable string of 1 to 64 characters, "
                                f"got {show(name)}")
        out["client_name"] = name
    if t is _T.PING and "inference" in msg:
        out["inference"] = inference_mode(msg, "PING")
    if t is _T.GET_CONFIG:
        out.update(declared_spaces(msg))
        return out
    if t is _T.HEARTBEAT:
        out["env_steps"] = count(msg, "env_steps", t.value) if "env_steps" in msg else None
        return out
    if t not in (_T.EPISODES, _T.EPISODES_AND_GET_STATE):
        return out
    episodes = require(msg, "episodes", t.value)
    counts = {k: count(msg, k, t.value) for k in ("timesteps", "env_steps") if k in msg}
    if len(set(counts.values())) > 1:
        raise ProtocolError(f"{t.value}: 'timesteps' = {counts['timesteps']} and 'env_steps' = "
                            f"{counts['env_steps']} disagree")
    if limits is not None and limits.max_chunks is not None and _chunks(episodes) > limits.max_chunks:
        raise ProtocolError(f"{t.value}: {_chunks(episodes)} chunks in one message, over the server's limit of "
                            f"{limits.max_chunks}")
    with np.errstate(all="ignore"):  # overflow in float32 casts is reported as non-finite
        if isinstance(episodes, (Columns, EpisodeBatch)):
            batch = columns_batch(episodes if isinstance(episodes, Columns) else episodes.columns(), t.value)
        elif isinstance(episodes, (MultiColumns, MultiAgentBatch)):
            modules = episodes if isinstance(episodes, MultiColumns) else episodes.policies
            batch = MultiAgentBatch({})
            for module, cols in modules.items():
                where = f"{t.value} module {module_id(module, t.value)!r}"
                if isinstance(cols, EpisodeBatch):
                    cols = cols.columns()
                elif not isinstance(cols, Columns):
                    raise ProtocolError(f"{where}: episodes must be columns, got {type(cols).__name__}")
                batch.policies[module] = columns_batch(cols, where, multi=True)
        elif isinstance(episodes, (list, tuple)):
            batch = episodes_batch([episode_fields(ep, i) for i, ep in enumerate(episodes)], t.value)
        else:
            raise ProtocolError(f"{t.value}: 'episodes' must be a list, got {type(episodes).__name__}")
    out["episodes"] = batch
    steps = batch.num_steps
    if limits is not None and limits.max_steps is not None and steps > limits.max_steps:
        raise ProtocolError(f"{t.value}: {steps} env steps in one message, over the server's limit of "
                            f"{limits.max_steps}")
    for key, said in counts.items():
        if said != steps:
            raise ProtocolError(f"{t.value}: {key!r} = {said} but the episodes hold {steps} steps "
                                f"(lengths that disagree)")
    out["timesteps"] = steps
    return out


DECLARED_FIELDS = ("observation_shape", "observation_dtype", "action_space")
_MAX_DECLARED_SIZE = 1 << 24   # values of one observation
_MAX_DECLARED_PARTS = 4096     # components of a Box action, parts of a MultiDiscrete
_DECLARED_ACTION_FIELDS = {"Discrete": ({"n"}, {"start"}), "Box": ({"shape", "low", "high"}, set()),
                           "MultiDiscrete": ({"nvec"}, set())}


def declared_spaces(msg: dict) -> dict:
    """The spaces a GET_CONFIG declares, normalized, in SET_CONFIG's format (docs/RLLINK.md
    §3.2): a flat float32 observation (``observation_shape``, ``observation_dtype`` "<f4")
    and a Discrete, Box (finite bounds) or MultiDiscrete ``action_space``; {} when it
    declares none. ProtocolError for a partial, malformed or unsupported declaration."""
    if "observation_leaves" in msg:
        raise ProtocolError("GET_CONFIG: 'observation_leaves' (a Dict or Tuple observation) cannot be declared; "
                            "start the learner with --env")
    given = [key for key in DECLARED_FIELDS if key in msg]
    if not given:
        return {}
    if len(given) < len(DECLARED_FIELDS):
        raise ProtocolError(f"GET_CONFIG: a declaration of spaces needs all of {', '.join(DECLARED_FIELDS)}; "
                            f"got only {', '.join(given)}")
    shape = msg["observation_shape"]
    if not (type(shape) is list and 1 <= len(shape) <= 8 and all(is_int(d) and d >= 1 for d in shape)
            and int(np.prod(shape, dtype=np.float64)) <= _MAX_DECLARED_SIZE):
        raise ProtocolError(f"GET_CONFIG: 'observation_shape' must be a list of 1 to 8 ints >= 1 of at most "
                            f"{_MAX_DECLARED_SIZE} values in all, got {show(shape)}")
    if msg["observation_dtype"] != "<f4":
        raise ProtocolError(f"GET_CONFIG: 'observation_dtype' {show(msg['observation_dtype'])} cannot be declared: "
                            "only \"<f4\" (float32); start the learner with --env for other observations")
    return {"observation_shape": [int(d) for d in shape], "observation_dtype": "<f4",
            "action_space": _declared_action(msg["action_space"])}


def _declared_action(space) -> dict:
    where = "GET_CONFIG: 'action_space'"
    kind = space.get("type") if isinstance(space, dict) else None
    if kind not in _DECLARED_ACTION_FIELDS:
        raise ProtocolError(f"{where} must be an object of type Discrete, Box or MultiDiscrete (others cannot be "
                            f"declared: start the learner with --env), got {show(space)}")
    needed, optional = _DECLARED_ACTION_FIELDS[kind]
    for key in space:
        if key != "type" and key not in needed | optional:
            raise ProtocolError(f"{where}: unexpected field {show(key)} for a {kind}")
    for key in sorted(needed):
        require(space, key, where)
    if kind == "Discrete":
        out = {"type": kind, "n": _declared_int(space, "n", 1)}
        start = _declared_int(space, "start", -(1 << 31)) if "start" in space else 0
        return {**out, "start": start} if start else out
    if kind == "MultiDiscrete":
        nvec = space["nvec"]
        if not (type(nvec) is list and 1 <= len(nvec) <= _MAX_DECLARED_PARTS
                and all(is_int(n) and 1 <= n < 1 << 31 for n in nvec)):
            raise ProtocolError(f"{where}: 'nvec' must be a list of 1 to {_MAX_DECLARED_PARTS} ints >= 1, "
                                f"got {show(nvec)}")
        return {"type": kind, "nvec": [int(n) for n in nvec]}
    shape = space["shape"]
    if not (type(shape) is list and len(shape) == 1 and is_int(shape[0]) and 1 <= shape[0] <= _MAX_DECLARED_PARTS):
        raise ProtocolError(f"{where}: a Box's 'shape' must be [d], 1 <= d <= {_MAX_DECLARED_PARTS}, got {show(shape)}")
    bounds = {}
    for key in ("low", "high"):
        values = space[key]
        if not (type(values) is list and len(values) == shape[0]
                and all(_finite(v) for v in values)):
            raise ProtocolError(f"{where}: a Box's {key!r} must be a list of {shape[0]} finite numbers, "
                                f"got {show(values)}")
        bounds[key] = [float(v) for v in values]
    if not all(lo < hi for lo, hi in zip(bounds["low"], bounds["high"])):
        raise ProtocolError(f"{where}: a Box's 'low' must be below its 'high' in every component")
    return {"type": kind, "shape": [int(shape[0])], **bounds}


def _finite(v) -> bool:
    return (type(v) is float and math.isfinite(v)) or (is_int(v) and abs(v) < 1 << 53)


def _declared_int(space: dict, key: str, minimum: int) -> int:
    value = space[key]
    if not is_int(value) or not minimum <= value < 1 << 31:
        raise ProtocolError(f"GET_CONFIG: 'action_space' {key!r} must be an int in [{minimum}, 2**31), "
                            f"got {show(value)}")
    return int(value)


def _chunks(episodes) -> int:
    """How many chunks ``episodes`` holds, as far as can be told before validating them."""
    if isinstance(episodes, (EpisodeBatch, MultiAgentBatch)):
        return episodes.num_chunks
    if isinstance(episodes, (list, tuple)):
        return len(episodes)
    modules = episodes.values() if isinstance(episodes, MultiColumns) else [episodes]
    return sum(len(cols["lengths"]) for cols in modules
               if isinstance(cols, dict) and isinstance(cols.get("lengths"), np.ndarray) and cols["lengths"].ndim)


def _reply(msg: dict, t: MessageType) -> dict:
    out = dict(msg)  # servers may add fields: keep them
    out["type"] = t.value
    if t is _T.SET_CONFIG:
        require(msg, "env_steps_per_sample", t.value)
        out["env_steps_per_sample"] = count(msg, "env_steps_per_sample", t.value, minimum=1)
        if not is_bool(require(msg, "force_on_policy", t.value)):
            raise ProtocolError(f"SET_CONFIG: 'force_on_policy' must be true or false, "
                                f"got {show(msg['force_on_policy'])}")
        out["force_on_policy"] = bool(msg["force_on_policy"])
    elif t is _T.PONG and "inference" in msg:
        out["inference"] = inference_mode(msg, "PONG")
    elif t is _T.ACTIONS:
        out = actions_reply(out)
    elif t is _T.SET_STATE:
        if "policies" in msg:   # multi-agent: one model per policy
            out["policies"] = _policies(msg["policies"])
        elif not isinstance(require(msg, "onnx_file", t.value), (str, bytes)):
            raise ProtocolError(f"SET_STATE: 'onnx_file' must be a string (or bytes), "
                                f"got {type(msg['onnx_file']).__name__}")
        require(msg, "weights_seq_no", t.value)
        out["weights_seq_no"] = count(msg, "weights_seq_no", t.value)
        if "env_steps_per_sample" in msg:   # the server shares its batch anew (optional)
            out["env_steps_per_sample"] = count(msg, "env_steps_per_sample", t.value, minimum=1)
    return out


def _policies(policies) -> dict:
    """SET_STATE's ``policies``: module_id -> {onnx_file, weights_seq_no[, frozen]}."""
    if not isinstance(policies, dict) or not policies:
        raise ProtocolError("SET_STATE: 'policies' must be a non-empty object of module_id -> model")
    out = {}
    for module, entry in policies.items():
        where = f"SET_STATE policy {module_id(module, 'SET_STATE')!r}"
        if not isinstance(entry, dict):
            raise ProtocolError(f"{where}: must be an object, got {type(entry).__name__}")
        if not isinstance(require(entry, "onnx_file", where), (str, bytes)):
            raise ProtocolError(f"{where}: 'onnx_file' must be a string (or bytes)")
        require(entry, "weights_seq_no", where)
        out[module] = {**entry, "weights_seq_no": count(entry, "weights_seq_no", where)}
        if "frozen" in entry and not is_bool(entry["frozen"]):
            raise ProtocolError(f"{where}: 'frozen' must be true or false")
    return out


def validate(msg: dict, role: str | None = None, limits: MessageLimits | None = None) -> dict:
    """A normalized copy of `msg`; role "request", "reply" or None (either); ``limits``
    bound a request's episodes."""
    if role not in ("request", "reply", None):
        raise ValueError(f"role must be 'request', 'reply' or None, not {role!r}")
    if not isinstance(msg, dict):
        raise ProtocolError(f"a message must be an object, got {type(msg).__name__}")
    if "type" not in msg:
        raise ProtocolError("message has no 'type'")
    t = msg["type"]
    if not isinstance(t, str) or t not in MessageType.__members__:
        raise ProtocolError(f"unknown message type {show(t)}")
    t = MessageType(t)
    if t in REQUEST_TYPES:
        if role == "reply":
            raise ProtocolError(f"{t.value!r} is a request type, not a reply")
        return _request(msg, t, limits)
    if role == "request":
        raise ProtocolError(f"{t.value!r} is a reply type, not a request")
    return _reply(msg, t)
