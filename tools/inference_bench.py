"""Server-side inference's benchmark: env steps/s in all and ACT's round trip, against
client-side inference at the same client count.

    python tools/inference_bench.py [--clients 1 16 64] [--envs 1] [--seconds 5] [--env ID]
    python tools/inference_bench.py --clients 16 --envs 16      # the throughput figure of issue 24
    python tools/inference_bench.py --client-cmd "clients/c/build/cartpole --port {port} --envs {envs}"
    python tools/inference_bench.py --server run                # against python -m shmrl.run --sims 0 --tcp-port 0 --async
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
started (server-side: actions served, each counted once). The server's CPU per env step
(this process: both of its threads) is less load-sensitive than the rates. The machine
may be shared: the load average before and after is reported.

``--server run`` serves them from a real run instead (``python -m shmrl.run --sims 0
--tcp-port 0 --async``, training as it goes): its figures come from metrics.jsonl, whole
samples received, so they need windows of many updates (``--seconds 20``).
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/inference_bench.py`: run as tools.inference_bench
    import run_as_module
    run_as_module.run(__file__)

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

from tools.shared import repo_on_pythonpath

HERE = Path(__file__).resolve()
DEFAULT_CLIENT = "{python} -m shmrl.sim --connect 127.0.0.1:{port} --server-inference --envs-per-sim {envs} --seed {seed}"
CLIENT_SIDE = "{python} -m shmrl.sim --connect 127.0.0.1:{port} --envs-per-sim {envs} --seed {seed}"
QUICK = {"clients": [1, 2], "seconds": 1.5, "envs": 1}
START_S = 180.0   # the longest the clients may take to connect (64 Python clients on a loaded machine)


class DrainServer:
    """shmrl's TcpServer and Hub in this process, serving as a run's serving thread does
    (one forward pass per poll round), with a learner that only drains the store."""

    def __init__(self, env: str, env_steps_per_sample: int = 256, server_side: bool = True):
        from shmrl.config.settings import Config, resolve_config
        from shmrl.envs.make import env_spec
        from shmrl.server.hub import Hub
        from shmrl.onnxio.policy import encode_onnx_file
        from shmrl.server.serving import heartbeat_period
        from shmrl.trainer.setup import policy_net
        from shmrl.server.store import DEFAULT_POLICY, EpisodeStore
        from shmrl.transport.tcp import TcpServer

        spec = env_spec(env)
        config = resolve_config(Config(env=env, env_steps_per_sample=env_steps_per_sample), spec)
        net = policy_net(config, spec)
        # A client is given a minute to fall silent: 64 of them starting at once on a loaded
        # 2-core machine take longer than --hang-timeout to load onnxruntime.
        self.server = TcpServer("127.0.0.1", 0, heartbeat_s=heartbeat_period(config.hang_timeout),
                                heartbeat_timeout=60.0)
        self.port = self.server.address[1]
        self.store = EpisodeStore()
        self.hub = Hub({DEFAULT_POLICY: spec}, self.store, env_steps_per_sample, on_policy=False,
                       state_size=net.state_size)
        onnx_file = encode_onnx_file(net.template.publish(net.initial_weights(0)))
        self.hub.set_state(1, {DEFAULT_POLICY: {"onnx_file": onnx_file, "weights_seq_no": 1}})
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.server.fileno(), selectors.EVENT_READ)
        self.closed = 0
        self.server_side = server_side

    def steps(self) -> int:
        """Env steps so far: actions served (server-side inference; the chunks they make
        reach the store too, and are not counted twice) or steps received (client-side)."""
        return self.hub.inference.rows if self.server_side else self.store.steps_received

    def clients(self) -> int:
        return len(self.hub.sampling)

    def window(self, seconds: float) -> dict:
        """Serve for ``seconds``: env steps/s, each client's steps, this process's memory."""
        t0, s0, by0, cpu0 = time.monotonic(), self.steps(), self.steps_by_client(), time.process_time()
        self.serve_for(seconds)
        steps = self.steps() - s0
        return {"env_steps_per_s": round(steps / (time.monotonic() - t0)), "closed": self.closed,
                "server_rss_mb": round(rss_mb()),
                # this process's CPU (both server threads) per env step: less load-sensitive than the rates
                "server_cpu_us_per_step": round((time.process_time() - cpu0) / max(steps, 1) * 1e6, 1),
                **fairness(self.steps_by_client(), by0)}

    def steps_by_client(self) -> dict[str, int]:
        """Env steps each connection has stepped: reported in its ACTs (server-side
        inference) or received (client-side)."""
        out = dict(self.store.steps_by_conn)
        out.update({conn_id: s.stepped for conn_id, s in self.hub.inference.slots.items()})
        return out

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


class RunServer:
    """``python -m shmrl.run --sims 0 --tcp-port 0 --async`` in a process of its own
    (``--server run``): the real learner, training as it samples; env steps/s and each
    client's steps from its metrics.jsonl (received steps: whole samples)."""

    def __init__(self, env: str, run_args: list[str]):
        import tempfile

        self.dir = Path(tempfile.mkdtemp(prefix="shmrl-inference-bench-"))
        self.log = open(self.dir / "run.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "shmrl.run", "--env", env, "--sims", "0", "--tcp-port", "0",
                                      "--async", "--stop-return", "inf", "--log-every", "0",
                                      "--logdir", str(self.dir / "run"), *run_args],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=repo_on_pythonpath())
        self.serve_until(lambda: self._port() is not None, START_S, "the run's TCP port")
        self.port = self._port()

    def _port(self) -> int | None:
        import re

        found = re.search(r"listening for RLlink clients on [\d.]+:(\d+)", (self.dir / "run.log").read_text())
        return int(found.group(1)) if found else None

    def _last_row(self) -> dict:
        path = self.dir / "run" / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return json.loads(lines[-1]) if lines else {"env_steps": 0, "elapsed_s": 0.0, "env_steps_by_client": {}}

    def clients(self) -> int:
        return len(self._last_row()["env_steps_by_client"])

    def serve_for(self, seconds: float) -> None:
        time.sleep(seconds)
        if self.proc.poll() is not None:
            raise RuntimeError(f"the run exited ({self.proc.returncode}): {(self.dir / 'run.log').read_text()[-2000:]}")

    serve_until = DrainServer.serve_until

    def window(self, seconds: float) -> dict:
        import psutil

        first = self._last_row()
        self.serve_for(seconds)
        last = self._last_row()
        rate = (last["env_steps"] - first["env_steps"]) / max(last["elapsed_s"] - first["elapsed_s"], 1e-9)
        return {"env_steps_per_s": round(rate), "server_rss_mb": round(psutil.Process(self.proc.pid).memory_info().rss
                                                                      / 2**20),
                **fairness(last["env_steps_by_client"], first["env_steps_by_client"])}

    def close(self) -> None:
        import shutil

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
        self.proc.wait(10)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def fairness(after: dict, before: dict) -> dict:
    """Each client's env steps over the window against the median: none starved means the
    slowest is within 2x of it."""
    steps = sorted(after[c] - before.get(c, 0) for c in after)
    if not steps:
        return {}
    median = float(np.median(steps))
    return {"client_steps_min": steps[0], "client_steps_median": median, "client_steps_max": steps[-1]}


def rss_mb() -> float:
    """This process's resident memory (the server's: TCP, Hub, store, the policy), MB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def start_clients(template: str, n: int, port: int, envs: int) -> list[subprocess.Popen]:
    env = repo_on_pythonpath()
    return [subprocess.Popen(shlex.split(template.format(python=shlex.quote(sys.executable), port=port, envs=envs,
                                                         seed=i)),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env) for i in range(n)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait(10)


def measure(template: str, n: int, envs: int, seconds: float, env: str, probe: bool,
            run_args: list[str] | None = None) -> dict:
    """One point: N clients (the last a probe, with ``probe``), steps/s over ``seconds``;
    against a draining learner in this process, or with ``run_args`` a real run's."""
    server = DrainServer(env, server_side=probe) if run_args is None else RunServer(env, run_args)
    procs = []
    try:
        procs = start_clients(template, n - 1 if probe else n, server.port, envs)
        if probe:
            procs.append(subprocess.Popen([sys.executable, str(HERE), "--probe", str(server.port), "--envs", str(envs),
                                           "--seconds", str(seconds + START_S)], stdout=subprocess.PIPE, text=True))
        server.serve_until(lambda: server.clients() >= n, START_S, f"{n} clients sampling")
        server.serve_for(min(1.0, seconds / 2))   # warm: every client past its first samples
        out = {"clients": n, "envs": envs, **server.window(seconds)}
        if probe:
            procs[-1].terminate()   # it reports the round trips of its last 5 s
            server.serve_until(lambda: procs[-1].poll() is not None, 10, "the probe's report")
            result, _ = procs[-1].communicate(timeout=10)
            out.update(json.loads(result.strip().splitlines()[-1]))
        return out
    finally:
        stop(procs)
        server.close()


def point(template: str, n: int, args, probe_: bool, run_args) -> dict:
    """``measure``, or what went wrong (the other points are still measured)."""
    try:
        return measure(template, n, args.envs, args.seconds, args.env, probe_, run_args)
    except (TimeoutError, RuntimeError, OSError, ValueError) as e:
        print(f"{n} clients: {e}", file=sys.stderr)
        return {"clients": n, "envs": args.envs, "error": str(e)[:300]}


def probe(port: int, envs: int, seconds: float) -> int:
    """A raw-socket server-inference client of CartPole that times each ACT's round trip
    until SIGTERM or ``seconds``, then prints p50 and p99 (ms) of the last 5 s of them."""
    import signal

    from shmrl import rllink
    from shmrl.envs.make import make_vec_env

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
    p.add_argument("--server", choices=("drain", "run"), default="drain",
                   help="drain: a learner in this process that only drains the store (the serving side's cost "
                        "alone); run: python -m shmrl.run --sims 0 --tcp-port 0 --async, training as it samples "
                        "(default: drain)")
    p.add_argument("--run-args", default="--env-steps-per-sample 256",
                   help="more flags for the run of --server run (default: %(default)s)")
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
    run_args = shlex.split(args.run_args) if args.server == "run" else None
    result["server"] = args.server
    for n in args.clients:
        result["server_side"].append(point(args.client_cmd, n, args, True, run_args))
        if not args.no_client_side:
            result["client_side"].append(point(CLIENT_SIDE, n, args, False, run_args))
    result["loadavg_after"] = os.getloadavg()
    if args.json:
        print(json.dumps(result))
        return 0
    learner = "learner draining" if args.server == "drain" else "a run training with --async"
    print(f"server-side inference, {args.env}, {learner}; load {result['loadavg_before']} -> "
          f"{result['loadavg_after']} on {result['cpus']} cpus")
    print(f"{'clients':>7} {'envs':>4} {'server-side steps/s':>20} {'ACT p50 ms':>10} {'p99 ms':>8} "
          f"{'client-side steps/s':>20} {'ratio':>6} {'per-client steps min/median/max':>32} {'server MB':>9} "
          f"{'server CPU us/step':>18}")
    for i, s in enumerate(result["server_side"]):
        c = result["client_side"][i] if result["client_side"] else None
        if "error" in s or (c and "error" in c):
            print(f"{s['clients']:>7} {s['envs']:>4} {(s.get('error') or c.get('error'))}")
            continue
        ratio = f"{s['env_steps_per_s'] / c['env_steps_per_s']:.2f}" if c and c["env_steps_per_s"] else "-"
        spread = f"{s.get('client_steps_min')}/{s.get('client_steps_median')}/{s.get('client_steps_max')}"
        print(f"{s['clients']:>7} {s['envs']:>4} {s['env_steps_per_s']:>20,} {s['rtt_ms_p50']:>10} "
              f"{s['rtt_ms_p99']:>8} {(c['env_steps_per_s'] if c else '-'):>20} {ratio:>6} {spread:>32} "
              f"{s['server_rss_mb']:>9} {s.get('server_cpu_us_per_step', '-'):>18}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
