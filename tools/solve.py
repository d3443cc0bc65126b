"""Time `python -m shmrl.run` to the stop return over several seeds.

    python tools/solve.py                      # 5 seeds of --sims 8 on CartPole-v1
    python tools/solve.py --seeds 0 1 2 -- --env-steps-per-sample 128
    python tools/solve.py --quick --json       # seconds: seed 0, --sims 2, --stop-return 100

Each run is timed from command start (the process's own start, as the run measures it)
to exit; prints one line per seed and the median. Any extra arguments after ``--`` go
to ``shmrl.run``. Each run has its own process group; one that outlives --timeout, or
this tool (an error, Ctrl-C, SIGTERM), is stopped as after Ctrl-C, then killed, and any
/dev/shm/shmrl_* file it left is removed.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/solve.py`: run as tools.solve
    import run_as_module
    run_as_module.run(__file__)

import argparse
import json
import signal
import statistics
import sys
import tempfile

from tools.shared import quick_asked, read_logdir, run_shmrl

QUICK = {"seeds": [0], "sims": 2, "timeout": 120.0}   # --quick; and --stop-return 100 for shmrl.run
QUICK_EXTRA = ["--stop-return", "100"]


def solve(seed: int, sims: int, extra: list[str], timeout: float) -> dict:
    """One timed ``python -m shmrl.run``; a run past ``timeout`` s is stopped, with its
    simulators and shared memory, and counts as not solved."""
    with tempfile.TemporaryDirectory() as logdir:
        code, wall, err = run_shmrl(["--sims", str(sims), "--seed", str(seed), "--logdir", logdir, *extra], timeout)
        summary, _ = read_logdir(logdir)
    if code is None:
        return {"seed": seed, "exit": None, "wall_s": timeout, "solved": False, "env_steps": None,
                "return_mean": None}
    if code not in (0, 1):
        sys.stderr.write(err)
    return {"seed": seed, "exit": code, "wall_s": wall,
            "solved": summary.get("solved", False), "env_steps": summary.get("env_steps"),
            "return_mean": summary.get("return_mean")}


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through run_shmrl()'s finally: the run is stopped


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--sims", type=int, default=8)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--quick", action="store_true",
                   help="seconds, not minutes: seed 0, --sims 2, --stop-return 100 (flags given still win)")
    p.add_argument("extra", nargs="*", help="arguments for shmrl.run (after --)")
    argv = sys.argv[1:] if argv is None else argv
    if quick_asked(argv):
        p.set_defaults(**QUICK)
    args = p.parse_args(argv)
    if args.quick and not any(x == "--stop-return" or x.startswith("--stop-return=") for x in args.extra):
        args.extra = [*QUICK_EXTRA, *args.extra]
    signal.signal(signal.SIGTERM, _terminate)
    results = []
    for seed in args.seeds:
        try:
            r = solve(seed, args.sims, args.extra, args.timeout)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
        results.append(r)
        if not args.json:
            print(f"seed {r['seed']}: {'solved' if r['solved'] else 'NOT solved'} in {r['wall_s']:.2f} s, "
                  f"{r['env_steps']} env steps, return {r['return_mean']}", flush=True)
    walls = [r["wall_s"] for r in results]
    out = {"command": " ".join(["python -m shmrl.run --sims", str(args.sims), "--seed S --logdir TMP", *args.extra]),
           "runs": results, "median_wall_s": statistics.median(walls),
           "all_solved": all(r["solved"] for r in results),
           "median_env_steps": statistics.median(r["env_steps"] or 0 for r in results)}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"median wall time {out['median_wall_s']:.2f} s over {len(walls)} seeds "
              f"(median {out['median_env_steps']:.0f} env steps); all solved: {out['all_solved']}")
    return 0 if out["all_solved"] else 1


if __name__ == "__main__":
    sys.exit(main())
