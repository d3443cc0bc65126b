"""The shared-memory RLlink transport: ShmServer (learner) and ShmClient (simulator)."""
import base64
import gzip
import logging
import os
import signal
import threading
import time

import multiprocess
import numpy as np
import pytest

from shmrl import rllink
from conftest import make_episode, shmrl_files, wait_until
from shmrl.transport.doorbell import Doorbell, PeerGone
from shmrl.transport.ring import Ring, ShmSpaceError, fifo_path, sweep_stale
from shmrl.transport.slot import ClientSlot
from shmrl.transport.shm import ConnectionClosed, ShmClient, ShmServer

fork = multiprocess.get_context("fork")  # the server's FIFO ends are closed in the children
STATE = {"type": "SET_STATE", "onnx_file": base64.b64encode(gzip.compress(b"model")).decode(),
         "weights_seq_no": 7}


pytestmark = pytest.mark.usefixtures("no_shm_leftovers")


@pytest.fixture
def server():
    s = ShmServer(2, request_ring_bytes=1 << 16, reply_ring_bytes=1 << 14)
    yield s
    s.close()


def request_fifo(server) -> str:
    slot = ClientSlot.attach(server.address(0))
    try:
        return fifo_path(slot.request_doorbell)
    finally:
        slot.close()


def start(children, target, *args):
    p = fork.Process(target=target, args=args, daemon=True)
    p.start()
    children.append(p)
    return p


def serve(server, until, seconds: float = 10.0) -> list:
    """Answer like a tiny Hub until ``until(received)`` holds; returns what was received."""
    received, deadline = [], time.monotonic() + seconds
    while not until(received):
        assert time.monotonic() < deadline, f"gave up; received {received}"
        for conn_id, msg in server.poll(0.2):
            received.append((conn_id, msg))
            kind = msg and msg["type"]
            if kind == "PING":
                server.reply(conn_id, {"type": "PONG"})
            elif kind in ("GET_STATE", "EPISODES_AND_GET_STATE"):
                server.reply(conn_id, STATE)          # the same dict: encoded once per codec
    return received


# ---------------------------------------------------------------- round trips

def simulator(address: str, codec: str, seed: int, results) -> None:
    with ShmClient(address, codec=codec, timeout=10) as client:
        pong = client.request({"type": "PING"})
        client.send({"type": "EPISODES", "episodes": [make_episode(5, seed).to_rllink()]})
        state = client.request({"type": "EPISODES_AND_GET_STATE", "timesteps": 30,
                                "episodes": [make_episode(30, seed + 1).to_rllink()]})
        results.put((codec, pong["type"], state["type"], state["weights_seq_no"], state["onnx_file"]))


def test_two_simulators_binary_and_json(server, children):
    results = fork.Queue()
    start(children, simulator, server.address(0), "binary", 10, results)
    start(children, simulator, server.address(1), "json", 20, results)
    got = serve(server, lambda r: sum(m["type"] == "EPISODES_AND_GET_STATE" for _, m in r) == 2)
    assert server.codec_of("shm:0") == "binary" and server.codec_of("shm:1") == "json"
    replies = sorted(results.get(timeout=10) for _ in range(2))
    assert replies == [(codec, "PONG", "SET_STATE", 7, STATE["onnx_file"]) for codec in ("binary", "json")]
    for i, seed in ((0, 10), (1, 20)):
        msgs = [m for c, m in got if c == f"shm:{i}"]
        assert [m["type"] for m in msgs] == ["PING", "EPISODES", "EPISODES_AND_GET_STATE"]
        for msg, n, s in ((msgs[1], 5, seed), (msgs[2], 30, seed + 1)):
            ep, want = msg["episodes"].chunk(0), make_episode(n, s).finalize()
            assert len(ep) == n and ep.is_terminated
            for field in ("obs", "actions", "rewards", "action_dist_inputs", "action_logp"):
                np.testing.assert_allclose(np.asarray(getattr(ep, field)), getattr(want, field), rtol=1e-6)
    for p in children:
        p.join(5)
        assert p.exitcode == 0


def test_exact_json_frames_go_through_the_rings(server):
    """The bytes in the ring are the very RLlink frames that TCP would carry."""
    raw = ClientSlot.attach(server.address(0))
    doorbell = Doorbell.open(request_fifo(server), "w")
    try:
        frame = rllink.frame(rllink.encode_json({"type": "PING"}))
        assert frame == b'00000016{"type": "PING"}'
        assert raw.requests.try_write([frame])
        doorbell.ring()
        assert server.poll(1.0) == [("shm:0", {"type": "PING"})]
        server.reply("shm:0", {"type": "PONG"})
        assert raw.replies.read() == rllink.frame(rllink.encode_json({"type": "PONG"}))
    finally:
        raw.close()
        doorbell.close()


# ---------------------------------------------------------------- untrusted input

def pinger(address: str, results) -> None:
    with ShmClient(address, timeout=10) as client:
        results.put(client.request({"type": "PING"})["type"])


@pytest.mark.parametrize("garbage", [b"garbage", b"00000005hello", b"00000002{}",
                                     b"00000099" + b"\x07" * 20])
def test_garbage_closes_only_its_connection(server, children, caplog, garbage):
    raw = ClientSlot.attach(server.address(0))
    try:
        raw.requests.try_write([garbage])
        with caplog.at_level(logging.WARNING, logger="shmrl.transport"):
            assert server.poll(0.0) == [("shm:0", None)]
        assert "shm:0" in caplog.text and "closing connection" in caplog.text
        raw.requests.try_write([b"more garbage"])
        assert server.poll(0.0) == []  # reported once; the connection is ignored now
        results = fork.Queue()
        start(children, pinger, server.address(1), results)
        serve(server, lambda r: r, seconds=10)
        assert results.get(timeout=10) == "PONG"
        with ShmClient(server.address(0)) as late, pytest.raises(ConnectionClosed, match="closed this"):
            late.request({"type": "PING"})  # told at once, not after a timeout
        server.reset(0)  # a replacement client gets a fresh connection
        start(children, pinger, server.address(0), results)
        serve(server, lambda r: r, seconds=10)
        assert results.get(timeout=10) == "PONG"
    finally:
        raw.close()


def wait_for_reply(address: str, results) -> None:
    with ShmClient(address, timeout=10) as client:
        client.heartbeat(7)
        try:
            client.request({"type": "GET_STATE"})
            results.put("replied")
        except ConnectionClosed as e:
            results.put(str(e))


def test_drop_tells_the_waiting_client_why(server, children, caplog):
    results = fork.Queue()
    start(children, wait_for_reply, server.address(1), results)
    got = wait_until(lambda: server.poll(0.2), 10, "the client's GET_STATE", interval=0)
    assert got == [("shm:1", {"type": "GET_STATE"})]
    assert server.client_pid(1) == children[0].pid and server.env_steps(1) == 7    # its heartbeat
    assert server.client_pid(0) is None and server.env_steps(0) == 0
    with pytest.raises(ConnectionRefusedError, match="in use"):
        ShmClient(server.address(1))  # one writer per ring
    server.drop("shm:1", "obs shape (3,) != (4,)")
    assert "obs shape" in results.get(timeout=5)
    server.reply("shm:1", STATE)  # replies to a closed connection are dropped quietly
    assert "shm:1" in caplog.text and "obs shape" in caplog.text


def test_oversize_request_is_refused_by_the_client(server):
    with ShmClient(server.address(0)) as client:
        big = {"type": "EPISODES", "episodes": [make_episode(3000, 1).to_rllink()]}
        with pytest.raises(ValueError, match="larger than"):
            client.send(big)


# ---------------------------------------------------------------- the learner dies

def doomed_learner(results) -> None:
    server = ShmServer(1)
    results.put((server.address(0), os.getpid()))
    while True:  # read requests, never answer
        server.poll(1.0)


def test_client_sees_the_learner_killed(children):
    results = fork.Queue()
    learner = start(children, doomed_learner, results)
    address, pid = results.get(timeout=10)
    client = ShmClient(address, timeout=20)
    killed_at = []

    def kill():
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)
    timer = threading.Timer(0.3, kill)
    timer.start()
    try:
        with pytest.raises(PeerGone):
            client.request({"type": "GET_STATE"})
        assert time.monotonic() - killed_at[0] < 2.0
        with pytest.raises(PeerGone):
            client.send({"type": "PING"})  # and it stays gone
    finally:
        timer.cancel()
        client.close()
        learner.join(5)
        removed = sweep_stale("shmrl")  # the dead learner's segment and FIFOs
    assert {address, address + ".fifo"} <= set(removed)


# ---------------------------------------------------------------- cleanup

def test_close_leaves_nothing_in_dev_shm():
    mine = lambda: {e for e in shmrl_files() if int(e.split("_")[1]) == os.getpid()}  # noqa: E731
    before = mine()
    with ShmServer(3, request_ring_bytes=1 << 16, reply_ring_bytes=1 << 14) as server, \
            ShmServer(1, request_ring_bytes=1 << 16, reply_ring_bytes=1 << 14) as other:
        assert len(mine() - before) == (3 + 3 + 1) + (1 + 1 + 1)  # segments, reply FIFOs, request FIFO
        client = ShmClient(server.address(2))
        assert server.address(0) != other.address(0)
    assert mine() == before  # closed while a client is still attached
    server.close()  # idempotent
    client.close()
    with pytest.raises(ShmSpaceError, match="--shm-size"):
        ShmServer(8, free_bytes=1 << 20)
    assert mine() == before


def test_corrupt_record_closes_its_connection_after_a_few_quick_looks(server, caplog):
    raw = ClientSlot.attach(server.address(0))
    doorbell = Doorbell.open(request_fifo(server), "w")
    try:
        raw.requests.try_write([rllink.frame(rllink.encode_json({"type": "PING"}))])
        raw.segment.buf[ClientSlot.HEADER_BYTES + Ring.HEADER_BYTES + 20] ^= 0xFF  # a payload byte
        doorbell.ring()  # rung once, as a client does; the re-checks need no more
        t0, got = time.monotonic(), []
        while not got:
            assert time.monotonic() - t0 < 1.0  # re-checked within ms, though nobody rings
            got = server.poll(5.0)
        assert got == [("shm:0", None)] and "crc" in caplog.text
    finally:
        raw.close()
        doorbell.close()


@pytest.mark.parametrize("env, hidden, envs_per_sim, steps", [
    ("CartPole-v1", 512, 128, 16384),   # a big model, long messages
    ("Pendulum-v1", 64, 3, 1000),       # Box actions; steps rounded up to whole steps of 3 envs
])
def test_rings_take_every_frame_of_the_run(env, hidden, envs_per_sim, steps):
    """A SET_STATE the reply ring cannot hold, or an EPISODES message the request ring
    cannot, used to stall a run (--hidden 512 hung, --env-steps-per-sample 16384 crashed)."""
    from shmrl.envs.make import env_spec, make_vec_env
    from shmrl.client.rollout import Rollout
    from shmrl.onnxio.policy import encode_onnx_file
    from shmrl.config.settings import Config, resolve_config
    from shmrl.server.serving import ring_bytes
    from shmrl.trainer.setup import policy_net
    from shmrl.client.simulator import make_sampler
    from shmrl.transport.ring import Ring

    spec = env_spec(env)
    config = resolve_config(Config(env=env, hidden=hidden, envs_per_sim=envs_per_sim,
                                      env_steps_per_sample=steps), spec)
    net = policy_net(config, spec)
    rings = ring_bytes(config, spec, {"default": net})
    model = net.template.publish(net.initial_weights(0))
    set_state = {"type": "SET_STATE", "onnx_file": encode_onnx_file(model), "weights_seq_no": 1}
    # The worst case for a message's size: every env's episode ends at every step (short chunks).
    envs, per_env = make_vec_env(env, envs_per_sim, 0), -(-steps // envs_per_sim)
    rollout, sampler = Rollout(envs_per_sim, per_env), make_sampler(spec, np.random.default_rng(0))
    obs = envs.reset()
    rollout.start(obs)
    for _ in range(per_env):
        actions, logp = sampler.sample(np.zeros((envs_per_sim, spec.policy_outputs), np.float32))
        obs, rewards, _, _, _ = envs.step(actions)
        done = np.ones(envs_per_sim, bool)
        rollout.record(actions, np.zeros((envs_per_sim, spec.policy_outputs)), logp, obs, rewards, done,
                       ~done, obs)
    episodes = {"type": "EPISODES_AND_GET_STATE", "episodes": rollout.batch(7), "timesteps": per_env * envs_per_sim}
    for msg, capacity in ((episodes, rings["request_ring_bytes"]), (set_state, rings["reply_ring_bytes"])):
        frame = 8 + len(rllink.encode_binary(msg))
        assert frame <= Ring(memoryview(bytearray(Ring.nbytes(capacity))), 0, capacity).max_payload, msg["type"]
