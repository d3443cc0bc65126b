"""Train a policy with PPO from simulator processes that talk RLlink through shared memory.

    python -m shmrl.run --sims 8                  # CartPole-v1 until the 100-episode mean is >= 475
    python -m shmrl.run --sims 8 --logdir runs/a  # metrics.jsonl, summary.json, policy.onnx, checkpoints
    python -m shmrl.run --resume runs/a           # go on from the last checkpoint in runs/a
    python -m shmrl.run --ray auto --sims 24      # the simulators as Ray actors across a cluster

Simulators that die or hang are restarted (and the env steps they lose are counted); a
simulator that keeps failing fails the run. Ctrl-C and SIGTERM stop everything within
seconds and write a checkpoint first.

Exit status: 0 when the stop return is reached, 1 when the env-step budget runs out
first, 2 when the command line asks for what cannot be done (a bad flag value, an unknown
env, a port in use, a log folder that cannot be made, a checkpoint that is damaged or
does not fit; one line ``error: ...``, nothing started or written), 3 when a part of the
run fails (a simulator that keeps dying, a transport that breaks, too little shared
memory), 130 after Ctrl-C, 143 after SIGTERM.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from shmrl.config import (EXIT_BUDGET, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_SOLVED, EXIT_USAGE,  # noqa: F401
                          ConfigError, OneLineErrorParser)

log = logging.getLogger("shmrl.run")


@dataclass
class RunConfig:
    """Everything a run takes, one field per command-line flag (``python -m shmrl.run
    --help``). Fields left None take the environment's defaults: see ``resolve_config``."""
    sims: int | None = None               # None: the env's preset (8 for most)
    env: str | Callable = "CartPole-v1"  # an id, gym:ID, package.module:make_env, or a callable
    seed: int = 0
    stop_return: float | None = None      # None: the env's reward threshold, else train to the budget
    max_env_steps: int | None = None
    logdir: str | None = None             # None: runs/<env>-<date>-<time>-<pid>
    train_batch_size: int | None = None
    env_steps_per_sample: int | None = None  # None: train_batch_size spread over the simulators
    envs_per_sim: int | None = None
    sim_nice: int = 19
    lr: float | None = None
    gamma: float | None = None
    gae_lambda: float | None = None
    epochs: int | None = None
    minibatch_size: int | None = None
    ent_coef: float | None = None
    clip: float | None = None
    reward_scale: float | None = None
    normalize_obs: bool | None = None
    normalize_reward: bool | None = None
    lr_anneal: bool | None = None
    vf_coef: float | None = None
    max_grad_norm: float | None = None
    hidden: int | None = None
    layers: int | None = None
    activation: str | None = None
    cnn: str | None = None
    log_std_init: float | None = None
    memory: str | None = None             # "none", "lstm" or "gru"; None: the env's preset
    memory_size: int | None = None
    max_seq_len: int | None = None
    torch_threads: int | None = None
    transport: str = "shm"
    tcp_host: str = "127.0.0.1"
    tcp_port: int | None = None
    max_frame_bytes: int = 64 << 20
    async_sampling: bool | None = None    # None: the env's preset (strict on-policy for most)
    auth_token: str | None = None
    max_policy_lag: int = 2
    hang_timeout: float = 10.0
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    resume: str | None = None
    log_every: float | None = None        # None: every update on a terminal, else every 10 s
    tensorboard: bool | None = None       # None: when the tensorboard package is installed
    policy_map: str = "shared"            # multi-agent envs: shared, per-agent or package.module:fn
    league: int | None = None             # multi-agent self-play: frozen snapshots kept (0: none)
    league_every: int | None = None       # updates between snapshots
    league_prob: float | None = None      # chance an episode has one agent play a snapshot
    ray: str | None = None                # a Ray cluster's address ("auto", "HOST:6379"): simulators as actors
    sim_cpus: float = 1.0                 # CPUs Ray reserves for each simulator actor


def env_defaults(env, spec=None) -> dict:
    """The defaults of ``env`` from shmrl/presets.toml (``spec``: to find its family)."""
    from shmrl.presets import defaults

    return defaults(env, spec)[0]


def resolve_config(config: RunConfig, spec=None) -> RunConfig:
    """A copy with every field left None set to the environment's default (its preset);
    unless given, each simulator's message holds its share of a training batch."""
    defaults = env_defaults(config.env, spec)
    config = dataclasses.replace(config, **{k: v for k, v in defaults.items() if getattr(config, k) is None})
    if config.env_steps_per_sample is None:
        config.env_steps_per_sample = -(-config.train_batch_size // max(config.sims, 1))
    return config


def process_start_time() -> float:
    """Wall-clock time at which this process started (Linux /proc), else now.

    /proc/self/stat gives the start in clock ticks since boot; CLOCK_BOOTTIME is the
    same clock (/proc/stat's btime would add up to a second of rounding).
    """
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


def _terminate(signum, frame):
    raise SystemExit(128 + signum)


def env_name(env) -> str:
    return env if isinstance(env, str) else f"{getattr(env, '__module__', '?')}.{getattr(env, '__qualname__', env)}"


def saved_config(config: RunConfig) -> dict:
    """The configuration as written to summaries and checkpoints: JSON, never the secret."""
    return {**dataclasses.asdict(config), "env": env_name(config.env),
            "auth_token": "(set)" if config.auth_token else None}


def train(config: RunConfig, t_start: float | None = None) -> tuple[int, dict]:
    """Run one training job; returns (exit status, summary). Whatever happens (Ctrl-C and
    SIGTERM included) every process it started is stopped, every segment it made is
    unlinked, and the summary and a checkpoint are written."""
    t_start = t_start if t_start is not None else time.time()
    launcher = None
    if config.ray:
        from shmrl.ray_launcher import RayLauncher

        try:
            launcher = RayLauncher(config.ray, sim_cpus=config.sim_cpus)
        except ImportError as e:
            raise ConfigError(str(e)) from None
        except (ConnectionError, RuntimeError, ValueError) as e:  # what ray.init raises for no cluster there
            raise ConfigError(f"--ray {config.ray}: cannot connect to the Ray cluster: {e}") from None
        if not config.auth_token:  # the port is open to the cluster's network: never without a secret
            import secrets

            config = dataclasses.replace(config, auth_token=secrets.token_urlsafe(24))
            log.info("--ray: the simulators' TCP connections use a generated auth token; give --auth-token "
                     "(or $SHMRL_AUTH_TOKEN) to let other clients in too")
    from shmrl.trainer import train_run

    try:
        return train_run(config, t_start, launcher)
    finally:
        if launcher is not None and launcher.owns_ray:
            launcher.ray.shutdown()


def build_parser(d: RunConfig, spec=None) -> argparse.ArgumentParser:
    """The command line, with ``d`` as the defaults (a resumed run's are its saved configuration)."""
    from shmrl.presets import PRESETS_FILE, defaults

    sources = " + ".join(defaults(d.env, spec)[1])
    p = OneLineErrorParser(prog="python -m shmrl.run", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog=f"The defaults shown are those of --env {env_name(d.env)}: {sources} in "
                                  f"{PRESETS_FILE}" + (f", saved by the run in {d.logdir}" if d.resume else ""))
    p.add_argument("--sims", type=int, default=d.sims,
                   help="simulator processes, each with its own shared-memory ring (default: %(default)s)")
    p.add_argument("--env", default=d.env,
                   help="environment: a built-in id (CartPole-v1, Pendulum-v1), gym:ID for any gymnasium env "
                        "(pip install 'shmrl[gym]'), or package.module:make_env, a function that makes one; "
                        "the defaults below are this env's (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the learner and, offset per simulator, "
                   "of the environments and action sampling (default: %(default)s)")
    p.add_argument("--stop-return", type=float, default=d.stop_return, metavar="R",
                   help="stop when the mean return of the last 100 complete episodes reaches R "
                        "(default: %(default)s; None: the env's reward threshold, or none: train to the budget)")
    p.add_argument("--max-env-steps", type=int, default=d.max_env_steps, metavar="N",
                   help="give up (exit 1) after N env steps received, counting those before a --resume "
                        "(default: %(default)s)")
    r = p.add_argument_group("logs, checkpoints and resuming")
    r.add_argument("--logdir", default=d.logdir, metavar="DIR",
                   help="write metrics.jsonl (one line per update), summary.json, policy.onnx and "
                        "checkpoints/ to DIR (default: runs/<env>-<date>-<time>-<pid>)")
    r.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, metavar="N",
                   help="also write a checkpoint every N updates; one is always written when the run ends, "
                        "Ctrl-C and SIGTERM included (default: %(default)s, only at the end)")
    r.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints, metavar="K",
                   help="keep the last K checkpoints (default: %(default)s)")
    r.add_argument("--log-every", type=float, default=d.log_every, metavar="S",
                   help="print a progress line at most every S seconds (0: every update); default: every "
                        "update on a terminal, every 10 s when stdout is a file or a pipe")
    r.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=d.tensorboard,
                   help="also write the metrics as TensorBoard scalars into the log folder (tensorboard "
                        "--logdir runs); default: when the tensorboard package is installed "
                        "(pip install 'shmrl[tensorboard]')")
    r.add_argument("--resume", default=None, metavar="DIR",
                   help="go on from the last checkpoint in DIR (weights, optimizer, env-step counts, "
                        "weights_seq_no, return window), with its configuration except for the flags given "
                        "here; logs are appended to DIR")
    t = p.add_argument_group("transports")
    t.add_argument("--transport", choices=("shm", "tcp"), default=d.transport,
                   help="how the local simulators talk to the learner: shared-memory rings, or "
                        "RLlink JSON over TCP loopback like an external client (default: %(default)s)")
    t.add_argument("--tcp-port", type=int, default=d.tcp_port, metavar="PORT",
                   help="also accept external RLlink clients (RLlib's JSON variant) on this port; "
                        "they train the same policy as the local simulators")
    t.add_argument("--tcp-host", default=d.tcp_host, metavar="HOST",
                   help="address to listen on (default: %(default)s, loopback only; 0.0.0.0 exposes "
                        "the learner to the network)")
    t.add_argument("--auth-token", default=os.environ.get("SHMRL_AUTH_TOKEN"), metavar="SECRET",
                   help="require this shared secret in every client's PING (field auth_token); a client "
                        "without it gets only a closed connection (default: $SHMRL_AUTH_TOKEN, else none)")
    t.add_argument("--max-frame-bytes", type=int, default=d.max_frame_bytes, metavar="N",
                   help="largest TCP frame body accepted; a bigger header closes that connection "
                        "before its body is read (default: %(default)s)")
    t.add_argument("--ray", default=d.ray, metavar="ADDRESS",
                   help="place the simulators as Ray actors across the nodes of the Ray cluster at ADDRESS "
                        "(auto: the one this machine belongs to; HOST:6379); those on this node use shared "
                        "memory, the others connect back over TCP on this node's cluster address (or "
                        "--tcp-host) with the binary codec and an auth token (one is generated unless "
                        "--auth-token gives it). pip install 'shmrl[ray]'")
    t.add_argument("--sim-cpus", type=float, default=d.sim_cpus, metavar="C",
                   help="with --ray, CPUs reserved for each simulator actor (default: %(default)s)")
    t.add_argument("--hang-timeout", type=float, default=d.hang_timeout, metavar="S",
                   help="restart a simulator whose env has not stepped for S seconds while the learner was "
                        "not holding it back; close a TCP client of shmrl's that sent no heartbeat for S "
                        "seconds; let a strict on-policy batch wait at most S seconds for a client still "
                        "sampling (default: %(default)s)")
    m = p.add_argument_group("multi-agent envs (PettingZoo: --env pz:NAME)")
    m.add_argument("--policy-map", default=d.policy_map, metavar="MAP",
                   help="which policy each agent plays: shared (one for all), per-agent (one each), or "
                        "package.module:fn, a function agent_id -> policy_id; each policy is trained by its own "
                        "PPO (default: %(default)s)")
    m.add_argument("--league", type=int, default=d.league, metavar="N",
                   help="self-play league: keep the last N frozen snapshots of each policy; at each episode "
                        "start, with probability --league-prob, one agent plays a snapshot picked uniformly "
                        "(default: %(default)s, none: every agent plays the current policy)")
    m.add_argument("--league-every", type=int, default=d.league_every, metavar="U",
                   help="add a snapshot every U updates (default: %(default)s)")
    m.add_argument("--league-prob", type=float, default=d.league_prob, metavar="P",
                   help="chance that an episode has an agent play a snapshot (default: %(default)s)")
    g = p.add_argument_group("sampling and PPO")
    g.add_argument("--train-batch-size", type=int, default=d.train_batch_size, metavar="N",
                   help="env steps per PPO update; fewer when every client waits for new weights and "
                        "together they have sent fewer (default: %(default)s)")
    g.add_argument("--env-steps-per-sample", type=int, default=None, metavar="N",
                   help="env steps per EPISODES message of each client, what SET_CONFIG tells them "
                        f"(default: the train batch spread over the simulators, {d.env_steps_per_sample} "
                        f"for {d.sims})")
    g.add_argument("--envs-per-sim", type=int, default=d.envs_per_sim, metavar="K",
                   help="environments each simulator steps together, one batched ONNX call per step "
                        "(default: %(default)s)")
    g.add_argument("--sim-nice", type=int, default=d.sim_nice, metavar="N",
                   help="run the local simulators N steps below the learner's CPU priority (0-19): the "
                        "learner's update is what every simulator waits for, so on a busy machine it "
                        "comes first (default: %(default)s)")
    g.add_argument("--async", dest="async_sampling", action=argparse.BooleanOptionalAction, default=d.async_sampling,
                   help="simulators keep sampling while the learner trains: each EPISODES_AND_GET_STATE "
                        "is answered at once with the latest weights, not after the next update; PPO's "
                        "ratio is taken against the behaviour log-probabilities the clients report")
    g.add_argument("--max-policy-lag", type=int, default=d.max_policy_lag, metavar="V",
                   help="with --async, drop (and count) chunks sampled with weights more than V "
                        "versions old (default: %(default)s)")
    g.add_argument("--lr", type=float, default=d.lr, help="Adam learning rate (default: %(default)s)")
    g.add_argument("--gamma", type=float, default=d.gamma, help="discount (default: %(default)s)")
    g.add_argument("--gae-lambda", type=float, default=d.gae_lambda, help="GAE lambda (default: %(default)s)")
    g.add_argument("--epochs", type=int, default=d.epochs, help="passes over each batch (default: %(default)s)")
    g.add_argument("--minibatch-size", type=int, default=d.minibatch_size,
                   help="steps per gradient step (default: %(default)s)")
    g.add_argument("--ent-coef", type=float, default=d.ent_coef, help="entropy bonus (default: %(default)s)")
    g.add_argument("--clip", type=float, default=d.clip, help="PPO ratio clip (default: %(default)s)")
    g.add_argument("--vf-coef", type=float, default=d.vf_coef, help="weight of the value loss (default: %(default)s)")
    g.add_argument("--max-grad-norm", type=float, default=d.max_grad_norm,
                   help="clip the global gradient norm of each step to this (default: %(default)s)")
    g.add_argument("--lr-anneal", action=argparse.BooleanOptionalAction, default=d.lr_anneal,
                   help="let the learning rate fall linearly to 0 over --max-env-steps (default: %(default)s)")
    g.add_argument("--reward-scale", type=float, default=d.reward_scale, metavar="C",
                   help="train on rewards times C (returns are reported unscaled) (default: %(default)s)")
    g.add_argument("--normalize-reward", action=argparse.BooleanOptionalAction, default=d.normalize_reward,
                   help="also divide the rewards trained on by the running standard deviation of each "
                        "client stream's discounted return, as VecNormalize does (default: %(default)s)")
    g.add_argument("--normalize-obs", action=argparse.BooleanOptionalAction, default=d.normalize_obs,
                   help="normalize observations by running mean and variance of all received, clipped to "
                        "+-10, inside the published ONNX policy: clients feed raw observations "
                        "(default: %(default)s)")
    g.add_argument("--hidden", type=int, default=d.hidden,
                   help="units in each hidden layer of the policy and value networks (default: %(default)s)")
    g.add_argument("--layers", type=int, default=d.layers,
                   help="hidden layers after the observation encoders (default: %(default)s)")
    g.add_argument("--cnn", choices=("nature", "small"), default=d.cnn,
                   help="CNN for image observations: the Nature CNN (8x8/4, 4x4/2, 3x3/1 convolutions and "
                        "512 units) for images of 36x36 or more, else a small one (two 3x3 convolutions), "
                        "or always the small one (default: %(default)s)")
    g.add_argument("--activation", choices=("ReLU", "Tanh"), default=d.activation,
                   help="activation of the hidden layers (default: %(default)s)")
    g.add_argument("--log-std-init", type=float, default=d.log_std_init,
                   help="initial log standard deviation of a Gaussian policy (Box actions) (default: %(default)s)")
    g.add_argument("--memory", choices=("none", "lstm", "gru"), default=d.memory,
                   help="a recurrent core (LSTM or GRU) between the hidden layers and the heads, shared by "
                        "actor and critic: the policy keeps a state across the steps of an episode, for envs "
                        "whose observation does not show everything (the ONNX policy takes state_in.<i> and "
                        "gives state_out.<i>; README, 'Memory') (default: %(default)s)")
    g.add_argument("--memory-size", type=int, default=d.memory_size, metavar="N",
                   help="units of the recurrent core (default: %(default)s)")
    g.add_argument("--max-seq-len", type=int, default=d.max_seq_len, metavar="T",
                   help="with --memory, PPO back-propagates through sequences of at most T steps "
                        "(default: %(default)s)")
    g.add_argument("--torch-threads", type=int, default=d.torch_threads,
                   help="torch threads of the learner; the simulators need the other cores. 0: every core, "
                        "where the update dominates and the simulators wait through it (strict on-policy "
                        "image presets) (default: %(default)s)")
    return p


def parse_args(argv=None) -> RunConfig:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    # The defaults depend on the env (or on the run being resumed): find those first, so
    # that --help shows the ones that apply.
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--env", default=RunConfig.env)
    pre.add_argument("--sims", type=int, default=RunConfig.sims)
    pre.add_argument("--resume")
    known, _ = pre.parse_known_args(argv)
    from shmrl.envs import env_spec

    try:
        spec = env_spec(known.env)
    except ValueError as e:
        OneLineErrorParser(prog="python -m shmrl.run").error(str(e))
    defaults = resolve_config(RunConfig(env=known.env, sims=known.sims), spec)
    if known.resume:
        from shmrl import checkpoint

        try:  # train() says which checkpoints it passed over, and why
            _, _, state, _ = checkpoint.load_latest(Path(known.resume))
        except checkpoint.CheckpointError as e:
            build_parser(defaults, spec).error(f"--resume {known.resume}: {e}")
        fields = {f.name for f in dataclasses.fields(RunConfig)}
        defaults = RunConfig(**{k: v for k, v in state.get("config", {}).items()
                                if k in fields and k != "auth_token"})
        defaults.logdir = known.resume
    p = build_parser(defaults, spec)
    a = p.parse_args(argv)
    config = resolve_config(RunConfig(**{f.name: getattr(a, f.name) for f in dataclasses.fields(RunConfig)}), spec)
    if config.sims < 0 or min(config.train_batch_size, config.env_steps_per_sample, config.max_env_steps,
                              config.envs_per_sim) < 1:
        p.error("--sims must be >= 0; --train-batch-size, --env-steps-per-sample, --max-env-steps and "
                "--envs-per-sim >= 1")
    if not 0 <= config.sim_nice <= 19:
        p.error("--sim-nice must be between 0 and 19")
    if config.checkpoint_every < 0 or config.keep_checkpoints < 1 or config.hang_timeout <= 0:
        p.error("--checkpoint-every must be >= 0, --keep-checkpoints >= 1 and --hang-timeout > 0")
    if config.tcp_port is not None and not 0 <= config.tcp_port <= 65535:
        p.error(f"--tcp-port {config.tcp_port}: a port is a number from 0 to 65535 (0: any free port)")
    if config.sims == 0 and config.tcp_port is None:
        p.error("--sims 0 runs no local simulator: give --tcp-port for external clients")
    if config.sim_cpus <= 0:
        p.error("--sim-cpus must be > 0")
    if config.ray is not None and config.sims == 0:
        p.error("--ray places simulators: give --sims N (N >= 1)")
    if config.max_frame_bytes < 1024:
        p.error("--max-frame-bytes must be >= 1024 (a PING alone takes 16)")
    if not (config.lr > 0 and 0 < config.gamma <= 1 and 0 <= config.gae_lambda <= 1 and config.clip > 0
            and config.ent_coef >= 0 and config.reward_scale > 0):
        p.error("--lr, --clip and --reward-scale must be > 0, --gamma in (0, 1], --gae-lambda in [0, 1] and "
                "--ent-coef >= 0")
    if min(config.epochs, config.minibatch_size, config.hidden) < 1 or config.torch_threads < 0 \
            or config.max_policy_lag < 0:
        p.error("--epochs, --minibatch-size and --hidden must be >= 1, --torch-threads and --max-policy-lag >= 0")
    if config.layers < 0:
        p.error("--layers must be >= 0")
    if config.memory_size < 1 or config.max_seq_len < 1:
        p.error("--memory-size and --max-seq-len must be >= 1")
    if config.log_every is not None and config.log_every < 0:
        p.error("--log-every must be >= 0")
    if config.league < 0 or config.league_every < 1 or not 0 <= config.league_prob <= 1:
        p.error("--league must be >= 0, --league-every >= 1 and --league-prob between 0 and 1")
    if getattr(spec, "multiagent", False):
        from shmrl.multiagent import policy_mapper

        try:
            spec.policy_specs(policy_mapper(config.policy_map))
        except ValueError as e:
            p.error(str(e))
        if config.memory != "none":
            p.error("--memory: recurrent policies are single-agent for now; a multi-agent env takes --memory none")
    if config.vf_coef < 0 or config.max_grad_norm <= 0:
        p.error("--vf-coef must be >= 0 and --max-grad-norm > 0")
    return config


def main(argv=None) -> int:
    t_start = process_start_time()
    try:
        config = parse_args(argv)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        signal.signal(signal.SIGTERM, _terminate)
        # Ctrl-C stops the run cleanly even if whoever started it ignored SIGINT (a shell's
        # background job inherits it ignored, and Python then leaves it so).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        status, _ = train(config, t_start)
    except ConfigError as e:  # found before anything started
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except KeyboardInterrupt:  # before train() had anything to clean up
        return EXIT_INTERRUPTED
    except Exception:  # a bug: say so, and exit as a failed part (1 means the budget ran out)
        log.exception("the run failed")
        return EXIT_FAILED
    return status


if __name__ == "__main__":
    status = main()
    # By now everything is written and every process and segment of the run is gone; what is
    # left, tearing down an interpreter that has loaded torch, takes about 0.4 s (measured
    # here), which the command need not wait for.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
