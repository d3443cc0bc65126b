"""What a run reports: a metrics row per update (metrics.jsonl, TensorBoard, the progress
line) and, built from the same parts, the summary when it ends (summary.json)."""
from __future__ import annotations

import math
import statistics
import time
from collections import deque


class Clock:
    """The run's times: since the process started (``t_start``) and since learning began;
    and the learner's busy share: the fraction of wall time it spends training (update and
    publish, ``trained``) rather than waiting for a batch, over each log period (between
    metrics rows) and since the training loop began (``start_loop``)."""

    def __init__(self, t_start: float, steps_at_start: int):
        self.t_start, self.t_learn, self.steps_at_start = t_start, time.time(), steps_at_start
        self.t_loop = self.t_period = time.perf_counter()
        self.busy_s = self.period_busy_s = 0.0

    def steps_per_s(self, steps_received: int) -> float:
        return (steps_received - self.steps_at_start) / max(time.time() - self.t_learn, 1e-9)

    def start_loop(self) -> None:
        self.t_loop = self.t_period = time.perf_counter()
        self.busy_s = self.period_busy_s = 0.0

    def trained(self, seconds: float) -> None:
        """The learner spent ``seconds`` training."""
        self.busy_s += seconds
        self.period_busy_s += seconds

    def period(self) -> tuple[float, float]:
        """(seconds busy, wall seconds) since the last call (or the loop's start); starts the
        next period. Their ratio is the period's busy share (``share``)."""
        now = time.perf_counter()
        busy, wall = self.period_busy_s, now - self.t_period
        self.t_period, self.period_busy_s = now, 0.0
        return busy, wall

    def learner_share(self) -> float:
        """The learner's busy share since the training loop began."""
        return share(self.busy_s, time.perf_counter() - self.t_loop)


def share(busy: float, wall: float) -> float:
    return min(busy / wall, 1.0) if wall > 0 else 0.0


WALL_WINDOW = 5     # updates whose median busy share decides: one slow update (a checkpoint's) is not the wall
WALL_SHARE = 0.9    # busier than this the learner is the wall...
WALL_LEAVE = 0.8    # ...until it is idle a fifth of the time again: between the two the marker stays as it was


class LearnerWall:
    """Whether the learner is the wall: the median busy share of its last WALL_WINDOW updates
    above WALL_SHARE. Then a batch is always waiting when an update ends, so the simulators
    wait for the learner (strict on-policy they are held through every update; with --async
    once a whole batch waits) and more of them would only wait more. It stops being the wall
    when that median falls below WALL_LEAVE, so a share near 90% does not flap."""

    def __init__(self):
        self.shares: deque = deque(maxlen=WALL_WINDOW)
        self.is_wall = False
        self.said_at: int | None = None   # the update at which the run said so (once)

    def observe(self, update: int, busy_share: float) -> bool:
        """Count one update's busy share; True the first time the learner is the wall (say it now)."""
        self.shares.append(busy_share)
        if len(self.shares) < WALL_WINDOW:
            return False
        median = self.median()
        self.is_wall = median >= WALL_LEAVE if self.is_wall else median > WALL_SHARE
        if not self.is_wall or self.said_at is not None:
            return False
        self.said_at = update
        return True

    def median(self) -> float:
        return statistics.median(self.shares) if self.shares else 0.0


def wall_line(busy_share: float, config) -> str:
    """The one line that says the learner is the wall, and what may move it."""
    gpu = "" if config.device == "cuda" else ", the learner on a GPU where there is one (--device cuda)"
    if getattr(config, "algo", "ppo") == "sac":   # it paces its clients to keep its gradient steps per env step
        return (f"the learner is the wall: busy {100 * busy_share:.0f}% of the time (median of the last {WALL_WINDOW} "
                f"updates) while the clients wait for it to pay --gradient-steps {config.gradient_steps:g} per env "
                f"step; what may: a smaller --gradient-steps (more env steps, fewer gradient steps each), a smaller "
                f"network{gpu}")
    return (f"the learner is the wall: busy {100 * busy_share:.0f}% of the time (median of the last {WALL_WINDOW} "
            f"updates) while the simulators wait for it, so more simulators will not help; what may: fewer "
            f"epochs (--epochs {config.epochs}), a larger minibatch (--minibatch-size {config.minibatch_size})"
            f"{gpu}, or a smaller network")


def counts(run) -> dict:
    """Where every env step went: received = trained + pending (waiting, or in an update
    that has not finished) + dropped (by reason); accepted: received less those refused as
    they came in (what --max-env-steps counts); lost: stepped by simulators that died
    before sending them, never received. A frame that could not be decoded has no steps to
    count: it counts as a bad frame. ``run``: a ``Training``."""
    serving, supervisor = run.serving, run.supervisor
    store = serving.store
    return {"env_steps": store.steps_received, "env_steps_accepted": store.steps_accepted,
            "env_steps_trained": store.steps_trained,
            "env_steps_pending": store.pending_steps + store.in_flight,
            "env_steps_dropped": dict(store.steps_dropped),
            "env_steps_lost": store.steps_lost, "env_steps_by_client": dict(store.steps_by_conn),
            "bad_frames": sum(server.frames_rejected for server in serving.servers),
            "clients_timed_out": sum(server.clients_timed_out for server in serving.servers),
            "short_batches": serving.short_batches, "updates_skipped": run.counts.skipped,
            "heartbeats_ignored": serving.hub.heartbeats_ignored, "auth_failures": serving.hub.auth_failures,
            "simulator_restarts": supervisor.restarts if supervisor else 0}


def books(run) -> dict:
    """The counters of ``run`` that a metrics row and summary.json both hold (``counts`` and
    the episodes): as a run ends, its last row's are the summary's."""
    return {**counts(run), "episodes": run.serving.store.episodes_completed}


def returns(serving) -> dict:
    """The mean return of the last episodes; a multi-agent run's also per policy and agent."""
    store = serving.store
    means = {"return_mean": store.return_mean()}
    if serving.multiagent:
        means.update(return_by_policy=store.policy_return_means(), return_by_agent=store.agent_return_means())
    return means


# An update with a win-rate evaluation (--eval-every) adds these (shmrl.trainer.win_rate).
EVAL_STATS = ("win_rate", "best_win_rate", "eval_s", "win_rate_by_policy")
# Every update's; before them in a row, its algorithm's own (``ROW_STATS`` of shmrl.model.ppo.PPO, shmrl.model.sac.SAC).
UPDATE_STATS = ("train_s", "learner_share", "learn_level", "epochs_run", "batch_steps", "weights_seq_no", "policy_lag",
                "lr", "reward_scale", "learner_wall")


def metrics_row(stats: dict, run) -> dict:
    """One update's line of metrics.jsonl (and of TensorBoard), from its ``stats`` and the
    state of ``run`` (a ``Training``)."""
    serving, clock = run.serving, run.clock
    store, means = serving.store, returns(serving)
    row = {"update": stats["update"], "return_mean": means["return_mean"], "episodes": store.episodes_completed,
           "env_steps_per_s": clock.steps_per_s(store.steps_received),
           **{k: stats[k] for k in stats.get("row_stats", ())}, **{k: stats[k] for k in UPDATE_STATS},
           **{k: stats[k] for k in EVAL_STATS if k in stats},
           **counts(run), "elapsed_s": time.time() - clock.t_start, **means}
    if serving.multiagent:   # each policy's losses too, "<id>/pi_loss"
        row["policies"] = {f"{pid}/{k}": v for pid, st in stats["policies"].items() for k, v in st.items()}
    return row


DETAIL_EVERY = 10   # without --verbose, every 10th progress line has its detail line under it
WIDTH = 100         # the progress line's most columns (the detail line's too)


def progress_line(row: dict, returns, stop_return: float, max_env_steps: int, detail: bool = False,
                  win_rate: float | None = None) -> str:
    """One update's line, at most WIDTH columns: the update, env steps of the budget, steps
    per second, the mean return of ``returns`` (the window) against the stop return (once
    an episode has ended), in a multi-agent run the share of agent episodes won (and
    ``win_rate``, the latest evaluated win rate against a random legal player, once there
    is one), the learner's share of the time where the row has it (marked while the learner
    is the wall, ``LearnerWall``), and the time.
    ``detail``: a second line with the losses, the policy lag and each client's env steps."""
    parts = [f"update {row['update']:4d}", f"steps {_k(row['env_steps'])} of {_k(max_env_steps)}",
             f"{_k(round(row['env_steps_per_s']))}/s"]
    if returns:
        target = f" -> {stop_return:g}" if math.isfinite(stop_return) else ""
        window = "" if len(returns) == returns.maxlen else f" (n={len(returns)})"
        parts.append(f"return {row['return_mean']:.1f}{target}{window}")
        if "return_by_agent" in row:   # zero-sum self-play returns average 0: say who wins
            parts.append(f"won {100 * sum(r > 0 for r in returns) / len(returns):.0f}%")
    else:
        parts.append("no episode ended yet")
    if win_rate is not None:
        parts.append(f"random {100 * win_rate:.0f}%")
    if row.get("learner_share") is not None:
        parts.append(f"learner {100 * row['learner_share']:.0f}%" + (" (the wall)" if row.get("learner_wall") else ""))
    parts.append(f"{row['elapsed_s']:.1f}s")
    line = " | ".join(parts)
    if len(line) > WIDTH and row.get("learner_wall"):   # a long line (returns of few episodes) keeps it short
        line = line.replace("% (the wall) | ", "% wall | ")
    if detail:
        line += "\n" + detail_line(row)
    return line


def detail_line(row: dict) -> str:
    """The losses, the policy lag, and each client's env steps (and each agent's and
    policy's return in a multi-agent run), indented, on lines of at most WIDTH columns."""
    if "q_mean" in row:   # SAC's
        items = [f"q {row['q_mean']:+.2f} critic {row['critic_loss']:.3f} actor {row['actor_loss']:+.3f} "
                 f"alpha {row['alpha']:.3f} ent {row['entropy']:.2f} ratio {row['replay_ratio']:.2f} "
                 f"lag {row['policy_lag']:.1f} |"]
    elif "pi_loss" in row:   # PPO's
        items = [f"pi {row['pi_loss']:+.3f} v {row['v_loss']:.3f} ent {row['entropy']:.3f} "
                 f"kl {row['approx_kl']:.4f} lag {row['policy_lag']:.1f} |"]
    else:   # another learner's scalars are in metrics.jsonl
        items = [f"lag {row['policy_lag']:.1f} |"]
    items += [f"{c}={_k(n)}" for c, n in sorted(row["env_steps_by_client"].items(),
                                                 key=lambda kv: (len(kv[0]), kv[0]))]
    items += [f"{a}={r:.2f}" for a, r in sorted(row.get("return_by_agent", {}).items())]
    if len(row.get("return_by_policy", {})) >= 2:
        items += [f"policy {p}={r:.2f}" for p, r in sorted(row["return_by_policy"].items())]
    lines, line = [], "      "
    for item in items:
        if len(line) + 1 + len(item) > WIDTH:
            lines.append(line)
            line = "      "
        line += " " + item
    return "\n".join([*lines, line])


def _k(n: int) -> str:
    if n >= 1_000_000:
        return f"{n / 1_000_000:.2f}M".replace(".00M", "M")
    return f"{n / 1000:.1f}k".replace(".0k", "k") if n >= 1000 else str(n)


def run_summary(run, status: int, error: str | None) -> dict:
    """summary.json but the configuration: the state of ``run`` (a ``Training``) at its end
    (the parts of a metrics row that are not one update's), and how it ended."""
    serving, supervisor, clock = run.serving, run.supervisor, run.clock
    resumed_from = run.setup.resumed[0] if run.setup.resumed else None
    store, means = serving.store, returns(serving)
    return {"solved": status == 0, "exit_status": status, "error": error, "wall_s": time.time() - clock.t_start,
            "return_mean": means["return_mean"], "episodes": store.episodes_completed, **counts(run),
            "env_steps_per_s": clock.steps_per_s(store.steps_received),
            "first_sample_s": store.first_steps_at - clock.t_start if store.first_steps_at else None,
            "updates": run.counts.done, "weights_seq_no": serving.weights_seq_no,
            "learner_share": clock.learner_share(), "learner_wall_update": run.wall.said_at,
            **torch_import_times(run),
            "simulator_recovery_s": supervisor.recovery_s if supervisor else [],
            "resumed_from": str(resumed_from) if resumed_from else None, **means}


def torch_import_times(run) -> dict:
    """When torch's import began and ended, from the process start, and how long the run
    waited for it (``shmrl.model.torch_import``); None where the run did not start one."""
    if run.torch_import is None:
        return dict.fromkeys(("torch_import_started_s", "torch_import_ended_s", "torch_import_waited_s"))
    return run.torch_import.times(run.clock.t_start)
