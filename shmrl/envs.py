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


ENVS = {"CartPole-v1": CartPole}


def env_spec(env_id: str) -> EnvSpec:
    return _env_class(env_id).spec


def make_env(env_id: str, seed: int | None = None):
    return _env_class(env_id)(seed=seed)


def _env_class(env_id: str):
    try:
        return ENVS[env_id]
    except KeyError:
        raise ValueError(f"unknown environment {env_id!r}; built in: {', '.join(sorted(ENVS))}") from None
