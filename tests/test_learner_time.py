"""Where the learner's time goes: torch's import off a run's critical path (the simulators
sample while it goes on), and a run that says when the learner is the wall."""
import dataclasses
import threading
import time
from collections import deque

import pytest

import shmrl
from shmrl.config.settings import Config, resolve_config
from shmrl.model import torch_import
from shmrl.server.store import EpisodeStore
from shmrl.trainer.report import WALL_WINDOW, WIDTH, LearnerWall, progress_line, wall_line


def test_simulators_sample_before_torchs_import_has_finished(monkeypatch, tmp_path, no_shm_leftovers,
                                                              no_sim_leftovers):
    """An import of torch that ends only once the first chunk has come in (within 60 s): the
    simulators were started, served their first policy and sampled without torch; the run
    waited for the import only after that, and summary.json says when each happened."""
    first_chunk = threading.Event()
    add = EpisodeStore.add

    def add_and_tell(self, conn_id, chunks):
        add(self, conn_id, chunks)
        if self.steps_received:
            first_chunk.set()

    def slow_import():
        first_chunk.wait(60)
        time.sleep(0.2)   # a little past the chunk: the import visibly ends after it
        import torch  # noqa: F401

    monkeypatch.setattr(EpisodeStore, "add", add_and_tell)
    monkeypatch.setattr(torch_import, "load_torch", slow_import)
    monkeypatch.setattr(torch_import, "_started", None)
    summary = shmrl.train(sims=2, max_env_steps=4096, stop_return=1e9, logdir=str(tmp_path / "logs"))
    assert summary["exit_status"] == 1 and summary["updates"] >= 1, summary
    assert first_chunk.is_set()
    started, ended = summary["torch_import_started_s"], summary["torch_import_ended_s"]
    assert 0 <= started < summary["first_sample_s"] < ended < summary["wall_s"], summary
    assert summary["torch_import_waited_s"] > 0   # the PPOs waited for the import's end, not for its start


def test_waiting_for_torch_gives_the_threads_import_and_its_error(monkeypatch):
    monkeypatch.setattr(torch_import, "_started", None)
    monkeypatch.setattr(torch_import, "load_torch", lambda: time.sleep(0.3))
    loading = torch_import.start_torch_import()
    assert torch_import.start_torch_import() is loading   # one import at a time
    assert torch_import.import_torch().__name__ == "torch" and loading.waited_s > 0.1
    times = loading.times(loading.started_at - 1.0)
    assert times["torch_import_started_s"] == pytest.approx(1.0) and times["torch_import_ended_s"] >= 1.3
    assert torch_import.started_since(loading.started_at - 1) is loading
    assert torch_import.started_since(loading.ended_at + 1) is None   # ended before: another run's

    def broken():
        raise ImportError("injected: no torch here")

    monkeypatch.setattr(torch_import, "load_torch", broken)
    torch_import.start_torch_import()   # the last one has ended: a new import
    with pytest.raises(ImportError, match="injected"):
        torch_import.import_torch()


def observed(shares: list[float]) -> tuple[LearnerWall, list[int], list[bool]]:
    """A LearnerWall after ``shares``: the updates at which it said so, and its state after each."""
    wall, said, states = LearnerWall(), [], []
    for update, s in enumerate(shares, 1):
        if wall.observe(update, s):
            said.append(update)
        states.append(wall.is_wall)
    return wall, said, states


def test_the_learner_is_the_wall_by_the_median_of_its_last_updates_said_once_without_flapping():
    # Busy 95% from the start: the wall once a window of updates says so, said once.
    wall, said, states = observed([0.95] * 12)
    assert said == [WALL_WINDOW] and states == [False] * (WALL_WINDOW - 1) + [True] * (12 - WALL_WINDOW + 1)
    assert wall.said_at == WALL_WINDOW and wall.median() == pytest.approx(0.95)
    # One busy update among idle ones (a checkpoint, a burst) is not the wall; one idle among busy ones
    # does not end it.
    assert observed([0.5, 0.5, 0.99, 0.5, 0.5, 0.5])[1] == []
    assert observed([0.95] * 5 + [0.3] + [0.95] * 4)[2][4:] == [True] * 6
    # Around 90% it stays as it was until the median falls below 80%; back above 90% it is the wall
    # again, but the line is not said twice.
    _, said, states = observed([0.95] * 5 + [0.85] * 6 + [0.7] * 5 + [0.85] * 5 + [0.97] * 5)
    assert said == [5]
    assert states[4:11] == [True] * 7 and not any(states[13:21]) and states[-1]
    # A learner busy 89% is not the wall.
    assert not any(observed([0.89] * 20)[2])


def test_the_progress_line_marks_the_wall_and_the_line_says_what_may_help():
    returns = deque([-120.0] * 98, maxlen=100)   # HalfCheetah: two long episodes per update
    row = {"update": 250, "env_steps": 512_000, "env_steps_per_s": 19_876.0, "return_mean": -120.3,
           "learner_share": 0.953, "learner_wall": True, "elapsed_s": 123.4}
    line = progress_line(row, returns, 3000.0, 1_000_000)
    assert "| learner 95% wall |" in line and len(line) <= WIDTH, line   # short, where the line is long
    returns.extend([-100.0] * 2)   # 100 episodes: no "(n=98)"
    line = progress_line(row, returns, 3000.0, 1_000_000)
    assert "| learner 95% (the wall) |" in line and len(line) <= WIDTH, line
    assert "(the wall)" not in progress_line({**row, "learner_wall": False}, returns, 3000.0, 1_000_000)
    assert "(the wall)" not in progress_line({k: v for k, v in row.items() if k != "learner_wall"}, returns,
                                             3000.0, 1_000_000)
    config = resolve_config(Config(env="Pendulum-v1"))
    said = wall_line(0.953, config)
    assert said.startswith("the learner is the wall: busy 95% of the time") and "\n" not in said
    assert "more simulators will not help" in said
    assert f"--epochs {config.epochs}" in said and f"--minibatch-size {config.minibatch_size}" in said
    # A GPU is advised unless the learner is on one already.
    assert "--device cuda" in said
    assert "--device cuda" not in wall_line(0.953, dataclasses.replace(config, device="cuda"))
