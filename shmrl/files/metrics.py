"""The run's metrics: one JSON object per update in ``metrics.jsonl``, and the same numbers
as TensorBoard scalars in the log folder when the ``tensorboard`` package is installed
(``pip install -e '.[tensorboard]' in shmrl's clone``; then ``tensorboard --logdir runs``).

The scalars go through TensorBoard's own event-file writer. Each update becomes one event
holding every scalar (one protobuf), not one event per scalar as
``SummaryWriter.add_scalar`` writes them (an order of magnitude slower). Importing the writer
(protobuf) and writing happen in a thread of their own, so the training loop
only puts a dict in a queue. The x-axis is env steps received, as in stable-baselines3 and
CleanRL; nested counters become ``name/key`` (``env_steps_by_client/shm:3``).
"""
from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from pathlib import Path

from shmrl.files.logdir import append_line, dumps, open_lines, write_error

log = logging.getLogger("shmrl.metrics")

# Where each scalar goes in TensorBoard's sidebar.
_GROUPS = {"return_mean": "rollout", "episodes": "rollout", "win_rate": "rollout", "best_win_rate": "rollout",
           "eval_s": "throughput",
           **dict.fromkeys(("env_steps_per_s", "train_s", "learner_share", "policy_lag", "elapsed_s"), "throughput"),
           **dict.fromkeys(("env_steps", "env_steps_accepted", "env_steps_trained", "env_steps_pending",
                            "env_steps_dropped", "env_steps_lost", "env_steps_by_client", "bad_frames",
                            "simulator_restarts"),
                           "counters")}  # anything else: "train"


def tensorboard_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


def scalars(row: dict) -> dict[str, float]:
    """A metrics row as TensorBoard tags and values: nested dicts flattened, non-numbers
    and non-finite values (a return mean before the first episode) left out."""
    out = {}
    for key, value in row.items():
        items = value.items() if isinstance(value, dict) else [(None, value)]
        for sub, v in items:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                continue
            out[f"{_GROUPS.get(key, 'train')}/{key}" + (f"/{sub}" if sub is not None else "")] = float(v)
    return out


class MetricsLog:
    """``write(row)`` appends a line to ``metrics.jsonl`` (one write of the whole line: it
    is the run's record; a NaN is written as null) and, with ``tensorboard``, hands the row
    to the TensorBoard thread; ``close()`` waits for that thread to write what it holds.
    A file that cannot be written raises ``shmrl.files.logdir.LogdirWriteError``."""

    def __init__(self, logdir: Path, append: bool = False, tensorboard: bool = False):
        self.logdir = Path(logdir)
        self.path = self.logdir / "metrics.jsonl"
        self._fd = open_lines(self.path, append)
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self.tensorboard_error: str | None = None
        if tensorboard:
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._tensorboard, name="shmrl-tensorboard", daemon=True)
            self._thread.start()

    def write(self, row: dict) -> None:
        self._last_line_at = os.fstat(self._fd).st_size
        append_line(self._fd, dumps(row), self.path)
        if self._queue is not None:
            self._queue.put(row)

    def rewrite_last(self, row: dict) -> None:
        """Replace the line ``write`` wrote last with ``row`` (the same update, as the run
        ended: metrics.jsonl keeps one row per update); TensorBoard gets it as a new point."""
        try:
            os.ftruncate(self._fd, self._last_line_at)
        except OSError as e:
            raise write_error(self.path, e) from None
        self.write(row)

    def close(self, timeout: float = 5.0) -> None:
        if self._queue is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            self._queue = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _tensorboard(self) -> None:
        writer = None
        try:
            from tensorboard.compat.proto.event_pb2 import Event
            from tensorboard.compat.proto.summary_pb2 import Summary
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            writer = EventFileWriter(str(self.logdir), flush_secs=10)
            while (row := self._queue.get()) is not None:
                values = [Summary.Value(tag=tag, simple_value=v) for tag, v in scalars(row).items()]
                writer.add_event(Event(wall_time=time.time(), step=int(row.get("env_steps", 0)),
                                       summary=Summary(value=values)))
        except Exception as e:  # metrics.jsonl has every row: a broken writer must not end the run
            self.tensorboard_error = f"{type(e).__name__}: {e}"
            log.warning("TensorBoard scalars are not written: %s", self.tensorboard_error)
            while self._queue.get() is not None:
                pass
        finally:
            if writer is not None:
                writer.close()
