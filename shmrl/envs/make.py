"""Environments by name: a built-in one (``CartPole-v1``, ``shmrl.envs.builtin``), any
gymnasium env (``gym:Acrobot-v1``), a PettingZoo env (``pz:NAME``), a user factory
(``package.module:make_env``) or, from Python, any callable that makes an env; their
specs, and K of them stepped as one.
"""
from __future__ import annotations

import functools
import importlib
import logging
from typing import Callable

import numpy as np

from shmrl.envs import pettingzoo_envs as pz_envs
from shmrl.config.settings import DECLARED_ENV
from shmrl.envs.builtin import ENVS, MIN_VECTORIZED_ENVS, VECTORIZED
from shmrl.envs.spec import EnvSpec, load_function, space_spec


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
    a MultiAgentSpec for a PettingZoo env (``shmrl.envs.pettingzoo_envs``)."""
    if isinstance(getattr(env, "spec", None), EnvSpec):
        return env.spec
    if pz_envs.is_multiagent(env):
        return pz_envs.multiagent_spec(env, env_id)
    if not (hasattr(env, "observation_space") and hasattr(env, "action_space")):
        raise ValueError(f"{env_id}: made {type(env).__name__!r}, not an env: it has no observation_space "
                         f"and action_space")
    threshold = getattr(getattr(env, "spec", None), "reward_threshold", None)
    limit = getattr(getattr(env, "spec", None), "max_episode_steps", None)   # gymnasium's TimeLimit
    return space_spec(env_id, env.observation_space, env.action_space, threshold,
                      limit if isinstance(limit, int) and limit > 0 else None)


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
    if env == DECLARED_ENV:
        raise ValueError(f"env {DECLARED_ENV!r} is the spaces an external client declares to a learner of --sims 0 "
                         "--tcp-port: there is no env to make from it here")
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


def make_vec_env(env, num_envs: int, seed: int | None = None):
    """``num_envs`` envs stepped together: numpy-vectorized where shmrl has that env and
    enough envs to make it pay, else a loop. Env k is seeded with ``seed + k``."""
    if isinstance(env, str) and env in VECTORIZED and num_envs >= MIN_VECTORIZED_ENVS:
        return VECTORIZED[env](num_envs, seed)
    factory, spec = resolve_env(env)
    if spec.multiagent:
        raise ValueError(f"{spec.env_id} is a multi-agent env, which a single-agent policy cannot play "
                         f"(train it with python -m shmrl.run --env {spec.env_id})")
    return LoopVecEnv(factory, num_envs, seed, spec)
