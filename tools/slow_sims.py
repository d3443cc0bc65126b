#!/usr/bin/env python3
"""shmrl beside stable-baselines3 + rl-zoo3's tuned PPO or SAC (--algo) on a slow simulator:
both trainers' envs throttled to the same aggregate rate (tools/slow_sim.py), seed by seed,
in turns (or --at-once: at the same time, each on its own core).
Returns at given env steps and wall times, how busy shmrl's learner was and how far its
policy moved per update (PPO: approx_kl, clip_frac; SAC: the replay ratio it kept up), a
plot of both curves, JSON; with --results, one file per seed (a long comparison in parts).

    python tools/slow_sims.py                                  # HalfCheetah-v5, 1000 steps/s, 100k steps, 3 seeds
    python tools/slow_sims.py --envs Hopper-v5 --steps 300000 --plot hopper.png
    python tools/slow_sims.py --no-sb3 --seeds 0 -- --learn-per-step off   # shmrl alone, flags of its own
    python tools/slow_sims.py --clients --no-sb3               # shmrl's simulators as external TCP clients
    python tools/slow_sims.py --at-once --steps 1000000        # both at once, a core each: 1M steps in ~35 min a seed
    python tools/slow_sims.py --quick --json                   # seconds: InvertedPendulum-v5, one seed
    python tools/slow_sims.py --algo sac --steps 300000 --seeds 0 --results sac-runs   # a seed at a time:
    python tools/slow_sims.py --algo sac --steps 300000 --seeds 0 1 2 --results sac-runs   # seed 0 read back
    python tools/slow_sims.py --algo sac --quick --json        # seconds: Pendulum-v1, one seed

SB3 runs as tools/zoo.py runs it (rl-zoo3's own training script and ppo.yml or sac.yml entry
of the base env; --algo auto: its SAC), on ``Throttled<ENV>`` (one process at --rate); shmrl
on ``gym:<ENV>`` itself with ``--algo`` as given,
throttled in every process (tools/slow_site on PYTHONPATH: tools/slow_sim.py), so that it
takes the env's own preset and slow profile as a user's run would, with no flags: --sims S
simulators (or, --clients, S ``python -m shmrl.sim --connect`` clients) at --rate / S each.
Each stops at --steps env steps or after --seconds (default: --steps / --rate x 4 + 60).
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/slow_sims.py`: run as tools.slow_sims
    import run_as_module
    run_as_module.run(__file__)

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tools import shared, slow_sim, zoo  # slow_sim: checked importable here before a trainer needs it
from tools.shared import REPO, interrupt_group, popen_group, read_logdir

HERE = Path(__file__).resolve().parent
FACTORIES = {base: name for name, base in slow_sim.BASE_IDS.items()}


def smaller_batch(env: str) -> int:
    """The smaller train batch of the env's preset and its slow profile (presets.toml): what
    each external client's messages are a share of, as shmrl's own simulators' are."""
    from shmrl.trainer.learn_per_step import slow_config
    from shmrl.config.settings import Config, resolve_config
    from shmrl.envs.make import env_spec

    spec = env_spec(env)
    fast = resolve_config(Config(env=env), spec)
    slow = slow_config(fast, spec, set())[1]
    return min(fast.train_batch_size, slow.train_batch_size if slow else fast.train_batch_size)


def run_shmrl_clients(env: str, seed: int, seconds: float, folder: Path, extra: list[str], env_vars: dict,
                      clients: int) -> dict:
    """shmrl with no simulator of its own (--sims 0) and ``clients`` external ones,
    ``python -m shmrl.sim --connect``, each throttled by ``env_vars``; stopped at its step
    budget or after ``seconds`` (its clients with it)."""
    logdir, log = folder / "shmrl", folder / "shmrl.log"
    environ = {**os.environ, **env_vars}
    cmd = [sys.executable, "-m", "shmrl.run", "--env", env, "--seed", str(seed), "--logdir", str(logdir),
           "--stop-return", "inf", "--log-every", "30", "--sims", "0", "--tcp-port", "0", *extra]
    start, sims = time.monotonic(), []
    with open(log, "w") as out:
        learner = popen_group(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=environ)
        try:
            port = None
            while port is None and learner.poll() is None and time.monotonic() - start < 120:
                found = re.search(r"listening for RLlink clients on [\d.]+:(\d+)", log.read_text())
                port = found and int(found.group(1))
                time.sleep(0.2)
            if port is None:
                raise RuntimeError(f"shmrl did not listen; its log:\n{log.read_text()[-3000:]}")
            sims = [popen_group([sys.executable, "-m", "shmrl.sim", "--connect", f"127.0.0.1:{port}", "--env", env,
                                 "--seed", str(seed * 1000 + k)], cwd=REPO, env=environ,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for k in range(clients)]
            learner.wait(timeout=max(seconds - (time.monotonic() - start), 1))
        except subprocess.TimeoutExpired:
            pass
        finally:
            for proc in [learner, *sims]:
                if proc.poll() is None:
                    interrupt_group(proc)
    return zoo.shmrl_result(logdir, log, " ".join(["python -m shmrl.run --env", env, "--sims 0 --tcp-port 0",
                                                   *extra, f"+ {clients} x python -m shmrl.sim --connect"]))


def learner_stats(summary: dict, rows: list[dict]) -> dict:
    """The profile and algorithm shmrl chose (summary.json's), how busy its learner was, how
    much it learned per batch, and how far each update moved (PPO), or the replay ratio it
    kept up, its Q values and temperature (SAC)."""
    if not rows:
        return {}
    common = {"profile": summary.get("profile"), "algo": (summary.get("config") or {}).get("algo"),
              "learner_share_median": statistics.median(r["learner_share"] for r in rows)}
    sac = [r for r in rows if "replay_ratio" in r]
    if sac:
        return {**common, "replay_ratio_median": statistics.median(r["replay_ratio"] for r in sac),
                "grad_steps": sac[-1]["grad_steps"], "q_mean_last": sac[-1]["q_mean"], "alpha_last": sac[-1]["alpha"]}
    return {**common,
            "learn_levels": sorted({r["learn_level"] for r in rows}),
            "epochs_run_median": statistics.median(r["epochs_run"] for r in rows),
            "approx_kl_median": statistics.median(r["approx_kl"] for r in rows),
            "approx_kl_max": max(r["approx_kl"] for r in rows),
            "clip_frac_median": statistics.median(r["clip_frac"] for r in rows),
            "clip_frac_max": max(r["clip_frac"] for r in rows)}


def summarize(run: dict, steps_at: list[int], times_at: list[float]) -> dict:
    curve = run["curve"]
    return {"return_at_steps": {str(n): zoo.at_steps(curve, n) for n in steps_at},
            "return_at_s": {str(int(t)): zoo.at(curve, "wall_s", t) for t in times_at},
            "final": curve[-1] if curve else None}


def one_seed(env: str, seed: int, a, py, folder: Path) -> dict:
    seconds = a.seconds or a.steps / a.rate * 4 + 60
    entry = {"seed": seed}
    runs = {}
    if a.sb3:
        runs["sb3"] = lambda: run_sb3(env, seed, a, py, seconds, folder / "sb3")
    if a.shmrl:
        runs["shmrl"] = lambda: run_shmrl(env, seed, a, seconds, folder / "shmrl")
    if a.at_once:   # each in a thread pinned to its own core: the processes it starts inherit that
        cores = sorted(os.sched_getaffinity(0))
        with ThreadPoolExecutor(len(runs)) as pool:
            futures = {who: pool.submit(pinned, cores[k], run) for k, (who, run) in enumerate(runs.items())}
            entry.update((who, f.result()) for who, f in futures.items())
    else:
        entry.update((who, run()) for who, run in runs.items())
    steps_at = sorted({int(a.steps * f) for f in (0.25, 0.5, 1.0)} | {n for n in zoo.STEPS if n <= a.steps})
    times_at = [t for t in (30, 60, 120, 300, 600, 1200) if t <= seconds]
    for who in ("sb3", "shmrl"):
        if who in entry:
            entry[who].update(summarize(entry[who], steps_at, times_at))
    return entry


def pinned(core: int, run) -> dict:
    """``run()`` with this thread, and so every process it starts, on ``core`` alone; the
    result says which core, and when it ran (time.time())."""
    os.sched_setaffinity(0, {core})
    start = time.time()
    return {**run(), "core": core, "span": [start, time.time()]}


def sb3_algo(algo: str) -> str:
    """SB3's side of shmrl's --algo: its PPO, or its SAC (what auto picks on slow simulators)."""
    return "ppo" if algo == "ppo" else "sac"


def run_sb3(env: str, seed: int, a, py, seconds: float, folder: Path) -> dict:
    folder.mkdir()
    return zoo.run_sb3(py, "Throttled" + env, seed, seconds, folder, sb3_algo(a.algo),
                       extra=("--gym-packages", "tools.slow_sim", "-n", str(a.steps)),
                       env_vars={"PYTHONPATH": str(REPO), slow_sim.RATE_VAR: str(a.rate),
                                 **({"OMP_NUM_THREADS": "1"} if a.at_once else {})},
                       entry_of=env)


def run_shmrl(env: str, seed: int, a, seconds: float, folder: Path) -> dict:
    folder.mkdir()
    pythonpath = os.pathsep.join([str(HERE / "slow_site"), str(REPO),
                                  os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    extra = ["--max-env-steps", str(a.steps), "--algo", a.algo, *a.extra]
    env_vars = {"PYTHONPATH": pythonpath, slow_sim.RATE_VAR: str(a.rate / a.sims)}
    if a.clients:   # each client's messages its share of a batch, as the local simulators' are
        # (with --sims 0 a message would be a whole batch: 4 clients sending together with --async
        # bring 4 batches at once, and half their steps were dropped as stale)
        per_client = -(-smaller_batch(f"gym:{env}") // a.sims)
        result = run_shmrl_clients(f"gym:{env}", seed, seconds, folder,
                                   ["--env-steps-per-sample", str(per_client), *extra], env_vars, a.sims)
    else:
        result = zoo.run_shmrl(f"gym:{env}", seed, seconds, folder, ["--sims", str(a.sims), *extra],
                               env_vars=env_vars)
    result["learner"] = learner_stats(*read_logdir(folder / "shmrl"))
    return result


def medians(runs: list[dict]) -> dict:
    out = {}
    for who in ("sb3", "shmrl"):
        mine = [r[who] for r in runs if who in r]
        if not mine:
            continue
        for key in ("return_at_steps", "return_at_s"):
            out[f"{who}_{key}_mean"] = {
                k: (statistics.mean(v) if v else None)
                for k in mine[0][key] for v in [[m[key][k] for m in mine if m[key].get(k) is not None]]}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--envs", nargs="+", default=["HalfCheetah-v5"], choices=sorted(FACTORIES))
    p.add_argument("--algo", choices=("ppo", "sac", "auto"), default="ppo",
                   help="shmrl's --algo, and SB3's algorithm beside it (its SAC for sac and auto) "
                        "(default: %(default)s)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rate", type=float, default=1000.0, help="env steps per second, all simulators together "
                                                             "(default: %(default)s)")
    p.add_argument("--steps", type=int, default=100_000, help="env steps of each run (default: %(default)s)")
    p.add_argument("--seconds", type=float, help="stop each run after this long even short of --steps (default: "
                                                 "--steps / --rate x 4 + 60; more on a busy machine)")
    p.add_argument("--sims", type=int, default=4, help="shmrl's simulators, each at --rate / S (default: %(default)s)")
    p.add_argument("--clients", action="store_true",
                   help="shmrl's simulators are external clients (python -m shmrl.sim --connect), not its own")
    p.add_argument("--sb3", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--shmrl", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--at-once", action="store_true",
                   help="run both trainers at the same time, each on its own CPU core (SB3 on the first, shmrl's "
                        "learner and simulators on the second), instead of in turns: half the wall time on a 2-core "
                        "machine, and neither takes the other's core")
    p.add_argument("--python", type=Path, help="a python with rl_zoo3 and mujoco (default: tools/zoo.py's venv)")
    p.add_argument("--plot", type=Path, help="write both trainers' curves to this PNG")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--results", type=Path,
                   help="a folder: each seed's result is written there as it ends (ENV-ALGO-seedN.json), and a seed "
                        "whose file is there, from the same settings, is read instead of run again: a long comparison "
                        "in parts (one sitting a seed)")
    p.add_argument("--quick", action="store_true", help="InvertedPendulum-v5 (--algo sac or auto: Pendulum-v1), seed "
                                                        "0, 5000 steps (SAC: 1500, within 180 s) at 1000/s")
    p.add_argument("extra", nargs="*", help="after --: extra arguments for shmrl.run")
    a = p.parse_args(argv)
    usable = len(os.sched_getaffinity(0))
    if a.at_once and usable < a.sb3 + a.shmrl:
        p.error(f"--at-once needs a CPU core for each trainer; this process may use {usable}")
    if a.quick:   # SAC: an env in rl-zoo3's sac.yml, whose warm-up (100 env steps) leaves time to learn
        a.envs, a.seeds, a.steps, a.rate, a.sims = ["InvertedPendulum-v5"], [0], 5000, 1000.0, 2
        if a.algo != "ppo":   # the learners set the pace (a gradient step per env step), not the throttle
            a.envs, a.steps, a.seconds = ["Pendulum-v1"], 1500, a.seconds or 180.0
    py = (a.python or shared.ZOO.ensure(shared.ZOO.folder)) if a.sb3 else None
    settings = {"algo": a.algo, "rate": a.rate, "steps": a.steps, "sims": a.sims, "clients": a.clients,
                "at_once": a.at_once, "extra": a.extra, "sb3": a.sb3, "shmrl": a.shmrl}
    results = {**settings, "load_before": os.getloadavg(), "envs": {}}
    if a.results:
        a.results.mkdir(parents=True, exist_ok=True)
    for env in a.envs:
        runs = []
        for seed in a.seeds:
            runs.append(seed_result(env, seed, a, py, settings))
            print_run(env, runs[-1], sys.stderr if a.json else sys.stdout)   # each seed's, as it ends
        results["envs"][env] = {"runs": runs, **medians(runs)}
    results["load_after"] = os.getloadavg()
    if a.plot:
        zoo.plot(results, a.plot, title=f"shmrl and SB3 + rl-zoo3, every env throttled to {a.rate:.0f} steps/s in all")
    if a.json:
        print(json.dumps(results))
    else:
        for env, r in results["envs"].items():
            for key in ("return_at_steps_mean", "return_at_s_mean"):
                parts = [f"{who} " + " ".join(f"{k}={zoo.fmt(v)}" for k, v in r[f"{who}_{key}"].items())
                         for who in ("shmrl", "sb3") if f"{who}_{key}" in r]
                print(f"{env} {key.replace('_', ' ')} over {len(a.seeds)} seeds: " + " | ".join(parts))
    return 0


def seed_result(env: str, seed: int, a, py, settings: dict) -> dict:
    """One seed's result: read from --results where an earlier sitting left it (with the same
    settings: else an error, never a mix), else run and, with --results, written there."""
    file = a.results / f"{env}-{a.algo}-seed{seed}.json" if a.results else None
    if file is not None and file.exists():
        kept = json.loads(file.read_text())
        if kept.get("settings") != settings:
            raise SystemExit(f"error: {file} was measured with {kept.get('settings')}, not {settings}: move it away "
                             "or give its settings")
        print(f"{env} seed {seed}: read from {file}", file=sys.stderr, flush=True)
        return kept["entry"]
    with tempfile.TemporaryDirectory(prefix=f"shmrl-slow-{env}-") as tmp:
        entry = one_seed(env, seed, a, py, Path(tmp))
    if file is not None:   # whole or not at all: a sitting stopped mid-write leaves no half file
        part = file.with_suffix(".part")
        part.write_text(json.dumps({"settings": settings, "entry": entry}))
        part.replace(file)
    return entry


def print_run(env: str, entry: dict, out=sys.stdout) -> None:
    for who in ("sb3", "shmrl"):
        if who in entry:
            r = entry[who]
            steps = " ".join(f"{int(n) // 1000}k={zoo.fmt(v)}" for n, v in r["return_at_steps"].items())
            times = " ".join(f"{t}s={zoo.fmt(v)}" for t, v in r["return_at_s"].items())
            learner = r.get("learner", {})
            profile = learner.get("profile") or {}
            extra = ""
            if learner:
                extra = (f" | {learner.get('algo')}, {profile.get('name')} profile "
                         f"({zoo.fmt(profile.get('sim_rate'))}/s at the first batch) | learner "
                         f"{100 * learner['learner_share_median']:.0f}% ")
                extra += (f"replay ratio {learner['replay_ratio_median']:.2f}" if "replay_ratio_median" in learner else
                          f"levels {learner['learn_levels']} kl max {learner['approx_kl_max']:.3f} "
                          f"clip max {learner['clip_frac_max']:.2f}")
            print(f"{env} seed {entry['seed']} {who:5s}: {steps} | {times} | {zoo.fmt(r.get('env_steps'))} steps, "
                  f"{zoo.fmt(r.get('env_steps_per_s'))}/s{extra}", file=out, flush=True)


if __name__ == "__main__":
    sys.exit(main())
