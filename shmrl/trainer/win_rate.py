"""A self-play run's win rate against a uniformly random legal player, measured while it
trains (``--eval-every U``), and what follows from it.

Every U updates each policy plays ``--eval-games`` games against the random player
(greedy, taking the seats in turn: ``shmrl.client.multi_agent.play``, what ``python -m
shmrl.eval --opponent random`` plays). The win rate goes into the metrics row (and so
TensorBoard and the progress line); the model that won most so far is kept, and is the
policy the run writes when it ends, however it ends (the step or time budget, the stop
rule, Ctrl-C): a budget leaves the best policy seen, not merely the last (the updates
since the last evaluation are evaluated too when a budget ends the run).
``--stop-win-rate W`` ends the run (solved) once every policy's latest win rate reaches W.

An evaluation is a sample of a few hundred games (200: a standard error of 0.02 at a rate
of 0.9), and the best of many samples flatters its policy. So an evaluation that would
become the best so far, or reach W, is played again with as many games and the two
pooled before it counts; and a preset sets W a margin above the rate it means
(presets.toml, connect_four).

The games run in the training thread between updates (connect_four: about 0.2 s for 200
games of a trained policy), on the same cores the simulators use.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

log = logging.getLogger("shmrl.run")


@dataclass
class Evaluated:
    """One evaluation of one policy's model."""
    win_rate: float
    update: int
    model: bytes


class WinRateEval:
    """The evaluations of a run's policies (ids ``policy_ids``) in env ``env``; off
    (``due`` never true) when ``every`` is 0."""

    def __init__(self, env, policy_ids, every: int, games: int, stop_at: float, seed: int = 0):
        self.env, self.policy_ids = env, list(policy_ids)
        self.every, self.games, self.seed = every, games, seed
        self.stop_at = math.inf if stop_at is None else stop_at   # None: no stop rule
        self.latest: dict[str, Evaluated] = {}
        self.best: dict[str, Evaluated] = {}
        self.evaluations = 0

    def due(self, update: int) -> bool:
        return self.every > 0 and update % self.every == 0

    def evaluate(self, models: dict, update: int) -> dict:
        """Play each policy of ``models`` (policy id -> its ONNX model bytes) against the
        random player; the metrics row's part: ``win_rate`` (the mean over the policies),
        ``best_win_rate``, ``eval_s``, and each policy's as ``win_rate_by_policy`` when
        there are several."""
        from shmrl.client.multi_agent import play   # the client side's numpy and onnxruntime only

        t0 = time.perf_counter()
        self.evaluations += 1
        for pid in self.policy_ids:
            # A new opponent's dice each time: the same games again would flatter one policy.
            seed = self.seed * 1_000_003 + 2 * self.evaluations
            try:
                rate = play(self.env, models[pid], "random", episodes=self.games, seed=seed, num_envs=16)["win_rate"]
                if rate >= min(self.stop_at, self.best[pid].win_rate if pid in self.best else 0.0):   # confirm it
                    again = play(self.env, models[pid], "random", episodes=self.games, seed=seed + 1, num_envs=16)
                    rate = (rate + again["win_rate"]) / 2
            except Exception as e:   # an env the learner cannot step (spaces only, for external clients)
                log.warning("--eval-every: no more evaluations: the learner cannot play %s: %s: %s",
                            self.policy_ids, type(e).__name__, e)
                self.every = 0
                return {}
            now = self.latest[pid] = Evaluated(rate, update, models[pid])
            if pid not in self.best or now.win_rate >= self.best[pid].win_rate:   # a tie: the later, trained longer
                self.best[pid] = now
        row = {"win_rate": self.mean(self.latest), "best_win_rate": self.mean(self.best),
               "eval_s": time.perf_counter() - t0}
        if len(self.policy_ids) > 1:
            row["win_rate_by_policy"] = {pid: e.win_rate for pid, e in self.latest.items()}
        return row

    def stale(self, update: int) -> bool:
        """Evaluations are on and the weights of ``update`` were not evaluated."""
        return self.every > 0 and update > 0 and any(
            pid not in self.latest or self.latest[pid].update < update for pid in self.policy_ids)

    def mean(self, evaluated: dict) -> float:
        return sum(e.win_rate for e in evaluated.values()) / len(evaluated)

    def solved(self) -> bool:
        """Every policy's latest win rate reached the stop win rate."""
        return len(self.latest) == len(self.policy_ids) and all(
            e.win_rate >= self.stop_at for e in self.latest.values())

    def best_models(self) -> dict:
        """policy id -> the model bytes that won most (only the policies evaluated)."""
        return {pid: e.model for pid, e in self.best.items()}

    def summary(self) -> dict:
        """summary.json's part: the win rate of the policies written and when they were
        evaluated, the latest win rate, the number of evaluations (empty if none ran)."""
        if not self.best:
            return {}
        out = {"win_rate": self.mean(self.best), "win_rate_update": {pid: e.update for pid, e in self.best.items()},
               "win_rate_latest": self.mean(self.latest), "evaluations": self.evaluations}
        if len(self.policy_ids) > 1:
            out["win_rate_by_policy"] = {pid: e.win_rate for pid, e in self.best.items()}
        return out
