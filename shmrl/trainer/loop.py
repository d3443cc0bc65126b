"""The one training loop: take a batch -> update -> publish -> log -> checkpoint -> stop?

``Training`` is a run that trains (``shmrl.trainer.lifecycle.Run`` gives it its life): it
holds the run's set-up, serving side, learners (PPO or SAC), supervisor, metrics log, clock, evaluator and
last metrics row, and loops until the stop return (or a self-play run's stop win rate,
``shmrl.trainer.win_rate``) or the step or time budget, and always ends by writing the
policy (the best evaluated, where a self-play run is evaluated), a checkpoint and
summary.json. The serving side (``shmrl.server.serving``) answers the clients in a thread
of its own and hands over one batch at a time; torch releases the GIL during the update,
so it keeps answering.

Two ways in: ``train_with_simulators`` opens the run's transports and starts its
simulators (``python -m shmrl.run``, ``shmrl.train``); ``train_with_servers`` trains on
the clients of transports the caller brings.
"""
from __future__ import annotations

import dataclasses

import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shmrl.config.settings import (DECLARED_ENV, EXIT_BUDGET, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_SOLVED,
                                   saved_config, validate)
from shmrl.core.episode import EpisodeBatch
from shmrl.files.checkpoint import CheckpointError
from shmrl.files.logdir import LogdirWriteError, open_logdir, replace_file, write_json_file
from shmrl.server.serving import Serving
from shmrl.trainer.learn_per_step import LearnPerStep, simulators_slow
from shmrl.trainer.lifecycle import Run, RunFailed, open_run, signals_held
from shmrl.model.torch_import import start_torch_import, started_since
from shmrl.trainer.report import (DETAIL_EVERY, Clock, LearnerWall, books, metrics_row, progress_line, run_summary,
                                  share, wall_line)
from shmrl.trainer.resume import policy_file, save_checkpoint, spent_budget
from shmrl.trainer.setup import Setup, make_learners, make_serving, set_up, switch_to_sac, switch_to_slow
from shmrl.trainer.win_rate import WinRateEval

log = logging.getLogger("shmrl.run")

__all__ = ["RunFailed", "Training", "UpdateCounts", "train_with_servers", "train_with_simulators", "update"]


def train_with_simulators(config, t_start: float, launcher=None, given: set[str] | None = None) -> tuple[int, dict]:
    """Train ``config``'s run: its simulators (placed by ``launcher``, default: forked
    here) and external clients when it opens a TCP port; returns (exit status, summary).
    ``given``: the settings the command line gave (``setup.set_up``). ``--env declared``:
    the run waits for a client to declare its spaces first (``shmrl.server.lobby``)."""
    spec = tcp = None
    if config.env == DECLARED_ENV:
        from shmrl.server.lobby import wait_for_spaces

        validate(config)
        waited = wait_for_spaces(config, t_start)
        if waited is None:
            print(f"time budget exhausted: no client declared its spaces within --max-seconds {config.max_seconds:g}",
                  flush=True)
            return EXIT_BUDGET, {}
        env, spec, tcp = waited
        config = dataclasses.replace(config, env=env)   # the default env, where the first client declared nothing
    try:
        setup = set_up(config, given=given, spec=spec)
        servers, supervisor = open_run(setup, launcher, tcp)
    except RunFailed as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILED, {}
    except BaseException:
        if tcp is not None:
            tcp.close()
        raise
    return Training(setup, servers, supervisor, t_start).run()


def train_with_servers(config, servers: list) -> tuple[int, dict]:
    """Train as ``python -m shmrl.run`` does, on the clients that come through ``servers``
    (transports of your own: see examples/custom_transport.py) instead of simulators it
    starts; returns (exit status, summary). Every server is closed at the end."""
    return Training(set_up(config, servers_given=True), servers, None, time.time()).run()


@dataclass
class UpdateCounts:
    """The trainer's count of updates, written and read by the training thread only (the
    serving thread is given the update with each publish, for the league)."""
    done: int = 0               # updates trained: the metrics row's "update", summary.json's "updates"
    skipped: int = 0            # a non-finite loss or gradient: the weights stayed
    skipped_in_a_row: int = 0
    last: dict | None = None    # the stats of update ``done``, counted with it: its metrics row's own numbers


def update(serving: Serving, learners: dict, counts: UpdateCounts, batches: dict, version: int,
           progress: float = 0.0, plan: dict | None = None) -> dict | None:
    """One update of each policy's learner (PPO or SAC: ``shmrl.model.algorithm``) on its
    chunks (``batches``: policy id -> its batches, taken at weights ``version``), then
    publish the new weights (and observation statistics); ``counts`` counts it.
    ``progress``: the fraction of the step budget trained; ``plan``: the epochs, minibatch
    size and target KL of a PPO update (``LearnPerStep``; default: the config's). The
    stats are their means weighted by steps, and each policy's under ``policies``. A
    learner that took its chunks and learned nothing yet (SAC's warm-up) publishes
    nothing: the serving side is told it may hand over the next batch."""
    t0 = time.perf_counter()
    if not batches:   # nothing to learn from: a new version releases any client held back
        serving.publish({})
        return None
    chunks = {pid: EpisodeBatch.concat(b) for pid, b in batches.items()}
    per_policy, lags, skipped, waiting = {}, [], {}, {}
    for pid, sub in chunks.items():
        learner = learners[pid]
        seq = sub.weights_seq_no
        scale = learner.config.reward_scale * serving.store.policies[pid].reward_scale()

        def publish(weights, pid=pid, learner=learner):   # in the middle of a long update (SAC)
            serving.publish({pid: weights}, action_dists={pid: learner.action_dist})

        result = learner.learn(sub, progress, reward_scale=scale, plan=plan, publish=publish)
        if result is None:   # taken, nothing learned yet
            waiting[pid] = sub
            continue
        if "skipped" in result:   # the weights stay as they were; its steps are dropped
            skipped[pid] = result["skipped"]
            continue
        lags.extend((version - seq[seq >= 0]).tolist())
        per_policy[pid] = {**result, "batch_steps": sub.num_steps, "reward_scale": scale}
    if waiting:
        with signals_held():
            serving.store.trained(waiting)
    if skipped:
        skip_update(serving, counts, {pid: chunks[pid] for pid in skipped}, skipped)
        if not per_policy:
            serving.publish({})   # the weights as they were: the clients waiting for new ones go on
            return None
    else:
        counts.skipped_in_a_row = 0
    if not per_policy:
        serving.taken()
        return None
    total = sum(p["batch_steps"] for p in per_policy.values())
    row_stats = type(learners[next(iter(per_policy))]).ROW_STATS
    stats = {k: sum(p[k] * p["batch_steps"] for p in per_policy.values()) / total
             for k in (*row_stats, "lr", "reward_scale", "epochs_run")}
    weights = {pid: learners[pid].published_weights() for pid in per_policy}
    with signals_held():   # counted whole: its steps trained, its number, its weights and its stats, or none
        serving.store.trained({pid: chunks[pid] for pid in per_policy})   # only this thread writes steps_trained
        counts.done += 1
        serving.publish(weights, update=counts.done, action_dists={pid: learners[pid].action_dist for pid in weights})
        stats.update(update=counts.done, batch_steps=total, policy_lag=float(np.mean(lags)) if lags else 0.0,
                     train_s=time.perf_counter() - t0, weights_seq_no=serving.weights_seq_no, policies=per_policy,
                     row_stats=row_stats)
        counts.last = stats
    return stats


def skip_update(serving: Serving, counts: UpdateCounts, chunks: dict, skipped: dict) -> None:
    """Count an update skipped for a non-finite loss or gradient (``skipped``: policy id ->
    why; ``chunks``: theirs, whose steps are dropped). Those policies keep their weights."""
    counts.skipped += 1
    counts.skipped_in_a_row += 1
    for pid, why in skipped.items():
        log.warning("update skipped: policy %r: %s (%d in a row)", pid, why, counts.skipped_in_a_row)
    serving.store.skipped(chunks, "update skipped: loss or gradient not finite")


class Training(Run):
    """A run that trains: the loop and everything it reads and writes."""

    def __init__(self, setup: Setup, servers: list, supervisor, t_start: float):
        super().__init__(setup, servers, supervisor, t_start)
        config = setup.config
        self.counts = UpdateCounts(done=setup.resumed[2]["update"] if setup.resumed else 0)
        self.learners: dict | None = None    # policy id -> its learner (PPO or SAC), once torch is loaded
        self.metrics = None                  # MetricsLog, once the loop begins
        self.clock = Clock(t_start, 0)
        self.judge = WinRateEval(config.env, setup.policy_specs, config.eval_every, config.eval_games,
                                 config.stop_win_rate, config.seed)
        self.learning: LearnPerStep | None = None   # how much to learn per batch, once the loop begins
        self.row: dict | None = None         # the last row written to metrics.jsonl
        self.evaluated_at_end = False        # a budget's end evaluated the last update after its row
        self.budget = "step"                 # the budget that ended the run, if one did
        self.lock = None                     # the log folder's, held from the start to the end
        self.wall = LearnerWall()            # whether the learner is the wall, said once
        self.torch_import = started_since(t_start)   # torch's import in a thread (begun by run.train with --ray)

    def run(self) -> tuple[int, dict]:
        spent = spent_budget(self.config, self.setup.resumed)
        if spent:
            super().close()
            return EXIT_BUDGET, spent
        return super().run()

    def take_folders(self) -> None:
        super().take_folders()   # --record's dataset first: a busy one leaves no log folder made
        # The last thing that can refuse the run (another run writes there): nothing is written before it.
        config, logdir = self.config, Path(self.config.logdir)
        self.lock = open_logdir(logdir, "--resume" if config.resume and Path(config.resume) == logdir
                                else "--logdir", self.setup.resumed[2]["update"] if self.setup.resumed else None)

    def make_serving(self) -> Serving:
        serving = make_serving(self.setup, self.servers, self.supervisor)
        self.clock = Clock(self.t_start, serving.store.steps_received)
        return serving

    def prepare(self) -> None:
        # The first policy is published and served before torch is loaded (about 2 s): the
        # simulators start (their fork server loads numpy and onnxruntime) and sample while this
        # process imports torch (begun here, or while joining a Ray cluster); make_learners waits for it.
        self.torch_import = self.torch_import or start_torch_import()
        self.learners = make_learners(self.setup)

    def loop(self) -> int:
        """Take a batch -> update -> publish -> (evaluate) -> log -> checkpoint, until the
        stop return or the stop win rate (exit 0), or the step or time budget (exit 1)."""
        from shmrl.files.metrics import MetricsLog

        config, store = self.config, self.serving.store
        self.metrics = MetricsLog(Path(config.logdir), append=bool(self.setup.resumed), tensorboard=config.tensorboard)
        # A terminal gets a line per update; a log file one every 10 s (metrics.jsonl has all).
        log_every = config.log_every if config.log_every is not None else (0.0 if sys.stdout.isatty() else 10.0)
        last_line, lines = -math.inf, 0
        learning = self.learning = LearnPerStep.of(config, (self.setup.profile or {}).get("name") == "slow")
        self.clock.start_loop()
        while True:
            batch = self.serving.next_batch(0.05)
            self.check_health()
            if self.counts.skipped_in_a_row >= config.max_skipped_updates:
                raise RunFailed(f"{self.counts.skipped_in_a_row} updates in a row were skipped: their loss or "
                                "gradient was not finite (see the WARNINGs above); the weights are those before them")
            if len(store.returns) >= store.returns.maxlen and store.return_mean() >= config.stop_return:
                return EXIT_SOLVED
            out_of_time = config.max_seconds is not None and time.time() - self.clock.t_start >= config.max_seconds
            if store.steps_accepted >= config.max_env_steps or out_of_time:
                if store.steps_accepted < config.max_env_steps:
                    self.budget = "time"
                self.evaluate_last()
                return EXIT_BUDGET
            if not batch:
                continue
            if self.setup.deciding:   # the first batch says how fast the simulators are: keep or switch
                if self.choose_profile(batch[0]):
                    config = self.config
                    learning = self.learning = LearnPerStep.of(config, self.setup.profile["name"] == "slow")
                    continue   # the batch was the other profile's: dropped (SAC's buffer took it)
            t0 = time.perf_counter()
            stats = update(self.serving, self.learners, self.counts, *batch,
                           progress=store.steps_trained / config.max_env_steps, plan=learning.plan())
            self.clock.trained(time.perf_counter() - t0)
            if not stats:
                continue
            busy, wall = self.clock.period()
            stats.update(learner_share=share(busy, wall), learn_level=learning.level)
            learning.observe(busy, wall, stats["epochs_run"])
            if self.wall.observe(stats["update"], stats["learner_share"]):
                print(wall_line(self.wall.median(), config), flush=True)
            stats["learner_wall"] = self.wall.is_wall
            if self.judge.due(stats["update"]):
                stats.update(self.judge.evaluate(self.serving.model_bytes, stats["update"]))
            row = metrics_row(stats, self)
            now = row["elapsed_s"]   # the row's own clock: a line is due by the time the row says
            if log_every == 0 or now - last_line >= log_every or stats["update"] == 1:
                detail = config.verbose or lines % DETAIL_EVERY == 0
                latest = self.judge.mean(self.judge.latest) if self.judge.latest else None
                print(progress_line(row, store.returns, config.stop_return, config.max_env_steps, detail, latest),
                      flush=True)
                last_line, lines = now, lines + 1
            with signals_held():   # the row is in metrics.jsonl exactly when ``self.row`` says so
                self.metrics.write(row)
                self.row = row
            if config.checkpoint_every and self.counts.done % config.checkpoint_every == 0:
                self.checkpoint()
            if self.judge.solved():
                return EXIT_SOLVED

    def evaluate_last(self) -> None:
        """A budget ends the run: the updates since the last evaluation are evaluated too (they
        may be the best), into the last row as the run ends (``final_row``)."""
        if self.counts.last is not None and self.judge.stale(self.counts.done):
            self.counts.last.update(self.judge.evaluate(self.serving.model_bytes, self.counts.done))
            self.evaluated_at_end = True

    def choose_profile(self, chunks: dict) -> bool:
        """The profile the run goes on with, from the env steps per second its simulators
        delivered until the first batch (``simulators_slow``): slow ones get SAC (--algo
        auto, where SAC takes the env and every client can sample its actions), else the
        slow profile (where the env has one). True if it switched (``learners`` then holds
        the new learners, and ``chunks`` went into SAC's buffer or were dropped)."""
        from shmrl.model.algorithm import algorithm

        setup, rate = self.setup, self.serving.first_batch_rate
        slow, line = simulators_slow(rate, setup.config.slow_rate)
        auto = None
        if setup.sac is not None:   # --algo auto, and SAC takes the env
            dists = algorithm("sac").action_dists()
            unable = self.serving.hub.unable_to_sample(dists) if slow else []
            if slow and not unable:
                print(f"{line.split(':')[0]}: --algo auto trains SAC (off-policy, a replay buffer)", flush=True)
                self.learners.update(switch_to_sac(setup, self.serving, chunks, rate))
                return True
            auto = ("--algo auto: PPO, the simulators are fast" if not slow else
                    f"--algo auto: PPO, {', '.join(unable[:4])}{' and more' if len(unable) > 4 else ''} cannot "
                    f"sample SAC's actions (their PING lists no {' and '.join(dists)})")
            setup.sac = None
            print(auto, flush=True)
        print(line, flush=True)
        if slow and setup.slow is not None:
            self.learners.update(switch_to_slow(setup, self.serving, chunks, rate))
        else:
            why = line if setup.slow is not None or not slow else f"{line.split(':')[0]}: no slow profile for this env"
            setup.slow, setup.profile = None, {**setup.profile, "name": "preset", "why": why, "sim_rate": rate}
        if auto:
            setup.profile["algo"] = auto
        return setup.profile["name"] == "slow"

    def checkpoint(self) -> Path:
        config = self.config
        return save_checkpoint(Path(config.logdir), self.counts.done, self.serving.weights_seq_no, self.serving.store,
                               self.learners, saved_config(config), config.keep_checkpoints, self.setup.multiagent)

    def end(self, status: int, error: str | None, unsaid: list) -> tuple[int, dict]:
        if not unsaid:   # a write that failed (a full disk): the rows written stay as they are
            self.final_row(unsaid)
        return self.finish(status, error, unsaid)

    def close(self) -> None:
        try:
            if self.metrics:
                self.metrics.close()
        finally:
            super().close()
            if self.lock is not None:   # None: the run was refused before it took its log folder
                self.lock.release()

    def final_row(self, unsaid: list) -> None:
        """The last update's row, written again with the counts and the return as the run
        ended (what summary.json says, from the same numbers) where anything came in after
        it: metrics.jsonl, and a plot of it, ends where the run did (at the return that
        solved it); written for the first time where a signal ended the run between the
        update and its row; written again with the evaluation a budget's end added
        (``evaluate_last``)."""
        stats, row = self.counts.last, self.row
        if stats is None or self.metrics is None:
            return
        written, now = row is not None and row["update"] == stats["update"], books(self)
        if written and not self.evaluated_at_end and {k: row[k] for k in now} == now:
            return
        # A signal before the loop took the update's share of the learner's time: the run's so far.
        stats.setdefault("learner_share", self.clock.learner_share())
        stats.setdefault("learn_level", self.learning.level if self.learning else 0)
        stats.setdefault("learner_wall", self.wall.is_wall)
        try:
            (self.metrics.rewrite_last if written else self.metrics.write)(metrics_row(stats, self))
        except LogdirWriteError as e:
            unsaid.append(str(e))

    def finish(self, status: int, error: str | None, unsaid: list) -> tuple[int, dict]:
        """Write the policy (the one that won most where the run was evaluated), a checkpoint
        (the last weights) and summary.json, and say how the run ended; returns the exit
        status (3 if any of them could not be written) and the summary. ``unsaid``: errors
        not printed yet; they and what cannot be written here make one ``error:`` line."""
        setup, serving, logdir = self.setup, self.serving, Path(self.config.logdir)
        problems, written = list(unsaid), None
        try:   # first what a resume needs (each file whole or not at all: a full disk leaves the last one)
            written = self.checkpoint() if self.learners is not None else None
        except CheckpointError as e:
            problems.append(str(e))
        try:
            for pid, model in {**serving.model_bytes, **self.judge.best_models()}.items():
                replace_file(logdir / policy_file(pid, setup.multiagent), model)
        except LogdirWriteError as e:
            problems.append(str(e))
        if len(problems) > len(unsaid):
            status, error = EXIT_FAILED, "; ".join(dict.fromkeys(([error] if error else []) + problems))
        result = {**run_summary(self, status, error), **self.judge.summary(), "profile": setup.profile,
                  "device": setup.device, "config": saved_config(self.config)}
        if self.learners is not None:
            result["checkpoint"] = str(written) if written else None
        try:
            write_json_file(logdir / "summary.json", result)
        except LogdirWriteError as e:
            problems.append(f"{e} (no summary.json written)")
        if problems:
            print(f"error: {'; '.join(dict.fromkeys(problems))}", file=sys.stderr, flush=True)
        verdict = {EXIT_SOLVED: "solved", EXIT_BUDGET: f"{self.budget} budget exhausted", EXIT_FAILED: "failed",
                   EXIT_INTERRUPTED: "interrupted"}.get(status, "terminated")
        won = (f"; the policy written won {result['win_rate']:.3f} of its evaluation games against a random legal "
               "player" if "win_rate" in result else "")
        print(f"{verdict}: return {result['return_mean']:.1f} over the last {len(serving.store.returns)} "
              f"episodes after {result['env_steps']} env steps in {result['wall_s']:.2f} s{won}; wrote {logdir}",
              flush=True)
        return status, result
