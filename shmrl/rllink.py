"""RLlink messages: types, framing, the JSON and binary codecs, and schema validation.

See docs/RLLINK.md for the protocol. A frame is 8 ASCII digits (the body length) + body.
The JSON body is byte-identical to what RLlib 2.48 writes. The binary body carries the
same schema with numpy arrays as raw little-endian blocks, for the shared-memory rings:

    b"\\x93RLB" | u32 LE head length | UTF-8 JSON head | zero padding to 8 | data blocks

The head is the message with each ndarray replaced by {"__nd__": [dtype, shape, offset,
nbytes]} and each bytes value by {"__b__": [offset, nbytes]}; offsets count from the start
of the data section (itself 8-aligned in the body) and are multiples of 8. An
``EpisodeBatch`` (the episodes of a message, column-wise) is written as {"__cols__":
{"lengths": ..., "obs": ..., ...}}: a handful of arrays however many chunks it holds,
where the list form costs a descriptor per field per chunk. Keys "__nd__", "__b__" and
"__cols__" are therefore reserved in binary messages. JSON writes an EpisodeBatch in the
list form RLlib reads.

After validation, the ``episodes`` of a request are always an ``EpisodeBatch``, whichever
form and codec they came in.

This module knows nothing of sockets, shared memory or torch.
"""
from __future__ import annotations

import enum
import itertools
import json
import math
import reprlib

import numpy as np

# The episode fields (RLlink's, and shmrl's optional ones) are defined with the episodes.
from shmrl.episode import (ACTION_DIST_INPUTS, ACTION_LOGP, ACTIONS, AGENT_ID, EPISODE_ID, FLAG_ALIASES,
                           MODULE_ID, OBS, REWARDS, STATE_IN, STEP_FIELDS, TERMINATED, TRUNCATED, WEIGHTS_SEQ_NO,
                           EpisodeBatch, MultiAgentBatch, obs_rows)


class ProtocolError(ValueError):
    """Input that breaks the RLlink protocol; the message says what was wrong."""


HEADER_LEN = 8
MAX_BODY_LEN = 99_999_999


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


_T = MessageType
REQUEST_TYPES = frozenset({_T.PING, _T.GET_CONFIG, _T.GET_STATE, _T.EPISODES, _T.EPISODES_AND_GET_STATE,
                           _T.HEARTBEAT})
# What a PING may offer in "codecs" (shmrl's extension); the PONG names the one chosen.
CODECS = ("binary", "json")
_MAX_CODECS = 16
REPLY_TYPES = frozenset({_T.PONG, _T.SET_CONFIG, _T.SET_STATE})

_EPISODE_KEYS = frozenset({OBS, ACTIONS, REWARDS, ACTION_DIST_INPUTS, ACTION_LOGP, TERMINATED,
                           TRUNCATED, EPISODE_ID, WEIGHTS_SEQ_NO, STATE_IN, AGENT_ID, MODULE_ID, *FLAG_ALIASES})
_MAX_ID_LEN = 200      # of an agent or module id
_REQUEST_FIELDS = {
    _T.PING: frozenset({"type", "auth_token", "codecs", "client_name"}),
    _T.GET_CONFIG: frozenset({"type"}),
    _T.GET_STATE: frozenset({"type"}),
    _T.EPISODES: frozenset({"type", "episodes", "timesteps", "env_steps"}),
    _T.EPISODES_AND_GET_STATE: frozenset({"type", "episodes", "timesteps", "env_steps"}),
    _T.HEARTBEAT: frozenset({"type", "env_steps"}),
}
_INT64_MAX = np.iinfo(np.int64).max


# ---------------------------------------------------------------- framing

def frame(body) -> bytes:
    """Header + body: the bytes that go on the wire."""
    n = memoryview(body).nbytes
    if n > MAX_BODY_LEN:
        raise ValueError(f"body of {n} bytes exceeds the RLlink maximum of {MAX_BODY_LEN}")
    return b"".join((b"%08d" % n, body))


def parse_header(header, max_body_len: int = MAX_BODY_LEN) -> int:
    """The body length announced by an 8-byte header."""
    if not isinstance(header, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"frame header must be bytes, got {type(header).__name__}")
    header = bytes(header)
    # bytes.isdigit() is ASCII-only: it refuses spaces, signs and Unicode digits, unlike int().
    if len(header) != HEADER_LEN or not header.isdigit():
        raise ProtocolError(f"frame header {header[:16]!r} is not {HEADER_LEN} ASCII digits")
    n = int(header)
    if n > max_body_len:
        raise ProtocolError(f"frame of {n} bytes exceeds the maximum of {max_body_len}")
    return n


# ---------------------------------------------------------------- JSON codec

def _json_default(obj):
    # Called only for what json cannot write itself, so plain dicts cost nothing extra.
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (EpisodeBatch, MultiAgentBatch)):
        return obj.to_dicts()  # RLlib's list of episode objects
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, (bytes, bytearray, memoryview)):
        raise TypeError("bytes cannot be sent as JSON (only the binary codec carries bytes)")
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def encode_json(msg: dict) -> bytes:
    """The JSON body, with json.dumps' default separators exactly as RLlib writes it."""
    return json.dumps(msg, default=_json_default).encode("utf-8")


# ---------------------------------------------------------------- binary codec

MAGIC = b"\x93RLB"
_ALIGN = 8
_MAX_DIMS = 32
_DTYPES = {s: np.dtype(s) for s in ("<f4", "<f8", "<i8", "<i4", "|u1", "|b1")}
# (kind, itemsize) -> the allowed dtype an array is converted to at encode.
_ENCODE_AS = {("f", 2): "<f4", ("f", 4): "<f4", ("f", 8): "<f8", ("i", 1): "<i4", ("i", 2): "<i4",
              ("i", 4): "<i4", ("i", 8): "<i8", ("u", 1): "|u1", ("u", 2): "<i4", ("u", 4): "<i8",
              ("b", 1): "|b1"}
_PAD = bytes(_ALIGN)


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def encode_binary(msg: dict) -> bytes:
    """The binary body: JSON head with descriptors, then the raw array and bytes blocks."""
    blocks = []
    size = 0  # bytes in the data section so far, always a multiple of 8

    def add_block(buf, n: int) -> int:
        nonlocal size
        offset = size
        blocks.append(buf)
        if n % _ALIGN:
            blocks.append(_PAD[: -n % _ALIGN])
        size += _align(n)
        return offset

    def default(obj):
        if isinstance(obj, np.ndarray):
            dtype = _ENCODE_AS.get((obj.dtype.kind, obj.dtype.itemsize))
            if dtype is None:
                raise ValueError(f"the binary codec cannot carry arrays of dtype {obj.dtype}")
            arr = np.asarray(obj, dtype=dtype, order="C")  # no copy when already fit
            return {"__nd__": [dtype, list(arr.shape), add_block(arr, arr.nbytes), arr.nbytes]}
        if isinstance(obj, (bytes, bytearray, memoryview)):
            n = memoryview(obj).nbytes
            return {"__b__": [add_block(obj, n), n]}
        if isinstance(obj, EpisodeBatch):
            return {"__cols__": obj.columns()}
        if isinstance(obj, MultiAgentBatch):
            return {"__multi__": obj.policies}
        if isinstance(obj, np.generic):
            return obj.item()
        raise TypeError(f"{type(obj).__name__} is not serializable by the binary codec")

    head = json.dumps(msg, default=default, separators=(",", ":")).encode("utf-8")
    if len(head) >= 1 << 32:
        raise ValueError(f"binary head of {len(head)} bytes is too long")
    pad = _PAD[: _align(8 + len(head)) - 8 - len(head)]
    return b"".join((MAGIC, len(head).to_bytes(4, "little"), head, pad, *blocks))


def encode(msg: dict, codec: str) -> bytes:
    """The body of ``msg`` in ``codec`` ("binary" or "json"): the one encoder every
    transport calls."""
    if codec == "binary":
        return encode_binary(msg)
    if codec == "json":
        return encode_json(msg)
    raise ValueError(f"codec must be one of {CODECS}, not {codec!r}")


def _decode_binary(mv: memoryview) -> dict:
    n = len(mv)
    if n < 8:
        raise ProtocolError(f"binary body of {n} bytes is shorter than its 8-byte preamble")
    head_len = int.from_bytes(mv[4:8], "little")
    data_start = _align(8 + head_len)
    if data_start > n:
        raise ProtocolError(f"binary head of {head_len} bytes (data from byte {data_start}) "
                            f"overruns the {n}-byte body")
    data_len = n - data_start

    def block(what, spec, offset, nbytes):
        if type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes < 0:
            raise ProtocolError(f"{what} descriptor {_show(spec)}: offset and nbytes must be ints >= 0")
        if offset % _ALIGN:
            raise ProtocolError(f"{what} descriptor {_show(spec)}: offset {offset} is not {_ALIGN}-aligned")
        if offset + nbytes > data_len:
            raise ProtocolError(f"{what} descriptor {_show(spec)}: bytes {offset}..{offset + nbytes} "
                                f"lie outside the {data_len}-byte data section")
        return data_start + offset

    def hook(d: dict):
        if "__nd__" in d:
            spec = d["__nd__"]
            if len(d) != 1 or type(spec) is not list or len(spec) != 4:
                raise ProtocolError(f"malformed array descriptor {_show(d)}")
            dtype_str, shape, offset, nbytes = spec
            dtype = _DTYPES.get(dtype_str) if type(dtype_str) is str else None
            if dtype is None:
                raise ProtocolError(f"array descriptor: dtype {_show(dtype_str)} is not one of {sorted(_DTYPES)}")
            if (type(shape) is not list or len(shape) > _MAX_DIMS
                    or not all(type(s) is int and s >= 0 for s in shape)):
                raise ProtocolError(f"array descriptor: shape {_show(shape)} is not a list of at most "
                                    f"{_MAX_DIMS} ints >= 0")
            start = block("array", spec, offset, nbytes)
            if math.prod(shape) * dtype.itemsize != nbytes:
                raise ProtocolError(f"array descriptor {_show(spec)}: shape and dtype make "
                                    f"{math.prod(shape) * dtype.itemsize} bytes, not {nbytes}")
            arr = np.frombuffer(mv, dtype, nbytes // dtype.itemsize, start).reshape(shape)
            if dtype.kind == "b" and arr.size and arr.view(np.uint8).max() > 1:
                raise ProtocolError("bool array holds bytes other than 0 and 1")
            return arr
        if "__b__" in d:
            spec = d["__b__"]
            if len(d) != 1 or type(spec) is not list or len(spec) != 2:
                raise ProtocolError(f"malformed bytes descriptor {_show(d)}")
            start = block("bytes", spec, *spec)
            return bytes(mv[start:start + spec[1]])
        if "__cols__" in d:
            if len(d) != 1 or type(d["__cols__"]) is not dict:
                raise ProtocolError(f"malformed columnar episodes {_show(d)}")
            return _Columns(d["__cols__"])
        if "__multi__" in d:
            if len(d) != 1 or type(d["__multi__"]) is not dict:
                raise ProtocolError(f"malformed multi-agent episodes {_show(d)}")
            return _MultiColumns(d["__multi__"])
        return d

    try:
        msg = json.loads(str(mv[8:8 + head_len], "utf-8"), object_hook=hook)
    except ProtocolError:
        raise
    except Exception as e:  # invalid UTF-8 or JSON, recursion bombs, absurd shapes
        raise ProtocolError(f"binary head is not valid: {e}"[:300]) from None
    if not isinstance(msg, dict):
        raise ProtocolError(f"binary head is a JSON {type(msg).__name__}, not an object")
    return msg


class _Columns(dict):
    """The columnar episodes of a binary head, as decoded and not yet validated (a type of
    its own, so that no JSON object can pass for one)."""


class _MultiColumns(dict):
    """Multi-agent columnar episodes of a binary head: module_id -> columns, not yet validated."""


def episodes_body_bytes(steps: int, obs_bytes: int, action_size: int, dist_size: int, leaves: int = 1,
                        state_size: int = 0) -> int:
    """An upper bound on the binary body of an EPISODES message of ``steps`` env steps
    (what a request ring must take): ``obs_bytes`` per observation row (all its leaves),
    actions as int64 or float32, and as if every step began a chunk of its own (an
    observation row, flags, version, id and recurrent state more); a descriptor per
    observation leaf."""
    per_step = obs_bytes + 8 * action_size + 4 * (2 + dist_size)
    per_chunk = obs_bytes + 8 + 2 + 8 + 64 + 4 * state_size
    return 4096 + 128 * leaves + steps * (per_step + per_chunk)


def set_state_body_bytes(model_bytes: int) -> int:
    """An upper bound on the body of a SET_STATE for a model file of ``model_bytes``
    (gzip can grow incompressible data a little; base64 takes 4 bytes per 3)."""
    return 1024 + 4 * ((model_bytes + model_bytes // 1000 + 64) // 3 + 1)


# ---------------------------------------------------------------- decoding

def decode(body) -> dict:
    """A message from a JSON or binary body (raises only ProtocolError; no schema check)."""
    if isinstance(body, (bytes, bytearray)):
        mv = memoryview(body)
    elif isinstance(body, memoryview):
        try:  # a flat view of unsigned bytes, whatever shape or format it came in
            mv = body if body.format == "B" and body.ndim == 1 and body.c_contiguous else body.cast("B")
        except (TypeError, ValueError) as e:
            raise ProtocolError(f"body memoryview is unusable: {e}") from None
    else:
        raise ProtocolError(f"body must be bytes, got {type(body).__name__}")
    if not mv:
        raise ProtocolError("empty body")
    if mv[:4] == MAGIC:
        return _decode_binary(mv)
    if mv[:1] != b"{":
        raise ProtocolError(f"body starts with {bytes(mv[:8])!r}: neither a JSON object nor binary")
    try:
        msg = json.loads(str(mv, "utf-8"))
    except Exception as e:  # invalid UTF-8 or JSON, recursion bombs, huge int literals
        raise ProtocolError(f"body is not valid JSON: {e}"[:300]) from None
    if not isinstance(msg, dict):
        raise ProtocolError(f"body is a JSON {type(msg).__name__}, not an object")
    return msg


def decode_request(body) -> dict:
    return validate(decode(body), "request")


def decode_reply(body) -> dict:
    return validate(decode(body), "reply")


# ---------------------------------------------------------------- validation

_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 60


def _show(value) -> str:
    """A bounded repr: hostile input can be megabytes."""
    return _repr.repr(value)


def _is_int(x) -> bool:
    return (type(x) is int or isinstance(x, np.integer)) and not isinstance(x, bool)


def _is_bool(x) -> bool:
    return type(x) is bool or isinstance(x, np.bool_)


def _leaf_types(value, ndim: int) -> set:
    """Types of the scalars in a nested list that np.asarray made `ndim`-dimensional.

    np.asarray quietly turns bools into 0/1 and too-big ints into floats; only the Python
    types tell. map(type) and chain run in C, about 20 ns per element.
    """
    level, array_types = [value], set()
    for _ in range(ndim):
        level = list(itertools.chain.from_iterable(level))
        types = set(map(type, level))
        if np.ndarray in types:  # a list of arrays: their dtypes speak for their elements
            array_types.update(x.dtype.type for x in level if type(x) is np.ndarray)
            level = [x for x in level if type(x) is not np.ndarray]
            types.discard(np.ndarray)
    return types | array_types


def _suspect(arr: np.ndarray) -> bool:
    """Whether np.asarray may have hidden bools (as 0 or 1) or ints beyond int64 (as floats).

    A cheap vectorized filter, so that most float data skips the per-element type scan.
    """
    if ((arr == 0) | (arr == 1)).any():
        return True
    return arr.dtype.kind == "f" and bool((np.abs(arr) >= 2.0**63).any())


def _too_big_int(value) -> bool:
    stack = [value]  # no recursion: this runs on hostile input
    while stack:
        x = stack.pop()
        if isinstance(x, (list, tuple)):
            stack.extend(x)
        elif type(x) is int and not -_INT64_MAX - 1 <= x <= _INT64_MAX:
            return True
    return False


def _array(ep: dict, key: str, where: str, *, actions: bool = False, integers: bool = False) -> np.ndarray:
    """Field `key` as float32 (or int64 for integer actions; with ``integers``, integer
    values stay integers: uint8 as uint8, others as int64), one np.asarray for the lot."""
    value = ep[key]
    try:
        arr = np.asarray(value)
        kind = arr.dtype.kind
        if kind in "iuf" and arr.ndim and arr.size and not isinstance(value, np.ndarray) and _suspect(arr):
            types = _leaf_types(value, arr.ndim)
            if bool in types or np.bool_ in types:
                kind = "b"
            elif kind == "f" and types and types <= {int}:  # ints beyond int64 became floats
                kind = "O"
    except Exception:  # ragged lists, or objects numpy cannot take
        raise ProtocolError(f"{where}: {key!r} is not a regular (non-ragged) array of numbers") from None
    if kind == "b":
        raise ProtocolError(f"{where}: {key!r} holds booleans, expected numbers")
    if kind not in "iuf":
        if kind == "O" and _too_big_int(value):
            raise ProtocolError(f"{where}: {key!r} holds an integer that does not fit int64")
        raise ProtocolError(f"{where}: {key!r} is not an array of numbers (got {_kind_name(arr)})")
    if arr.ndim == 0:
        raise ProtocolError(f"{where}: {key!r} is a single value, expected a list")
    if integers and kind in "iu":   # an observation of integers (an image, a Discrete): the env decides
        if arr.dtype == np.uint8:
            return arr
        if kind == "u" and arr.size and arr.max() > _INT64_MAX:
            raise ProtocolError(f"{where}: {key!r} holds an integer that does not fit int64")
        return arr.astype(np.int64, copy=False)
    if actions and (kind in "iu" or (arr.size == 0 and not isinstance(value, np.ndarray))):
        # Discrete actions. An empty JSON list says nothing: int64 (0,) is the likelier case.
        if kind == "u" and arr.size and arr.max() > _INT64_MAX:
            raise ProtocolError(f"{where}: {key!r} holds an integer that does not fit int64")
        return arr.astype(np.int64, copy=False)
    out = arr.astype(np.float32, copy=False)
    if not np.isfinite(out).all():  # after the cast: 1e300 becomes inf in float32
        raise ProtocolError(f"{where}: non-finite value in {key!r}")
    return out


_MAX_OBS_DEPTH = 8     # nesting of a Dict observation's JSON objects
_MAX_OBS_LEAVES = 256


def _obs(value, where: str):
    """A chunk's observations: one array (rows x shape), or for a structured observation a
    dict of arrays by leaf name. The JSON form of a structured observation is a list of one
    object per step whose keys are the leaf names (nested objects flatten to dotted names:
    {"state": {"pos": [...]}} is leaf "state.pos"); the binary form, a dict of arrays."""
    if isinstance(value, dict):       # columnar (binary codec): leaf name -> array
        leaves = value
    elif isinstance(value, list) and value and isinstance(value[0], dict):
        steps = [_flatten_obs(step, where) for step in value]
        names = list(steps[0])
        for i, step in enumerate(steps):
            if list(step) != names:
                raise ProtocolError(f"{where}: obs {i} has the keys {_show(sorted(step))}, obs 0 "
                                    f"{_show(sorted(names))}")
        leaves = {name: [step[name] for step in steps] for name in names}
    else:
        return _array({OBS: value}, OBS, where, integers=True)
    if not leaves or len(leaves) > _MAX_OBS_LEAVES:
        raise ProtocolError(f"{where}: 'obs' must have 1 to {_MAX_OBS_LEAVES} leaves, got {len(leaves)}")
    out = {}
    for name, values in leaves.items():
        if not isinstance(name, str) or not name or len(name) > 200:
            raise ProtocolError(f"{where}: obs leaf name {_show(name)} is not a short string")
        out[name] = _array({OBS: values}, OBS, f"{where} obs {name!r}", integers=True)
    if len({len(v) for v in out.values()}) > 1:
        raise ProtocolError(f"{where}: the obs leaves have different numbers of rows")
    return out


def _flatten_obs(step, where: str, prefix: str = "", depth: int = 0) -> dict:
    if not isinstance(step, dict):
        raise ProtocolError(f"{where}: an observation object holds {type(step).__name__} beside objects")
    if depth > _MAX_OBS_DEPTH:
        raise ProtocolError(f"{where}: observation objects nest deeper than {_MAX_OBS_DEPTH}")
    out = {}
    for key, v in step.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(v, dict):
            out.update(_flatten_obs(v, where, name, depth + 1))
        else:
            out[name] = v
        if len(out) > _MAX_OBS_LEAVES:
            raise ProtocolError(f"{where}: an observation has more than {_MAX_OBS_LEAVES} leaves")
    return out


def _obs_form(obs):
    """What must agree between the chunks of one message: shapes and dtypes of the leaves."""
    if isinstance(obs, dict):
        return tuple(sorted((k, v.shape[1:], v.dtype.kind) for k, v in obs.items()))
    return obs.shape[1:], obs.dtype.kind


def _kind_name(arr: np.ndarray) -> str:
    return {"U": "strings", "S": "bytes", "O": "mixed or non-numeric values"}.get(arr.dtype.kind, str(arr.dtype))


def _flag(ep: dict, key: str, alias: str, where: str) -> bool:
    names = [k for k in (key, alias) if k in ep]
    if not names:
        raise ProtocolError(f"{where}: missing field {key!r} (or {alias!r})")
    for k in names:
        if not _is_bool(ep[k]):
            raise ProtocolError(f"{where}: {k!r} must be true or false, got {_show(ep[k])}")
    if len(names) == 2 and bool(ep[key]) != bool(ep[alias]):
        raise ProtocolError(f"{where}: {key!r} and its alias {alias!r} disagree")
    return bool(ep[names[0]])


def _episode(ep, i: int) -> dict:
    where = f"episode {i}"
    if not isinstance(ep, dict):
        raise ProtocolError(f"{where} is a {type(ep).__name__}, not an object")
    for key in ep:
        if key not in _EPISODE_KEYS:
            raise ProtocolError(f"{where}: unexpected field {_show(key)}")
    for key in (OBS, ACTIONS, REWARDS, ACTION_DIST_INPUTS, ACTION_LOGP):
        if key not in ep:
            raise ProtocolError(f"{where}: missing field {key!r}")
    actions = _array(ep, ACTIONS, where, actions=True)
    n = len(actions)
    out = {OBS: _obs(ep[OBS], where), ACTIONS: actions}
    if obs_rows(out[OBS]) != n + 1:
        raise ProtocolError(f"{where}: 'obs' has {obs_rows(out[OBS])} entries, expected len(actions)+1 = {n + 1}")
    for key in (REWARDS, ACTION_DIST_INPUTS, ACTION_LOGP):
        out[key] = arr = _array(ep, key, where)
        if len(arr) != n:
            raise ProtocolError(f"{where}: {key!r} has {len(arr)} entries, expected len(actions) = {n}")
        if key != ACTION_DIST_INPUTS and arr.ndim != 1:
            raise ProtocolError(f"{where}: {key!r} has shape {arr.shape}, expected ({n},)")
    for alias, key in FLAG_ALIASES.items():
        out[key] = _flag(ep, key, alias, where)
    if EPISODE_ID in ep:
        eid = ep[EPISODE_ID]
        if not (isinstance(eid, str) or _is_int(eid)):
            raise ProtocolError(f"{where}: 'episode_id' must be a string or an int, got {_show(eid)}")
        out[EPISODE_ID] = eid if isinstance(eid, str) else int(eid)
    if WEIGHTS_SEQ_NO in ep:
        # Beyond int64: from the future all the same, which the Hub refuses per chunk.
        out[WEIGHTS_SEQ_NO] = min(_count(ep, WEIGHTS_SEQ_NO, where), 2**63 - 1)
    if STATE_IN in ep:
        out[STATE_IN] = state = _array(ep, STATE_IN, where)
        if state.ndim != 1:
            raise ProtocolError(f"{where}: 'state_in' has shape {state.shape}, expected one list of numbers")
    if (AGENT_ID in ep) != (MODULE_ID in ep):
        raise ProtocolError(f"{where}: a multi-agent chunk has both 'agent_id' and 'module_id'")
    if AGENT_ID in ep:
        out[AGENT_ID] = _agent_id(ep[AGENT_ID], where)
        out[MODULE_ID] = _module_id(ep[MODULE_ID], where)
    return out


def _agent_id(value, where: str):
    """An agent id: a short string or an int (PettingZoo's are strings)."""
    if not ((isinstance(value, str) and 0 < len(value) <= _MAX_ID_LEN) or _is_int(value)):
        raise ProtocolError(f"{where}: 'agent_id' must be a short string or an int, got {_show(value)}")
    return value if isinstance(value, str) else int(value)


def _module_id(value, where: str) -> str:
    if not (isinstance(value, str) and 0 < len(value) <= _MAX_ID_LEN):
        raise ProtocolError(f"{where}: 'module_id' must be a short string, got {_show(value)}")
    return value


def _multi_batch(episodes: list[dict], where: str) -> EpisodeBatch | MultiAgentBatch:
    """Validated episode dicts as one EpisodeBatch, or, when they carry module ids (all of
    them must), a MultiAgentBatch of one EpisodeBatch per module."""
    multi = [MODULE_ID in ep for ep in episodes]
    if not any(multi):
        return _batch(episodes, where)
    if not all(multi):
        raise ProtocolError(f"{where}: episode {multi.index(False)} has no 'module_id' but others do: "
                            f"a message is single-agent or multi-agent")
    groups: dict[str, list] = {}
    for ep in episodes:
        groups.setdefault(ep.pop(MODULE_ID), []).append(ep)
    return MultiAgentBatch({module: _batch(eps, f"{where} module {module!r}") for module, eps in groups.items()})


def _batch(episodes: list[dict], where: str) -> EpisodeBatch:
    """Validated episode dicts in one EpisodeBatch: they must agree in the shapes and types
    of their rows (the episodes of one message come from one environment)."""
    if not episodes:
        return EpisodeBatch.from_episodes([])
    first = episodes[0]
    stepped = [ep for ep in episodes if len(ep[ACTIONS])]
    for i, ep in enumerate(episodes):
        if _obs_form(ep[OBS]) != _obs_form(first[OBS]):
            raise ProtocolError(f"{where}: episode {i} has observations of shape {_obs_form(ep[OBS])}, "
                                f"episode 0 of {_obs_form(first[OBS])}: one message, one environment")
    sizes = {len(ep[STATE_IN]) for ep in episodes if STATE_IN in ep}
    if len(sizes) > 1:
        raise ProtocolError(f"{where}: the episodes' 'state_in' differ in size ({sorted(sizes)})")
    for ep in stepped[1:]:
        for key in (ACTIONS, ACTION_DIST_INPUTS):
            a, b = ep[key], stepped[0][key]
            if a.shape[1:] != b.shape[1:] or a.dtype != b.dtype:
                raise ProtocolError(f"{where}: the episodes disagree in {key!r} ({a.dtype} {a.shape[1:]} "
                                    f"and {b.dtype} {b.shape[1:]}): one message, one environment")
    return EpisodeBatch.from_episodes(episodes)


_COLUMN_KEYS = frozenset({"lengths", OBS, *STEP_FIELDS, TERMINATED, TRUNCATED, EPISODE_ID, WEIGHTS_SEQ_NO,
                          STATE_IN, AGENT_ID})
_REQUIRED_COLUMNS = ("lengths", OBS, *STEP_FIELDS, TERMINATED, TRUNCATED)


def _columns(cols: dict, where: str, multi: bool = False) -> EpisodeBatch:
    """Columnar episodes (the binary codec's form) checked as thoroughly as the list form."""
    where = f"{where} episodes"
    for key in cols:
        if key not in _COLUMN_KEYS:
            raise ProtocolError(f"{where}: unexpected field {_show(key)}")
    for key in _REQUIRED_COLUMNS:
        if key not in cols:
            raise ProtocolError(f"{where}: missing field {key!r}")
    actions = _array(cols, ACTIONS, where, actions=True)
    lengths = cols["lengths"]
    if not (isinstance(lengths, np.ndarray) and lengths.dtype.kind in "iu" and lengths.ndim == 1):
        raise ProtocolError(f"{where}: 'lengths' must be a 1-D array of integers")
    if lengths.size and (lengths.min() < 0 or lengths.max() > len(actions)):  # also: no overflow below
        raise ProtocolError(f"{where}: 'lengths' must lie between 0 and the number of actions")
    n, total = len(lengths), int(lengths.sum())
    if len(actions) != total:
        raise ProtocolError(f"{where}: {len(actions)} actions, but 'lengths' add up to {total}")
    obs = _obs(cols[OBS], where)
    if obs_rows(obs) != total + n:
        raise ProtocolError(f"{where}: 'obs' has {obs_rows(obs)} rows, expected one more per chunk than "
                            f"its steps: {total + n}")
    rows = {}
    for key in (REWARDS, ACTION_DIST_INPUTS, ACTION_LOGP):
        rows[key] = arr = _array(cols, key, where)
        if len(arr) != total or (key != ACTION_DIST_INPUTS and arr.ndim != 1):
            raise ProtocolError(f"{where}: {key!r} has shape {arr.shape}, expected {total} rows"
                                + ("" if key == ACTION_DIST_INPUTS else " of one value"))
    flags = {}
    for key in (TERMINATED, TRUNCATED):
        flags[key] = value = cols[key]
        if not (isinstance(value, np.ndarray) and value.dtype == bool and value.shape == (n,)):
            raise ProtocolError(f"{where}: {key!r} must be an array of {n} booleans")
    seq = cols.get(WEIGHTS_SEQ_NO)
    if seq is not None and not (isinstance(seq, np.ndarray) and seq.dtype.kind in "iu" and seq.shape == (n,)
                                and (not n or seq.min() >= -1)):
        raise ProtocolError(f"{where}: 'weights_seq_no' must be an array of {n} ints >= -1 (-1: unknown)")
    ids = cols.get(EPISODE_ID)
    if ids is not None and not (type(ids) is list and len(ids) == n and all(
            i is None or isinstance(i, str) or _is_int(i) for i in ids)):
        raise ProtocolError(f"{where}: 'episode_id' must be a list of {n} strings, ints or nulls")
    state = None
    if STATE_IN in cols:
        state = _array(cols, STATE_IN, where) if n else np.zeros((0, 0), np.float32)
        if state.ndim != 2 or len(state) != n:
            raise ProtocolError(f"{where}: 'state_in' has shape {state.shape}, expected {n} rows of numbers")
    agents = cols.get(AGENT_ID)
    if agents is not None:
        if not (type(agents) is list and len(agents) == n):
            raise ProtocolError(f"{where}: 'agent_id' must be a list of {n} agent ids")
        agents = [_agent_id(a, where) for a in agents]
    if multi != (agents is not None):
        raise ProtocolError(f"{where}: 'agent_id' is a column of multi-agent episodes, and only of them")
    return EpisodeBatch(obs=obs, actions=actions, lengths=lengths, **rows, is_terminated=flags[TERMINATED],
                        is_truncated=flags[TRUNCATED], weights_seq_no=seq, episode_ids=ids, state_in=state,
                        agent_ids=agents)


def _count(msg: dict, key: str, where: str, minimum: int = 0) -> int:
    value = msg[key]
    if not _is_int(value) or value < minimum:
        raise ProtocolError(f"{where}: {key!r} must be an int >= {minimum}, got {_show(value)}")
    return int(value)


def _require(msg: dict, key: str, where: str):
    if key not in msg:
        raise ProtocolError(f"{where}: missing field {key!r}")
    return msg[key]


def _request(msg: dict, t: MessageType) -> dict:
    for key in msg:
        if key not in _REQUEST_FIELDS[t]:
            raise ProtocolError(f"{t.value}: unexpected field {_show(key)}")
    out = {"type": t.value}
    if t is _T.PING and "auth_token" in msg:
        if not isinstance(msg["auth_token"], str):
            raise ProtocolError(f"PING: 'auth_token' must be a string, got {type(msg['auth_token']).__name__}")
        out["auth_token"] = msg["auth_token"]
    if t is _T.PING and "codecs" in msg:
        codecs = msg["codecs"]
        if (type(codecs) is not list or len(codecs) > _MAX_CODECS
                or not all(isinstance(c, str) and len(c) <= 32 for c in codecs)):
            raise ProtocolError(f"PING: 'codecs' must be a list of at most {_MAX_CODECS} short strings, "
                                f"got {_show(codecs)}")
        out["codecs"] = codecs  # unknown ones are not an error: the server picks one it knows
    if t is _T.PING and "client_name" in msg:
        name = msg["client_name"]
        if not (isinstance(name, str) and 0 < len(name) <= 64 and name.isprintable()):
            raise ProtocolError(f"PING: 'client_name' must be a printable string of 1 to 64 characters, "
                                f"got {_show(name)}")
        out["client_name"] = name
    if t is _T.HEARTBEAT:
        out["env_steps"] = _count(msg, "env_steps", t.value) if "env_steps" in msg else None
        return out
    if t not in (_T.EPISODES, _T.EPISODES_AND_GET_STATE):
        return out
    episodes = _require(msg, "episodes", t.value)
    counts = {k: _count(msg, k, t.value) for k in ("timesteps", "env_steps") if k in msg}
    if len(set(counts.values())) > 1:
        raise ProtocolError(f"{t.value}: 'timesteps' = {counts['timesteps']} and 'env_steps' = "
                            f"{counts['env_steps']} disagree")
    with np.errstate(all="ignore"):  # overflow in float32 casts is reported as non-finite
        if isinstance(episodes, (_Columns, EpisodeBatch)):
            batch = _columns(episodes if isinstance(episodes, _Columns) else episodes.columns(), t.value)
        elif isinstance(episodes, (_MultiColumns, MultiAgentBatch)):
            modules = episodes if isinstance(episodes, _MultiColumns) else episodes.policies
            batch = MultiAgentBatch({})
            for module, cols in modules.items():
                where = f"{t.value} module {_module_id(module, t.value)!r}"
                if isinstance(cols, EpisodeBatch):
                    cols = cols.columns()
                elif not isinstance(cols, _Columns):
                    raise ProtocolError(f"{where}: episodes must be columns, got {type(cols).__name__}")
                batch.policies[module] = _columns(cols, where, multi=True)
        elif isinstance(episodes, (list, tuple)):
            batch = _multi_batch([_episode(ep, i) for i, ep in enumerate(episodes)], t.value)
        else:
            raise ProtocolError(f"{t.value}: 'episodes' must be a list, got {type(episodes).__name__}")
    out["episodes"] = batch
    steps = batch.num_steps
    for key, count in counts.items():
        if count != steps:
            raise ProtocolError(f"{t.value}: {key!r} = {count} but the episodes hold {steps} steps "
                                f"(lengths that disagree)")
    out["timesteps"] = steps
    return out


def _reply(msg: dict, t: MessageType) -> dict:
    out = dict(msg)  # servers may add fields: keep them
    out["type"] = t.value
    if t is _T.SET_CONFIG:
        _require(msg, "env_steps_per_sample", t.value)
        out["env_steps_per_sample"] = _count(msg, "env_steps_per_sample", t.value, minimum=1)
        if not _is_bool(_require(msg, "force_on_policy", t.value)):
            raise ProtocolError(f"SET_CONFIG: 'force_on_policy' must be true or false, "
                                f"got {_show(msg['force_on_policy'])}")
        out["force_on_policy"] = bool(msg["force_on_policy"])
    elif t is _T.SET_STATE:
        if "policies" in msg:   # multi-agent: one model per policy
            out["policies"] = _policies(msg["policies"])
        elif not isinstance(_require(msg, "onnx_file", t.value), (str, bytes)):
            raise ProtocolError(f"SET_STATE: 'onnx_file' must be a string (or bytes), "
                                f"got {type(msg['onnx_file']).__name__}")
        _require(msg, "weights_seq_no", t.value)
        out["weights_seq_no"] = _count(msg, "weights_seq_no", t.value)
    return out


def _policies(policies) -> dict:
    """SET_STATE's ``policies``: module_id -> {onnx_file, weights_seq_no[, frozen]}."""
    if not isinstance(policies, dict) or not policies:
        raise ProtocolError("SET_STATE: 'policies' must be a non-empty object of module_id -> model")
    out = {}
    for module, entry in policies.items():
        where = f"SET_STATE policy {_module_id(module, 'SET_STATE')!r}"
        if not isinstance(entry, dict):
            raise ProtocolError(f"{where}: must be an object, got {type(entry).__name__}")
        if not isinstance(_require(entry, "onnx_file", where), (str, bytes)):
            raise ProtocolError(f"{where}: 'onnx_file' must be a string (or bytes)")
        _require(entry, "weights_seq_no", where)
        out[module] = {**entry, "weights_seq_no": _count(entry, "weights_seq_no", where)}
        if "frozen" in entry and not _is_bool(entry["frozen"]):
            raise ProtocolError(f"{where}: 'frozen' must be true or false")
    return out


def validate(msg: dict, role: str | None = None) -> dict:
    """A normalized copy of `msg`; role "request", "reply" or None (either)."""
    if role not in ("request", "reply", None):
        raise ValueError(f"role must be 'request', 'reply' or None, not {role!r}")
    if not isinstance(msg, dict):
        raise ProtocolError(f"a message must be an object, got {type(msg).__name__}")
    if "type" not in msg:
        raise ProtocolError("message has no 'type'")
    t = msg["type"]
    if not isinstance(t, str) or t not in MessageType.__members__:
        raise ProtocolError(f"unknown message type {_show(t)}")
    t = MessageType(t)
    if t in REQUEST_TYPES:
        if role == "reply":
            raise ProtocolError(f"{t.value!r} is a request type, not a reply")
        return _request(msg, t)
    if role == "request":
        raise ProtocolError(f"{t.value!r} is a reply type, not a request")
    return _reply(msg, t)
