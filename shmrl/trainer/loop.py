"""The one training loop: take a batch -> update -> publish -> log -> checkpoint.

``train_run`` sets a run up (env, policies, a checkpoint to resume, the transports, the
simulators), then loops until the stop return (or a self-play run's stop win rate,
``shmrl.trainer.win_rate``) or the step or time budget, and always ends by writing the policy (the
best evaluated, where a self-play run is evaluated), a checkpoint and summary.json. The serving side (``shmrl.server.serving``)
answers the clients in a thread of its own and hands over one batch at a time; torch
releases the GIL during the update, so it keeps answering.
"""
from __future__ import annotations

import logging
import math
import sys
import time
from pathlib import Path

import numpy as np

from shmrl.trainer.learn_per_step import LearnPerStep, simulators_slow
from shmrl.files.checkpoint import CheckpointError
from shmrl.config.settings import EXIT_BUDGET, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_SOLVED, ConfigError, saved_config
from shmrl.core.episode import EpisodeBatch
from shmrl.files.logdir import LogdirWriteError, open_logdir, replace_file, write_json_file
from shmrl.trainer.report import DETAIL_EVERY, Clock, metrics_row, progress_line, run_summary, share
from shmrl.trainer.resume import policy_file, save_checkpoint, spent_budget
from shmrl.server.serving import Serving, open_transports
from shmrl.trainer.setup import Setup, make_ppos, make_serving, set_up, switch_to_slow
from shmrl.trainer.win_rate import WinRateEval

log = logging.getLogger("shmrl.run")


class RunFailed(RuntimeError):
    """A part of the run failed (a simulator died, a transport broke)."""


def update(serving: Serving, ppos: dict, batches: dict, version: int, progress: float = 0.0,
           plan: dict | None = None) -> dict | None:
    """One PPO update of each policy on its chunks (``batches``: policy id -> its batches,
    taken at weights ``version``), then publish the new weights (and observation
    statistics). ``progress``: the fraction of the step budget trained; ``plan``: the
    epochs, minibatch size and target KL of this update (``adapt.LearnPerStep``; default:
    the config's). The stats are their means weighted by steps, and each policy's under
    ``policies``."""
    t0 = time.perf_counter()
    if not batches:   # nothing to learn from: a new version releases any client held back
        serving.publish({})
        return None
    chunks = {pid: EpisodeBatch.concat(b) for pid, b in batches.items()}
    per_policy, lags, skipped = {}, [], {}
    for pid, sub in chunks.items():
        ppo = ppos[pid]
        seq = sub.weights_seq_no
        scale = ppo.config.reward_scale * serving.store.policies[pid].reward_scale()
        result = ppo.update(ppo.make_batch(sub, reward_scale=scale), progress, **(plan or {}))
        if "skipped" in result:   # the weights stay as they were; its steps are dropped
            skipped[pid] = result["skipped"]
            continue
        lags.extend((version - seq[seq >= 0]).tolist())
        per_policy[pid] = {**result, "batch_steps": sub.num_steps, "reward_scale": scale}
        if result["ratio_out_of_bounds"] and serving.updates % 100 == 0:   # now and then, not every update
            from shmrl.model.ppo import MAX_LOG_RATIO   # loaded already (torch is, by now)

            log.warning("policy %r: %.1f%% of the batch's steps have a behaviour action_logp more than %g from "
                        "the policy's own (a client's absurd log-probabilities): they get no policy gradient",
                        pid, 100 * result["ratio_out_of_bounds"], MAX_LOG_RATIO)
        ppo.update_obs_stats(sub)
    if skipped:
        skip_update(serving, {pid: chunks[pid] for pid in skipped}, skipped)
        if not per_policy:
            serving.publish({})   # the weights as they were: the clients waiting for new ones go on
            return None
    else:
        serving.skipped_in_a_row = 0
    serving.store.trained({pid: chunks[pid] for pid in per_policy})   # only this thread writes steps_trained
    serving.updates += 1
    serving.publish({pid: ppos[pid].published_weights() for pid in per_policy})
    total = sum(p["batch_steps"] for p in per_policy.values())
    stats = {k: sum(p[k] * p["batch_steps"] for p in per_policy.values()) / total
             for k in ("pi_loss", "v_loss", "entropy", "approx_kl", "clip_frac", "lr", "reward_scale", "epochs_run")}
    stats.update(update=serving.updates, batch_steps=total, policy_lag=float(np.mean(lags)) if lags else 0.0,
                 train_s=time.perf_counter() - t0, weights_seq_no=serving.weights_seq_no, policies=per_policy)
    return stats


def skip_update(serving: Serving, chunks: dict, skipped: dict) -> None:
    """Count an update skipped for a non-finite loss or gradient (``skipped``: policy id ->
    why; ``chunks``: theirs, whose steps are dropped). Those policies keep their weights."""
    serving.updates_skipped += 1
    serving.skipped_in_a_row += 1
    for pid, why in skipped.items():
        log.warning("update skipped: policy %r: %s (%d in a row)", pid, why, serving.skipped_in_a_row)
    serving.store.skipped(chunks, "update skipped: loss or gradient not finite")


def check_health(serving: Serving, supervisor) -> None:
    if supervisor and supervisor.failure:
        raise RunFailed(supervisor.failure)
    if serving.failure:
        raise RunFailed(f"the learner's serving thread failed: {serving.failure!r}")


def loop(setup: Setup, serving: Serving, ppos: dict, supervisor, metrics, clock: Clock, last: dict,
         judge: WinRateEval) -> int:
    """Take a batch -> update -> publish -> (evaluate) -> log -> checkpoint, until the stop
    return or the stop win rate (exit 0), or the step or time budget (exit 1; ``last``
    ["budget"] says which). ``last``: the last update's stats and row, kept there."""
    config, store = setup.config, serving.store
    # A terminal gets a line per update; a log file one every 10 s (metrics.jsonl has all).
    log_every = config.log_every if config.log_every is not None else (0.0 if sys.stdout.isatty() else 10.0)
    last_line, lines = -math.inf, 0
    learning = LearnPerStep.of(config, (setup.profile or {}).get("name") == "slow")
    clock.start_loop()
    while True:
        batch = serving.next_batch(0.05)
        check_health(serving, supervisor)
        if serving.skipped_in_a_row >= config.max_skipped_updates:
            raise RunFailed(f"{serving.skipped_in_a_row} updates in a row were skipped: their loss or gradient "
                            "was not finite (see the WARNINGs above); the weights are those before them")
        if len(store.returns) >= store.returns.maxlen and store.return_mean() >= config.stop_return:
            return EXIT_SOLVED
        out_of_time = config.max_seconds is not None and time.time() - clock.t_start >= config.max_seconds
        if store.steps_accepted >= config.max_env_steps or out_of_time:
            if store.steps_accepted < config.max_env_steps:
                last["budget"] = "time"
            evaluate_last(judge, serving, last)
            return EXIT_BUDGET
        if not batch:
            continue
        if setup.slow is not None:   # the first batch says how fast the simulators are: keep or switch
            if choose_profile(setup, serving, ppos, batch[0]):
                config, learning = setup.config, LearnPerStep.of(setup.config, slow_profile=True)
                continue   # the batch was the other profile's: dropped
        plan = learning.plan()
        t0 = time.perf_counter()
        stats = update(serving, ppos, *batch, progress=store.steps_trained / config.max_env_steps, plan=plan)
        clock.trained(time.perf_counter() - t0)
        if not stats:
            continue
        busy, wall = clock.period()
        stats.update(learner_share=share(busy, wall), learn_level=learning.level)
        learning.observe(busy, wall, stats["epochs_run"])
        if judge.due(stats["update"]):
            stats.update(judge.evaluate(serving.model_bytes, stats["update"]))
        row = metrics_row(stats, serving, supervisor, clock)
        last.update(stats=stats, row=row, written=False)
        now = row["elapsed_s"]   # the row's own clock: a line is due by the time the row says
        if log_every == 0 or now - last_line >= log_every or stats["update"] == 1:
            detail = config.verbose or lines % DETAIL_EVERY == 0
            latest = judge.mean(judge.latest) if judge.latest else None
            print(progress_line(row, store.returns, config.stop_return, config.max_env_steps, detail, latest),
                  flush=True)
            last_line, lines = now, lines + 1
        metrics.write(row)
        last["written"] = True
        if config.checkpoint_every and serving.updates % config.checkpoint_every == 0:
            checkpoint(setup, serving, ppos)
        if judge.solved():
            return EXIT_SOLVED


def evaluate_last(judge: WinRateEval, serving: Serving, last: dict) -> None:
    """A budget ends the run: the updates since the last evaluation are evaluated too (they
    may be the best), into the last row as the run ends (``final_row``)."""
    if last.get("row") is not None and judge.stale(serving.updates):
        last["stats"].update(judge.evaluate(serving.model_bytes, serving.updates))
        last["evaluated_at_end"] = True


def choose_profile(setup: Setup, serving: Serving, ppos: dict, chunks: dict) -> bool:
    """The profile the run goes on with, from the env steps per second its simulators
    delivered until the first batch (``adapt.simulators_slow``); True if it switched to
    the slow one (``ppos`` then holds the new PPOs and ``chunks`` were dropped)."""
    rate = serving.first_batch_rate
    slow, line = simulators_slow(rate, setup.config.slow_rate)
    print(line, flush=True)
    if not slow:
        setup.slow, setup.profile = None, {"name": "preset", "why": line, "sim_rate": rate}
        return False
    ppos.update(switch_to_slow(setup, serving, chunks, rate))
    return True


def checkpoint(setup: Setup, serving: Serving, ppos: dict) -> Path:
    config = setup.config
    return save_checkpoint(Path(config.logdir), serving.updates, serving.weights_seq_no, serving.store, ppos,
                           saved_config(config), config.keep_checkpoints, setup.multiagent)


def train_run(config, t_start: float, launcher=None, given: set[str] | None = None) -> tuple[int, dict]:
    """Run one training job (the simulators of ``config``, and external clients when it
    opens a TCP port); returns (exit status, summary). Whatever happens (Ctrl-C and
    SIGTERM included) every process it started is stopped, every segment it made is
    unlinked, and the summary and a checkpoint are written. ``given``: the settings the
    command line gave (``setup_run.set_up``)."""
    from shmrl.launch.supervisor import Supervisor, make_room_for
    from shmrl.transport.ring import ShmSpaceError

    setup = set_up(config, given=given)
    config = setup.config
    if config.sims and not (launcher is not None and launcher.remote):
        make_room_for(config.sims)
    try:
        servers, addresses, shm = open_transports(config, setup.spec, setup.ring_nets(), launcher)
    except ShmSpaceError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILED, {}
    supervisor = None if not addresses else Supervisor(
        addresses, env=config.env, seed=config.seed, envs_per_sim=config.envs_per_sim, auth_token=config.auth_token,
        shm_server=shm, hang_timeout=config.hang_timeout, nice=config.sim_nice, launcher=launcher,
        max_restarts=config.max_restarts, restart_window=config.restart_window)
    return train_on(setup, servers, supervisor, t_start)


def train_with_servers(config, servers: list) -> tuple[int, dict]:
    """Train as ``python -m shmrl.run`` does, on the clients that come through ``servers``
    (transports of your own: see examples/custom_transport.py) instead of simulators it
    starts; returns (exit status, summary). Every server is closed at the end."""
    return train_on(set_up(config, servers_given=True), servers, None, time.time())


def train_on(setup: Setup, servers: list, supervisor, t_start: float) -> tuple[int, dict]:
    """The run's life: serve, start the simulators, loop, and always finish (see
    ``train_run``)."""
    from shmrl.files.metrics import MetricsLog

    config, logdir = setup.config, Path(setup.config.logdir)
    spent = spent_budget(config, setup.resumed)
    if spent:
        for server in servers:
            server.close()
        return EXIT_BUDGET, spent
    try:  # the last thing that can refuse the run (another run writes there): nothing is written before it
        lock = open_logdir(logdir, "--resume" if config.resume and Path(config.resume) == logdir else "--logdir",
                           setup.resumed[2]["update"] if setup.resumed else None)
    except ConfigError:
        for server in servers:
            server.close()
        raise
    status, error, unsaid, summary, last = EXIT_FAILED, None, [], {}, {}
    serving = ppos = metrics = None
    clock = Clock(t_start, 0)
    judge = WinRateEval(config.env, setup.policy_specs, config.eval_every, config.eval_games, config.stop_win_rate,
                        config.seed)
    try:
        serving = make_serving(setup, servers, supervisor)
        clock = Clock(t_start, serving.store.steps_received)
        serving.start()
        if supervisor:
            supervisor.start_all_in_background()
        # The first policy is published and served before torch is imported (about 2 s):
        # the simulators start (their fork server loads numpy and onnxruntime) and sample
        # on one core while this process loads torch on the other.
        ppos = make_ppos(setup)
        launch_error = supervisor.joined() if supervisor else None
        if launch_error is not None:
            raise RunFailed(f"could not start the simulators: {launch_error!r}")
        metrics = MetricsLog(logdir, append=bool(setup.resumed), tensorboard=setup.config.tensorboard)
        status = loop(setup, serving, ppos, supervisor, metrics, clock, last, judge)
    except RunFailed as e:
        error = str(e)
        print(f"error: {e}", file=sys.stderr, flush=True)
    except (LogdirWriteError, CheckpointError) as e:   # a full disk: finish() says so, with what else it could not write
        error = str(e)
        unsaid.append(error)
    except KeyboardInterrupt:
        status = EXIT_INTERRUPTED
    except SystemExit as e:  # SIGTERM (see run._terminate)
        status = e.code if isinstance(e.code, int) else EXIT_FAILED
    finally:
        if serving is not None:
            serving.stop()   # from here on the store stands still
            if serving.store.recorder is not None:   # --record: the episodes still open are written too
                serving.store.recorder.close()
        if supervisor is not None:
            supervisor.stop()
        if status in (EXIT_SOLVED, EXIT_BUDGET):
            final_row(serving, supervisor, metrics, clock, last, unsaid)
        try:
            if serving is not None:
                status, summary = finish(setup, serving, supervisor, ppos, clock, status, error, unsaid, judge,
                                         last.get("budget", "step"))
        finally:
            if metrics:
                metrics.close()
            for server in servers:
                server.close()
            lock.release()
    return status, summary


def final_row(serving: Serving, supervisor, metrics, clock: Clock, last: dict, unsaid: list) -> None:
    """The last update's row, written again with the counts and the return as the run
    ended (what summary.json says) where episodes or steps came in after it: metrics.jsonl,
    and a plot of it, ends where the run did (at the return that solved it); written for
    the first time where the run ended between the update and its row; written again with
    the evaluation a budget's end added (``evaluate_last``)."""
    row = last.get("row")
    if row is None or (last["written"] and not last.get("evaluated_at_end") and (row["env_steps"], row["episodes"]) ==
                       (serving.store.steps_received, serving.store.episodes_completed)):
        return
    try:   # not written at all where Ctrl-C came between the update and its row
        write = metrics.rewrite_last if last["written"] else metrics.write
        write(metrics_row(last["stats"], serving, supervisor, clock))
    except LogdirWriteError as e:
        unsaid.append(str(e))


def finish(setup: Setup, serving: Serving, supervisor, ppos, clock: Clock, status: int, error,
           unsaid: list, judge: WinRateEval | None = None, budget: str = "step") -> tuple[int, dict]:
    """Write the policy (the one that won most where ``judge`` evaluated it), a checkpoint
    (the last weights) and summary.json, and say how the run ended (``budget``: which one
    ran out); returns the exit status (3 if any of them could not be written) and the
    summary. ``unsaid``: errors not printed yet; they and what cannot be written here make
    one ``error:`` line."""
    config, logdir = setup.config, Path(setup.config.logdir)
    problems, written = list(unsaid), None
    try:   # first what a resume needs (each file whole or not at all: a full disk leaves the last one)
        written = checkpoint(setup, serving, ppos) if ppos is not None else None
    except CheckpointError as e:
        problems.append(str(e))
    try:
        best = judge.best_models() if judge else {}
        for pid, model in {**serving.model_bytes, **best}.items():
            replace_file(logdir / policy_file(pid, setup.multiagent), model)
    except LogdirWriteError as e:
        problems.append(str(e))
    if len(problems) > len(unsaid):
        status, error = EXIT_FAILED, "; ".join(dict.fromkeys(([error] if error else []) + problems))
    result = {**run_summary(serving, supervisor, clock, status, error, setup.resumed and setup.resumed[0]),
              **(judge.summary() if judge else {}), "profile": setup.profile, "config": saved_config(config)}
    if ppos is not None:
        result["checkpoint"] = str(written) if written else None
    try:
        write_json_file(logdir / "summary.json", result)
    except LogdirWriteError as e:
        problems.append(f"{e} (no summary.json written)")
    if problems:
        print(f"error: {'; '.join(dict.fromkeys(problems))}", file=sys.stderr, flush=True)
    verdict = {EXIT_SOLVED: "solved", EXIT_BUDGET: f"{budget} budget exhausted", EXIT_FAILED: "failed",
               EXIT_INTERRUPTED: "interrupted"}.get(status, "terminated")
    won = (f"; the policy written won {result['win_rate']:.3f} of its evaluation games against a random legal "
           "player" if "win_rate" in result else "")
    print(f"{verdict}: return {result['return_mean']:.1f} over the last {len(serving.store.returns)} "
          f"episodes after {result['env_steps']} env steps in {result['wall_s']:.2f} s{won}; wrote {logdir}",
          flush=True)
    return status, result
