"""Server-side inference for many agents on the wire (docs/RLLINK.md §11.3): the ACT of a
client of a multi-agent env and the ACTIONS that answer it, validated field by field in
both codecs.

The form follows PettingZoo's parallel API, one object per env: ``obs`` maps each agent
that acts now to its observation; ``rewards`` what each agent got since the last ACT;
``terminateds``/``truncateds`` the agents whose episode ended; ``final_obs`` the last
observation of each truncated agent; ``reset`` says the env's episode ended and ``obs``
starts the next. ACTIONS gives one object per env: agent -> action. What needs the env or
the connection's history (the agents are the env's, their observations fit, K fixed, the
outcome on every ACT but the first, no agent acting again after it ended before its env's
reset) is the server's to check (``shmrl.server.inference.multi_agent``).

This module knows nothing of sockets, shared memory or torch.
"""
from __future__ import annotations

import math

import numpy as np

from shmrl.core.episode import obs_rows
from shmrl.rllink.codec import ProtocolError, show
from shmrl.rllink.fields import MAX_ID_LEN, array, count, is_bool, is_int, obs_value, require

MAX_ACT_ROWS = 4096     # observations (acting agents and final_obs) in one ACT, over all its envs
ENV_FIELDS = frozenset({"obs", "rewards", "terminateds", "truncateds", "final_obs", "reset"})
OUTCOME_FIELDS = ("rewards", "terminateds", "truncateds", "final_obs", "reset")


def multiagent_act(msg: dict) -> dict:
    """A validated multi-agent ACT: ``envs``, a list of K (1 <= K <= 4096) env objects,
    each ``{"obs": {agent: one observation (an array [1, ...] or a dict of them by leaf)},
    "rewards": {agent: float}, "terminateds"/"truncateds": {agent: True}, "final_obs":
    {agent: observation}, "reset": bool, "outcome": bool}``; ``outcome`` says whether the
    env object carried the last step's outcome (``rewards``)."""
    envs = msg["envs"]
    if not isinstance(envs, list) or not 1 <= len(envs) <= MAX_ACT_ROWS:
        raise ProtocolError(f"ACT: 'envs' must be a list of 1 to {MAX_ACT_ROWS} env objects, got {show(envs)}")
    out, rows = [], 0
    with np.errstate(all="ignore"):   # float32 casts that overflow are reported as non-finite
        for k, env in enumerate(envs):
            parsed = _env(env, f"ACT env {k}")
            rows += len(parsed["obs"]) + len(parsed["final_obs"])
            if rows > MAX_ACT_ROWS:
                raise ProtocolError(f"ACT: more than {MAX_ACT_ROWS} observations in one ACT (its envs' agents)")
            out.append(parsed)
    return {"type": "ACT", "envs": out}


def _env(env, where: str) -> dict:
    if not isinstance(env, dict):
        raise ProtocolError(f"{where} is {show(env)}, not an object")
    for key in env:
        if key not in ENV_FIELDS:
            raise ProtocolError(f"{where}: unexpected field {show(key)}")
    if "obs" not in env:
        raise ProtocolError(f"{where}: missing field 'obs' (the agents that act now: agent -> observation)")
    outcome = "rewards" in env
    if not outcome and any(key in env for key in OUTCOME_FIELDS):
        raise ProtocolError(f"{where}: {[key for key in OUTCOME_FIELDS if key in env]} without 'rewards': the "
                            f"outcome of a step starts with its rewards (an object, {{}} when none)")
    out = {"obs": _observations(env["obs"], f"{where} obs"), "outcome": outcome,
           "rewards": _by_agent(env.get("rewards", {}), f"{where} rewards", _reward),
           "terminateds": _flags(env.get("terminateds", {}), f"{where} terminateds"),
           "truncateds": _flags(env.get("truncateds", {}), f"{where} truncateds"),
           "final_obs": _observations(env.get("final_obs", {}), f"{where} final_obs"),
           "reset": env.get("reset", False)}
    if not out["obs"]:
        raise ProtocolError(f"{where}: 'obs' is empty; every env has an agent to act (after a reset, the new "
                            f"episode's first)")
    if not is_bool(out["reset"]):
        raise ProtocolError(f"{where}: 'reset' must be true or false, got {show(out['reset'])}")
    out["reset"] = bool(out["reset"])
    missing = sorted(set(out["truncateds"]) - set(out["final_obs"]))
    if missing:
        raise ProtocolError(f"{where}: agents {show(missing)} were truncated but have no 'final_obs' (the learner "
                            f"bootstraps from it)")
    if not out["reset"]:
        again = sorted((set(out["terminateds"]) | set(out["truncateds"])) & set(out["obs"]))
        if again:
            raise ProtocolError(f"{where}: agents {show(again)} ended and act again without 'reset': true "
                                f"(an agent's episode ends once)")
    return out


def _by_agent(value, where: str, parse) -> dict:
    """An object agent id -> value (each parsed), its keys short strings."""
    if not isinstance(value, dict):
        raise ProtocolError(f"{where} must be an object agent id -> value, got {show(value)}")
    out = {}
    for agent, v in value.items():
        if not (isinstance(agent, str) and 0 < len(agent) <= MAX_ID_LEN):
            raise ProtocolError(f"{where}: agent id {show(agent)} is not a short string")
        out[agent] = parse(v, f"{where} {agent!r}")
    return out


def _observations(value, where: str) -> dict:
    return _by_agent(value, where, _one_obs)


def _one_obs(value, where: str):
    """One observation as a batch of one row (an array [1, ...], or a dict by leaf)."""
    if isinstance(value, np.ndarray):   # binary: the array itself, or one at each leaf
        return obs_value(value[None], where)
    if isinstance(value, dict) and value and all(type(v) is np.ndarray for v in value.values()):
        return obs_value({leaf: v[None] for leaf, v in value.items()}, where)
    obs = obs_value([value], where)
    if obs_rows(obs) != 1:
        raise ProtocolError(f"{where}: expected one observation")
    return obs


def _reward(value, where: str) -> float:
    if not ((is_int(value) or isinstance(value, (float, np.floating))) and not is_bool(value)):
        raise ProtocolError(f"{where}: a reward must be a number, got {show(value)}")
    try:
        reward = float(value)
    except OverflowError:   # an int beyond any float
        reward = math.inf
    if not abs(reward) <= float(np.finfo(np.float32).max):   # NaN, infinity, or beyond float32
        raise ProtocolError(f"{where}: non-finite reward (or beyond float32)")
    return float(np.float32(reward))


def _flags(value, where: str) -> dict:
    """terminateds/truncateds: agent -> bool; only the agents whose flag is true are kept."""
    flags = _by_agent(value, where, _flag)
    return {agent: True for agent, flag in flags.items() if flag}


def _flag(value, where: str) -> bool:
    if not is_bool(value):
        raise ProtocolError(f"{where}: must be true or false, got {show(value)}")
    return bool(value)


def multiagent_actions(msg: dict) -> dict:
    """A validated multi-agent ACTIONS: ``actions``, one object per env of the ACT it
    answers, agent -> action (an int, or a list of numbers: as in the single-agent form);
    ``weights_seq_no``."""
    out = dict(msg)
    envs = msg["actions"]
    if not 1 <= len(envs) <= MAX_ACT_ROWS:
        raise ProtocolError(f"ACTIONS: 'actions' holds {len(envs)} envs; 1 to {MAX_ACT_ROWS}")
    parsed = []
    with np.errstate(all="ignore"):
        for k, env in enumerate(envs):
            if not isinstance(env, dict) or not env:
                raise ProtocolError(f"ACTIONS: env {k}'s actions must be an object agent -> action, got {show(env)}")
            parsed.append(_by_agent(env, f"ACTIONS env {k}", _action))
    out["actions"] = parsed
    require(msg, "weights_seq_no", "ACTIONS")
    out["weights_seq_no"] = count(msg, "weights_seq_no", "ACTIONS")
    return out


def _action(value, where: str):
    arr = array({"a": [value]}, "a", where, actions=True)
    if arr.ndim not in (1, 2):
        raise ProtocolError(f"{where}: an action is a number or a list of numbers, got {show(value)}")
    return arr[0]
