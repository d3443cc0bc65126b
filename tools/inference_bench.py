"""Server-side inference's benchmark: env steps/s in all and ACT's round trip, against
client-side inference at the same client count.

    python tools/inference_bench.py [--clients 1 16 64] [--envs 1] [--seconds 5] [--env ID]
    python tools/inference_bench.py --clients 16 --envs 16      # the throughput figure of issue 24
    python tools/inference_bench.py --client-cmd "clients/c/build/cartpole --port {port} --envs {envs}"
    python tools/inference_bench.py --quick --json              # seconds: a check that it works

For each client count N: a learner that only drains (this process: shmrl's TcpServer and
Hub, the chunks taken from the store and thrown away, nothing trained, so the figure is the
serving side's and the clients') serves N client processes over loopback TCP. Server-side
inference: N - 1 clients from ``--client-cmd`` (a template with {port}, {envs}, {seed},
{python}; default: ``python -m shmrl.sim --server-inference``) and one probe of this file
(a raw-socket client of as many envs that times every ACT's round trip: p50 and p99 over
the window). Client-side inference: N ``python -m shmrl.sim`` (onnxruntime in each
client, the binary codec), for the ratio. Env steps/s: actions served (server-side) or env
steps received (client-side) per second over ``--seconds`` after every client has
started. The machine may be shared: the load average before and after is reported.
"""
from __future__ import annotations

import argparse
import json
import os
import selectors
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
DEFAULT_CLIENT = "{python} -m shmrl.sim --connect 127.0.0.1:{port} --server-inference --envs-per-sim {envs} --seed {seed}"
CLIENT_SIDE = "{python} -m shmrl.sim --connect 127.0.0.1:{port} --envs-per-sim {envs} --seed {seed}"
QUICK = {"clients": [1, 2], "seconds": 1.5, "envs": 1}
START_S = 180.0   # the longest the clients may take to connect (64 Python clients on a loaded machine)


class DrainServer:
    """shmrl's TcpServer and Hub in this process, serving as a run's serving thread does
    (one forward pass per poll round), with a learner that only drains the store."""

    def __init__(self, env: str, env_steps_per_sample: int = 256):
        sys.path.insert(0, str(ROOT))
        from shmrl.config import Config, resolve_config
        from shmrl.envs import env_spec
        from shmrl.hub import Hub
        from shmrl.onnx_policy import encode_onnx_file
        from shmrl.serving import heartbeat_period
        from shmrl.setup_run import policy_net
        from shmrl.store import DEFAULT_POLICY, EpisodeStore
        from shmrl.transport.tcp import TcpServer

        spec = env_spec(env)
        config = resolve_config(Config(env=env, env_steps_per_sample=env_steps_per_sample), spec)
        net = policy_net(config, spec)
        self.server = TcpServer("127.0.0.1", 0, heartbeat_s=heartbeat_period(config.hang_timeout),
                                heartbeat_timeout=config.hang_timeout)
        self.port = self.server.address[1]
        self.store = EpisodeStore()
        self.hub = Hub({DEFAULT_POLICY: spec}, self.store, env_steps_per_sample, on_policy=False,
                       state_size=net.state_size)
        onnx_file = encode_onnx_file(net.template.publish(net.initial_weights(0)))
        self.hub.set_state(1, {DEFAULT_POLICY: {"onnx_file": onnx_file, "weights_seq_no": 1}})
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.server.fileno(), selectors.EVENT_READ)
        self.closed = 0

    def steps(self) -> int:
        """Env steps so far: actions served (server-side inference) and steps received."""
        return self.hub.inference.rows + self.store.steps_received

    def serve_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            self.selector.select(min(left, 0.05))
            for conn_id, msg in self.server.poll(0.0):
                self.closed += msg is None
                self.hub.handle(self.server, conn_id, msg)
            self.hub.flush_actions()
            if self.store.pending_steps:
                self.store.take()   # drain: nothing is trained

    def serve_until(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not within {timeout:.0f} s")
            self.serve_for(0.05)

    def close(self) -> None:
        self.selector.close()
        self.server.close()


def start_clients(template: str, n: int, port: int, envs: int) -> list[subprocess.Popen]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return [subprocess.Popen(shlex.split(template.format(python=shlex.quote(sys.executable), port=port, envs=envs,
                                                         seed=i)),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env) for i in range(n)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait(10)


def measure(template: str, n: int, envs: int, seconds: float, env: str, probe: bool) -> dict:
    """One point: N clients (the last a probe, with ``probe``), steps/s over ``seconds``."""
    server = DrainServer(env)
    procs = []
    try:
        procs = start_clients(template, n - 1 if probe else n, server.port, envs)
        if probe:
            procs.append(subprocess.Popen([sys.executable, str(HERE), "--probe", str(server.port), "--envs", str(envs),
                                           "--seconds", str(seconds + START_S)], stdout=subprocess.PIPE, text=True))
        server.serve_until(lambda: len(server.hub.sampling) >= n, START_S, f"{n} clients sampling")
        server.serve_for(min(1.0, seconds / 2))   # warm: every client past its first samples
        t0, s0 = time.monotonic(), server.steps()
        server.serve_for(seconds)
        rate = (server.steps() - s0) / (time.monotonic() - t0)
        out = {"clients": n, "envs": envs, "env_steps_per_s": round(rate), "closed": server.closed}
        if probe:
            procs[-1].terminate()   # it reports the round trips of its last 5 s
            server.serve_until(lambda: procs[-1].poll() is not None, 10, "the probe's report")
            result, _ = procs[-1].communicate(timeout=10)
            out.update(json.loads(result.strip().splitlines()[-1]))
        return out
    finally:
        stop(procs)
        server.close()


def probe(port: int, envs: int, seconds: float) -> int:
    """A raw-socket server-inference client of CartPole that times each ACT's round trip
    until SIGTERM or ``seconds``, then prints p50 and p99 (ms) of the last 5 s of them."""
    import signal

    sys.path.insert(0, str(ROOT))
    from shmrl import rllink
    from shmrl.envs import make_vec_env

    stopped = []
    signal.signal(signal.SIGTERM, lambda *_: stopped.append(1))
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def request(msg: dict) -> dict:
        sock.sendall(rllink.frame(rllink.encode(msg, "binary")))
        header = sock.recv(8, socket.MSG_WAITALL)
        return rllink.decode_reply(sock.recv(int(header), socket.MSG_WAITALL))

    request({"type": "PING", "inference": "server", "codecs": ["binary"]})
    envs_ = make_vec_env("CartPole-v1", envs, 12345)
    msg, times = {"type": "ACT", "obs": envs_.reset()}, []
    end = time.monotonic() + seconds
    while not stopped and time.monotonic() < end:
        t0 = time.perf_counter()
        reply = request(msg)
        times.append((time.monotonic(), time.perf_counter() - t0))
        obs, rewards, term, trunc, final = envs_.step(reply["actions"])
        msg = {"type": "ACT", "obs": obs, "rewards": rewards, "terminateds": term, "truncateds": trunc}
        if final is not None:
            msg["final_obs"] = final
    last = np.array([rtt for t, rtt in times if t > times[-1][0] - 5.0]) * 1e3
    print(json.dumps({"rtt_ms_p50": round(float(np.percentile(last, 50)), 3),
                      "rtt_ms_p99": round(float(np.percentile(last, 99)), 3), "rtt_samples": len(last)}))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tools/inference_bench.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 16, 64], help="client counts (default: 1 16 64)")
    p.add_argument("--envs", type=int, default=1, help="envs per client (default: 1)")
    p.add_argument("--seconds", type=float, default=5.0, help="the window of each measurement (default: 5)")
    p.add_argument("--env", default="CartPole-v1", help="env of the learner and of shmrl.sim's clients")
    p.add_argument("--client-cmd", default=DEFAULT_CLIENT,
                   help="server-side inference clients: a command with {port}, {envs}, {seed}, {python} "
                        "(default: python -m shmrl.sim --server-inference)")
    p.add_argument("--no-client-side", action="store_true", help="skip client-side inference's figures")
    p.add_argument("--quick", action="store_true", help=f"seconds, not minutes: {QUICK}")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    p.add_argument("--probe", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.probe is not None:
        return probe(args.probe, args.envs, args.seconds)
    if args.quick:
        given = set(a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]))
        for key, value in QUICK.items():
            if f"--{key}" not in given:
                setattr(args, key, value)
    result = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "loadavg_before": os.getloadavg(),
              "cpus": os.cpu_count(), "client_cmd": args.client_cmd, "server_side": [], "client_side": []}
    for n in args.clients:
        result["server_side"].append(measure(args.client_cmd, n, args.envs, args.seconds, args.env, probe=True))
        if not args.no_client_side:
            result["client_side"].append(measure(CLIENT_SIDE, n, args.envs, args.seconds, args.env, probe=False))
    result["loadavg_after"] = os.getloadavg()
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"server-side inference, {args.env}, learner draining; load {result['loadavg_before']} -> "
          f"{result['loadavg_after']} on {result['cpus']} cpus")
    print(f"{'clients':>7} {'envs':>4} {'server-side steps/s':>20} {'ACT p50 ms':>10} {'p99 ms':>8} "
          f"{'client-side steps/s':>20} {'ratio':>6}")
    for i, s in enumerate(result["server_side"]):
        c = result["client_side"][i] if result["client_side"] else None
        ratio = f"{s['env_steps_per_s'] / c['env_steps_per_s']:.2f}" if c and c["env_steps_per_s"] else "-"
        print(f"{s['clients']:>7} {s['envs']:>4} {s['env_steps_per_s']:>20,} {s['rtt_ms_p50']:>10} "
              f"{s['rtt_ms_p99']:>8} {(c['env_steps_per_s'] if c else '-'):>20} {ratio:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
