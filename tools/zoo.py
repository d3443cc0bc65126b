#!/usr/bin/env python3
"""shmrl beside stable-baselines3 with rl-zoo3's tuned PPO, in turns, seed by seed: return
against wall time and env steps, time to targets, throughput, and a plot of both curves.

    python tools/zoo.py                                   # HalfCheetah-v5 and Hopper-v5, 3 seeds, 300 s each
    python tools/zoo.py --envs Walker2d-v5 Ant-v5 --no-sb3 --seeds 0   # shmrl's presets alone
    python tools/zoo.py --no-shmrl --json                 # SB3 alone (its figures to set beside shmrl's)
    python tools/zoo.py --envs ALE/Breakout-v5 --seeds 0 --seconds 300 # Atari: frames/s of both
    python tools/zoo.py --quick --json                    # seconds: InvertedPendulum-v5, one seed, both
    python tools/zoo.py --setup                           # only create the SB3 virtualenv

SB3 runs rl-zoo3's own training script (``python -m rl_zoo3.train --algo ppo``) with
rl-zoo3's own hyperparameters for the env (its ppo.yml entry, of the -v4 env where there
is none for -v5: the same task; for an ALE game, zoo's "atari" entry on the game's
NoFrameskip-v4 version: AtariWrapper, 4 frames stacked, 8 envs x 128 steps, 4 epochs of
256, the settings CleanRL's ppo_atari uses too), in its own virtualenv (--venv, created on
first use with rl_zoo3, gymnasium[mujoco,atari] and torch==2.13.0, the same torch as
shmrl's), so nothing of it is reimplemented here. Its returns come from the Monitor file
zoo writes (every episode's return and time) and its env steps per second from zoo's own
log; shmrl's from metrics.jsonl; returns as the mean of the last 100 episodes. Each command
is timed from its launch and stopped with SIGINT after --seconds. The machine drifts: the
two run in turns, seed by seed.

The comparison docs/FIGURES.md quotes: SB3's return after --seconds of its own training, and
how long shmrl takes to reach it ("speedup" = SB3's seconds / shmrl's).
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/zoo.py`: run as tools.zoo
    import run_as_module
    run_as_module.run(__file__)

import argparse
import csv
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools import shared
from tools.shared import REPO, popen_group, read_logdir, wait_group_gone

HERE = Path(__file__).resolve()
TIMES = (30, 60, 120, 180, 300)         # seconds at which returns are reported
STEPS = (100_000, 300_000, 1_000_000)   # env steps at which returns are reported
# An ALE game's env step is 4 emulator frames on both sides (zoo's AtariWrapper, shmrl's
# AtariPreprocessing): Monitor counts frames, and Atari throughput is quoted in frames/s.
ATARI_FRAME_SKIP = 4


def frames_per_step(env: str) -> int:
    return ATARI_FRAME_SKIP if env.startswith("ALE/") else 1


def zoo_env(env: str) -> str:
    """The env id SB3 trains: an ALE game's NoFrameskip-v4 version (what zoo's Atari
    settings are for), anything else as it is."""
    if env.startswith("ALE/"):
        return env[4:].rsplit("-", 1)[0] + "NoFrameskip-v4"
    return env


def zoo_config(py: Path, env: str, folder: Path, entry_of: str | None = None, algo: str = "ppo") -> Path:
    """A hyperparameter file for ``env`` holding rl-zoo3's own ``algo`` entry for it (or
    for the same task's older version; "atari" for a NoFrameskip game), as zoo's ``-conf``
    takes it; ``entry_of``: the env whose entry to take (a throttled env takes its base env's)."""
    script = (f"import rl_zoo3, os, yaml, json; env = {entry_of or env!r}; name, version = env.rsplit('-', 1)\n"
              f"path = os.path.join(os.path.dirname(rl_zoo3.__file__), 'hyperparams', '{algo}.yml')\n"
              "table = yaml.safe_load(open(path))\n"
              "keys = (['atari'] if 'NoFrameskip' in env\n"
              "        else [env] + [f'{name}-{v}' for v in ('v5', 'v4', 'v3', 'v2')])\n"
              "key = next(k for k in keys if k in table)\n"
              "print(json.dumps({'key': key, 'params': table[key]}))")
    found = json.loads(subprocess.run([str(py), "-c", script], capture_output=True, text=True,
                                      check=True).stdout)
    conf = folder / "zoo.yml"
    conf.write_text(json.dumps({env: found["params"]}))   # JSON is YAML
    return conf


def stop_after(cmd: list, seconds: float, cwd: Path, log: Path, env_vars: dict | None = None) -> float:
    """Run ``cmd`` in its own session (``env_vars`` added to its environment); SIGINT after
    ``seconds`` (then SIGKILL if needed). Returns the launch time (time.time()). The child
    starts with SIGINT at its default even if this tool was started with it ignored
    (popen_group): else rl-zoo3 would train on until the SIGKILL."""
    t0 = time.time()
    with open(log, "w") as out:
        proc = popen_group(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                           env={**os.environ, **env_vars} if env_vars else None)
        try:
            proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
            wait_group_gone(proc.pid)   # what it started (a fork server) ends a moment after it
    return t0


def window_means(episodes: list[tuple[float, int, float]]) -> list[dict]:
    """(wall s, env steps, return) per episode -> the 100-episode mean after each."""
    out, returns = [], []
    for wall, steps, ret in episodes:
        returns.append(ret)
        last = returns[-100:]
        out.append({"wall_s": wall, "env_steps": steps, "return_mean": sum(last) / len(last)})
    return out


def run_sb3(py: Path, env: str, seed: int, seconds: float, folder: Path, algo: str = "ppo",
            extra: tuple = (), env_vars: dict | None = None, entry_of: str | None = None) -> dict:
    """rl-zoo3's training script for ``seconds``: its PPO or SAC with the entry
    ``zoo_config`` finds (``entry_of``'s), or another ``algo`` (``ppo_lstm``: sb3-contrib's
    RecurrentPPO) with zoo's own file for it; ``extra``: more of its arguments;
    ``env_vars``: added to its environment."""
    skip = frames_per_step(env)
    env = zoo_env(env)
    conf = ["-conf", str(zoo_config(py, env, folder, entry_of, algo))] if algo in ("ppo", "sac") else []
    t0 = stop_after([str(py), "-m", "rl_zoo3.train", "--algo", algo, "--env", env, "--seed", str(seed),
                     *conf, "--log-folder", str(folder / "zoo"), "--vec-env", "dummy",
                     "--eval-freq", "-1", "--save-freq", "-1", *extra],
                    seconds, folder, folder / "sb3.log", env_vars)
    monitors = sorted((folder / "zoo").rglob("*.monitor.csv"))
    if not monitors:
        raise RuntimeError(f"SB3 wrote no Monitor file; its log:\n{(folder / 'sb3.log').read_text()[-3000:]}")
    # One Monitor file per env (n_envs > 1): every env's episodes, in the order they ended.
    ended = []
    for monitor in monitors:
        with open(monitor) as f:
            t_start = json.loads(f.readline().lstrip("#"))["t_start"]
            ended += [(t_start + float(row["t"]) - t0, int(row["l"]), float(row["r"])) for row in csv.DictReader(f)]
    episodes, steps = [], 0
    for wall, length, ret in sorted(ended):
        steps += round(length / skip)   # Monitor's lengths count frames under AtariWrapper
        episodes.append((wall, steps, ret))
    # Throughput from SB3's own log: its last total_timesteps and time_elapsed (Monitor
    # counts only finished episodes).
    log = (folder / "sb3.log").read_text()
    totals = [int(x) for x in _log_values(log, "total_timesteps")]
    elapsed = [float(x) for x in _log_values(log, "time_elapsed")]
    steps_per_s = totals[-1] / elapsed[-1] if totals and elapsed and elapsed[-1] else None
    # Its env steps: the more of its log's last total (SAC logs it every 4 episodes only) and its
    # finished episodes' steps.
    return {"curve": window_means(episodes), "env_steps_per_s": steps_per_s,
            "env_steps": max(totals[-1] if totals else 0, steps) or None,
            "command": " ".join(["python -m rl_zoo3.train --algo", algo, "--env", env, *extra])}


def _log_values(log: str, key: str) -> list[str]:
    """The values of ``key`` in SB3's logger tables (lines like ``|    fps    | 512 |``)."""
    out = []
    for line in log.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0] == key:
            out.append(cells[1])
    return out


def has_return(row: dict) -> bool:
    """A mean return in a metrics row or summary: null before the first episode (NaN
    in runs of older shmrl)."""
    value = row.get("return_mean")
    return value is not None and value == value


def run_shmrl(env: str, seed: int, seconds: float, folder: Path, extra: list[str],
              stop_return: float = float("inf"), env_vars: dict | None = None) -> dict:
    """``python -m shmrl.run --env ENV`` (an --env value: ``gym:HalfCheetah-v5``) for
    ``seconds``, or until ``stop_return``; its curve from metrics.jsonl. ``env_vars``:
    added to its environment."""
    logdir = folder / "shmrl"
    cmd = [sys.executable, "-m", "shmrl.run", "--env", env, "--seed", str(seed), "--logdir",
           str(logdir), "--stop-return", str(stop_return), "--log-every", "30", *extra]
    stop_after(cmd, seconds, REPO, folder / "shmrl.log", env_vars)
    return shmrl_result(logdir, folder / "shmrl.log", " ".join(["python -m shmrl.run --env", env, *extra]))


def shmrl_result(logdir: Path, log: Path, command: str) -> dict:
    """A shmrl run's curve (from metrics.jsonl and summary.json), throughput and command."""
    if not (logdir / "metrics.jsonl").exists():
        raise RuntimeError(f"shmrl wrote no metrics; its log:\n{log.read_text()[-3000:]}")
    summary, rows = read_logdir(logdir)
    curve = [{"wall_s": r["elapsed_s"], "env_steps": r["env_steps"], "return_mean": r["return_mean"]}
             for r in rows if has_return(r)]      # not before the first episode
    env_steps = rows[-1]["env_steps"] if rows else None
    if summary:   # where it stopped: the steps and return after the last update's row
        env_steps = summary["env_steps"]
        if has_return(summary):
            curve.append({"wall_s": summary["wall_s"], "env_steps": summary["env_steps"],
                          "return_mean": summary["return_mean"]})
    return {"curve": curve, "env_steps_per_s": rows[-1]["env_steps_per_s"] if rows else None,
            "env_steps": env_steps, "command": command}


def at(curve: list[dict], key: str, limit: float) -> float | None:
    """The return at ``limit`` (wall s or env steps): the last point at or before it."""
    points = [p for p in curve if p[key] <= limit]
    return points[-1]["return_mean"] if points else None


def at_steps(curve: list[dict], steps: int) -> float | None:
    """The return after ``steps`` env steps; None for a run that stopped short of them (a
    time cap), whose last return is not the return at ``steps``."""
    reached = curve and curve[-1]["env_steps"] >= steps * 0.99   # the last sample may end just short
    return at(curve, "env_steps", steps) if reached else None


def first_reaching(curve: list[dict], target: float) -> dict | None:
    return next((p for p in curve if p["return_mean"] >= target), None)


def summarize(run: dict, seconds: float) -> dict:
    curve = run["curve"]
    return {"return_at_s": {str(t): at(curve, "wall_s", t) for t in TIMES if t <= seconds},
            "return_at_steps": {str(n): at_steps(curve, n) for n in STEPS},
            "final": curve[-1] if curve else None}


def compare(sb3: dict, shmrl: dict, seconds: float) -> dict:
    """SB3's return after ``seconds`` and when shmrl first reached it."""
    target = at(sb3["curve"], "wall_s", seconds)
    reached = first_reaching(shmrl["curve"], target) if target is not None else None
    return {"sb3_return": target, "shmrl_wall_s": reached["wall_s"] if reached else None,
            "shmrl_env_steps": reached["env_steps"] if reached else None,
            "speedup": seconds / reached["wall_s"] if reached else None}


def plot(results: dict, path: Path, title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    envs = list(results["envs"])
    fig, axes = plt.subplots(len(envs), 2, figsize=(11, 3.6 * len(envs)), squeeze=False)
    colors = {"shmrl": "tab:blue", "sb3": "tab:orange"}
    for row, env in enumerate(envs):
        for seed_runs in results["envs"][env]["runs"]:
            for who in ("shmrl", "sb3"):
                curve = seed_runs.get(who, {}).get("curve")
                if not curve:
                    continue
                label = f"{who} (seed {seed_runs['seed']})"
                for col, key in enumerate(("wall_s", "env_steps")):
                    axes[row][col].plot([p[key] for p in curve], [p["return_mean"] for p in curve],
                                        color=colors[who], alpha=0.8, label=label)
        for col, xlabel in enumerate(("wall time from command start (s)", "env steps")):
            ax = axes[row][col]
            ax.set_xlabel(xlabel)
            ax.set_ylabel("mean return, last 100 episodes")
            ax.set_title(env)
            ax.grid(alpha=0.3)
        axes[row][0].legend(fontsize=7)
    who = title or ("shmrl (presets) and SB3 + rl-zoo3's tuned PPO" if results["sb3"] else "shmrl (presets)")
    fig.suptitle(f"{who}, on a {os.cpu_count()}-core machine", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--envs", nargs="+", default=["HalfCheetah-v5", "Hopper-v5"], help="gymnasium ids")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--seconds", type=float, default=300.0, help="wall time of each run (default: %(default)s)")
    p.add_argument("--sb3", action=argparse.BooleanOptionalAction, default=True,
                   help="also run SB3 with rl-zoo3's settings, in turns (default: %(default)s)")
    p.add_argument("--shmrl", action=argparse.BooleanOptionalAction, default=True,
                   help="run shmrl (default: %(default)s); --no-shmrl runs SB3 alone")
    p.add_argument("--venv", type=Path, default=shared.ZOO.folder, help="rl-zoo3 virtualenv (default: %(default)s)")
    p.add_argument("--python", type=Path, help="a python that has rl_zoo3 and mujoco, instead of --venv")
    p.add_argument("--plot", type=Path, help="write both curves of every run to this PNG")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--quick", action="store_true",
                   help="InvertedPendulum-v5, seed 0, 12 s each: that the whole path works, in seconds")
    p.add_argument("--setup", action="store_true", help="only create the rl-zoo3 virtualenv, then exit")
    p.add_argument("extra", nargs="*", help="after --: extra arguments for shmrl.run")
    a = p.parse_args(argv)
    if not (a.sb3 or a.shmrl or a.setup):
        p.error("--no-sb3 and --no-shmrl: nothing to run")
    if a.quick:
        a.envs, a.seeds, a.seconds = ["InvertedPendulum-v5"], [0], 12.0
    py = None
    if a.sb3 or a.setup:
        py = a.python or shared.ZOO.ensure(a.venv)
        if a.setup:
            print(f"rl-zoo3 virtualenv ready: {py}")
            return 0
    results = {"method": __doc__.split("\n\n")[2].replace("\n", " "), "seconds": a.seconds, "sb3": a.sb3,
               "shmrl": a.shmrl,
               "load_before": os.getloadavg(), "envs": {}}
    for env in a.envs:
        runs = []
        for seed in a.seeds:  # in turns, so that both see the machine in the same state
            with tempfile.TemporaryDirectory(prefix=f"shmrl-zoo-{env.replace('/', '-')}-") as tmp:
                tmp = Path(tmp)
                entry = {"seed": seed}
                if a.sb3:
                    (tmp / "sb3").mkdir()
                    entry["sb3"] = run_sb3(py, env, seed, a.seconds, tmp / "sb3")
                if a.shmrl:
                    (tmp / "shmrl").mkdir()
                    entry["shmrl"] = run_shmrl(f"gym:{env}", seed, a.seconds, tmp / "shmrl", a.extra)
            for who in ("sb3", "shmrl"):
                if who in entry:
                    entry[who].update(summarize(entry[who], a.seconds))
            if a.sb3 and a.shmrl:
                entry["comparison"] = compare(entry["sb3"], entry["shmrl"], a.seconds)
            runs.append(entry)
            if not a.json:
                print_run(env, entry, a.seconds)
        r = results["envs"][env] = {"runs": runs, **medians(runs, a.seconds, a.sb3, a.shmrl)}
        if frames_per_step(env) > 1:
            r.update({f"{who}_frames_per_s": r[f"{who}_env_steps_per_s"] * frames_per_step(env)
                      for who in ("shmrl", "sb3") if r.get(f"{who}_env_steps_per_s")})
    results["load_after"] = os.getloadavg()
    if a.plot:
        plot(results, a.plot)
    if a.json:
        print(json.dumps(results))
    else:
        for env, r in results["envs"].items():
            parts = [f"shmrl {fmt(r['shmrl_final'])}"] if a.shmrl else []
            parts += [f"SB3 {fmt(r['sb3_final'])}"] if a.sb3 else []
            line = f"{env}: median return after {a.seconds:.0f} s: {', '.join(parts)}"
            if a.sb3 and a.shmrl:
                line += f"; shmrl reached SB3's in a median {fmt(r['shmrl_wall_s'])} s (speedup {fmt(r['speedup'], '.1f')}x)"
            rates = [f"{name} {fmt(r[who + '_env_steps_per_s'])}"
                     + (f" ({fmt(r[who + '_frames_per_s'])} frames)" if who + "_frames_per_s" in r else "")
                     for who, name, on in (("shmrl", "shmrl", a.shmrl), ("sb3", "SB3", a.sb3)) if on]
            print(f"{line}; env steps per s: {', '.join(rates)}")
        if a.plot:
            print(f"wrote {a.plot}")
    return 0


def medians(runs: list[dict], seconds: float, sb3: bool, shmrl: bool = True) -> dict:
    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    out = {}
    if shmrl:
        out["shmrl_final"] = med(r["shmrl"]["final"]["return_mean"] for r in runs if r["shmrl"]["final"])
        out["shmrl_env_steps_per_s"] = med(r["shmrl"]["env_steps_per_s"] for r in runs)
    if sb3:
        out["sb3_env_steps_per_s"] = med(r["sb3"]["env_steps_per_s"] for r in runs)
        out["sb3_final"] = med(at(r["sb3"]["curve"], "wall_s", seconds) for r in runs)
    if sb3 and shmrl:
        out["shmrl_wall_s"] = med(r["comparison"]["shmrl_wall_s"] for r in runs)
        out["speedup"] = med(r["comparison"]["speedup"] for r in runs)
    return out


def fmt(x, spec: str = ".0f") -> str:
    return "n/a" if x is None else format(x, spec)


def print_run(env: str, entry: dict, seconds: float) -> None:
    for who in ("sb3", "shmrl"):
        if who not in entry:
            continue
        r = entry[who]
        times = " ".join(f"{t}s={fmt(v)}" for t, v in r["return_at_s"].items())
        steps = " ".join(f"{int(n) // 1000}k={fmt(v)}" for n, v in r["return_at_steps"].items())
        print(f"{env} seed {entry['seed']} {who:5s}: {times} | {steps} | {fmt(r.get('env_steps'))} env steps, "
              f"{fmt(r.get('env_steps_per_s'))} per s", flush=True)
    if "comparison" in entry:
        c = entry["comparison"]
        print(f"{env} seed {entry['seed']}: SB3's return after {seconds:.0f} s, {fmt(c['sb3_return'])}, reached by "
              f"shmrl after {fmt(c['shmrl_wall_s'])} s: {fmt(c['speedup'], '.1f')}x", flush=True)


if __name__ == "__main__":
    sys.exit(main())
