"""The episode store: chunks waiting for the next update, the returns of complete
episodes, and where every env step went (received, trained, dropped, lost).

A run trains a set of policies (a single-agent run: one, ``DEFAULT_POLICY``); the store
keeps each policy's chunks, episode glue, returns and reward statistics, and the run's
counts and return window over all of them. Only the serving thread (``shmrl.server.serving``)
adds to it and takes from it; the training thread reads its counts and writes
``steps_trained`` once its update is done.
"""
from __future__ import annotations

import functools
import math
import time
from collections import deque

import numpy as np

from shmrl.core.episode import EpisodeBatch, obs_row_bytes
from shmrl.core.stats import RunningMeanStd, discounted_sums

PENDING_AT_CHECKPOINT = "not yet trained when the checkpoint was taken"
DEFAULT_POLICY = "default"   # a single-agent run's one policy (RLlib's default module)
SWITCHED = "sampled before the switch to the slow profile"   # by the networks the run no longer trains


def count(counter: dict, key, n: int) -> None:
    counter[key] = counter.get(key, 0) + n


class PolicyChunks:
    """One policy's chunks waiting for the next update, and the returns of its complete
    episodes.

    Continuation chunks are glued to the episode they continue by id when the client
    sends one, else by their first observation being the last one of an open chunk on
    the same connection (RLlib's client sends no id; with one env per client this is
    its order of messages).
    """

    def __init__(self, window: int = 100, reward_gamma: float | None = None, time_limit: int | None = None):
        """``reward_gamma``: keep the running variance of each stream's discounted return
        (``reward_stats``), by which rewards are scaled for training (VecNormalize's reward
        normalization, at the learner and per client stream instead of in a wrapper).
        ``time_limit``: the env's (``EnvSpec.max_episode_steps``), which a truncated episode
        must reach to be complete (``complete``)."""
        self.pending: list[tuple[str, EpisodeBatch]] = []   # (the connection it came from, a batch)
        self.pending_steps = 0
        self.pending_by_conn: dict[str, int] = {}   # conn_id -> its env steps in ``pending``
        self.returns: deque = deque(maxlen=window)
        self.lengths: deque = deque(maxlen=window)
        self.episodes_completed = 0
        self.steps_received = 0
        self.steps_trained = 0
        self.steps_by_conn: dict[str, int] = {}
        # glue key -> (return, length, discounted return) of an episode so far
        self._open: dict[tuple, tuple[float, int, float]] = {}
        self.reward_gamma = reward_gamma
        self.reward_stats = RunningMeanStd() if reward_gamma is not None else None
        self.window = window
        self.time_limit = time_limit
        self.returns_by_agent: dict = {}   # multi-agent chunks: agent id -> its recent returns
        self.recorder = None   # called with every batch taken (see EpisodeStore.record)

    def add(self, conn_id: str, batch: EpisodeBatch) -> list[tuple[float, int]]:
        """Take chunks: their steps wait for training, their returns complete episodes (one
        Python step per chunk, none per env step). Returns the (return, length) of each
        episode they complete."""
        ids = batch.episode_ids
        obs, first, last = batch.obs, batch.obs_first.tolist(), batch.obs_last.tolist()
        starts = [(conn_id, "id", ids[i]) if ids is not None and ids[i] is not None
                  else (conn_id, "obs", obs_row_bytes(obs, first[i])) for i in range(batch.num_chunks)]
        ends = [None] * batch.num_chunks   # the key each chunk leaves open (None: its episode ended)
        before = [self._open.pop(key, (0.0, 0, 0.0)) for key in starts]
        discounted = self._discounted_returns(batch, [b[2] for b in before])
        completed = []
        terminated = batch.is_terminated.tolist()
        for i, (ret, length, done) in enumerate(zip(batch.chunk_returns().tolist(), batch.lengths.tolist(),
                                                     batch.is_done.tolist())):
            ret, length = ret + before[i][0], length + before[i][1]
            if done and not self.complete(length, terminated[i]):   # trained on; no return, no "solved"
                continue
            if done:
                if batch.agent_ids is not None:
                    self.returns_by_agent.setdefault(batch.agent_ids[i], deque(maxlen=self.window)).append(ret)
                self.returns.append(ret)
                self.lengths.append(length)
                completed.append((ret, length))
            else:
                eid = ids[i] if ids is not None else None
                key = (conn_id, "id", eid) if eid is not None else (conn_id, "obs", obs_row_bytes(obs, last[i]))
                self._open[key] = (ret, length, discounted[i])
                ends[i] = key
        self.episodes_completed += len(completed)
        if self.recorder is not None:   # --record: the chunks and how they glue, to its writer thread
            self.recorder(conn_id, batch, starts, ends)
        if batch.num_steps:
            self.pending.append((conn_id, batch))
            count(self.pending_by_conn, conn_id, batch.num_steps)
            self.pending_steps += batch.num_steps
            self.steps_received += batch.num_steps
            count(self.steps_by_conn, conn_id, batch.num_steps)
        return completed

    def complete(self, length: int, terminated: bool) -> bool:
        """Whether an episode that ended after ``length`` steps completes one, with a return
        for the window (and "solved"): the env ended it (terminated), or it was truncated at
        the env's time limit (where unknown, after more than one step). An episode of no
        steps, or one cut short, is part of an episode: its return is no episode's return."""
        if terminated:
            return length > 0
        return length >= (self.time_limit or 2)

    def _discounted_returns(self, batch: EpisodeBatch, carries: list[float]) -> list[float]:
        """Each chunk's discounted return at its last step, going on from ``carries`` (its
        episode's so far); every step's goes into ``reward_stats``. Zeros without them."""
        if self.reward_stats is None or not batch.num_steps:
            return [0.0] * batch.num_chunks
        lengths = batch.lengths
        chunk_of_step = np.repeat(np.arange(batch.num_chunks), lengths)
        col = np.arange(batch.num_steps) - batch.offsets[chunk_of_step]
        padded = np.zeros((batch.num_chunks, int(lengths.max())))
        padded[chunk_of_step, col] = batch.rewards
        sums = discounted_sums(padded, self.reward_gamma, np.asarray(carries))
        self.reward_stats.update(sums[chunk_of_step, col])
        return np.where(lengths > 0, sums[np.arange(batch.num_chunks), np.maximum(lengths - 1, 0)],
                        carries).tolist()

    def reward_scale(self) -> float:
        """1 / the standard deviation of discounted returns (1 without ``reward_stats``)."""
        return 1.0 if self.reward_stats is None else float(1.0 / np.sqrt(self.reward_stats.var + 1e-8))

    def forget(self, conn_id: str) -> None:
        """A connection closed: its open episodes will never complete."""
        for key in [k for k in self._open if k[0] == conn_id]:
            del self._open[key]

    def take(self, version: int, max_lag: int | None, max_steps: int | None, dropped: dict,
             min_seq: int = 0) -> list[EpisodeBatch]:
        """The oldest pending batches, up to ``max_steps`` steps (None: all; the last batch
        may go over, unless that would make the update more than twice ``max_steps``: then
        it is cut between its chunks, and only a single chunk may go over), without the chunks
        sampled with weights more than ``max_lag`` versions older than ``version``, which
        are counted into ``dropped`` as stale, nor those sampled before version ``min_seq``
        (by the networks of another profile: ``SWITCHED``). Chunks without a version (RLlib's
        client sends none) count as current."""
        if max_lag is not None or min_seq > 0:
            fresh = []
            for conn_id, batch in self.pending:
                seq = batch.weights_seq_no
                for reason, old in (("stale", (seq >= 0) & (version - seq > (math.inf if max_lag is None else max_lag))),
                                    (SWITCHED, (seq >= 0) & (seq < min_seq))):
                    if old.any():
                        n_old = int(batch.lengths[old].sum())
                        count(dropped, reason, n_old)
                        self._unpend(conn_id, n_old)
                        batch = batch.select(~old)
                        seq = batch.weights_seq_no
                if batch.num_steps:
                    fresh.append((conn_id, batch))
            self.pending = fresh
        taken, steps = [], 0
        while self.pending and (max_steps is None or steps < max_steps):
            conn_id, batch = self.pending[0]
            if max_steps is not None and steps + batch.num_steps > 2 * max_steps and batch.num_chunks > 1:
                batch, rest = self._cut(batch, max_steps - steps)
                self.pending[0] = (conn_id, rest)
            else:
                self.pending.pop(0)
            taken.append(batch)
            steps += batch.num_steps
            self._unpend(conn_id, batch.num_steps)
        return taken

    @staticmethod
    def _cut(batch: EpisodeBatch, steps: int) -> tuple[EpisodeBatch, EpisodeBatch]:
        """The first chunks of ``batch`` that hold at most ``steps`` steps (at least one
        chunk), and the rest: one message of many chunks makes updates of the batch size."""
        ends = np.cumsum(batch.lengths)
        first = max(1, int(np.searchsorted(ends, steps, side="right")))
        head = np.arange(batch.num_chunks) < first
        return batch.select(head), batch.select(~head)

    def _unpend(self, conn_id: str, steps: int) -> None:
        self.pending_steps -= steps
        left = self.pending_by_conn.get(conn_id, 0) - steps
        if left > 0:
            self.pending_by_conn[conn_id] = left
        else:
            self.pending_by_conn.pop(conn_id, None)

    def counters(self) -> dict:
        """This policy's counts and return window, for a checkpoint (the run's keys)."""
        return {"steps_received": self.steps_received, "steps_trained": self.steps_trained,
                "steps_dropped": {PENDING_AT_CHECKPOINT: self.steps_received - self.steps_trained}
                if self.steps_received > self.steps_trained else {},
                "steps_lost": 0, "steps_by_conn": dict(self.steps_by_conn),
                "episodes_completed": self.episodes_completed,
                "returns": list(self.returns), "lengths": list(self.lengths)}

    def restore(self, counters: dict, arrays: dict) -> None:
        """Continue from ``counters()`` of an earlier run, and the reward statistics among
        its checkpoint's ``arrays`` (this policy's), if this store keeps them."""
        if self.reward_stats is not None and "reward_stats.mean" in arrays:
            self.reward_stats.set_state(arrays, "reward_stats")
        self.steps_received = int(counters["steps_received"])
        self.steps_trained = int(counters["steps_trained"])
        self.episodes_completed = int(counters["episodes_completed"])
        self.steps_by_conn = {k: int(v) for k, v in counters["steps_by_conn"].items()}
        self.returns.extend(counters["returns"])
        self.lengths.extend(counters["lengths"])

    def return_mean(self) -> float:
        returns = list(self.returns)   # one C-level copy: the serving thread may append
        return float(np.mean(returns)) if returns else float("nan")


class EpisodeStore:
    """The chunks of every policy of the run (``policies``: policy id -> PolicyChunks), the
    run's counts and its return window over every episode. ``take`` hands over each
    policy's chunks at once."""

    def __init__(self, policy_ids=(DEFAULT_POLICY,), window: int = 100, reward_gamma: float | None = None,
                 time_limit: int | None = None):
        """``time_limit``: the env's, which a truncated episode must reach to count
        (``PolicyChunks.complete``)."""
        self.policies = {pid: PolicyChunks(window, reward_gamma, time_limit) for pid in policy_ids}
        self.returns: deque = deque(maxlen=window)
        self.lengths: deque = deque(maxlen=window)
        self.episodes_completed = 0
        self.steps_received = 0
        self.steps_taken = 0       # handed to the trainer (by the serving thread)
        self.steps_trained = 0     # trained on (by the training thread, once its update is done)
        self.steps_skipped = 0     # taken for an update that was skipped (by the training thread)
        self.steps_dropped: dict[str, int] = {}
        self.steps_refused = 0     # of those dropped, refused as they came in (``drop``): never the run's budget
        self.steps_lost = 0        # stepped by a simulator that died before sending them: never received
        self.steps_by_conn: dict[str, int] = {}
        self.first_steps_at: float | None = None   # time.time() when the first env steps arrived
        self.recorder = None       # --record: a shmrl.server.recorder.Recorder that gets every chunk taken

    def record(self, recorder) -> None:
        """Hand every chunk taken from now on to ``recorder`` (``add(policy id, conn_id,
        batch, starts, ends)``, with the glue keys of its chunks, and ``forget``)."""
        self.recorder = recorder
        for pid, policy in self.policies.items():
            policy.recorder = functools.partial(recorder.add, pid)

    def add(self, conn_id: str, chunks: dict[str, EpisodeBatch]) -> None:
        """Take a message's chunks, by policy id."""
        steps = 0
        for pid, batch in chunks.items():
            for ret, length in self.policies[pid].add(conn_id, batch):
                self.returns.append(ret)
                self.lengths.append(length)
                self.episodes_completed += 1
            steps += batch.num_steps
        if steps:
            if self.first_steps_at is None:
                self.first_steps_at = time.time()
            self.steps_received += steps
            count(self.steps_by_conn, conn_id, steps)

    @property
    def pending_steps(self) -> int:
        return sum(policy.pending_steps for policy in self.policies.values())

    def pending_of(self, conn_id: str) -> int:
        """The env steps from ``conn_id`` waiting for training (its budget's use)."""
        return sum(policy.pending_by_conn.get(conn_id, 0) for policy in self.policies.values())

    def forget(self, conn_id: str) -> None:
        """A connection closed: its open episodes will never complete."""
        for policy in self.policies.values():
            policy.forget(conn_id)
        if self.recorder is not None:
            self.recorder.forget(conn_id)

    def drop(self, reason: str, steps: int) -> None:
        """Count steps received but refused as they came in (over a client's budget, out
        of bounds, not fitting the env): dropped, never silently lost, and not part of
        ``steps_accepted``, so a flooding or hostile client cannot spend the run's budget."""
        self.steps_received += steps
        self.steps_refused += steps
        count(self.steps_dropped, reason, steps)

    @property
    def steps_accepted(self) -> int:
        """Steps received less those refused as they came in: what --max-env-steps counts."""
        return self.steps_received - self.steps_refused

    def take(self, version: int = 0, max_lag: int | None = None,
             max_steps: int | None = None, min_seq: int = 0) -> dict[str, list[EpisodeBatch]]:
        """Each policy's oldest pending batches (see ``PolicyChunks.take``), by policy id;
        policies with none are left out. ``max_steps`` bounds a lone policy's batch: the
        chunks of several policies (one multi-agent message holds all of theirs) go together."""
        max_steps = max_steps if len(self.policies) == 1 else None
        taken = {}
        for pid, policy in self.policies.items():
            batches = policy.take(version, max_lag, max_steps, self.steps_dropped, min_seq)
            if batches:
                taken[pid] = batches
                self.steps_taken += sum(b.num_steps for b in batches)
        return taken

    def trained(self, chunks: dict[str, EpisodeBatch]) -> None:
        """An update on ``chunks`` (by policy id) is done (training thread only)."""
        for pid, batch in chunks.items():
            self.policies[pid].steps_trained += batch.num_steps
        self.steps_trained += sum(batch.num_steps for batch in chunks.values())

    def skipped(self, chunks: dict[str, EpisodeBatch], reason: str) -> None:
        """An update on ``chunks`` was skipped: their steps are dropped for ``reason`` (training
        thread only; the serving thread never writes that key)."""
        steps = sum(batch.num_steps for batch in chunks.values())
        self.steps_skipped += steps
        count(self.steps_dropped, reason, steps)

    @property
    def in_flight(self) -> int:
        """Steps taken for an update that has not finished (or never will: the run ended)."""
        return self.steps_taken - self.steps_trained - self.steps_skipped

    def counters(self) -> dict:
        """The counts and return windows, for a checkpoint, with each policy's under
        ``policies``. Steps not yet trained on (pending or in flight) count as dropped: a run
        resumed from it never trains on them."""
        dropped = dict(self.steps_dropped)
        untrained = self.pending_steps + self.in_flight
        if untrained:
            count(dropped, PENDING_AT_CHECKPOINT, untrained)
        return {"steps_received": self.steps_received, "steps_trained": self.steps_trained,
                "steps_dropped": dropped, "steps_refused": self.steps_refused, "steps_lost": self.steps_lost,
                "steps_by_conn": dict(self.steps_by_conn), "episodes_completed": self.episodes_completed,
                "returns": list(self.returns), "lengths": list(self.lengths),
                "policies": {pid: policy.counters() for pid, policy in self.policies.items()}}

    def restore(self, counters: dict, arrays: dict[str, dict]) -> None:
        """Continue from ``counters()`` of an earlier run, and each policy's reward
        statistics among ``arrays`` (by policy id)."""
        for key in ("steps_received", "steps_trained", "steps_lost", "episodes_completed"):
            setattr(self, key, int(counters[key]))
        self.steps_taken, self.steps_skipped = self.steps_trained, 0
        self.steps_dropped = {k: int(v) for k, v in counters["steps_dropped"].items()}
        self.steps_refused = int(counters.get("steps_refused", 0))   # checkpoints before it: none known
        self.steps_by_conn = {k: int(v) for k, v in counters["steps_by_conn"].items()}
        self.returns.extend(counters["returns"])
        self.lengths.extend(counters["lengths"])
        for pid, policy in self.policies.items():
            saved = counters["policies"].get(pid)
            if saved is not None:
                policy.restore(saved, arrays.get(pid, {}))

    def return_mean(self) -> float:
        returns = list(self.returns)   # one C-level copy: the serving thread may append
        return float(np.mean(returns)) if returns else float("nan")

    def policy_return_means(self) -> dict:
        return {pid: policy.return_mean() for pid, policy in self.policies.items()}

    def agent_return_means(self) -> dict:
        return {str(a): float(np.mean(list(r))) for policy in self.policies.values()
                for a, r in list(policy.returns_by_agent.items()) if r}
