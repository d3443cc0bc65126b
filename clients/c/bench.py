"""C clients against shmrl: env steps/s, round trips, fairness, server memory; with
server-side inference (clients/c/build/cartpole) or client-side (build/cartpole_onnx).

Starts `python -m shmrl.run --sims 0 --tcp-port 0` (CartPole-v1, never stopping on its
own: the learner keeps training on what arrives) and N client processes of K envs each
for S seconds, then prints one JSON object per setting:

    python clients/c/bench.py --clients 16 --envs 16 --seconds 20     # throughput
    python clients/c/bench.py --clients 1 16 64 --envs 1              # round trips
    python clients/c/bench.py --clients 256 --envs 1 --seconds 30     # many at once
    python clients/c/bench.py --clients 16 --inference both           # server- then client-side
    python clients/c/bench.py --quick                                 # 2 clients, 2 s

With `--inference client` the round trips are EPISODES_AND_GET_STATE's (one message per
env_steps_per_sample steps, the learner's update included when it holds the reply), not
ACT's.

`env_steps_per_s` is the sum of the clients' own rates (steps over the seconds since their
first ACTIONS); `p50_ms`/`p99_ms` are over every ACT round trip of every client, replies
the learner held while it trained included (`--run-args=--async` for replies never held);
`steps_min_over_median`/`steps_max_over_median` compare the clients' step counts;
`server_rss_mb` is the run's peak resident memory (its process tree), sampled twice a
second; `client_cpu_us_per_step` the clients' CPU time (user and system) per env step. Extra arguments for the run go in --run-args.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

C_DIR = Path(__file__).resolve().parent
ROOT = C_DIR.parents[1]
SUMMARY = re.compile(r"cartpole(?:_onnx)? (\S+): .*?: (\d+) env steps, .* (?:act|message) round trips (\d+), .* in ([\d.]+) s")


def build(inference: str) -> Path:
    """build/cartpole (server-side inference), or build/cartpole_onnx with this python's onnxruntime."""
    if inference == "server":
        subprocess.run(["make", "-s", "-C", str(C_DIR)], check=True)
        return C_DIR / "build" / "cartpole"
    subprocess.run(["make", "-s", "-C", str(C_DIR), "onnx", f"PYTHON={sys.executable}"], check=True)
    return C_DIR / "build" / "cartpole_onnx"


def start_run(tmp: Path, run_args: list[str]) -> tuple[subprocess.Popen, int]:
    log = open(tmp / "run.log", "w")
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH") or str(ROOT)}   # this checkout's shmrl
    run = subprocess.Popen([sys.executable, "-m", "shmrl.run", "--env", "CartPole-v1", "--sims", "0", "--tcp-port", "0",
                            "--logdir", str(tmp / "run"), "--stop-return", "1e9", "--max-env-steps", str(10 ** 12),
                            *run_args], stdout=log, stderr=subprocess.STDOUT, cwd=tmp, env=env, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = re.search(r"listening for RLlink clients on [\d.]+:(\d+)", (tmp / "run.log").read_text())
        if found:
            return run, int(found.group(1))
        if run.poll() is not None:
            break
        time.sleep(0.1)
    run.kill()
    raise SystemExit(f"the run did not start:\n{(tmp / 'run.log').read_text()[-3000:]}")


def tree_rss(proc: psutil.Process) -> int:
    try:
        return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])
    except psutil.Error:
        return 0


def merge_latency(files: list[Path]) -> tuple[float, float]:
    counts: dict[int, int] = {}
    for f in files:
        if f.exists():
            for line in f.read_text().split("\n"):
                if line:
                    us, n = map(int, line.split())
                    counts[us] = counts.get(us, 0) + n
    total = sum(counts.values())
    if not total:
        return 0.0, 0.0
    quantiles, seen, wanted = [], 0, [0.5 * total, 0.99 * total]
    for us in sorted(counts):
        seen += counts[us]
        while wanted and seen >= wanted[0]:
            quantiles.append(us / 1000)
            wanted.pop(0)
    return quantiles[0], quantiles[1]


def measure(exe: Path, clients: int, envs: int, seconds: float, run_args: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="shmrl_cbench_") as tmp_name:
        tmp = Path(tmp_name)
        run, port = start_run(tmp, run_args)
        procs = []
        peak = 0
        before = resource.getrusage(resource.RUSAGE_CHILDREN)   # the clients' CPU: they are waited for first
        try:
            for i in range(clients):
                procs.append(subprocess.Popen(
                    [str(exe), "--port", str(port), "--envs", str(envs), "--name", f"c{i}", "--seconds", str(seconds),
                     "--max-retries", "0", "--quiet", "--latency-file", str(tmp / f"lat{i}")],
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            server = psutil.Process(run.pid)
            deadline = time.monotonic() + seconds + 120
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                peak = max(peak, tree_rss(server))
                time.sleep(0.5)
            outputs = [p.communicate(timeout=30)[0] if p.poll() is not None else "" for p in procs]
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.communicate(timeout=10)
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGINT)
                try:
                    run.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(run.pid, signal.SIGKILL)
                    run.wait(10)
        rows = [m for out in outputs if (m := SUMMARY.search(out))]
        steps = [int(m.group(2)) for m in rows]
        rates = [int(m.group(2)) / float(m.group(4)) for m in rows if float(m.group(4)) > 0]
        p50, p99 = merge_latency([tmp / f"lat{i}" for i in range(clients)])
        median = statistics.median(steps) if steps else 0
        return {"clients": clients, "envs": envs, "seconds": seconds, "clients_reporting": len(rows),
                "env_steps": sum(steps), "env_steps_per_s": round(sum(rates)),
                "p50_ms": p50, "p99_ms": p99,
                "steps_min_over_median": round(min(steps) / median, 3) if median else None,
                "steps_max_over_median": round(max(steps) / median, 3) if median else None,
                "server_rss_mb": round(peak / 2 ** 20, 1), "load": os.getloadavg()[0],
                "client_cpu_us_per_step": round(1e6 * (after.ru_utime + after.ru_stime - before.ru_utime
                                                       - before.ru_stime) / max(sum(steps), 1), 2),
                "run_args": run_args}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, nargs="+", default=[16], help="client processes (one setting each)")
    p.add_argument("--envs", type=int, default=16, help="envs per client")
    p.add_argument("--seconds", type=float, default=20, help="each client steps this long")
    p.add_argument("--run-args", default="", help="more arguments for python -m shmrl.run (one string)")
    p.add_argument("--inference", choices=["server", "client", "both"], default="server",
                   help="who runs the policy: the server (cartpole), the client (cartpole_onnx), or each in turn")
    p.add_argument("--quick", action="store_true", help="2 clients of 2 envs for 2 s: does it work")
    args = p.parse_args(argv)
    if args.quick:
        args.clients, args.envs, args.seconds = [2], 2, 2.0
    kinds = ["server", "client"] if args.inference == "both" else [args.inference]
    exes = {kind: build(kind) for kind in kinds}
    for n in args.clients:
        for kind in kinds:
            result = {"inference": kind, **measure(exes[kind], n, args.envs, args.seconds, shlex.split(args.run_args))}
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
