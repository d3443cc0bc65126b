"""The books agree whatever the moment of a signal: after Ctrl-C or SIGTERM at any point of
the training loop, summary.json's counters are those of metrics.jsonl's last row, every
update counted has its row, and the final checkpoint is of the last update.

The runs are in this process (``train_with_servers``: simulator threads behind the
in-process transport), so that a signal can be sent at each step of one loop iteration in
turn: a real signal (``signal.raise_signal``), handled as Python handles one, by the main
thread at its next chance, not an exception raised in the middle of the step."""
import json
import math
import signal
import threading
import time

import pytest

import shmrl
from shmrl.files import checkpoint
from shmrl.files.metrics import MetricsLog
from shmrl.model.ppo import PPO
from shmrl.run import _terminate
from shmrl.server.serving import Serving
from shmrl.server.store import EpisodeStore
from shmrl.trainer import loop
from shmrl.trainer.learn_per_step import LearnPerStep
from shmrl.trainer.report import Clock
from shmrl.transport.inproc import InProcServer

from conftest import check_books, metrics_rows, simulator_threads, summary_of, wait_until


def train_until_signalled(logdir, signum: int, arm=None) -> None:
    """A CartPole run on two simulator threads with a budget it never reaches: only the
    signal ends it. ``arm()`` is called once the run has started (it arranges the signal);
    SIGTERM is handled as ``python -m shmrl.run`` handles it."""
    server = InProcServer()
    threads = simulator_threads(server)
    before = signal.signal(signal.SIGTERM, _terminate)
    # Ctrl-C as `python -m shmrl.run` takes it, even where pytest started with SIGINT ignored
    # (a script's background job: `nohup bash .ci/run &`), where Python leaves it ignored.
    before_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    # Should the signal never come, Ctrl-C after 120 s ends the run (and the test fails on its checks).
    watchdog = threading.Timer(120, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    watchdog.start()
    try:
        config = shmrl.Config(sims=0, seed=0, hidden=8, epochs=1, minibatch_size=64, train_batch_size=128,
                              env_steps_per_sample=64, max_env_steps=10**9, stop_return=math.inf, torch_threads=1,
                              tensorboard=False, logdir=str(logdir), log_every=0, checkpoint_every=1)
        if arm is not None:
            arm()
        status, summary = loop.train_with_servers(config, [server])
    except (KeyboardInterrupt, SystemExit) as e:   # the signal escaped the run: its books were not written
        pytest.fail(f"{type(e).__name__} escaped the run")
    finally:
        watchdog.cancel()
        signal.signal(signal.SIGTERM, before)
        signal.signal(signal.SIGINT, before_int)
        server.close()
        for t in threads:
            t.join(10)
    assert status == 128 + signum, summary.get("error")


def check_books_agree(logdir) -> None:
    """Every counted update has its row, in order; the last row's counters are summary.json's
    (``check_books``), as are the newest checkpoint's."""
    summary, rows = summary_of(logdir), metrics_rows(logdir)
    assert [r["update"] for r in rows] == list(range(1, summary["updates"] + 1)), [r["update"] for r in rows]
    check_books(summary, logdir)
    if rows:
        assert rows[-1]["update"] == summary["updates"]
        assert rows[-1]["return_mean"] == summary["return_mean"]
    state = json.loads((checkpoint.latest(logdir) / "state.json").read_text())
    assert state["update"] == summary["updates"] and state["counters"]["steps_trained"] == summary["env_steps_trained"]


# Each step of one loop iteration, and what the signal comes before or after: taking a batch,
# training, the update's counts (steps trained, weights published), the learner's clock and
# learning plan, the row (built, printed, written) and the checkpoint.
STEPS = [(Serving, "next_batch"), (PPO, "update"), (EpisodeStore, "trained"), (Serving, "publish"),
         (Clock, "trained"), (LearnPerStep, "observe"), (loop, "metrics_row"), (loop, "progress_line"),
         (MetricsLog, "write"), (loop, "save_checkpoint")]


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("owner, name", STEPS, ids=[f"{o.__name__.rsplit('.', 1)[-1]}.{n}" for o, n in STEPS])
def test_ctrl_c_at_each_step_of_the_loop_leaves_the_books_agreeing(monkeypatch, tmp_path, owner, name, when):
    real, calls = getattr(owner, name), []

    def signalled(*args, **kwargs):   # the 4th call (an update or more into the loop) gets the signal
        calls.append(1)
        fire = len(calls) == 4
        if fire and when == "before":
            signal.raise_signal(signal.SIGINT)
        out = real(*args, **kwargs)
        if fire and when == "after":
            signal.raise_signal(signal.SIGINT)
        return out

    monkeypatch.setattr(owner, name, signalled)
    train_until_signalled(tmp_path / "run", signal.SIGINT)
    assert len(calls) >= 4
    check_books_agree(tmp_path / "run")


@pytest.mark.parametrize("owner, name", [(EpisodeStore, "trained"), (loop, "metrics_row"), (MetricsLog, "write")],
                         ids=["trained", "metrics_row", "write"])
def test_sigterm_in_the_middle_of_an_update_leaves_the_books_agreeing(monkeypatch, tmp_path, owner, name):
    real, calls = getattr(owner, name), []

    def signalled(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            signal.raise_signal(signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, signalled)
    train_until_signalled(tmp_path / "run", signal.SIGTERM)
    check_books_agree(tmp_path / "run")


@pytest.mark.parametrize("delay", [0.0, 0.013, 0.031, 0.057, 0.089, 0.14, 0.23, 0.37])
def test_ctrl_c_at_any_moment_leaves_the_books_agreeing(tmp_path, delay):
    """The signal from another thread at a moment chosen by the clock, not by a step: once
    the loop has written its second row, ``delay`` s later (wherever the loop is then)."""
    logdir = tmp_path / "run"

    def arm():
        def send():
            try:
                wait_until(lambda: len(rows_so_far()) >= 2, 60, "the loop's second row")
            except AssertionError:
                pass   # the signal all the same: the run must end, and the checks say what went wrong
            time.sleep(delay)
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

        threading.Thread(target=send, daemon=True).start()

    def rows_so_far():
        path = logdir / "metrics.jsonl"
        return path.read_bytes().splitlines() if path.exists() else []

    train_until_signalled(logdir, signal.SIGINT, arm)
    check_books_agree(logdir)
