"""What one run of shmrl costs: its processes (learner, fork server, simulators) with their
PSS, USS and RSS once the first update is written; then it is stopped as after Ctrl-C and
nothing of it may be left (tools/shared.py holds the process helpers this uses).

    python tools/processes.py [--json] [-- shmrl.run ARGS]   # default: CartPole, --sims 8
    python tools/processes.py --quick --json                 # seconds: --sims 2, a small net
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/processes.py`: run as tools.processes
    import run_as_module
    run_as_module.run(__file__)

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from tools.shared import group_alive, interrupt_group, own_shm_files, popen_group, process_tree, read_logdir

QUICK_RUN = ["--sims", "2", "--hidden", "16", "--no-tensorboard"]   # --quick


def measure_run(args: list[str], timeout: float) -> dict:
    """Start ``python -m shmrl.run ARGS``, take its process tree once its first update is in
    metrics.jsonl, stop it as after Ctrl-C; what it cost and how it ended."""
    with tempfile.TemporaryDirectory(prefix="shmrl-processes-") as logdir:
        # It is stopped, not solved: no stop return (a flag given wins), and our own log folder.
        proc = popen_group([sys.executable, "-m", "shmrl.run", "--stop-return", "inf", *args, "--logdir", logdir],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + timeout
            while not read_logdir(logdir)[1]:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"shmrl.run {' '.join(args)} wrote no update "
                                       f"({'exit ' + str(proc.returncode) if proc.poll() is not None else 'timeout'})")
                time.sleep(0.1)
            tree = process_tree(proc.pid)
        finally:
            status = interrupt_group(proc) if proc.poll() is None else proc.returncode
            left = own_shm_files(proc.pid)
            for name in left:
                os.unlink(f"/dev/shm/{name}")
        summary, rows = read_logdir(logdir)
    return {"args": args, "processes": tree, "pss_mib": sum(p["pss_mib"] for p in tree),
            "rss_mib": sum(p["rss_mib"] for p in tree), "exit_status": status,
            "group_left": group_alive(proc.pid), "shm_left": left,
            "updates": len(rows), "summary_written": bool(summary)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tools/processes.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"shmrl.run {' '.join(QUICK_RUN)} unless ARGS are given")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to the first update (default: %(default)s)")
    p.add_argument("run_args", nargs="*", metavar="ARGS", help="for shmrl.run, after --")
    args = p.parse_args(argv)
    run_args = args.run_args or (QUICK_RUN if args.quick else ["--sims", "8"])
    try:
        out = measure_run(run_args, args.timeout)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out))
    else:
        for proc in out["processes"]:
            print(f"{proc['pid']:>8}  {proc['role']:<18} PSS {proc['pss_mib']:7.1f} MiB  USS {proc['uss_mib']:7.1f}"
                  f"  RSS {proc['rss_mib']:7.1f}")
        print(f"in all: PSS {out['pss_mib']:.0f} MiB (RSS summed {out['rss_mib']:.0f}); after Ctrl-C: exit "
              f"{out['exit_status']}, processes left: {out['group_left']}, segments left: {out['shm_left']}")
    return 0 if out["exit_status"] == 130 and not out["group_left"] and not out["shm_left"] else 1


if __name__ == "__main__":
    sys.exit(main())
