"""Server-side inference on the wire (docs/RLLINK.md, "Server-side inference"): ACT, the
request of a client that runs no policy (the observations of its K envs and the outcome of
their last step), and ACTIONS, the server's reply (K actions and the policy version that
chose them). Validated here field by field, in both codecs, into numpy arrays; what needs
the connection's history (K fixed, rewards on every ACT but the first) is the server's to
check (``shmrl.inference``).

This module knows nothing of sockets, shared memory or torch.
"""
from __future__ import annotations

import numpy as np

from shmrl.episode import obs_rows
from shmrl.rllink_codec import ProtocolError, _show
from shmrl.rllink_act_ma import multiagent_act, multiagent_actions
from shmrl.rllink_episodes import _array, _count, _is_bool, _obs, _require

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
            raise ProtocolError(f"ACT: unexpected field {_show(key)}")
    with np.errstate(all="ignore"):   # float32 casts that overflow are reported as non-finite
        return _act(msg)


def _multiagent_act(msg: dict) -> dict:
    extra = sorted(set(msg) - {"type", "envs"}, key=str)
    if extra:
        raise ProtocolError(f"ACT: unexpected field {_show(extra[0])} beside 'envs' (a multi-agent ACT)")
    return multiagent_act(msg)


def _act(msg: dict) -> dict:
    obs = _obs(_require(msg, "obs", "ACT"), "ACT")
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
    rewards = _array(msg, "rewards", "ACT")
    if rewards.shape != (k,):
        raise ProtocolError(f"ACT: 'rewards' has shape {rewards.shape}, expected ({k},): one per env of 'obs'")
    out["rewards"] = rewards
    out["terminateds"] = _bools(msg, "terminateds", k)
    out["truncateds"] = _bools(msg, "truncateds", k)
    if "final_obs" in msg:
        final = _obs(msg["final_obs"], "ACT final_obs")
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
    value = _require(msg, key, "ACT")
    if isinstance(value, np.ndarray):   # binary: a |b1 array
        if value.dtype == bool and value.shape == (k,):
            return value
    elif type(value) is list and len(value) == k and all(_is_bool(v) for v in value):
        return np.array(value, bool)
    raise ProtocolError(f"ACT: {key!r} must be {k} booleans (one per env of 'obs'), got {_show(value)}")


def actions_reply(msg: dict) -> dict:
    """A validated ACTIONS: ``actions`` as an array (int64 for integers, float32 for Box
    samples), one row per env of the ACT it answers; ``weights_seq_no``."""
    out = dict(msg)   # servers may add fields: keep them
    actions = _require(msg, "actions", "ACTIONS")
    if isinstance(actions, list) and actions and isinstance(actions[0], dict):   # many agents: per env
        return multiagent_actions(msg)
    if not isinstance(actions, (list, np.ndarray)):
        raise ProtocolError(f"ACTIONS: 'actions' must be a list, got {type(actions).__name__}")
    with np.errstate(all="ignore"):
        arr = _array(msg, "actions", "ACTIONS", actions=True)
    if arr.ndim not in (1, 2) or not 1 <= len(arr) <= MAX_ACT_ENVS:
        raise ProtocolError(f"ACTIONS: 'actions' has shape {arr.shape}: 1 to {MAX_ACT_ENVS} rows of a number "
                            f"or a list of numbers")
    out["actions"] = arr
    _require(msg, "weights_seq_no", "ACTIONS")
    out["weights_seq_no"] = _count(msg, "weights_seq_no", "ACTIONS")
    return out


def inference_mode(msg: dict, where: str) -> str:
    """A PING's or PONG's ``inference``: "server" or "client" (the default)."""
    mode = msg.get("inference", "client")
    if mode not in INFERENCE_MODES:
        raise ProtocolError(f"{where}: 'inference' must be one of {list(INFERENCE_MODES)}, got {_show(mode)}")
    return mode
