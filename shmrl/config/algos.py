"""What each learning algorithm of ``--algo`` takes, checked before anything starts
(``shmrl.config.settings.validate`` asks ``sac_refusal``); ``shmrl.model.algorithm`` holds
the algorithms themselves."""
from __future__ import annotations

import math

# The learning algorithms of --algo; auto is one of them, chosen once the simulators' rate is
# known (``shmrl.trainer.setup.set_up``, ``shmrl.trainer.loop.Training.choose_profile``).
ALGOS = ("ppo", "sac")
ALGO_CHOICES = ALGOS + ("auto",)


def sac_refusal(config, spec=None) -> str | None:
    """Why --algo sac cannot train this run (``spec``: the env's, where known), or None.
    SAC (``shmrl.model.sac``) takes one Box action with finite bounds, a single agent,
    vector observations and no --memory; --normalize-reward is PPO's."""
    if config.memory not in (None, "none"):
        return f"--memory {config.memory}: SAC's policy has no recurrent core; give --memory none or --algo ppo"
    if config.normalize_reward:
        return "--normalize-reward scales PPO's batches; SAC trains on the rewards as they are (--reward-scale C)"
    if spec is None:
        return None
    name = config.env if isinstance(config.env, str) else getattr(config.env, "__qualname__", str(config.env))
    if spec.multiagent:
        return f"{name} is a multi-agent env; SAC trains a single agent for now: give --algo ppo"
    actions = spec.actions
    if not actions.single_box:
        return (f"{name}'s action space is {spec.action_space!r}; SAC takes one Box of floats (continuous "
                "actions): give --algo ppo")
    part = actions.parts[0]
    if not (all(math.isfinite(v) for v in part.low) and all(math.isfinite(v) for v in part.high)):
        return (f"{name}'s action space {spec.action_space!r} has infinite bounds; SAC squashes its actions "
                "into finite ones (low, high): give --algo ppo, or bound the env's action space")
    leaves = [leaf for leaf in spec.obs.inputs if leaf.encoding != "vector"]
    if leaves or spec.obs.mask is not None:
        what = f"a {leaves[0].encoding} observation {leaves[0].name!r}" if leaves else "an action_mask"
        return f"{name} has {what}; SAC takes vector observations (Box) for now: give --algo ppo"
    return None
