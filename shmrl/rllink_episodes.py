"""RLlink's episodes validated: each chunk's fields (list form, as RLlib's JSON has them)
and the columnar form of the binary codec, checked alike into one ``EpisodeBatch`` (or a
``MultiAgentBatch`` by module). Used by ``shmrl.rllink``'s ``validate``; hostile input
raises ``ProtocolError`` with what was wrong, never anything else.
"""
from __future__ import annotations

import itertools

import numpy as np

from shmrl.episode import (ACTION_DIST_INPUTS, ACTION_LOGP, ACTIONS, AGENT_ID, EPISODE_ID, FLAG_ALIASES,
                           MODULE_ID, OBS, REWARDS, STATE_IN, STEP_FIELDS, TERMINATED, TRUNCATED, WEIGHTS_SEQ_NO,
                           EpisodeBatch, MultiAgentBatch, obs_rows)
from shmrl.rllink_codec import ProtocolError, _show

_EPISODE_KEYS = frozenset({OBS, ACTIONS, REWARDS, ACTION_DIST_INPUTS, ACTION_LOGP, TERMINATED,
                           TRUNCATED, EPISODE_ID, WEIGHTS_SEQ_NO, STATE_IN, AGENT_ID, MODULE_ID, *FLAG_ALIASES})
_MAX_ID_LEN = 200      # of an agent or module id
_INT64_MAX = np.iinfo(np.int64).max


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
