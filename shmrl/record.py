"""Record what clients send without training, and export a recording to Minari.

    python -m shmrl.record --tcp-port 9900 --out demos              # clients that play by themselves
    python -m shmrl.record --tcp-port 9900 --out demos --policy runs/a/policy.onnx
    python -m shmrl.record --sims 4 --env gym:HalfCheetah-v5 --policy runs/a/policy.onnx --episodes 50 --out hc
    python -m shmrl.record export demos --minari-id cartpole-demos-v0

The first form serves RLlink clients over TCP (any number, from any engine) and writes
every episode they send to the dataset folder ``--out`` (docs/RECORDING.md), appending
if it exists. Clients are served ``--policy`` (an ONNX file, e.g. a run's policy.onnx),
or without one a fresh policy of the house network, which a client that plays by itself
(a human at the keyboard, a scripted bot) ignores: it only reports its episodes. The
weights never change. ``--sims N`` also starts N local simulators of ``--env`` playing the
policy. It runs until Ctrl-C or SIGTERM, then writes the episodes still open (marked
``stopped``) and exits 0; or until ``--episodes N`` episodes ended, and then writes those
N whole episodes and nothing else.

``export`` writes a recording as a Minari dataset (pip install 'shmrl[minari]'), which
``minari.load_dataset(NAME)`` then loads, with the env's spaces; actions are written as
the env took them (a Discrete's start added, a Box clipped to its bounds), and
observations without the leaves shmrl leaves out (a Text). Minari holds one agent's
episodes: a multi-agent recording stays in shmrl's format.

Exit status: 0 when done, 2 for a bad command line or a dataset that does not fit (one
line ``error: ...``), 3 when a part fails.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

import numpy as np

from shmrl.config.settings import EXIT_FAILED, EXIT_USAGE, Config, ConfigError, OneLineErrorParser, resolve_config
from shmrl.files.dataset import Dataset, DatasetError


def serve(config: Config, policy: bytes | None, episodes: int | None, say_every: float = 10.0) -> int:
    """Serve ``config``'s clients (TCP, local simulators) one fixed policy and record every
    episode to ``config.record`` until Ctrl-C, SIGTERM or ``episodes`` episodes
    (``shmrl.trainer.recording``); returns the exit status."""
    from shmrl.client.actor import check_policy_fits
    from shmrl.onnxio.policy import OnnxPolicy
    from shmrl.trainer.lifecycle import RunFailed, open_run
    from shmrl.trainer.recording import Recording
    from shmrl.trainer.setup import set_up

    setup = set_up(config)
    if policy is not None:
        if setup.multiagent:
            raise ConfigError("--policy: a multi-agent recording serves the house network's policies")
        try:
            check_policy_fits(OnnxPolicy(policy), setup.spec)
        except Exception as e:   # not an ONNX model, or one of another env
            raise ConfigError(f"--policy: {str(e).strip()[:300]}") from None
    try:
        servers, supervisor = open_run(setup)
    except RunFailed as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    status, _ = Recording(setup, servers, supervisor, policy, episodes, say_every).run()
    return status


# ------------------------------------------------------------------ Minari

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


def export_minari(path, dataset_id: str, description: str | None = None):
    """Write the recording at ``path`` as the Minari dataset ``dataset_id``; returns it."""
    try:
        import minari
        from minari.data_collector.episode_buffer import EpisodeBuffer
    except ImportError as e:
        raise DatasetError(f"export needs Minari: pip install 'shmrl[minari]' ({e})") from None
    dataset = Dataset(path)
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
    return minari.create_dataset_from_buffers(
        dataset_id, buffers, env=env, observation_space=observation_space, action_space=action_space,
        algorithm_name="shmrl", description=description or f"recorded by shmrl from {dataset.env}",
        jpeg_encoding=False)


# ------------------------------------------------------------------ the command line

def _export_main(argv) -> int:
    p = OneLineErrorParser(prog="python -m shmrl.record export",
                           description="write a recording as a Minari dataset")
    p.add_argument("dataset", help="a dataset folder (--record, python -m shmrl.record --out)")
    p.add_argument("--minari-id", required=True, metavar="NAME", help="the Minari dataset id, e.g. shmrl/cartpole-v0")
    p.add_argument("--minari-root", metavar="DIR", help="where Minari keeps its datasets (default: its own, "
                   "$MINARI_DATASETS_PATH or ~/.minari/datasets)")
    a = p.parse_args(argv)
    if a.minari_root:
        os.environ["MINARI_DATASETS_PATH"] = a.minari_root
    try:
        exported = export_minari(a.dataset, a.minari_id)
    except (DatasetError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(f"exported {exported.total_episodes} episodes ({exported.total_steps} steps) of {a.dataset} as Minari "
          f"dataset {a.minari_id}", flush=True)
    return 0


def _terminate(signum, frame):
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    if argv[:1] == ["export"]:
        return _export_main(argv[1:])
    p = OneLineErrorParser(prog="python -m shmrl.record", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, metavar="DIR", help="the dataset folder to write (appended to if it exists)")
    p.add_argument("--env", default="CartPole-v1", help="the clients' environment, as for shmrl.run (default: %(default)s)")
    p.add_argument("--policy", metavar="FILE", help="the ONNX policy clients are served (a run's policy.onnx)")
    p.add_argument("--tcp-port", type=int, metavar="PORT", help="serve RLlink clients over TCP on PORT")
    p.add_argument("--tcp-host", default="127.0.0.1", metavar="HOST", help="address to listen on (default: %(default)s)")
    p.add_argument("--auth-token", default=os.environ.get("SHMRL_AUTH_TOKEN"), metavar="SECRET",
                   help="clients must send it in their PING (default: $SHMRL_AUTH_TOKEN)")
    p.add_argument("--sims", type=int, default=0, help="also start N local simulators (default: %(default)s)")
    p.add_argument("--envs-per-sim", type=int, default=None, metavar="K", help="envs per simulator (default: the env's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the simulators (default: %(default)s)")
    p.add_argument("--episodes", type=int, metavar="N", help="stop after N complete episodes (default: Ctrl-C)")
    a = p.parse_args(argv)
    if a.tcp_port is None and not a.sims:
        p.error("give --tcp-port for clients, or --sims N for local simulators")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from shmrl.envs.make import env_spec

        spec = env_spec(a.env)
        # Clients keep sampling with the one policy: no batch ever waits for an update.
        config = resolve_config(Config(env=a.env, sims=a.sims, tcp_port=a.tcp_port, tcp_host=a.tcp_host,
                                       auth_token=a.auth_token, seed=a.seed, record=a.out, async_sampling=True,
                                       max_policy_lag=2 ** 62, envs_per_sim=a.envs_per_sim, tensorboard=False), spec)
        policy = open(a.policy, "rb").read() if a.policy else None
        signal.signal(signal.SIGTERM, _terminate)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        return serve(config, policy, a.episodes)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except OSError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except KeyboardInterrupt:   # before anything was served
        return 0


if __name__ == "__main__":
    sys.exit(main())
