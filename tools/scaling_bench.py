"""``python tools/bench.py scaling``: how the time to solve scales with the simulators: time
to solve CartPole-v1 and to reach 3000 on HalfCheetah-v5 at ``--sims 1, 2, 4, ...`` up to
the usable cores, with the env steps per second and the learner's busy share at each.

    python tools/bench.py scaling [--envs CartPole-v1 gym:HalfCheetah-v5] [--sims 1 2 ...] [--seeds 0 1 2]
                                  [--timeout 300] [--device cpu] [--plot scaling.png]
    python tools/bench.py scaling --quick --json    # CartPole, --sims 1, one seed, a 4096-step budget

Each point is ``python -m shmrl.run --env ENV --sims N --seed S --logdir TMP`` (CartPole-v1
to its preset's stop return, HalfCheetah-v5 with ``--stop-return 3000``), this checkout's
shmrl, as a user runs it but for ``--max-seconds`` (the time limit: a run still short of
the target then ends itself, exit 1, and counts as not reached; one that outlives it by
GRACE_S is stopped as after Ctrl-C, then killed) and ``--no-plot``. What a point says
comes from the run's own summary.json and metrics.jsonl: the seconds from its process
start to the target (the last metrics row's ``elapsed_s``: the run ends on the return
that reached it, and that row is written as it ends), its env steps, its env steps per
second (the run's own figure: since its serving began, start-up before it left out), and
the learner's busy share (``learner_share``: the time spent updating and publishing over
the time since the training loop began). Seeds run in rounds (every env and sims count of
seed 0, then of seed 1, ...) so that a drift of the machine's load spreads over the
points; a point's figures are medians over its seeds, the time and env steps to the
target as censored medians (a run that did not reach it counts as longer than any that
did, so the median is there only when more than half reached it).

Module level: the standard library only, as tools/bench.py (whose fork server imports
this); matplotlib is imported where the plot is drawn.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from tools.shared import finished, median, read_logdir, repo_on_pythonpath, run_shmrl, started

# The envs and what each is run to: shmrl.run's flags for its target (none: the preset's stop return).
TARGETS = {"CartPole-v1": (), "gym:HalfCheetah-v5": ("--stop-return", "3000")}
ENVS = tuple(TARGETS)
GRACE_S = 60.0   # past --timeout, a run that has not ended by its own --max-seconds is stopped

# --quick: the pipeline end to end in seconds (the target is not expected within the budget).
QUICK = {"envs": ["CartPole-v1"], "sims": [1], "seeds": [0], "max_env_steps": 4096, "timeout": 120.0}


def usable_cores() -> int:
    return len(os.sched_getaffinity(0))


def default_sims(cores: int | None = None) -> list[int]:
    """1, 2, 4, ... doubling below ``cores`` (default: the usable ones), and ``cores`` itself:
    1 2 4 8 16 on 16 cores, 1 2 4 6 on 6, 1 2 on 2."""
    cores = cores or usable_cores()
    sims, n = [], 1
    while n < cores:
        sims.append(n)
        n *= 2
    return [*sims, cores]


def censored_median(values) -> float | None:
    """The median of figures where None is a run that never got there (longer than any
    that did): None unless more than half got there."""
    m = median(math.inf if v is None else v for v in values)
    return m if math.isfinite(m) else None


def torch_version() -> str | None:
    """The installed torch's version, read without importing it (the bench stays light)."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------- one run

def run_args(env: str, sims: int, seed: int, args) -> list[str]:
    """shmrl.run's command line for one point (the log folder comes after)."""
    out = ["--env", env, "--sims", str(sims), "--seed", str(seed), *TARGETS[env],
           "--max-seconds", f"{args.timeout:g}", "--no-plot"]
    if args.max_env_steps is not None:
        out += ["--max-env-steps", str(args.max_env_steps)]
    if args.device is not None:
        out += ["--device", args.device]
    return out


def run_point(env: str, sims: int, seed: int, args) -> dict:
    """One ``python -m shmrl.run`` to ``env``'s target, and what its log folder says."""
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="shmrl-scaling-") as logdir:
        code, process_wall, err = run_shmrl([*run_args(env, sims, seed, args), "--logdir", logdir],
                                            args.timeout + GRACE_S, env=repo_on_pythonpath())
        summary, rows = read_logdir(logdir)
    if code == 2:   # refused before it started (an unknown env, a bad flag): no point will do better
        last = err.strip().splitlines()[-1] if err.strip() else "no message"
        raise RuntimeError(f"shmrl.run {' '.join(run_args(env, sims, seed, args))} refused: {last}")
    if code not in (0, 1, None):
        sys.stderr.write(err[-3000:])
    reached = code == 0 and bool(summary.get("solved"))
    if reached and rows:
        seconds, source = rows[-1]["elapsed_s"], "metrics.jsonl"
    elif reached and "wall_s" in summary:
        seconds, source = summary["wall_s"], "summary.json"
    else:
        seconds, source = (process_wall if reached else None), ("process" if reached else None)
    config = summary.get("config") or {}
    return {"env": env, "sims": sims, "seed": seed, "exit": code, "reached": reached,
            "seconds": seconds, "seconds_from": source,
            "wall_s": summary.get("wall_s", process_wall), "process_wall_s": process_wall,
            "env_steps": summary.get("env_steps"), "env_steps_per_s": summary.get("env_steps_per_s"),
            "learner_share": summary.get("learner_share"), "updates": summary.get("updates"),
            "first_sample_s": summary.get("first_sample_s"), "return_mean": summary.get("return_mean"),
            "target": config.get("stop_return"), "device": summary.get("device"),
            "profile": (summary.get("profile") or {}).get("name"), "loadavg_before": round(load, 2)}


def point(env: str, sims: int, runs: list[dict]) -> dict:
    """The row of (env, sims): medians over its seeds."""
    mine = [r for r in runs if r["env"] == env and r["sims"] == sims]
    known = lambda key: [r[key] for r in mine if r[key] is not None]  # noqa: E731

    def med(key):
        xs = known(key)
        return median(xs) if xs else None

    return {"env": env, "sims": sims, "seeds": len(mine), "reached": sum(r["reached"] for r in mine),
            "seconds_median": censored_median(r["seconds"] for r in mine),
            "env_steps_median": censored_median(r["env_steps"] if r["reached"] else None for r in mine),
            "env_steps_per_s_median": med("env_steps_per_s"), "learner_share_median": med("learner_share"),
            "target": next(iter(known("target")), None)}


# ---------------------------------------------------------------- the subcommand

def scaling_bench(args) -> dict:
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print(f"note: no plot ({args.plot}): --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
    torch = torch_version()
    args.sims = sorted(set(args.sims))   # the speed-up is against the fewest
    extra = f" --max-env-steps {args.max_env_steps}" if args.max_env_steps is not None else ""
    device = f" --device {args.device}" if args.device else ""
    result = started(
        "scaling",
        f"per env, simulator count and seed, `python -m shmrl.run --env ENV --sims N --seed S --logdir TMP "
        f"--max-seconds {args.timeout:g} --no-plot{extra}{device}` (CartPole-v1 to its preset's stop return, "
        f"HalfCheetah-v5 with --stop-return 3000), one at a time, seeds in rounds; seconds to the target: "
        f"the run's own clock from its process start to its last metrics row (it ends on the return that "
        f"reached it); env steps, env steps per second (the run's: since its serving began) and the "
        f"learner's busy share (learner_share: updating and publishing over the time since its training "
        f"loop began) from its summary.json. A run still short of the target after --timeout "
        f"{args.timeout:g} s ends itself (--max-seconds) and counts as not reached. Figures per point: "
        f"medians over seeds, the seconds and env steps to the target censored (a run not reaching it "
        f"counts as longer than any: no median unless more than half reached it); torch {torch} "
        f"(the runs'), device {args.device or 'shmrl.run default'}" + (
            "; --quick: a small env-step budget, the target not expected (checks the pipeline)"
            if args.quick else ""),
        envs=args.envs, sims=args.sims, seeds=args.seeds, timeout=args.timeout,
        max_env_steps=args.max_env_steps, device=args.device, quick=args.quick,
        usable_cores=usable_cores())
    result["torch"] = torch
    runs = []
    for seed in args.seeds:
        for env in args.envs:
            for sims in args.sims:
                r = run_point(env, sims, seed, args)
                runs.append(r)
                if not args.json:
                    print("  " + run_line(r), file=sys.stderr, flush=True)
    result["runs"] = runs
    result["points"] = [point(env, sims, runs) for env in args.envs for sims in args.sims]
    for p in result["points"]:   # against the fewest simulators measured
        first = next(q for q in result["points"] if q["env"] == p["env"])
        p["speedup"] = (first["seconds_median"] / p["seconds_median"]
                        if first["seconds_median"] and p["seconds_median"] else None)
    result["plot"] = draw(result, args.plot) if args.plot else None
    return finished(result)


def run_line(r: dict) -> str:
    """One run, as it ends (the progress the table is built from)."""
    what = (f"reached in {r['seconds']:.1f} s" if r["reached"] else
            "NOT reached" + (f" (exit {r['exit']})" if r["exit"] != 1 else ""))
    rate = "n/a" if r["env_steps_per_s"] is None else f"{r['env_steps_per_s']:,.0f}"
    share = _pct(r["learner_share"])
    return (f"{r['env']} --sims {r['sims']} seed {r['seed']}: {what}, {r['env_steps']} env steps, "
            f"{rate} env steps/s, learner busy {share} (load {r['loadavg_before']})")


def _f(x, spec: str, none: str = "n/a") -> str:
    return none if x is None else format(x, spec)


def _pct(share: float | None) -> str:
    return "n/a" if share is None else f"{100 * share:.0f}%"


def print_scaling(r: dict) -> None:
    p = r["params"]
    print(f"scaling: time to the target against the simulators (medians over {len(p['seeds'])} seed(s); "
          f"{p['usable_cores']} usable cores; a run past {p['timeout']:g} s does not reach it)")
    print(f"  {'env':<20} | {'target':>6} | {'sims':>4} | {'s to target':>11} | {'speed-up':>8} | "
          f"{'env steps':>10} | {'env steps/s':>11} | {'learner busy':>12} | reached")
    for x in r["points"]:
        print(f"  {x['env']:<20} | {_f(x['target'], 'g'):>6} | {x['sims']:>4} | "
              f"{_f(x['seconds_median'], '.1f', 'not reached'):>11} | {_f(x['speedup'], '.2f'):>8} | "
              f"{_f(x['env_steps_median'], ',.0f'):>10} | {_f(x['env_steps_per_s_median'], ',.0f'):>11} | "
              f"{_pct(x['learner_share_median']):>12} | "
              f"{x['reached']}/{x['seeds']}")
    print("  s to target, env steps: to the target (censored medians); speed-up: the fewest sims' time "
          "over this one's; env steps/s and learner busy: over each whole run")
    if r["plot"]:
        print(f"  plot: {r['plot']}")


def add_scaling_parser(sub, common) -> None:
    """bench.py's ``scaling`` subcommand."""
    s = sub.add_parser("scaling", parents=[common],
                       help="time to solve against the number of simulators, with env steps/s and learner busy")
    s.add_argument("--envs", nargs="+", choices=ENVS, default=list(ENVS), help="envs to run to their targets")
    s.add_argument("--sims", type=int, nargs="+", default=default_sims(),
                   help="simulator counts (default: 1, 2, 4, ... and the usable cores: %(default)s)")
    s.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds; a point's figures are medians")
    s.add_argument("--timeout", type=_positive, default=300.0,
                   help="seconds per run (shmrl.run's --max-seconds): later, the target counts as not reached")
    s.add_argument("--max-env-steps", type=int, default=None,
                   help="shmrl.run's env-step budget (default: the preset's)")
    s.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                   help="shmrl.run's --device (default: none given, shmrl.run's own)")
    s.add_argument("--plot", type=Path, default=None, metavar="PATH.png",
                   help="draw the time to target and the env steps/s against the simulators (needs matplotlib)")


def _positive(text: str) -> float:
    x = float(text)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, not {text}")
    return x


# ---------------------------------------------------------------- the plot

def draw(result: dict, path: Path) -> str | None:
    """The plot into ``path`` (a PNG); its path, or None (one line says why) where
    matplotlib is missing or fails."""
    try:
        from matplotlib.figure import Figure   # Figure alone draws to files: no pyplot, no display
    except ImportError:
        print(f"note: no plot ({path}): --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return None
    envs = result["params"]["envs"]
    fig = Figure(figsize=(11, 3.8 * len(envs)), layout="constrained")
    axes = fig.subplots(len(envs), 2, squeeze=False)
    for (left, right), env in zip(axes, envs):
        points = [p for p in result["points"] if p["env"] == env]
        runs = [r for r in result["runs"] if r["env"] == env]
        sims = [p["sims"] for p in points]
        target = next((p["target"] for p in points if p["target"] is not None), None)
        done = [r for r in runs if r["reached"]]
        left.plot([r["sims"] for r in done], [r["seconds"] for r in done], "o", color="C0", alpha=0.35,
                  label="a seed")
        med = [p for p in points if p["seconds_median"] is not None]
        left.plot([p["sims"] for p in med], [p["seconds_median"] for p in med], "-o", color="C0", label="median")
        missed = [r["sims"] for r in runs if not r["reached"]]
        if missed:
            left.plot(missed, [result["params"]["timeout"]] * len(missed), "x", color="C3",
                      label="not reached (drawn at --timeout)")
        left.set_title(f"{env} to {target:g}" if target is not None else env)
        left.set_ylabel("seconds to target")
        rate = [p for p in points if p["env_steps_per_s_median"] is not None]
        right.plot([p["sims"] for p in rate], [p["env_steps_per_s_median"] for p in rate], "-o", color="C2",
                   label="env steps/s")
        right.set_ylabel("env steps/s (median)")
        busy = right.twinx()
        share = [p for p in points if p["learner_share_median"] is not None]
        busy.plot([p["sims"] for p in share], [100 * p["learner_share_median"] for p in share], "--s",
                  color="C1", label="learner busy %")
        busy.set_ylim(0, 100)
        busy.set_ylabel("learner busy %")
        right.set_title(f"{env}: sampling and the learner")
        for ax in (left, right):
            ax.set_xscale("log", base=2)
            ax.set_xticks(sims, [str(n) for n in sims])
            ax.minorticks_off()
            ax.set_xlabel("simulators (--sims)")
            ax.grid(alpha=0.3)
        left.set_ylim(bottom=0)
        right.set_ylim(bottom=0)
        left.legend(fontsize=8)
        lines = right.get_legend_handles_labels()
        more = busy.get_legend_handles_labels()
        right.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="lower right")
    fig.suptitle(f"time to target against simulators ({result['host_before']['cpus']} usable cores)")
    try:
        fig.savefig(path, dpi=110)
    except (OSError, ValueError) as e:
        print(f"note: no plot: {path}: {e}", file=sys.stderr)
        return None
    print(f"wrote {path}", file=sys.stderr)
    return str(path)
