"""What a checkpoint holds of a run, and how a run resumes from one.

A checkpoint (``shmrl.checkpoint``: weights.npz + state.json) keeps each policy's PPO
state and published weights, the reward statistics, the episode store's counters and the
weights version. The layout is the one shmrl has always written: a single-agent run's
arrays at the top (``params``, ``policy/<name>``, ``reward_stats.*``), a multi-agent run's
under ``policies/<id>/``. Only this module knows that; the trainer works on a set of
policies either way.
"""
from __future__ import annotations

import logging
from pathlib import Path

from shmrl import checkpoint
from shmrl.config import ConfigError

log = logging.getLogger("shmrl.run")


def policy_prefix(pid: str | None) -> str:
    """Where policy ``pid``'s arrays are in a checkpoint (None: a single-agent run's)."""
    return "" if pid is None else f"policies/{pid}/"


def policy_arrays(arrays: dict, pid: str | None) -> dict:
    """Policy ``pid``'s arrays in a checkpoint, under the names PPO uses."""
    prefix = policy_prefix(pid)
    return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}


def saved_policy(arrays: dict, pid: str | None = None) -> dict:
    """The published weights of policy ``pid`` in a checkpoint's arrays (``policy/<name>``
    within its arrays; None: a single-agent run's)."""
    prefix = policy_prefix(pid) + "policy/"
    return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}


def load_resume_checkpoint(resume: str, env: str, hidden: int, nets: dict) -> tuple:
    """(path, arrays, state) of the newest intact checkpoint in the folder ``resume``,
    checked against this run's env (its name) and networks (policy id -> PolicyNet; None
    as the id: a single-agent run's) before anything is started or written: a run that
    cannot resume must leave the folder it would resume as it found it."""
    try:
        path, arrays, state, damaged = checkpoint.load_latest(Path(resume))
    except checkpoint.CheckpointError as e:
        raise ConfigError(f"--resume {resume}: {e}") from None
    for reason in damaged:
        log.warning("--resume %s: %s; going on from %s instead", resume, reason, path)
    saved_env = state.get("config", {}).get("env")
    if saved_env is not None and saved_env != env:
        raise ConfigError(f"--resume {resume}: its checkpoint was trained on {saved_env}, not "
                          f"{env}; a run resumes on the env it was trained on")
    for pid, net in nets.items():
        why = net.check(saved_policy(arrays, pid))
        if why:
            raise ConfigError(f"--resume {resume}: {path} does not fit a network of --hidden {hidden} "
                              f"for {net.spec.env_id}: {why}; was it saved with other layer sizes?")
    return path, arrays, state


def save_checkpoint(logdir: Path, update: int, weights_seq_no: int, store, ppos: dict, config: dict,
                    keep: int) -> Path:
    """Write a checkpoint of PPO state ``ppos`` (policy id -> PPO; None as the id: a
    single-agent run's), the episode ``store`` and the run's ``config`` (JSON)."""
    arrays, ppo_values = {}, {}
    for pid, ppo in ppos.items():
        a, ppo_values[pid] = ppo.get_state()
        stats = store.reward_stats if pid is None else store.policies[pid].reward_stats
        if stats is not None:
            a.update(stats.get_state("reward_stats"))
        arrays.update({policy_prefix(pid) + k: v for k, v in a.items()})
    return checkpoint.save(Path(logdir), update, arrays, keep=keep, state={
        "weights_seq_no": weights_seq_no, "config": {**config, "auth_token": None},
        "counters": store.counters(), "ppo": ppo_values.get(None, ppo_values)})
