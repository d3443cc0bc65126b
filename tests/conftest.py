"""What every test file shares: the slow set left out of the default run, bounded waits
(``wait_until`` and what is built on it: ``Run.wait_until``, ``all_gone``, ``serve_until``),
``python -m shmrl.run`` in a process of its own (``start_run``), a run's summary and
metrics, the process and /dev/shm checks, and ``need`` for the optional env families."""
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
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


def need(module: str, extra: str):
    """``module``, or skip the calling test (or module, at import) with the extra that
    installs it: the test extra has every family, a smaller install skips with a reason."""
    return pytest.importorskip(module, reason=f"{module} is not installed: pip install 'shmrl[{extra}]' "
                                              "(the test extra has it)")


def serve_until(learner, condition, timeout: float, what: str):
    """Serve the learner's clients (``learner.poll``) until ``condition()`` is true; bounded
    like ``wait_until``."""
    def served():
        learner.poll(0.05)
        return condition()
    return wait_until(served, timeout, what, interval=0)


def request_while_serving(learner, client, *requests, timeout: float = 10.0, what: str = "the client's requests"):
    """Send ``requests`` one after another from ``client`` in a thread while this thread
    serves the learner; return the last reply, or the ConnectionError that ended them (a
    client the server closes)."""
    out = {}

    def talk():
        try:
            for request in requests:
                out["reply"] = client.request(request)
        except ConnectionError as e:
            out["error"] = e
        out["done"] = True

    thread = threading.Thread(target=talk, daemon=True)
    thread.start()
    serve_until(learner, lambda: "done" in out, timeout, what)
    thread.join(5)
    return out.get("error", out.get("reply"))


def quick_cartpole(logdir, **fields) -> dict:
    """A short CartPole run in this process (``shmrl.train``): about 30 updates of 128 env
    steps, ~1 s."""
    import shmrl   # here, not at the top: simulator processes import this module, and shmrl.train pulls torch

    config = dict(env="CartPole-v1", sims=1, max_env_steps=4000, env_steps_per_sample=128, epochs=1,
                  logdir=str(logdir))
    return shmrl.train(**{**config, **fields})


def summary_of(logdir) -> dict:
    """A run's summary.json."""
    return json.loads((Path(logdir) / "summary.json").read_text())


def metrics_rows(logdir) -> list[dict]:
    """A run's metrics.jsonl, one dict per update."""
    return [json.loads(line) for line in (Path(logdir) / "metrics.jsonl").read_text().splitlines()]


def check_books(summary: dict, logdir=None) -> None:
    """Every env step received was trained on, is pending, or was dropped for a reason, and
    was counted for one client; and (with ``logdir``) those counted as trained are exactly
    those the updates in metrics.jsonl trained on, not a batch the run took and then
    stopped before training."""
    assert summary["env_steps"] == (summary["env_steps_trained"] + summary["env_steps_pending"]
                                    + sum(summary["env_steps_dropped"].values())), summary
    assert sum(summary["env_steps_by_client"].values()) == summary["env_steps"], summary
    if logdir is not None:
        rows = metrics_rows(logdir)
        unlogged = summary["env_steps_trained"] - sum(r["batch_steps"] for r in rows)
        if summary["updates"] == len(rows) + 1:                 # stopped between an update and its line
            assert 0 < unlogged <= max(r["batch_steps"] for r in rows), (unlogged, summary)
        else:
            assert summary["updates"] == len(rows) and unlogged == 0, (unlogged, summary)


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


def process_state(pid: int) -> str:
    """psutil's status of ``pid`` ("running", "sleeping", "zombie", ...), "" if it is gone."""
    try:
        return psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return ""


def all_gone(pids, timeout: float, what: str) -> None:
    """Wait until none of ``pids`` is alive (zombies count as gone)."""
    wait_until(lambda: not [p for p in pids if alive(p)], timeout, what)


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
        self.wait_until(lambda out: text in out, timeout, repr(text))

    def wait_until(self, condition, timeout: float, what: str):
        """``condition(output)`` until it is true, and return it; fail with the output when
        ``timeout`` passes or the run ends first."""
        def met():
            out = self.output()
            if value := condition(out):
                return value
            if self.proc.poll() is not None:
                raise AssertionError(f"the run ended ({self.proc.returncode}) before {what}; output:\n{out[-5000:]}")
            return None
        try:
            return wait_until(met, timeout, what, interval=0.05)
        except AssertionError as e:
            if "timed out" not in str(e):
                raise
            raise AssertionError(f"{e}; output:\n{self.output()[-5000:]}") from None

    def tcp_port(self, timeout: float = 30) -> int:
        """The port the run listens on for RLlink clients (--tcp-port 0 picks one), once it says."""
        found = self.wait_until(lambda out: re.search(r"listening for RLlink clients on [\d.]+:(\d+)", out), timeout,
                                "the run's TCP port")
        return int(found.group(1))

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
