"""Benchmarks of shmrl: sampling throughput, transport cost, time to solve, weight
synchronization latency, memory, the learner's update, and the time to solve against the
number of simulators.

    python tools/bench.py throughput [--sims 1 2 4 8 16 32] [--seconds 5] [--envs-per-sim 1] [--repeat 3] [--env ID]
    python tools/bench.py transport  [--steps 500] [--messages 200] [--repeat 3] [--env ID]
    python tools/bench.py solve      [--seeds 0 1 2 3 4] [--sims 8] [-- extra shmrl.run args]
    python tools/bench.py sync       [--sims 8] [--updates 50]
    python tools/bench.py memory     [--sims 8] [--repeat 1]
    python tools/bench.py update     [--nets NAME ...] [--repeat 5] [--threads 1] [--device cpu]
    python tools/bench.py scaling    [--envs ENV ...] [--sims 1 2 ...] [--seeds 0 1 2] [--plot PATH.png]
    python tools/bench.py SUBCOMMAND --quick --json    # seconds: small sizes, one short window

Every subcommand prints a table, or with ``--json`` one JSON object; both say what was
measured and how. The machine may be shared: figures are medians of repetitions, and
the load average before and after each run is reported with them. ``--quick`` only
checks that a subcommand works, in seconds (its figures are not ones to quote): it
changes the defaults to those in QUICK below, and flags given still win.

Every process started here is stopped, on failure too, and no ``shmrl_*`` file is left
in /dev/shm. Sampling parts never import torch (simulators never do; the learner's
torch would only take memory here).
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/bench.py`: run as tools.bench
    import run_as_module
    run_as_module.run(__file__)

# Only the standard library and numpy at module level (psutil where it is used): the fork
# server that starts the simulators imports this file as __mp_main__, and its children
# should carry no more than shmrl.run's simulators do.
import argparse
import json
import math
import os
import queue
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from tools.shared import (cpu_s, finished, interrupt_group, median, own_shm_files, percentile, popen_group,
                          print_method, process_tree, read_logdir, started, stop_process)
from tools.scaling_bench import QUICK as QUICK_SCALING, add_scaling_parser, print_scaling, scaling_bench
from tools.update_bench import QUICK as QUICK_UPDATE, add_update_parser, print_update, update_bench

ENV_ID = "CartPole-v1"         # the default --env of throughput and transport; the one of sync and memory
WAIT_S = 60.0                 # the longest any single wait may take before the bench gives up
HERE = Path(__file__).resolve()


# ---------------------------------------------------------------- small helpers

def run_policy(env: str = ENV_ID, envs_per_sim: int = 1, env_steps_per_sample: int = 256):
    """The env's spec, shmrl.run's configuration of it (its preset) and the policy network
    that shmrl.run publishes for it (numpy and the ONNX template only: no torch)."""
    from shmrl.envs.make import env_spec
    from shmrl.config.settings import Config, resolve_config
    from shmrl.trainer.setup import policy_net

    spec = env_spec(env)
    config = resolve_config(Config(env=env, envs_per_sim=envs_per_sim,
                                      env_steps_per_sample=env_steps_per_sample), spec)
    return spec, config, policy_net(config, spec)


def policy_text(env: str = ENV_ID) -> str:
    """What the bench's simulators run, for the method texts."""
    spec, config, net = run_policy(env)
    params = sum(math.prod(shape) for shape in net.template.shapes.values())
    images = [leaf.name for leaf in spec.obs.inputs if leaf.encoding == "image"]
    body = (f"{config.layers} x {config.hidden} {config.activation}" +
            (f" after a CNN (--cnn {config.cnn}) on {', '.join(images)}" if images else ""))
    return (f"shmrl.run's own {env} policy network ({body}, "
            f"{params:,} weights; PolicyNet.initial_weights, new seeds for new weights)")


def run_worker(args: list[str]) -> subprocess.Popen:
    """This file as a fresh interpreter (a hidden subcommand), stdout piped for its JSON."""
    return subprocess.Popen([sys.executable, str(HERE), *args], stdout=subprocess.PIPE, text=True)


def worker_result(proc: subprocess.Popen, timeout: float) -> dict:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_process(proc)
        raise TimeoutError(f"worker {proc.args[2]} gave no result within {timeout:.0f} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"worker {proc.args[2]} exited with code {proc.returncode}")
    return json.loads(out.strip().splitlines()[-1])


# ---------------------------------------------------------------- the pipeline

class Pipeline:
    """ShmServer + simulator processes started exactly as shmrl.run starts them, and a Hub
    with its EpisodeStore in this process. The learner here only drains: chunks are
    taken from the store and thrown away, nothing is trained."""

    def __init__(self, sims: int, *, env: str = ENV_ID, envs_per_sim: int = 1, env_steps_per_sample: int = 256,
                 on_policy: bool, seed: int = 0, weights: dict[str, np.ndarray] | None = None,
                 transport: str = "shm"):
        """``transport``: "shm" (rings) or "tcp-binary" (loopback TCP, the simulators
        agreeing on the binary codec as shmrl.run's do with --transport tcp)."""
        from shmrl.server.hub import Hub
        from shmrl.server.serving import heartbeat_period, ring_bytes
        from shmrl.server.store import DEFAULT_POLICY, EpisodeStore
        from shmrl.launch.supervisor import Supervisor
        from shmrl.transport.shm import ShmServer
        from shmrl.transport.tcp import TcpServer

        self.sims, self.seq, self.supervisor = sims, 0, None
        self.rng = np.random.default_rng(seed)
        spec, config, self.net = run_policy(env, envs_per_sim, env_steps_per_sample)
        if transport == "shm":
            self.server = ShmServer(sims, **ring_bytes(config, spec, {DEFAULT_POLICY: self.net}))  # as shmrl.run sizes them
            addresses = [f"shm:{self.server.address(i)}" for i in range(sims)]
        else:
            self.server = TcpServer("127.0.0.1", 0, heartbeat_s=heartbeat_period(config.hang_timeout),
                                    heartbeat_timeout=config.hang_timeout)
            addresses = [f"tcp:127.0.0.1:{self.server.address[1]}"] * sims
        try:
            self.store = EpisodeStore()
            self.hub = Hub({DEFAULT_POLICY: spec}, self.store, env_steps_per_sample, on_policy)
            self.publish(weights)  # before any simulator asks: GET_STATE needs a state
            self.supervisor = Supervisor(addresses, env=env, seed=seed, envs_per_sim=envs_per_sim,
                                         nice=config.sim_nice)
            self.transport = transport
            self.supervisor.start_all()
            self.procs = [sim.proc for sim in self.supervisor.sims]
        except BaseException:
            self.close()
            raise
        self._next_alive_check = 0.0

    def new_weights(self) -> dict[str, np.ndarray]:
        """Weights the network has not had: its initial ones, of a new seed."""
        return self.net.initial_weights(int(self.rng.integers(2 ** 31)))

    def publish(self, weights: dict[str, np.ndarray] | None = None) -> int:
        """What the learner does after an update: patch the weights into the ONNX graph,
        gzip+base64 it, hand it to the Hub (which releases waiting simulators)."""
        from shmrl.onnxio.policy import encode_onnx_file
        from shmrl.server.store import DEFAULT_POLICY

        weights = weights if weights is not None else self.new_weights()
        t0 = time.perf_counter()
        self.model_bytes = self.net.template.publish(weights)
        t1 = time.perf_counter()
        onnx_file = encode_onnx_file(self.model_bytes)
        t2 = time.perf_counter()
        self.seq += 1
        self.hub.set_state(self.seq, {DEFAULT_POLICY: {"onnx_file": onnx_file, "weights_seq_no": self.seq}})
        # Where a publish spends its time: patch+serialize, gzip+base64, SET_STATE to every ring.
        self.publish_parts = {"onnx": t1 - t0, "encode": t2 - t1, "set_state": time.perf_counter() - t2}
        return self.seq

    def poll(self, timeout: float) -> list[tuple[str, dict]]:
        """Handle every request that arrives within ``timeout``; returns them."""
        msgs = self.server.poll(timeout)
        for conn_id, msg in msgs:
            self.hub.handle(self.server, conn_id, msg)
        self.store.take()  # drain: the bench does not train
        self._check_alive()
        return msgs

    def _check_alive(self) -> None:
        now = time.monotonic()
        if now < self._next_alive_check:
            return
        self._next_alive_check = now + 0.2  # waitpid per simulator: not on every message
        dead = [p for p in self.procs if not p.is_alive()]
        if dead:
            raise RuntimeError(", ".join(f"simulator {p.name} exited with code {p.exitcode}" for p in dead))

    def run_until(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{what}: not within {timeout:.0f} s")
            self.poll(min(left, 0.05))

    def run_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            self.poll(min(left, 0.05))

    def close(self) -> None:
        try:
            if self.supervisor is not None:
                self.supervisor.stop()
        finally:
            self.server.close()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def stop_fork_server(timeout: float = 5.0) -> None:
    """The fork server and resource tracker that multiprocess started for the simulators
    would end with this process anyway (EOF on their pipes); end them now and reap them.
    Their _stop() waits without a timeout, so it runs in a thread we can give up on."""
    fs = sys.modules.get("multiprocess.forkserver")
    rt = sys.modules.get("multiprocess.resource_tracker")
    helpers = []  # private API of multiprocess; checked before use
    if fs is not None and getattr(fs._forkserver, "_forkserver_pid", None) is not None:
        helpers.append((fs._forkserver._stop, fs._forkserver._forkserver_pid))
    if rt is not None and getattr(rt._resource_tracker, "_pid", None) is not None:
        helpers.append((rt._resource_tracker._stop, rt._resource_tracker._pid))
    for stop, pid in helpers:  # the fork server first: it uses the tracker
        t = threading.Thread(target=stop, name="bench-stop-helper", daemon=True)
        t.start()
        t.join(timeout)
        if t.is_alive():
            print(f"warning: helper process {pid} did not stop in {timeout:g} s; killing it", file=sys.stderr)
            os.kill(pid, signal.SIGKILL)
            t.join(timeout)


# ---------------------------------------------------------------- throughput

def throughput(args) -> dict:
    result = started(
        "throughput",
        f"Pipeline: ShmServer(n) (--transport shm) or a loopback TcpServer whose clients agree on "
        f"the binary codec (tcp-binary) + n simulators started by shmrl.launch.supervisor.Supervisor (forkserver), "
        f"{args.env} with {policy_text(args.env)} as ONNX; in this process a Hub with "
        f"on_policy=False answers each EPISODES_AND_GET_STATE at once and the chunks are "
        f"drained (no training). Env steps received per second: after every simulator has sent "
        f"episodes and a {args.warmup:g} s warm-up, --seconds {args.seconds:g} of measurement split "
        f"into --repeat {args.repeat} consecutive windows; the figure is the median window. "
        f"In-process limit: the same env + OnnxPolicy + shmrl.sim's sampler in a plain loop "
        f"(no episode recording, no transport), one process per core, windows on a common "
        f"clock, rates summed per window, median window. CPU use (psutil's cpu_times, process_time) "
        f"is measured in the same windows: steps per cpu-second discounts the time the bench's "
        f"processes lost to other processes (not contention on the host or in caches).",
        sims=args.sims, seconds=args.seconds, warmup=args.warmup, repeat=args.repeat,
        envs_per_sim=args.envs_per_sim, env_steps_per_sample=args.env_steps_per_sample, env=args.env,
        transport=args.transport)
    weights = run_policy(args.env)[2].initial_weights(0)
    result["limit"] = in_process_limit(weights, args)
    limit = result["limit"]["steps_per_s"]
    rows = []
    for n in args.sims:
        for transport in args.transport:  # side by side, per sims count
            row = pipeline_throughput(n, weights, args, transport)
            row["ratio_to_limit"] = row["steps_per_s"] / limit
            row["cpu_efficiency"] = row["steps_per_cpu_s"] / result["limit"]["steps_per_cpu_s"]
            rows.append(row)
            if not args.json:
                print(f"  measured {n} sims over {transport}: {row['steps_per_s']:,.0f} steps/s",
                      file=sys.stderr, flush=True)
    result["pipeline"] = rows
    best = max(rows, key=lambda r: r["steps_per_s"])
    result["best"] = {"sims": best["sims"], "transport": best["transport"], "steps_per_s": best["steps_per_s"],
                      "ratio_to_limit": best["ratio_to_limit"]}
    if set(args.transport) >= {"shm", "tcp-binary"}:  # TCP against shared memory, per sims count
        rate = {(r["sims"], r["transport"]): r["steps_per_s"] for r in rows}
        result["tcp_binary_to_shm"] = {n: rate[n, "tcp-binary"] / rate[n, "shm"] for n in args.sims}
    return finished(result)


def pipeline_throughput(n: int, weights, args, transport: str = "shm") -> dict:
    t0 = time.monotonic()
    with Pipeline(n, env=args.env, envs_per_sim=args.envs_per_sim, env_steps_per_sample=args.env_steps_per_sample,
                  on_policy=False, weights=weights, transport=transport) as p:
        p.run_until(lambda: len(p.store.steps_by_conn) == n, WAIT_S, f"{n} simulators sending episodes")
        ready_s = time.monotonic() - t0
        p.run_for(args.warmup)
        rates, learner_cpu, sims_cpu = [], [], []
        window = args.seconds / args.repeat
        pids = [proc.pid for proc in p.procs]
        for _ in range(args.repeat):
            s0, w0, l0, c0 = p.store.steps_received, time.monotonic(), time.process_time(), cpu_s(pids)
            p.run_for(window)
            wall = time.monotonic() - w0
            rates.append((p.store.steps_received - s0) / wall)
            learner_cpu.append((time.process_time() - l0) / wall)
            sims_cpu.append((cpu_s(pids) - c0) / wall)
    # Where the cores went: the learner's share, and what the simulators make of theirs.
    return {"sims": n, "transport": transport, "steps_per_s": median(rates), "windows": rates, "ready_s": ready_s,
            "learner_cpu_cores": median(learner_cpu), "sims_cpu_cores": median(sims_cpu),
            "steps_per_sim_cpu_s": median(r / c for r, c in zip(rates, sims_cpu) if c > 0),
            "steps_per_cpu_s": median(r / (c + l) for r, c, l in zip(rates, sims_cpu, learner_cpu))}


def in_process_limit(weights, args) -> dict:
    """Sum of env steps/s of one plain sampling loop per core, measured in the same windows."""
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="shmrl-bench-") as tmp:
        model = Path(tmp) / "policy.onnx"
        model.write_bytes(run_policy(args.env)[2].template.publish(weights))
        start_at = time.time() + 2.0  # time for every worker to import numpy and onnxruntime
        common = ["--model", str(model), "--start-at", repr(start_at), "--warmup", str(args.warmup),
                  "--seconds", str(args.seconds), "--windows", str(args.repeat),
                  "--envs-per-sim", str(args.envs_per_sim), "--env", args.env]
        timeout = 2.0 + args.warmup + args.seconds + WAIT_S
        workers = [run_worker(["_limit-worker", "--seed", str(i), *common]) for i in range(cores)]
        try:
            outs = [worker_result(w, timeout) for w in workers]
        finally:
            for w in workers:
                stop_process(w)
    late = [o for o in outs if o["late"]]
    if late:
        print(f"warning: {len(late)} limit worker(s) were not ready at the common start", file=sys.stderr)
    sums = [sum(o["windows"][k]["steps"] / o["windows"][k]["wall_s"] for o in outs)
            for k in range(args.repeat)]
    # Steps per CPU second discount the time lost to other processes on a shared machine.
    per_cpu = [sum(o["windows"][k]["steps"] for o in outs) / sum(o["windows"][k]["cpu_s"] for o in outs)
               for k in range(args.repeat)]
    return {"processes": cores, "steps_per_s": median(sums), "windows": sums,
            "per_process": [median(w["steps"] / w["wall_s"] for w in o["windows"]) for o in outs],
            "steps_per_cpu_s": median(per_cpu)}


def limit_worker(args) -> int:
    """Hidden: the in-process loop of one core. Mirrors shmrl.sim's stepping (the same
    vectorized envs, policy and sampler), minus the recording and the transport."""
    from shmrl.envs.make import env_spec, make_vec_env
    from shmrl.onnxio.policy import OnnxPolicy
    from shmrl.client.simulator import make_sampler

    k = args.envs_per_sim
    policy = OnnxPolicy(Path(args.model).read_bytes())
    sampler = make_sampler(env_spec(args.env), np.random.default_rng(args.seed))
    envs = make_vec_env(args.env, k, args.seed * 1_000_003)
    obs = envs.reset()
    late = time.time() > args.start_at
    window = args.seconds / args.windows
    # Boundaries on the wall clock that every worker shares, so that their rates add up.
    bounds = [args.start_at + args.warmup + i * window for i in range(args.windows + 1)]
    counts, steps, b = [], 0, 0
    while b < len(bounds):
        for _ in range(16):  # a clock read per 16 steps is noise next to ~50 us per step
            actions, _ = sampler.sample(policy.logits(obs))
            obs = envs.step(actions)[0]
            steps += k
        now = time.time()
        if now >= bounds[b]:
            counts.append((steps, now, time.process_time()))
            b += 1
    windows = [{"steps": s1 - s0, "wall_s": t1 - t0, "cpu_s": c1 - c0}
               for (s0, t0, c0), (s1, t1, c1) in zip(counts, counts[1:])]
    print(json.dumps({"windows": windows, "late": late}))
    return 0


def print_throughput(r: dict) -> None:
    p = r["params"]
    lim = r["limit"]
    print(f"throughput: env steps/s received by a draining learner, {p['env']}, "
          f"envs/sim {p['envs_per_sim']}, {p['env_steps_per_sample']} steps/message")
    print(f"  windows: {p['seconds']:g} s after a {p['warmup']:g} s warm-up, split in {p['repeat']}; "
          f"figure = median window")
    print(f"  in-process limit ({lim['processes']} plain loops, no transport): "
          f"{lim['steps_per_s']:,.0f} steps/s  (windows {_ints(lim['windows'])}; "
          f"per process {_ints(lim['per_process'])}); {lim['steps_per_cpu_s']:,.0f} steps per cpu-s")
    print(f"  {'sims':>5} | {'transport':>10} | {'steps/s':>9} | {'pipeline/limit':>14} | {'learner cpu':>11} | "
          f"{'sims cpu':>8} | {'steps/sim-cpu-s':>15} | {'cpu efficiency':>14} | {'ready s':>7} | windows")
    for row in r["pipeline"]:
        print(f"  {row['sims']:>5} | {row['transport']:>10} | {row['steps_per_s']:>9,.0f} | "
              f"{row['ratio_to_limit']:>14.2f} | "
              f"{row['learner_cpu_cores']:>11.2f} | {row['sims_cpu_cores']:>8.2f} | "
              f"{row['steps_per_sim_cpu_s']:>15,.0f} | {row['cpu_efficiency']:>14.2f} | "
              f"{row['ready_s']:>7.2f} | {_ints(row['windows'])}")
    print("  (cpu: cores used, median of the windows; cpu efficiency: steps per cpu-s of simulators "
          "+ learner over the limit's steps per cpu-s, blind to time lost to other processes; "
          "ready s: from creating the rings to every simulator's first episodes)")
    b = r["best"]
    print(f"  best: {b['sims']} sims over {b['transport']}, {b['steps_per_s']:,.0f} steps/s = "
          f"{b['ratio_to_limit']:.2f} of the limit")
    for n, ratio in r.get("tcp_binary_to_shm", {}).items():
        print(f"  {n} sims: tcp-binary / shm = {ratio:.2f}")


def _ints(xs) -> str:
    return " ".join(f"{x:,.0f}" for x in xs)


# ---------------------------------------------------------------- transport

VARIANTS = ("shm-binary", "shm-json", "tcp-binary", "tcp-json")


def transport(args) -> dict:
    from shmrl import rllink
    from shmrl.transport.shm import ShmServer
    from shmrl.transport.tcp import TcpServer

    result = started(
        "transport",
        f"One client process (a fresh interpreter) sends EPISODES_AND_GET_STATE messages, each "
        f"one {args.steps}-step " + (f"chunk of {args.env}'s own observations (recorded with random actions, "
                                     f"stored dtypes: uint8 images stay uint8)" if args.env else
                                     "CartPole-shaped episode of pre-built numpy arrays") + ", and times "
        f"client.request() (encode, transfer, server poll: decode + validate, a small SET_STATE "
        f"reply, client decode). The servers (ShmServer with a binary and a JSON client slot, "
        f"TcpServer with a client that negotiated the binary codec in its PING and one that "
        f"did not, as RLlib's) run in this process. Per repetition and variant: {args.warmup} untimed "
        f"messages, then --messages {args.messages} timed; us/step = median round trip / steps; "
        f"the figure is the median over --repeat {args.repeat} repetitions (variants interleaved).",
        steps=args.steps, messages=args.messages, repeat=args.repeat, warmup=args.warmup, env=args.env)
    msg = transport_message(args.steps, env=args.env)
    sizes = {"binary": len(rllink.encode_binary(msg)), "json": len(rllink.encode_json(msg))}
    # The request ring must hold a whole frame (at most about half the ring): size it to fit.
    ring = 1 << max(20, (4 * (sizes["json"] + 64)).bit_length())
    shm = ShmServer(2, request_ring_bytes=ring)
    tcp = client = None
    try:
        # No heartbeats are sent, and a client idles (before its first request too) while the
        # other variants run: minutes with big JSON messages.
        tcp = TcpServer("127.0.0.1", 0, max_frame_bytes=ring, heartbeat_s=3600, heartbeat_timeout=7200,
                        hello_timeout=10 * WAIT_S)
        host, port = tcp.address
        client = run_worker(["_transport-client", "--shm-binary", shm.address(0), "--shm-json",
                             shm.address(1), "--tcp", f"{host}:{port}", "--steps", str(args.steps),
                             "--messages", str(args.messages), "--repeat", str(args.repeat),
                             "--warmup", str(args.warmup), *(["--env", args.env] if args.env else [])])
        served = serve_transport(client, [shm, tcp], args.steps)
        out = worker_result(client, WAIT_S)
    finally:
        if client is not None:
            stop_process(client)
        if tcp is not None:
            tcp.close()
        shm.close()
    per_step = {v: median(out["rtt_s"][v]) / args.steps * 1e6 for v in VARIANTS}
    result["variants"] = {
        v: {"us_per_step": per_step[v], "rtt_ms": median(out["rtt_s"][v]) * 1e3,
            "repeats_us_per_step": [x / args.steps * 1e6 for x in out["rtt_s"][v]],
            "client_encode_us_per_step": out["encode_s"][codec_of(v)] / args.steps * 1e6,
            "body_bytes": sizes[codec_of(v)],
            # Per byte, so that image frames compare with float columns: round trip / body size.
            "ns_per_body_byte": median(out["rtt_s"][v]) / sizes[codec_of(v)] * 1e9}
        for v in VARIANTS}
    result["ratios"] = {"tcp-json/shm-binary": per_step["tcp-json"] / per_step["shm-binary"],
                        "shm-json/shm-binary": per_step["shm-json"] / per_step["shm-binary"],
                        "tcp-json/tcp-binary": per_step["tcp-json"] / per_step["tcp-binary"],
                        "tcp-binary/shm-binary": per_step["tcp-binary"] / per_step["shm-binary"]}
    result["messages_served"] = served
    return finished(result)


def codec_of(variant: str) -> str:
    return variant.rsplit("-", 1)[1]


def transport_message(steps: int, seq: int = 1, env: str | None = None) -> dict:
    """EPISODES_AND_GET_STATE with one chunk, as shmrl.sim would send it: CartPole-shaped
    synthetic arrays, or ``env``'s own observations (recorded with random actions)."""
    if env is not None:
        return recorded_message(env, steps, seq)
    rng = np.random.default_rng(0)
    logits = rng.normal(0.0, 0.01, (steps, 2)).astype(np.float32)
    actions = rng.integers(0, 2, steps)
    logp = logits[np.arange(steps), actions] - np.log(np.exp(logits).sum(axis=1))
    episode = {"obs": rng.normal(0.0, 0.05, (steps + 1, 4)).astype(np.float32),
               "actions": actions.astype(np.int64),
               "rewards": np.ones(steps, np.float32),  # CartPole's: all 1.0
               "action_dist_inputs": logits, "action_logp": logp.astype(np.float32),
               "is_terminated": True, "is_truncated": False,
               "episode_id": "bench-0", "weights_seq_no": seq}
    from shmrl.core.episode import EpisodeBatch

    return {"type": "EPISODES_AND_GET_STATE", "episodes": EpisodeBatch.from_episodes([episode]),
            "timesteps": steps}


def recorded_message(env: str, steps: int, seq: int) -> dict:
    """One ``steps``-step chunk of ``env``'s observations in its stored form (uint8 images stay
    uint8), actions from shmrl's sampler on flat distribution inputs. Episode ends inside the
    chunk are ignored: it is the bytes per step that are measured."""
    from shmrl.envs.make import env_spec, make_vec_env
    from shmrl.core.episode import EpisodeBatch
    from shmrl.client.simulator import make_sampler

    spec = env_spec(env)
    envs = make_vec_env(env, 1, 0)
    sampler = make_sampler(spec, np.random.default_rng(0))
    dist_inputs = np.zeros((1, spec.policy_outputs), np.float32)
    obs, actions, logps = [envs.reset()], [], []
    for _ in range(steps):
        action, logp = sampler.sample(dist_inputs)
        obs.append(envs.step(action)[0])
        actions.append(action)
        logps.append(logp)
    if isinstance(obs[0], dict):
        obs = {name: np.concatenate([o[name] for o in obs]) for name in obs[0]}
    else:
        obs = np.concatenate(obs)
    episode = {"obs": obs, "actions": np.concatenate(actions), "rewards": np.zeros(steps, np.float32),
               "action_dist_inputs": np.repeat(dist_inputs, steps, axis=0),
               "action_logp": np.concatenate(logps).astype(np.float32),
               "is_terminated": True, "is_truncated": False, "episode_id": "bench-0", "weights_seq_no": seq}
    return {"type": "EPISODES_AND_GET_STATE", "episodes": EpisodeBatch.from_episodes([episode]),
            "timesteps": steps}


def serve_transport(client: subprocess.Popen, servers: list, steps: int) -> int:
    """Answer every request with a small SET_STATE until the client exits."""
    reply = {"type": "SET_STATE", "onnx_file": "", "weights_seq_no": 1}
    sel = selectors.DefaultSelector()
    for s in servers:
        sel.register(s.fileno(), selectors.EVENT_READ, s)
    served, deadline = 0, time.monotonic() + 10 * WAIT_S
    try:
        while client.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"transport client still running after {10 * WAIT_S:.0f} s")
            for key, _ in sel.select(0.1):
                server = key.data
                for conn_id, msg in server.poll(0.0):
                    if msg is None:
                        continue  # a client left (the end of a variant)
                    if msg["type"] == "PING":  # a TCP client's handshake: the codec is agreed here
                        server.reply(conn_id, {"type": "PONG"})
                        continue
                    if msg["timesteps"] != steps:
                        raise RuntimeError(f"{conn_id}: {msg['timesteps']} steps, expected {steps}")
                    server.reply(conn_id, reply)
                    served += 1
    finally:
        sel.close()
    return served


def transport_client(args) -> int:
    """Hidden: the client side of ``transport``. Prints per-variant, per-repetition medians."""
    from shmrl import rllink
    from shmrl.transport.shm import ShmClient
    from shmrl.transport.tcp_client import TcpClient, parse_address

    msg = transport_message(args.steps, env=args.env)
    clients = {"shm-binary": ShmClient(args.shm_binary, codec="binary", timeout=WAIT_S),
               "shm-json": ShmClient(args.shm_json, codec="json", timeout=WAIT_S),
               "tcp-binary": TcpClient(*parse_address(args.tcp), timeout=WAIT_S, codec="binary"),
               "tcp-json": TcpClient(*parse_address(args.tcp), timeout=WAIT_S, codec="json")}
    rtt = {v: [] for v in VARIANTS}
    try:
        for v in ("tcp-binary", "tcp-json"):
            clients[v].request({"type": "PING"})
        if clients["tcp-binary"].codec != "binary":
            raise RuntimeError("the TCP server did not agree to the binary codec")
        for r in range(args.repeat):
            # Rotate the order so that no variant always runs first (or right after another).
            k = r % len(VARIANTS)
            for v in VARIANTS[k:] + VARIANTS[:k]:
                times = []
                for i in range(args.warmup + args.messages):
                    t0 = time.perf_counter()
                    reply = clients[v].request(msg)
                    if i >= args.warmup:
                        times.append(time.perf_counter() - t0)
                    assert reply["type"] == "SET_STATE"
                rtt[v].append(median(times))
    finally:
        for c in clients.values():
            c.close()
    encode = {}
    for name, codec in (("binary", rllink.encode_binary), ("json", rllink.encode_json)):
        times = []  # what the client alone spends encoding, for the breakdown
        for _ in range(50):
            t0 = time.perf_counter()
            codec(msg)
            times.append(time.perf_counter() - t0)
        encode[name] = median(times)
    print(json.dumps({"rtt_s": rtt, "encode_s": encode}))
    return 0


def print_transport(r: dict) -> None:
    p = r["params"]
    print(f"transport: cost per env step of one EPISODES_AND_GET_STATE round trip "
          f"({p['steps']}-step episode of {p.get('env') or 'CartPole-shaped arrays'} per message, "
          f"{p['messages']} messages x {p['repeat']} repetitions)")
    print(f"  {'variant':<11} | {'us/step':>8} | {'RTT ms':>7} | {'client encode us/step':>21} | "
          f"{'body bytes':>10} | {'ns/byte':>7} | repetitions (us/step)")
    for v, x in r["variants"].items():
        print(f"  {v:<11} | {x['us_per_step']:>8.2f} | {x['rtt_ms']:>7.3f} | "
              f"{x['client_encode_us_per_step']:>21.2f} | {x['body_bytes']:>10,} | {x['ns_per_body_byte']:>7.3f} | "
              f"{' '.join(f'{y:.2f}' for y in x['repeats_us_per_step'])}")
    for k, v in r["ratios"].items():
        print(f"  {k}: {v:.1f}x")


# ---------------------------------------------------------------- solve

def solve_bench(args) -> dict:
    from tools.solve import solve  # one timed `python -m shmrl.run` per seed

    command = " ".join(["python -m shmrl.run", "--sims", str(args.sims), "--seed S --logdir TMP", *args.extra])
    result = started(
        "solve",
        f"tools/solve.py's solve(): `{command}` per seed; wall time from launch to exit (bench "
        f"clock), env steps from summary.json; median over seeds.",
        seeds=args.seeds, sims=args.sims, extra=args.extra, timeout=args.timeout)
    runs = []
    for seed in args.seeds:
        r = solve(seed, args.sims, args.extra, args.timeout)  # past the timeout: stopped, not solved
        runs.append(r)
        if not args.json:
            print(f"  seed {seed}: {'solved' if r['solved'] else 'NOT solved'} in {r['wall_s']:.2f} s",
                  file=sys.stderr, flush=True)
    result["runs"] = runs
    result["median_wall_s"] = median(r["wall_s"] for r in runs)
    steps = [r["env_steps"] for r in runs if r["env_steps"] is not None]
    result["median_env_steps"] = median(steps) if steps else None
    result["all_solved"] = all(r["solved"] for r in runs)
    return finished(result)


def print_solve(r: dict) -> None:
    p = r["params"]
    command = " ".join(["python -m shmrl.run --sims", str(p["sims"]), *p["extra"]])
    print(f"solve: wall time of `{command}` from launch to exit, per seed")
    print(f"  {'seed':>4} | {'result':<10} | {'wall s':>7} | {'env steps':>9} | return")
    for x in r["runs"]:
        ret = "n/a" if x["return_mean"] is None else f"{x['return_mean']:.1f}"
        print(f"  {x['seed']:>4} | {'solved' if x['solved'] else 'NOT solved':<10} | {x['wall_s']:>7.2f} | "
              f"{x['env_steps'] if x['env_steps'] is not None else 'n/a':>9} | {ret}")
    steps = r["median_env_steps"]
    print(f"  median {r['median_wall_s']:.2f} s, {steps if steps is None else f'{steps:.0f}'} env steps; "
          f"all solved: {r['all_solved']}")


# ---------------------------------------------------------------- sync

def sync(args) -> dict:
    from shmrl.onnxio.policy import OnnxPolicy, decode_onnx_file

    result = started(
        "sync",
        f"Pipeline as in throughput ({policy_text()}), but the Hub in on-policy mode (on_policy=True: each "
        f"EPISODES_AND_GET_STATE waits for the next weights) and env_steps_per_sample=1. Once all "
        f"{args.sims} simulators wait, a publish: new weights -> ModelTemplate.publish -> "
        f"encode_onnx_file -> hub.set_state (writes SET_STATE to every reply ring). Latency: from "
        f"the start of the publish until every simulator's next message, whose episodes carry the "
        f"new weights_seq_no, has been received; it includes one env step and one ONNX call per "
        f"simulator (tens of us) besides decoding and installing the model. "
        f"{args.warmup} untimed publishes, then --updates {args.updates}; median and p90.",
        sims=args.sims, updates=args.updates, warmup=args.warmup)
    all_in, first_in, publish = [], [], []
    parts: dict[str, list] = {"onnx": [], "encode": [], "set_state": []}
    with Pipeline(args.sims, env_steps_per_sample=1, on_policy=True) as p:
        everyone_waits = lambda: len(p.hub.sampling) == args.sims and p.hub.all_waiting()  # noqa: E731
        p.run_until(everyone_waits, WAIT_S, f"{args.sims} simulators waiting for weights")
        for u in range(args.warmup + args.updates):
            weights = p.new_weights()  # drawn before the clock starts, as a trained update has them
            t0 = time.perf_counter()
            seq = p.publish(weights)
            t_published = time.perf_counter() - t0
            arrived = wait_for_version(p, seq, t0)
            if u >= args.warmup:
                publish.append(t_published)
                for k, v in p.publish_parts.items():
                    parts[k].append(v)
                all_in.append(max(arrived.values()))
                first_in.append(min(arrived.values()))
            p.run_until(everyone_waits, WAIT_S, "simulators waiting again")
        onnx_file = p.hub.state_msg["onnx_file"]
    # What one simulator spends installing a model, timed here alone (same code, one process).
    install = []
    for _ in range(20):
        t0 = time.perf_counter()
        OnnxPolicy(decode_onnx_file(onnx_file))
        install.append(time.perf_counter() - t0)
    ms = lambda xs: {"median": median(xs) * 1e3, "p90": percentile(xs, 90) * 1e3}  # noqa: E731
    result["all_simulators_ms"] = ms(all_in)
    result["first_simulator_ms"] = ms(first_in)
    result["publish_ms"] = ms(publish)
    result["publish_parts_ms"] = {k: ms(v) for k, v in parts.items()}
    result["install_alone_ms"] = ms(install)
    result["onnx_file_bytes"] = len(onnx_file)
    return finished(result)


def wait_for_version(p: Pipeline, seq: int, t0: float) -> dict[str, float]:
    """Seconds from ``t0`` until each simulator's first message sampled with version ``seq``."""
    arrived: dict[str, float] = {}
    deadline = time.monotonic() + WAIT_S
    while len(arrived) < p.sims:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(arrived)} of {p.sims} simulators ran version {seq} "
                               f"within {WAIT_S:.0f} s")
        for conn_id, msg in p.poll(0.05):
            if msg is None or msg["type"] != "EPISODES_AND_GET_STATE" or not msg["episodes"].num_chunks:
                continue
            if (msg["episodes"].weights_seq_no == seq).all():
                arrived.setdefault(conn_id, time.perf_counter() - t0)
    return arrived


def print_sync(r: dict) -> None:
    p = r["params"]
    f = lambda x: f"median {x['median']:7.2f} ms, p90 {x['p90']:7.2f} ms"  # noqa: E731
    print(f"sync: weight publication until the simulators sample with it, {p['sims']} simulators, "
          f"{p['updates']} publishes, env_steps_per_sample=1")
    print(f"  every simulator's next message in : {f(r['all_simulators_ms'])}")
    print(f"  first simulator's next message in : {f(r['first_simulator_ms'])}")
    print(f"  of which publish+encode+set_state : {f(r['publish_ms'])}")
    names = {"onnx": "ModelTemplate.publish", "encode": "encode_onnx_file", "set_state": "hub.set_state"}
    for k, x in r["publish_parts_ms"].items():
        print(f"    {names[k]:<31} : {f(x)}")
    print(f"  one model install alone (decode + onnxruntime session): {f(r['install_alone_ms'])}; "
          f"onnx_file {r['onnx_file_bytes']:,} bytes")
    print("  (latency counts from the start of the publish to the arrival of each simulator's "
          "message tagged with the new weights_seq_no; one env step included)")


# ---------------------------------------------------------------- memory

def memory(args) -> dict:
    result = started(
        "memory",
        f"`python -m shmrl.run --sims {args.sims} --max-env-steps 10000000 --stop-return 1e9 --logdir TMP` "
        f"in its own process group; when it prints 'update    3 |', the memory of the learner and "
        f"every descendant (psutil: children, memory_full_info from /proc/PID/smaps_rollup); then SIGINT to "
        f"the group. PSS (proportional set size, the headline): each resident page divided by the "
        f"number of processes that map it (shared libraries, the pages the forked simulators share "
        f"with their fork server, the shared-memory rings), so the PSS of all processes adds up to "
        f"the memory the run really occupies. USS (unique set size, Private_Clean + Private_Dirty): "
        f"pages mapped by that process alone, about what its exit would give back; what one more "
        f"simulator costs is near its USS. RSS (/proc/PID/statm, as VmRSS): every resident page the "
        f"process maps, shared ones whole, so summed over processes it counts each shared library "
        f"once per process: kept beside for comparison only. Per role (learner, simulators, fork "
        f"server, resource tracker): the sum over its processes and, per process, the median. "
        f"First sample: seconds from the run's process start until its learner received the first "
        f"env steps (summary.json first_sample_s). Start-up: seconds from launch to the first "
        f"progress line ('update    1 |'), which comes after the first batch (the default train "
        f"batch, shared by the {args.sims} simulators) has arrived and one PPO update; the update's "
        f"own train_s (metrics.jsonl) is reported to subtract. The start-up's split, in seconds from the "
        f"run's process start (summary.json): torch's import, in a thread of its own beside the simulators' "
        f"start, started (torch_import_started_s) and ended (torch_import_ended_s), how long the "
        f"run waited for it before its first update (torch_import_waited_s: the import's cost on the "
        f"critical path), the first env steps received (first_sample_s) and the first update done "
        f"(metrics.jsonl's first elapsed_s). Figures are medians over --repeat "
        f"{args.repeat} runs; the process table is the first run's.",
        sims=args.sims, repeat=args.repeat)
    runs = [memory_run(args.sims) for _ in range(args.repeat)]
    result["processes"] = runs[0]["processes"]
    result["runs"] = [{k: v for k, v in r.items() if k != "processes"} for r in runs]
    for key in ("pss_total_mib", "uss_total_mib", "rss_total_mib", "first_progress_s",
                "first_update_train_s", *START_UP_SPLIT):
        values = [r[key] for r in runs if r[key] is not None]
        result[key] = median(values) if values else None
    result["by_role"] = {}
    for role in runs[0]["by_role"]:  # the same roles in every run
        rows = [r["by_role"][role] for r in runs if role in r["by_role"]]
        result["by_role"][role] = {k: median(x[k] for x in rows) for k in rows[0]}
        result["by_role"][role]["processes"] = rows[0]["processes"]
    sims = result["by_role"].get("simulator")
    result["per_simulator_mib"] = ({m: sims[f"{m}_per_process_mib"] for m in ("pss", "uss", "rss")}
                                   if sims else None)
    return finished(result)


# The start-up's split (seconds from the run's process start), in the order they happen.
START_UP_SPLIT = ("torch_import_started_s", "first_sample_s", "torch_import_ended_s", "first_update_elapsed_s",
                  "torch_import_waited_s")


def memory_run(sims: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="shmrl-bench-") as logdir:
        cmd = [sys.executable, "-m", "shmrl.run", "--sims", str(sims), "--max-env-steps", "10000000",
               "--stop-return", "1e9", "--logdir", logdir, "--log-every", "0"]
        t0 = time.monotonic()
        proc = popen_group(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # SIGINT it like Ctrl-C
        left = []
        try:
            lines = line_reader(proc)
            first = wait_for_line(lines, proc, "update    1 |", t0)
            wait_for_line(lines, proc, "update    3 |", t0)
            processes = process_tree(proc.pid)
        finally:
            # Also on failure or when the bench is interrupted: the run stops as after Ctrl-C.
            exit_code = interrupt_group(proc)
            left = own_shm_files(proc.pid)
            if left:  # shmrl.run must unlink its segments: report it, and leave none behind
                print(f"warning: shmrl.run left {left} in /dev/shm; removing them", file=sys.stderr)
                for name in left:
                    os.unlink(f"/dev/shm/{name}")
        summary, rows = read_logdir(logdir)
    return {"processes": processes, "exit_code": exit_code, "shm_files_left": left,
            "first_sample_s": summary.get("first_sample_s"),
            **{k: summary.get(k) for k in ("torch_import_started_s", "torch_import_ended_s", "torch_import_waited_s")},
            "pss_total_mib": sum(p["pss_mib"] for p in processes),
            "uss_total_mib": sum(p["uss_mib"] for p in processes),
            "rss_total_mib": sum(p["rss_mib"] for p in processes),
            "by_role": by_role(processes),
            "first_progress_s": first,
            "first_update_elapsed_s": rows[0]["elapsed_s"] if rows else None,
            "first_update_train_s": rows[0]["train_s"] if rows else None}


def line_reader(proc: subprocess.Popen) -> queue.Queue:
    """Lines of ``proc``'s output as (seconds, line) on a queue, read by a thread so that
    every wait on them can time out."""
    lines: queue.Queue = queue.Queue()

    def read():
        for line in proc.stdout:
            lines.put((time.monotonic(), line))
        lines.put((time.monotonic(), None))

    threading.Thread(target=read, name="bench-reader", daemon=True).start()
    return lines


def wait_for_line(lines: queue.Queue, proc, text: str, t0: float, timeout: float = 2 * WAIT_S) -> float:
    """Seconds from ``t0`` to the line holding ``text``."""
    deadline = time.monotonic() + timeout
    seen = []
    while True:
        try:
            t, line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"{text!r} did not appear within {timeout:.0f} s") from None
        if line is None:
            raise RuntimeError(f"shmrl.run exited ({proc.wait(5)}) before {text!r}:\n{''.join(seen[-20:])}")
        seen.append(line)
        if text in line:
            return t - t0


def by_role(processes: list[dict]) -> dict[str, dict]:
    """Per role ("simulator" for all simulators): how many processes, the sums of their
    PSS, USS and RSS, and the median of each per process (MiB)."""
    groups: dict[str, list[dict]] = {}
    for x in processes:
        groups.setdefault("simulator" if x["role"].startswith("simulator ") else x["role"], []).append(x)
    out = {}
    for role, xs in groups.items():
        out[role] = {"processes": len(xs)}
        for m in ("pss", "uss", "rss"):
            out[role][f"{m}_mib"] = sum(x[f"{m}_mib"] for x in xs)
            out[role][f"{m}_per_process_mib"] = median(x[f"{m}_mib"] for x in xs)
    return out


def print_memory(r: dict) -> None:
    p = r["params"]
    f = lambda x, spec=".2f": "n/a" if x is None else format(x, spec)  # noqa: E731
    print(f"memory: `python -m shmrl.run --sims {p['sims']}` at its third update (MiB; PSS the headline, "
          f"USS private to the process, RSS with shared pages whole)")
    print(f"  {'pid':>7} | {'process':<18} | {'PSS':>7} | {'USS':>7} | {'RSS':>7}")
    for x in r["processes"]:
        print(f"  {x['pid']:>7} | {x['role']:<18} | {x['pss_mib']:>7.1f} | {x['uss_mib']:>7.1f} | {x['rss_mib']:>7.1f}")
    print(f"  {'role':<18} | {'n':>3} | {'PSS':>7} | {'USS':>7} | {'RSS':>7} | {'PSS/proc':>8} | "
          f"{'USS/proc':>8} | {'RSS/proc':>8}")
    for role, x in r["by_role"].items():
        print(f"  {role:<18} | {x['processes']:>3} | {x['pss_mib']:>7.1f} | {x['uss_mib']:>7.1f} | "
              f"{x['rss_mib']:>7.1f} | {x['pss_per_process_mib']:>8.1f} | {x['uss_per_process_mib']:>8.1f} | "
              f"{x['rss_per_process_mib']:>8.1f}")
    print(f"  total: PSS {r['pss_total_mib']:.1f} MiB (what the run occupies), USS {r['uss_total_mib']:.1f} MiB "
          f"(private pages only), RSS {r['rss_total_mib']:.1f} MiB (shared pages counted once per process)")
    sim = r["per_simulator_mib"]
    if sim:
        print(f"  each simulator (median): PSS {sim['pss']:.1f}, USS {sim['uss']:.1f}, RSS {sim['rss']:.1f} MiB")
    fp, tr, fs = r["first_progress_s"], r["first_update_train_s"], r["first_sample_s"]
    print(f"  first sample: the learner had its first env steps {f(fs)} s after the run's process start")
    print(f"  start-up: first progress line {f(fp)} s after launch (includes the first batch and "
          f"one PPO update of {f(tr)} s); the run's own clock put update 1 at "
          f"{f(r['runs'][0]['first_update_elapsed_s'])} s from its process start")
    print(f"  start-up split (s from the run's process start): torch import {f(r['torch_import_started_s'])} -> "
          f"{f(r['torch_import_ended_s'])}, first sample {f(fs)}, first update done "
          f"{f(r['first_update_elapsed_s'])}; the run waited {f(r['torch_import_waited_s'])} s for torch")
    for run in r["runs"]:
        left = run["shm_files_left"] or "none"
        print(f"  run: exit {run['exit_code']} after SIGINT, /dev/shm files left: {left}")


# ---------------------------------------------------------------- command line

# --quick: the defaults of each subcommand that make it take seconds (CI runs every one).
QUICK = {
    "throughput": {"sims": [2], "seconds": 1.0, "warmup": 0.5, "repeat": 2, "transport": ["shm", "tcp-binary"]},
    "transport": {"steps": 100, "messages": 20, "repeat": 1, "warmup": 2},
    "solve": {"seeds": [0], "sims": 2, "timeout": 120.0},   # and --stop-return 100 for shmrl.run
    "sync": {"sims": 2, "updates": 5, "warmup": 1},
    "memory": {"sims": 2, "repeat": 1},
}
QUICK["update"] = QUICK_UPDATE
QUICK["scaling"] = QUICK_SCALING
QUICK_SOLVE_EXTRA = ["--stop-return", "100"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    # Arguments after "--" belong to shmrl.run (solve); split them off before argparse,
    # which would otherwise mix them with --seeds' values.
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    common.add_argument("--quick", action="store_true",
                        help="seconds, not minutes: small sizes, one short window (checks that it works)")
    p = argparse.ArgumentParser(prog="python tools/bench.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")

    s = sub.add_parser("throughput", parents=[common], help="sampling throughput of the pipeline vs the limit")
    s.add_argument("--sims", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32], help="simulator counts")
    s.add_argument("--seconds", type=float, default=5.0,
                   help="measurement per sims count, split into --repeat windows")
    s.add_argument("--warmup", type=float, default=1.0, help="seconds before measuring")
    s.add_argument("--repeat", type=int, default=3, help="windows; the figure is their median")
    s.add_argument("--envs-per-sim", type=int, default=1)
    s.add_argument("--env-steps-per-sample", type=int, default=256)
    s.add_argument("--transport", nargs="+", choices=("shm", "tcp-binary"), default=["shm"],
                   help="how the simulators reach the learner; several are measured side by side")
    s.add_argument("--env", default=ENV_ID, help="environment, as shmrl.run's --env (default: %(default)s)")

    s = sub.add_parser("transport", parents=[common],
                       help="per-env-step cost of shm-binary, shm-json, tcp-binary, tcp-json")
    s.add_argument("--steps", type=int, default=500, help="env steps per message")
    s.add_argument("--messages", type=int, default=200, help="timed messages per variant and repetition")
    s.add_argument("--repeat", type=int, default=3)
    s.add_argument("--warmup", type=int, default=10, help="untimed messages before each timed series")
    s.add_argument("--env", default=None, help="messages of this environment's observations and actions, "
                   "recorded from it with random actions, as shmrl.run's --env (default: CartPole-shaped "
                   "synthetic episodes)")

    s = sub.add_parser("solve", parents=[common], help="time to solve CartPole over seeds (tools/solve.py)")
    s.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    s.add_argument("--sims", type=int, default=8)
    s.add_argument("--timeout", type=float, default=300.0, help="seconds per run")

    s = sub.add_parser("sync", parents=[common], help="weight publication latency to every simulator")
    s.add_argument("--sims", type=int, default=8)
    s.add_argument("--updates", type=int, default=50, help="timed publishes")
    s.add_argument("--warmup", type=int, default=5, help="untimed publishes first")

    s = sub.add_parser("memory", parents=[common], help="memory of a training run, and its start-up")
    s.add_argument("--sims", type=int, default=8)
    s.add_argument("--repeat", type=int, default=1)

    # Hidden workers: processes this tool starts for itself.
    s = sub.add_parser("_limit-worker")
    s.add_argument("--model", required=True)
    s.add_argument("--start-at", type=float, required=True)
    for name in ("--warmup", "--seconds"):
        s.add_argument(name, type=float, required=True)
    for name in ("--windows", "--envs-per-sim", "--seed"):
        s.add_argument(name, type=int, required=True)
    s.add_argument("--env", required=True)
    s = sub.add_parser("_transport-client")
    for name in ("--shm-binary", "--shm-json", "--tcp"):
        s.add_argument(name, required=True)
    for name in ("--steps", "--messages", "--repeat", "--warmup"):
        s.add_argument(name, type=int, required=True)
    s.add_argument("--env")
    add_update_parser(sub, common)
    add_scaling_parser(sub, common)

    if "--quick" in argv:  # quick defaults; flags given on the command line still win
        for name, defaults in QUICK.items():
            sub.choices[name].set_defaults(**defaults)
    args = p.parse_args(argv)
    if getattr(args, "quick", False) and args.command == "solve" and not any(
            x == "--stop-return" or x.startswith("--stop-return=") for x in extra):
        extra = [*QUICK_SOLVE_EXTRA, *extra]
    if extra and args.command != "solve":
        p.error("arguments after -- are for shmrl.run, only with solve")
    args.extra = extra
    for name in ("repeat", "seconds", "steps", "messages", "updates", "envs_per_sim", "env_steps_per_sample"):
        if getattr(args, name, 1) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    sims = getattr(args, "sims", 1)
    if min(sims if isinstance(sims, list) else [sims]) <= 0:
        p.error("--sims must be > 0")
    return args


COMMANDS = {"throughput": (throughput, print_throughput), "transport": (transport, print_transport),
            "solve": (solve_bench, print_solve), "sync": (sync, print_sync), "memory": (memory, print_memory)}
COMMANDS["update"] = (update_bench, print_update)
COMMANDS["scaling"] = (scaling_bench, print_scaling)


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through every finally: processes and segments go


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "_limit-worker":
        return limit_worker(args)
    if args.command == "_transport-client":
        return transport_client(args)
    signal.signal(signal.SIGTERM, _terminate)
    measure, show = COMMANDS[args.command]
    try:
        result = measure(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError, OSError) as e:
        print(f"error: {args.command}: {e}", file=sys.stderr)
        return 1
    finally:
        stop_fork_server()
        left = own_shm_files(os.getpid())
        if left:  # ShmServer.close() unlinks them; never leave any behind even if it did not
            print(f"warning: removing leftover {left} from /dev/shm", file=sys.stderr)
            for name in left:
                os.unlink(f"/dev/shm/{name}")
    if args.json:
        print(json.dumps(result))
    else:
        show(result)
        print_method(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
