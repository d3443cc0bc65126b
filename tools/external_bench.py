"""External clients against local simulators: env steps and seconds to the stop return.

    python tools/external_bench.py                        # 4 and 8 clients, seeds 0 1 2
    python tools/external_bench.py --clients 4 --seeds 0 --kinds local python python-set
    python tools/external_bench.py --quick --json         # seconds: 2 clients, return 100

For each number of clients N and seed, ``python -m shmrl.run`` learns CartPole-v1 (or
--env) in turns:

- ``local``: --sims N, the run's own simulators (1 env each), the reference;
- ``python``: --sims 0 --tcp-port 0 with the learner's defaults, and N processes of
  ``examples/external_client.py`` (client-side inference, JSON, 1 env each);
- ``python-set``: the same with ``--env-steps-per-sample`` set by hand to the batch / N;
- ``c`` and ``c-set``: the same two with N C clients (``clients/c/build/cartpole``,
  server-side inference, --c-envs envs each; skipped unless built: ``make -C clients/c``).

Each run is timed from the learner's launch to its exit (the clients start once it
listens); env steps are what its summary.json counts when it stopped. Prints one line per
run, then per kind the medians over seeds and their ratios to ``local`` (env steps) and
to the hand-set kind of the same client (seconds). Every process started is stopped at
the end of its run, and on an error or Ctrl-C.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/external_bench.py`: run as tools.external_bench
    import run_as_module
    run_as_module.run(__file__)

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.shared import (REPO, finished, interrupt_group, median, own_shm_files, popen_group, print_method, quick_asked,
                          read_logdir, repo_on_pythonpath, started)

KINDS = ("local", "python", "python-set", "c", "c-set")
C_CLIENT = REPO / "clients" / "c" / "build" / "cartpole"
LISTENING = re.compile(r"listening for RLlink clients on (\S+):(\d+)")
QUICK = {"clients": [2], "seeds": [0], "timeout": 120.0, "kinds": ["local", "python"]}


def one_run(kind: str, n: int, seed: int, args) -> dict:
    """One timed run of ``kind`` with ``n`` simulators or clients; a run past --timeout is
    stopped and counts as not solved."""
    shmrl = ["--seed", str(seed), "--env", args.env, "--train-batch-size", str(args.batch), *args.extra]
    if args.stop_return is not None:
        shmrl += ["--stop-return", str(args.stop_return)]
    if kind == "local":
        shmrl += ["--sims", str(n)]
    else:
        shmrl += ["--sims", "0", "--tcp-port", "0"]
        if kind.endswith("-set"):
            shmrl += ["--env-steps-per-sample", str(-(-args.batch // n))]
    env = repo_on_pythonpath()
    with tempfile.TemporaryDirectory() as logdir, open(Path(logdir + "-out"), "w+") as out:
        learner = popen_group([sys.executable, "-m", "shmrl.run", *shmrl, "--logdir", logdir], stdout=out,
                              stderr=out, text=True, env=env)
        t0, clients, code = time.time(), [], None
        try:
            if kind != "local":
                port = wait_for_port(out, learner, t0 + args.timeout)
                for i in range(n if port else 0):
                    clients.append(popen_group(client_command(kind, port, seed * 100 + i, args), env=env,
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            try:
                code = learner.wait(max(0.0, t0 + args.timeout - time.time()))
            except subprocess.TimeoutExpired:   # counted as not solved
                code = None
            wall = time.time() - t0
        finally:
            for proc in [learner, *clients]:
                if proc.poll() is None:
                    interrupt_group(proc, timeout=5.0)
            for name in own_shm_files(learner.pid):
                Path(f"/dev/shm/{name}").unlink(missing_ok=True)
            out.seek(0)
            tail = out.read()[-2000:]
        Path(logdir + "-out").unlink(missing_ok=True)
        summary, _ = read_logdir(logdir)
    if code not in (0, 1):
        sys.stderr.write(f"{kind} n={n} seed={seed}: exit {code}\n{tail}\n")
    return {"kind": kind, "n": n, "seed": seed, "exit": code, "wall_s": round(wall, 2),
            "solved": bool(summary.get("solved")), "env_steps": summary.get("env_steps"),
            "return_mean": summary.get("return_mean")}


def wait_for_port(out, learner, deadline: float) -> int | None:
    """The port the learner listens on, from its log line (None: it ended or took too long)."""
    while time.time() < deadline and learner.poll() is None:
        out.seek(0)
        m = LISTENING.search(out.read())
        if m:
            return int(m.group(2))
        time.sleep(0.05)
    return None


def client_command(kind: str, port: int, seed: int, args) -> list[str]:
    if kind.startswith("python"):
        return [sys.executable, str(REPO / "examples" / "external_client.py"), "--port", str(port)]
    return [str(C_CLIENT), "--port", str(port), "--envs", str(args.c_envs), "--seed", str(seed), "--quiet"]


def summarize(runs: list[dict]) -> dict:
    """Per (kind, n): medians over seeds, and the ratios the issue asks for."""
    out = {}
    for (kind, n) in sorted({(r["kind"], r["n"]) for r in runs}, key=lambda k: (k[1], KINDS.index(k[0]))):
        mine = [r for r in runs if r["kind"] == kind and r["n"] == n]
        out[f"{kind}/{n}"] = {"median_env_steps": median(r["env_steps"] or 0 for r in mine),
                              "median_wall_s": median(r["wall_s"] for r in mine),
                              "all_solved": all(r["solved"] for r in mine), "seeds": len(mine)}
    for key, row in out.items():
        kind, n = key.split("/")
        local, hand = out.get(f"local/{n}"), out.get(f"{kind}-set/{n}")
        if local and kind != "local" and local["median_env_steps"]:
            row["env_steps_vs_local"] = round(row["median_env_steps"] / local["median_env_steps"], 2)
        if hand and hand["median_wall_s"]:
            row["wall_vs_hand_set"] = round(row["median_wall_s"] / hand["median_wall_s"], 2)
    return out


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through one_run()'s finally: its processes are stopped


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, nargs="+", default=[4, 8], metavar="N",
                   help="numbers of clients (and of local simulators) to run (default: 4 8)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="what to run (default: all)")
    p.add_argument("--env", default="CartPole-v1", help="the learner's --env (the clients play CartPole)")
    p.add_argument("--batch", type=int, default=2048, help="the learner's --train-batch-size (default: 2048)")
    p.add_argument("--c-envs", type=int, default=16, help="envs per C client (default: 16)")
    p.add_argument("--stop-return", type=float, default=None, help="the learner's --stop-return (default: the env's)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run (default: 300)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--quick", action="store_true",
                   help="seconds: 2 clients, seed 0, local and python, --stop-return 100 (flags given still win)")
    p.add_argument("extra", nargs="*", help="more arguments for shmrl.run (after --)")
    argv = sys.argv[1:] if argv is None else argv
    if quick_asked(argv):
        p.set_defaults(**QUICK, stop_return=100.0)
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds if not k.startswith("c") or C_CLIENT.exists()]
    if len(kinds) < len(args.kinds):
        print(f"skipping the C client's kinds: {C_CLIENT} is not built (make -C clients/c)", file=sys.stderr)
    signal.signal(signal.SIGTERM, _terminate)
    result = started("external_bench", "each run timed from the learner's launch to its exit; clients start "
                     "once it listens; env steps from its summary.json; medians over seeds",
                     clients=args.clients, seeds=args.seeds, kinds=kinds, env=args.env, batch=args.batch,
                     c_envs=args.c_envs, stop_return=args.stop_return, extra=args.extra)
    runs = []
    try:
        for n in args.clients:
            for seed in args.seeds:
                for kind in kinds:   # in turns: the machine's load falls on every kind alike
                    r = one_run(kind, n, seed, args)
                    runs.append(r)
                    if not args.json:
                        print(f"{kind:>10} n={n} seed={seed}: {'solved' if r['solved'] else 'NOT solved'} in "
                              f"{r['wall_s']:.2f} s, {r['env_steps']} env steps", flush=True)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    result.update(runs=runs, summary=summarize(runs))
    finished(result)
    if args.json:
        print(json.dumps(result))
    else:
        for key, row in result["summary"].items():
            ratios = "".join(f", {k} {row[k]}" for k in ("env_steps_vs_local", "wall_vs_hand_set") if k in row)
            print(f"{key:>14}: median {row['median_env_steps']:.0f} env steps, {row['median_wall_s']:.2f} s"
                  f"{ratios}; all solved: {row['all_solved']}")
        print_method(result)
    return 0 if all(r["solved"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
