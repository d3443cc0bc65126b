"""How much the learner learns from each env step, chosen by how fast the simulators are
and how busy the learner is: the one policy that spends a slow simulator's idle learner on
more learning per env step. Two stages.

First, the profile (``simulators_slow``). What moves the return per env step most is fixed
before the first weights are published: the network's width, its initial std, the batch
and epochs (rl-zoo3's tuned settings: on HalfCheetah-v5 at 1000 env steps/s, 704 after
100k env steps against the preset's 154). So with ``--learn-per-step auto`` a run whose env
has a slow profile in presets.toml measures the env steps per second its simulators
deliver until the first batch (``Hub.delivery_rate``: local simulators and external
clients alike), and below --slow-rate (2000; unthrottled HalfCheetah delivers 10-20k here, 3-4k at a load of 8)
switches to it (``setup_run.switch_to_slow``): new networks and first weights published,
the batch it measured on dropped (it counts in env_steps). A fast simulator keeps the
preset; a setting given on the command line is kept either way. The message size the
clients learn at their handshake is the smaller batch's share from the start, so it fits
either profile. summary.json's ``profile`` says which and why.

Second, the ladder below, over whichever profile the run has.

When the simulators, not the learner, are the bottleneck (a game engine, a robot, external
clients delivering a few hundred env steps per second), the learner waits for batches
most of the time. That time is spent on more gradient steps per batch, inside PPO's trust
region: a ladder of levels, each twice the gradient steps of the one below it, first by
halving the minibatch (down to MIN_MINIBATCH steps), then by doubling the epochs, up to
MAX_LEVEL. Above level 0 every update stops early once the approximate KL from the policy
it began with passes 1.5 x --target-kl (``PPO.update``), so more epochs never move the
policy further than that; a batch that needs few steps gets few.

The level follows the learner's busy share (``report.Clock``: the fraction of wall time
spent in update and publish) over the last WINDOW updates together (not each update's:
external clients that send at once bring batches in bursts, busy then idle), and the
epochs the KL bound let each update run. It climbs one level when the next level's cost,
doubling per level, would keep the learner busy at most the target share, and the KL
bound did not cut this level short (its median update ran every epoch). It falls one
level when the KL bound cut this level's updates below the gradient steps of the level
beneath (smaller minibatches then only reach the bound sooner: the extra steps buy
nothing), and to the level the share affords when the learner is busy. With --async the
simulators sample on while the learner trains, so its idle time is free: the target is
ASYNC_TARGET. Without, they wait for every update, and a longer update costs env steps per
second: the target is SYNC_TARGET, which a fast simulator's learner (CartPole's, busy
20-40% of the time) stays above. Either way a fast simulator keeps level 0, the preset's
settings, unchanged. ``--learn-per-step off`` keeps level 0; ``on`` starts at the top
level and stays there. The level starts at 0 again after a --resume.

Measured (README, "Slow simulators"): on HalfCheetah-v5 at 1000 env steps/s the ladder
moves the return after 100k env steps little (the KL bound stops the top level's updates
after a fifth of their epochs); the network's width and initial std, fixed before the
first weights are published, are what move it.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque

from shmrl.config.settings import PRESETS_FILE, Config, ConfigError, NetworkSettings, PPOSettings
from shmrl.config.presets import slow_tables

MODES = ("auto", "off", "on")
MIN_MINIBATCH = 64      # steps; below this a gradient step costs nearly as much as at 64 and is noisier
MAX_LEVEL = 4           # at most 16 times the preset's gradient steps per batch
ASYNC_TARGET = 0.5      # the highest busy share a level may be expected to cost, with --async
SYNC_TARGET = 0.2       # without: each update's seconds are seconds the simulators wait
WINDOW = 5              # updates whose busy share decide the level (the first after a change is skipped)


# The settings a slow profile may change: how PPO learns, the network, the batch and whether
# clients wait for each update (the server's side alone); never the run's shape (its
# simulators, transports, budget, the clients' message size), fixed before the switch.
SLOW_SETTINGS = frozenset(f.name for cls in (PPOSettings, NetworkSettings) for f in dataclasses.fields(cls)
                          if f.metadata["preset"] and f.name not in ("memory", "memory_size", "torch_threads")
                          ) | {"train_batch_size", "async_sampling"}


def given_settings(config: Config) -> set[str]:
    """The preset settings an unresolved ``config`` gives (those not None: a resolved one
    gives them all; the command line says which it gave, ``run.parse_command_line``)."""
    return {f.name for f in dataclasses.fields(config)
            if (f.metadata["preset"] or f.name == "env_steps_per_sample") and getattr(config, f.name) is not None}


def slow_config(config: Config, spec, given: set[str]) -> tuple[Config, Config | None, list[str]]:
    """(the resolved ``config``, the same with the env's slow profile over every setting not
    in ``given``, the presets.toml tables that came from); the slow one None where the env
    has no slow profile or it changes nothing. Unless given, each simulator's message then
    holds its share of the smaller batch of the two, in both: a client learns its message
    size once, at its handshake, and keeps it across the switch."""
    values, sources = slow_tables(config.env, spec)
    unknown = set(values) - SLOW_SETTINGS
    if unknown:
        raise ConfigError(f"{PRESETS_FILE}: {', '.join(sources)}: a slow profile may not change {sorted(unknown)}")
    changes = {k: v for k, v in values.items() if k not in given and getattr(config, k) != v}
    if not changes:
        return config, None, []
    if "env_steps_per_sample" not in given:
        smaller = min(config.train_batch_size, changes.get("train_batch_size", config.train_batch_size))
        config = dataclasses.replace(config, env_steps_per_sample=-(-smaller // max(config.sims, 1)))
    return config, dataclasses.replace(config, **changes), sources


def simulators_slow(rate: float, slow_rate: float) -> tuple[bool, str]:
    """(whether simulators that delivered ``rate`` env steps per second are slow, the line
    that says so and what the run does about it)."""
    if rate < slow_rate:
        return True, (f"simulators slow ({rate:.0f} env steps/s < --slow-rate {slow_rate:g}): "
                      "the slow profile, more learning per env step")
    return False, f"simulators fast ({rate:.0f} env steps/s >= --slow-rate {slow_rate:g}): the preset's profile"


def ladder(epochs: int, minibatch_size: int, batch_size: int) -> list[tuple[int, int]]:
    """(epochs, minibatch size) of each level: level 0 the preset's, each next twice the
    gradient steps: the minibatch halved while it stays at least MIN_MINIBATCH steps (and
    below the batch), else the epochs doubled."""
    levels = [(epochs, minibatch_size)]
    mb = min(minibatch_size, batch_size)
    for _ in range(MAX_LEVEL):
        if mb // 2 >= MIN_MINIBATCH:
            mb //= 2
        else:
            epochs *= 2
        levels.append((epochs, mb))
    return levels


class LearnPerStep:
    """The level of learning per env step. ``plan()``: the next update's settings;
    ``observe(busy_s, wall_s, epochs_run)``: how that update went."""

    def __init__(self, mode: str, epochs: int, minibatch_size: int, batch_size: int, target_kl: float,
                 async_sampling: bool):
        if mode not in MODES:
            raise ValueError(f"learn-per-step mode must be one of {', '.join(MODES)}, not {mode!r}")
        self.mode, self.target_kl = mode, target_kl
        self.target = ASYNC_TARGET if async_sampling else SYNC_TARGET
        self.levels = ladder(epochs, minibatch_size, batch_size)
        self.level = len(self.levels) - 1 if mode == "on" else 0
        self.periods: deque[tuple[float, float]] = deque(maxlen=WINDOW)   # (busy s, wall s) of each
        self.epochs_run: deque[float] = deque(maxlen=WINDOW)
        self.settle = 1   # updates not counted: the first (torch warms up) and the first after a change

    @classmethod
    def of(cls, config, slow_profile: bool = False) -> LearnPerStep:
        """The policy for a run's settings (--learn-per-step and the PPO settings it scales).
        ``on`` with the slow profile is that profile, the ladder climbing as in ``auto``: its
        top level on a 256-unit network had the KL bound stop updates within half an epoch
        (HalfCheetah: 65 and 74 after 100k env steps against 540 and 469 at level 0)."""
        mode = "auto" if slow_profile and config.learn_per_step == "on" else config.learn_per_step
        return cls(mode, config.epochs, config.minibatch_size, config.train_batch_size, config.target_kl,
                   config.async_sampling)

    def plan(self) -> dict:
        epochs, minibatch_size = self.levels[self.level]
        return {"epochs": epochs, "minibatch_size": minibatch_size,
                "target_kl": self.target_kl if self.level > 0 else None}

    def observe(self, busy_s: float, wall_s: float, epochs_run: float | None = None) -> None:
        """How the last update went: the seconds the learner was busy and the wall seconds
        of the log period it ended, and the epochs it ran (fewer than planned where the KL
        bound stopped it)."""
        if self.mode != "auto":
            return
        if self.settle:
            self.settle -= 1
            return
        epochs, minibatch_size = self.levels[self.level]
        self.periods.append((busy_s, wall_s))
        self.epochs_run.append(epochs if epochs_run is None else epochs_run)
        if len(self.periods) < WINDOW:
            return
        # The window's share, not each period's: clients that send together bring batches in bursts
        share = sum(b for b, _ in self.periods) / max(sum(w for _, w in self.periods), 1e-9)
        ran, level = statistics.median(self.epochs_run), self.level
        below_epochs, below_minibatch = self.levels[max(level - 1, 0)]
        if level > 0 and ran / minibatch_size < below_epochs / below_minibatch:
            level -= 1   # the KL bound cut this level below the gradient steps of the one beneath: no use
        elif self.level_for(share) > level and ran >= epochs:
            level += 1   # idle, and the trust region left room at this level: one more
        else:
            level = min(level, self.level_for(share))   # too busy: down
        if level != self.level:
            self.level, self.settle = level, 1
            self.periods.clear()
            self.epochs_run.clear()

    def level_for(self, share: float) -> int:
        """The highest level whose cost, doubling per level from the current one's
        ``share``, stays at most the target."""
        if share <= 0:
            return len(self.levels) - 1
        steps = math.floor(math.log2(self.target / share))
        return max(0, min(len(self.levels) - 1, self.level + steps))
