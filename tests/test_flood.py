"""Hostile clients against the serving side (issue 22, items 13-18): memory and work per
client are bounded, and no message ends the run. Raw-socket clients speak both codecs to a
real TcpServer served by a real Serving thread (no trainer: batches are not consumed, so
whatever a client sends stays pending unless the server bounds it)."""
from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from conftest import FakeServer, wait_until
from shmrl import rllink
from shmrl.config.settings import Config
from shmrl.envs.make import env_spec
from shmrl.core.episode import EpisodeBatch
from shmrl.server.hub import OVER_BUDGET, Hub
from shmrl.model.net import PolicyNet
from shmrl.server.serving import Serving, open_transports
from shmrl.server.store import DEFAULT_POLICY, EpisodeStore

SPEC = env_spec("CartPole-v1")
CODECS = ("json", "binary")


# ---------------------------------------------------------------- raw clients

def one_step_chunks(chunks: int, steps_each: int = 1, seed: int = 0) -> EpisodeBatch:
    """``chunks`` CartPole-shaped chunks of ``steps_each`` steps (0: observation only)."""
    rng = np.random.default_rng(seed)
    steps = chunks * steps_each
    return EpisodeBatch(obs=rng.normal(size=(steps + chunks, 4)).astype(np.float32),
                        actions=rng.integers(0, 2, steps), rewards=np.ones(steps, np.float32),
                        action_dist_inputs=np.zeros((steps, 2), np.float32),
                        action_logp=np.full(steps, -0.69, np.float32), lengths=np.full(chunks, steps_each),
                        is_terminated=np.zeros(chunks, bool), is_truncated=np.zeros(chunks, bool))


def send_frame(sock: socket.socket, msg: dict, codec: str) -> None:
    sock.sendall(rllink.frame(rllink.encode(msg, codec)))


def recv_msg(sock: socket.socket, timeout: float = 10.0) -> dict:
    sock.settimeout(timeout)
    header = b""
    while len(header) < 8:
        part = sock.recv(8 - len(header))
        if not part:
            raise ConnectionError("closed")
        header += part
    n, body = int(header), bytearray()
    while len(body) < n:
        part = sock.recv(min(1 << 20, n - len(body)))
        if not part:
            raise ConnectionError("closed")
        body += part
    return rllink.decode(bytes(body))


def closed(sock: socket.socket, timeout: float = 30.0) -> bool:
    """Whether the server closes ``sock`` within ``timeout`` (replies before that are read).
    Not when the timeout passes: the server closes a connection after logging why, so a
    test that reads the log once this is true reads it whole, however slow the server was."""
    sock.settimeout(timeout)
    try:
        while sock.recv(1 << 16):
            pass
        return True
    except TimeoutError:
        return False
    except (ConnectionError, OSError):
        return True


class Served:
    """A TcpServer with the limits of ``config``, served by a Serving thread."""

    def __init__(self, **fields):
        self.config = Config(sims=0, tcp_port=0, env_steps_per_sample=32, train_batch_size=64, **fields)
        net = PolicyNet(SPEC)
        [self.server], _, _ = open_transports(self.config, SPEC, {DEFAULT_POLICY: net})   # the run's own limits
        self.serving = Serving([self.server], self.config, {DEFAULT_POLICY: SPEC}, {DEFAULT_POLICY: net.template},
                               {DEFAULT_POLICY: net.initial_weights(0)})
        self.serving.start()
        self.socks = []

    def connect(self, codec: str = "json", name: str | None = None, token: str | None = None) -> socket.socket:
        sock = socket.create_connection(self.server.address, timeout=10)
        self.socks.append(sock)
        ping = {"type": "PING", **({"codecs": ["binary"]} if codec == "binary" else {}),
                **({"client_name": name} if name else {}), **({"auth_token": token} if token else {})}
        send_frame(sock, ping, "json")
        assert recv_msg(sock)["type"] == "PONG"
        return sock

    def round_trip(self, sock: socket.socket, codec: str = "json") -> float:
        start = time.perf_counter()
        send_frame(sock, {"type": "PING"}, codec)
        assert recv_msg(sock)["type"] == "PONG"
        return time.perf_counter() - start

    def close(self):
        for sock in self.socks:
            sock.close()
        self.serving.stop()
        self.server.close()
        assert self.serving.failure is None, self.serving.failure


@pytest.fixture
def served():
    made = []

    def make(**fields):
        made.append(Served(**fields))
        return made[-1]

    yield make
    for s in made:
        s.close()


# ---------------------------------------------------------------- item 13: a budget per client

@pytest.mark.parametrize("codec", CODECS)
def test_a_flooding_tcp_client_is_not_read_past_its_budget(served, codec):
    s = served(client_budget=256)
    flooder, honest = s.connect(codec, "flooder"), s.connect("json", "honest")
    batch = one_step_chunks(4, 16)   # 64 steps a message
    flooder.settimeout(10)
    for _ in range(40):               # 2560 steps: ten times the budget
        send_frame(flooder, {"type": "EPISODES", "episodes": batch}, codec)
    hub, store = s.serving.hub, s.serving.store
    wait_until(lambda: s.serving.connection_named("flooder") in hub.held, 10, "the flooder to be held")
    time.sleep(0.5)                   # what was in flight when it was held arrives (and is dropped)
    # At most one batch (64 steps) was handed to a trainer that never takes it.
    assert store.pending_steps <= 256 and store.steps_taken <= 64
    assert store.steps_received < 2560, "the server went on reading the flooder"
    assert store.steps_received == store.pending_steps + store.steps_taken + store.steps_dropped.get(OVER_BUDGET, 0)
    s.round_trip(honest)   # the run goes on, and a client within its budget is served


def test_a_transport_that_cannot_hold_a_client_drops_and_counts_its_steps_over_budget(caplog):
    store = EpisodeStore()
    hub = Hub({DEFAULT_POLICY: SPEC}, store, 32, client_budget=100)
    server = FakeServer()
    with caplog.at_level(logging.WARNING):
        for _ in range(10):
            hub.handle(server, "shm:0", rllink.validate({"type": "EPISODES", "episodes": one_step_chunks(2, 20)},
                                                        "request"))
    assert store.pending_steps == 120 and store.steps_dropped[OVER_BUDGET] == 280   # one message may cross it
    assert caplog.text.count(OVER_BUDGET) == 1 and not server.dropped


# ---------------------------------------------------------------- item 14: work per message

@pytest.mark.parametrize("codec", CODECS)
def test_a_message_over_the_chunk_or_step_limit_closes_its_connection(served, codec, caplog):
    s = served(max_message_steps=1000)   # chunks: 2024
    honest = s.connect("json", "honest")
    for batch, why in ((one_step_chunks(3000, 0), "3000 chunks in one message"),
                       (one_step_chunks(1, 1500), "1500 env steps in one message")):
        with caplog.at_level(logging.WARNING):
            flooder = s.connect(codec)
            send_frame(flooder, {"type": "EPISODES", "episodes": batch}, codec)
            assert closed(flooder)
            wait_until(lambda: why in caplog.text, 5, f"the log to say {why!r}")
        s.round_trip(honest)
    assert s.serving.store.pending_steps == 0


@pytest.mark.parametrize("codec", CODECS)
def test_a_frame_bigger_than_any_message_within_the_limits_is_refused_from_its_first_bytes(served, codec, caplog):
    s = served()
    honest = s.connect("json", "honest")
    quiet = min(s.round_trip(honest) for _ in range(5))
    big = rllink.frame(rllink.encode(   # item 14's frame, smaller: many zero-step episodes
        {"type": "EPISODES", "episodes": one_step_chunks(60_000, 0)}, codec))
    assert len(big) > 1 << 20
    flooder = s.connect(codec)
    with caplog.at_level(logging.WARNING):
        flooder.sendall(big[:4096])   # the header and the first bytes suffice
        assert closed(flooder)
    name = "binary" if codec == "binary" else "JSON"
    assert f"{name} frame of {len(big) - 8} bytes exceeds the maximum of" in caplog.text
    assert s.round_trip(honest) < max(0.5, 50 * quiet)


def test_one_message_of_many_chunks_makes_updates_of_the_batch_size():
    store = EpisodeStore()
    store.add("tcp:flood", {DEFAULT_POLICY: one_step_chunks(600, 1)})
    sizes = []
    while store.pending_steps:
        taken = store.take(max_steps=64)[DEFAULT_POLICY]
        sizes.append(sum(b.num_steps for b in taken))
    # Never one update of 600 steps: the last batch of an update may only go over by less
    # than the batch size (an honest client's message is kept whole).
    assert sizes == [64] * 8 + [88]
    assert store.pending_of("tcp:flood") == 0


# ---------------------------------------------------------------- item 15: no steps, still answered

@pytest.mark.parametrize("episodes", [[], "zero-step chunk"])
@pytest.mark.parametrize("codec", CODECS)
def test_episodes_and_get_state_without_steps_from_the_only_client_is_answered(served, codec, episodes):
    s = served()
    sock = s.connect(codec)
    send_frame(sock, {"type": "GET_STATE"}, codec)
    assert recv_msg(sock)["type"] == "SET_STATE"
    batch = one_step_chunks(1, 0) if episodes else EpisodeBatch.from_episodes([])
    send_frame(sock, {"type": "EPISODES_AND_GET_STATE", "episodes": batch}, codec)
    assert recv_msg(sock, timeout=5)["type"] == "SET_STATE"


# ---------------------------------------------------------------- item 16: no message kills the run

def test_a_lone_surrogate_auth_token_closes_that_connection_only(served, caplog):
    s = served(auth_token="s3cret")
    evil = socket.create_connection(s.server.address, timeout=10)
    s.socks.append(evil)
    body = b'{"type": "PING", "auth_token": "\\ud800"}'   # valid JSON, not encodable as UTF-8
    with caplog.at_level(logging.WARNING):
        evil.sendall(rllink.frame(body))
        assert closed(evil)
    assert s.serving.hub.auth_failures == 1 and "authentication failed" in caplog.text
    honest = s.connect(token="s3cret")
    s.round_trip(honest)


def test_an_exception_from_one_clients_input_closes_its_connection_and_the_run_goes_on(served, caplog):
    s = served()
    handle = s.serving.hub.handle

    def broken_for_mallory(server, conn_id, msg):
        if s.serving.hub.name(conn_id) == f"{conn_id} (mallory)" and msg and msg["type"] == "GET_CONFIG":
            raise RuntimeError("a bug that only mallory's input reaches")
        handle(server, conn_id, msg)

    s.serving.hub.handle = broken_for_mallory
    honest, mallory = s.connect(name="honest"), s.connect(name="mallory")
    with caplog.at_level(logging.WARNING):
        send_frame(mallory, {"type": "GET_CONFIG"}, "json")
        assert closed(mallory)
    assert "internal error on its input: RuntimeError" in caplog.text
    send_frame(honest, {"type": "GET_CONFIG"}, "json")
    assert recv_msg(honest)["type"] == "SET_CONFIG"
    assert s.serving._thread.is_alive() and s.serving.failure is None


# ---------------------------------------------------------------- item 17: a policy too big to frame

@pytest.mark.parametrize("hidden", [5000, 100_000])
def test_a_policy_too_big_for_one_frame_is_refused_at_start(tmp_path, hidden):
    out = subprocess.run([sys.executable, "-m", "shmrl.run", "--env", "CartPole-v1", "--sims", "0", "--tcp-port",
                          "0", "--hidden", str(hidden), "--logdir", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the policy is too large to send"), out.stderr
    assert "listening" not in out.stdout


# ---------------------------------------------------------------- item 18: agent ids are the env's

def multi_agent_chunk(agent_id, steps: int = 3) -> dict:
    return {"obs": [[0.0] * 4] * (steps + 1), "actions": [0] * steps, "rewards": [1.0] * steps,
            "action_dist_inputs": [[0.0, 0.0]] * steps, "action_logp": [-0.69] * steps, "is_terminated": True,
            "is_truncated": False, "agent_id": agent_id, "module_id": "shared"}


def test_chunks_of_agents_the_env_does_not_have_are_refused_and_counted():
    store = EpisodeStore(["shared"])
    hub = Hub({"shared": SPEC}, store, 32, multiagent=True, agents=("player_0", "player_1"))
    server = FakeServer()
    good = rllink.validate({"type": "EPISODES", "episodes": [multi_agent_chunk("player_0")]}, "request")
    hub.handle(server, "tcp:good", good)
    for i in range(100):
        evil = rllink.validate({"type": "EPISODES", "episodes": [multi_agent_chunk(f"mallory{i}")]}, "request")
        hub.handle(server, f"tcp:evil{i}", evil)
    assert set(store.policies["shared"].returns_by_agent) == {"player_0"}
    assert store.steps_dropped["does not fit the environment"] == 300
    assert len(server.dropped) == 100 and "are not the env's" in server.dropped[0][1]


# ---------------------------------------------------------------- the learner's memory under a flood

def test_the_learners_memory_stays_bounded_while_a_client_floods(start_run):
    # Dropped steps count as received: no step budget, or the flood would end the run.
    run = start_run("--env", "CartPole-v1", "--sims", "0", "--tcp-port", "0", "--train-batch-size", "512",
                    "--max-env-steps", 10**12, "--epochs", "1")
    port = run.tcp_port()
    learner = psutil.Process(run.proc.pid)
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        send_frame(sock, {"type": "PING", "codecs": ["binary"]}, "json")
        assert recv_msg(sock)["type"] == "PONG"
        send_frame(sock, {"type": "GET_STATE"}, "binary")
        assert recv_msg(sock)["type"] == "SET_STATE"
        # One update first (its answer waits for it): torch is loaded and has trained once.
        send_frame(sock, {"type": "EPISODES_AND_GET_STATE", "episodes": one_step_chunks(16, 32)}, "binary")
        assert recv_msg(sock, timeout=120)["type"] == "SET_STATE"
        frame = rllink.frame(rllink.encode_binary({"type": "EPISODES", "episodes": one_step_chunks(64, 32)}))
        before = learner.memory_info().rss
        deadline, sent, peak = time.monotonic() + 5, 0, before
        sock.settimeout(0.2)   # a held flooder blocks in send: it tries again until the deadline
        while time.monotonic() < deadline:
            try:
                sock.sendall(frame)
                sent += 2048
            except TimeoutError:
                pass
            except ConnectionError:
                raise AssertionError(f"the server closed the flooder; its output:\n{run.output()[-3000:]}")
            peak = max(peak, learner.memory_info().rss)
        assert sent > 100_000, f"the flood sent only {sent} env steps"
        assert peak - before < 200 << 20, f"the learner grew by {(peak - before) >> 20} MiB under {sent} env steps"
    finally:
        sock.close()


# ---------------------------------------------------------------- the tool that measures all this

@pytest.mark.slow   # a whole run, torch and all, and a window per attack
def test_abuse_messages_reports_memory_and_round_trips_under_each_attack(tmp_path):
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-m", "tests.harness.abuse_messages", "--seconds", "1", "--json",
                          "--only", "huge-json", "surrogate", "empty"],
                         capture_output=True, text=True, timeout=300, cwd=repo)
    assert out.returncode in (0, 1), out.stderr[-3000:]   # 1: a gate failed on a loaded machine
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert list(result["rows"]) == ["quiet", "busy", "huge-json", "surrogate", "empty"]
    for name, row in result["rows"].items():
        assert row["rtt_ms"]["PING"] > 0 and row["rss_peak_mib"] >= row["rss_before_mib"] > 0
        if name not in ("quiet", "busy"):
            assert row["run_alive"]
    assert result["rows"]["huge-json"]["attacker"]["closed"] >= 1      # refused, and back for more
    assert result["rows"]["surrogate"]["attacker"]["closed"] >= 1
    assert result["rows"]["empty"]["attacker"]["replies"] >= 1         # answered, the good client sampling too
