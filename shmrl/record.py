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

A dataset folder has one writer at a time: ``--out`` on the folder of a live recording
(or of a run's ``--record``) is refused, naming its pid. With ``--tcp-port 0`` it listens
on a free port and says which.

Exit status: 0 when done, 2 for a bad command line or a dataset that does not fit, is
another's, or whose manifest is damaged or values poisoned (one line ``error: ...``), 3
when a part fails (a shard it cannot write, a simulator that keeps dying).
"""
from __future__ import annotations

import logging
import os
import signal
import sys

from shmrl.config.flags import face_parser, parse_settings
from shmrl.config.settings import EXIT_FAILED, EXIT_USAGE, Config, ConfigError, resolve_config
from shmrl.files.dataset import DatasetError, ValueBounds


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


# ------------------------------------------------------------------ the command line

def _export_main(argv) -> int:
    from shmrl.config.faces import RecordExportSettings
    from shmrl.files.minari import export_minari

    p = face_parser(RecordExportSettings, "python -m shmrl.record export", "write a recording as a Minari dataset")
    a = parse_settings(p, RecordExportSettings, argv)
    if a.minari_root:
        os.environ["MINARI_DATASETS_PATH"] = a.minari_root
    defaults = Config()
    try:   # poisoned values are what the learner would refuse from a client by default
        exported = export_minari(a.dataset, a.minari_id, ValueBounds(defaults.max_obs_abs, defaults.max_reward_abs),
                                 author=a.author, author_email=a.author_email, code_permalink=a.code_permalink)
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
    from shmrl.config.faces import RecordSettings

    p = face_parser(RecordSettings, "python -m shmrl.record", __doc__)
    a = parse_settings(p, RecordSettings, argv)
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
