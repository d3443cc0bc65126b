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
