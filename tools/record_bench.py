"""The targets of recording (issue 25): what --record costs, and what --pretrain saves.

    python tools/record_bench.py overhead                    # CartPole: steps/s with and without --record
    python tools/record_bench.py overhead --env gym:HalfCheetah-v5 --steps 200000 --sims 4
    python tools/record_bench.py pretrain                    # CartPole: 20 expert episodes, 3 seeds
    python tools/record_bench.py pretrain --env gym:HalfCheetah-v5 --expert-return 3000 --episodes 50 --sims 4
    python tools/record_bench.py pretrain --quick --json     # seconds: the same steps, tiny

``overhead`` runs ``python -m shmrl.run`` for ``--steps`` env steps (no stop return) with
and without ``--record``, alternating, ``--repeats`` times each, and prints each one's
median env steps per second (the run's own, from its first env steps) and CPU time per env
step (the run and its simulators), and the cost of recording in percent of each. On a
machine others load too, the CPU time per step is the steadier of the two.

``pretrain`` trains an expert to ``--expert-return`` (``--stop-return``), records
``--episodes`` of its episodes with ``python -m shmrl.record --sims`` (sampling, as in
training), then for each seed runs PPO from scratch and ``--pretrain`` on that dataset
to ``--target`` (default: the env's threshold), and prints the env steps and wall time
of each (wall time from process start: the cloning counts) and their medians' ratios.
``--keep DIR`` keeps the expert and its dataset there, and a later call uses them again.
Every run has its own process group and is stopped if it outlives ``--timeout``.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/record_bench.py`: run as tools.record_bench
    import run_as_module
    run_as_module.run(__file__)

import argparse
import contextlib
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.shared import popen_group, read_logdir, run_shmrl, stop_process

QUICK = {"pretrain": dict(seeds=[0], sims=1, expert_return=60.0, episodes=5, target=80.0, timeout=120.0,
                          pretrain_steps=50),
         "overhead": dict(steps=4000, repeats=1, sims=1)}


def say(a, line: str) -> None:
    """A progress line: on stdout, or on stderr when stdout is the one JSON object."""
    print(line, file=sys.stderr if a.json else sys.stdout, flush=True)


def timed_run(args: list[str], timeout: float) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory() as logdir:
        code, wall, err = run_shmrl([*args, "--logdir", logdir], timeout)
        summary, _ = read_logdir(logdir)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)   # the run and its simulators, reaped
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    if code not in (0, 1):
        sys.stderr.write(err[-2000:])
    return {"exit": code, "wall_s": wall, "env_steps": summary.get("env_steps"),
            "steps_per_s": summary.get("env_steps_per_s") or 0.0,   # the run's own: from its first env steps
            "cpu_us_per_step": 1e6 * cpu / max(summary.get("env_steps") or 0, 1),
            "return_mean": summary.get("return_mean"), "solved": summary.get("solved", False)}


def overhead(a) -> dict:
    common = ["--env", a.env, "--sims", str(a.sims), "--max-env-steps", str(a.steps), "--stop-return", "inf",
              "--seed", "0", *a.extra]
    runs = {"plain": [], "record": []}
    with tempfile.TemporaryDirectory(dir=a.workdir) as work:
        for i in range(a.repeats):
            for kind in ("plain", "record"):
                extra = ["--record", str(Path(work) / f"ds{i}")] if kind == "record" else []
                r = timed_run([*common, *extra], a.timeout)
                runs[kind].append(r)
                say(a, f"{kind:7s} {r['env_steps']} env steps in {r['wall_s']:.2f} s: {r['steps_per_s']:.0f} steps/s, "
                       f"{r['cpu_us_per_step']:.1f} CPU us per step")
    med = {k: statistics.median(r["steps_per_s"] for r in v) for k, v in runs.items()}
    cpu = {k: statistics.median(r["cpu_us_per_step"] for r in v) for k, v in runs.items()}
    return {"env": a.env, "runs": runs, "median_steps_per_s": med, "median_cpu_us_per_step": cpu,
            "record_cost_pct": 100.0 * (1 - med["record"] / med["plain"]) if med["plain"] else None,
            "record_cpu_cost_pct": 100.0 * (cpu["record"] / cpu["plain"] - 1) if cpu["plain"] else None}


def record(a, expert_dir: Path, dataset: Path) -> None:
    """``--episodes`` episodes of the expert, sampled as in training, into ``dataset``."""
    rec = popen_group([sys.executable, "-m", "shmrl.record", "--env", a.env, "--sims", str(a.sims), "--policy",
                       str(expert_dir / "policy.onnx"), "--episodes", str(a.episodes), "--out", str(dataset)],
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = rec.communicate(timeout=a.timeout)[0]
    finally:
        stop_process(rec)
    if rec.returncode != 0:
        raise SystemExit(f"recording failed ({rec.returncode}): {out[-1000:]}")


def pretrain(a) -> dict:
    with (contextlib.nullcontext(a.keep) if a.keep else tempfile.TemporaryDirectory(dir=a.workdir)) as work:
        expert_dir, dataset = Path(work) / "expert", Path(work) / "dataset"
        if not read_logdir(expert_dir)[0].get("solved"):   # --keep: an expert of an earlier call is used again
            code, wall, err = run_shmrl(["--env", a.env, "--sims", str(a.sims), "--stop-return",
                                         str(a.expert_return), "--seed", "100", "--logdir", str(expert_dir),
                                         *a.extra], a.timeout)
            if code != 0:
                raise SystemExit(f"the expert did not reach {a.expert_return} (exit {code}): {err[-1000:]}")
        expert = read_logdir(expert_dir)[0]
        say(a, f"expert: return {expert['return_mean']:.1f} after {expert['env_steps']} env steps in "
               f"{expert['wall_s']:.1f} s")
        if not (dataset / "manifest.json").exists():   # likewise its recording
            record(a, expert_dir, dataset)
        from shmrl.files.dataset import Dataset

        episodes = list(Dataset(dataset).episodes())
        whole = [float(ep.rewards.sum()) for ep in episodes if not ep.stopped]
        demo = {"episodes": len(episodes), "whole_episodes": len(whole),
                "return_mean": statistics.fmean(whole) if whole else None}
        say(a, f"dataset: {demo['episodes']} episodes ({demo['whole_episodes']} whole, mean return "
               f"{demo['return_mean']})")
        runs = {"scratch": [], "pretrain": []}
        target = [] if a.target is None else ["--stop-return", str(a.target)]
        for seed in a.seeds:
            for kind in ("scratch", "pretrain"):
                extra = (["--pretrain", str(dataset), "--pretrain-steps", str(a.pretrain_steps)]
                         if kind == "pretrain" else [])
                r = timed_run(["--env", a.env, "--sims", str(a.sims), "--seed", str(seed), *target, *extra, *a.extra],
                              a.timeout)
                r["seed"] = seed
                runs[kind].append(r)
                say(a, f"seed {seed} {kind:8s}: {'solved' if r['solved'] else 'NOT solved'} in {r['wall_s']:.1f} s, "
                       f"{r['env_steps']} env steps, return {r['return_mean']}")

    def median(kind, key):
        return statistics.median(r[key] or 0 for r in runs[kind])

    return {"env": a.env, "expert_return": expert["return_mean"], "dataset": demo, "runs": runs,
            "env_steps_ratio": median("pretrain", "env_steps") / max(median("scratch", "env_steps"), 1),
            "wall_ratio": median("pretrain", "wall_s") / median("scratch", "wall_s"),
            "all_solved": all(r["solved"] for v in runs.values() for r in v)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("overhead", "pretrain"))
    p.add_argument("--env", default="CartPole-v1")
    p.add_argument("--sims", type=int, default=4)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=300_000, help="overhead: env steps per run")
    p.add_argument("--repeats", type=int, default=3, help="overhead: runs of each kind")
    p.add_argument("--expert-return", type=float, default=490.0, help="pretrain: the expert's stop return")
    p.add_argument("--episodes", type=int, default=20, help="pretrain: expert episodes recorded")
    p.add_argument("--target", type=float, default=None, help="pretrain: the return to reach (default: the env's)")
    p.add_argument("--pretrain-steps", type=int, default=5000)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--keep", metavar="DIR", help="pretrain: keep the expert and its dataset in DIR, and use "
                   "those already there")
    p.add_argument("--workdir", default=None, help="where the datasets go, made if missing (default: the system's temp folder)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--quick", action="store_true", help="seconds: tiny runs (flags given still win)")
    p.epilog = "Arguments after -- go to every python -m shmrl.run."
    argv = sys.argv[1:] if argv is None else list(argv)
    argv, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    mode = next((x for x in argv if x in QUICK), None)
    if "--quick" in argv and mode:
        p.set_defaults(**QUICK[mode])
    a = p.parse_args(argv)
    a.extra = extra
    if a.workdir:   # a folder named that does not exist yet is made, not a traceback
        Path(a.workdir).mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    result = overhead(a) if a.mode == "overhead" else pretrain(a)
    result["bench_s"] = time.time() - t0
    if a.json:
        print(json.dumps(result))
    elif a.mode == "overhead":
        print(f"{a.env}: {result['median_steps_per_s']['plain']:.0f} steps/s without --record, "
              f"{result['median_steps_per_s']['record']:.0f} with: recording costs {result['record_cost_pct']:.1f}% of "
              f"the throughput; CPU per env step (learner and simulators) {result['median_cpu_us_per_step']['plain']:.1f} "
              f"and {result['median_cpu_us_per_step']['record']:.1f} us: {result['record_cpu_cost_pct']:+.1f}%")
    else:
        print(f"{a.env}: --pretrain needs {result['env_steps_ratio']:.2f}x the env steps and "
              f"{result['wall_ratio']:.2f}x the wall time of PPO from scratch (medians); all solved: "
              f"{result['all_solved']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
