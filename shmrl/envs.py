"""Built-in environments and their spaces, in pure Python/numpy (no gymnasium needed).

The interface is gymnasium's: ``reset(seed=None) -> (obs, info)`` and
``step(action) -> (obs, reward, terminated, truncated, info)``, with a
``TimeLimit``-style truncation built in.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Discrete:
    n: int


@dataclass(frozen=True)
class Box:
    low: tuple
    high: tuple
    shape: tuple


@dataclass(frozen=True)
class EnvSpec:
    """What the learner needs to know about an environment to check clients' data."""
    env_id: str
    observation_space: Box
    action_space: Discrete | Box

    @property
    def obs_shape(self) -> tuple:
        return self.observation_space.shape


class CartPole:
    """CartPole-v1 with gymnasium's dynamics (Euler), thresholds and 500-step truncation."""

    gravity = 9.8
    masscart = 1.0
    masspole = 0.1
    total_mass = masspole + masscart
    length = 0.5  # half the pole's length
    polemass_length = masspole * length
    force_mag = 10.0
    tau = 0.02
    theta_threshold = 12 * 2 * math.pi / 360
    x_threshold = 2.4
    max_episode_steps = 500

    high = np.array([x_threshold * 2, np.finfo(np.float32).max, theta_threshold * 2,
                     np.finfo(np.float32).max], dtype=np.float32)
    spec = EnvSpec("CartPole-v1", Box(tuple(-high), tuple(high), (4,)), Discrete(2))

    def __init__(self, seed: int | None = None):
        self._rng = np.random.default_rng(seed)
        self._state = (0.0, 0.0, 0.0, 0.0)
        self._steps = 0

    def reset(self, seed: int | None = None):
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self._state = tuple(float(v) for v in self._rng.uniform(-0.05, 0.05, size=4))
        self._steps = 0
        return np.array(self._state, dtype=np.float32), {}

    def step(self, action):
        x, x_dot, theta, theta_dot = self._state
        force = self.force_mag if action == 1 else -self.force_mag
        costheta = math.cos(theta)
        sintheta = math.sin(theta)
        temp = (force + self.polemass_length * theta_dot * theta_dot * sintheta) / self.total_mass
        thetaacc = (self.gravity * sintheta - costheta * temp) / (
            self.length * (4.0 / 3.0 - self.masspole * costheta * costheta / self.total_mass))
        xacc = temp - self.polemass_length * thetaacc * costheta / self.total_mass
        x = x + self.tau * x_dot
        x_dot = x_dot + self.tau * xacc
        theta = theta + self.tau * theta_dot
        theta_dot = theta_dot + self.tau * thetaacc
        self._state = (x, x_dot, theta, theta_dot)
        self._steps += 1
        terminated = (x < -self.x_threshold or x > self.x_threshold
                      or theta < -self.theta_threshold or theta > self.theta_threshold)
        truncated = self._steps >= self.max_episode_steps
        return np.array(self._state, dtype=np.float32), 1.0, terminated, truncated, {}


class VecCartPole:
    """``num_envs`` CartPoles stepped together in numpy: the same dynamics, thresholds and
    truncation as ``CartPole`` (float64 state, float32 observations), each env seeded
    and reset exactly as a ``CartPole(seed)`` of its own would be."""

    spec = CartPole.spec

    def __init__(self, num_envs: int, seed: int | None = None):
        self.num_envs = num_envs
        self._envs = [CartPole(None if seed is None else seed + k) for k in range(num_envs)]  # rngs, resets
        self._state = np.zeros((4, num_envs))
        self._steps = np.zeros(num_envs, np.int64)

    def reset(self) -> np.ndarray:
        for k in range(self.num_envs):
            self._reset_one(k)
        return self._state.T.astype(np.float32)

    def _reset_one(self, k: int) -> None:
        self._envs[k].reset()
        self._state[:, k] = self._envs[k]._state  # the float64 state, not the float32 obs
        self._steps[k] = 0

    def step(self, actions: np.ndarray):
        """(obs, rewards, terminated, truncated, final_obs): an env that ended is reset at
        once; its last observation is in ``final_obs`` (None when no env ended)."""
        c = CartPole
        x, x_dot, theta, theta_dot = self._state
        force = np.where(np.asarray(actions) == 1, c.force_mag, -c.force_mag)
        costheta, sintheta = np.cos(theta), np.sin(theta)
        temp = (force + c.polemass_length * theta_dot * theta_dot * sintheta) / c.total_mass
        thetaacc = (c.gravity * sintheta - costheta * temp) / (
            c.length * (4.0 / 3.0 - c.masspole * costheta * costheta / c.total_mass))
        xacc = temp - c.polemass_length * thetaacc * costheta / c.total_mass
        self._state = np.stack([x + c.tau * x_dot, x_dot + c.tau * xacc,
                                theta + c.tau * theta_dot, theta_dot + c.tau * thetaacc])
        self._steps += 1
        x, theta = self._state[0], self._state[2]
        terminated = (np.abs(x) > c.x_threshold) | (np.abs(theta) > c.theta_threshold)
        truncated = self._steps >= c.max_episode_steps
        obs = self._state.T.astype(np.float32)
        final_obs = None
        done = np.flatnonzero(terminated | truncated)
        if len(done):
            final_obs = obs.copy()
            for k in done:
                self._reset_one(k)
            obs[done] = self._state[:, done].T
        return obs, np.ones(self.num_envs, np.float32), terminated, truncated, final_obs


class LoopVecEnv:
    """Any gymnasium-style single env as a vector of ``num_envs``, stepped in a Python loop,
    with the same interface (and same-step reset) as ``VecCartPole``. The arrays it returns
    are reused by the next step: copy what you keep."""

    def __init__(self, make, num_envs: int, seed: int | None = None):
        self.num_envs = num_envs
        self._envs = [make() for _ in range(num_envs)]
        self._seed = seed
        self.spec = getattr(self._envs[0], "spec", None)
        self._rewards = np.zeros(num_envs, np.float32)
        self._terminated = np.zeros(num_envs, bool)
        self._truncated = np.zeros(num_envs, bool)

    def reset(self) -> np.ndarray:
        self._obs = np.stack([np.asarray(env.reset(seed=None if self._seed is None else self._seed + k)[0],
                                         np.float32) for k, env in enumerate(self._envs)])
        return self._obs

    def step(self, actions):
        obs, final_obs = self._obs, None
        for k, a in enumerate(actions.tolist() if isinstance(actions, np.ndarray) else actions):
            env = self._envs[k]
            o, r, terminated, truncated, _ = env.step(a)
            if terminated or truncated:
                if final_obs is None:
                    final_obs = obs.copy()
                final_obs[k] = o
                o = env.reset()[0]
            obs[k], self._rewards[k], self._terminated[k], self._truncated[k] = o, r, terminated, truncated
        return obs, self._rewards, self._terminated, self._truncated, final_obs


ENVS = {"CartPole-v1": CartPole}
VECTORIZED = {"CartPole-v1": VecCartPole}
# numpy's per-call cost (1-3 us here, some 30 calls a step) pays only for enough envs:
# below this, a Python loop over single envs is faster.
MIN_VECTORIZED_ENVS = 32


def env_spec(env_id: str) -> EnvSpec:
    return _env_class(env_id).spec


def make_env(env_id: str, seed: int | None = None):
    return _env_class(env_id)(seed=seed)


def make_vec_env(env_id: str, num_envs: int, seed: int | None = None):
    """``num_envs`` envs stepped together: numpy-vectorized where shmrl has that env and
    enough envs to make it pay, else a loop. Env k is seeded with ``seed + k``."""
    if env_id in VECTORIZED and num_envs >= MIN_VECTORIZED_ENVS:
        return VECTORIZED[env_id](num_envs, seed)
    cls = _env_class(env_id)
    return LoopVecEnv(lambda: cls(), num_envs, seed)


def _env_class(env_id: str):
    try:
        return ENVS[env_id]
    except KeyError:
        raise ValueError(f"unknown environment {env_id!r}; built in: {', '.join(sorted(ENVS))}") from None
