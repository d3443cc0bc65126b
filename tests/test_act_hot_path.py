"""Server-side inference's hot path (shmrl/rllink/act.py, ``ActHeads`` and ``ActionsFrames``):
a binary ACT whose head was seen before decodes to exactly what ``rllink.decode_request``
gives, and never accepts what it refuses; a binary ACTIONS is written byte for byte as
``rllink.encode`` writes it; and TCP clients are served through both."""
import json
import math
import socket
import time

import numpy as np
import pytest

from conftest import FakeServer, conn_id_of, recv_frame, wait_until
from shmrl import rllink
from shmrl.envs.make import env_spec
from shmrl.server.hub import Hub
from shmrl.model.net import PolicyNet
from shmrl.onnxio.policy import encode_onnx_file
from shmrl.rllink import ProtocolError
from shmrl.rllink.act import ActHeads, ActionsFrames
from shmrl.server.store import DEFAULT_POLICY, EpisodeStore
from shmrl.transport.tcp import TcpServer

RNG = np.random.default_rng(0)


def act(k=2, obs=None, first=False, truncated=(), final=True, **replace):
    msg = {"type": "ACT", "obs": RNG.normal(size=(k, 4)).astype(np.float32) if obs is None else obs}
    if not first:
        trunc = np.zeros(k, bool)
        trunc[list(truncated)] = True
        msg.update(rewards=np.ones(k, np.float32), terminateds=np.zeros(k, bool), truncateds=trunc)
        if truncated and final:
            msg["final_obs"] = np.zeros_like(msg["obs"]) if not isinstance(msg["obs"], dict) else \
                {name: np.zeros_like(v) for name, v in msg["obs"].items()}
    msg.update(replace)
    return rllink.encode_binary(msg)


def slow(body):
    """decode_request's verdict: the message, or the ProtocolError."""
    try:
        return rllink.decode_request(body)
    except ProtocolError as e:
        return e


def assert_same(fast: dict, ref: dict):
    assert list(fast) == list(ref)
    for key, value in ref.items():
        if isinstance(value, dict):
            assert list(fast[key]) == list(value)
            for name in value:
                assert fast[key][name].dtype == value[name].dtype
                np.testing.assert_array_equal(fast[key][name], value[name])
        elif isinstance(value, np.ndarray):
            assert fast[key].dtype == value.dtype and fast[key].shape == value.shape
            np.testing.assert_array_equal(fast[key], value)
        else:
            assert fast[key] == value


def learned(body) -> ActHeads:
    heads = ActHeads()
    assert heads.decode(body) is None   # not seen yet: the whole way
    heads.learn(body, rllink.decode_request(body))
    return heads


def with_value(body: bytes, key: str, value) -> bytes:
    """``body`` with the first element of array ``key`` overwritten (the head unchanged)."""
    head_len = int.from_bytes(body[4:8], "little")
    dtype, _, offset, _ = json.loads(body[8:8 + head_len])[key]["__nd__"]
    start = -(-(8 + head_len) // 8) * 8 + offset
    raw = bytearray(body)
    raw[start:start + np.dtype(dtype).itemsize] = np.array([value], "|u1" if dtype == "|b1" else dtype).tobytes()
    return bytes(raw)


@pytest.mark.parametrize("make", [
    lambda: act(first=True), lambda: act(k=1), lambda: act(k=3), lambda: act(k=3, truncated=[1]),
    lambda: act(k=200),   # many floats: numpy's check
    lambda: act(obs=RNG.integers(0, 255, (2, 3, 3)).astype(np.uint8)),
    lambda: act(obs=RNG.integers(0, 5, (2, 1)).astype(np.int64)),
    lambda: act(obs={"pos": RNG.normal(size=(2, 2)).astype(np.float32), "mask": np.ones((2, 3), np.uint8)},
                truncated=[0]),
], ids=["first", "k1", "k3", "final_obs", "k200", "uint8", "int64", "dict"])
def test_a_known_head_decodes_as_the_whole_way(make):
    body = make()
    heads = learned(body)
    for again in (body, make()):   # the same head, new values
        assert_same(heads.decode(again), rllink.decode_request(again))
    assert heads.fast == 2


@pytest.mark.parametrize("key, value, match", [
    ("obs", math.nan, "non-finite"), ("obs", math.inf, "non-finite"), ("rewards", -math.inf, "non-finite"),
    ("terminateds", 2, "other than 0 and 1"), ("truncateds", 1, "'final_obs' is missing"),
])
def test_values_the_whole_way_refuses_are_never_taken_fast(key, value, match):
    body = act(k=3)
    heads = learned(body)
    bad = with_value(body, key, value)
    assert heads.decode(bad) is None   # left to decode_request, which says why
    with pytest.raises(ProtocolError, match=match):
        rllink.decode_request(bad)
    for many in (act(k=100),):   # the numpy check of many floats
        heads.learn(many, rllink.decode_request(many))
        assert heads.decode(with_value(many, "obs", math.nan)) is None


def test_heads_it_does_not_take_go_the_whole_way():
    f8 = act(obs=np.zeros((2, 4)), first=True)   # float64 obs: act_request converts them
    heads = learned(f8)
    assert heads.decode(f8) is None
    body = act(k=2)
    heads.learn(body, rllink.decode_request(body))
    assert heads.decode(body[:-8] + bytes(16)) is None   # another length: another layout
    assert heads.decode(rllink.encode_json({"type": "ACT", "obs": [[0.0] * 4]})) is None
    ping = rllink.encode_binary({"type": "PING"})
    heads.learn(ping, rllink.decode_request(ping))
    assert heads.decode(ping) is None and heads.fast == 0
    padded = rllink.encode_binary({"type": "ACT", "obs": np.zeros((1, 4), np.float32)})
    head_len = int.from_bytes(padded[4:8], "little")
    huge = padded[:4] + (head_len + 8192).to_bytes(4, "little") + padded[8:8 + head_len] + b" " * 8192 + \
        padded[8 + head_len:]   # a valid head of 8 KB of spaces is not kept
    heads.learn(huge, rllink.decode_request(huge))
    assert heads.decode(huge) is None


def test_a_head_with_other_fields_is_never_taken_fast():
    """An ACT of another form (a multi-agent one's "envs") that the whole way accepts is
    left to it: the fast path knows only the single-agent fields."""
    body = rllink.encode_binary({"type": "ACT", "envs": [{"obs": np.zeros((1, 4), np.float32)}]})
    heads = ActHeads()
    heads.learn(body, {"type": "ACT", "envs": []})   # as if validated
    assert heads.decode(body) is None


def test_heads_kept_are_bounded():
    heads = ActHeads()
    for k in range(1, ActHeads.MAX_HEADS + 10):
        body = act(k=k % 4000 + 1, first=True)
        heads.learn(body, rllink.decode_request(body))
        assert len(heads._plans) <= ActHeads.MAX_HEADS


@pytest.mark.parametrize("actions", [
    np.array([1]), np.array([0, 1, 1]), RNG.integers(0, 3, (3, 2)), RNG.normal(size=(1, 1)).astype(np.float32),
    RNG.normal(size=(3, 3)).astype(np.float32), RNG.normal(size=(5,)).astype(np.float32),
])
def test_actions_frames_are_encodes_bytes(actions):
    frames = ActionsFrames()
    for version in (1, 1, 12345):
        msg = {"type": "ACTIONS", "actions": actions, "weights_seq_no": version}
        assert frames(msg) == rllink.frame(rllink.encode_binary(msg))
        decoded = rllink.decode_reply(frames(msg)[8:])
        np.testing.assert_array_equal(decoded["actions"], actions)


@pytest.mark.parametrize("msg", [
    {"type": "ACTIONS", "actions": [1, 0], "weights_seq_no": 1},
    {"type": "ACTIONS", "actions": np.array([1.0]), "weights_seq_no": 1},    # float64: converted by encode
    {"type": "ACTIONS", "weights_seq_no": 1, "actions": np.array([1])},       # another order of keys
    {"type": "ACTIONS", "actions": np.array([1]), "weights_seq_no": 1, "more": 2},
    {"type": "SET_STATE", "actions": np.array([1]), "weights_seq_no": 1},
])
def test_actions_frames_leave_other_messages_to_encode(msg):
    assert ActionsFrames()(msg) is None


def test_tcp_server_serves_acts_through_the_hot_path():
    server = TcpServer("127.0.0.1", 0)
    try:
        sock = socket.create_connection(server.address, timeout=10)
        sock.sendall(rllink.frame(rllink.encode_json({"type": "PING", "codecs": ["binary"]})))
        (conn_id, _), = wait_for(server, 1)
        server.reply(conn_id, {"type": "PONG"})
        assert rllink.decode(recv_frame(sock)[8:])["codec"] == "binary"
        bodies = [act(k=2, first=True)] + [act(k=2) for _ in range(3)] + [with_value(act(k=2), "obs", math.nan)]
        got = []
        for i, body in enumerate(bodies):
            sock.sendall(rllink.frame(body))
            got += wait_for(server, 1)
            conn_id, msg = got[i]
            if i < 4:
                assert_same(msg, rllink.decode_request(body))
                server.reply(conn_id, {"type": "ACTIONS", "actions": np.array([i, 1]), "weights_seq_no": 7})
                frame = recv_frame(sock)
                assert frame == rllink.frame(rllink.encode_binary({"type": "ACTIONS", "actions": np.array([i, 1]),
                                                                   "weights_seq_no": 7}))
            else:
                assert msg is None   # the NaN closed the connection, as the whole way does
        assert server._act_heads.fast == 2   # the first of each head went the whole way
    finally:
        server.close()


def full_act(field: str, value) -> dict:
    """A binary-ready ACT with every field, ``field`` replaced by ``value`` (a Dict
    observation's "pos" where ``value`` is one)."""
    leaf = isinstance(value, dict) or isinstance(value, list) and isinstance(value[0], dict)
    obs = {"pos": np.zeros((2, 4), np.float32)} if leaf else np.zeros((2, 4), np.float32)
    msg = {"type": "ACT", "obs": obs, "rewards": np.ones(2, np.float32), "terminateds": np.zeros(2, bool),
           "truncateds": np.array([False, True]), "final_obs": obs}
    msg[field] = value
    return msg


@pytest.mark.parametrize("field, value", [
    ("obs", [[0.0] * 4] * 2), ("obs", [{"pos": [0.0] * 4}] * 2), ("obs", {"pos": [[0.0] * 4] * 2}),
    ("final_obs", [[0.0] * 4] * 2), ("rewards", [1.0, 1.0]), ("terminateds", [False, False]),
    ("truncateds", [False, True]),
])
def test_a_binary_act_with_a_json_value_where_an_array_goes_is_refused_with_the_reason(field, value):
    """A binary ACT carries its fields as arrays: an inline JSON list in its head is refused
    (a ProtocolError, which closes only that connection), never an error of the head cache."""
    body = rllink.encode_binary(full_act(field, value))
    with pytest.raises(ProtocolError, match=f"a binary ACT's '{field}' is an array"):
        ActHeads(rllink.decode_request)(body)
    server = TcpServer("127.0.0.1", 0)
    try:
        with socket.create_connection(server.address, timeout=10) as sock:
            sock.sendall(rllink.frame(body))
            assert wait_for(server, 1) == [(conn_id_of(sock), None)]   # closed
        assert server.frames_rejected == 1   # refused as a bad frame, not an internal error
    finally:
        server.close()


def wait_for(server, n: int, timeout: float = 10.0) -> list:
    got = []
    wait_until(lambda: got.extend(server.poll(0.05)) or len(got) >= n, timeout, f"{n} requests")
    return got


def test_replies_of_a_batch_go_out_together_at_its_end():
    """TcpServer.batched: the IO thread is woken once for the ACTIONS of a forward pass."""
    server = TcpServer("127.0.0.1", 0)
    socks = []
    try:
        for _ in range(3):
            socks.append(socket.create_connection(server.address, timeout=10))
            socks[-1].sendall(rllink.frame(rllink.encode_json({"type": "PING"})))
        conn_ids = [conn_id for conn_id, _ in wait_for(server, 3)]
        with server.batched():
            for conn_id in conn_ids:
                server.reply(conn_id, {"type": "PONG"})
            time.sleep(0.3)
            for sock in socks:
                sock.setblocking(False)
                with pytest.raises(BlockingIOError):
                    sock.recv(1)
                sock.settimeout(10)
        for sock in socks:
            assert rllink.decode(recv_frame(sock)[8:]) == {"type": "PONG"}
        server.reply(conn_ids[0], {"type": "PONG"})   # outside a batch: at once, as before
        assert rllink.decode(recv_frame(socks[0])[8:]) == {"type": "PONG"}
    finally:
        for sock in socks:
            sock.close()
        server.close()


def test_samples_after_the_first_are_recorded_step_by_step_alike():
    """ServerInference records the first sample's steps at its end, later ones as they
    come: three samples of K = 2 (env 0 terminating, env 1 truncated, in each) reach the
    store with every reward, flag and final observation where it belongs."""
    spec = env_spec("CartPole-v1")
    net = PolicyNet(spec, 16, "Tanh", layers=1)
    store = EpisodeStore()
    hub = Hub({DEFAULT_POLICY: spec}, store, env_steps_per_sample=8, on_policy=False, max_pending_steps=1000)
    hub.set_state(1, {DEFAULT_POLICY: {"onnx_file": encode_onnx_file(net.template.publish(net.initial_weights(0))),
                                       "weights_seq_no": 1}})
    server = FakeServer()

    def send(msg):
        hub.handle(server, "c", rllink.decode_request(rllink.encode_binary(msg)))
        hub.flush_actions()

    def obs(t):
        return np.array([[0.01 * t, 0.0, 0.0, 0.0], [0.01 * t, 0.5, 0.0, 0.0]], np.float32)

    send({"type": "PING", "inference": "server"})
    send({"type": "ACT", "obs": obs(0)})
    final = np.full((2, 4), 9.0, np.float32)
    for t in range(1, 13):
        term, trunc = np.array([t % 4 == 1, False]), np.array([False, t % 4 == 2])
        msg = {"type": "ACT", "obs": obs(t), "rewards": np.array([t, 100 + t], np.float32),
               "terminateds": term, "truncateds": trunc}
        if trunc.any():
            msg["final_obs"] = final
        send(msg)
    batches = store.take()[DEFAULT_POLICY]
    assert len(batches) == 3 and sum(b.num_steps for b in batches) == 24
    for s, batch in enumerate(batches):
        assert len(batch.obs) == batch.num_steps + batch.num_chunks
        rewards = batch.rewards.tolist()
        steps = range(4 * s + 1, 4 * s + 5)
        assert rewards == [float(t) for t in steps] + [100.0 + t for t in steps]
        ends = np.cumsum(batch.lengths) - 1   # each chunk's last step
        assert [rewards[i] for i in ends[batch.is_terminated]] == [float(4 * s + 1)]
        assert [rewards[i] for i in ends[batch.is_truncated]] == [100.0 + 4 * s + 2]
        rows = np.cumsum(batch.lengths + 1) - 1   # each chunk's last obs
        np.testing.assert_allclose(batch.obs[rows[batch.is_truncated]], final[1:])
        np.testing.assert_allclose(batch.obs[rows[batch.is_terminated]], obs(4 * s + 1)[:1])
