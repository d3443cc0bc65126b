#!/usr/bin/env python3
"""stable-baselines3's PPO and shmrl on CartPole-v1, side by side: wall time to a 100-episode
mean return of 475.

    python tools/sb3_baseline.py                      # 5 seeds, interleaved: SB3, then shmrl, per seed
    python tools/sb3_baseline.py --seeds 0 1 2 --json
    python tools/sb3_baseline.py -- --sims 4 --envs-per-sim 8     # extra arguments for shmrl.run
    python tools/sb3_baseline.py --quick --json       # seconds: seed 0, a mean return of 100, short budgets
    python tools/sb3_baseline.py --setup              # only create the SB3 virtualenv (.ci/run does)

Both are timed the same way, from launching the command to its exit (tools/solve.py's
solve() for shmrl). The machine drifts, so the two run in turns, seed by seed.

SB3 runs in its own virtualenv (``--venv``, created on first use with stable-baselines3,
gymnasium and torch==2.13.0, the same torch as shmrl's) by running this file with the venv's
python and a hidden subcommand; the top level imports the standard library only. Its
settings are rl-zoo3's tuned PPO for CartPole-v1, the anchor in ../shared/DESIGN.md:
8 envs in a DummyVecEnv, n_steps 32, batch 256, 20 epochs, gamma 0.98, GAE lambda 0.8,
no entropy bonus, learning rate 1e-3 and clip 0.2 both decaying linearly over zoo's
1e5 steps. A callback stops it once the mean return of the last 100 complete episodes
(VecMonitor) reaches --stop-return; if 1e5 steps pass first (or --max-env-steps, which
leaves zoo's schedules as they are) it counts as not solved.

--quick checks that the whole path works, in seconds: seed 0, --stop-return 100, --sims 2,
at most 50,000 env steps for each (shmrl.run --max-env-steps); flags given still win.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/sb3_baseline.py`: run as tools.sb3_baseline
    import run_as_module
    run_as_module.run(__file__)

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tools import shared

HERE = Path(__file__).resolve()
ZOO_STEPS = 100_000
QUICK = {"seeds": [0], "stop_return": 100.0, "sims": 2, "max_env_steps": 50_000, "timeout": 180.0}


def sb3_main(a) -> int:
    """Hidden, inside the venv: one SB3 run; prints one JSON line."""
    import numpy as np
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.vec_env import DummyVecEnv, VecMonitor

    torch.set_num_threads(1)  # as zoo's and shmrl's learners on 2 cores

    class StopAtMeanReturn(BaseCallback):
        def _on_step(self) -> bool:
            if self.num_timesteps >= a.max_env_steps:
                return False
            returns = [info["r"] for info in self.model.ep_info_buffer]
            return not (len(returns) >= 100 and np.mean(returns[-100:]) >= a.stop_return)

    def linear(start: float):
        return lambda progress_remaining: progress_remaining * start

    env = VecMonitor(make_vec_env("CartPole-v1", n_envs=8, seed=a.seed, vec_env_cls=DummyVecEnv))
    model = PPO("MlpPolicy", env, n_steps=32, batch_size=256, n_epochs=20, gamma=0.98, gae_lambda=0.8,
                ent_coef=0.0, learning_rate=linear(1e-3), clip_range=linear(0.2), seed=a.seed, verbose=0,
                stats_window_size=100, device="cpu")
    model.learn(total_timesteps=ZOO_STEPS, callback=StopAtMeanReturn())
    returns = [info["r"] for info in model.ep_info_buffer]
    mean = float(np.mean(returns)) if returns else float("nan")
    print(json.dumps({"env_steps": int(model.num_timesteps), "return_mean": mean,
                      "solved": len(returns) >= 100 and mean >= a.stop_return}))
    return 0


def sb3_run(py: Path, seed: int, stop_return: float, timeout: float, max_env_steps: int = ZOO_STEPS) -> dict:
    t0 = time.time()
    proc = subprocess.run([str(py), str(HERE), "_sb3-run", "--seed", str(seed), "--stop-return", str(stop_return),
                           "--max-env-steps", str(max_env_steps)],
                          capture_output=True, text=True, timeout=timeout)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"SB3 run of seed {seed} failed:\n{proc.stderr[-2000:]}")
    return {"seed": seed, "wall_s": wall, **json.loads(proc.stdout.strip().splitlines()[-1])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--sims", type=int, default=8, help="shmrl.run --sims (default: %(default)s)")
    p.add_argument("--stop-return", type=float, default=475.0)
    p.add_argument("--venv", type=Path, default=shared.SB3.folder, help="SB3 virtualenv (default: %(default)s)")
    p.add_argument("--max-env-steps", type=int, default=ZOO_STEPS,
                   help="env steps after which a run counts as not solved, for each (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--quick", action="store_true",
                   help="seconds, not minutes: seed 0, --stop-return 100, --sims 2, --max-env-steps 50000")
    p.add_argument("--setup", action="store_true", help="only create the SB3 virtualenv (--venv), then exit")
    p.add_argument("extra", nargs="*", help="after --: extra arguments for shmrl.run")
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["_sb3-run"]:
        h = argparse.ArgumentParser()
        h.add_argument("--seed", type=int, required=True)
        h.add_argument("--stop-return", type=float, required=True)
        h.add_argument("--max-env-steps", type=int, default=ZOO_STEPS)
        return sb3_main(h.parse_args(argv[1:]))
    if shared.quick_asked(argv):
        p.set_defaults(**QUICK)
    a = p.parse_args(argv)
    if a.setup:
        print(f"stable-baselines3 virtualenv ready: {shared.SB3.ensure(a.venv)}")
        return 0
    from tools.solve import solve  # one timed `python -m shmrl.run` per seed

    signal.signal(signal.SIGTERM, _terminate)
    py = shared.SB3.ensure(a.venv)
    extra = ["--stop-return", str(a.stop_return), "--max-env-steps", str(a.max_env_steps), *a.extra]
    runs = {"sb3": [], "shmrl": []}
    for seed in a.seeds:  # in turns, so that both see the machine in the same state
        runs["sb3"].append(sb3_run(py, seed, a.stop_return, a.timeout, a.max_env_steps))
        runs["shmrl"].append(solve(seed, a.sims, extra, a.timeout))
        if not a.json:
            s, m = runs["sb3"][-1], runs["shmrl"][-1]
            print(f"seed {seed}: SB3 {s['wall_s']:6.2f} s {s['env_steps']:7d} steps "
                  f"{'solved' if s['solved'] else 'NOT solved'} | shmrl {m['wall_s']:5.2f} s "
                  f"{m['env_steps']} steps {'solved' if m['solved'] else 'NOT solved'}", flush=True)
    out = {"method": __doc__.split("\n\n")[2].replace("\n", " "), "load_after": os.getloadavg(),
           "shmrl_command": f"python -m shmrl.run --sims {a.sims} {' '.join(extra)}", "runs": runs}
    for name, rs in runs.items():
        out[name] = {"median_wall_s": statistics.median(r["wall_s"] for r in rs),
                     "median_env_steps": statistics.median(r["env_steps"] or 0 for r in rs),
                     "solved": sum(bool(r["solved"]) for r in rs), "of": len(rs)}
    if a.json:
        print(json.dumps(out))
    else:
        for name in runs:
            o = out[name]
            print(f"{name:6s}: median {o['median_wall_s']:.2f} s from launch to exit, median "
                  f"{o['median_env_steps']:.0f} env steps, {o['solved']} of {o['of']} solved")
        print(f"shmrl is {out['sb3']['median_wall_s'] / out['shmrl']['median_wall_s']:.1f}x faster in median wall time")
    return 0 if all(r["solved"] for rs in runs.values() for r in rs) else 1


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through solve()'s cleanup and subprocess.run's kill


if __name__ == "__main__":
    sys.exit(main())
