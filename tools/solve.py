"""Time `python -m shmrl.run` to the stop return over several seeds.

    python tools/solve.py                      # 5 seeds of --sims 8 on CartPole-v1
    python tools/solve.py --seeds 0 1 2 -- --env-steps-per-sample 128

Each run is timed from command start (the process's own start, as the run measures it)
to exit; prints one line per seed and the median. Any extra arguments after ``--`` go
to ``shmrl.run``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def solve(seed: int, sims: int, extra: list[str], timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as logdir:
        cmd = [sys.executable, "-m", "shmrl.run", "--sims", str(sims), "--seed", str(seed),
               "--logdir", logdir, *extra]
        t0 = time.time()
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              timeout=timeout)
        wall = time.time() - t0
        summary_path = Path(logdir) / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    if proc.returncode not in (0, 1):
        sys.stderr.write(proc.stderr)
    return {"seed": seed, "exit": proc.returncode, "wall_s": wall,
            "solved": summary.get("solved", False), "env_steps": summary.get("env_steps"),
            "return_mean": summary.get("return_mean")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--sims", type=int, default=8)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("extra", nargs="*", help="arguments for shmrl.run (after --)")
    args = p.parse_args()
    results = []
    for seed in args.seeds:
        r = solve(seed, args.sims, args.extra, args.timeout)
        results.append(r)
        if not args.json:
            print(f"seed {r['seed']}: {'solved' if r['solved'] else 'NOT solved'} in {r['wall_s']:.2f} s, "
                  f"{r['env_steps']} env steps, return {r['return_mean']}", flush=True)
    walls = [r["wall_s"] for r in results]
    out = {"runs": results, "median_wall_s": statistics.median(walls),
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
