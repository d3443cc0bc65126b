"""Multi-agent targets: connect_four by self-play against a random legal player, and
simple_spread against a published reference return.

    python tools/multiagent_bench.py                    # both, at their full budgets (minutes)
    python tools/multiagent_bench.py connect_four --seeds 0 1 2
    python tools/multiagent_bench.py --quick --json     # seconds: tiny budgets, the whole path

connect_four: ``python -m shmrl.run --env pz:connect_four_v3 --seed S``, the preset as a
new user runs it (self-play, one shared policy, evaluated against a random legal player
while it trains; it stops at the preset's --stop-win-rate, or its step or time budget,
and writes the best policy evaluated), then ``python -m shmrl.eval ... --opponent random``
over --games games (greedy and sampled). The wall time runs from the training command's
start to the end of the greedy evaluation; the training run's own evaluations (metrics.jsonl's
win_rate) give the time it first reached the target rate. Target: a win rate >= 0.9 over
the final games within 300 s. --c4-steps N caps the run at N env steps instead.

simple_spread: ``python -m shmrl.run --env pz:simple_spread_v3`` for --spread-steps agent
steps; reports the mean per-agent return of the last 100 agent episodes at the end and
the time (from command start, metrics.jsonl) at which it first reached --spread-target.
See docs/MULTIAGENT.md ("Targets") for where the target comes from and its reward
conventions. Target: reached within 600 s.

Each run has its own process group, stopped with everything it started (and its
/dev/shm files removed) when it outlives --timeout or this tool is interrupted.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/multiagent_bench.py`: run as tools.multiagent_bench
    import run_as_module
    run_as_module.run(__file__)

import argparse
import json
import math
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.shared import read_logdir, repo_on_pythonpath, run_shmrl

# The runs import the shmrl of this checkout, whatever the current directory.
ENV = repo_on_pythonpath()
C4_TARGET_WIN_RATE, C4_TARGET_S = 0.9, 300.0
SPREAD_TARGET_S = 600.0
# The reference return in PettingZoo's per-agent convention (docs/MULTIAGENT.md, "Targets").
SPREAD_REFERENCE = -22.3
FULL = {"c4_steps": None, "spread_steps": 2_000_000, "games": 1000, "timeout": 900.0}
QUICK = {"c4_steps": 8192, "spread_steps": 13000, "games": 50, "timeout": 120.0, "seeds": [0]}
QUICK_C4_ARGS = ["--eval-every", "1", "--eval-games", "20"]   # an evaluation per update, of a few games


def run(args: list[str], timeout: float) -> tuple[int | None, float, dict, list[dict], str]:
    """``python -m shmrl.run ARGS --logdir TMP``: (exit status, wall s, summary, metrics
    rows, log folder); the folder is the caller's to remove."""
    logdir = tempfile.mkdtemp(prefix="shmrl-ma-")
    code, wall, err = run_shmrl([*args, "--logdir", logdir, "--no-tensorboard"], timeout, env=ENV)
    if code not in (0, 1):
        sys.stderr.write(err[-3000:])
    return (code, wall, *read_logdir(logdir), logdir)


def evaluate(policy: Path, games: int, seed: int, stochastic: bool) -> dict:
    cmd = [sys.executable, "-m", "shmrl.eval", str(policy), "--env", "pz:connect_four_v3", "--opponent", "random",
           "--episodes", str(games), "--seed", str(seed), "--json", *(["--stochastic"] if stochastic else [])]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True, env=ENV)
    return json.loads(out.stdout)


def c4_args(seed: int, args) -> list[str]:
    """The training command's flags: the preset's, but for --c4-steps (and --quick's)."""
    budget = ["--max-env-steps", str(args.c4_steps)] if args.c4_steps else []
    return ["--env", "pz:connect_four_v3", "--seed", str(seed), *budget, *(QUICK_C4_ARGS if args.quick else [])]


def connect_four(seed: int, args) -> dict:
    code, wall, summary, rows, logdir = run(c4_args(seed, args), args.timeout)
    policy = Path(logdir) / "policy-shared.onnx"
    evaluated = [row for row in rows if row.get("win_rate") is not None]
    reached = next((row for row in evaluated if row["win_rate"] >= C4_TARGET_WIN_RATE), None)
    r = {"seed": seed, "exit": code, "train_wall_s": wall, "env_steps": summary.get("env_steps"),
         "env_steps_per_s": summary.get("env_steps_per_s"), "updates": summary.get("updates"),
         "stop_win_rate": summary.get("config", {}).get("stop_win_rate"),
         "evaluations": len(evaluated), "train_win_rate": summary.get("win_rate"),
         "train_win_rate_update": summary.get("win_rate_update", {}).get("shared"),
         "reached_s": reached["elapsed_s"] if reached else None,
         "reached_env_steps": reached["env_steps"] if reached else None}
    if policy.exists():
        t0 = time.time()
        greedy = evaluate(policy, args.games, seed, stochastic=False)
        r.update(win_rate_greedy=greedy["win_rate"], games=greedy["episodes"], wall_s=wall + time.time() - t0)
        r["win_rate_sampled"] = evaluate(policy, args.games, seed, stochastic=True)["win_rate"]
        r["met"] = r["win_rate_greedy"] >= C4_TARGET_WIN_RATE and r["wall_s"] <= C4_TARGET_S
    else:
        r.update(win_rate_greedy=None, win_rate_sampled=None, games=0, wall_s=wall, met=False)
    _rmtree(logdir)
    return r


def simple_spread(seed: int, args) -> dict:
    code, wall, summary, rows, logdir = run(["--env", "pz:simple_spread_v3", "--seed", str(seed),
                                             "--max-env-steps", str(args.spread_steps)], args.timeout)
    _rmtree(logdir)
    reached = next((row for row in rows if (row["return_mean"] or -math.inf) >= args.spread_target), None)  # null: none yet
    in_time = [row for row in rows if row["elapsed_s"] <= SPREAD_TARGET_S]
    return {"return_at_target_s": in_time[-1]["return_mean"] if in_time else None, "seed": seed, "exit": code, "wall_s": wall, "env_steps": summary.get("env_steps"),
            "env_steps_per_s": summary.get("env_steps_per_s"), "return_mean": summary.get("return_mean"),
            "return_by_agent": summary.get("return_by_agent"), "target": args.spread_target,
            "reached_s": reached["elapsed_s"] if reached else None,
            "reached_env_steps": reached["env_steps"] if reached else None,
            "met": bool(reached) and reached["elapsed_s"] <= SPREAD_TARGET_S}


def _rmtree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _terminate(signum, frame):
    raise SystemExit(128 + signum)   # unwinds through run()'s finally: the run is stopped


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tasks", nargs="*", choices=["connect_four", "simple_spread", []], default=[],
                   help="what to run (default: both)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--c4-steps", type=int, default=FULL["c4_steps"],
                   help="connect_four env steps of training (default: the preset's budget and stop rule)")
    p.add_argument("--spread-steps", type=int, default=FULL["spread_steps"], help="simple_spread agent steps")
    p.add_argument("--spread-target", type=float, default=SPREAD_REFERENCE,
                   help="simple_spread per-agent return to reach (default: %(default)s, the reference)")
    p.add_argument("--games", type=int, default=FULL["games"], help="connect_four evaluation games")
    p.add_argument("--timeout", type=float, default=FULL["timeout"], help="seconds per training run")
    p.add_argument("--quick", action="store_true", help="seconds: tiny budgets (flags given still win)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    argv = sys.argv[1:] if argv is None else argv
    if "--quick" in argv:
        p.set_defaults(**QUICK)
    args = p.parse_args(argv)
    tasks = args.tasks or ["connect_four", "simple_spread"]
    signal.signal(signal.SIGTERM, _terminate)
    out: dict = {"quick": args.quick}
    try:
        if "connect_four" in tasks:
            runs = [connect_four(seed, args) for seed in args.seeds]
            out["connect_four"] = {
                "command": f"python -m shmrl.run {' '.join(c4_args(0, args)).replace('--seed 0', '--seed S')}; "
                           f"python -m shmrl.eval policy-shared.onnx --env pz:connect_four_v3 --opponent random "
                           f"--episodes {args.games} [--stochastic]",
                "runs": runs, "target": {"win_rate": C4_TARGET_WIN_RATE, "wall_s": C4_TARGET_S},
                "median_win_rate_greedy": _median(r["win_rate_greedy"] for r in runs),
                "median_win_rate_sampled": _median(r["win_rate_sampled"] for r in runs),
                "median_wall_s": _median(r["wall_s"] for r in runs),
                "median_reached_s": _median(r["reached_s"] for r in runs), "all_met": all(r["met"] for r in runs)}
            if not args.json:
                for r in runs:
                    print(f"connect_four seed {r['seed']}: win rate vs random {r['win_rate_greedy']} greedy, "
                          f"{r['win_rate_sampled']} sampled, {r['games']} games; {r['env_steps']} env steps, exit "
                          f"{r['exit']}; {r['wall_s']:.1f} s from command start; {C4_TARGET_WIN_RATE} first reached "
                          f"in training at {r['reached_s']} s; target met: {r['met']}", flush=True)
        if "simple_spread" in tasks:
            runs = [simple_spread(seed, args) for seed in args.seeds]
            out["simple_spread"] = {
                "command": f"python -m shmrl.run --env pz:simple_spread_v3 --seed S --max-env-steps {args.spread_steps}",
                "runs": runs, "target": {"return": args.spread_target, "wall_s": SPREAD_TARGET_S},
                "median_return": _median(r["return_mean"] for r in runs),
                "median_reached_s": _median(r["reached_s"] for r in runs), "all_met": all(r["met"] for r in runs)}
            if not args.json:
                for r in runs:
                    print(f"simple_spread seed {r['seed']}: return {r['return_at_target_s']} at {SPREAD_TARGET_S:.0f} s; "
                          f"{r['return_mean']} per agent after "
                          f"{r['env_steps']} agent steps in {r['wall_s']:.1f} s; {args.spread_target} reached at "
                          f"{r['reached_s']} s; target met: {r['met']}", flush=True)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(out))
    return 0


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


if __name__ == "__main__":
    sys.exit(main())
