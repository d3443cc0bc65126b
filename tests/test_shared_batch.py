"""Issue 35, item 1: the train batch is shared over whoever samples. Each client's
``env_steps_per_sample`` is the batch over the connected clients and the run's own
simulators, in SET_CONFIG at the handshake and in every SET_STATE after it (RLLINK.md
§3.3), so it follows clients as they come and go; server-side inference cuts each
connection's samples by it at once; ``--env-steps-per-sample`` still fixes it."""
import numpy as np

from conftest import FakeServer, wait_until
from shmrl import rllink
from shmrl.client.rollout import Rollout
from shmrl.client.simulator import run_simulator
from shmrl.envs.make import env_spec
from shmrl.server.hub import Hub
from shmrl.server.store import DEFAULT_POLICY, EpisodeStore
from test_server_inference import Client, act, model_file, obs_of

SPEC = env_spec("CartPole-v1")


def shared_hub(shared_batch, local_sims=0, on_policy=True):
    hub = Hub({DEFAULT_POLICY: SPEC}, EpisodeStore(), env_steps_per_sample=2048, on_policy=on_policy,
              max_pending_steps=None if on_policy else 10_000, shared_batch=shared_batch, local_sims=local_sims)
    hub.set_state(1, {DEFAULT_POLICY: {"onnx_file": model_file(), "weights_seq_no": 1}})
    return hub


def handshake(hub, server, conn_id) -> int:
    """PING and GET_CONFIG as a client-side-inference client does: its SET_CONFIG's share."""
    hub.handle(server, conn_id, {"type": "PING"})
    hub.handle(server, conn_id, {"type": "GET_CONFIG"})
    (c, config), = [r for r in server.replies[-1:]]
    assert c == conn_id and config["type"] == "SET_CONFIG"
    return config["env_steps_per_sample"]


def state_share(hub, server, conn_id):
    """The env_steps_per_sample of the SET_STATE that a GET_STATE gets now (None: absent)."""
    hub.handle(server, conn_id, {"type": "GET_STATE"})
    msg = rllink.decode_reply(rllink.encode(server.replies[-1][1], "json"))   # through the wire's checks
    return msg.get("env_steps_per_sample")


def test_each_client_gets_its_share_of_the_batch_as_clients_come_and_go():
    hub, server = shared_hub(2048), FakeServer()
    assert [handshake(hub, server, f"tcp:c{i}") for i in range(3)] == [2048, 1024, 683]
    assert state_share(hub, server, "tcp:c0") == 683          # the first one hears of it in SET_STATE
    hub.handle(server, "tcp:c2", None)                         # one leaves: the others take its share
    assert state_share(hub, server, "tcp:c0") == 1024
    hub.handle(server, "tcp:c0", {"type": "PING"})             # a PING alone takes no share
    assert state_share(hub, server, "tcp:c1") == 1024
    assert handshake(hub, server, "tcp:c1") == 1024            # a second GET_CONFIG of one client: still one
    # The run's own simulators count from the start, whether or not they have connected yet.
    local, server = shared_hub(2048, local_sims=2), FakeServer()
    assert handshake(local, server, "shm:0") == 1024 and handshake(local, server, "shm:1") == 1024
    assert handshake(local, server, "tcp:ext") == 683


def test_a_set_env_steps_per_sample_stays_and_set_state_is_rlliBs_own():
    hub, server = shared_hub(None), FakeServer()
    assert [handshake(hub, server, f"tcp:c{i}") for i in range(3)] == [2048, 2048, 2048]
    assert state_share(hub, server, "tcp:c0") is None
    assert list(server.replies[-1][1]) == ["type", "onnx_file", "weights_seq_no"]   # RLlib's keys, in its order


def test_server_side_inference_cuts_each_sample_at_the_share_of_its_moment():
    hub = shared_hub(16, on_policy=False)
    a = Client(hub, "tcp:a")
    a.send(act(obs_of(0)))                                    # 2 envs: 16 steps are 8 ACTs
    for t in range(1, 9):
        assert hub.store.steps_by_conn.get("tcp:a", 0) == 0
        a.send(act(obs_of(t), [1.0, 1.0]))
    assert hub.store.steps_by_conn["tcp:a"] == 16
    Client(hub, "tcp:b")             # a second one asks for actions: 8 steps each, from a's next sample on
    sent = [hub.store.steps_by_conn["tcp:a"]]
    for t in range(9, 33):
        a.send(act(obs_of(t), [1.0, 1.0]))
        sent.append(hub.store.steps_by_conn["tcp:a"])
        if t == 20:
            hub.handle(a.server, "tcp:b", None)              # it leaves: 16 again, from a's next sample
    # The sample open when b came ends at the old share (8 ACTs), then two of 4 ACTs (the second
    # began before b left), then 8 ACTs again.
    assert [t for t, (x, y) in enumerate(zip(sent, sent[1:]), 9) if y > x] == [16, 20, 24, 32], sent
    assert sent[-1] == 16 + 16 + 8 + 8 + 16


def test_a_rollout_resized_between_rollouts_keeps_its_episodes_going():
    r = Rollout(2, 3)
    obs = np.zeros((2, 4), np.float32)
    r.start(obs)
    for _ in range(3):
        r.record(np.zeros(2, np.int64), np.zeros((2, 2), np.float32), np.zeros(2, np.float32), obs,
                 np.ones(2, np.float32), np.zeros(2, bool), np.zeros(2, bool))
    first = r.batch(1)
    r.resize(5)
    r.start(obs)
    for _ in range(5):
        r.record(np.zeros(2, np.int64), np.zeros((2, 2), np.float32), np.zeros(2, np.float32), obs,
                 np.ones(2, np.float32), np.zeros(2, bool), np.zeros(2, bool))
    second = r.batch(1)
    assert first.lengths.tolist() == [3, 3] and second.lengths.tolist() == [5, 5]
    assert second.episode_ids == first.episode_ids                        # the same episodes, continued
    assert r.returns.tolist() == [8.0, 8.0]


def test_shmrls_client_follows_its_share_from_set_state(net):
    """A Python client waits for SET_STATE after each message (strict on-policy): a client
    that joins meanwhile halves its next message; one that leaves doubles it again."""
    server = net.server()
    loop = net.hub(server, auto_publish=False, onnx_file=model_file(), shared_batch=32)
    sizes = []
    handle = loop.hub.handle

    def recording(server_, conn_id, msg):
        if msg is not None and msg["type"] == "EPISODES_AND_GET_STATE":
            sizes.append(int(msg["episodes"].lengths.sum()))
        handle(server_, conn_id, msg)

    loop.hub.handle = recording
    a = net.client(server, timeout=30)
    net.thread(run_simulator, a, "CartPole-v1", 0, 2, 3)      # 2 envs, 3 messages
    wait_until(lambda: len(sizes) == 1 and loop.hub.waiting, 30, "the first message", interval=0.01)
    b = net.client(server, timeout=30)
    b.request({"type": "PING"})
    assert b.request({"type": "GET_CONFIG"})["env_steps_per_sample"] == 16
    loop.publish_requested.set()
    wait_until(lambda: len(sizes) == 2 and loop.hub.waiting, 30, "the second message", interval=0.01)
    b.close()
    wait_until(lambda: len(loop.closed()) == 1, 30, "the second client's close", interval=0.01)
    loop.publish_requested.set()
    wait_until(lambda: len(sizes) == 3, 30, "the third message", interval=0.01)
    assert sizes == [32, 16, 32]
