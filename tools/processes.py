"""The processes the tools start, and what they cost: ``python -m shmrl.run`` in a process
group of its own, stopped whole (as after Ctrl-C, then killed) with its /dev/shm segments;
what it wrote to its log folder; and CPU time and memory of processes, read with psutil.

As a command it shows what one run costs: its processes (learner, fork server,
simulators) with their PSS, USS and RSS once the first update is written, then stops it as
after Ctrl-C and checks that nothing of it is left:

    python tools/processes.py [--json] [-- shmrl.run ARGS]   # default: CartPole, --sims 8
    python tools/processes.py --quick --json                 # seconds: --sims 2, a small net

Module level: the standard library only, psutil imported where it is used: tools/bench.py
imports this file, and the fork server of bench's simulators imports bench as
__mp_main__, whose children should carry no more than shmrl.run's simulators do.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MiB = 1 << 20


# ---------------------------------------------------------------- stopping what we started

def own_shm_files(pid: int) -> list[str]:
    """The /dev/shm segments that the shmrl process ``pid`` made (named shmrl_PID_...)."""
    return sorted(e for e in os.listdir("/dev/shm") if e.startswith(f"shmrl_{pid}_"))


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, belongs to someone else
        return True


def wait_group_gone(pgid: int, timeout: float = 5.0) -> bool:
    """Wait until no live process of the group ``pgid`` is left (a run's fork server ends a
    moment after the run), at most ``timeout`` s; True if none is."""
    import psutil

    deadline = time.monotonic() + timeout
    while True:
        live = []
        for proc in psutil.process_iter(["status"]):
            try:
                if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(proc.pid) == pgid:
                    live.append(proc.pid)
            except (psutil.Error, ProcessLookupError):
                continue
        if not live or time.monotonic() > deadline:
            return not live
        time.sleep(0.05)


def stop_process(proc: subprocess.Popen, timeout: float = 5.0) -> None:
    """SIGTERM, then SIGKILL: a subprocess of ours never outlives the tool."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def popen_group(cmd: list[str], **kwargs) -> subprocess.Popen:
    """``cmd`` in a session (and process group) of its own, with SIGINT at its default even
    if this tool was started with it ignored (``nohup ... &`` from a script): Python would
    then ignore it too, and interrupt_group's Ctrl-C would only end it by SIGKILL."""
    return subprocess.Popen(cmd, start_new_session=True, preexec_fn=_sigint_default, **kwargs)


def interrupt_group(proc: subprocess.Popen, timeout: float = 15.0) -> int | None:
    """Ctrl-C to the run's process group, SIGKILL if it is not gone within ``timeout``;
    the run's exit status (130 expected after SIGINT)."""
    for sig in (signal.SIGINT, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)  # the group outlives its leader while members remain
        except ProcessLookupError:
            pass
        try:
            code = proc.wait(timeout)
            break
        except subprocess.TimeoutExpired:
            print(f"warning: shmrl.run still running {timeout:g} s after {sig.name}", file=sys.stderr)
    else:
        return None
    if sig is signal.SIGKILL:
        return code
    deadline = time.monotonic() + timeout  # the simulators and the fork server end after it
    while group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if group_alive(proc.pid):
        os.killpg(proc.pid, signal.SIGKILL)
    return code


def run_shmrl(args: list[str], timeout: float, env: dict | None = None) -> tuple[int | None, float, str]:
    """``python -m shmrl.run ARGS`` in its own process group, timed from launch to exit:
    (exit status, None when it outlived ``timeout``; wall seconds; its stderr). Whatever
    happens here (a timeout, an error, Ctrl-C), the run is stopped as after Ctrl-C with its
    simulators, or killed, and leaves no /dev/shm segment behind."""
    cmd = [sys.executable, "-m", "shmrl.run", *args]
    t0 = time.time()
    proc = popen_group(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    code, err = None, ""
    try:
        _, err = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        pass
    finally:
        if proc.poll() is None or group_alive(proc.pid):
            interrupt_group(proc)
        for name in own_shm_files(proc.pid):
            os.unlink(f"/dev/shm/{name}")
    return code, time.time() - t0, err


def read_logdir(logdir: str | Path) -> tuple[dict, list[dict]]:
    """What a run wrote to its log folder: summary.json ({} before the run's end) and the
    rows of metrics.jsonl, one per update ([] before the first)."""
    summary_path, metrics_path = Path(logdir) / "summary.json", Path(logdir) / "metrics.jsonl"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    rows = ([json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
            if metrics_path.exists() else [])
    return summary, rows


# ---------------------------------------------------------------- what processes cost (psutil)

def cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) used so far by ``pids`` (those gone count nothing)."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def rss_kib(pid: int) -> int | None:
    """The resident set of ``pid`` in KiB (VmRSS), None once it is gone."""
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss >> 10
    except psutil.Error:
        return None


def process_tree(root: int) -> list[dict]:
    """The run ``root`` and every descendant, with a role, and its PSS, USS and RSS in MiB."""
    import psutil

    try:
        tree = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    out = []
    for proc in tree:
        try:
            mem = proc.memory_full_info()  # RSS from statm, PSS and USS from smaps_rollup
            role = role_of(proc, root)
        except psutil.Error:
            continue  # gone meanwhile
        out.append({"pid": proc.pid, "role": role, "pss_mib": mem.pss / MiB, "uss_mib": mem.uss / MiB,
                    "rss_mib": mem.rss / MiB})
    return out


def role_of(proc, root: int) -> str:
    """What a process (psutil.Process) of the run ``root`` is, from its name and command line."""
    if proc.pid == root:
        return "learner"
    name, cmdline = proc.name(), " ".join(proc.cmdline())
    if name.startswith("shmrl-sim"):
        return f"simulator {name[len('shmrl-sim'):]}"
    if "forkserver" in cmdline:
        return "fork server"
    if "resource_tracker" in cmdline:
        return "resource tracker"
    return name


# ---------------------------------------------------------------- as a command: what a run costs

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
