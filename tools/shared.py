"""What the tools share: the processes they start and what those cost, the baselines'
virtualenvs, and the frame of every report.

Processes: ``python -m shmrl.run`` in a process group of its own, stopped whole (as after
Ctrl-C, then killed) with its /dev/shm segments; what it wrote to its log folder; CPU time
and memory of processes, read with psutil.

Virtualenvs: stable-baselines3 (tools/sb3_baseline.py), RLlib 2.48 (tools/rllib_compat.py)
and rl-zoo3 (tools/zoo.py, tools/recurrent_baseline.py, tools/slow_sims.py), each made once
in ~/.cache/shmrl/NAME (a tool's --venv picks another folder) and reused, with torch pinned
to 2.13.0, the same CPU build as shmrl's: an unpinned torch pulls a CUDA build of several GB.

Reports: every result starts with what was measured, how, when and on what machine in what
state (``started``), and ends with the machine's state after (``finished``).

Module level: the standard library only (psutil and numpy imported where they are used):
the baselines' own interpreters import the tools that import this, and the fork server of
tools/bench.py's simulators imports bench, whose children should carry no more than
shmrl.run's simulators do.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[1]   # the repository's root


# ---------------------------------------------------------------- stopping what we started

def own_shm_files(pid: int) -> list[str]:
    """The /dev/shm segments that the shmrl process ``pid`` made (named shmrl_PID_...)."""
    return sorted(e for e in os.listdir("/dev/shm") if e.startswith(f"shmrl_{pid}_"))


def group_alive(pgid: int) -> bool:
    """Whether a live process is left in the process group ``pgid``. A zombie (exited, only
    waiting to be reaped) is not one: a run's fork server and resource tracker become zombies
    as the run exits, and some containers' init reaps them a second or two late (measured
    here: tools/solve.py counted that wait in every run's time)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, belongs to someone else
        return True
    if not os.path.isdir("/proc"):
        return True
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:   # gone meanwhile
            continue
        state, _, pgrp = stat[stat.rindex(")") + 2:].split()[:3]   # the name in parentheses may hold spaces
        if int(pgrp) == pgid and state != "Z":
            return True
    return False


def wait_group_gone(pgid: int, timeout: float = 5.0) -> bool:
    """Wait until no live process of the group ``pgid`` is left (a run's fork server ends a
    moment after the run), at most ``timeout`` s; True if none is."""
    deadline = time.monotonic() + timeout
    while group_alive(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


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
        wall = time.time() - t0   # the command's end: what is left is ours to check, not its time
        if proc.poll() is None or group_alive(proc.pid):
            interrupt_group(proc)
        for name in own_shm_files(proc.pid):
            os.unlink(f"/dev/shm/{name}")
    return code, wall, err


def repo_on_pythonpath(env: dict | None = None) -> dict:
    """``env`` (default: this process's) with the repository's root first on PYTHONPATH, for
    the interpreters a tool starts: they import shmrl (and tools) from this checkout."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


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



# ---------------------------------------------------------------- the baselines' virtualenvs

CACHE = Path("~/.cache/shmrl").expanduser()


class SetupError(RuntimeError):
    """A virtualenv could not be made to work."""


@dataclass(frozen=True)
class Venv:
    name: str                   # its folder in ~/.cache/shmrl
    what: str                   # for messages: "the {what} virtualenv"
    packages: tuple[str, ...]   # pip install these; NAME==VERSION pins are checked on every use
    modules: tuple[str, ...]    # what the tools import there

    @property
    def folder(self) -> Path:
        return CACHE / self.name

    def ensure(self, folder: Path | None = None, log=None) -> Path:
        """The python of the virtualenv in ``folder`` (default: its own), made if missing
        or incomplete, reused as it is otherwise. ``log``: where progress goes (stderr)."""
        folder = folder or self.folder
        log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        py = folder / "bin" / "python"
        if py.exists() and subprocess.run([str(py), "-c", self._check(load=False)],
                                          capture_output=True).returncode == 0:
            return py
        log(f"creating the {self.what} virtualenv in {folder} (takes minutes) ...")
        folder.parent.mkdir(parents=True, exist_ok=True)
        if not py.exists():
            subprocess.run([shutil.which("python3") or sys.executable, "-m", "venv", str(folder)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", *self.packages], check=True)
        r = subprocess.run([str(py), "-c", self._check(load=True)], capture_output=True, text=True)
        if r.returncode != 0:
            raise SetupError(f"the virtualenv {folder} does not work:\n{r.stderr}")
        return py

    def _check(self, *, load: bool) -> str:
        """Python that fails unless the modules are there and the pinned versions installed.
        ``load=False`` finds the modules without importing them (importing ray or torch takes
        seconds), for the check on every use; ``load=True`` imports them, once after pip."""
        lines = ["import importlib.util, importlib.metadata as md"]
        for module in self.modules:
            lines.append(f"import {module}" if load else
                         f"assert importlib.util.find_spec({module!r}), 'no module {module}'")
        for spec in self.packages:
            pin = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?==(\S+)", spec)
            if pin:  # startswith: a local build tag (2.13.0+cpu) is the same release
                dist, version = pin.group(1), pin.group(3)
                lines.append(f"assert md.version({dist!r}).startswith({version!r}), md.version({dist!r})")
        return "\n".join(lines)


TORCH = "torch==2.13.0"
SB3 = Venv("sb3-venv", "stable-baselines3", (TORCH, "stable-baselines3>=2.3", "gymnasium"),
           ("stable_baselines3", "torch", "gymnasium"))
# onnx: torch's legacy ONNX exporter (rllib_compat's _legacy_onnx_export) needs the onnx package.
RLLIB = Venv("rllib-2.48-venv", "RLlib 2.48", ("ray[rllib]==2.48.0", TORCH, "gymnasium", "onnxruntime", "onnx"),
             ("ray", "torch", "onnxruntime", "onnx", "gymnasium"))
# sb3_contrib (RecurrentPPO, for recurrent_baseline.py) comes with rl_zoo3.
ZOO = Venv("zoo-venv", "rl-zoo3", (TORCH, "rl_zoo3", "gymnasium[mujoco,atari]", "opencv-python-headless"),
           ("rl_zoo3", "sb3_contrib", "mujoco", "ale_py", "cv2", "torch"))


def quick_asked(argv: list[str]) -> bool:
    """Whether a tool's own flags (those before a ``--``, after which come shmrl.run's) ask
    for --quick: its quick defaults are then set before parsing, so flags given still win."""
    return "--quick" in argv[:argv.index("--") if "--" in argv else len(argv)]


# ---------------------------------------------------------------- the frame of every report

def median(xs) -> float:
    """The median of any iterable of numbers (a list, a generator), NaN when it is empty."""
    xs = list(xs)
    return float(statistics.median(xs)) if xs else math.nan


def percentile(xs, q: float) -> float:
    """The q-th percentile of any iterable of numbers, NaN when it is empty."""
    import numpy as np  # here: a baseline's interpreter imports this module without numpy

    xs = list(xs)
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if xs else math.nan


def host_info() -> dict:
    return {"cpus": len(os.sched_getaffinity(0)), "loadavg": [round(x, 2) for x in os.getloadavg()],
            "python": sys.version.split()[0]}


def started(name: str, method: str, **params) -> dict:
    """The head of every result: what, how, when, and on what a machine in what state."""
    return {"subcommand": name, "method": method, "params": params,
            "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host_before": host_info()}


def finished(result: dict) -> dict:
    result["host_after"] = host_info()
    result["torch_imported"] = "torch" in sys.modules  # must stay False: the bench is light
    return result


def print_method(result: dict) -> None:
    """The foot of every table: how it was measured, when, and the machine's load."""
    print(textwrap.fill(f"method: {result['method']}", width=110, initial_indent="  ",
                        subsequent_indent="    ", break_on_hyphens=False))
    print(f"  measured {result['when']}; load average before {result['host_before']['loadavg']}, "
          f"after {result['host_after']['loadavg']} on {result['host_after']['cpus']} cpus")
