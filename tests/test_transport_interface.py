"""Every transport behind one typed interface: the protocols, the one ConnectionClosed, the
one encoder, the one wake pipe, the one wait for space in a ring."""
import inspect
import threading
import time

import numpy as np
import pytest

from shmrl import rllink
from shmrl.transport import base, inproc, shm, tcp
from shmrl.transport.tcp_client import TcpClient
from shmrl.transport.base import (ClientTransport, ConnectionClosed, ReplyEncoder, ServerTransport,
                                  WakePipe)
from shmrl.transport.doorbell import PeerGone
from shmrl.transport.ring import Ring

pytestmark = pytest.mark.usefixtures("no_shm_leftovers")


@pytest.fixture
def ends():
    """One connected (server, client, conn_id) per shipped transport, by name; closed after."""
    made = {}
    shm_server = shm.ShmServer(1, request_ring_bytes=4096, reply_ring_bytes=4096)
    made["shm"] = (shm_server, shm.ShmClient(shm_server.address(0), timeout=10), "shm:0")
    tcp_server = tcp.TcpServer("127.0.0.1", 0)
    tcp_client = TcpClient(*tcp_server.address, timeout=10)
    made["tcp"] = (tcp_server, tcp_client, None)  # the conn_id is known once the server polls
    inproc_server = inproc.InProcServer()
    inproc_client = inproc_server.connect(timeout=10)
    made["inproc"] = (inproc_server, inproc_client, inproc_client.conn_id)
    yield made
    for server, client, _ in made.values():
        client.close()
        server.close()


def protocol_methods(protocol) -> dict:
    return {name: fn for name, fn in vars(protocol).items()
            if inspect.isfunction(fn) and not name.startswith("_")}


def check_conforms(obj, protocol) -> None:
    assert isinstance(obj, protocol), f"{type(obj).__name__} is not a {protocol.__name__}"
    for name, fn in protocol_methods(protocol).items():
        wanted = list(inspect.signature(fn).parameters)[1:]  # without self
        got = list(inspect.signature(getattr(obj, name)).parameters)
        assert got[:len(wanted)] == wanted, f"{type(obj).__name__}.{name}{got} is not {name}{wanted}"


def test_every_shipped_end_is_its_protocol(ends):
    assert set(protocol_methods(ServerTransport)) == {"fileno", "poll", "reply", "drop", "timed_out", "close"}
    assert set(protocol_methods(ClientTransport)) == {"send", "request", "heartbeat", "close"}
    for name, (server, client, _) in ends.items():
        check_conforms(server, ServerTransport)
        check_conforms(client, ClientTransport)
        assert server.frames_rejected == 0 and server.clients_timed_out == 0, name
        assert not isinstance(client, ServerTransport), name


def test_a_half_made_end_is_not_the_protocol():
    class NoHeartbeat:
        def send(self, msg): ...
        def request(self, msg): ...
        def close(self): ...

    class NoCounters:
        def fileno(self): ...
        def poll(self, timeout=0.0): ...
        def reply(self, conn_id, msg): ...
        def drop(self, conn_id, reason): ...
        def timed_out(self, conn_id): ...
        def close(self): ...

    assert not isinstance(NoHeartbeat(), ClientTransport)
    assert not isinstance(NoCounters(), ServerTransport)


def test_one_connection_closed_class():
    assert shm.ConnectionClosed is base.ConnectionClosed
    assert issubclass(ConnectionClosed, ConnectionError)
    assert issubclass(PeerGone, ConnectionClosed)  # the learner's death closes the connection too


def accept(server, client_request, what):
    """The conn_id under which ``server`` receives a PING sent by ``client_request`` in a thread."""
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("reply", _try(client_request)), daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while True:
        assert time.monotonic() < deadline, f"{what}: no PING arrived"
        for conn_id, msg in server.poll(0.1):
            if msg is not None and msg["type"] == "PING":
                server.reply(conn_id, {"type": "PONG"})
                t.join(10)
                assert got["reply"]["type"] == "PONG", got
                return conn_id


def _try(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 -- handed to the test thread to assert on
        return e


@pytest.mark.parametrize("name", ["shm", "tcp", "inproc"])
def test_a_dropped_connection_raises_the_one_connection_closed(ends, name):
    server, client, conn_id = ends[name]
    seen = accept(server, lambda: client.request({"type": "PING"}), name)
    assert conn_id is None or seen == conn_id
    server.drop(seen, "told to go")
    error = _try(lambda: client.request({"type": "GET_STATE"}))  # never answered: only the close ends it
    assert type(error) is ConnectionClosed, f"{name}: {error!r}"


def test_rllink_encode_is_each_codec_byte_for_byte():
    msg = {"type": "EPISODES", "episodes": [{"obs": np.arange(6, dtype=np.float32).reshape(3, 2)}], "x": 1}
    assert rllink.encode(msg, "binary") == rllink.encode_binary(msg)
    assert rllink.encode(msg, "json") == rllink.encode_json(msg)
    assert rllink.encode({"type": "PING"}, "json") == b'{"type": "PING"}'  # RLlib's own bytes
    with pytest.raises(ValueError, match="codec must be one of"):
        rllink.encode(msg, "pickle")


def test_reply_encoder_encodes_one_message_once_per_codec():
    encode = ReplyEncoder()
    state = {"type": "SET_STATE", "onnx_file": "abc", "weights_seq_no": 3}
    first = encode(state, "json")
    assert first == rllink.encode_json(state)
    assert encode(state, "json") is first                     # the same dict: not encoded again
    assert encode(state, "binary") == rllink.encode_binary(state)
    assert encode(state, "json") is first                     # a binary client in between keeps it
    equal_copy = dict(state)
    assert encode(equal_copy, "json") is not first            # by identity, not by value
    framed = ReplyEncoder(framed=True)({"type": "PONG"}, "json")
    assert framed == b'00000016{"type": "PONG"}'


def test_wake_pipe_wakes_coalesces_and_closes():
    pipe = WakePipe()
    try:
        t0 = time.monotonic()
        assert pipe.wait(0.05) is False
        assert time.monotonic() - t0 >= 0.04
        threading.Timer(0.05, pipe.wake).start()
        assert pipe.wait(10) is True
        pipe.drain()
        assert pipe.wait(0) is False                # drained: nothing pending
        for _ in range(100_000):                    # far more than a pipe holds: never blocks
            pipe.wake()
        assert pipe.wait(0) is True
        pipe.drain()
        assert pipe.wait(0) is False
    finally:
        pipe.close()
    pipe.close()
    pipe.wake()
    pipe.drain()
    assert pipe.fileno() == -1 and pipe.wait(10) is False  # closed: returns at once


def test_ring_write_waits_until_its_check_gives_up():
    ring = Ring(memoryview(bytearray(Ring.nbytes(256))), 0, 256)
    while ring.try_write([b"x" * 100]):
        pass
    calls = []

    def give_up():
        calls.append(1)
        if len(calls) == 3:
            raise ConnectionClosed("gone")

    with pytest.raises(ConnectionClosed, match="gone"):
        ring.write([b"x" * 100], timeout=10, while_waiting=give_up)
    assert len(calls) == 3


def test_shm_client_on_a_full_ring_times_out_or_learns_the_close():
    server = shm.ShmServer(1, request_ring_bytes=4096, reply_ring_bytes=4096)
    client = shm.ShmClient(server.address(0), timeout=0.2)
    try:
        msg = {"type": "HEARTBEAT", "env_steps": 1}
        with pytest.raises(TimeoutError, match="request ring full for 0.2 s"):
            for _ in range(10_000):  # nobody polls: the ring fills
                client.send(msg)
        client.timeout = 10
        threading.Timer(0.2, server.drop, ("shm:0", "told to go")).start()
        t0 = time.monotonic()
        with pytest.raises(ConnectionClosed, match="told to go"):
            client.send(msg)
        assert time.monotonic() - t0 < 5  # learnt while waiting, not after the 10 s timeout
    finally:
        client.close()
        server.close()


def test_shm_client_on_a_full_ring_learns_the_learner_is_gone():
    server = shm.ShmServer(1, request_ring_bytes=4096, reply_ring_bytes=4096)
    client = shm.ShmClient(server.address(0), timeout=0.2)
    try:
        msg = {"type": "HEARTBEAT", "env_steps": 1}
        with pytest.raises(TimeoutError):
            for _ in range(10_000):
                client.send(msg)
        client.timeout = 10
        threading.Timer(0.2, server.close).start()
        t0 = time.monotonic()
        with pytest.raises(PeerGone):
            client.send(msg)
        assert time.monotonic() - t0 < 5
    finally:
        client.close()
        server.close()
