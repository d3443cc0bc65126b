"""One chunk of one episode, with RLlib's semantics.

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

from shmrl import rllink

_ids = itertools.count()


def new_episode_id() -> str:
    return f"{os.getpid():x}-{next(_ids):x}"


class Episode:
    __slots__ = ("id", "obs", "actions", "rewards", "action_dist_inputs", "action_logp",
                 "is_terminated", "is_truncated", "weights_seq_no")

    def __init__(self, first_obs, id: str | None = None, weights_seq_no: int | None = None):
        self.id = id if id is not None else new_episode_id()
        self.obs = [first_obs]
        self.actions = []
        self.rewards = []
        self.action_dist_inputs = []
        self.action_logp = []
        self.is_terminated = False
        self.is_truncated = False
        self.weights_seq_no = weights_seq_no

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
        return Episode(self.obs[-1], id=self.id, weights_seq_no=self.weights_seq_no)

    def get_return(self) -> float:
        return float(np.sum(self.rewards, dtype=np.float64))

    def finalize(self) -> "Episode":
        """Turn the step lists into numpy arrays (in place) and return self."""
        self.obs = np.asarray(self.obs, dtype=np.float32)
        n = len(self.obs) - 1
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
        """The RLlink episode dict (numpy arrays; ``rllink.encode_json`` turns them into lists)."""
        self.finalize()
        d = {
            rllink.OBS: self.obs,
            rllink.ACTIONS: self.actions,
            rllink.REWARDS: self.rewards,
            rllink.ACTION_DIST_INPUTS: self.action_dist_inputs,
            rllink.ACTION_LOGP: self.action_logp,
            rllink.TERMINATED: self.is_terminated,
            rllink.TRUNCATED: self.is_truncated,
            rllink.EPISODE_ID: self.id,
        }
        if self.weights_seq_no is not None:
            d[rllink.WEIGHTS_SEQ_NO] = self.weights_seq_no
        return d

    @classmethod
    def from_rllink(cls, d: dict) -> "Episode":
        """Wrap an episode dict that ``rllink.validate`` has normalized (numpy arrays)."""
        ep = cls.__new__(cls)
        ep.id = d.get(rllink.EPISODE_ID)
        ep.obs = d[rllink.OBS]
        ep.actions = d[rllink.ACTIONS]
        ep.rewards = d[rllink.REWARDS]
        ep.action_dist_inputs = d[rllink.ACTION_DIST_INPUTS]
        ep.action_logp = d[rllink.ACTION_LOGP]
        ep.is_terminated = bool(d[rllink.TERMINATED])
        ep.is_truncated = bool(d[rllink.TRUNCATED])
        ep.weights_seq_no = d.get(rllink.WEIGHTS_SEQ_NO)
        return ep


class Rollout:
    """``steps`` steps of ``num_envs`` envs in preallocated arrays: recording a step is one
    array write per field, however many envs there are. ``chunks()`` cuts the steps into
    RLlink episode chunks: an episode that ended becomes a terminated or truncated chunk
    (its last observation is the one the env returned before it was reset), a running one
    a chunk that the next rollout continues under the same episode id.

    ``obs[t]`` is what the policy saw at step t; ``obs[steps]`` is where the next rollout
    starts.
    """

    def __init__(self, num_envs: int, steps: int):
        self.num_envs, self.steps = num_envs, steps
        self.ids = [new_episode_id() for _ in range(num_envs)]
        self.returns = np.zeros(num_envs)  # of each env's running episode, so far
        self.completed: list[float] = []   # returns of the episodes that ended, for the caller to read
        self.t = 0
        self._bufs: dict[str, np.ndarray] | None = None
        self._final_obs: dict[tuple[int, int], np.ndarray] = {}

    def start(self, obs: np.ndarray) -> None:
        """Begin a rollout from ``obs`` (one row per env)."""
        self.t = 0
        self._final_obs.clear()
        self._obs0 = np.array(obs, np.float32)  # a copy: envs reuse their arrays

    def record(self, actions, action_dist_inputs, action_logp, obs, rewards, terminated, truncated,
               final_obs=None) -> None:
        """One step of every env: what was done and what came of it (``final_obs``: the last
        observation of the envs that ended, which ``obs`` already shows reset)."""
        if self._bufs is None:  # shapes and dtypes from the first step
            fields = {"actions": actions, "action_dist_inputs": action_dist_inputs, "action_logp": action_logp,
                      "rewards": rewards, "terminated": terminated, "truncated": truncated}
            T, K = self.steps, self.num_envs
            self._bufs = {k: np.zeros((T, K, *np.shape(v)[1:]), np.asarray(v).dtype) for k, v in fields.items()}
            self._bufs["obs"] = np.zeros((T + 1, K, *np.shape(obs)[1:]), np.float32)
        if self.t == 0:
            self._bufs["obs"][0] = self._obs0
        t, bufs = self.t, self._bufs
        bufs["actions"][t] = actions
        bufs["action_dist_inputs"][t] = action_dist_inputs
        bufs["action_logp"][t] = action_logp
        bufs["rewards"][t] = rewards
        bufs["terminated"][t] = terminated
        bufs["truncated"][t] = truncated
        bufs["obs"][t + 1] = obs
        if final_obs is not None:
            for k in np.flatnonzero(np.asarray(terminated) | np.asarray(truncated)):
                self._final_obs[(t, int(k))] = np.array(final_obs[k], np.float32)
        self.t = t + 1

    def chunks(self, weights_seq_no: int | None = None) -> list[dict]:
        """The recorded steps as RLlink episode dicts (numpy arrays, copies), one per episode
        part; ``weights_seq_no``: the version of the policy that sampled them."""
        b, T = self._bufs, self.t
        if b is None or T == 0:
            return []
        done = b["terminated"][:T] | b["truncated"][:T]
        out = []
        for k in range(self.num_envs):
            start = 0
            for t in np.flatnonzero(done[:, k]):
                obs = np.concatenate([b["obs"][start:t + 1, k], self._final_obs[(t, k)][None]])
                out.append(self._chunk(k, start, t + 1, obs, weights_seq_no))
                self.completed.append(float(self.returns[k]))
                self.returns[k] = 0.0
                self.ids[k] = new_episode_id()
                start = t + 1
            if start < T:
                out.append(self._chunk(k, start, T, b["obs"][start:T + 1, k], weights_seq_no))
        return out

    def _chunk(self, k: int, start: int, end: int, obs: np.ndarray, weights_seq_no) -> dict:
        b = self._bufs
        rewards = np.array(b["rewards"][start:end, k], np.float32)
        self.returns[k] += float(rewards.sum(dtype=np.float64))
        d = {rllink.OBS: np.array(obs, np.float32), rllink.ACTIONS: np.array(b["actions"][start:end, k]),
             rllink.REWARDS: rewards,
             rllink.ACTION_DIST_INPUTS: np.array(b["action_dist_inputs"][start:end, k], np.float32),
             rllink.ACTION_LOGP: np.array(b["action_logp"][start:end, k], np.float32),
             rllink.TERMINATED: bool(b["terminated"][end - 1, k]),
             rllink.TRUNCATED: bool(b["truncated"][end - 1, k]),
             rllink.EPISODE_ID: self.ids[k]}
        if weights_seq_no is not None:
            d[rllink.WEIGHTS_SEQ_NO] = weights_seq_no
        return d
