"""The TCP RLlink transport: TcpServer (learner) and TcpClient, against the real Hub.

Frames sent over raw sockets are built the way RLlib 2.48's client builds them (json.dumps,
8-digit header), independently of shmrl.rllink, so the exchanges are byte-for-byte RLlib's.
"""
import json
import logging
import math
import selectors
import socket
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmrl.envs.make import env_spec
from shmrl.envs.spec import space_config
from shmrl.rllink import ProtocolError
from shmrl.transport import ConnectionClosed
from shmrl.transport.tcp import TcpServer
from shmrl.transport.tcp_client import TcpClient, parse_address

from conftest import (Net, conn_id_of, episodes_msg, log_lines, read_to_eof, recv_exactly, recv_frame, rllib_episodes,
                      rllib_frame, state_frame, wait_until)

# shmrl's SET_CONFIG: RLlib's two fields, then the spaces (for server-side inference's clients)
CONFIG = {"type": "SET_CONFIG", "env_steps_per_sample": 8, "force_on_policy": True,
          **space_config(env_spec("CartPole-v1"))}


def io_threads(server) -> list:
    return [t for t in threading.enumerate() if t.name == f"shmrl-tcp-{server.address[1]}"]


def keep_sampling(net: Net, server: TcpServer, served: list) -> None:
    """A good client in the background: EPISODES_AND_GET_STATE over and over; the
    weights_seq_no of every SET_STATE it gets goes to ``served``."""
    frame = rllib_frame(episodes_msg(8, seed=1))

    def run():
        s = net.raw(server)
        while not net.stop.is_set():
            s.sendall(frame)
            reply = json.loads(recv_frame(s)[8:])
            assert reply["type"] == "SET_STATE"
            served.append(reply["weights_seq_no"])

    net.thread(run)
    wait_until(lambda: len(served) >= 3, 5, what="the good client's first replies")


# ---------------------------------------------------------------- exact bytes

def test_every_message_type_byte_exact_over_a_raw_socket(net):
    server = net.server()
    hub = net.hub(server)
    s = net.raw(server)
    s.sendall(b'00000016{"type": "PING"}')
    assert recv_frame(s) == b'00000016{"type": "PONG"}'
    s.sendall(rllib_frame({"type": "GET_CONFIG"}))
    assert recv_frame(s) == rllib_frame(CONFIG)
    s.sendall(rllib_frame({"type": "GET_STATE"}))
    assert recv_frame(s) == state_frame(1)

    s.sendall(rllib_frame(episodes_msg(8, seed=1, kind="EPISODES")))  # no reply
    wait_until(lambda: hub.store.steps_received == 8, 5, what="the EPISODES steps")
    s.settimeout(0.2)
    with pytest.raises(TimeoutError):
        s.recv(1)
    s.settimeout(5)

    s.sendall(rllib_frame(episodes_msg(8, seed=2)))                   # RLlib's "timesteps"
    assert recv_frame(s) == state_frame(2)
    s.sendall(rllib_frame(episodes_msg(8, seed=3, count="env_steps")))  # RLlib's docs: "env_steps"
    assert recv_frame(s) == state_frame(3)
    assert hub.store.steps_received == 24 and hub.store.steps_by_conn == {conn_id_of(s): 24}
    assert [kind for _, kind in hub.received] == ["PING", "GET_CONFIG", "GET_STATE", "EPISODES",
                                                  "EPISODES_AND_GET_STATE", "EPISODES_AND_GET_STATE"]


def test_split_and_pipelined_frames(net):
    """Frames may arrive a byte at a time or many in one segment; replies keep their order,
    also beyond the requests one connection may have waiting for poll()."""
    server = net.server()
    net.hub(server)
    s = net.raw(server)
    for byte in b'00000016{"type": "PING"}':
        s.sendall(bytes([byte]))
        time.sleep(0.001)
    assert recv_frame(s) == b'00000016{"type": "PONG"}'
    s.sendall(b"".join(rllib_frame({"type": t}) for t in ("PING", "GET_CONFIG", "GET_STATE")))
    assert [recv_frame(s) for _ in range(3)] == [rllib_frame({"type": "PONG"}), rllib_frame(CONFIG), state_frame(1)]
    n = 3 * TcpServer.MAX_UNPOLLED
    s.sendall(rllib_frame({"type": "PING"}) * n + rllib_frame({"type": "GET_STATE"}))
    assert recv_exactly(s, 24 * n) == rllib_frame({"type": "PONG"}) * n
    assert recv_frame(s) == state_frame(1)


def test_a_connection_is_not_read_while_its_requests_wait_for_poll(net):
    """Backpressure: a client that pipelines faster than the learner polls stops being read
    (its data waits in the kernel) and is read again after the next poll()."""
    server = net.server()
    s = net.raw(server)
    conn_id = conn_id_of(s)
    n = 3 * TcpServer.MAX_UNPOLLED
    s.sendall(rllib_frame({"type": "PING"}) * n)
    time.sleep(0.2)
    s.sendall(rllib_frame({"type": "GET_STATE"}))
    time.sleep(0.2)
    first = server.poll()
    assert TcpServer.MAX_UNPOLLED <= len(first) <= n     # the GET_STATE has not been read
    got = list(first)
    wait_until(lambda: got.extend(server.poll(0.05)) or len(got) == n + 1, 5, "every request polled")
    assert got == [(conn_id, {"type": "PING"})] * n + [(conn_id, {"type": "GET_STATE"})]


# ---------------------------------------------------------------- many clients

@pytest.mark.parametrize("factor", [1e6, 1e3])
def test_a_costly_frame_makes_its_connection_wait_its_turn(net, monkeypatch, factor):
    """Fairness: after a frame that took the IO thread t s to decode, its connection is not
    read again for REST_FACTOR * t while another client is connected (a JSON flooder
    cannot keep the thread, and the interpreter, to itself); then what it sent meanwhile is
    read."""
    monkeypatch.setattr(TcpServer, "REST_FACTOR", factor)  # 1e6: seconds at least; 1e3: ms
    server = net.server()
    greedy, other = net.raw(server), net.raw(server)
    other.sendall(rllib_frame({"type": "GET_STATE"}))      # its reply is owed while greedy sends
    got = []
    wait_until(lambda: got.extend(server.poll(0.05)) or got, 5, "the other client's request")
    monkeypatch.setattr(TcpServer, "MIN_REST_S", 0.0)      # from now on every frame rests, PINGs too
    greedy.sendall(rllib_frame({"type": "PING"}) * 2)
    wait_until(lambda: got.extend(server.poll(0.05)) or len(got) >= 2, 5, "the first PING")
    ping, get_state = (conn_id_of(greedy), {"type": "PING"}), (conn_id_of(other), {"type": "GET_STATE"})
    if factor == 1e6:   # resting: its second PING is not read while the other client waits
        time.sleep(0.3)
        assert got + server.poll() == [get_state, ping]
    else:               # the rest ends: its second PING is read after all
        wait_until(lambda: got.extend(server.poll(0.05)) or len(got) >= 3, 5, "the second PING")
        assert sorted(got, key=str) == sorted([ping, ping, get_state], key=str)


def test_a_costly_frame_rests_nobody_when_no_one_else_is_connected(net, monkeypatch):
    """A rest only makes room for others: a lone client is read on at once, however costly
    its frames (one JSON client sending flat out ran at half its speed when it rested
    regardless)."""
    monkeypatch.setattr(TcpServer, "MIN_REST_S", 0.0)
    monkeypatch.setattr(TcpServer, "REST_FACTOR", 1e6)     # a rest would be seconds at least
    server = net.server()
    lone = net.raw(server)
    lone.sendall(rllib_frame({"type": "PING"}) * 3)
    got = []
    wait_until(lambda: got.extend(server.poll(0.05)) or len(got) >= 3, 2, "all three PINGs")
    assert got == [(conn_id_of(lone), {"type": "PING"})] * 3


def test_32_clients_at_once_on_one_port(net):
    server = net.server()
    hub = net.hub(server)
    n = 32
    clients = [net.client(server, timeout=10) for _ in range(n)]
    start = threading.Barrier(n, timeout=10)
    done = []

    def session(i, client):
        start.wait()
        assert client.request({"type": "PING"}) == {"type": "PONG"}
        seq = client.request({"type": "GET_STATE"})["weights_seq_no"]
        for k in range(3):
            reply = client.request(episodes_msg(8, seed=100 * i + k))
            assert reply["type"] == "SET_STATE" and reply["weights_seq_no"] > seq
            seq = reply["weights_seq_no"]
        done.append(i)

    threads = [net.thread(session, i, c) for i, c in enumerate(clients)]
    for t in threads:
        t.join(15)
    assert sorted(done) == list(range(n)), net.errors
    assert hub.store.steps_by_conn == {conn_id_of(c): 24 for c in clients}
    assert len({conn_id_of(c) for c in clients}) == n


# ---------------------------------------------------------------- hostile clients

def stall(s):        # a header and half the body, then silence
    s.sendall(b'00000016{"type":')


def mid_frame_eof(s):  # a header and part of the body, then it hangs up (its reading side stays open)
    s.sendall(b"00000100" + b"x" * 40)
    s.shutdown(socket.SHUT_WR)


def nan_rewards():
    msg = episodes_msg(8, seed=5)
    msg["episodes"][0]["rewards"][0] = math.nan  # json.dumps writes NaN, as Python's RLlib client would
    return rllib_frame(msg)


HOSTILE = {
    "stalls mid-frame": (stall, "frame incomplete after 0.5 s: slow or stalled client (got 16 of 24 bytes)"),
    "sends garbage": (b"hello world!!!!!", "frame header b'hello wo' is not 8 ASCII digits"),
    "announces 99,999,999 bytes": (b"99999999", "frame of 99999999 bytes exceeds the maximum of 67108864"),
    "disconnects mid-frame": (mid_frame_eof, "disconnected mid-frame after 48 of 108 bytes"),
    "sends NaN rewards": (nan_rewards(), "non-finite value in 'rewards'"),
    "sends an unknown type": (rllib_frame({"type": "HELLO"}), "unknown message type 'HELLO'"),
    "sends a reply type": (rllib_frame({"type": "PONG"}), "'PONG' is a reply type, not a request"),
    "sends a 3-dim obs": (rllib_frame({"type": "EPISODES", "episodes": [{
        **rllib_episodes(2)[0], "obs": [[0.0, 1.0, 2.0]] * 3}]}), "obs 'obs' has shape (3,), the environment's is (4,)"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_client_is_dropped_while_a_good_one_goes_on(net, caplog, case):
    send, reason = HOSTILE[case]
    server = net.server(frame_timeout=0.5)
    hub = net.hub(server)
    served = []
    keep_sampling(net, server, served)
    bad = net.raw(server)
    bad.sendall(rllib_frame({"type": "PING"}))
    assert recv_frame(bad) == rllib_frame({"type": "PONG"})     # it starts out well
    before = len(served)
    send(bad) if callable(send) else bad.sendall(send)
    assert read_to_eof(bad) == b""                              # dropped: EOF, nothing else
    if case == "stalls mid-frame":
        assert len(served) > before + 10                        # served all through the stall
    conn_id = conn_id_of(bad)
    lines = log_lines(caplog, conn_id)
    assert len(lines) == 1 and lines[0].startswith(f"{conn_id}: closing connection: ") and reason in lines[0], lines
    wait_until(lambda: conn_id in hub.closed(), 5, "the connection reported closed")
    n = len(served)
    wait_until(lambda: len(served) >= n + 3, 5, what="the good client to go on")
    assert hub.closed() == [conn_id]                            # reported once; the good one untouched
    assert hub.store.steps_by_conn.get(conn_id, 0) == 0


def test_first_frame_limit_refuses_a_big_first_frame_only(net, caplog):
    server = net.server(first_frame_max_bytes=64)
    net.hub(server)
    big_first = net.raw(server)
    big_first.sendall(b"%08d" % 65 + b"{")                      # refused from its header
    assert read_to_eof(big_first) == b""
    assert any("exceeds the maximum of 64" in m for m in log_lines(caplog, conn_id_of(big_first)))
    good = net.raw(server)
    good.sendall(rllib_frame({"type": "PING"}))                 # a small first frame, then anything
    assert recv_frame(good) == rllib_frame({"type": "PONG"})
    good.sendall(rllib_frame(episodes_msg(40, kind="EPISODES")) + rllib_frame({"type": "PING"}))
    assert recv_frame(good) == rllib_frame({"type": "PONG"})    # the big second frame was taken


def test_a_client_that_does_not_read_its_replies_is_dropped(net, caplog):
    server = net.server(max_out_bytes=1 << 20)
    hub = net.hub(server, onnx_file="x" * (256 << 10))          # 256 KiB per SET_STATE
    served = []
    keep_sampling(net, server, served)
    slow = net.raw(server, rcvbuf=4096)
    conn_id = conn_id_of(slow)
    slow.sendall(rllib_frame({"type": "GET_STATE"}) * 64)       # 16 MiB of replies it never reads
    wait_until(lambda: conn_id in hub.closed(), 5, what="the slow reader to be dropped")
    assert any("not reading its replies" in m for m in log_lines(caplog, conn_id)), caplog.text
    n = len(served)
    wait_until(lambda: len(served) >= n + 3, 5, what="the good client to go on")
    assert hub.closed() == [conn_id]


def test_big_incomplete_frames_of_many_clients_stay_within_a_memory_budget(net, caplog):
    server = net.server(max_frame_bytes=8 << 20, max_buffered_bytes=3 << 20)
    hub = net.hub(server)
    served = []
    keep_sampling(net, server, served)
    hogs = [net.raw(server) for _ in range(4)]
    total = 0
    for k, hog in enumerate(hogs):                              # each announces 8 MiB and sends ~1 MiB
        part = b"%08d" % (8 << 20) + b"x" * ((1 << 20) - 4096 * k)
        hog.sendall(part)
        total += len(part)
        if k < 3:                                               # in order: the first is the largest
            wait_until(lambda: server._buffered() == total, 5, what=f"hog {k}'s bytes to arrive")
    biggest = conn_id_of(hogs[0])
    wait_until(lambda: biggest in hub.closed(), 5, what="the largest incomplete frame to be dropped")
    assert any("exceed max_buffered_bytes (3145728): this one is the largest" in m
               for m in log_lines(caplog, biggest)), caplog.text
    assert server._buffered() <= 3 << 20
    assert hub.closed() == [biggest]                            # the others fit again: kept
    n = len(served)
    wait_until(lambda: len(served) >= n + 3, 5, what="the good client to go on")


def test_idle_timeout_spares_a_client_waiting_for_its_reply(net, caplog):
    server = net.server(idle_timeout=0.3)
    hub = net.hub(server, auto_publish=False)
    idle, waiting = net.raw(server), net.raw(server)
    idle.sendall(rllib_frame({"type": "PING"}))
    assert recv_frame(idle) == rllib_frame({"type": "PONG"})
    waiting.sendall(rllib_frame(episodes_msg(8)))               # on-policy: waits for a publish
    assert read_to_eof(idle) == b""
    assert any("idle for 0.3 s with no reply owed" in m for m in log_lines(caplog, conn_id_of(idle)))
    time.sleep(0.5)
    assert hub.closed() == [conn_id_of(idle)]
    waiting.settimeout(0.1)
    with pytest.raises(TimeoutError):                           # still open, still waiting
        waiting.recv(1)


def test_a_connection_that_never_speaks_is_closed_but_a_quiet_client_is_not(net, caplog):
    server = net.server(hello_timeout=0.3)
    hub = net.hub(server)
    silent, spoke = net.raw(server), net.raw(server)
    spoke.sendall(rllib_frame({"type": "PING"}))
    assert recv_frame(spoke) == rllib_frame({"type": "PONG"})   # then quiet: it may be sampling
    assert read_to_eof(silent) == b""
    assert any("sent nothing in the 0.3 s after connecting" in m for m in log_lines(caplog, conn_id_of(silent)))
    time.sleep(0.5)
    assert hub.closed() == [conn_id_of(silent)]
    spoke.sendall(rllib_frame({"type": "PING"}))
    assert recv_frame(spoke) == rllib_frame({"type": "PONG"})


def test_max_connections_refuses_the_excess_and_logs_once_per_burst(net, caplog):
    server = net.server(max_connections=2)
    hub = net.hub(server)
    a, b = net.raw(server), net.raw(server)
    a_id = conn_id_of(a)
    for s in (a, b):
        s.sendall(rllib_frame({"type": "PING"}))
        assert recv_frame(s) == rllib_frame({"type": "PONG"})
    for _ in range(3):
        assert read_to_eof(net.raw(server)) == b""
    assert sum("max_connections" in r.getMessage() for r in caplog.records) == 1
    a.close()
    wait_until(lambda: a_id in hub.closed(), 5, "the first connection reported closed")
    c = net.raw(server)                                         # a place is free again
    c.sendall(rllib_frame({"type": "PING"}))
    assert recv_frame(c) == rllib_frame({"type": "PONG"})


# ---------------------------------------------------------------- closing

def test_clean_eof_logged_at_info_and_reported_once(net, caplog):
    caplog.set_level(logging.INFO, logger="shmrl.transport")
    server = net.server()
    hub = net.hub(server)
    s = net.raw(server)
    conn_id = conn_id_of(s)
    s.sendall(rllib_frame(episodes_msg(8, kind="EPISODES")))    # its last data, then it leaves
    s.close()
    wait_until(lambda: conn_id in hub.closed(), 5, "the connection reported closed")
    assert hub.received == [(conn_id, "EPISODES"), (conn_id, None)]  # the data is not lost
    assert hub.store.steps_received == 8
    assert log_lines(caplog, conn_id, logging.INFO) == [f"{conn_id}: connected",
                                                        f"{conn_id}: closing connection: the client disconnected"]
    assert log_lines(caplog, conn_id) == []


def test_poll_fileno_drop_and_close_without_a_hub(net, caplog):
    server = net.server()
    s = net.raw(server)
    conn_id = conn_id_of(s)
    sel = selectors.DefaultSelector()
    sel.register(server.fileno(), selectors.EVENT_READ)
    try:
        assert sel.select(0.05) == [] and server.poll(0.05) == []
        s.sendall(rllib_frame({"type": "PING"}) + rllib_frame({"type": "GET_STATE"}))
        assert sel.select(5)                                    # readable: requests wait
        got = []
        wait_until(lambda: got.extend(server.poll()) or len(got) == 2, 5, "both requests polled")
        assert got == [(conn_id, {"type": "PING"}), (conn_id, {"type": "GET_STATE"})]
        assert sel.select(0) == []                              # drained
        server.reply(conn_id, {"type": "PONG"})
        server.reply("tcp:127.0.0.1:1", {"type": "PONG"})       # unknown: ignored
        assert recv_frame(s) == b'00000016{"type": "PONG"}'
        server.drop(conn_id, "test: go away")
        server.drop(conn_id, "test: twice")                     # already closing: ignored
        server.reply(conn_id, {"type": "PONG"})                 # closed: ignored
        assert read_to_eof(s) == b""
        assert server.poll(5) == [(conn_id, None)] and server.poll(0.05) == []
        assert log_lines(caplog, conn_id) == [f"{conn_id}: closing connection: test: go away"]
        other = net.raw(server)
        other.sendall(rllib_frame({"type": "PING"}) + b"0000")  # accepted, and mid-frame
        assert server.poll(5) == [(conn_id_of(other), {"type": "PING"})]
        server.close()
        server.close()                                          # idempotent
        assert read_to_eof(other) == b""                        # every socket closed
        assert io_threads(server) == [] and server.poll(0.05) == []
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(server.address, timeout=1).close()
    finally:
        sel.close()


# ---------------------------------------------------------------- fuzzing

VALID = [rllib_frame({"type": "PING"}), rllib_frame({"type": "GET_CONFIG"}), rllib_frame(episodes_msg(4, seed=7))]
numbers = st.integers(-2, 3) | st.floats(-10, 10, width=32)
scalars = st.none() | st.booleans() | numbers | st.sampled_from([math.nan, math.inf, 1e300]) | st.text(max_size=3)
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=3), inner, max_size=2), max_leaves=8)


@st.composite
def mutated_frames(draw):
    data = bytearray(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(1, 4))):
        op, pos = draw(st.sampled_from(["set", "insert", "delete", "cut"])), draw(st.integers(0, len(data)))
        if op == "set" and pos < len(data):
            data[pos] = draw(st.integers(0, 255))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[pos:pos + draw(st.integers(1, 8))]
        else:
            del data[pos:]
    return bytes(data)


@st.composite
def episode_frames(draw):
    """EPISODES(_AND_GET_STATE) frames whose episodes are valid for CartPole, or have one
    flaw: wrong for the environment (the Hub drops them), or breaking the schema."""
    def episode():
        n = draw(st.integers(0, 4))
        def lists(of, length, width=None):
            item = of if width is None else st.lists(of, min_size=width, max_size=width)
            return draw(st.lists(item, min_size=length, max_size=length))

        ep = {"obs": lists(numbers, n + 1, 4), "actions": lists(st.integers(0, 1), n), "rewards": lists(numbers, n),
              "action_dist_inputs": lists(numbers, n, 2), "action_logp": lists(numbers, n),
              "is_terminated": draw(st.booleans()), "is_truncated": False}
        flaw = draw(st.sampled_from(["none", "none", "obs width", "action range", "not finite", "field"]))
        if flaw == "obs width":
            ep["obs"] = [o[:3] for o in ep["obs"]]
        elif flaw == "action range" and n:
            ep["actions"][draw(st.integers(0, n - 1))] = draw(st.sampled_from([-1, 2]))
        elif flaw == "not finite" and n:
            ep[draw(st.sampled_from(["rewards", "action_logp"]))][draw(st.integers(0, n - 1))] = \
                draw(st.sampled_from([math.nan, -math.inf, 1e39]))
        elif flaw == "field":
            key = draw(st.sampled_from(sorted(ep) + ["extra", "episode_id"]))
            if draw(st.booleans()):
                ep[key] = draw(junk)
            else:
                ep.pop(key, None)
        return ep

    episodes = [episode() for _ in range(draw(st.integers(0, 2)))]
    msg = {"type": draw(st.sampled_from(["EPISODES", "EPISODES_AND_GET_STATE"])), "episodes": episodes}
    if draw(st.booleans()):
        msg[draw(st.sampled_from(["timesteps", "env_steps"]))] = draw(st.integers(-1, 8))
    return rllib_frame(msg)


payloads = st.one_of(
    st.binary(max_size=300).map(lambda b: b"%08d" % len(b) + b),  # random bytes after a valid header
    mutated_frames(),
    episode_frames(),
    st.binary(max_size=40),
)


def test_fuzzed_connections_only_ever_get_closed(net):
    server = net.server(frame_timeout=2.0)
    hub = net.hub(server)
    connections = 0

    @settings(max_examples=120, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(payloads)
    def exchange(payload):
        nonlocal connections
        s = socket.create_connection(server.address, timeout=5)
        connections += 1
        try:
            try:
                s.sendall(payload)
                s.shutdown(socket.SHUT_WR)
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused already
            data = read_to_eof(s)
        finally:
            s.close()
        while data:  # whatever came back is whole, valid replies: never garbage
            n = int(data[:8])
            assert json.loads(data[8:8 + n])["type"] in ("PONG", "SET_CONFIG", "SET_STATE")
            data = data[8 + n:]

    exchange()
    wait_until(lambda: len(hub.closed()) == connections, 5, what="every connection reported closed")
    with TcpClient(*server.address, timeout=5, codec="json") as client:
        assert client.request({"type": "PING"}) == {"type": "PONG"}
    assert hub.error is None and len(io_threads(server)) == 1


# ---------------------------------------------------------------- TcpClient

def test_client_request_send_and_timeout(net):
    server = net.server()
    hub = net.hub(server, auto_publish=False)
    client = net.client(server, timeout=5)
    assert client.request({"type": "PING"}) == {"type": "PONG"}
    assert client.request({"type": "GET_CONFIG"}) == CONFIG
    assert client.request({"type": "GET_STATE"}) == {"type": "SET_STATE", "onnx_file": "abc", "weights_seq_no": 1}
    client.send(episodes_msg(8, kind="EPISODES"))
    wait_until(lambda: hub.store.steps_received == 8, 5, "the EPISODES steps")
    client.timeout = 0.3
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="no reply within 0.3 s"):
        client.request(episodes_msg(8))                         # on-policy, and nobody trains
    assert 0.25 < time.monotonic() - t0 < 2
    with pytest.raises(ConnectionError, match="reconnect"):     # out of step now: refuses
        client.request({"type": "PING"})
    wait_until(lambda: conn_id_of(client) in hub.closed(), 5, "the client's connection reported closed")


def test_client_sees_connection_error_when_dropped_or_the_server_closes(net, caplog):
    server = net.server()
    hub = net.hub(server, auto_publish=False)
    dropped, waiting = net.client(server, timeout=5), net.client(server, timeout=5)
    assert dropped.request({"type": "PING"}) == {"type": "PONG"}
    server.drop(conn_id_of(dropped), "test: go away")
    with pytest.raises(ConnectionClosed, match="closed the connection"):
        dropped.request({"type": "PING"})
    errors = []

    def wait_for_state():
        try:
            waiting.request(episodes_msg(8))
        except ConnectionError as e:
            errors.append(e)

    t = net.thread(wait_for_state)
    wait_until(lambda: hub.hub.waiting, 5, what="the client to wait for SET_STATE")
    hub.stop()
    server.close()
    t.join(5)
    assert len(errors) == 1 and isinstance(errors[0], ConnectionClosed), errors
    assert f"{conn_id_of(dropped)}: closing connection: test: go away" in caplog.text


def test_client_connect_refused_and_bad_reply(net):
    server = net.server()
    port = server.address[1]
    server.close()
    with pytest.raises(ConnectionRefusedError):
        TcpClient("127.0.0.1", port, connect_timeout=1)
    with socket.create_server(("127.0.0.1", 0)) as fake:       # a server that answers garbage
        client = TcpClient(*fake.getsockname()[:2], timeout=5)
        net.socks.append(client)
        peer, _ = fake.accept()
        with peer:
            peer.sendall(b"00000002{}")
            with pytest.raises(ProtocolError, match="no 'type'"):
                client.request({"type": "PING"})


def test_parse_address():
    assert parse_address("localhost:5556") == ("localhost", 5556)
    assert parse_address("[::1]:80") == ("::1", 80)
    for bad in ("localhost", ":5556", "host:", "host:http", "host:70000", "host:-1"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_address(bad)


def test_a_client_that_waits_for_its_replies_never_rests(net, monkeypatch):
    """Only a client sending without waiting (EPISODES, or frames pipelined) rests: one that
    sends its next request after its reply is paced by the replies (a lone JSON client
    beside an idle connection ran at half its speed when every costly frame rested)."""
    monkeypatch.setattr(TcpServer, "REST_FACTOR", 1e6)     # a rest would be seconds at least
    server = net.server()
    idle, paced = net.raw(server), net.raw(server)
    monkeypatch.setattr(TcpServer, "MIN_REST_S", 0.0)
    got = []
    for n in (1, 2):
        paced.sendall(rllib_frame({"type": "PING"}))
        wait_until(lambda: got.extend(server.poll(0.05)) or len(got) >= n, 2, f"PING {n}")
    assert got == [(conn_id_of(paced), {"type": "PING"})] * 2
