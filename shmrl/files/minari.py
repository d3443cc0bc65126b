"""A recording (``shmrl.files.dataset``) written as a Minari dataset, which
``minari.load_dataset(NAME)`` then loads with the env's spaces: actions as the env took
them (a Discrete's start added, a Box clipped to its bounds), observations without the
leaves shmrl leaves out (a Text). Minari holds one agent's episodes: a multi-agent
recording stays in shmrl's format. Poisoned values (not finite, or beyond the bounds the
learner takes from a client) are refused, never passed on to Minari. Needs gymnasium and
Minari (pip install 'shmrl[minari]').
"""
from __future__ import annotations

import numpy as np

from shmrl.files.dataset import Dataset, DatasetError, ValueBounds


def to_gym(space):
    """A gymnasium space for a ``shmrl.core.spaces`` space, without the leaves shmrl leaves out."""
    import gymnasium as gym

    from shmrl.core import spaces

    if isinstance(space, spaces.Box):
        low = np.broadcast_to(np.asarray(space.low, np.float64), space.shape) if len(space.low) == 1 \
            else np.asarray(space.low).reshape(space.shape)
        high = np.broadcast_to(np.asarray(space.high, np.float64), space.shape) if len(space.high) == 1 \
            else np.asarray(space.high).reshape(space.shape)
        return gym.spaces.Box(low.astype(space.dtype), high.astype(space.dtype), space.shape, np.dtype(space.dtype))
    if isinstance(space, spaces.Discrete):
        return gym.spaces.Discrete(space.n, start=space.start)
    if isinstance(space, spaces.MultiDiscrete):
        return gym.spaces.MultiDiscrete(list(space.nvec), start=list(space.start) if space.start else None)
    if isinstance(space, spaces.MultiBinary):
        return gym.spaces.MultiBinary(space.n)
    if isinstance(space, spaces.Dict):
        return gym.spaces.Dict({k: to_gym(s) for k, s in space.spaces if not isinstance(s, spaces.Unsupported)})
    if isinstance(space, spaces.Tuple):
        return gym.spaces.Tuple([to_gym(s) for s in space.spaces if not isinstance(s, spaces.Unsupported)])
    raise DatasetError(f"Minari cannot hold a {space!r} space")


def gym_obs(space, leaves, path: str = ""):
    """Observations in ``space``'s structure from shmrl's leaves (an array, or by leaf name)."""
    from shmrl.core import spaces

    if isinstance(space, spaces.Dict):
        return {k: gym_obs(s, leaves, f"{path}.{k}" if path else k) for k, s in space.spaces
                if not isinstance(s, spaces.Unsupported)}
    if isinstance(space, spaces.Tuple):
        return tuple(gym_obs(s, leaves, f"{path}.{i}" if path else str(i)) for i, s in enumerate(space.spaces)
                     if not isinstance(s, spaces.Unsupported))
    return leaves if not isinstance(leaves, dict) else leaves[path]


def gym_actions(space, actions: np.ndarray):
    """Actions as the env took them (one row per step), in ``space``'s structure."""
    from shmrl.core import spaces

    layout = spaces.action_layout(space)
    if layout.single_discrete:
        return actions.astype(np.int64) + layout.parts[0].start
    columns = iter(actions.reshape(len(actions), -1).T)

    def build(s):
        if isinstance(s, spaces.Discrete):
            return next(columns).astype(np.int64) + s.start
        if isinstance(s, spaces.Box):
            part = spaces.action_layout(s).parts[0]
            values = np.stack([next(columns) for _ in range(part.size)], -1).astype(np.float32)
            return np.clip(values, part.low, part.high).reshape(len(actions), *s.shape).astype(s.dtype)
        if isinstance(s, spaces.MultiDiscrete):
            starts = s.start or (0,) * len(s.nvec)
            return np.stack([next(columns).astype(np.int64) + st for st in starts], -1)
        if isinstance(s, spaces.MultiBinary):
            return np.stack([next(columns) for _ in range(s.n)], -1).astype(np.int8)
        if isinstance(s, spaces.Tuple):
            return tuple(build(sub) for sub in s.spaces)
        return {k: build(sub) for k, sub in s.spaces}

    return build(space)


def gym_env_spaces(env_id: str, obs_space, action_space) -> tuple:
    """(the gymnasium id of the env, or None; the observation and action spaces to export):
    the gymnasium env's own spaces where they hold the same values as the recorded ones
    (shmrl's built-in CartPole bounds its velocities where gymnasium's has infinity) and
    nothing was left out, else the recorded ones."""
    import gymnasium as gym

    from shmrl.core import spaces

    try:
        env = gym.spec(env_id.removeprefix("gym:")).id
        made = gym.make(env)
    except Exception:   # shmrl's own env functions, PettingZoo: no gymnasium id to recover it by
        return None, to_gym(obs_space), to_gym(action_space)
    theirs = spaces.obs_layout(made.observation_space)
    ours = spaces.obs_layout(obs_space)
    if (theirs.leaves, ours.skipped, spaces.action_layout(made.action_space).parts) == \
            (ours.leaves, (), spaces.action_layout(action_space).parts):
        return env, made.observation_space, made.action_space
    return env, to_gym(obs_space), to_gym(action_space)


# Minari warns (UserWarning) about every piece of metadata left None: the author, their
# email and a code permalink, which are the user's to give (export's --author, ...) and not
# shmrl's to make up; eval_env, which is the recording's env unless said otherwise; and the
# env spec of an env gymnasium cannot make (shmrl's own env functions). None of them is
# anything the user did: those warnings alone are silenced, any other of Minari's is shown.
QUIET_MINARI_WARNINGS = r"`(code_permalink|author|author_email|eval_env)` is set to None|env_spec is None"


def export_minari(path, dataset_id: str, bounds: ValueBounds, description: str | None = None, *,
                  author: str | None = None, author_email: str | None = None, code_permalink: str | None = None):
    """Write the recording at ``path`` as the Minari dataset ``dataset_id``; returns it. A
    damaged shard is passed over (with a warning); a poisoned one (a value not finite or
    beyond ``bounds``) refuses the export, as a damaged manifest does (DatasetError).
    ``author``, ``author_email``, ``code_permalink``: the dataset's metadata, where given."""
    import warnings

    try:
        import minari
        from minari.data_collector.episode_buffer import EpisodeBuffer
    except ImportError as e:
        raise DatasetError(f"export needs Minari: pip install 'shmrl[minari]' ({e})") from None
    dataset = Dataset(path, bounds)
    if dataset.manifest.get("agents") or len(dataset.policy_spaces) != 1:
        raise DatasetError(f"{path}: a multi-agent recording ({len(dataset.policy_spaces)} policies); Minari holds "
                           "one agent's episodes, so it stays in shmrl's format (docs/RECORDING.md)")
    (pid, (obs_space, action_space)), = dataset.policy_spaces.items()
    buffers = []
    for i, ep in enumerate(dataset.episodes(pid)):
        n = len(ep)
        flags = np.zeros((2, n), bool)
        if n:
            flags[:, -1] = ep.terminated, ep.truncated
        buffers.append(EpisodeBuffer(id=i, observations=gym_obs(obs_space, ep.obs),
                                     actions=gym_actions(action_space, ep.actions), rewards=ep.rewards.tolist(),
                                     terminations=flags[0].tolist(), truncations=flags[1].tolist(), infos={}))
    if not buffers:
        raise DatasetError(f"{path}: no episodes to export")
    env, observation_space, action_space = gym_env_spaces(dataset.env, obs_space, action_space)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", QUIET_MINARI_WARNINGS, UserWarning)
        return minari.create_dataset_from_buffers(
            dataset_id, buffers, env=env, eval_env=env, observation_space=observation_space,
            action_space=action_space, algorithm_name="shmrl",
            description=description or f"recorded by shmrl from {dataset.env}", jpeg_encoding=False,
            author=author, author_email=author_email, code_permalink=code_permalink)
