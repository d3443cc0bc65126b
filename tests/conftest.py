import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def pytest_collection_modifyitems(config, items):
    """A run of the suite or of a folder (``python -m pytest -q``) leaves the tests marked
    ``slow`` out, so that it stays within minutes; ``-m slow`` runs only those, ``-m "slow
    or not slow"`` all; a run that names test files or tests runs every test in them."""
    names_files = any(not os.path.isdir(arg.split("::")[0]) for arg in config.args)
    if config.option.markexpr or names_files:
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


def load_tool(name: str):
    """tools/NAME.py as a module (tools/ is not a package: each tool is a script)."""
    path = Path(__file__).resolve().parents[1] / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"shmrl_tools_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def wait_until(condition, timeout: float, what: str, interval: float = 0.02):
    """Call ``condition()`` until it returns something true, and return that; after
    ``timeout`` seconds fail the test, saying ``what`` was awaited. Every wait in the tests
    goes through here, so none can hang."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def shm_entries(pid: int) -> list[str]:
    return [e for e in os.listdir("/dev/shm") if e.startswith(f"shmrl_{pid}_")]


def shmrl_files() -> set:
    return {e for e in os.listdir("/dev/shm") if e.startswith("shmrl_")}


def _pid_of(entry: str) -> int:
    return int(entry.split("_")[1])


@pytest.fixture
def no_shm_leftovers():
    """The test leaves /dev/shm as it found it. Files of other live processes (a run
    going on beside the tests) are not ours: never judged, never touched."""
    before = shmrl_files()
    yield
    left = {e for e in shmrl_files() - before if _pid_of(e) == os.getpid() or not alive(_pid_of(e))}
    for e in left:  # clean up, so that one failure does not cascade
        os.unlink(os.path.join("/dev/shm", e))
    assert not left, f"left behind in /dev/shm: {sorted(left)}"


def process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


@pytest.fixture
def no_sim_leftovers():
    """A run in this process (``shmrl.train``) leaves no simulator process behind."""
    yield
    left = [pid for pid in descendants(os.getpid()) if process_name(pid).startswith("shmrl-sim") and alive(pid)]
    for pid in left:  # clean up, so that one failure does not cascade
        os.kill(pid, signal.SIGKILL)
    assert not left, f"simulator processes left running: {left}"


@pytest.fixture
def children():
    """Processes a test starts; killed and joined in teardown."""
    procs = []
    yield procs
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)


class Run:
    """``python -m shmrl.run`` in its own process group, always killed in teardown."""

    def __init__(self, args, tmp_path, preexec_fn=None):
        self.log_path = tmp_path / "run.log"
        self.log = open(self.log_path, "w")
        # In the test's own folder: a run without --logdir writes runs/... where it starts.
        if "--log-every" not in args:
            args = [*args, "--log-every", "0"]  # the tests watch for every update's line
        self.proc = subprocess.Popen([sys.executable, "-m", "shmrl.run", *args], stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path,
                                     preexec_fn=preexec_fn)

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def wait_for(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{text!r} did not appear; output:\n{self.output()}")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(5)
        self.log.close()


@pytest.fixture
def start_run(tmp_path):
    runs = []

    def start(*args, preexec_fn=None):
        run = Run([str(a) for a in args], tmp_path, preexec_fn)
        runs.append(run)
        return run

    yield start
    for run in runs:
        run.kill()
        for name in shm_entries(run.proc.pid):
            os.unlink(os.path.join("/dev/shm", name))
