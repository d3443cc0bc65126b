"""The run's metrics as TensorBoard scalars, read back with TensorBoard's own reader."""
import pytest

import shmrl
from conftest import metrics_rows, need
from shmrl.files.metrics import scalars

need("tensorboard", "tensorboard")
from tensorboard.backend.event_processing import event_accumulator  # noqa: E402


def test_a_run_writes_every_metrics_row_as_tensorboard_scalars(tmp_path, no_shm_leftovers, no_sim_leftovers):
    summary = shmrl.train(env="CartPole-v1", sims=2, max_env_steps=8000, logdir=str(tmp_path), tensorboard=True)
    assert summary["updates"] >= 3
    rows = metrics_rows(tmp_path)
    acc = event_accumulator.EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    # Each client that delivered steps has its own counter (on a loaded machine the second
    # simulator may start too late to deliver any in so short a run).
    clients = rows[-1]["env_steps_by_client"]
    assert clients and set(clients) <= {"shm:0", "shm:1"}, clients
    for tag in ("rollout/return_mean", "train/pi_loss", "train/v_loss", "train/entropy", "train/approx_kl",
                "throughput/env_steps_per_s", "throughput/policy_lag", "throughput/learner_share",
                "train/learn_level", "train/epochs_run", "counters/env_steps",
                *(f"counters/env_steps_by_client/{c}" for c in clients)):
        assert tag in tags, sorted(tags)
    loss = acc.Scalars("train/pi_loss")
    if len(loss) == len(rows) + 1:   # the last row, rewritten as the run ended (trainer.final_row): a new point
        loss = loss[:-2] + loss[-1:]
    assert [e.step for e in loss] == [r["env_steps"] for r in rows]          # x-axis: env steps
    assert [e.value for e in loss] == pytest.approx([r["pi_loss"] for r in rows], rel=1e-6, abs=1e-7)
    for c in clients:
        assert acc.Scalars(f"counters/env_steps_by_client/{c}")[-1].value == clients[c]
    # the learner's busy share: a fraction in every row, and the run's mean in the summary
    assert all(0 < r["learner_share"] <= 1 for r in rows) and 0 < summary["learner_share"] <= 1


def test_no_tensorboard_writes_no_event_file(tmp_path, no_shm_leftovers, no_sim_leftovers):
    shmrl.train(env="CartPole-v1", sims=1, max_env_steps=5000, logdir=str(tmp_path), tensorboard=False)
    assert (tmp_path / "metrics.jsonl").read_text() and not list(tmp_path.glob("events.out.tfevents.*"))


def test_scalars_flatten_counters_and_leave_out_what_is_not_a_finite_number():
    row = {"update": 3, "return_mean": float("nan"), "pi_loss": -0.5, "env_steps_dropped": {"stale": 7},
           "env_steps_by_client": {"shm:0": 10, "tcp:1.2.3.4:5": 20}, "solved": True, "error": None}
    assert scalars(row) == {"train/update": 3.0, "train/pi_loss": -0.5, "counters/env_steps_dropped/stale": 7.0,
                            "counters/env_steps_by_client/shm:0": 10.0,
                            "counters/env_steps_by_client/tcp:1.2.3.4:5": 20.0}
