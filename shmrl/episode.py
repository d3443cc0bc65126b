"""Episode chunks, with RLlib's semantics: one at a time (``Episode``), column-wise
(``EpisodeBatch``, what a message carries and the learner trains on), and recorded from
vectorized envs (``Rollout``).

A chunk starts from an observation (the reset observation, or the last observation of
the chunk it continues) and then holds (action, reward, next observation) steps, so
``obs`` has one entry more than ``actions``. Its length is the number of actions.
``cut()`` ends the chunk where it is (the episode is still running) and returns the
continuation chunk, which starts from the last observation and keeps the episode id.
"""
from __future__ import annotations

import itertools
import os

import numpy as np

# The fields of an RLlink episode (docs/RLLINK.md, "Episodes"). RLlib 2.48's client writes, and its server
# reads, "is_terminated" and "is_truncated"; "terminateds"/"truncateds" (RLlib's column
# names, which shmrl sent before) are accepted too.
OBS = "obs"
ACTIONS = "actions"
REWARDS = "rewards"
ACTION_DIST_INPUTS = "action_dist_inputs"
ACTION_LOGP = "action_logp"
TERMINATED = "is_terminated"
TRUNCATED = "is_truncated"
FLAG_ALIASES = {"terminateds": TERMINATED, "truncateds": TRUNCATED}
# Optional shmrl extensions, never required from a client.
EPISODE_ID = "episode_id"
WEIGHTS_SEQ_NO = "weights_seq_no"
# Multi-agent chunks (RLlib's vocabulary): the agent that took the steps and the policy
# (module) that chose them. A chunk has both or neither.
AGENT_ID = "agent_id"
MODULE_ID = "module_id"
# A recurrent policy's state before the chunk's first step (float32, the graph's state_in.<i>
# side by side): what lets the learner replay a chunk cut in mid-episode. Absent: zeros,
# the state an episode starts from.
STATE_IN = "state_in"
STEP_FIELDS = (ACTIONS, REWARDS, ACTION_DIST_INPUTS, ACTION_LOGP)  # one row per step

_ids = itertools.count()


# Observations are one array (rows x shape) or, for a Dict or Tuple space, a dict of such
# arrays by leaf name (shmrl.spaces). These few helpers are all that differs.

def obs_map(fn, obs):
    """``fn`` applied to every leaf array of ``obs``."""
    return {k: fn(v) for k, v in obs.items()} if isinstance(obs, dict) else fn(obs)


def obs_concat(parts: list):
    if parts and isinstance(parts[0], dict):
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    return np.concatenate(parts)


def obs_rows(obs) -> int:
    return len(next(iter(obs.values()))) if isinstance(obs, dict) else len(obs)


def obs_row_bytes(obs, i: int) -> bytes:
    """Row ``i`` as bytes: what glues a continuation chunk to its episode without an id."""
    if isinstance(obs, dict):
        return b"".join(v[i].tobytes() for v in obs.values())
    return obs[i].tobytes()


def stack_obs(rows: list):
    """Per-step observations (arrays, or dicts of leaf values) as one observation batch."""
    if rows and isinstance(rows[0], dict):
        return {k: np.stack([np.asarray(r[k]) for r in rows]) for k in rows[0]}
    arr = np.asarray(rows)
    return arr if arr.dtype == np.uint8 else arr.astype(np.float32)   # images stay bytes


def obs_steps(obs) -> list:
    """The inverse of ``stack_obs``: one observation per row (dicts of leaf rows)."""
    if isinstance(obs, dict):
        return [{k: v[i] for k, v in obs.items()} for i in range(obs_rows(obs))]
    return obs


def new_episode_id() -> str:
    return f"{os.getpid():x}-{next(_ids):x}"


class Episode:
    __slots__ = ("id", "obs", "actions", "rewards", "action_dist_inputs", "action_logp",
                 "is_terminated", "is_truncated", "weights_seq_no", "state_in", "agent_id")

    def __init__(self, first_obs, id: str | None = None, weights_seq_no: int | None = None, state_in=None,
                 agent_id=None):
        self.id = id if id is not None else new_episode_id()
        self.agent_id = agent_id
        self.obs = [first_obs]
        self.actions = []
        self.rewards = []
        self.action_dist_inputs = []
        self.action_logp = []
        self.is_terminated = False
        self.is_truncated = False
        self.weights_seq_no = weights_seq_no
        self.state_in = None if state_in is None else np.asarray(state_in, np.float32).reshape(-1)

    def __len__(self) -> int:
        return len(self.actions)

    @property
    def is_done(self) -> bool:
        return self.is_terminated or self.is_truncated

    def add_step(self, action, reward, obs, action_dist_inputs, action_logp,
                 terminated: bool = False, truncated: bool = False) -> None:
        if self.is_done:
            raise ValueError(f"episode {self.id} is done; start a new one")
        self.actions.append(action)
        self.rewards.append(reward)
        self.obs.append(obs)
        self.action_dist_inputs.append(action_dist_inputs)
        self.action_logp.append(action_logp)
        self.is_terminated = bool(terminated)
        self.is_truncated = bool(truncated)

    def cut(self) -> "Episode":
        """The continuation of this still-running episode, starting from its last obs."""
        if self.is_done:
            raise ValueError(f"episode {self.id} is done; a done episode has no continuation")
        return Episode(self.obs[-1], id=self.id, weights_seq_no=self.weights_seq_no, agent_id=self.agent_id)

    def get_return(self) -> float:
        return float(np.sum(self.rewards, dtype=np.float64))

    def finalize(self) -> "Episode":
        """Turn the step lists into numpy arrays (in place) and return self."""
        if isinstance(self.obs, list):
            self.obs = stack_obs(self.obs)
        n = obs_rows(self.obs) - 1
        self.actions = np.asarray(self.actions)
        if self.actions.dtype.kind in "iub" or n == 0:
            self.actions = self.actions.astype(np.int64)
        else:
            self.actions = self.actions.astype(np.float32)
        self.rewards = np.asarray(self.rewards, dtype=np.float32).reshape(n)
        self.action_dist_inputs = np.asarray(self.action_dist_inputs, dtype=np.float32).reshape(n, -1 if n else 0)
        self.action_logp = np.asarray(self.action_logp, dtype=np.float32).reshape(n)
        return self

    def to_rllink(self) -> dict:
        """The RLlink episode dict (numpy arrays; ``encode_json`` turns them into lists)."""
        self.finalize()
        d = {
            OBS: obs_steps(self.obs),
            ACTIONS: self.actions,
            REWARDS: self.rewards,
            ACTION_DIST_INPUTS: self.action_dist_inputs,
            ACTION_LOGP: self.action_logp,
            TERMINATED: self.is_terminated,
            TRUNCATED: self.is_truncated,
        }
        if self.id is not None:   # chunks without an id (RLlib's client sends none) are glued by observation
            d[EPISODE_ID] = self.id
        if self.weights_seq_no is not None:
            d[WEIGHTS_SEQ_NO] = self.weights_seq_no
        if self.agent_id is not None:
            d[AGENT_ID] = self.agent_id
        if self.state_in is not None:
            d[STATE_IN] = self.state_in
        return d

    @classmethod
    def from_rllink(cls, d: dict) -> "Episode":
        """Wrap an episode dict that ``validate`` has normalized (numpy arrays)."""
        ep = cls.__new__(cls)
        ep.id = d.get(EPISODE_ID)
        ep.obs = d[OBS]
        ep.actions = d[ACTIONS]
        ep.rewards = d[REWARDS]
        ep.action_dist_inputs = d[ACTION_DIST_INPUTS]
        ep.action_logp = d[ACTION_LOGP]
        ep.is_terminated = bool(d[TERMINATED])
        ep.is_truncated = bool(d[TRUNCATED])
        ep.weights_seq_no = d.get(WEIGHTS_SEQ_NO)
        ep.agent_id = d.get(AGENT_ID)
        ep.state_in = d.get(STATE_IN)
        return ep


class EpisodeBatch:
    """Episode chunks stored column-wise: what one EPISODES message carries, what the
    learner keeps until it trains, and what a training batch is made of. Per-chunk work
    is a few array operations however many chunks there are.

    Chunk i has ``lengths[i]`` steps, rows ``offsets[i]:offsets[i+1]`` of the step fields
    (``actions``, ``rewards``, ``action_dist_inputs``, ``action_logp``), and one
    observation more, rows ``obs_first[i]..obs_last[i]`` of ``obs``. Per chunk also:
    ``is_terminated``, ``is_truncated``, ``weights_seq_no`` (int64, -1 where the client
    did not say), ``episode_ids`` (a list, None entries where the client sent none; or
    None for all), ``state_in`` (float32 [chunks, state_size]: a recurrent policy's
    state before each chunk's first step; or None) and ``agent_ids`` (a list in a
    multi-agent batch, else None).

    The constructor takes arrays as they are; ``rllink.validate`` is what checks a
    client's (``shmrl.rllink`` builds every batch that comes off a wire).
    """

    __slots__ = ("obs", "actions", "rewards", "action_dist_inputs", "action_logp", "lengths",
                 "is_terminated", "is_truncated", "episode_ids", "weights_seq_no", "state_in", "agent_ids",
                 "num_steps", "offsets", "obs_first", "obs_last")

    def __init__(self, *, obs, actions, rewards, action_dist_inputs, action_logp, lengths,
                 is_terminated, is_truncated, episode_ids=None, weights_seq_no=None, state_in=None,
                 agent_ids=None):
        self.agent_ids = agent_ids
        self.obs, self.actions, self.rewards = obs, actions, rewards
        self.action_dist_inputs, self.action_logp = action_dist_inputs, action_logp
        self.lengths = np.asarray(lengths, np.int64)
        self.is_terminated = np.asarray(is_terminated, bool)
        self.is_truncated = np.asarray(is_truncated, bool)
        self.episode_ids = episode_ids
        self.state_in = state_in
        n = len(self.lengths)
        self.weights_seq_no = (np.full(n, -1, np.int64) if weights_seq_no is None
                               else np.asarray(weights_seq_no, np.int64))
        self.offsets = np.zeros(n + 1, np.int64)
        np.cumsum(self.lengths, out=self.offsets[1:])
        self.num_steps = int(self.offsets[-1])
        self.obs_first = self.offsets[:-1] + np.arange(n)
        self.obs_last = self.obs_first + self.lengths

    @property
    def num_chunks(self) -> int:
        return len(self.lengths)

    @property
    def is_done(self) -> np.ndarray:
        return self.is_terminated | self.is_truncated

    def chunk_returns(self) -> np.ndarray:
        """The sum of each chunk's rewards (float64)."""
        cum = np.zeros(self.num_steps + 1)
        np.cumsum(self.rewards, dtype=np.float64, out=cum[1:])
        return cum[self.offsets[1:]] - cum[self.offsets[:-1]]

    def chunk(self, i: int) -> Episode:
        """Chunk ``i`` as an Episode whose arrays are views into this batch."""
        a, b = self.offsets[i], self.offsets[i + 1]
        ep = Episode.__new__(Episode)
        rows = slice(self.obs_first[i], self.obs_last[i] + 1)
        ep.obs = obs_map(lambda v: v[rows], self.obs)
        ep.actions, ep.rewards = self.actions[a:b], self.rewards[a:b]
        ep.action_dist_inputs, ep.action_logp = self.action_dist_inputs[a:b], self.action_logp[a:b]
        ep.is_terminated, ep.is_truncated = bool(self.is_terminated[i]), bool(self.is_truncated[i])
        ep.id = self.episode_ids[i] if self.episode_ids is not None else None
        seq = int(self.weights_seq_no[i])
        ep.weights_seq_no = seq if seq >= 0 else None
        ep.agent_id = self.agent_ids[i] if self.agent_ids is not None else None
        ep.state_in = self.state_in[i] if self.state_in is not None else None
        return ep

    def chunks(self) -> list[Episode]:
        return [self.chunk(i) for i in range(self.num_chunks)]

    def to_dicts(self) -> list[dict]:
        """The chunks as RLlink episode dicts (numpy views): the list form of JSON messages."""
        return [ep.to_rllink() for ep in self.chunks()]

    def columns(self) -> dict:
        """Every field by its RLlink name, plus ``lengths``: what the binary codec carries."""
        cols = {"lengths": self.lengths, OBS: self.obs, ACTIONS: self.actions, REWARDS: self.rewards,
                ACTION_DIST_INPUTS: self.action_dist_inputs, ACTION_LOGP: self.action_logp,
                TERMINATED: self.is_terminated, TRUNCATED: self.is_truncated,
                WEIGHTS_SEQ_NO: self.weights_seq_no}
        if self.episode_ids is not None:
            cols[EPISODE_ID] = self.episode_ids
        if self.agent_ids is not None:
            cols[AGENT_ID] = self.agent_ids
        if self.state_in is not None:
            cols[STATE_IN] = self.state_in
        return cols

    def select(self, keep) -> "EpisodeBatch":
        """The chunks where the boolean mask ``keep`` is true, in order."""
        keep = np.asarray(keep, bool)
        steps = np.repeat(keep, self.lengths)
        obs_keep = np.repeat(keep, self.lengths + 1)
        return EpisodeBatch(
            obs=obs_map(lambda v: v[obs_keep], self.obs), actions=self.actions[steps], rewards=self.rewards[steps],
            action_dist_inputs=self.action_dist_inputs[steps], action_logp=self.action_logp[steps],
            lengths=self.lengths[keep], is_terminated=self.is_terminated[keep],
            is_truncated=self.is_truncated[keep], weights_seq_no=self.weights_seq_no[keep],
            episode_ids=(None if self.episode_ids is None
                         else [e for e, k in zip(self.episode_ids, keep.tolist()) if k]),
            state_in=None if self.state_in is None else self.state_in[keep],
            agent_ids=(None if self.agent_ids is None
                       else [a for a, k in zip(self.agent_ids, keep.tolist()) if k]))

    @classmethod
    def concat(cls, batches: list["EpisodeBatch"]) -> "EpisodeBatch":
        """One batch of the chunks of ``batches``, in order."""
        if len(batches) == 1:
            return batches[0]
        ids = None
        if any(b.episode_ids is not None for b in batches):
            ids = [e for b in batches for e in (b.episode_ids or [None] * b.num_chunks)]
        agents = None
        if any(b.agent_ids is not None for b in batches):
            agents = [a for b in batches for a in (b.agent_ids or [None] * b.num_chunks)]
        states = [b.state_in for b in batches]
        if any(s is None for s in states) and not all(s is None for s in states):
            raise ValueError("some batches carry state_in and some do not")
        return cls(agent_ids=agents, **{k: np.concatenate([getattr(b, k) for b in batches])
                      for k in ("actions", "rewards", "action_dist_inputs", "action_logp", "lengths",
                                "is_terminated", "is_truncated", "weights_seq_no")},
                   obs=obs_concat([b.obs for b in batches]), episode_ids=ids,
                   state_in=None if states[0] is None else np.concatenate(states))

    @classmethod
    def from_episodes(cls, episodes: list) -> "EpisodeBatch":
        """Finalized Episodes (or validated RLlink dicts, see Episode.from_rllink) in one batch.
        They must agree in observation shape and action type (one environment)."""
        eps = [e if isinstance(e, Episode) else Episode.from_rllink(e) for e in episodes]
        if not eps:  # a message may carry no episode at all
            empty = np.zeros(0, np.float32)
            return cls(obs=empty, actions=np.zeros(0, np.int64), rewards=empty,
                       action_dist_inputs=np.zeros((0, 0), np.float32), action_logp=empty, lengths=[],
                       is_terminated=[], is_truncated=[])
        stepped = [e for e in eps if len(e)] or eps[:1]  # empty chunks say nothing of step shapes

        def steps(field):
            return np.concatenate([getattr(e, field) for e in stepped])

        ids = [e.id for e in eps]
        agents = [getattr(e, "agent_id", None) for e in eps]
        states = None
        sizes = {len(e.state_in) for e in eps if e.state_in is not None}
        if len(sizes) > 1:
            raise ValueError(f"the chunks' state_in differ in size ({sorted(sizes)})")
        if sizes:   # a chunk without one starts from zeros
            states = np.zeros((len(eps), sizes.pop()), np.float32)
            for i, e in enumerate(eps):
                if e.state_in is not None:
                    states[i] = e.state_in
        return cls(obs=obs_concat([e.obs for e in eps]), actions=steps(ACTIONS), rewards=steps(REWARDS),
                   action_dist_inputs=steps(ACTION_DIST_INPUTS), action_logp=steps(ACTION_LOGP),
                   lengths=[len(e) for e in eps], is_terminated=[e.is_terminated for e in eps],
                   is_truncated=[e.is_truncated for e in eps],
                   weights_seq_no=[-1 if e.weights_seq_no is None else e.weights_seq_no for e in eps],
                   episode_ids=None if all(i is None for i in ids) else ids, state_in=states,
                   agent_ids=None if all(a is None for a in agents) else agents)


class MultiAgentBatch:
    """The chunks of a multi-agent message: ``policies`` maps a module_id (policy) to an
    EpisodeBatch of the chunks its agents stepped, with their ``agent_ids``. JSON writes it
    as RLlib's list of episode objects, each with ``agent_id`` and ``module_id``; the binary
    codec as one set of columns per policy."""

    __slots__ = ("policies",)

    def __init__(self, policies: dict):
        self.policies = policies

    @property
    def num_steps(self) -> int:
        return sum(b.num_steps for b in self.policies.values())

    @property
    def num_chunks(self) -> int:
        return sum(b.num_chunks for b in self.policies.values())

    def to_dicts(self) -> list[dict]:
        return [{**d, MODULE_ID: module} for module, batch in self.policies.items() for d in batch.to_dicts()]


class Rollout:
    """``steps`` steps of ``num_envs`` envs in preallocated arrays: recording a step is one
    array write per field, however many envs there are. ``batch()`` turns the steps into
    an EpisodeBatch of RLlink chunks with a few array operations: an episode that ended
    becomes a terminated or truncated chunk (its last observation is the one the env
    returned before it was reset), a running one a chunk that the next rollout continues
    under the same episode id.

    ``obs[t]`` is what the policy saw at step t; ``obs[steps]`` is where the next rollout
    starts. With a recurrent policy, ``start`` takes each env's state too, and every chunk
    carries the state before its first step: that one for the chunks that begin the
    rollout, zeros for those that begin an episode.
    """

    def __init__(self, num_envs: int, steps: int):
        self.num_envs, self.steps = num_envs, steps
        self.ids = [new_episode_id() for _ in range(num_envs)]
        self.returns = np.zeros(num_envs)  # of each env's running episode, so far
        self.completed: list[float] = []   # returns of the episodes that ended, for the caller to read
        self.t = 0
        self._state0: np.ndarray | None = None
        self._bufs: dict[str, np.ndarray] | None = None
        self._final_obs: list[tuple] = []  # (step, envs that ended, their final obs)

    def start(self, obs, state: np.ndarray | None = None) -> None:
        """Begin a rollout from ``obs`` (one row per env; a dict of leaves for a Dict space)
        and, for a recurrent policy, each env's ``state`` ([envs, state_size])."""
        self.t = 0
        self._obs0 = obs_map(np.array, obs)  # a copy: envs reuse their arrays
        self._state0 = None if state is None else np.array(state, np.float32)

    def record(self, actions, action_dist_inputs, action_logp, obs, rewards, terminated, truncated,
               final_obs=None) -> None:
        """One step of every env: what was done and what came of it. ``final_obs``: the last
        observation of the envs that ended, which ``obs`` already shows reset; None when no
        env ended, as the vector envs return it. Then ``terminated`` and ``truncated`` are
        all false and not written: two array writes fewer, about 40% of a step's recording
        with one env."""
        if self._bufs is None:  # shapes and dtypes from the first step
            fields = {ACTIONS: actions, ACTION_DIST_INPUTS: action_dist_inputs, ACTION_LOGP: action_logp,
                      REWARDS: rewards, TERMINATED: terminated, TRUNCATED: truncated}
            T, K = self.steps, self.num_envs
            self._bufs = {k: np.zeros((T, K, *np.shape(v)[1:]), np.asarray(v).dtype) for k, v in fields.items()}
            self._obs = obs_map(lambda v: np.zeros((T + 1, K, *v.shape[1:]), v.dtype), obs)
        t, bufs = self.t, self._bufs
        if t == 0:
            self._final_obs = []
            self._write_obs(0, self._obs0)
            bufs[TERMINATED][:] = bufs[TRUNCATED][:] = False
        bufs[ACTIONS][t] = actions
        bufs[ACTION_DIST_INPUTS][t] = action_dist_inputs
        bufs[ACTION_LOGP][t] = action_logp
        bufs[REWARDS][t] = rewards
        self._write_obs(t + 1, obs)
        if final_obs is not None:  # where an env ended, the step led to its final obs, not the reset one
            bufs[TERMINATED][t] = terminated
            bufs[TRUNCATED][t] = truncated
            ended = np.flatnonzero(np.asarray(terminated) | np.asarray(truncated))
            self._final_obs.append((t, ended, obs_map(lambda v: np.array(v[ended]), final_obs)))
        self.t = t + 1

    def _write_obs(self, t: int, obs) -> None:
        if isinstance(obs, dict):
            for k, v in obs.items():
                self._obs[k][t] = v
        else:
            self._obs[t] = obs

    def batch(self, weights_seq_no: int | None = None) -> EpisodeBatch | None:
        """The recorded steps as RLlink chunks, env by env (copies; None if nothing was
        recorded); ``weights_seq_no``: the version of the policy that sampled them."""
        b, T, K = self._bufs, self.t, self.num_envs
        if b is None or T == 0:
            return None

        def env_major(a):  # [T, K, ...] -> a copy [K * T, ...]: each env's steps contiguous
            out = np.empty((K * T, *a.shape[2:]), a.dtype)
            out.reshape(K, T, *a.shape[2:])[...] = a[:T].swapaxes(0, 1)
            return out

        terminated, truncated = env_major(b[TERMINATED]), env_major(b[TRUNCATED])
        done = terminated | truncated
        ends = done.copy()
        ends[T - 1::T] = True                        # a chunk also ends where the rollout does
        last = np.flatnonzero(ends)                  # each chunk's last step (flat index)
        first = np.concatenate(([0], last[:-1] + 1))
        lengths = last - first + 1
        n = len(lengths)
        # A chunk's observations: the one its first step saw, then each step's next one
        # (which, where an env ended, is its final obs, not the reset one it saw next).
        first_rows = first + np.arange(n)
        rest = np.ones(K * T + n, bool)
        rest[first_rows] = False

        def chunk_obs(buf, final_of):
            seen, following = env_major(buf), env_major(buf[1:])
            for t, ended, final in self._final_obs:
                following[ended * T + t] = final_of(final)
            obs = np.empty((K * T + n, *seen.shape[1:]), seen.dtype)
            obs[first_rows] = seen[first]
            obs[rest] = following
            return obs

        if isinstance(self._obs, dict):
            obs = {k: chunk_obs(buf, lambda final, k=k: final[k]) for k, buf in self._obs.items()}
        else:
            obs = chunk_obs(self._obs, lambda final: final)
        batch = EpisodeBatch(
            obs=obs, actions=env_major(b[ACTIONS]), rewards=env_major(b[REWARDS]).astype(np.float32),
            action_dist_inputs=env_major(b[ACTION_DIST_INPUTS]).astype(np.float32),
            action_logp=env_major(b[ACTION_LOGP]).astype(np.float32), lengths=lengths,
            is_terminated=terminated[last], is_truncated=truncated[last],
            weights_seq_no=None if weights_seq_no is None else np.full(n, weights_seq_no))
        if self._state0 is not None:
            batch.state_in = np.zeros((n, self._state0.shape[1]), np.float32)
            at_start = first % T == 0                # the chunks that begin this rollout
            batch.state_in[at_start] = self._state0[first[at_start] // T]
        # Ids and running returns: a Python step per chunk (chunks are few next to steps).
        ids, chunk_done, chunk_env = [], done[last].tolist(), (first // T).tolist()
        for k, ret, ended in zip(chunk_env, batch.chunk_returns().tolist(), chunk_done):
            ids.append(self.ids[k])
            if ended:
                self.completed.append(float(self.returns[k] + ret))
                self.returns[k] = 0.0
                self.ids[k] = new_episode_id()
            else:
                self.returns[k] += ret
        batch.episode_ids = ids
        return batch
