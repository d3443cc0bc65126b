import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest


def load_tool(name: str):
    """tools/NAME.py as a module (tools/ is not a package: each tool is a script). tools/
    goes on sys.path, as python puts a script's folder there: tools import their siblings."""
    tools = Path(__file__).resolve().parents[1] / "tools"
    if str(tools) not in sys.path:
        sys.path.insert(0, str(tools))
    path = tools / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"shmrl_tools_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import would: dataclasses look their module up there
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
    """All live descendants of ``pid``."""
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def alive(pid: int) -> bool:
    """Running, not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
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
    """The kernel's name of the process (what setproctitle/prctl set: 15 characters at most)."""
    try:
        return psutil.Process(pid).name()
    except psutil.NoSuchProcess:
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
