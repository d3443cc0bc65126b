"""What a checkpoint and the log folder hold of a run's policies, and how a run resumes.

A checkpoint (``shmrl.files.checkpoint``: weights.npz + state.json) keeps each policy's PPO
state, published weights and reward statistics, the episode store's counters and the
weights version. The trainer works on a set of policies; the layout is the one shmrl
has always written, and only this module maps between them: a single-agent run's one
policy at the top (``params``, ``policy/<name>``, ``reward_stats.*``; its counts are
the run's; ``policy.onnx``), a multi-agent run's under ``policies/<id>/``
(``policy-<id>.onnx``).
"""
from __future__ import annotations

import logging
from pathlib import Path

from shmrl.files import checkpoint
from shmrl.config.settings import EXIT_BUDGET, ConfigError
from shmrl.server.store import DEFAULT_POLICY

log = logging.getLogger("shmrl.run")


def policy_prefix(pid: str, multiagent: bool) -> str:
    """Where policy ``pid``'s arrays are in a checkpoint."""
    return f"policies/{pid}/" if multiagent else ""


def policy_file(pid: str, multiagent: bool) -> str:
    """The log folder's ONNX model of policy ``pid``."""
    return f"policy-{pid}.onnx" if multiagent else "policy.onnx"


def policy_arrays(arrays: dict, prefix: str) -> dict:
    """The arrays under ``prefix``, by the names below it."""
    return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}


def saved_policy(arrays: dict, prefix: str = "") -> dict:
    """The published weights in a checkpoint's arrays of the policy at ``prefix``
    (``policy_prefix``; by default a single-agent run's)."""
    return policy_arrays(arrays, prefix + "policy/")


def load_resume_checkpoint(resume: str, env: str, hidden: int, nets: dict, multiagent: bool,
                           settings: dict | None = None) -> tuple:
    """(path, arrays, state) of the newest intact checkpoint in the folder ``resume`` whose
    arrays fit this run's networks (policy id -> PolicyNet; a newer one whose arrays have
    other shapes is damaged, passed over with a warning), checked against this run's env
    (its name) and network settings (``settings``, as saved_config writes them) before
    anything is started or written: a run that cannot resume must leave the folder it
    would resume as it found it."""
    misfits = []   # (path, why) of the readable checkpoints whose arrays do not fit
    algo = (settings or {}).get("algo")

    def misfit(path: Path, arrays: dict, state: dict) -> str | None:
        saved_env = state.get("config", {}).get("env")
        if saved_env is not None and saved_env != env:
            raise ConfigError(f"--resume {resume}: its checkpoint was trained on {saved_env}, not "
                              f"{env}; a run resumes on the env it was trained on")
        if settings:   # the algorithm and the set of policies first: the arrays are compared policy by policy
            refuse_other_algorithm(resume, state, settings)
            refuse_other_network(resume, state, settings, ["policy_map"])
        for pid, net in nets.items():
            prefix = policy_prefix(pid, multiagent)
            why = net.check(saved_policy(arrays, prefix)) or optimizer_misfit(net, arrays, prefix, algo)
            if why:
                why = f"it does not fit a network of --hidden {hidden} for {net.spec.env_id}: {why}"
                misfits.append((path, why))
                return why
        return None

    try:
        path, arrays, state, damaged = checkpoint.load_latest(Path(resume), misfit)
    except checkpoint.CheckpointError as e:
        if misfits:   # none fits this run's network: that is the run's settings, not damage
            newest, why = misfits[0]
            raise ConfigError(f"--resume {resume}: {newest} {why.removeprefix('it ')}; was it saved with other "
                              "layer sizes?") from None
        raise ConfigError(f"--resume {resume}: {e}") from None
    for reason in damaged:
        log.warning("--resume %s: %s; going on from %s instead", resume, reason, path)
    if settings:   # the same shapes, and still another network (--activation, --normalize-obs, ...)
        refuse_other_network(resume, state, settings)
    return path, arrays, state


def optimizer_misfit(net, arrays: dict, prefix: str, algo: str | None = None) -> str | None:
    """Why the flat parameters and Adam moments of the policy at ``prefix`` do not fit
    ``net`` as the learner of ``algo`` lays them out (``shmrl.model.algorithm``), or None."""
    from shmrl.model.algorithm import algorithm

    return algorithm(algo).misfit(net, arrays, prefix)


def refuse_other_algorithm(resume: str, state: dict, settings: dict) -> None:
    """ConfigError where the checkpoint was trained by another --algo than this run's (one
    that wrote none was PPO's): its arrays are another learner's."""
    saved = state.get("config", {}).get("algo") or "ppo"
    wanted = settings.get("algo") or "ppo"
    if saved != wanted:
        raise ConfigError(f"--resume {resume}: its checkpoint was trained with --algo {saved}, not --algo {wanted}; "
                          "a run resumes with the algorithm it was trained with")


def refuse_other_network(resume: str, state: dict, settings: dict, keys=checkpoint.NETWORK_SETTINGS) -> None:
    """ConfigError naming the first network setting of ``keys`` in which this run's
    ``settings`` differ from the checkpoint's: resuming would overwrite the run's
    checkpoints and policy with another network."""
    why = checkpoint.network_difference(state.get("config", {}), settings, keys)
    if why:
        raise ConfigError(f"--resume {resume}: {why}; a run resumes with the network it was trained with")


def ppo_state(state: dict, pid: str, multiagent: bool) -> dict:
    """Policy ``pid``'s learner values (PPO's or SAC's) in a checkpoint's state."""
    return state["ppo"][pid] if multiagent else state["ppo"]


def restore_store(store, state: dict, arrays: dict, multiagent: bool) -> None:
    """Let the episode ``store`` go on from a checkpoint's counters and reward statistics."""
    counters = state["counters"]
    if not multiagent:   # the one policy's counts and returns are the run's
        counters = {**counters, "policies": {DEFAULT_POLICY: counters}}
    store.restore(counters, {pid: policy_arrays(arrays, policy_prefix(pid, multiagent)) for pid in store.policies})


def save_checkpoint(logdir: Path, update: int, weights_seq_no: int, store, ppos: dict, config: dict,
                    keep: int, multiagent: bool) -> Path:
    """Write a checkpoint of the learners ``ppos`` (policy id -> PPO or SAC), the episode ``store``
    and the run's ``config`` (JSON)."""
    arrays, ppo_values = {}, {}
    for pid, ppo in ppos.items():
        a, ppo_values[pid] = ppo.get_state()
        stats = store.policies[pid].reward_stats
        if stats is not None:
            a.update(stats.get_state("reward_stats"))
        arrays.update({policy_prefix(pid, multiagent) + k: v for k, v in a.items()})
    counters = store.counters()
    if not multiagent:
        del counters["policies"]
    return checkpoint.save(Path(logdir), update, arrays, keep=keep, state={
        "weights_seq_no": weights_seq_no, "config": {**config, "auth_token": None}, "counters": counters,
        "ppo": ppo_values if multiagent else ppo_values[DEFAULT_POLICY]})


def accepted_steps(counters: dict) -> int:
    """A checkpoint's env steps that count toward --max-env-steps (``EpisodeStore.steps_accepted``)."""
    return int(counters["steps_received"]) - int(counters.get("steps_refused", 0))


def spent_budget(config, resumed: tuple | None) -> dict | None:
    """When the run resumed (``resumed``: path, arrays, state) has already received its
    ``--max-env-steps``, say so and return its summary (exit status 1): it samples
    nothing and writes nothing. None when there is budget left."""
    if not resumed or accepted_steps(resumed[2]["counters"]) < config.max_env_steps:
        return None
    path, _, state = resumed
    steps = accepted_steps(state["counters"])
    print(f"step budget exhausted: {config.resume} already has {steps} env steps (--max-env-steps "
          f"{config.max_env_steps}); nothing trained or written (a larger --max-env-steps goes on)", flush=True)
    return {"solved": False, "exit_status": EXIT_BUDGET, "error": None, "env_steps": steps,
            "updates": state["update"], "weights_seq_no": state["weights_seq_no"], "resumed_from": str(path),
            "checkpoint": str(path)}
