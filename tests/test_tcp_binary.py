"""Binary RLlink over TCP and liveness: codec negotiation in PING/PONG, byte-exact JSON for
a client that does not ask (RLlib's), the abuse limits for binary frames, HEARTBEATs, a
hung client closed and its lost steps counted, and a strict on-policy batch that waits on
a silent client only so long."""
import json
import logging
import os
import re
import signal
import socket
import threading
import time

import pytest

from shmrl.config.settings import Config
from shmrl import rllink
from shmrl.server.serving import Serving
from shmrl.server.store import DEFAULT_POLICY
from shmrl.model.net import PolicyNet
from shmrl.transport.inproc import InProcServer
from shmrl.transport import ConnectionClosed
from shmrl.transport.tcp_client import TcpClient
from conftest import (HANGING_ENV, SPEC, binary_episodes, binary_frame, check_books, chunk, decode_frame, episodes_msg,
                      log_lines, read_to_eof, recv_frame, rllib_frame, state_frame, summary_of, wait_until)


# ---------------------------------------------------------------- negotiation

def test_a_client_that_offers_binary_gets_it_and_a_heartbeat_period(net):
    server = net.server(heartbeat_s=0.25, heartbeat_timeout=2.0)
    hub = net.hub(server)
    s = net.raw(server)
    s.sendall(rllib_frame({"type": "PING", "codecs": ["msgpack", "binary"]}))
    pong = json.loads(recv_frame(s)[8:])       # the PONG itself is JSON: the client may not know yet
    assert pong == {"type": "PONG", "codec": "binary", "heartbeat_s": 0.25}
    s.sendall(binary_frame({"type": "GET_STATE"}))
    reply = recv_frame(s)
    assert reply[8:12] == rllink.MAGIC          # answered in binary from now on
    assert decode_frame(reply) == {"type": "SET_STATE", "onnx_file": "abc", "weights_seq_no": 1}
    s.sendall(binary_frame(binary_episodes(8)))
    assert decode_frame(recv_frame(s))["weights_seq_no"] == 2
    assert hub.store.steps_received == 8


def test_rllib_client_gets_json_byte_for_byte(net):
    """No "codecs" in PING: every reply is exactly what RLlib's own server would write."""
    server = net.server()
    hub = net.hub(server)
    s = net.raw(server)
    s.sendall(rllib_frame({"type": "PING"}))
    assert recv_frame(s) == b'00000016{"type": "PONG"}'
    s.sendall(rllib_frame({"type": "GET_STATE"}))
    assert recv_frame(s) == state_frame(1)
    s.sendall(rllib_frame(episodes_msg(8)))
    assert recv_frame(s) == state_frame(2)
    # A binary client on the same port at the same time changes nothing for it.
    b = net.client(server, codec="binary")
    b.request({"type": "PING"})
    assert b.codec == "binary" and b.request({"type": "GET_STATE"})["weights_seq_no"] >= 2
    s.sendall(rllib_frame({"type": "PING"}))
    assert recv_frame(s) == b'00000016{"type": "PONG"}'
    assert hub.error is None


def test_tcp_client_negotiates_and_falls_back_to_json(net):
    server = net.server()
    net.hub(server)
    binary = net.client(server, codec="binary", client_name="sim-7")
    assert binary.request({"type": "PING"})["codec"] == "binary"
    assert (binary.codec, binary.heartbeat_s) == ("binary", server.heartbeat_s)
    json_client = net.client(server, codec="json")
    assert json_client.request({"type": "PING"}) == {"type": "PONG"}
    assert (json_client.codec, json_client.heartbeat_s) == ("json", None)
    # A server that ignores the offer (RLlib's) leaves the client on JSON, without heartbeats.
    with socket.create_server(("127.0.0.1", 0)) as fake:
        client = TcpClient(*fake.getsockname()[:2], timeout=5)
        net.socks.append(client)
        peer, _ = fake.accept()
        with peer:
            peer.settimeout(5)
            peer.sendall(b'00000016{"type": "PONG"}')
            assert client.request({"type": "PING"}) == {"type": "PONG"}
            assert json.loads(recv_frame(peer)[8:]) == {"type": "PING", "codecs": ["binary"]}
            assert client.codec == "json" and client.heartbeat_s is None
            client.heartbeat(100)                  # nothing goes out
            client.send({"type": "GET_CONFIG"})
            assert recv_frame(peer) == rllib_frame({"type": "GET_CONFIG"})


def test_a_pong_choosing_a_codec_never_offered_is_refused(net):
    with socket.create_server(("127.0.0.1", 0)) as fake:
        client = TcpClient(*fake.getsockname()[:2], timeout=5, codec="json")
        net.socks.append(client)
        peer, _ = fake.accept()
        with peer:
            peer.sendall(rllib_frame({"type": "PONG", "codec": "binary"}))
            with pytest.raises(rllink.ProtocolError, match="did not offer"):
                client.request({"type": "PING"})


@pytest.mark.parametrize("ping, error", [
    ({"type": "PING", "codecs": "binary"}, "'codecs' must be a list"),
    ({"type": "PING", "codecs": [1]}, "'codecs' must be a list"),
    ({"type": "PING", "client_name": ""}, "'client_name' must be"),
    ({"type": "HEARTBEAT", "env_steps": -1}, "'env_steps' must be an int >= 0"),
    ({"type": "HEARTBEAT", "beat": 1}, "unexpected field"),
])
def test_bad_extension_fields_close_the_connection(net, ping, error, caplog):
    server = net.server()
    hub = net.hub(server)
    s = net.raw(server)
    s.sendall(rllib_frame(ping))
    assert read_to_eof(s) == b""
    wait_until(lambda: hub.closed(), 5, "the connection reported closed")
    assert any(error in line for line in log_lines(caplog, hub.closed()[0]))


# ---------------------------------------------------------------- abuse limits, binary frames

def test_binary_frames_obey_the_same_limits(net, caplog):
    server = net.server(max_frame_bytes=4096, frame_timeout=0.5)
    hub = net.hub(server)
    good = net.client(server, codec="binary", timeout=5)
    good.request({"type": "PING"})
    big, bad, slow = net.raw(server), net.raw(server), net.raw(server)
    for s in (big, bad, slow):
        s.sendall(rllib_frame({"type": "PING", "codecs": ["binary"]}))
        assert json.loads(recv_frame(s)[8:])["codec"] == "binary"
    # Too large: refused from its header, before the body is read.
    frame = binary_frame(binary_episodes(200))
    assert len(frame) > 4096 + 8
    big.sendall(frame[:8])
    assert read_to_eof(big) == b""
    # Malformed: a descriptor pointing outside the body.
    body = bytearray(rllink.encode_binary(binary_episodes(8)))
    head_len = int.from_bytes(body[4:8], "little")
    head = json.loads(body[8:8 + head_len])
    head["episodes"]["__cols__"]["rewards"]["__nd__"][2] = 1 << 20
    new_head = json.dumps(head, separators=(",", ":")).encode()
    new_head += b" " * (head_len - len(new_head))  # same length: the data stays aligned
    body[8:8 + head_len] = new_head
    bad.sendall(rllink.frame(bytes(body)))
    assert read_to_eof(bad) == b""
    # Slowloris: half a binary frame, then nothing.
    frame = binary_frame(binary_episodes(8))
    slow.sendall(frame[:len(frame) // 2])
    t0 = time.monotonic()
    assert read_to_eof(slow) == b""
    assert 0.3 < time.monotonic() - t0 < 3
    wait_until(lambda: len(hub.closed()) == 3, 5, "the three connections reported closed")
    closed = hub.closed()
    reasons = [line for c in closed for line in log_lines(caplog, c)]
    assert any("exceeds the maximum of 4096" in r for r in reasons), reasons
    assert any("lie outside" in r for r in reasons), reasons
    assert any("frame incomplete after 0.5 s" in r for r in reasons), reasons
    assert server.frames_rejected == 2
    # Meanwhile the good binary client was served, and still is.
    assert good.request(binary_episodes(8))["type"] == "SET_STATE"
    assert hub.store.steps_received == 8


def test_binary_frames_count_against_the_buffer_cap(net, caplog):
    server = net.server(max_buffered_bytes=1 << 20, max_frame_bytes=8 << 20)
    hub = net.hub(server)
    s = net.raw(server)
    s.sendall(rllib_frame({"type": "PING", "codecs": ["binary"]}))
    recv_frame(s)
    s.sendall(b"%08d" % (4 << 20) + rllink.MAGIC + bytes(2 << 20))  # half of a 4 MiB binary frame
    assert read_to_eof(s) == b""
    wait_until(lambda: hub.closed(), 5, "the connection reported closed")
    assert any("max_buffered_bytes" in line for line in log_lines(caplog, hub.closed()[0]))


# ---------------------------------------------------------------- heartbeats

def test_a_silent_binary_client_is_closed_and_its_lost_steps_counted(net, caplog):
    server = net.server(heartbeat_s=0.1, heartbeat_timeout=0.6)
    hub = net.hub(server)
    hung = net.client(server, timeout=5, codec="binary", client_name="hung-sim")
    alive = net.client(server, timeout=5, codec="binary")
    quiet_json = net.client(server, timeout=5, codec="json")
    for c in (hung, alive, quiet_json):
        c.request({"type": "PING"})
        c.request({"type": "GET_STATE"})
    hung.request(binary_episodes(8))
    hung.heartbeat(8)                       # too soon after the reply: nothing sent
    time.sleep(0.15)
    hung.heartbeat(30)                      # a HEARTBEAT: 30 stepped, 8 sent ...
    hung_id = f"tcp:{hung.local_address[0]}:{hung.local_address[1]}"
    wait_until(lambda: getattr(hub.hub.connections.get(hung_id), "stepped", None) == 30, 5, "the HEARTBEAT's 30 steps")
    t0 = time.monotonic()                   # ... and then its env hangs
    stepped = 0
    while time.monotonic() - t0 < 1.5:      # the other one keeps stepping
        stepped += 1
        alive.heartbeat(stepped)
        time.sleep(0.01)
    wait_until(lambda: hung_id in hub.closed(), 2, "the hung client closed")
    assert hub.closed() == [hung_id]        # not the one heartbeating, nor the JSON client
    assert server.clients_timed_out == 1
    assert hub.store.steps_lost == 22
    assert any("no heartbeat for" in line and "hung" in line for line in log_lines(caplog, hung_id))
    assert f"{hung_id} (hung-sim): 22 env steps it had stepped but not sent are lost" in caplog.text
    with pytest.raises(ConnectionClosed):
        hung.request(binary_episodes(8))
    assert alive.request(binary_episodes(8))["type"] == "SET_STATE"
    assert quiet_json.request({"type": "PING"}) == {"type": "PONG"}   # JSON clients owe no heartbeat


def test_a_client_waiting_for_its_reply_is_never_timed_out(net):
    """Silence while the learner holds the client back (on-policy, nobody trains) is the
    learner's, not the client's."""
    server = net.server(heartbeat_s=0.1, heartbeat_timeout=0.3)
    hub = net.hub(server, auto_publish=False)
    client = net.client(server, timeout=5, codec="binary")
    client.request({"type": "PING"})
    client.request({"type": "GET_STATE"})
    client.send(binary_episodes(8))         # its reply waits for weights that never come
    # Checked while the client still waits (one that gives up closes its connection); on a
    # loaded machine the hub's thread may take the request late.
    wait_until(lambda: hub.hub.waiting, 10, "the hub to hold the request", interval=0.01)
    time.sleep(1.0)                          # > 3 heartbeat timeouts of the client's silence
    assert server.clients_timed_out == 0 and hub.hub.waiting


# ---------------------------------------------------------------- the batch does not wait forever

@pytest.mark.parametrize("timeout", [None, 0.5])
def test_an_on_policy_batch_waits_on_a_silent_client_at_most_the_timeout(timeout, caplog):
    server = InProcServer()
    net = PolicyNet(SPEC, 16)
    learner = Serving([server], Config(env_steps_per_sample=32, train_batch_size=64, hang_timeout=timeout),
                      {DEFAULT_POLICY: SPEC}, {DEFAULT_POLICY: net.template}, {DEFAULT_POLICY: net.initial_weights(0)})
    learner.start()
    sent = threading.Thread()
    try:
        fast, silent = server.connect(timeout=5), server.connect(timeout=5)
        for c in (fast, silent):
            c.request({"type": "PING"})
            c.request({"type": "GET_STATE"})
        caplog.set_level(logging.WARNING)
        def send():
            try:
                fast.request({"type": "EPISODES_AND_GET_STATE", "episodes": [chunk(0.0, 32).to_rllink()],
                              "timesteps": 32})
            except (ConnectionError, TimeoutError):
                pass  # the test ends without training: its weights never come

        sent = threading.Thread(target=send, daemon=True)
        sent.start()
        t0, batch = time.monotonic(), None
        while batch is None and time.monotonic() - t0 < 1.5:
            batch = learner.next_batch(0.02)
        if timeout is None:   # the silent client never sends: the batch would wait forever
            assert batch is None and learner.short_batches == 0
        else:
            assert batch is not None and 0.45 < time.monotonic() - t0 < 1.5
            assert sum(b.num_steps for b in batch[0][DEFAULT_POLICY]) == 32 and learner.short_batches == 1
            assert "training on the 32 env steps it has without them" in caplog.text
    finally:
        learner.stop()
        server.close()
        if sent.ident is not None:
            sent.join(5)


# ---------------------------------------------------------------- a hung local TCP simulator

def test_a_hung_local_tcp_simulator_is_closed_and_restarted(start_run, tmp_path, monkeypatch, no_shm_leftovers):
    """--transport tcp: the simulator's HEARTBEATs stop with its env, the server closes its
    connection after --hang-timeout, the supervisor kills and restarts its process."""
    armed, hung = tmp_path / "armed", tmp_path / "hung"
    (tmp_path / "hanging_env_local.py").write_text(HANGING_ENV.format(armed=str(armed), hung=str(hung)))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    run = start_run("--sims", 2, "--transport", "tcp", "--env", "hanging_env_local:make_env", "--hang-timeout", 2,
                    "--logdir", tmp_path / "run", "--stop-return", 1e9, "--max-env-steps", 10_000_000)
    run.wait_for("update    2 ", timeout=60)
    armed.touch()
    run.wait_for("hung: its HEARTBEATs stopped, so the server closed tcp:", timeout=20)
    run.wait_for("is back, ", timeout=20)
    out = run.output()
    assert re.search(r"simulator shmrl-sim\d \(pid \d+\) hung: its HEARTBEATs stopped", out), out[-3000:]
    assert "closing connection: no heartbeat for" in out
    os.killpg(run.proc.pid, signal.SIGINT)
    assert run.proc.wait(30) == 130, run.output()[-3000:]
    s = summary_of(tmp_path / "run")
    assert s["clients_timed_out"] == 1 and s["simulator_restarts"] == 1
    check_books(s, tmp_path / "run")
