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
import errno
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from shmrl.config import (EXIT_BUDGET, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_SOLVED, EXIT_USAGE,  # noqa: F401
                          Config, ConfigError, OneLineErrorParser, RunConfig, add_arguments, config_from_args,
                          config_from_saved, env_name, preset_values, resolve_config, saved_config,
                          validate)

log = logging.getLogger("shmrl.run")


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


def open_transports(config: RunConfig, spec, net, launcher=None) -> tuple[list, list[str], object]:
    """The learner's servers, the address each local simulator connects to, and the
    shared-memory server (None if the simulators use TCP or there are none). With a remote
    ``launcher`` (Ray) the TCP server also listens, on the address this node has in the
    cluster unless --tcp-host names another: the simulators on other nodes connect there."""
    servers, addresses, shm = [], [], None
    remote = launcher is not None and launcher.remote
    if config.sims and config.transport == "shm":
        from shmrl.transport.shm import ShmServer
        shm = ShmServer(config.sims, **ring_bytes(config, spec, net))
        servers.append(shm)
        addresses = [f"shm:{shm.address(i)}" for i in range(config.sims)]
    if config.tcp_port is not None or (config.sims and config.transport == "tcp") or remote:
        from shmrl.transport.tcp import TcpServer
        host = launcher.node_ip if remote and config.tcp_host == RunConfig.tcp_host else config.tcp_host
        try:
            tcp = TcpServer(host, config.tcp_port or 0, max_frame_bytes=config.max_frame_bytes,
                            first_frame_max_bytes=FIRST_FRAME_MAX_BYTES if config.auth_token else None,
                            heartbeat_s=heartbeat_period(config.hang_timeout), heartbeat_timeout=config.hang_timeout)
        except BaseException as e:
            for server in servers:
                server.close()
            if isinstance(e, (OSError, OverflowError)):
                raise ConfigError(listen_error(config, e)) from None
            raise
        servers.append(tcp)
        host, port = tcp.address
        if config.tcp_port is not None or remote:
            print(f"listening for RLlink clients on {host}:{port}", flush=True)
        if remote:
            launcher.tcp_address = f"tcp:{host}:{port}"
        if config.transport == "tcp":
            addresses = [f"tcp:{host}:{port}"] * config.sims
    return servers, addresses, shm


def heartbeat_period(hang_timeout: float) -> float:
    """How often shmrl's TCP clients are asked to send a HEARTBEAT: several per
    ``--hang-timeout``, so that one late frame is not taken for a hang; at most 1 s."""
    return min(1.0, hang_timeout / 5)


# With --auth-token a connection's first frame must be its PING: a few hundred bytes.
FIRST_FRAME_MAX_BYTES = 4096


def listen_error(config: RunConfig, e: Exception) -> str:
    """Why the TCP port could not be opened, in the words of the flags that chose it."""
    where = f"--tcp-host {config.tcp_host} --tcp-port {config.tcp_port or 0}"
    code = getattr(e, "errno", None)
    if code == errno.EADDRINUSE:
        return f"{where}: the port is already in use (another run or program listens there; choose " \
               f"another port, or --tcp-port 0 for any free one)"
    if code == errno.EADDRNOTAVAIL:
        return f"{where}: {config.tcp_host} is not an address of this machine"
    if code == errno.EACCES:
        return f"{where}: permission denied (ports below 1024 need privileges)"
    if isinstance(e, socket.gaierror):
        return f"{where}: cannot resolve {config.tcp_host!r} ({e.strerror})"
    return f"{where}: cannot listen there: {getattr(e, 'strerror', None) or e}"


def load_resume_checkpoint(config: RunConfig, net) -> tuple:
    """(path, arrays, state) of the newest intact checkpoint of ``config.resume``, checked
    against this run's env and network before anything is started or written: a run that
    cannot resume must leave the folder it would resume as it found it."""
    from shmrl import checkpoint

    try:
        path, arrays, state, damaged = checkpoint.load_latest(Path(config.resume))
    except checkpoint.CheckpointError as e:
        raise ConfigError(f"--resume {config.resume}: {e}") from None
    for reason in damaged:
        log.warning("--resume %s: %s; going on from %s instead", config.resume, reason, path)
    saved_env = state.get("config", {}).get("env")
    if saved_env is not None and saved_env != env_name(config.env):
        raise ConfigError(f"--resume {config.resume}: its checkpoint was trained on {saved_env}, not "
                          f"{env_name(config.env)}; a run resumes on the env it was trained on")
    # A multi-agent run's nets are by policy id: each must fit its saved policy.
    for pid, one in (net.items() if isinstance(net, dict) else [(None, net)]):
        why = one.check(saved_policy(arrays, pid))
        if why:
            raise ConfigError(f"--resume {config.resume}: {path} does not fit a network of --hidden {config.hidden} "
                              f"for {one.spec.env_id}: {why}; was it saved with other layer sizes?")
    return path, arrays, state


def saved_policy(arrays: dict, pid: str | None = None) -> dict:
    """The published policy in a checkpoint's arrays (``policy/<name>``; a multi-agent
    run's policy ``pid``: ``policies/<pid>/policy/<name>``)."""
    prefix = "policy/" if pid is None else f"policies/{pid}/policy/"
    return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}


def policy_arrays(arrays: dict, pid: str) -> dict:
    """A multi-agent checkpoint's arrays of policy ``pid``, under the names PPO uses."""
    prefix = f"policies/{pid}/"
    return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}


def policy_net(config: RunConfig, spec):
    """The published policy of this run's configuration."""
    from shmrl.net import PolicyNet

    return PolicyNet(spec, config.hidden, config.activation, normalize_obs=config.normalize_obs,
                     log_std_init=config.log_std_init, layers=config.layers, cnn=config.cnn,
                     memory=None if config.memory == "none" else config.memory, memory_size=config.memory_size)


def ring_bytes(config: RunConfig, spec, net) -> dict:
    """Ring capacities that take every frame of this run: a simulator's EPISODES message
    (``env_steps_per_sample`` rounded up to whole steps of its envs) and a SET_STATE of
    this policy."""
    import numpy as np

    from shmrl import rllink
    from shmrl.transport.shm import ShmServer, ring_bytes_for

    steps = -(-config.env_steps_per_sample // config.envs_per_sim) * config.envs_per_sim
    specs, nets, extra = [spec], [net], 0
    if isinstance(net, dict):   # multi-agent: each step may be any agent's; every policy and snapshot in a reply
        specs = list(spec.agent_specs.values())
        steps += config.envs_per_sim * len(spec.agents)   # a turn may end past the sample size
        nets = list(net.values()) * (1 + config.league)
        extra = 256                                       # agent and module ids
    request = 0
    for s in specs:
        leaves = s.obs.leaves
        obs_bytes = sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in leaves)
        request = max(request, rllink.episodes_body_bytes(steps, obs_bytes + extra, s.actions.action_size,
                                                          s.policy_outputs, len(leaves), nets[0].state_size))
    params = sum(math.prod(shape) for n in nets for shape in n.template.shapes.values())
    reply = rllink.set_state_body_bytes(4 * params + 4096 * len(nets))   # float32 weights and the graphs around them
    return {"request_ring_bytes": ring_bytes_for(8 + request, ShmServer.REQUEST_RING_BYTES),
            "reply_ring_bytes": ring_bytes_for(8 + reply, ShmServer.REPLY_RING_BYTES)}


def _terminate(signum, frame):
    raise SystemExit(128 + signum)


def progress_line(row: dict, n_returns: int) -> str:
    clients = " ".join(f"{c}={_k(n)}" for c, n in sorted(row["env_steps_by_client"].items(),
                                                        key=lambda kv: (len(kv[0]), kv[0])))
    return (f"update {row['update']:4d} | steps {row['env_steps']:8d} | {row['env_steps_per_s']:8.0f} steps/s | "
            f"return {row['return_mean']:7.1f} (n={n_returns}) | pi {row['pi_loss']:+.3f} "
            f"v {row['v_loss']:.3f} ent {row['entropy']:.3f} kl {row['approx_kl']:.4f} | "
            f"lag {row['policy_lag']:.1f} | {row['elapsed_s']:.1f}s | {clients}"
            + ("" if "return_by_agent" not in row else " | " + " ".join(
                f"{a}={r:.2f}" for a, r in sorted(row["return_by_agent"].items())))
            + ("" if len(row.get("return_by_policy", {})) < 2 else " | policies " + " ".join(
                f"{p}={r:.2f}" for p, r in sorted(row["return_by_policy"].items()))))


def _k(n: int) -> str:
    return f"{n / 1000:.1f}k" if n >= 1000 else str(n)


def counts(learner, supervisor) -> dict:
    """Where every env step went: received = trained + pending (waiting, or in an update
    that has not finished) + dropped (by reason); lost: stepped by simulators that died
    before sending them, never received. A frame that could not be decoded has no steps to
    count: it counts as a bad frame."""
    store = learner.store
    return {"env_steps": store.steps_received, "env_steps_trained": store.steps_trained,
            "env_steps_pending": store.pending_steps + store.in_flight,
            "env_steps_dropped": dict(store.steps_dropped),
            "env_steps_lost": store.steps_lost, "env_steps_by_client": dict(store.steps_by_conn),
            "bad_frames": sum(server.frames_rejected for server in learner.servers),
            "clients_timed_out": sum(server.clients_timed_out for server in learner.servers),
            "short_batches": learner.short_batches,
            "simulator_restarts": supervisor.restarts if supervisor else 0}


def policy_returns(learner) -> dict:
    """A multi-agent run's mean returns per policy and per agent (nothing for a single agent)."""
    store = learner.store
    if not hasattr(store, "policies"):
        return {}
    return {"return_by_policy": store.policy_return_means(), "return_by_agent": store.agent_return_means()}


def save_checkpoint(config: RunConfig, learner, ppo, keep: int) -> Path:
    from shmrl import checkpoint

    if isinstance(ppo, dict):   # multi-agent: every policy's state under policies/<id>/
        arrays, ppo_values = {}, {}
        for pid, p in ppo.items():
            a, ppo_values[pid] = p.get_state()
            stats = learner.store.policies[pid].reward_stats
            if stats is not None:
                a.update(stats.get_state("reward_stats"))
            arrays.update({f"policies/{pid}/{k}": v for k, v in a.items()})
    else:
        arrays, ppo_values = ppo.get_state()
    if learner.store.reward_stats is not None:
        arrays.update(learner.store.reward_stats.get_state("reward_stats"))
    return checkpoint.save(Path(config.logdir), learner.updates, arrays, keep=keep, state={
        "weights_seq_no": learner.weights_seq_no, "config": {**saved_config(config), "auth_token": None},
        "counters": learner.store.counters(), "ppo": ppo_values})


def train(config: RunConfig, t_start: float | None = None) -> tuple[int, dict]:
    """Run one training job; returns (exit status, summary). Whatever happens (Ctrl-C and
    SIGTERM included) every process it started is stopped, every segment it made is
    unlinked, and the summary and a checkpoint are written."""
    t_start = t_start if t_start is not None else time.time()
    validate(config)   # what can be checked before the env is made: nothing is started yet
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
    try:
        return _train(config, t_start, launcher)
    finally:
        if launcher is not None and launcher.owns_ray:
            launcher.ray.shutdown()


def _train(config: RunConfig, t_start: float, launcher) -> tuple[int, dict]:
    from shmrl.envs import env_spec
    from shmrl.learner import Learner
    from shmrl.metrics import MetricsLog, tensorboard_available
    from shmrl.supervisor import Supervisor
    from shmrl.transport.ring import ShmSpaceError

    spec = env_spec(config.env)
    config = resolve_config(config, spec)
    validate(config, spec)
    policy_specs = None
    if getattr(spec, "multiagent", False):
        from shmrl.multiagent import policy_mapper

        try:
            policy_specs = spec.policy_specs(policy_mapper(config.policy_map))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if config.stop_return is None:  # the env's threshold; without one, train to the step budget
        config.stop_return = spec.reward_threshold if spec.reward_threshold is not None else math.inf
    if config.logdir is None:
        name = "".join(c if c.isalnum() or c in "-_." else "_" for c in env_name(config.env))
        config.logdir = os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    logdir = Path(config.logdir)
    net = (policy_net(config, spec) if policy_specs is None
           else {pid: policy_net(config, s) for pid, s in policy_specs.items()})
    resumed = load_resume_checkpoint(config, net) if config.resume else None
    # The first policy is published and served before torch is imported (about 2 s):
    # the simulators start (their fork server loads numpy and onnxruntime) and sample
    # on one core while this process loads torch on the other.
    if resumed:
        path, arrays, state = resumed
        first_seq = state["weights_seq_no"] + 1
        first_policy = (saved_policy(arrays) if policy_specs is None
                        else {pid: saved_policy(arrays, pid) for pid in policy_specs})
    else:
        first_policy, first_seq = (net.initial_weights(config.seed) if policy_specs is None else
                                   {pid: n.initial_weights(config.seed + i) for i, (pid, n) in enumerate(net.items())}), 1
    if config.tensorboard is None:
        config.tensorboard = tensorboard_available()
    elif config.tensorboard and not tensorboard_available():
        raise ConfigError("--tensorboard needs the tensorboard package: pip install 'shmrl[tensorboard]'")
    try:
        servers, addresses, shm = open_transports(config, spec, net, launcher)
    except ShmSpaceError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_FAILED, {}
    try:  # the last thing that can refuse the run: nothing is written before it
        logdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        for server in servers:
            server.close()
        raise ConfigError(f"--logdir {logdir}: cannot create it: {e.strerror or e}") from None
    status, summary = EXIT_FAILED, {}
    learner = supervisor = ppo = metrics = error = None
    steps_at_start, t_learn = 0, time.time()
    try:
        if addresses:
            supervisor = Supervisor(addresses, env=config.env, seed=config.seed, envs_per_sim=config.envs_per_sim,
                                    auth_token=config.auth_token, shm_server=shm, hang_timeout=config.hang_timeout,
                                    nice=config.sim_nice, launcher=launcher, max_restarts=config.max_restarts,
                                    restart_window=config.restart_window)
        learner = Learner(spec, servers, initial_weights=first_policy,
                          policy=net.template if policy_specs is None else {p: n.template for p, n in net.items()},
                          policy_specs=policy_specs, league_size=config.league, league_every=config.league_every,
                          extra_config=None if policy_specs is None else {
                              "policy_map": config.policy_map, "league_prob": config.league_prob if config.league else 0.0},
                          env_steps_per_sample=config.env_steps_per_sample,
                          train_batch_size=config.train_batch_size,
                          on_policy=not config.async_sampling, max_policy_lag=config.max_policy_lag,
                          auth_token=config.auth_token, first_weights_seq_no=first_seq,
                          housekeeping=supervisor.check if supervisor else None,
                          reward_gamma=config.gamma if config.normalize_reward else None,
                          batch_wait_timeout=config.hang_timeout, window=config.return_window,
                          state_size=0 if policy_specs else net.state_size)
        store = learner.store
        if resumed:
            store.restore(state["counters"], arrays)
            learner.updates = state["update"]
            print(f"resuming from {path} (update {state['update']}, {store.steps_received} env steps, "
                  f"weights {first_seq - 1})", flush=True)
        steps_at_start, t_learn = store.steps_received, time.time()
        learner.start()
        launch_error: list = []

        def launch():
            try:
                supervisor.start_all()
            except BaseException as e:  # re-raised below, in the main thread
                launch_error.append(e)

        launcher = threading.Thread(target=launch, name="shmrl-launcher", daemon=True)
        if supervisor:
            launcher.start()
        import torch

        from shmrl.ppo import PPO

        # 0: every core, for strict on-policy runs whose update dominates (the simulators
        # wait through it, so the learner may take their cores).
        torch.set_num_threads(config.torch_threads or os.cpu_count() or 1)
        if policy_specs is None:
            ppo = PPO(net, config, seed=config.seed, initial_weights=first_policy)
            if resumed:
                ppo.set_state(arrays, state["ppo"])
        else:   # one PPO per policy
            ppo = {pid: PPO(n, config, seed=config.seed + i, initial_weights=first_policy[pid])
                   for i, (pid, n) in enumerate(net.items())}
            if resumed:
                for pid, p in ppo.items():
                    p.set_state(policy_arrays(arrays, pid), state["ppo"][pid])
        if supervisor:
            launcher.join()
        if launch_error:
            raise RunFailed(f"could not start the simulators: {launch_error[0]!r}")
        metrics = MetricsLog(logdir, append=bool(resumed), tensorboard=config.tensorboard)
        # A terminal gets a line per update; a log file one every 10 s (metrics.jsonl has all).
        log_every = config.log_every if config.log_every is not None else (0.0 if sys.stdout.isatty() else 10.0)
        last_line = -math.inf
        while True:
            batch = learner.next_batch(0.05)
            if supervisor and supervisor.failure:
                raise RunFailed(supervisor.failure)
            if learner.failure:
                raise RunFailed(f"the learner's serving thread failed: {learner.failure!r}")
            if len(store.returns) >= store.returns.maxlen and store.return_mean() >= config.stop_return:
                status = EXIT_SOLVED
                break
            if store.steps_received >= config.max_env_steps:
                status = EXIT_BUDGET
                break
            stats = learner.train(ppo, *batch, progress=store.steps_trained / config.max_env_steps) if batch else None
            if stats:
                now = time.time()
                row = {"update": stats["update"], "return_mean": store.return_mean(),
                       "episodes": store.episodes_completed,
                       "env_steps_per_s": (store.steps_received - steps_at_start) / max(now - t_learn, 1e-9),
                       **{k: stats[k] for k in ("pi_loss", "v_loss", "entropy", "approx_kl", "clip_frac",
                                               "train_s", "batch_steps", "weights_seq_no", "policy_lag",
                                               "lr", "reward_scale")},
                       **counts(learner, supervisor), "elapsed_s": now - t_start, **policy_returns(learner)}
                if "policies" in stats:   # a multi-agent update: each policy's losses, "<id>/pi_loss"
                    row["policies"] = {f"{pid}/{k}": v for pid, st in stats["policies"].items() for k, v in st.items()}
                if log_every == 0 or now - last_line >= log_every or stats["update"] == 1:
                    print(progress_line(row, len(store.returns)), flush=True)
                    last_line = now
                metrics.write(row)
                if config.checkpoint_every and learner.updates % config.checkpoint_every == 0:
                    save_checkpoint(config, learner, ppo, config.keep_checkpoints)
    except RunFailed as e:
        error = str(e)
        print(f"error: {e}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        status = EXIT_INTERRUPTED
    except SystemExit as e:  # SIGTERM (see _terminate)
        status = e.code if isinstance(e.code, int) else EXIT_FAILED
    finally:
        if learner is not None:
            learner.stop()   # from here on the store stands still
        if supervisor is not None:
            supervisor.stop()
        try:
            if learner is not None:
                wall = time.time() - t_start
                steps_here = learner.store.steps_received - steps_at_start
                summary = {"solved": status == EXIT_SOLVED, "exit_status": status, "error": error, "wall_s": wall,
                           "return_mean": learner.store.return_mean(), "episodes": learner.store.episodes_completed,
                           **counts(learner, supervisor),
                           "env_steps_per_s": steps_here / max(time.time() - t_learn, 1e-9),
                           "first_sample_s": (learner.store.first_steps_at - t_start
                                              if learner.store.first_steps_at else None),
                           "updates": learner.updates, "weights_seq_no": learner.weights_seq_no,
                           "simulator_recovery_s": supervisor.recovery_s if supervisor else [],
                           "resumed_from": str(resumed[0]) if resumed else None, "config": saved_config(config),
                           **policy_returns(learner)}
                if isinstance(learner.model_bytes, dict):   # multi-agent: policy-<id>.onnx each
                    for pid, model in learner.model_bytes.items():
                        (logdir / f"policy-{pid}.onnx").write_bytes(model)
                else:
                    (logdir / "policy.onnx").write_bytes(learner.model_bytes)
                if ppo is not None:
                    summary["checkpoint"] = str(save_checkpoint(config, learner, ppo, config.keep_checkpoints))
                (logdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
                verdict = {EXIT_SOLVED: "solved", EXIT_BUDGET: "step budget exhausted", EXIT_FAILED: "failed",
                           EXIT_INTERRUPTED: "interrupted"}.get(status, "terminated")
                print(f"{verdict}: return {summary['return_mean']:.1f} over the last {len(learner.store.returns)} "
                      f"episodes after {summary['env_steps']} env steps in {wall:.2f} s; wrote {logdir}",
                      flush=True)
        finally:
            if metrics:
                metrics.close()
            for server in servers:
                server.close()
    return status, summary


def build_parser(d: Config, spec=None) -> argparse.ArgumentParser:
    """The command line, with ``d`` as the defaults (a resumed run's are its saved
    configuration): one flag per setting of shmrl/config.py."""
    sources = " + ".join(preset_values(d.env, spec)[1])
    p = OneLineErrorParser(prog="python -m shmrl.run", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog=f"The defaults shown are those of --env {env_name(d.env)}: {sources}"
                                  + (f", saved by the run in {d.logdir}" if d.resume else ""))
    add_arguments(p, d)
    return p


def parse_args(argv=None) -> Config:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    # The defaults depend on the env (or on the run being resumed): find those first, so
    # that --help shows the ones that apply.
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--env", default=Config.env)
    pre.add_argument("--sims", type=int, default=Config.sims)
    pre.add_argument("--resume")
    known, _ = pre.parse_known_args(argv)
    from shmrl.envs import env_spec

    try:
        spec = env_spec(known.env)
    except ValueError as e:
        OneLineErrorParser(prog="python -m shmrl.run").error(str(e))
    defaults = resolve_config(Config(env=known.env, sims=known.sims), spec)
    if known.resume:
        from shmrl import checkpoint

        try:  # train() says which checkpoints it passed over, and why
            _, _, state, _ = checkpoint.load_latest(Path(known.resume))
        except checkpoint.CheckpointError as e:
            build_parser(defaults, spec).error(f"--resume {known.resume}: {e}")
        defaults = dataclasses.replace(config_from_saved(state.get("config", {})), logdir=known.resume)
    p = build_parser(defaults, spec)
    config = resolve_config(config_from_args(p.parse_args(argv)), spec)
    try:
        validate(config, spec)
    except ConfigError as e:
        p.error(str(e))
    if getattr(spec, "multiagent", False):
        from shmrl.multiagent import policy_mapper

        try:
            spec.policy_specs(policy_mapper(config.policy_map))
        except ValueError as e:
            p.error(str(e))
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
