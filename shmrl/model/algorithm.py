"""The seam between the trainer and its learning algorithms (``--algo``): what the one loop
(``shmrl.trainer.loop``) asks of a learner, and what the set-up needs to know of an
algorithm before torch is loaded. PPO (``shmrl.model.ppo``) and SAC (``shmrl.model.sac``)
are each written top to bottom in their own module; the trainer picks one here and never
asks which it has.

A learner (one per policy) has:

- ``learn(chunks, progress, reward_scale, plan, publish)``: take the episode chunks that
  arrived (an ``EpisodeBatch``, each accepted chunk once, whatever transport it came by)
  and learn from them. Returns its statistics (``ROW_STATS``, ``lr``, ``epochs_run``), or
  ``{"skipped": why}`` when a loss or gradient was not finite (the weights stay), or None
  when it took the chunks and learned nothing yet (SAC's warm-up): nothing to publish.
  ``publish(weights)`` publishes weights in the middle of a long update (SAC, every
  ``--publish-every`` gradient steps); the loop publishes ``published_weights()`` after it.
- ``published_weights()``: the policy as the ONNX graph takes it.
- ``action_dist``: how clients are to sample output 0 now (SET_STATE's ``action_dist``,
  docs/RLLINK.md §4.2); None: as the model says.
- ``get_state()`` / ``set_state(arrays, values)``: what a checkpoint keeps (arrays and JSON).
- ``ROW_STATS``: the scalars of its metrics rows, beside those every update has.

An ``Algorithm`` (``ALGORITHMS[name]``) describes one without importing torch: its network
(``net``), whether it is off-policy (the serving side then never holds a client for an
update and keeps every chunk, however old: ``shmrl.server.serving.Serving``), what SET_CONFIG
and the first SET_STATE say of its distribution, how a checkpoint's arrays must look, and
``make``, which imports its module (and torch) and builds a learner.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from shmrl.model.net import PolicyNet, SquashedGaussianNet
from shmrl.onnxio.graph import SQUASHED_GAUSSIAN


@dataclass(frozen=True)
class Algorithm:
    name: str
    off_policy: bool
    net_class: type

    def net(self, config, spec) -> PolicyNet:
        """The published policy of this run's configuration."""
        return self.net_class(spec, config.hidden, config.activation, normalize_obs=config.normalize_obs,
                              log_std_init=config.log_std_init, layers=config.layers, cnn=config.cnn,
                              memory=None if config.memory == "none" else config.memory,
                              memory_size=config.memory_size, ortho_init=config.ortho_init)

    def make(self, net, config, seed: int, initial_weights: dict, device: str):
        """A learner of this algorithm (imports torch)."""
        if self.name == "sac":
            from shmrl.model.sac import SAC as cls
        else:
            from shmrl.model.ppo import PPO as cls
        return cls(net, config, seed=seed, initial_weights=initial_weights, device=device)

    def config_fields(self) -> dict:
        """What SET_CONFIG adds: the distribution of output 0 where it is not RLlib's."""
        return {"action_dist": SQUASHED_GAUSSIAN} if self.name == "sac" else {}

    def action_dists(self) -> tuple[str, ...]:
        """Every distribution its clients may be told to sample (SET_STATE's ``action_dist``):
        what a client that runs the policy itself must list in its PING."""
        return (SQUASHED_GAUSSIAN, "uniform") if self.name == "sac" else ()

    def first_action_dist(self, config, resumed: bool, recorded_steps: int = 0) -> str | None:
        """SET_STATE's ``action_dist`` before the first update: SAC's warm-up acts uniformly
        (a resumed run has its warm-up behind it, as has one whose --pretrain brought
        ``recorded_steps`` of at least --learning-starts)."""
        if self.name != "sac":
            return None
        warm_up = config.learning_starts > recorded_steps and not resumed
        return "uniform" if warm_up else SQUASHED_GAUSSIAN

    def misfit(self, net, arrays: dict, prefix: str) -> str | None:
        """Why a checkpoint's learner arrays of the policy at ``prefix`` do not fit ``net``
        (another algorithm's, or another network's), or None."""
        if self.name == "sac":
            from shmrl.model.sac import state_sizes
        else:
            state_sizes = ppo_state_sizes
        for name, size in state_sizes(net).items():
            found = arrays.get(prefix + name)
            if found is None or found.shape != (size,):
                return (f"its {name!r} has shape {None if found is None else found.shape}, this network's "
                        f"{(size,)} for --algo {self.name}")
        return None


def replay_row_bytes(spec) -> int:
    """The bytes one env step takes in SAC's replay buffer (``shmrl.model.sac.ReplayBuffer``):
    its observation and the next (each leaf in its dtype), its action, reward and done flag."""
    import numpy as np

    obs = sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in spec.obs.inputs)
    return 2 * obs + 4 * spec.actions.action_size + 8


def ppo_state_sizes(net) -> dict:
    """The flat arrays of PPO's state (``PPO.get_state``) and their sizes for ``net``."""
    size = sum(math.prod(shape) for _, shape, _ in net.trained_params()) + len(net.log_std_rows)
    return {"params": size, "exp_avg": size, "exp_avg_sq": size}


ALGORITHMS = {"ppo": Algorithm("ppo", False, PolicyNet), "sac": Algorithm("sac", True, SquashedGaussianNet)}


def algorithm(name: str | None) -> Algorithm:
    """The algorithm of ``--algo`` (an older checkpoint's, which wrote none: PPO)."""
    return ALGORITHMS[name or "ppo"]
