"""What every test file shares: the slow set left out of the default run, bounded waits
(``wait_until`` and what is built on it: ``Run.wait_until``, ``all_gone``, ``serve_until``),
``python -m shmrl.run`` in a process of its own (``start_run``), a run's summary and
metrics, the process and /dev/shm checks, a full disk (``small_disk``), ``need`` for the
optional env families and CartPole beside gymnasium's, and RLlink messages as RLlib
writes them (and in binary, as shmrl's simulators do) with the ``net`` fixture (TCP
servers, a hub loop, sockets and threads, all closed in teardown)."""
import json
import logging
import os
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import psutil
import pytest

from shmrl import rllink
from shmrl.envs.make import env_spec, make_env   # none of these imports torch: simulator processes import this module
from shmrl.core.episode import Episode
from shmrl.server.hub import Hub
from shmrl.server.store import DEFAULT_POLICY, EpisodeStore
from shmrl.transport.tcp import TcpServer
from shmrl.transport.tcp_client import TcpClient


def pytest_configure(config):
    """Hypothesis draws the same examples on every run of the suite (``derandomize``, as its
    own CI profile does): a run passes or fails by the code, never by the draw.
    ``HYPOTHESIS_PROFILE=explore`` draws new ones each run, for a fuzzing session."""
    from hypothesis import settings

    settings.register_profile("suite", derandomize=True, database=None)
    settings.register_profile("explore", derandomize=False)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))


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


JS_CLIENT = Path(__file__).resolve().parents[1] / "clients" / "js"


def need_js_client() -> Path:
    """clients/js, or skip the calling test with the reason: Node, or the client's
    node_modules (``npm ci`` in clients/js, which .ci/run does), is missing here."""
    if shutil.which("node") is None:
        pytest.skip("node is not installed: the JavaScript client needs Node >= 18")
    if not (JS_CLIENT / "node_modules" / "onnxruntime-node").is_dir():
        pytest.skip("clients/js/node_modules is missing: run (cd clients/js && npm ci) (.ci/run does)")
    return JS_CLIENT


def balancing_action(obs) -> int:
    """CartPole's action that keeps the pole up for all 500 steps: push toward the side
    it falls to."""
    return int(obs[2] + 0.5 * obs[3] > 0)


def step_beside_gymnasium(env_id: str, mine, seed: int, next_action, atol: float) -> tuple[int, bool, bool]:
    """Reset ``mine`` and gymnasium's ``env_id`` with ``seed`` and step both with the same
    actions until the episode ends, checking each step; returns (steps, terminated, truncated)."""
    ref = need("gymnasium", "gym").make(env_id)
    ref_obs, _ = ref.reset(seed=seed)
    obs, _ = mine.reset(seed=seed)
    np.testing.assert_array_equal(obs, ref_obs)  # same seeding, same reset distribution
    for steps in range(1, 1001):   # both envs end episodes by 500 steps: one that never ends fails here
        # Step both from the same state: gymnasium uses np.cos/np.sin, we use math's, and
        # a last-bit difference would grow along a chaotic trajectory.
        mine._state = tuple(float(v) for v in ref.unwrapped.state)
        action = next_action(ref_obs)
        ref_obs, ref_r, ref_term, ref_trunc, _ = ref.step(action)
        obs, r, term, trunc, _ = mine.step(action)
        np.testing.assert_allclose(obs, ref_obs, rtol=1e-6, atol=atol)
        assert r == pytest.approx(float(ref_r), rel=1e-9, abs=1e-9)
        assert (term, trunc) == (ref_term, ref_trunc)
        if term or trunc:
            return steps, term, trunc
    raise AssertionError(f"{env_id}: no episode end in 1000 steps")


def simulator_threads(server, n: int = 2) -> list[threading.Thread]:
    """``n`` of shmrl's simulator loops (CartPole, seeds 0..n-1) in daemon threads, each a
    client of the in-process ``server``, started; each ends when the run closes the server."""
    from shmrl.client.simulator import run_simulator

    def simulate(client, seed):
        try:
            run_simulator(client, seed=seed)
        except ConnectionError:
            pass   # the run closed the server

    threads = [threading.Thread(target=simulate, args=(server.connect(timeout=10), i), daemon=True)
               for i in range(n)]
    for t in threads:
        t.start()
    return threads


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
                  logdir=str(logdir), plot=False)
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
    stopped before training, and the last row's counters are the summary's."""
    assert summary["env_steps"] == (summary["env_steps_trained"] + summary["env_steps_pending"]
                                    + sum(summary["env_steps_dropped"].values())), summary
    assert sum(summary["env_steps_by_client"].values()) == summary["env_steps"], summary
    if logdir is not None:
        rows = metrics_rows(logdir)
        assert summary["updates"] == len(rows), (len(rows), summary)
        assert summary["env_steps_trained"] == sum(r["batch_steps"] for r in rows), summary
        if rows:
            assert {k: rows[-1][k] for k in BOOKS} == {k: summary[k] for k in BOOKS}, (rows[-1], summary)


# The counters metrics.jsonl's rows and summary.json share: at a run's end, the last row's are the summary's.
BOOKS = ("episodes", "env_steps", "env_steps_accepted", "env_steps_trained", "env_steps_pending",
         "env_steps_dropped", "env_steps_lost", "env_steps_by_client", "bad_frames", "clients_timed_out",
         "short_batches", "updates_skipped", "heartbeats_ignored", "simulator_restarts")


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


@pytest.fixture
def small_disk(tmp_path):
    """A 200 KiB tmpfs: a real full disk (ENOSPC). Needs root and mount(8)."""
    where = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    where.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(where)],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot mount a small tmpfs for a full disk here: {e}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs for a full disk here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=10)


class Run:
    """``python -m shmrl.run`` in its own process group, always killed in teardown."""

    def __init__(self, args, tmp_path, preexec_fn=None):
        self.log_path = tmp_path / "run.log"
        self.log = open(self.log_path, "w")
        # In the test's own folder: a run without --logdir writes runs/... where it starts.
        if "--log-every" not in args:
            args = [*args, "--log-every", "0"]  # the tests watch for every update's line
        if "--plot" not in args:
            args = [*args, "--no-plot"]         # about 1 s per run; tests/test_eval_plot.py draws one
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


EXAMPLE_CLIENT = Path(__file__).resolve().parents[1] / "examples" / "external_client.py"


def run_beside_example_client(start_run, tmp_path, game: str, *run_args, timeout: float = 150) -> tuple[Run, str]:
    """A ``--sims 0 --tcp-port 0`` run (``run_args`` added) fed by examples/external_client.py
    playing ``game`` over TCP, until the run ends; the run and the client's output. The
    example is importable from the run's folder too (``--env examples.external_client:...``)."""
    (tmp_path / "examples").mkdir(exist_ok=True)
    shutil.copy(EXAMPLE_CLIENT, tmp_path / "examples" / "external_client.py")
    run = start_run("--sims", 0, "--tcp-port", 0, *(() if "--env" in run_args else ("--env", "CartPole-v1")), *run_args)
    client = subprocess.Popen([sys.executable, str(EXAMPLE_CLIENT), "--port", str(run.tcp_port()),
                               "--max-retries", "0", "--game", game],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        run.proc.wait(timeout=timeout)
        client.wait(timeout=30)
    finally:
        client.kill()
        out = client.communicate(timeout=5)[0]
    return run, out


# A module of a user env factory (format it with the paths ``armed`` and ``hung``): the first
# env to step after ``armed`` exists creates ``hung`` and hangs for good.
HANGING_ENV = """
import os, time
from shmrl.envs.make import make_env as _make

def make_env():
    env = _make("CartPole-v1")
    step = env.step

    def step_or_hang(action):
        if os.path.exists({armed!r}):
            try:   # the first env to step once armed hangs, for good
                os.close(os.open({hung!r}, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass
            else:
                time.sleep(3600)
        return step(action)

    env.step = step_or_hang
    return env
"""


# ------------------------------------------------- RLlink messages, TCP servers and a hub loop

def rllib_frame(msg: dict) -> bytes:
    """A frame exactly as RLlib 2.48's client writes one."""
    body = json.dumps(msg).encode("utf-8")
    return f"{len(body):08d}".encode() + body


def rllib_episodes(steps: int, seed: int = 0) -> list:
    """``steps`` CartPole steps recorded as RLlib 2.48's _dummy_client records them: plain
    lists (float32 ``.tolist()``), a new chunk at every episode end."""
    env, rng = make_env("CartPole-v1"), np.random.default_rng(seed)
    obs, _ = env.reset(seed=seed)
    episodes, observations, actions, dist, logps, rewards = [], [obs.tolist()], [], [], [], []
    for t in range(1, steps + 1):
        logits = rng.normal(size=2).astype(np.float32)
        probs = np.exp(logits.astype(np.float64)) / np.exp(logits.astype(np.float64)).sum()
        action = int(rng.choice(2, p=probs))
        obs, reward, terminated, truncated, _ = env.step(action)
        observations.append(obs.tolist())
        actions.append(action)
        dist.append(logits.tolist())
        logps.append(float(np.log(probs[action])))
        rewards.append(reward)
        if t == steps or terminated or truncated:
            episodes.append({"obs": observations, "actions": actions, "action_dist_inputs": dist,
                             "action_logp": logps, "rewards": rewards, "is_terminated": terminated,
                             "is_truncated": truncated})
            observations, actions, dist, logps, rewards = [observations[-1]], [], [], [], []
            if terminated or truncated:
                obs, _ = env.reset()
                observations = [obs.tolist()]
    return episodes


def episodes_msg(steps: int = 8, seed: int = 0, kind: str = "EPISODES_AND_GET_STATE", count="timesteps"):
    """An RLlink EPISODES(_AND_GET_STATE) as RLlib's client sends it, ``steps`` CartPole steps."""
    return {"type": kind, "episodes": rllib_episodes(steps, seed), count: steps}


def make_episode(n: int, seed: int) -> Episode:
    """A CartPole-shaped episode of ``n`` random steps that terminates at its last."""
    rnd = np.random.default_rng(seed)
    ep = Episode(rnd.normal(size=4).astype(np.float32))
    for t in range(n):
        ep.add_step(t % 2, 1.0, rnd.normal(size=4).astype(np.float32),
                    rnd.normal(size=2).astype(np.float32), -0.5, terminated=t == n - 1)
    return ep


def chunk(obs0, n, *, terminated=False, truncated=False, id=None, obs_dim=4, action=0):
    """A finalized episode chunk of ``n`` steps whose observations count up from ``obs0``
    (so that continuations glue by obs); it ends as told on its last step."""
    ep = Episode(np.full(obs_dim, obs0, np.float32), id=id)
    for t in range(n):
        ep.add_step(action, 1.0, np.full(obs_dim, obs0 + t + 1, np.float32), np.zeros(2, np.float32), -0.7,
                    terminated=terminated and t == n - 1, truncated=truncated and t == n - 1)
    return ep.finalize()


# The env spec of the CartPole every RLlink helper here plays.
SPEC = env_spec("CartPole-v1")


def state_frame(seq: int, onnx_file: str = "abc") -> bytes:
    """The SET_STATE the hub sends for weights ``seq``, as RLlib's JSON frame."""
    return rllib_frame({"type": "SET_STATE", "onnx_file": onnx_file, "weights_seq_no": seq})


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        assert part, f"EOF after {len(data)} of {n} bytes"
        data += part
    return data


def recv_frame(sock: socket.socket) -> bytes:
    """One whole frame, its 8-byte header included."""
    header = recv_exactly(sock, 8)
    return header + recv_exactly(sock, int(header))


def conn_id_of(sock_or_client) -> str:
    """The id the TCP server gives the connection of a raw socket or a TcpClient."""
    host, port = (sock_or_client.local_address if isinstance(sock_or_client, TcpClient)
                  else sock_or_client.getsockname()[:2])
    return f"tcp:{host}:{port}"


def log_lines(caplog, conn_id: str, level=logging.WARNING) -> list[str]:
    """The log messages at ``level`` about connection ``conn_id``."""
    messages = [r.getMessage() for r in caplog.records if r.levelno == level]
    return [m for m in messages if m.startswith(conn_id + ":")]


def binary_frame(msg: dict) -> bytes:
    """``msg`` framed in shmrl's binary codec."""
    return rllink.frame(rllink.encode_binary(msg))


def decode_frame(data: bytes) -> dict:
    """The message in one whole frame, JSON or binary."""
    assert int(data[:8]) == len(data) - 8
    return rllink.decode(data[8:])


def binary_episodes(steps: int, seed: int = 0) -> dict:
    """An EPISODES_AND_GET_STATE as shmrl's simulators send it in binary: columns."""
    msg = rllink.validate(episodes_msg(steps, seed), "request")
    return {"type": "EPISODES_AND_GET_STATE", "episodes": msg["episodes"], "timesteps": steps}


def read_to_eof(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything until the server closes the connection (a reset counts as closed)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
    except ConnectionResetError:
        pass
    return data


class HubLoop:
    """The learner's side in a thread, as production runs it: the real Hub and EpisodeStore,
    fed by server.poll() whenever server.fileno() is readable. With ``auto_publish`` it
    publishes new weights as soon as a client waits for them (an instant training step);
    without, once ``publish_requested`` is set and a client waits. ``shared_batch``: the
    Hub's batch to share over its clients (None: 8 env steps per sample, fixed)."""

    def __init__(self, server: TcpServer, *, auto_publish: bool = True, onnx_file: str = "abc",
                 shared_batch: int | None = None):
        self.server, self.auto_publish, self.onnx_file = server, auto_publish, onnx_file
        self.store = EpisodeStore()
        self.hub = Hub({DEFAULT_POLICY: env_spec("CartPole-v1")}, self.store, env_steps_per_sample=8, on_policy=True,
                       shared_batch=shared_batch)
        self.publish_requested = threading.Event()
        self.seq = 1
        self.publish()
        self.received: list[tuple[str, str | None]] = []  # (conn_id, type), None: closed
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hub-loop", daemon=True)
        self._thread.start()

    def _run(self):
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(self.server.fileno(), selectors.EVENT_READ)
                while not self._stop.is_set():
                    sel.select(0.05)
                    for conn_id, msg in self.server.poll(0.0):
                        self.hub.handle(self.server, conn_id, msg)
                        # After handling: a test that sees a close in closed() may read what the
                        # hub did with it (steps counted lost, its log lines) at once.
                        self.received.append((conn_id, msg and msg["type"]))
                    if self.hub.waiting and (self.auto_publish or self.publish_requested.is_set()):
                        self.publish_requested.clear()
                        self.seq += 1
                        self.publish()
                    self.hub.flush_actions()   # server-side inference: the round's ACTs
        except BaseException as e:  # reported by stop()
            self.error = e

    def publish(self) -> None:
        self.hub.set_state(self.seq, {DEFAULT_POLICY: {"onnx_file": self.onnx_file, "weights_seq_no": self.seq}})

    def closed(self) -> list[str]:
        return [c for c, kind in list(self.received) if kind is None]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        assert not self._thread.is_alive(), "hub loop did not stop"
        if self.error is not None:
            raise self.error


class Net:
    """Servers, hub loops, sockets and threads of one test, all closed in teardown."""

    def __init__(self):
        self.stop = threading.Event()
        self.servers, self.hubs, self.socks, self.threads, self.errors = [], [], [], [], []

    def server(self, **kw) -> TcpServer:
        self.servers.append(TcpServer("127.0.0.1", 0, **kw))
        return self.servers[-1]

    def hub(self, server, **kw) -> HubLoop:
        self.hubs.append(HubLoop(server, **kw))
        return self.hubs[-1]

    def raw(self, server, timeout: float = 5.0, rcvbuf: int | None = None) -> socket.socket:
        s = socket.socket()
        self.socks.append(s)
        if rcvbuf:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        s.settimeout(timeout)
        s.connect(server.address)
        return s

    def client(self, server, **kw) -> TcpClient:
        kw.setdefault("codec", "json")  # RLlib's JSON variant; test_tcp_binary.py tests the binary codec
        self.socks.append(TcpClient(*server.address, **kw))
        return self.socks[-1]

    def thread(self, fn, *args) -> threading.Thread:
        def run():
            try:
                fn(*args)
            except BaseException as e:
                if not self.stop.is_set():  # failures after teardown began are expected
                    self.errors.append(e)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.threads.append(t)
        return t

    def teardown(self):
        self.stop.set()
        for s in self.socks:
            if isinstance(s, socket.socket):
                try:
                    s.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv on it
                except OSError:
                    pass
            s.close()
        for t in self.threads:
            t.join(5)
        for h in self.hubs:
            h.stop()
        for s in self.servers:
            s.close()
        assert not [t for t in self.threads if t.is_alive()], "threads left running"
        assert not self.errors, self.errors


@pytest.fixture
def net():
    n = Net()
    try:
        yield n
    finally:
        n.teardown()


class FakeServer:
    """A transport's reply side that records what the Hub sends and drops."""

    def __init__(self):
        self.replies, self.dropped = [], []

    def reply(self, conn_id, msg):
        self.replies.append((conn_id, msg))

    def drop(self, conn_id, reason):
        self.dropped.append((conn_id, reason))


@pytest.fixture
def procs():
    """Client processes (C, C#, Godot...) a test starts: killed in teardown."""
    started = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.communicate(timeout=10)


class ListeningServer:
    """A listening socket on which a test plays the server for a client in another language,
    one frame at a time; each wait bounded by 30 s (a mono or Godot start on a loaded machine)."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(30)
        self.port = self.listener.getsockname()[1]

    def accept(self) -> socket.socket:
        conn, _ = self.listener.accept()
        conn.settimeout(30)
        return conn

    def close(self):
        self.listener.close()


@pytest.fixture
def server():
    s = ListeningServer()
    yield s
    s.close()


def read_body(conn) -> bytes:
    """One frame's body: 8 digits of length, then the body."""
    header = recv_exactly(conn, 8)
    assert header.isdigit(), header
    return recv_exactly(conn, int(header))


def send(conn, msg: dict, codec: str = "json") -> None:
    conn.sendall(rllink.frame(rllink.encode(msg, codec)))
