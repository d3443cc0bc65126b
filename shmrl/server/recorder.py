"""``--record DIR``: every chunk the learner accepts, glued into whole episodes and written
to a dataset (``shmrl.files.dataset``) by a thread of its own, off the serving thread's path.

The serving thread hands each accepted batch over with the glue keys the episode store
found for its chunks (``PolicyChunks.add``: the key each chunk continues, the key it leaves
open), so episodes are glued exactly as the store glues them. The writer thread keeps
the chunks of open episodes and writes the episodes that ended as a shard every
``flush_every`` seconds (a SIGKILL loses at most that much), and at ``close`` the rest,
open ones included (``stopped``: they had not ended).

Memory is bounded: at most ``max_queued_steps`` env steps wait for the writer. When it
falls that far behind (a disk slower than the simulators), the serving thread waits for
it up to ``max_wait`` seconds per message (back-pressure: recording stays whole), and only
then drops the message's chunks from the recording (not from training), says so once, and
leaves out the episodes they belong to (never an episode with a hole in it).

A shard that cannot be written (a full disk) stops the recording: ``failure`` says why in
one line, and the run that owns the recorder fails on it (``shmrl.trainer.lifecycle``)
instead of training on without its recording.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque

from shmrl.files.dataset import DatasetWriter, DatasetWriteError, shard_arrays

log = logging.getLogger("shmrl.recorder")


class Recorder:
    def __init__(self, writer: DatasetWriter, flush_every: float = 2.0, max_queued_steps: int = 1_000_000,
                 max_wait: float = 1.0, max_shard_steps: int = 200_000, max_episodes: int | None = None):
        """``max_episodes``: keep that many episodes that ended, and nothing after them
        (``python -m shmrl.record --episodes``); by default every one, and those still open
        at ``close``."""
        self.writer = writer
        self.flush_every, self.max_queued_steps, self.max_wait = flush_every, max_queued_steps, max_wait
        self.max_shard_steps = max_shard_steps
        self.episodes_left = max_episodes
        self._queue: deque = deque()
        self._queued_steps = 0
        self._cond = threading.Condition()
        self._closing = False
        self.steps_dropped = 0            # left out of the recording because the writer was behind
        self.failure: str | None = None   # why the writer thread stopped, in one line
        # writer thread only: glue key -> (policy id, pieces, source); per policy the episodes to write
        self._open: dict = {}
        self._done: dict[str, list] = {}
        self._done_steps = 0
        self._skip: set = set()           # glue keys of episodes with a dropped chunk
        self._thread = threading.Thread(target=self._run, name="shmrl-recorder", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the serving thread
    def add(self, policy_id: str, conn_id: str, batch, starts: list, ends: list) -> None:
        """A batch the store accepted, with each chunk's glue keys (``ends[i]`` None: its
        episode ended)."""
        if self.failure is not None:   # the writer stopped (said once, when it did): nothing is kept
            return
        n = batch.num_steps
        with self._cond:
            if self._queued_steps and self._queued_steps + n > self.max_queued_steps and not self._closing:
                deadline = time.monotonic() + self.max_wait
                while (self._queued_steps and self._queued_steps + n > self.max_queued_steps
                       and time.monotonic() < deadline and self._thread.is_alive()):
                    self._cond.wait(deadline - time.monotonic())
            if self._queued_steps and self._queued_steps + n > self.max_queued_steps:
                if not self.steps_dropped:
                    log.warning("the recording falls behind (its disk is slower than the simulators): chunks "
                                "are left out of it, and the episodes they belong to (training goes on)")
                self.steps_dropped += n
                self._queue.append(("gap", policy_id, conn_id, batch, starts, ends))
            else:
                self._queue.append(("add", policy_id, conn_id, batch, starts, ends))
                self._queued_steps += n
            self._cond.notify_all()

    def forget(self, conn_id: str) -> None:
        """A connection closed: its open episodes are written as they are (``stopped``)."""
        with self._cond:
            self._queue.append(("forget", conn_id))
            self._cond.notify_all()

    def close(self) -> None:
        """Write everything, open episodes too, and stop the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        print(f"recorded {self.writer.episodes} episodes ({self.writer.steps} env steps) to {self.writer.path}"
              + (f"; {self.steps_dropped} env steps were left out of it (the writer fell behind)"
                 if self.steps_dropped else "")
              + (f"; the recording stopped early: {self.failure}" if self.failure else ""), flush=True)

    # ------------------------------------------------------------ the writer thread
    def _run(self) -> None:
        last_flush = time.monotonic()
        try:
            while True:
                with self._cond:
                    if not self._queue and not self._closing:
                        self._cond.wait(max(0.0, last_flush + self.flush_every - time.monotonic()))
                    items, closing = list(self._queue), self._closing
                    self._queue.clear()
                for item in items:
                    self._take(item)
                with self._cond:
                    self._queued_steps -= sum(item[3].num_steps for item in items if item[0] == "add")
                    self._cond.notify_all()
                if closing:
                    for key in list(self._open):
                        self._end(key, stopped=True)
                    self._flush()
                    return
                if time.monotonic() - last_flush >= self.flush_every or self._done_steps >= self.max_shard_steps:
                    self._flush()
                    last_flush = time.monotonic()
        except DatasetWriteError as e:   # a full disk: the run fails on ``failure``, which says it all
            self.failure = str(e)
        except BaseException as e:   # a bug: its traceback too
            self.failure = f"{type(e).__name__}: {e}"
            log.exception("the recording stopped: writing %s failed", self.writer.path)
        if self.failure is not None:
            with self._cond:
                self._queue.clear()
                self._queued_steps = 0
                self._cond.notify_all()

    def _take(self, item) -> None:
        if item[0] == "forget":
            for key in [k for k in self._open if k[0] == item[1]]:
                self._end(key, stopped=True)
            self._skip = {k for k in self._skip if k[0] != item[1]}
            return
        kind, pid, conn_id, batch, starts, ends = item
        # The store's keys are per policy; here one table holds every policy's episodes.
        starts = [(conn_id, pid, k) for k in starts]
        ends = [None if k is None else (conn_id, pid, k) for k in ends]
        if kind == "gap":
            for start, end in zip(starts, ends):
                self._open.pop(start, None)
                if end is not None:
                    self._skip.add(end)
            return
        for i, (start, end) in enumerate(zip(starts, ends)):
            if start in self._skip:   # its episode lost a chunk
                self._skip.discard(start)
                if end is not None:
                    self._skip.add(end)
                continue
            _, pieces, _ = self._open.pop(start, (pid, [], conn_id))
            pieces.append((batch, i))
            if end is None:
                if (batch.lengths[i] or len(pieces) > 1) and self.episodes_left != 0:
                    self._done.setdefault(pid, []).append((pieces, False, conn_id))
                    self._done_steps += int(sum(b.lengths[j] for b, j in pieces))
                    if self.episodes_left is not None:
                        self.episodes_left -= 1
            else:
                self._open[end] = (pid, pieces, conn_id)

    def _end(self, key, stopped: bool) -> None:
        pid, pieces, source = self._open.pop(key)
        if sum(b.lengths[j] for b, j in pieces) and self.episodes_left is None:
            self._done.setdefault(pid, []).append((pieces, stopped, source))

    def _flush(self) -> None:
        for pid, episodes in self._done.items():
            if episodes:
                self.writer.write(pid, shard_arrays(episodes))
        self._done, self._done_steps = {}, 0
