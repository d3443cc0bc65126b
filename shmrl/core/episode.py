"""Episode chunks, with RLlib's semantics: one at a time (``Episode``) and column-wise
(``EpisodeBatch``, what a message carries and the learner trains on). A simulator records
them from vectorized envs with ``shmrl.client.rollout.Rollout``.

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
# arrays by leaf name (shmrl.core.spaces). These few helpers are all that differs.

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
    client's (``shmrl.rllink.messages`` builds every batch that comes off a wire).
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
