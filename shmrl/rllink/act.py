"""Server-side inference on the wire (docs/RLLINK.md, "Server-side inference"): ACT, the
request of a client that runs no policy (the observations of its K envs and the outcome of
their last step), and ACTIONS, the server's reply (K actions and the policy version that
chose them). Validated here field by field, in both codecs, into numpy arrays; what needs
the connection's history (K fixed, rewards on every ACT but the first) is the server's to
check (``shmrl.server.inference.single_agent``).

This module knows nothing of sockets, shared memory or torch.
"""
from __future__ import annotations

import struct
from math import isfinite as _isfinite

import numpy as np

from shmrl.core.episode import obs_rows
from shmrl.rllink.codec import MAGIC as _MAGIC, ProtocolError, show, encode_binary, frame
from shmrl.rllink.act_multi_agent import MAX_ACT_ROWS, multiagent_act, multiagent_actions
from shmrl.rllink.fields import array, count, is_bool, obs_value, require

MAX_ACT_ENVS = 4096    # envs (slots) in one ACT: a bound on one request's work and memory
ACT_FIELDS = frozenset({"type", "obs", "rewards", "terminateds", "truncateds", "final_obs"})
OUTCOME = ("rewards", "terminateds", "truncateds")   # the last step's outcome: all of them, or none
INFERENCE_MODES = ("server", "client")                # PING's and PONG's "inference"


def act_request(msg: dict) -> dict:
    """A validated ACT: ``obs`` (an array [K, ...] or a dict of them by leaf), and, unless
    it is a connection's first, ``rewards`` (float32 [K]), ``terminateds`` and
    ``truncateds`` (bool [K]) and ``final_obs`` (as ``obs``; required when an env was
    truncated). A multi-agent ACT (``envs``) is ``rllink_act_ma``'s."""
    if "envs" in msg:
        return _multiagent_act(msg)
    for key in msg:
        if key not in ACT_FIELDS:
            raise ProtocolError(f"ACT: unexpected field {show(key)}")
    with np.errstate(all="ignore"):   # float32 casts that overflow are reported as non-finite
        return _act(msg)


def _multiagent_act(msg: dict) -> dict:
    extra = sorted(set(msg) - {"type", "envs"}, key=str)
    if extra:
        raise ProtocolError(f"ACT: unexpected field {show(extra[0])} beside 'envs' (a multi-agent ACT)")
    return multiagent_act(msg)


def _act(msg: dict) -> dict:
    obs = obs_value(require(msg, "obs", "ACT"), "ACT")
    k = obs_rows(obs)
    if not 1 <= k <= MAX_ACT_ENVS:
        raise ProtocolError(f"ACT: 'obs' holds {k} observations; one ACT carries 1 to {MAX_ACT_ENVS} envs")
    out = {"type": "ACT", "obs": obs}
    given = [key for key in OUTCOME if key in msg]
    if given and len(given) < len(OUTCOME):
        missing = [key for key in OUTCOME if key not in msg]
        raise ProtocolError(f"ACT: {given} without {missing}: the outcome of a step is all three or none")
    if not given:
        if "final_obs" in msg:
            raise ProtocolError("ACT: 'final_obs' without the outcome of a step ('rewards', ...)")
        return out
    rewards = array(msg, "rewards", "ACT")
    if rewards.shape != (k,):
        raise ProtocolError(f"ACT: 'rewards' has shape {rewards.shape}, expected ({k},): one per env of 'obs'")
    out["rewards"] = rewards
    out["terminateds"] = _bools(msg, "terminateds", k)
    out["truncateds"] = _bools(msg, "truncateds", k)
    if "final_obs" in msg:
        final = obs_value(msg["final_obs"], "ACT final_obs")
        if obs_rows(final) != k or _shapes(final) != _shapes(obs):
            raise ProtocolError(f"ACT: 'final_obs' must have the form of 'obs' ({k} observations of "
                                f"{_shapes(obs)}), got {obs_rows(final)} of {_shapes(final)}")
        out["final_obs"] = final
    elif out["truncateds"].any():
        raise ProtocolError("ACT: an env was truncated but 'final_obs' is missing (the learner bootstraps from it)")
    return out


def _shapes(obs):
    """What 'obs' and 'final_obs' must share: the leaves and their shapes (not the dtype: a
    JSON row of whole numbers reads as integers beside a row of floats)."""
    return sorted((k, v.shape[1:]) for k, v in obs.items()) if isinstance(obs, dict) else obs.shape[1:]


def _bools(msg: dict, key: str, k: int) -> np.ndarray:
    value = require(msg, key, "ACT")
    if isinstance(value, np.ndarray):   # binary: a |b1 array
        if value.dtype == bool and value.shape == (k,):
            return value
    elif type(value) is list and len(value) == k and all(is_bool(v) for v in value):
        return np.array(value, bool)
    raise ProtocolError(f"ACT: {key!r} must be {k} booleans (one per env of 'obs'), got {show(value)}")


def actions_reply(msg: dict) -> dict:
    """A validated ACTIONS: ``actions`` as an array (int64 for integers, float32 for Box
    samples), one row per env of the ACT it answers; ``weights_seq_no``."""
    out = dict(msg)   # servers may add fields: keep them
    actions = require(msg, "actions", "ACTIONS")
    if isinstance(actions, list) and actions and isinstance(actions[0], dict):   # many agents: per env
        return multiagent_actions(msg)
    if not isinstance(actions, (list, np.ndarray)):
        raise ProtocolError(f"ACTIONS: 'actions' must be a list, got {type(actions).__name__}")
    with np.errstate(all="ignore"):
        arr = array(msg, "actions", "ACTIONS", actions=True)
    if arr.ndim not in (1, 2) or not 1 <= len(arr) <= MAX_ACT_ENVS:
        raise ProtocolError(f"ACTIONS: 'actions' has shape {arr.shape}: 1 to {MAX_ACT_ENVS} rows of a number "
                            f"or a list of numbers")
    out["actions"] = arr
    require(msg, "weights_seq_no", "ACTIONS")
    out["weights_seq_no"] = count(msg, "weights_seq_no", "ACTIONS")
    return out


_ARRAY_FIELDS = ("obs", "final_obs", "rewards", "terminateds", "truncateds")


def binary_act_arrays(msg: dict) -> None:
    """A binary single-agent ACT (``msg`` as decoded, before validation) carries each of its
    fields as an array (an observation: an array, or an object of them by leaf): a JSON
    value in its head where an array goes is refused, not read as the JSON form."""
    for key in _ARRAY_FIELDS:
        value = msg.get(key)
        if key not in msg or type(value) is np.ndarray or (
                key in ("obs", "final_obs") and type(value) is dict and value
                and all(type(leaf) is np.ndarray for leaf in value.values())):
            continue
        raise ProtocolError(f"ACT: a binary ACT's {key!r} is an array ({{\"__nd__\": ...}} in the head; a Dict "
                            f"observation: an object of them by leaf), not the JSON value {show(value)}")


def act_body_bytes(obs_bytes: int, leaves: list[tuple[str, int]], agent_ids: list[str] | None = None
                   ) -> tuple[int, int]:
    """Upper bounds on the body of an ACT within this module's limits, (binary, JSON), for
    observations of ``obs_bytes`` (all their leaves, ``leaves``: (name, ndim) each): the
    largest ACT a server need read. ``agent_ids``: a multi-agent
    env's agents (``multiagent_act``'s form: at most ``MAX_ACT_ROWS`` observations, each in
    arrays of its own keyed by its agent's id, and every env's rewards and flags for every
    agent). JSON writes a number in up to 8 times its bytes, as for EPISODES."""
    names = sum(len(name) + 8 for name, _ in leaves)                     # a row's leaf keys in JSON
    descriptors = sum(len(name) + 96 + 12 * ndim for name, ndim in leaves)   # one array's {"__nd__": ...} each
    if agent_ids is None:   # K envs: obs and final_obs [K, ...], rewards and flags [K]
        data = MAX_ACT_ENVS * (2 * obs_bytes + 6)
        return (1024 + 2 * descriptors + data + 8 * (2 * len(leaves) + 3),
                1024 + MAX_ACT_ENVS * 2 * names + 8 * data)
    ids = max(map(len, agent_ids), default=0) + 8        # an agent's id as a key, quoted
    per_env = 128 + len(agent_ids) * 3 * (ids + 32)      # its object and fields: a reward and two flags per agent
    text = 1024 + MAX_ACT_ROWS * per_env                 # as many envs as observations, at most
    return (text + MAX_ACT_ROWS * (ids + obs_bytes + descriptors + 8 * len(leaves)),
            text + MAX_ACT_ROWS * (ids + 8 * obs_bytes + names))


def inference_mode(msg: dict, where: str) -> str:
    """A PING's or PONG's ``inference``: "server" or "client" (the default)."""
    mode = msg.get("inference", "client")
    if mode not in INFERENCE_MODES:
        raise ProtocolError(f"{where}: 'inference' must be one of {list(INFERENCE_MODES)}, got {show(mode)}")
    return mode


# ---------------------------------------------------------------- the hot path
# A server-inference client sends an ACT per env step, and from one client (from every
# client of one env and K) the binary head is the same bytes every time: only the arrays'
# values change. ``ActHeads`` decodes such an ACT from a head it has already seen pass
# ``act_request`` without parsing the head again: the arrays are views at the offsets the
# head gave, and only what depends on their values is checked (finite floats, booleans
# that are 0 or 1, final_obs where an env was truncated). A message that fails any of
# these, or has a head not seen, goes the whole way (``rllink.decode_request``), which
# gives its error, so the fast path never accepts what the slow one refuses.

_FAST_DTYPES = {"<f4": np.dtype("<f4"), "|u1": np.dtype("|u1"), "<i8": np.dtype("<i8"), "|b1": np.dtype("|b1")}
_OBS_DTYPES = ("<f4", "|u1", "<i8")   # the dtypes that act_request passes through unchanged
_FIELD_DTYPES = {"obs": _OBS_DTYPES, "final_obs": _OBS_DTYPES, "rewards": ("<f4",), "terminateds": ("|b1",),
                 "truncateds": ("|b1",)}
_SMALL_FLOATS = 64                     # up to this many, math.isfinite beats numpy's call overhead


class ActHeads:
    """The binary ACT heads already validated, each with its plan: where each array lies in
    the body. ``decode(body)``: the validated ACT, or None when the body is not a binary
    ACT with a known head (decode it whole, then ``learn``); calling it does both, with
    ``whole`` (``rllink.decode_request``). At most ``MAX_HEADS`` heads of at most
    ``MAX_HEAD_BYTES`` are kept (then forgotten all at once): a client that sends ever new
    heads costs a second parse of each, and no memory."""

    MAX_HEADS = 1024
    MAX_HEAD_BYTES = 4096

    def __init__(self, whole=None):
        self.whole = whole
        self._plans: dict[tuple[bytes, int], tuple | None] = {}   # (head, body length) -> plan; None: never fast
        self.fast = 0   # ACTs decoded by the fast path

    def __call__(self, body: bytes) -> dict:
        msg = self.decode(body)
        if msg is None:
            msg = self.whole(body)
            self.learn(body, msg)
        return msg

    def decode(self, body: bytes) -> dict | None:
        head_len = int.from_bytes(body[4:8], "little")
        if body[:4] != _MAGIC or head_len > self.MAX_HEAD_BYTES:   # (an EPISODES' head: no copy of it)
            return None
        plan = self._plans.get((body[8:8 + head_len], len(body)))
        if plan is None:
            return None
        out = {"type": "ACT"}
        for key, leaves in plan:
            if type(leaves) is dict:
                value = {}
                for name, leaf in leaves.items():
                    value[name] = _view(body, *leaf)
                    if value[name] is None:
                        return None
            else:
                value = _view(body, *leaves)
                if value is None:
                    return None
            out[key] = value
        if "truncateds" in out and "final_obs" not in out and b"\x01" in out["truncateds"].tobytes():
            return None   # a truncated env without final_obs: act_request says what is wrong
        self.fast += 1
        return out

    def learn(self, body: bytes, msg: dict) -> None:
        """``msg`` is ``body`` decoded and validated the whole way: remember its head's plan."""
        head_len = int.from_bytes(body[4:8], "little")
        if msg.get("type") != "ACT" or body[:4] != _MAGIC or head_len > self.MAX_HEAD_BYTES:
            return
        key = (body[8:8 + head_len], len(body))
        if key not in self._plans:
            if len(self._plans) >= self.MAX_HEADS:
                self._plans.clear()
            self._plans[key] = _plan(key[0], -(-(8 + head_len) // 8) * 8)


def _view(body: bytes, dtype: np.dtype, shape: tuple, start: int, end: int, check):
    """The array at body[start:end], or None if its values need the slow path's verdict.
    ``check``: a ``struct.Struct`` of its floats (few of them), "finite" (many), "bool"."""
    if check is not None:
        if type(check) is struct.Struct:
            if not all(map(_isfinite, check.unpack_from(body, start))):
                return None
        elif check == "bool":
            if body[start:end].translate(None, b"\x00\x01"):
                return None
        elif not np.isfinite(np.frombuffer(body, dtype, (end - start) // 4, start)).all():
            return None
    return np.ndarray(shape, dtype, body, start)


def _plan(head: bytes, data_start: int) -> tuple | None:
    """Each field of a validated ACT's head: (key, leaf) or (key, {name: leaf}), a leaf
    being (dtype, shape, start, end, check) in the body; None if the head has a field or
    dtype that act_request converts (a float64 obs, say): those always go the whole way."""
    import json

    fields = json.loads(head)
    if set(fields) - {"type", *_FIELD_DTYPES}:   # another form of ACT (many agents' "envs", say)
        return None
    plan = []
    for key in ("obs", "rewards", "terminateds", "truncateds", "final_obs"):
        if key not in fields:
            continue
        value = fields[key]
        if key in ("obs", "final_obs") and "__nd__" not in value:
            leaves = {name: _leaf(leaf, data_start, _OBS_DTYPES) for name, leaf in value.items()}
            if None in leaves.values():
                return None
        else:
            leaves = _leaf(value, data_start, _FIELD_DTYPES[key])
            if leaves is None:
                return None
        plan.append((key, leaves))
    return tuple(plan)


def _leaf(desc: dict, data_start: int, dtypes: tuple) -> tuple | None:
    dtype, shape, offset, nbytes = desc["__nd__"]
    if dtype not in dtypes:
        return None
    floats = nbytes // 4
    check = (("finite" if floats > _SMALL_FLOATS else struct.Struct(f"<{floats}f")) if dtype == "<f4" else
             "bool" if dtype == "|b1" else None)
    start = data_start + offset
    return _FAST_DTYPES[dtype], tuple(shape), start, start + nbytes, check


_ACTIONS_KEYS = ("type", "actions", "weights_seq_no")


class ActionsFrames:
    """Framed binary ACTIONS bodies, byte for byte ``frame(encode_binary(msg))``, for the
    message ``ServerInference`` sends ({"type", "actions", "weights_seq_no"}, actions an
    int64 or float32 array): everything but the actions' bytes is the same for every reply
    of one version, shape and dtype, so it is encoded once (``encode_binary`` of zeros) and
    kept. ``__call__`` returns None for any other message."""

    MAX_KEPT = 256

    def __init__(self):
        self._prefixes: dict[tuple, tuple[bytes, bytes]] = {}   # (dtype, shape, version) -> (prefix, padding)

    def __call__(self, msg: dict) -> bytes | None:
        actions, version = msg.get("actions"), msg.get("weights_seq_no")
        if (type(actions) is not np.ndarray or type(version) is not int or tuple(msg) != _ACTIONS_KEYS
                or msg["type"] != "ACTIONS" or actions.dtype.str not in ("<i8", "<f4")):
            return None
        key = (actions.dtype.str, actions.shape, version)
        kept = self._prefixes.get(key)
        if kept is None:
            if len(self._prefixes) >= self.MAX_KEPT:
                self._prefixes.clear()
            data = frame(encode_binary({"type": "ACTIONS", "actions": np.zeros(actions.shape, actions.dtype),
                                        "weights_seq_no": version}))
            pad = -actions.nbytes % 8
            kept = self._prefixes[key] = (data[:len(data) - actions.nbytes - pad], bytes(pad))
        return b"".join((kept[0], actions.tobytes(), kept[1]))
