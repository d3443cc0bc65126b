"""RLlink's episodes validated: each chunk's fields (list form, as RLlib's JSON has them)
and the columnar form of the binary codec, checked alike into one ``EpisodeBatch`` (or a
``MultiAgentBatch`` by module). Used by ``shmrl.rllink.messages``'s ``validate``; hostile input
raises ``ProtocolError`` with what was wrong, never anything else.
"""
from __future__ import annotations


import numpy as np

from shmrl.core.episode import (ACTION_DIST_INPUTS, ACTION_LOGP, ACTIONS, AGENT_ID, EPISODE_ID, FLAG_ALIASES,
                           MODULE_ID, OBS, REWARDS, STATE_IN, STEP_FIELDS, TERMINATED, TRUNCATED, WEIGHTS_SEQ_NO,
                           EpisodeBatch, MultiAgentBatch, obs_rows)
from shmrl.rllink.codec import ProtocolError, show
from shmrl.rllink.fields import agent_id, array, count, is_bool, is_int, module_id, obs_value

_EPISODE_KEYS = frozenset({OBS, ACTIONS, REWARDS, ACTION_DIST_INPUTS, ACTION_LOGP, TERMINATED,
                           TRUNCATED, EPISODE_ID, WEIGHTS_SEQ_NO, STATE_IN, AGENT_ID, MODULE_ID, *FLAG_ALIASES})


def _obs_form(obs):
    """What must agree between the chunks of one message: shapes and dtypes of the leaves."""
    if isinstance(obs, dict):
        return tuple(sorted((k, v.shape[1:], v.dtype.kind) for k, v in obs.items()))
    return obs.shape[1:], obs.dtype.kind


def _flag(ep: dict, key: str, alias: str, where: str) -> bool:
    names = [k for k in (key, alias) if k in ep]
    if not names:
        raise ProtocolError(f"{where}: missing field {key!r} (or {alias!r})")
    for k in names:
        if not is_bool(ep[k]):
            raise ProtocolError(f"{where}: {k!r} must be true or false, got {show(ep[k])}")
    if len(names) == 2 and bool(ep[key]) != bool(ep[alias]):
        raise ProtocolError(f"{where}: {key!r} and its alias {alias!r} disagree")
    return bool(ep[names[0]])


def episode_fields(ep, i: int) -> dict:
    where = f"episode {i}"
    if not isinstance(ep, dict):
        raise ProtocolError(f"{where} is a {type(ep).__name__}, not an object")
    for key in ep:
        if key not in _EPISODE_KEYS:
            raise ProtocolError(f"{where}: unexpected field {show(key)}")
    for key in (OBS, ACTIONS, REWARDS, ACTION_DIST_INPUTS, ACTION_LOGP):
        if key not in ep:
            raise ProtocolError(f"{where}: missing field {key!r}")
    actions = array(ep, ACTIONS, where, actions=True)
    n = len(actions)
    out = {OBS: obs_value(ep[OBS], where), ACTIONS: actions}
    if obs_rows(out[OBS]) != n + 1:
        raise ProtocolError(f"{where}: 'obs' has {obs_rows(out[OBS])} entries, expected len(actions)+1 = {n + 1}")
    for key in (REWARDS, ACTION_DIST_INPUTS, ACTION_LOGP):
        out[key] = arr = array(ep, key, where)
        if len(arr) != n:
            raise ProtocolError(f"{where}: {key!r} has {len(arr)} entries, expected len(actions) = {n}")
        if key != ACTION_DIST_INPUTS and arr.ndim != 1:
            raise ProtocolError(f"{where}: {key!r} has shape {arr.shape}, expected ({n},)")
    for alias, key in FLAG_ALIASES.items():
        out[key] = _flag(ep, key, alias, where)
    if EPISODE_ID in ep:
        eid = ep[EPISODE_ID]
        if not (isinstance(eid, str) or is_int(eid)):
            raise ProtocolError(f"{where}: 'episode_id' must be a string or an int, got {show(eid)}")
        out[EPISODE_ID] = eid if isinstance(eid, str) else int(eid)
    if WEIGHTS_SEQ_NO in ep:
        # Beyond int64: from the future all the same, which the Hub refuses per chunk.
        out[WEIGHTS_SEQ_NO] = min(count(ep, WEIGHTS_SEQ_NO, where), 2**63 - 1)
    if STATE_IN in ep:
        out[STATE_IN] = state = array(ep, STATE_IN, where)
        if state.ndim != 1:
            raise ProtocolError(f"{where}: 'state_in' has shape {state.shape}, expected one list of numbers")
    if (AGENT_ID in ep) != (MODULE_ID in ep):
        raise ProtocolError(f"{where}: a multi-agent chunk has both 'agent_id' and 'module_id'")
    if AGENT_ID in ep:
        out[AGENT_ID] = agent_id(ep[AGENT_ID], where)
        out[MODULE_ID] = module_id(ep[MODULE_ID], where)
    return out


def episodes_batch(episodes: list[dict], where: str) -> EpisodeBatch | MultiAgentBatch:
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


def columns_batch(cols: dict, where: str, multi: bool = False) -> EpisodeBatch:
    """Columnar episodes (the binary codec's form) checked as thoroughly as the list form."""
    where = f"{where} episodes"
    for key in cols:
        if key not in _COLUMN_KEYS:
            raise ProtocolError(f"{where}: unexpected field {show(key)}")
    for key in _REQUIRED_COLUMNS:
        if key not in cols:
            raise ProtocolError(f"{where}: missing field {key!r}")
    actions = array(cols, ACTIONS, where, actions=True)
    lengths = cols["lengths"]
    if not (isinstance(lengths, np.ndarray) and lengths.dtype.kind in "iu" and lengths.ndim == 1):
        raise ProtocolError(f"{where}: 'lengths' must be a 1-D array of integers")
    if lengths.size and (lengths.min() < 0 or lengths.max() > len(actions)):  # also: no overflow below
        raise ProtocolError(f"{where}: 'lengths' must lie between 0 and the number of actions")
    n, total = len(lengths), int(lengths.sum())
    if len(actions) != total:
        raise ProtocolError(f"{where}: {len(actions)} actions, but 'lengths' add up to {total}")
    obs = obs_value(cols[OBS], where)
    if obs_rows(obs) != total + n:
        raise ProtocolError(f"{where}: 'obs' has {obs_rows(obs)} rows, expected one more per chunk than "
                            f"its steps: {total + n}")
    rows = {}
    for key in (REWARDS, ACTION_DIST_INPUTS, ACTION_LOGP):
        rows[key] = arr = array(cols, key, where)
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
            i is None or isinstance(i, str) or is_int(i) for i in ids)):
        raise ProtocolError(f"{where}: 'episode_id' must be a list of {n} strings, ints or nulls")
    state = None
    if STATE_IN in cols:
        state = array(cols, STATE_IN, where) if n else np.zeros((0, 0), np.float32)
        if state.ndim != 2 or len(state) != n:
            raise ProtocolError(f"{where}: 'state_in' has shape {state.shape}, expected {n} rows of numbers")
    agents = cols.get(AGENT_ID)
    if agents is not None:
        if not (type(agents) is list and len(agents) == n):
            raise ProtocolError(f"{where}: 'agent_id' must be a list of {n} agent ids")
        agents = [agent_id(a, where) for a in agents]
    if multi != (agents is not None):
        raise ProtocolError(f"{where}: 'agent_id' is a column of multi-agent episodes, and only of them")
    return EpisodeBatch(obs=obs, actions=actions, lengths=lengths, **rows, is_terminated=flags[TERMINATED],
                        is_truncated=flags[TRUNCATED], weights_seq_no=seq, episode_ids=ids, state_in=state,
                        agent_ids=agents)


