"""Train a policy with PPO from simulator processes that talk RLlink through shared memory.

    python -m shmrl.run --sims 8                  # CartPole-v1 until the 100-episode mean is >= 475
    python -m shmrl.run --sims 8 --logdir runs/a  # also write metrics.jsonl, summary.json, policy.onnx

Exit status: 0 when the stop return is reached, 1 when the env-step budget runs out
first, 3 when a part of the run fails (a simulator dies, a transport breaks),
130 after Ctrl-C, 143 after SIGTERM.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("shmrl.run")

EXIT_SOLVED, EXIT_BUDGET, EXIT_FAILED = 0, 1, 3


@dataclass
class RunConfig:
    sims: int = 8
    env: str = "CartPole-v1"
    seed: int = 0
    stop_return: float = 475.0
    max_env_steps: int = 1_000_000
    logdir: str | None = None
    env_steps_per_sample: int = 256
    envs_per_sim: int = 1
    lr: float = 1e-3
    gamma: float = 0.99
    gae_lambda: float = 0.95
    epochs: int = 10
    minibatch_size: int = 512
    ent_coef: float = 0.0
    clip: float = 0.2
    hidden: int = 64
    torch_threads: int = 1
    transport: str = "shm"
    tcp_host: str = "127.0.0.1"
    tcp_port: int | None = None
    max_frame_bytes: int = 64 << 20
    async_sampling: bool = False
    auth_token: str | None = None
    max_policy_lag: int = 2


class RunFailed(RuntimeError):
    """A part of the run failed (a simulator died, a transport broke)."""


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


def start_simulators(addresses: list[str], config: RunConfig) -> list:
    """One process per simulator, forked from a server that has imported only the
    simulator's modules (numpy, onnxruntime): never torch, and a fork costs ms, not the
    hundreds of ms a fresh interpreter would."""
    import multiprocess

    from shmrl.sim import sim_process_main

    ctx = multiprocess.get_context("forkserver")
    ctx.set_forkserver_preload(["shmrl.sim", f"shmrl.transport.{config.transport}"])
    procs = []
    for i, address in enumerate(addresses):
        p = ctx.Process(target=sim_process_main, name=f"shmrl-sim{i}", daemon=True,
                        args=(address, config.env, config.seed * 1000 + i, config.envs_per_sim,
                              f"shmrl-sim{i}", config.auth_token))
        p.start()
        procs.append(p)
    return procs


def open_transports(config: RunConfig) -> tuple[list, list[str]]:
    """The learner's servers, and the address each local simulator connects to."""
    servers, addresses = [], []
    if config.sims and config.transport == "shm":
        from shmrl.transport.shm import ShmServer
        shm = ShmServer(config.sims)
        servers.append(shm)
        addresses = [f"shm:{shm.address(i)}" for i in range(config.sims)]
    if config.tcp_port is not None or (config.sims and config.transport == "tcp"):
        from shmrl.transport.tcp import TcpServer
        try:
            tcp = TcpServer(config.tcp_host, config.tcp_port or 0, max_frame_bytes=config.max_frame_bytes)
        except BaseException:
            for server in servers:
                server.close()
            raise
        servers.append(tcp)
        host, port = tcp.address
        if config.tcp_port is not None:
            print(f"listening for RLlink clients on {host}:{port}", flush=True)
        if config.transport == "tcp":
            addresses = [f"tcp:{host}:{port}"] * config.sims
    return servers, addresses


def stop_simulators(procs: list, timeout: float = 2.0) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


def _terminate(signum, frame):
    raise SystemExit(128 + signum)


def progress_line(row: dict, n_returns: int) -> str:
    clients = " ".join(f"{c}={_k(n)}" for c, n in sorted(row["env_steps_by_client"].items(),
                                                        key=lambda kv: (len(kv[0]), kv[0])))
    return (f"update {row['update']:4d} | steps {row['env_steps']:8d} | {row['env_steps_per_s']:8.0f} steps/s | "
            f"return {row['return_mean']:7.1f} (n={n_returns}) | pi {row['pi_loss']:+.3f} "
            f"v {row['v_loss']:.3f} ent {row['entropy']:.3f} kl {row['approx_kl']:.4f} | "
            f"lag {row['policy_lag']:.1f} | {row['elapsed_s']:.1f}s | {clients}")


def _k(n: int) -> str:
    return f"{n / 1000:.1f}k" if n >= 1000 else str(n)


def train(config: RunConfig, t_start: float | None = None) -> tuple[int, dict]:
    """Run one training job; returns (exit status, summary)."""
    t_start = t_start if t_start is not None else time.time()
    from shmrl.envs import env_spec

    spec = env_spec(config.env)
    logdir = Path(config.logdir) if config.logdir else None
    if logdir:
        logdir.mkdir(parents=True, exist_ok=True)
    procs: list = []
    summary: dict = {}
    status = EXIT_FAILED
    servers, addresses = open_transports(config)
    metrics_file = learner = None
    try:
        # The first policy is published and served before torch is imported (about 2 s):
        # the simulators start (their fork server loads numpy and onnxruntime) and sample
        # on one core while this process loads torch on the other.
        import numpy as np

        from shmrl.learner import Learner
        from shmrl.onnx_policy import init_mlp_weights

        actor_sizes = [spec.obs_shape[0], config.hidden, config.hidden, spec.action_space.n]
        first_policy = init_mlp_weights(actor_sizes, 0.01, np.random.default_rng(config.seed))
        learner = Learner(spec, servers, actor_sizes=actor_sizes, initial_weights=first_policy,
                          env_steps_per_sample=config.env_steps_per_sample,
                          train_batch_size=max(config.sims, 1) * config.env_steps_per_sample,
                          force_on_policy=not config.async_sampling, max_policy_lag=config.max_policy_lag,
                          auth_token=config.auth_token)
        t_learn = time.time()
        store = learner.store
        learner.start()
        launch_error: list = []

        def launch():
            try:
                procs.extend(start_simulators(addresses, config))
            except BaseException as e:  # re-raised below, in the main thread
                launch_error.append(e)

        launcher = threading.Thread(target=launch, name="shmrl-launcher", daemon=True)
        launcher.start()
        import torch

        from shmrl.ppo import PPO, PPOConfig

        torch.set_num_threads(config.torch_threads)
        ppo = PPO(spec.obs_shape[0], spec.action_space.n,
                  PPOConfig(lr=config.lr, gamma=config.gamma, gae_lambda=config.gae_lambda,
                            clip=config.clip, epochs=config.epochs, minibatch_size=config.minibatch_size,
                            ent_coef=config.ent_coef, hidden=config.hidden),
                  seed=config.seed, actor_weights=first_policy)
        launcher.join()
        if launch_error:
            raise RunFailed(f"could not start the simulators: {launch_error[0]!r}")
        metrics_file = open(logdir / "metrics.jsonl", "w") if logdir else None
        while True:
            batch = learner.next_batch(0.05)
            dead = [p for p in procs if not p.is_alive()]
            if dead:
                raise RunFailed(", ".join(f"simulator {p.name} (pid {p.pid}) exited with code {p.exitcode}"
                                          for p in dead))
            if len(store.returns) >= store.returns.maxlen and store.return_mean() >= config.stop_return:
                status = EXIT_SOLVED
                break
            if store.steps_received >= config.max_env_steps:
                status = EXIT_BUDGET
                break
            stats = learner.train(ppo, *batch) if batch else None
            if stats:
                now = time.time()
                row = {"update": stats["update"], "env_steps": store.steps_received,
                       "env_steps_per_s": store.steps_received / max(now - t_learn, 1e-9),
                       "return_mean": store.return_mean(), "episodes": store.episodes_completed,
                       **{k: stats[k] for k in ("pi_loss", "v_loss", "entropy", "approx_kl", "clip_frac",
                                               "train_s", "batch_steps", "weights_seq_no", "policy_lag")},
                       "env_steps_trained": store.steps_trained, "env_steps_dropped": dict(store.steps_dropped),
                       "env_steps_by_client": dict(store.steps_by_conn),
                       "elapsed_s": now - t_start}
                print(progress_line(row, len(store.returns)), flush=True)
                if metrics_file:
                    metrics_file.write(json.dumps(row) + "\n")
                    metrics_file.flush()
        wall = time.time() - t_start
        summary = {"solved": status == EXIT_SOLVED, "exit_status": status, "wall_s": wall,
                   "env_steps": store.steps_received, "env_steps_trained": store.steps_trained,
                   "env_steps_dropped": dict(store.steps_dropped), "env_steps_pending": store.pending_steps,
                   "return_mean": store.return_mean(), "episodes": store.episodes_completed,
                   "env_steps_per_s": store.steps_received / max(time.time() - t_learn, 1e-9),
                   "env_steps_by_client": dict(store.steps_by_conn),
                   "updates": learner.updates, "weights_seq_no": learner.weights_seq_no,
                   "config": {**dataclasses.asdict(config),
                              "auth_token": "(set)" if config.auth_token else None}}  # never the secret
        verdict = "solved" if status == EXIT_SOLVED else "step budget exhausted"
        print(f"{verdict}: return {summary['return_mean']:.1f} over the last {len(store.returns)} "
              f"episodes after {summary['env_steps']} env steps in {wall:.2f} s", flush=True)
        if logdir:
            (logdir / "policy.onnx").write_bytes(learner.model_bytes)
            (logdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return status, summary
    except RunFailed as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILED, summary
    finally:
        if metrics_file:
            metrics_file.close()
        if learner is not None:
            learner.stop()
        stop_simulators(procs)
        for server in servers:
            server.close()


def parse_args(argv=None) -> RunConfig:
    d = RunConfig()
    p = argparse.ArgumentParser(prog="python -m shmrl.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sims", type=int, default=d.sims,
                   help="simulator processes, each with its own shared-memory ring (default: %(default)s)")
    p.add_argument("--env", default=d.env, help="environment id (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the learner and, offset per simulator, "
                   "of the environments and action sampling (default: %(default)s)")
    p.add_argument("--stop-return", type=float, default=d.stop_return, metavar="R",
                   help="stop when the mean return of the last 100 complete episodes reaches R (default: %(default)s)")
    p.add_argument("--max-env-steps", type=int, default=d.max_env_steps, metavar="N",
                   help="give up (exit 1) after N env steps received (default: %(default)s)")
    p.add_argument("--logdir", default=None, metavar="DIR",
                   help="write metrics.jsonl (one line per update), summary.json and policy.onnx to DIR")
    t = p.add_argument_group("transports")
    t.add_argument("--transport", choices=("shm", "tcp"), default=d.transport,
                   help="how the local simulators talk to the learner: shared-memory rings, or "
                        "RLlink JSON over TCP loopback like an external client (default: %(default)s)")
    t.add_argument("--tcp-port", type=int, default=None, metavar="PORT",
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
    g = p.add_argument_group("sampling and PPO")
    g.add_argument("--env-steps-per-sample", type=int, default=d.env_steps_per_sample, metavar="N",
                   help="env steps per EPISODES message of each simulator; one update trains on "
                        "sims x N steps (default: %(default)s)")
    g.add_argument("--envs-per-sim", type=int, default=d.envs_per_sim, metavar="K",
                   help="environments each simulator steps together, one batched ONNX call per step "
                        "(default: %(default)s)")
    g.add_argument("--async", dest="async_sampling", action="store_true",
                   help="simulators keep sampling while the learner trains (SET_CONFIG force_on_policy "
                        "false); PPO's ratio is taken against the behaviour policy the clients report. "
                        "RLlib's own client refuses this mode")
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
    g.add_argument("--hidden", type=int, default=d.hidden,
                   help="units in each of the two hidden layers of the policy and value networks "
                        "(default: %(default)s)")
    g.add_argument("--torch-threads", type=int, default=d.torch_threads,
                   help="torch threads of the learner; the simulators need the other cores (default: %(default)s)")
    a = p.parse_args(argv)
    config = RunConfig(**{f.name: getattr(a, f.name) for f in dataclasses.fields(RunConfig)})
    if config.sims < 0 or min(config.env_steps_per_sample, config.max_env_steps, config.envs_per_sim) < 1:
        p.error("--sims must be >= 0; --env-steps-per-sample, --max-env-steps and --envs-per-sim >= 1")
    if config.sims == 0 and config.tcp_port is None:
        p.error("--sims 0 runs no local simulator: give --tcp-port for external clients")
    return config


def main(argv=None) -> int:
    t_start = process_start_time()
    config = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _terminate)
    try:
        status, _ = train(config, t_start)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return status


if __name__ == "__main__":
    sys.exit(main())
