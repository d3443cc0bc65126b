#!/usr/bin/env python3
"""shmrl's recurrent policies beside sb3-contrib's RecurrentPPO with rl-zoo3's settings, in
turns, seed by seed, on the partially observed envs: wall time to the same return, and a
plot of both curves.

    python tools/recurrent_baseline.py                         # CartPoleNoVel-v1, PendulumNoVel-v1; seeds 1 2 3
    python tools/recurrent_baseline.py --envs CartPoleNoVel-v1 --seeds 1 --seconds 300 --plot novel.png
    python tools/recurrent_baseline.py --quick --json          # seconds: CartPoleNoVel-v1, seed 0, 10 s each
    python tools/recurrent_baseline.py --setup                 # only create the rl-zoo3 virtualenv

RecurrentPPO runs rl-zoo3's own training script (python -m rl_zoo3.train --algo ppo_lstm)
with zoo's own hyperparams/ppo_lstm.yml entry for the env (rl-zoo3 registers the NoVel
envs itself: velocities masked to 0, as shmrl's built-in ones), in the virtualenv of
tools/zoo.py, its step budget raised (-n) so that --seconds, not zoo's 100k steps, ends
it. shmrl runs its preset for the env (an LSTM), stopping at the target. Each command is
timed from its launch; returns are 100-episode means, SB3's from the Monitor file zoo
writes, shmrl's from metrics.jsonl. The speedup is RecurrentPPO's wall time to the env's
target (475, -300) over shmrl's; where RecurrentPPO did not reach it within --seconds, a
lower bound (its last episode's time over shmrl's); and at RecurrentPPO's final return,
when shmrl first reached it.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/recurrent_baseline.py`: run as tools.recurrent_baseline
    import run_as_module
    run_as_module.run(__file__)

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from tools import shared, zoo  # zoo: the zoo runner, the curves and the plot; rl-zoo3's virtualenv has sb3-contrib

TARGETS = {"CartPoleNoVel-v1": 475.0, "PendulumNoVel-v1": -300.0}
QUICK = {"envs": ["CartPoleNoVel-v1"], "seeds": [0], "seconds": 10.0}


def compare(env: str, sb3: dict, shmrl: dict) -> dict:
    """The ratio of wall times to the env's target: exact where RecurrentPPO reached it,
    else a lower bound (RecurrentPPO had not reached it when its last episode ended). And
    at RecurrentPPO's final return: when shmrl first reached it."""
    sb3_t, shmrl_t = to_target(env, sb3), to_target(env, shmrl)
    last = sb3["curve"][-1] if sb3["curve"] else None
    at_final = zoo.first_reaching(shmrl["curve"], last["return_mean"]) if last else None
    out = {"target": TARGETS.get(env), "sb3_reached_target": sb3_t is not None,
           "speedup": None, "speedup_at_least": None,
           "sb3_final_return": last and last["return_mean"], "sb3_final_wall_s": last and last["wall_s"],
           "shmrl_wall_s_to_sb3_final": at_final and at_final["wall_s"]}
    if shmrl_t and sb3_t:
        out["speedup"] = sb3_t["wall_s"] / shmrl_t["wall_s"]
    elif shmrl_t and last:
        out["speedup_at_least"] = last["wall_s"] / shmrl_t["wall_s"]
    return out


def to_target(env: str, run: dict) -> dict | None:
    """Where a run first reached the env's target (None: it did not)."""
    return zoo.first_reaching(run["curve"], TARGETS[env]) if env in TARGETS else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--envs", nargs="+", default=list(TARGETS), help="default: %(default)s")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--seconds", type=float, default=300.0, help="wall time of each run at most (default: %(default)s)")
    p.add_argument("--venv", type=Path, default=shared.ZOO.folder, help="rl-zoo3 virtualenv (default: %(default)s)")
    p.add_argument("--python", type=Path, help="a python that has rl_zoo3 and sb3_contrib, instead of --venv")
    p.add_argument("--plot", type=Path, help="write both curves of every run to this PNG")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--quick", action="store_true", help="CartPoleNoVel-v1, seed 0, 10 s each: the whole path")
    p.add_argument("--setup", action="store_true", help="only create the rl-zoo3 virtualenv, then exit")
    p.add_argument("extra", nargs="*", help="after --: extra arguments for shmrl.run")
    a = p.parse_args(argv)
    if a.quick:
        a.envs, a.seeds, a.seconds = QUICK["envs"], QUICK["seeds"], QUICK["seconds"]
    py = a.python or shared.ZOO.ensure(a.venv)
    if a.setup:
        print(f"rl-zoo3 virtualenv ready: {py}")
        return 0
    results = {"method": __doc__.split("\n\n")[2].replace("\n", " "), "seconds": a.seconds, "sb3": True,
               "load_before": os.getloadavg(), "envs": {}}
    # A budget no run reaches in --seconds: the clock ends RecurrentPPO, not zoo's n_timesteps.
    budget = ["-n", "10000000"]
    for env in a.envs:
        runs = []
        for seed in a.seeds:   # in turns, so that both see the machine in the same state
            with tempfile.TemporaryDirectory(prefix=f"shmrl-recurrent-{env}-") as tmp:
                tmp = Path(tmp)
                (tmp / "sb3").mkdir()
                (tmp / "shmrl").mkdir()
                entry = {"seed": seed, "sb3": zoo.run_sb3(py, env, seed, a.seconds, tmp / "sb3", "ppo_lstm", budget),
                         "shmrl": zoo.run_shmrl(env, seed, a.seconds, tmp / "shmrl", a.extra,
                                                  stop_return=TARGETS.get(env, float("inf")))}
            for who in ("sb3", "shmrl"):
                reached = to_target(env, entry[who])
                entry[who]["target_wall_s"] = reached and reached["wall_s"]
                entry[who]["final"] = entry[who]["curve"][-1] if entry[who]["curve"] else None
            entry["comparison"] = compare(env, entry["sb3"], entry["shmrl"])
            runs.append(entry)
            if not a.json:
                print_run(env, entry)
        results["envs"][env] = {"runs": runs, "target": TARGETS.get(env), **medians(runs)}
    results["load_after"] = os.getloadavg()
    if a.plot:
        zoo.plot(results, a.plot, "shmrl (--memory lstm, presets) and sb3-contrib's RecurrentPPO with rl-zoo3's "
                                  "settings")
    if a.json:
        print(json.dumps(results))
    else:
        for env, r in results["envs"].items():
            print(f"{env}: to {r['target']}: shmrl {r['shmrl_solved']}/{len(a.seeds)} seeds, median "
                  f"{zoo.fmt(r['shmrl_target_wall_s'], '.1f')} s; RecurrentPPO {r['sb3_solved']}/{len(a.seeds)}, "
                  f"median {zoo.fmt(r['sb3_target_wall_s'], '.1f')} s; median speedup to the target "
                  f"{zoo.fmt(r['speedup'], '.1f')}x, at least {zoo.fmt(r['speedup_at_least'], '.1f')}x where "
                  f"RecurrentPPO did not reach it")
        if a.plot:
            print(f"wrote {a.plot}")
    return 0


def medians(runs: list[dict]) -> dict:
    def med(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    out = {"speedup": med(r["comparison"]["speedup"] for r in runs),
           "speedup_at_least": med(r["comparison"]["speedup_at_least"] for r in runs)}
    for who in ("shmrl", "sb3"):
        out[f"{who}_solved"] = sum(r[who]["target_wall_s"] is not None for r in runs)
        out[f"{who}_target_wall_s"] = med(r[who]["target_wall_s"] for r in runs)
        out[f"{who}_env_steps_per_s"] = med(r[who]["env_steps_per_s"] for r in runs)
    return out


def print_run(env: str, entry: dict) -> None:
    for who, name in (("sb3", "RecurrentPPO"), ("shmrl", "shmrl")):
        r = entry[who]
        final = r["final"] or {}
        print(f"{env} seed {entry['seed']} {name:12s}: target at {zoo.fmt(r['target_wall_s'], '.1f')} s; last "
              f"{zoo.fmt(final.get('return_mean'), '.1f')} after {zoo.fmt(final.get('wall_s'), '.1f')} s, "
              f"{zoo.fmt(r.get('env_steps'))} env steps, {zoo.fmt(r.get('env_steps_per_s'))} per s", flush=True)
    c = entry["comparison"]
    print(f"{env} seed {entry['seed']}: to {c['target']}: {zoo.fmt(c['speedup'], '.1f')}x (at least "
          f"{zoo.fmt(c['speedup_at_least'], '.1f')}x); RecurrentPPO's final {zoo.fmt(c['sb3_final_return'], '.1f')} "
          f"after {zoo.fmt(c['sb3_final_wall_s'], '.1f')} s, reached by shmrl after "
          f"{zoo.fmt(c['shmrl_wall_s_to_sb3_final'], '.1f')} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
