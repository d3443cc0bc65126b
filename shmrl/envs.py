"""Environments: built-in ones in pure Python/numpy (no gymnasium needed), any gymnasium
env (``gym:Acrobot-v1``), a user factory (``package.module:make_env``) or, from Python,
any callable that makes an env.

The interface is gymnasium's: ``reset(seed=None) -> (obs, info)`` and
``step(action) -> (obs, reward, terminated, truncated, info)``, with a
``TimeLimit``-style truncation built in; spaces are ``Discrete(n)`` or ``Box``.
"""
from __future__ import annotations

import functools
import importlib
import logging
import math
from typing import Callable

import numpy as np

from shmrl import pz_envs
from shmrl.envspec import EnvSpec, load_function, space_spec  # noqa: F401 (shmrl.envs.EnvSpec and space_spec as before)
from shmrl.spaces import Box, Discrete  # noqa: F401 (the built-in envs' spaces; shmrl.envs.Box as before)


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
    spec = EnvSpec("CartPole-v1", Box(tuple(-high), tuple(high), (4,)), Discrete(2), reward_threshold=475.0)

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
                   Box((-2.0,), (2.0,), (1,)), reward_threshold=None)

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

    spec = EnvSpec("CartPoleNoVel-v1", CartPole.spec.observation_space, Discrete(2), reward_threshold=475.0)
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

    spec = EnvSpec("PendulumNoVel-v1", Pendulum.spec.observation_space, Pendulum.spec.action_space)

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


class LoopVecEnv:
    """Any gymnasium-style single env as a vector of ``num_envs``, stepped in a Python loop,
    with the same interface (and same-step reset) as ``VecCartPole``. Observations come in
    the stored form of the space layer (an array, or a dict of arrays for a Dict or Tuple
    space); the arrays it returns are reused by the next step: copy what you keep."""

    def __init__(self, make, num_envs: int, seed: int | None = None, spec: EnvSpec | None = None):
        self.num_envs = num_envs
        self._envs = [make() for _ in range(num_envs)]
        self._seed = seed
        self.spec = spec if spec is not None else spec_of(self._envs[0], "env")
        self._layout, self._actions = self.spec.obs, self.spec.actions
        self._rewards = np.zeros(num_envs, np.float32)
        self._terminated = np.zeros(num_envs, bool)
        self._truncated = np.zeros(num_envs, bool)

    def reset(self) -> np.ndarray | dict:
        split = self._layout.split
        self._obs = self._layout.stack([split(env.reset(seed=None if self._seed is None else self._seed + k)[0])
                                        for k, env in enumerate(self._envs)])
        return self._obs

    def _put(self, target, k: int, o) -> None:
        if isinstance(target, dict):
            for name, value in self._layout.split(o).items():
                target[name][k] = value
        else:
            target[k] = o

    def step(self, actions):
        obs, final_obs = self._obs, None
        # Continuous actions are sampled unbounded (their log-probability is what the
        # learner needs); the env gets them clipped to its bounds.
        for k, a in enumerate(self._actions.to_env(actions)):
            env = self._envs[k]
            o, r, terminated, truncated, _ = env.step(a)
            if terminated or truncated:
                if final_obs is None:
                    final_obs = {n: v.copy() for n, v in obs.items()} if isinstance(obs, dict) else obs.copy()
                self._put(final_obs, k, o)
                o = env.reset()[0]
            self._put(obs, k, o)
            self._rewards[k], self._terminated[k], self._truncated[k] = r, terminated, truncated
        return obs, self._rewards, self._terminated, self._truncated, final_obs


ENVS = {"CartPole-v1": CartPole, "Pendulum-v1": Pendulum, "CartPoleNoVel-v1": CartPoleNoVel,
        "PendulumNoVel-v1": PendulumNoVel}
VECTORIZED = {"CartPole-v1": VecCartPole}
# numpy's per-call cost (1-3 us here, some 30 calls a step) pays only for enough envs:
# below this, a Python loop over single envs is faster.
MIN_VECTORIZED_ENVS = 32


def _gym_make(env_id: str):
    try:
        import gymnasium
    except ImportError:
        raise ValueError(f"--env gym:{env_id} needs gymnasium: pip install -e '.[gym]' in shmrl's clone") from None
    namespace = env_id.split("/", 1)[0] if "/" in env_id else env_id.split("-", 1)[0]
    package = GYM_PACKAGES.get(namespace)
    if package is not None:
        try:
            module = importlib.import_module(package[0])
        except ImportError:
            raise ValueError(f"--env gym:{env_id} needs {package[0]}: pip install '{package[1]}'") from None
        if package[0] == "minatar.gym" and env_id not in gymnasium.registry:
            module.register_envs()
        elif package[0] == "ale_py":
            gymnasium.register_envs(module)
    try:
        if "mujoco" in str(getattr(gymnasium.spec(env_id), "entry_point", "")):
            _log_mujoco_warnings()
        if namespace == "ALE":
            return _atari(gymnasium, env_id)
        return gymnasium.make(env_id)
    except gymnasium.error.Error as e:  # an unknown id or version, a missing dependency
        raise ValueError(f"--env gym:{env_id}: {e}") from None


# Packages that register a gymnasium namespace when imported: (module, what to install).
GYM_PACKAGES = {"ALE": ("ale_py", "shmrl[atari]"), "MiniGrid": ("minigrid", "shmrl[minigrid]"),
                "BabyAI": ("minigrid", "shmrl[minigrid]"), "MinAtar": ("minatar.gym", "shmrl[minatar]")}


def _atari(gymnasium, env_id: str):
    """An ALE game with the usual preprocessing, by gymnasium's own wrappers: 4 frames
    skipped (max-pooled), up to 30 no-ops at reset, 84x84 grey frames, the last 4 stacked
    (an observation of shape (4, 84, 84), uint8); rewards and episodes as the game has them."""
    from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

    env = gymnasium.make(env_id, frameskip=1, repeat_action_probability=0.0)
    return FrameStackObservation(AtariPreprocessing(env, frame_skip=4, screen_size=84, grayscale_obs=True,
                                                    noop_max=30), 4)


def _log_mujoco_warnings() -> None:
    """MuJoCo's warnings go to the log, once each, instead of into a MUJOCO_LOG.TXT it
    would write in the working directory (mujoco 4 warns of every gymnasium model's
    deprecated 'settotalmass')."""
    try:
        import mujoco
    except ImportError:
        return  # gymnasium.make says what is missing
    seen = set()

    def warn(message: str) -> None:
        if message not in seen:
            seen.add(message)
            logging.getLogger("shmrl.envs").debug("MuJoCo: %s", message)

    mujoco.set_mju_user_warning(warn)


def spec_of(env, env_id: str):
    """The spec of a live env object: its spaces, and gymnasium's reward threshold if any;
    a MultiAgentSpec for a PettingZoo env (``shmrl.pz_envs``)."""
    if isinstance(getattr(env, "spec", None), EnvSpec):
        return env.spec
    if pz_envs.is_multiagent(env):
        return pz_envs.multiagent_spec(env, env_id)
    if not (hasattr(env, "observation_space") and hasattr(env, "action_space")):
        raise ValueError(f"{env_id}: made {type(env).__name__!r}, not an env: it has no observation_space "
                         f"and action_space")
    threshold = getattr(getattr(env, "spec", None), "reward_threshold", None)
    return space_spec(env_id, env.observation_space, env.action_space, threshold)


def _call_factory(factory, env_id: str):
    """``factory()``; an exception in the user's code becomes a clear error at start."""
    try:
        return factory()
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(f"{env_id}: making the env failed: {type(e).__name__}: {e}") from None


def resolve_env(env) -> tuple[Callable[[], object], EnvSpec]:
    """(factory, spec) for ``env``: a built-in id, ``gym:ID``, ``package.module:callable``
    or a callable. The factory pickles (with dill, as ``multiprocess`` does), so simulator
    processes can make their own envs."""
    if callable(env):
        made = _call_factory(env, getattr(env, "__name__", "custom"))
        try:
            return env, spec_of(made, getattr(env, "__name__", "custom"))
        finally:
            getattr(made, "close", lambda: None)()
    if not isinstance(env, str):
        raise ValueError(f"env must be an id string or a callable that makes an env, got {env!r}")
    if env in ENVS:
        return ENVS[env], ENVS[env].spec
    if env.startswith("gym:"):
        factory = functools.partial(_gym_make, env[4:])
    elif env.startswith("pz:"):
        factory = functools.partial(pz_envs.pz_make, env[3:])
    elif ":" in env:
        factory = load_function("--env", env, "that makes an env")
    else:
        raise ValueError(f"unknown environment {env!r}; built in: {', '.join(sorted(ENVS))}; or gym:ID "
                         f"(gymnasium), or package.module:make_env (a function that makes one)")
    made = _call_factory(factory, env)
    try:
        return factory, spec_of(made, env)
    finally:
        getattr(made, "close", lambda: None)()


def env_spec(env) -> EnvSpec:
    return resolve_env(env)[1]


def make_env(env, seed: int | None = None):
    """One env; ``seed`` seeds its first reset."""
    if isinstance(env, str) and env in ENVS:
        return ENVS[env](seed=seed)
    made = resolve_env(env)[0]()
    if seed is not None:
        made.reset(seed=seed)
    return made


def make_vec_env(env, num_envs: int, seed: int | None = None):
    """``num_envs`` envs stepped together: numpy-vectorized where shmrl has that env and
    enough envs to make it pay, else a loop. Env k is seeded with ``seed + k``."""
    if isinstance(env, str) and env in VECTORIZED and num_envs >= MIN_VECTORIZED_ENVS:
        return VECTORIZED[env](num_envs, seed)
    factory, spec = resolve_env(env)
    if getattr(spec, "multiagent", False):
        raise ValueError(f"{spec.env_id} is a multi-agent env, which a single-agent policy cannot play "
                         f"(train it with python -m shmrl.run --env {spec.env_id})")
    return LoopVecEnv(factory, num_envs, seed, spec)
