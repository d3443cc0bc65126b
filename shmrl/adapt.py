"""How much the learner learns from each batch, chosen by how busy it is: the one policy
that spends a slow simulator's idle learner on more learning per env step.

When the simulators, not the learner, are the bottleneck (a game engine, a robot, external
clients delivering a few hundred env steps per second), the learner waits for batches
most of the time. That time is spent on more gradient steps per batch, inside PPO's trust
region: a ladder of levels, each twice the gradient steps of the one below it, first by
halving the minibatch (down to MIN_MINIBATCH steps), then by doubling the epochs, up to
MAX_LEVEL. Above level 0 every update stops early once the approximate KL from the policy
it began with passes 1.5 x --target-kl (``PPO.update``), so more epochs never move the
policy further than that; a batch that needs few steps gets few.

The level follows the learner's busy share (``report.Clock``: the fraction of wall time
spent in update and publish) over the last WINDOW updates: it goes to the highest level
whose cost, doubling per level, would keep that share at most the target; it rises only
when every share of the window says so, and falls when their median does (the shares of a
loaded machine jump). With --async the simulators sample on while the learner trains, so
its idle time is free: the target is ASYNC_TARGET. Without, they wait for every update,
and a longer update costs env steps per second: the target is SYNC_TARGET, which a fast
simulator's learner (CartPole's, busy 20-40% of the time) stays above. Either way a fast
simulator keeps level 0, the preset's settings, unchanged.
``--learn-per-step off`` keeps level 0; ``on`` starts at the top level and stays there.
"""
from __future__ import annotations

import math
import statistics
from collections import deque

MODES = ("auto", "off", "on")
MIN_MINIBATCH = 64      # steps; below this a gradient step costs nearly as much as at 64 and is noisier
MAX_LEVEL = 4           # at most 16 times the preset's gradient steps per batch
ASYNC_TARGET = 0.5      # the highest busy share a level may be expected to cost, with --async
SYNC_TARGET = 0.2       # without: each update's seconds are seconds the simulators wait
WINDOW = 5              # updates whose busy share decide the level (the first after a change is skipped)


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
    ``observe(share)``: the busy share of the log period that update ended."""

    def __init__(self, mode: str, epochs: int, minibatch_size: int, batch_size: int, target_kl: float,
                 async_sampling: bool):
        if mode not in MODES:
            raise ValueError(f"learn-per-step mode must be one of {', '.join(MODES)}, not {mode!r}")
        self.mode, self.target_kl = mode, target_kl
        self.target = ASYNC_TARGET if async_sampling else SYNC_TARGET
        self.levels = ladder(epochs, minibatch_size, batch_size)
        self.level = len(self.levels) - 1 if mode == "on" else 0
        self.shares: deque[float] = deque(maxlen=WINDOW)
        self.settle = 1   # updates not counted: the first (torch warms up) and the first after a change

    def plan(self) -> dict:
        epochs, minibatch_size = self.levels[self.level]
        return {"epochs": epochs, "minibatch_size": minibatch_size,
                "target_kl": self.target_kl if self.level > 0 else None}

    def observe(self, share: float) -> None:
        if self.mode != "auto":
            return
        if self.settle:
            self.settle -= 1
            return
        self.shares.append(share)
        if len(self.shares) < WINDOW:
            return
        up, down = self.level_for(max(self.shares)), self.level_for(statistics.median(self.shares))
        level = up if up > self.level else down if down < self.level else self.level
        if level != self.level:
            self.level, self.settle = level, 1
            self.shares.clear()

    def level_for(self, share: float) -> int:
        """The highest level whose cost, doubling per level from the current one's
        ``share``, stays at most the target."""
        if share <= 0:
            return len(self.levels) - 1
        steps = math.floor(math.log2(self.target / share))
        return max(0, min(len(self.levels) - 1, self.level + steps))
