"""The field checks every RLlink message shares, named once: ints, bools, ids, counts,
required fields, arrays and observations as a client sends them. Hostile input raises
``ProtocolError`` with what was wrong, never anything else."""
from __future__ import annotations

import itertools

import numpy as np

from shmrl.core.episode import OBS
from shmrl.rllink.codec import ProtocolError, show

MAX_ID_LEN = 200      # of an agent or module id


_INT64_MAX = np.iinfo(np.int64).max


def is_int(x) -> bool:
    return (type(x) is int or isinstance(x, np.integer)) and not isinstance(x, bool)


def is_bool(x) -> bool:
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


def array(ep: dict, key: str, where: str, *, actions: bool = False, integers: bool = False) -> np.ndarray:
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


def obs_value(value, where: str):
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
                raise ProtocolError(f"{where}: obs {i} has the keys {show(sorted(step))}, obs 0 "
                                    f"{show(sorted(names))}")
        leaves = {name: [step[name] for step in steps] for name in names}
    else:
        return array({OBS: value}, OBS, where, integers=True)
    if not leaves or len(leaves) > _MAX_OBS_LEAVES:
        raise ProtocolError(f"{where}: 'obs' must have 1 to {_MAX_OBS_LEAVES} leaves, got {len(leaves)}")
    out = {}
    for name, values in leaves.items():
        if not isinstance(name, str) or not name or len(name) > 200:
            raise ProtocolError(f"{where}: obs leaf name {show(name)} is not a short string")
        out[name] = array({OBS: values}, OBS, f"{where} obs {name!r}", integers=True)
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


def _kind_name(arr: np.ndarray) -> str:
    return {"U": "strings", "S": "bytes", "O": "mixed or non-numeric values"}.get(arr.dtype.kind, str(arr.dtype))


def agent_id(value, where: str):
    """An agent id: a short string or an int (PettingZoo's are strings)."""
    if not ((isinstance(value, str) and 0 < len(value) <= MAX_ID_LEN) or is_int(value)):
        raise ProtocolError(f"{where}: 'agent_id' must be a short string or an int, got {show(value)}")
    return value if isinstance(value, str) else int(value)


def module_id(value, where: str) -> str:
    if not (isinstance(value, str) and 0 < len(value) <= MAX_ID_LEN):
        raise ProtocolError(f"{where}: 'module_id' must be a short string, got {show(value)}")
    return value


def count(msg: dict, key: str, where: str, minimum: int = 0) -> int:
    value = msg[key]
    if not is_int(value) or value < minimum:
        raise ProtocolError(f"{where}: {key!r} must be an int >= {minimum}, got {show(value)}")
    return int(value)


def require(msg: dict, key: str, where: str):
    if key not in msg:
        raise ProtocolError(f"{where}: missing field {key!r}")
    return msg[key]
