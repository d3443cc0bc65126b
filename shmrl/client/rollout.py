"""The rollout of K vectorized envs: ``Rollout`` keeps their steps in preallocated arrays
and cuts them into RLlink chunks (an ``EpisodeBatch``) with a few array operations, for
the simulator loop (``shmrl.client.simulator``) to send.
"""
from __future__ import annotations

import numpy as np

from shmrl.core.episode import (ACTION_DIST_INPUTS, ACTION_LOGP, ACTIONS, REWARDS, TERMINATED, TRUNCATED, EpisodeBatch,
                           new_episode_id, obs_map)


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

    def resize(self, steps: int) -> None:
        """Make the next rollouts ``steps`` long (the server shares its batch anew, RLLINK.md
        §3.3): call between rollouts (after ``batch``, or after ``start`` before the first
        ``record``). Episode ids and running returns carry on."""
        if steps != self.steps:
            self.steps, self._bufs = steps, None   # the arrays are made anew at the next record

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
