"""The built-in envs, in pure Python and numpy (no gymnasium needed): CartPole-v1 and
Pendulum-v1 with gymnasium's dynamics, their NoVel variants for recurrent policies, a
vectorized CartPole.

The interface is gymnasium's: ``reset(seed=None) -> (obs, info)`` and
``step(action) -> (obs, reward, terminated, truncated, info)``, with a
``TimeLimit``-style truncation built in.
"""
from __future__ import annotations

import math

import numpy as np

from shmrl.core.spaces import Box, Discrete
from shmrl.envs.spec import EnvSpec


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
    spec = EnvSpec("CartPole-v1", Box(tuple(-high), tuple(high), (4,)), Discrete(2), reward_threshold=475.0,
                   max_episode_steps=max_episode_steps)

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

    @classmethod
    def accelerations(cls, force, theta_dot, costheta, sintheta):
        """(the cart's, the pole's) under ``force``: gymnasium's equations, for floats (one
        env) or arrays (``VecCartPole``) alike."""
        temp = (force + cls.polemass_length * theta_dot * theta_dot * sintheta) / cls.total_mass
        thetaacc = (cls.gravity * sintheta - costheta * temp) / (
            cls.length * (4.0 / 3.0 - cls.masspole * costheta * costheta / cls.total_mass))
        return temp - cls.polemass_length * thetaacc * costheta / cls.total_mass, thetaacc

    def step(self, action):
        x, x_dot, theta, theta_dot = self._state
        force = self.force_mag if action == 1 else -self.force_mag
        xacc, thetaacc = self.accelerations(force, theta_dot, math.cos(theta), math.sin(theta))
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


class Pendulum:
    """Pendulum-v1 with gymnasium's dynamics, costs and 200-step truncation: swing up and
    hold; observation (cos, sin, angular velocity), action a torque in [-2, 2]."""

    max_speed, max_torque, dt, g, m, length = 8.0, 2.0, 0.05, 10.0, 1.0, 1.0
    max_episode_steps = 200
    spec = EnvSpec("Pendulum-v1", Box((-1.0, -1.0, -8.0), (1.0, 1.0, 8.0), (3,)),
                   Box((-2.0,), (2.0,), (1,)), reward_threshold=None, max_episode_steps=max_episode_steps)

    def __init__(self, seed: int | None = None):
        self._rng = np.random.default_rng(seed)
        self._state = (0.0, 0.0)
        self._steps = 0

    def _obs(self) -> np.ndarray:
        th, thdot = self._state
        return np.array([math.cos(th), math.sin(th), thdot], dtype=np.float32)

    def reset(self, seed: int | None = None):
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self._state = tuple(float(v) for v in self._rng.uniform([-math.pi, -1.0], [math.pi, 1.0]))
        self._steps = 0
        return self._obs(), {}

    def step(self, action):
        th, thdot = self._state
        u = min(max(float(np.asarray(action, dtype=np.float64).reshape(-1)[0]), -self.max_torque), self.max_torque)
        costs = (((th + math.pi) % (2 * math.pi)) - math.pi) ** 2 + 0.1 * thdot ** 2 + 0.001 * u ** 2
        thdot = thdot + (3 * self.g / (2 * self.length) * math.sin(th) + 3.0 / (self.m * self.length ** 2) * u) * self.dt
        thdot = min(max(thdot, -self.max_speed), self.max_speed)
        self._state = (th + thdot * self.dt, thdot)
        self._steps += 1
        return self._obs(), -costs, False, self._steps >= self.max_episode_steps, {}


class CartPoleNoVel(CartPole):
    """CartPole-v1 with the cart's and the pole's velocities hidden (observed as 0), as
    rl-zoo3's CartPoleNoVel-v1 (its MaskVelocityWrapper): only a policy with memory can
    tell which way the pole moves."""

    spec = EnvSpec("CartPoleNoVel-v1", CartPole.spec.observation_space, Discrete(2), reward_threshold=475.0,
                   max_episode_steps=CartPole.max_episode_steps)
    VISIBLE = np.array([1, 0, 1, 0], np.float32)

    def reset(self, seed: int | None = None):
        obs, info = super().reset(seed)
        return obs * self.VISIBLE, info

    def step(self, action):
        obs, reward, terminated, truncated, info = super().step(action)
        return obs * self.VISIBLE, reward, terminated, truncated, info


class PendulumNoVel(Pendulum):
    """Pendulum-v1 with the angular velocity hidden (observed as 0), as rl-zoo3's
    PendulumNoVel-v1."""

    spec = EnvSpec("PendulumNoVel-v1", Pendulum.spec.observation_space, Pendulum.spec.action_space,
                   max_episode_steps=Pendulum.max_episode_steps)

    def _obs(self) -> np.ndarray:
        obs = super()._obs()
        obs[2] = 0.0
        return obs


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
        xacc, thetaacc = c.accelerations(force, theta_dot, np.cos(theta), np.sin(theta))
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


ENVS = {"CartPole-v1": CartPole, "Pendulum-v1": Pendulum, "CartPoleNoVel-v1": CartPoleNoVel,
        "PendulumNoVel-v1": PendulumNoVel}
VECTORIZED = {"CartPole-v1": VecCartPole}
# numpy's per-call cost (1-3 us here, some 30 calls a step) pays only for enough envs:
# below this, a Python loop over single envs is faster.
MIN_VECTORIZED_ENVS = 32
