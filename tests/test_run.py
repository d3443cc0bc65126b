"""End to end: ``python -m shmrl.run`` as a user runs it."""
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import onnxruntime as ort
import psutil

from conftest import all_gone, descendants, metrics_rows, process_name, shm_entries, summary_of


def test_run_learns_and_writes_its_logdir(start_run, tmp_path):
    logdir = tmp_path / "logs"
    run = start_run("--sims", 8, "--stop-return", 150, "--max-env-steps", 150_000, "--seed", 1,
                    "--logdir", logdir, "--verbose")
    run.proc.wait(timeout=120)
    out = run.output()
    assert run.proc.returncode == 0, out
    assert "update    1 | steps " in out and " of 150k | " in out and " -> 150" in out
    # The progress lines fit 100 columns with 8 simulators; each client's steps on the detail lines.
    lines = [line for line in out.splitlines() if line.startswith(("update ", "   "))]
    assert max(map(len, lines)) <= 100, "\n".join(line for line in lines if len(line) > 100)
    assert all(f"shm:{i}=" in out for i in range(8)) and "return nan" not in out
    summary = summary_of(logdir)
    assert summary["solved"] and summary["return_mean"] >= 150   # random play averages ~22
    assert summary["env_steps"] > 0 and summary["wall_s"] > 0 and summary["env_steps_per_s"] > 0
    rows = metrics_rows(logdir)
    assert len(rows) == summary["updates"] >= 1
    assert [r["update"] for r in rows] == list(range(1, len(rows) + 1))
    assert {"env_steps", "env_steps_per_s", "return_mean", "pi_loss", "v_loss", "elapsed_s"} <= set(rows[0])
    # The last row is the run's end: a plot of metrics.jsonl ends at the summary's return.
    assert (rows[-1]["return_mean"], rows[-1]["env_steps"]) == (summary["return_mean"], summary["env_steps"])
    session = ort.InferenceSession(str(logdir / "policy.onnx"), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].name == "onnx::Gemm_0"
    logits = session.run(None, {"onnx::Gemm_0": np.zeros((3, 4), np.float32)})[0]
    assert logits.shape == (3, 2)
    assert shm_entries(run.proc.pid) == [] and descendants(run.proc.pid) == []


def test_a_failure_in_the_serving_thread_ends_the_run_as_failed(monkeypatch, tmp_path, capsys, no_shm_leftovers,
                                                                  no_sim_leftovers):
    """The learner's serving thread dying (a bug, a transport that broke) used to leave the
    run waiting forever for batches; now the run ends with exit 3 and says why."""
    import shmrl
    from shmrl.server.store import EpisodeStore

    # In taking a batch, not in one client's message: an exception from a client's input
    # only closes that connection (tests/test_flood.py); this one is the run's own.
    def broken_take(self, *args, **kwargs):
        raise RuntimeError("injected: the store is broken")

    monkeypatch.setattr(EpisodeStore, "take", broken_take)
    out = {}
    run = threading.Thread(target=lambda: out.update(summary=shmrl.train(
        sims=1, max_env_steps=100_000, logdir=str(tmp_path / "logs"))), daemon=True)
    run.start()
    run.join(60)   # bounded: the bug this checks was a hang
    assert not run.is_alive(), "the run hangs after its serving thread failed"
    summary = out["summary"]
    assert summary["exit_status"] == 3 and not summary["solved"]
    assert "serving thread failed" in capsys.readouterr().err and "injected" in summary["error"]


def test_budget_exhausted_exits_1(start_run):
    run = start_run("--sims", 2, "--stop-return", 500, "--max-env-steps", 2000, "--env-steps-per-sample", 256)
    run.proc.wait(timeout=60)
    assert run.proc.returncode == 1, run.output()
    assert "step budget exhausted" in run.output()


def test_ctrl_c_stops_everything_and_leaves_no_segment(start_run, tmp_path):
    logdir = tmp_path / "logs"
    run = start_run("--sims", 4, "--stop-return", 500, "--max-env-steps", 10_000_000, "--logdir", logdir)
    run.wait_for("update    2 |", timeout=60)
    family = descendants(run.proc.pid)
    assert len(family) >= 4 and shm_entries(run.proc.pid)
    t0 = time.monotonic()
    os.killpg(run.proc.pid, signal.SIGINT)        # what Ctrl-C in a terminal does
    run.proc.wait(timeout=10)
    all_gone(family, 3 - (time.monotonic() - t0), "the run and its simulators to end")   # all of it, within 3 s
    assert run.proc.returncode == 130, run.output()
    assert shm_entries(run.proc.pid) == []
    summary = summary_of(logdir)                                   # nothing lost: what it did is written
    assert summary["exit_status"] == 130 and summary["updates"] >= 2
    assert (logdir / "checkpoints" / f"{summary['updates']:06d}" / "weights.npz").exists()


def test_ctrl_c_works_even_if_the_run_was_started_with_sigint_ignored(start_run, tmp_path):
    """A shell script's background job inherits SIGINT ignored; the run still stops on it
    (and bench.py's memory subcommand stops runs that way)."""
    run = start_run("--sims", 1, "--stop-return", 500, "--max-env-steps", 10_000_000, "--logdir", tmp_path / "logs",
                    preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    run.wait_for("update    1 |", timeout=60)
    os.killpg(run.proc.pid, signal.SIGINT)
    run.proc.wait(timeout=10)
    assert run.proc.returncode == 130, run.output()
    summary = summary_of(tmp_path / "logs")
    assert 0 < summary["first_sample_s"] < summary["wall_s"]


def test_sigterm_stops_everything(start_run):
    run = start_run("--sims", 2, "--stop-return", 500, "--max-env-steps", 10_000_000)
    run.wait_for("update    1 |", timeout=60)
    family = descendants(run.proc.pid)
    run.proc.send_signal(signal.SIGTERM)
    run.proc.wait(timeout=10)
    assert run.proc.returncode == 143, run.output()
    all_gone(family, 3, "the simulators to end")
    assert shm_entries(run.proc.pid) == []


def test_simulators_never_import_torch(start_run):
    """The simulator processes have no libtorch mapped, while the learner does."""
    run = start_run("--sims", 2, "--stop-return", 500, "--max-env-steps", 10_000_000)
    run.wait_for("update    1 |", timeout=60)

    def maps_torch(pid):
        return any("libtorch" in m.path for m in psutil.Process(pid).memory_maps(grouped=False))

    family = descendants(run.proc.pid)
    assert maps_torch(run.proc.pid)
    assert len(family) >= 2 and not any(maps_torch(p) for p in family)
    # And importing the simulator side never pulls torch in.
    code = ("import sys, shmrl.sim, shmrl.transport.shm, shmrl.transport.inproc, shmrl.core.episode, shmrl.client.rollout,"
            " shmrl.client.action_sampler;"
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_simulators_run_below_the_learners_priority(start_run):
    """The learner's update is what every simulator waits for: on a busy machine it comes first."""
    run = start_run("--sims", 2, "--sim-nice", 7, "--stop-return", 500, "--max-env-steps", 10_000_000)
    run.wait_for("update    1 |", timeout=60)

    def nice(pid):
        return psutil.Process(pid).nice()

    sims = [p for p in descendants(run.proc.pid) if process_name(p).startswith("shmrl-sim")]
    assert len(sims) == 2 and all(nice(p) == nice(run.proc.pid) + 7 for p in sims)


def test_help_explains_every_flag():
    out = subprocess.run([sys.executable, "-m", "shmrl.run", "--help"], capture_output=True, text=True,
                         timeout=30).stdout
    for flag in ("--sims", "--env", "--seed", "--stop-return", "--max-env-steps", "--logdir"):
        assert flag in out


def test_learner_killed_simulators_exit_and_next_run_sweeps_its_segments(start_run):
    run = start_run("--sims", 3, "--stop-return", 500, "--max-env-steps", 10_000_000)
    run.wait_for("update    2 |", timeout=60)
    family = descendants(run.proc.pid)
    dead_pid = run.proc.pid
    assert shm_entries(dead_pid)
    t_kill = time.monotonic()
    os.kill(dead_pid, signal.SIGKILL)      # only the learner: its children must notice
    run.proc.wait(timeout=5)
    all_gone(family, 2.0 - (time.monotonic() - t_kill), "every simulator (and helper) to end")   # within 2 s
    assert shm_entries(dead_pid)           # nobody could unlink them...
    nxt = start_run("--sims", 1, "--stop-return", 500, "--max-env-steps", 1000)
    nxt.proc.wait(timeout=60)
    assert shm_entries(dead_pid) == []     # ...until the next run swept them


def test_a_training_batch_is_the_same_however_many_simulators_share_it():
    from shmrl.config.settings import Config, resolve_config
    from shmrl.run import parse_args

    for sims, per_message in ((8, 256), (4, 512), (3, 683), (0, 2048)):
        argv = ["--env", "CartPole-v1", "--sims", sims] + (["--tcp-port", 0] if sims == 0 else [])
        config = parse_args(argv)
        assert (config.train_batch_size, config.env_steps_per_sample) == (2048, per_message), sims
    # Without --env, clients only: the env's presets wait for the first client's spaces (RLLINK.md 3.2).
    declared = parse_args(["--sims", 0, "--tcp-port", 0])
    assert declared.env == "declared" and declared.train_batch_size is None and declared.env_steps_per_sample is None
    assert parse_args(["--sims", 4, "--env-steps-per-sample", 100]).env_steps_per_sample == 100
    assert parse_args(["--train-batch-size", 4096]).env_steps_per_sample == 512
    assert resolve_config(Config(env="Pendulum-v1", sims=2)).env_steps_per_sample == 2048


HUGE_REWARDS = '''
from shmrl.envs.builtin import CartPole


class HugeRewards(CartPole):
    """CartPole whose every reward is out of bounds (above --max-reward-abs)."""

    def step(self, action):
        obs, _, terminated, truncated, info = super().step(action)
        return obs, 1e7, terminated, truncated, info


def make_env():
    return HugeRewards()
'''


def test_an_env_whose_every_step_is_refused_ends_the_run_with_exit_3(start_run, tmp_path, monkeypatch):
    """Every chunk refused (its rewards above --max-reward-abs): the budget can never fill,
    so the run fails naming the reason, as one whose env gives NaN does."""
    (tmp_path / "huge_rewards_env.py").write_text(HUGE_REWARDS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    run = start_run("--sims", 2, "--env", "huge_rewards_env:make_env", "--stop-return", 1e9, "--max-env-steps",
                    100_000, "--logdir", tmp_path / "logs")
    try:
        run.proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the run did not end; output:\n{run.output()[-3000:]}") from None
    out = run.output()
    assert run.proc.returncode == 3, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "every env step of its last 10 messages was refused: reward out of bounds" in errors[0], \
        out[-3000:]
    summary = summary_of(tmp_path / "logs")
    assert summary["exit_status"] == 3 and summary["env_steps_accepted"] == 0 and summary["updates"] == 0
    assert summary["env_steps_dropped"] == {"reward out of bounds": summary["env_steps"]} and summary["env_steps"] > 0
