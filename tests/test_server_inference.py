"""Server-side inference (docs/RLLINK.md, "Server-side inference"): ACT and ACTIONS
validated, the Hub's per-connection trajectories (what reaches the store, step by step),
the hold in strict on-policy, recurrent state per slot, bad ACTs closing only their
connection; and clients on raw sockets training a real run over TCP in both codecs."""
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import FakeServer, decode_frame, read_to_eof, recv_frame, wait_until
from shmrl import rllink
from shmrl.envs.make import env_spec, make_vec_env
from shmrl.server.hub import Hub
from shmrl.model.net import PolicyNet
from shmrl.onnxio.policy import encode_onnx_file
from shmrl.rllink import ProtocolError
from shmrl.client.simulator import run_server_inference
from shmrl.server.store import DEFAULT_POLICY, EpisodeStore
from shmrl.transport.tcp_client import TcpClient

SPEC = env_spec("CartPole-v1")


def model_file(spec=SPEC, memory=None, seed=0) -> str:
    net = PolicyNet(spec, 16, "Tanh", layers=1, memory=memory, memory_size=8)
    return encode_onnx_file(net.template.publish(net.initial_weights(seed)))


def make_hub(steps=8, on_policy=True, spec=SPEC, memory=None, **kw):
    store = EpisodeStore()
    hub = Hub({DEFAULT_POLICY: spec}, store, env_steps_per_sample=steps, on_policy=on_policy,
              max_pending_steps=None if on_policy else 4 * steps, state_size=8 if memory else 0, **kw)
    hub.set_state(1, {DEFAULT_POLICY: {"onnx_file": model_file(spec, memory), "weights_seq_no": 1}})
    return hub, store


class Client:
    """One server-inference connection to a Hub, messages validated as a transport would."""

    def __init__(self, hub, conn_id="tcp:c0", server=None, codec="json"):
        self.hub, self.conn_id, self.server, self.codec = hub, conn_id, server or FakeServer(), codec
        self.send({"type": "PING", "inference": "server"})
        assert self.server.replies.pop() == (conn_id, {"type": "PONG", "inference": "server"})

    def send(self, msg, flush=True) -> None:
        body = rllink.encode(msg, self.codec)   # through the codec, as on the wire
        self.hub.handle(self.server, self.conn_id, rllink.decode_request(body))
        if flush:   # the end of the serving thread's poll round
            self.hub.flush_actions()

    def actions(self):
        """The ACTIONS sent to this connection since the last call (None: none)."""
        mine = [m for c, m in self.server.replies if c == self.conn_id]
        self.server.replies = [(c, m) for c, m in self.server.replies if c != self.conn_id]
        assert len(mine) <= 1, mine
        return rllink.decode_reply(rllink.encode(mine[0], self.codec)) if mine else None

    def dropped(self) -> list[str]:
        return [why for c, why in self.server.dropped if c == self.conn_id]


def act(obs, rewards=None, terminateds=None, truncateds=None, final_obs=None) -> dict:
    msg = {"type": "ACT", "obs": np.asarray(obs, np.float32)}
    if rewards is not None:
        k = len(msg["obs"])
        msg.update(rewards=np.asarray(rewards, np.float32),
                   terminateds=np.zeros(k, bool) if terminateds is None else np.asarray(terminateds),
                   truncateds=np.zeros(k, bool) if truncateds is None else np.asarray(truncateds))
    if final_obs is not None:
        msg["final_obs"] = np.asarray(final_obs, np.float32)
    return msg


def obs_of(t, k=2):
    """A recognizable observation of env k at step t."""
    return [[0.01 * t, 0.1 * e, 0.0, 0.0] for e in range(k)]


# ------------------------------------------------------------- the wire

def test_act_and_actions_validate_in_both_codecs():
    msg = act(obs_of(1), [1.0, 0.5], [False, True], [True, False], final_obs=obs_of(9))
    for codec in ("json", "binary"):
        out = rllink.decode_request(rllink.encode(msg, codec))
        np.testing.assert_array_equal(out["obs"], msg["obs"])
        assert out["rewards"].dtype == np.float32 and out["terminateds"].tolist() == [False, True]
        assert out["truncateds"].tolist() == [True, False]
        np.testing.assert_array_equal(out["final_obs"], msg["final_obs"])
        reply = rllink.decode_reply(rllink.encode({"type": "ACTIONS", "actions": np.array([1, 0]),
                                                   "weights_seq_no": 3}, codec))
        assert reply["actions"].tolist() == [1, 0] and reply["actions"].dtype == np.int64
        assert reply["weights_seq_no"] == 3
    # JSON whole numbers read as integers: a final_obs of them still fits float obs
    ints = rllink.decode_request(b'{"type": "ACT", "obs": [[0.5, 0, 0, 0]], "rewards": [1], "terminateds": [false], '
                                 b'"truncateds": [true], "final_obs": [[1, 2, 3, 4]]}')
    assert ints["final_obs"].tolist() == [[1, 2, 3, 4]] and ints["rewards"].dtype == np.float32
    ping = rllink.decode_request(rllink.encode_json({"type": "PING", "inference": "server"}))
    assert ping["inference"] == "server"
    assert rllink.decode_reply(b'{"type": "PONG", "inference": "server"}')["inference"] == "server"


@pytest.mark.parametrize("msg, match", [
    ({"type": "ACT"}, "missing field 'obs'"),
    ({"type": "ACT", "obs": []}, "1 to 4096 envs"),
    ({"type": "ACT", "obs": [[0.0] * 4] * 4097}, "1 to 4096 envs"),
    ({"type": "ACT", "obs": [[float("nan")] * 4]}, "non-finite"),
    ({"type": "ACT", "obs": [[1e300] * 4]}, "non-finite"),
    ({"type": "ACT", "obs": [[0.0] * 4], "rewards": [1.0]}, "all three or none"),
    ({"type": "ACT", "obs": [[0.0] * 4], "rewards": [1.0, 2.0], "terminateds": [False], "truncateds": [False]},
     "'rewards' has shape"),
    ({"type": "ACT", "obs": [[0.0] * 4], "rewards": [1.0], "terminateds": [0], "truncateds": [False]},
     "'terminateds' must be 1 booleans"),
    ({"type": "ACT", "obs": [[0.0] * 4], "rewards": [1.0], "terminateds": [False], "truncateds": [True]},
     "'final_obs' is missing"),
    ({"type": "ACT", "obs": [[0.0] * 4], "rewards": [1.0], "terminateds": [False], "truncateds": [True],
      "final_obs": [[0.0] * 3]}, "form of 'obs'"),
    ({"type": "ACT", "obs": [[0.0] * 4], "final_obs": [[0.0] * 4]}, "without the outcome"),
    ({"type": "ACT", "obs": [[0.0] * 4], "agent_ids": ["a"]}, "unexpected field"),
    ({"type": "PING", "inference": "gpu"}, "'inference' must be one of"),
])
def test_bad_acts_are_refused_with_the_reason(msg, match):
    with pytest.raises(ProtocolError, match=match):
        rllink.decode_request(rllink.encode_json(msg))


@pytest.mark.parametrize("msg, match", [
    ({"type": "ACTIONS", "weights_seq_no": 1}, "missing field 'actions'"),
    ({"type": "ACTIONS", "actions": [1]}, "missing field 'weights_seq_no'"),
    ({"type": "ACTIONS", "actions": "1", "weights_seq_no": 1}, "must be a list"),
    ({"type": "ACTIONS", "actions": [True], "weights_seq_no": 1}, "booleans"),
    ({"type": "ACTIONS", "actions": [], "weights_seq_no": 1}, "1 to 4096 rows"),
])
def test_bad_actions_replies_are_refused(msg, match):
    with pytest.raises(ProtocolError, match=match):
        rllink.decode_reply(rllink.encode_json(msg))


def test_set_config_describes_the_spaces():
    hub, _ = make_hub()
    assert {k: hub.config_msg[k] for k in ("observation_shape", "observation_dtype", "action_space")} == {
        "observation_shape": [4], "observation_dtype": "<f4", "action_space": {"type": "Discrete", "n": 2}}
    box, _ = make_hub(spec=env_spec("Pendulum-v1"))
    assert box.config_msg["action_space"] == {"type": "Box", "shape": [1], "low": [-2.0], "high": [2.0]}


# ------------------------------------------------------------- the Hub's trajectories

@pytest.mark.parametrize("codec", ["json", "binary"])
def test_steps_reach_the_store_as_chunks_with_their_rewards_and_flags(codec):
    """K = 2, 4 steps per env per sample: env 0 terminates after step 1, env 1 is truncated
    after step 2 (its chunk ends at final_obs), and the running episodes are continued."""
    hub, store = make_hub(steps=8)
    c = Client(hub, codec=codec)
    c.send(act(obs_of(0)))
    first = c.actions()
    assert first["weights_seq_no"] == 1 and first["actions"].shape == (2,)
    final = [[9.0, 9.0, 9.0, 9.0], [8.0, 8.0, 8.0, 8.0]]
    outcome = {1: ([True, False], [False, False]), 2: ([False, False], [False, True])}
    sent_actions = [first["actions"]]
    for t in range(1, 5):
        term, trunc = outcome.get(t, ([False, False], [False, False]))
        c.send(act(obs_of(t), [10 * t + 0, 10 * t + 1], term, trunc, final_obs=final if any(trunc) else None))
        reply = c.actions()
        if t < 4:
            sent_actions.append(reply["actions"])
    assert reply is None and hub.waiting == [c.conn_id]   # strict on-policy: held until new weights
    assert store.pending_steps == 8 and store.steps_by_conn == {c.conn_id: 8}
    (batch,) = store.take()[DEFAULT_POLICY]
    assert batch.lengths.tolist() == [1, 3, 2, 2]          # env 0: 1 + 3; env 1: 2 + 2
    assert len(batch.obs) == batch.num_steps + batch.num_chunks
    assert batch.is_terminated.tolist() == [True, False, False, False]
    assert batch.is_truncated.tolist() == [False, False, True, False]
    np.testing.assert_allclose(batch.rewards, [10, 20, 30, 40, 11, 21, 31, 41])
    np.testing.assert_array_equal(batch.actions, np.array(sent_actions).T.reshape(-1))   # env by env
    # env 1's truncated chunk ends at its final_obs; the next starts at the reset obs
    rows = np.cumsum(batch.lengths + 1)
    np.testing.assert_allclose(batch.obs[rows[2] - 1], final[1])
    np.testing.assert_allclose(batch.obs[rows[2]], obs_of(2)[1])
    assert batch.weights_seq_no.tolist() == [1, 1, 1, 1]
    assert batch.episode_ids[2] != batch.episode_ids[3]
    hub.set_state(2, {DEFAULT_POLICY: {"onnx_file": model_file(seed=1), "weights_seq_no": 2}})
    hub.flush_actions()
    assert c.actions()["weights_seq_no"] == 2 and not hub.waiting


def test_async_answers_at_once():
    hub, store = make_hub(steps=2, on_policy=False)
    c = Client(hub)
    c.send(act(obs_of(0)))
    c.actions()
    c.send(act(obs_of(1), [1.0, 1.0]))
    assert c.actions()["weights_seq_no"] == 1 and store.pending_steps == 2 and not hub.waiting


def test_acts_of_one_round_share_one_forward_pass():
    hub, _ = make_hub()
    server = FakeServer()
    clients = [Client(hub, f"tcp:c{i}", server) for i in range(3)]
    before = hub.inference.forward_passes
    for i, c in enumerate(clients):
        hub.handle(server, c.conn_id, rllink.validate(act(obs_of(0, k=i + 1)), "request"))
    hub.flush_actions()
    assert hub.inference.forward_passes == before + 1 and hub.inference.rows == 6
    assert [len(m["actions"]) for _, m in server.replies] == [1, 2, 3]


@pytest.mark.parametrize("case, msgs, match", [
    ("K changes", [act(obs_of(0)), act(obs_of(1, k=3), [1.0] * 3)], "K is fixed"),
    ("rewards first", [act(obs_of(0), [1.0, 1.0])], "first ACT of a connection carries no 'rewards'"),
    ("no rewards later", [act(obs_of(0)), act(obs_of(1))], "without 'rewards'"),
    ("wrong obs shape", [{"type": "ACT", "obs": np.zeros((2, 3), np.float32)}], "shape"),
])
def test_a_bad_act_closes_only_its_connection(case, msgs, match):
    hub, store = make_hub()
    server = FakeServer()
    bad, good = Client(hub, "tcp:bad", server), Client(hub, "tcp:good", server)
    good.send(act(obs_of(0)))
    for msg in msgs:
        bad.send(msg)
    assert len(bad.dropped()) == 1 and match in bad.dropped()[0], bad.dropped()
    assert bad.conn_id not in hub.inference.slots and not good.dropped()
    good.actions()
    good.send(act(obs_of(1), [1.0, 1.0]))
    assert good.actions() is not None


def test_act_without_asking_in_ping_or_twice_in_a_row_is_refused():
    hub, _ = make_hub()
    server = FakeServer()
    hub.handle(server, "tcp:x", rllink.validate({"type": "PING"}, "request"))
    assert server.replies[-1][1] == {"type": "PONG"}   # RLlib's PONG: no inference granted
    hub.handle(server, "tcp:x", rllink.validate(act(obs_of(0)), "request"))
    assert "did not ask for server-side inference" in server.dropped[-1][1]
    c = Client(hub, "tcp:y", server)
    hub.handle(server, c.conn_id, rllink.validate(act(obs_of(0)), "request"))
    hub.handle(server, c.conn_id, rllink.validate(act(obs_of(1), [1.0, 1.0]), "request"))
    assert "one ACT at a time" in c.dropped()[0]


def test_a_closed_connection_counts_its_open_steps_as_lost():
    hub, store = make_hub(steps=8)
    c = Client(hub)
    c.send(act(obs_of(0)))
    for t in range(1, 3):
        c.actions()
        c.send(act(obs_of(t), [1.0, 1.0]))
    hub.handle(c.server, c.conn_id, None)
    assert store.steps_lost == 4 and not hub.inference.slots


def test_a_run_that_cannot_serve_actions_does_not_grant_it():
    # a multi-agent Hub told neither its agents nor its policy map (tests/test_server_inference_ma.py: one that is)
    hub = Hub({DEFAULT_POLICY: SPEC}, EpisodeStore(), env_steps_per_sample=8, multiagent=True)
    server = FakeServer()
    hub.handle(server, "tcp:m", rllink.validate({"type": "PING", "inference": "server"}, "request"))
    assert server.replies[-1][1] == {"type": "PONG"}
    hub.handle(server, "tcp:m", rllink.validate(act(obs_of(0)), "request"))
    assert "does not serve actions" in server.dropped[-1][1]


def test_recurrent_state_is_kept_per_slot_and_reset_at_episode_end():
    spec = env_spec("CartPoleNoVel-v1")
    hub, store = make_hub(steps=4, on_policy=False, spec=spec, memory="gru")   # K = 2: 2 steps per sample
    c = Client(hub)
    obs = np.full((2, *spec.obs_shape), 0.5, np.float32)
    step = {"type": "ACT", "obs": obs, "rewards": np.ones(2, np.float32), "terminateds": np.zeros(2, bool),
            "truncateds": np.zeros(2, bool)}
    c.send({"type": "ACT", "obs": obs})
    slots = hub.inference.slots[c.conn_id]
    assert slots.state.shape == (2, 8) and slots.state.any(axis=1).all()
    c.actions()
    before = slots.state.copy()
    c.send({**step, "terminateds": np.array([True, False])})
    c.actions()
    # env 0 started over: its state is one step from zeros (as a new connection's), env 1's stepped on
    fresh = Client(hub, "tcp:fresh", c.server)
    fresh.send({"type": "ACT", "obs": obs})
    np.testing.assert_allclose(slots.state[0], hub.inference.slots["tcp:fresh"].state[0], atol=1e-6)
    assert not np.allclose(slots.state[1], before[1])
    c.send(step, flush=False)              # the first sample is complete
    carried = slots.state.copy()           # the state the next sample starts from
    hub.flush_actions()
    c.actions()
    c.send(step)
    c.actions()
    c.send(step)
    first, second = store.take()[DEFAULT_POLICY]
    assert first.lengths.tolist() == [1, 1, 2] and not first.state_in.any()   # every chunk from zeros
    assert second.lengths.tolist() == [2, 2]
    np.testing.assert_allclose(second.state_in, carried)   # continuation chunks carry the slot's state


# ------------------------------------------------------------- over TCP, a real run

def raw_client(port: int, codec: str, k: int) -> tuple[socket.socket, dict]:
    """A server-inference client on a raw socket, after its handshake: (socket, SET_CONFIG)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    ping = {"type": "PING", "inference": "server", **({"codecs": ["binary"]} if codec == "binary" else {})}
    sock.sendall(rllink.frame(rllink.encode_json(ping)))
    pong = rllink.decode_reply(recv_frame(sock)[8:])
    assert pong["inference"] == "server" and pong.get("codec", "json") == codec
    sock.sendall(rllink.frame(rllink.encode_json({"type": "GET_CONFIG"})))
    return sock, rllink.decode_reply(recv_frame(sock)[8:])


def act_loop(sock, codec: str, k: int, steps: int, seed: int = 0) -> list[int]:
    """Step K CartPoles with the server's actions for ``steps`` ACTs; returns each reply's version."""
    envs = make_vec_env("CartPole-v1", k, seed)
    msg, versions = {"type": "ACT", "obs": envs.reset()}, []
    for _ in range(steps):
        sock.sendall(rllink.frame(rllink.encode(msg, codec)))
        reply = rllink.decode_reply(recv_frame(sock)[8:])
        assert reply["type"] == "ACTIONS" and reply["actions"].shape == (k,)
        versions.append(reply["weights_seq_no"])
        obs, rewards, term, trunc, final = envs.step(reply["actions"].tolist())
        msg = {"type": "ACT", "obs": obs, "rewards": np.asarray(rewards, np.float32),
               "terminateds": np.asarray(term, bool), "truncateds": np.asarray(trunc, bool)}
        if final is not None and np.any(trunc):
            msg["final_obs"] = final
    return versions


@pytest.mark.parametrize("codec", ["json", "binary"])
def test_raw_socket_clients_train_a_run(start_run, tmp_path, codec):
    run = start_run("--env", "CartPole-v1", "--sims", 0, "--tcp-port", 0, "--env-steps-per-sample", 64,
                    "--train-batch-size", 128, "--logdir", tmp_path / "run")
    port = run.tcp_port()
    sock, config = raw_client(port, codec, 2)
    assert config["action_space"] == {"type": "Discrete", "n": 2} and config["observation_shape"] == [4]
    bad, _ = raw_client(port, codec, 1)
    bad.sendall(rllink.frame(rllink.encode_json({"type": "ACT", "obs": [[0.0] * 4], "rewards": [1.0],
                                                 "terminateds": [False], "truncateds": [False]})))
    assert read_to_eof(bad) == b""    # closed, with the reason in the run's log
    versions = act_loop(sock, codec, 2, 32 * 5)   # 5 samples of 64 env steps
    assert versions == sorted(versions) and versions[-1] >= versions[0] + 3   # strict on-policy: a new one each
    run.wait_until(lambda out: "update    3" in out, 30, "the third update")
    assert "the first ACT of a connection carries no 'rewards'" in run.output()


# ------------------------------------------------------------- shmrl.sim --server-inference

def test_the_python_client_refuses_a_server_that_does_not_serve_actions():
    class RLlibLike:   # answers PING as RLlib's server (and an older shmrl) does
        def request(self, msg):
            return {"type": "PONG"}

    with pytest.raises(ConnectionError, match="does not serve actions"):
        run_server_inference(RLlibLike())


def test_the_python_client_steps_with_the_servers_actions(start_run, tmp_path):
    run = start_run("--env", "CartPole-v1", "--sims", 0, "--tcp-port", 0, "--env-steps-per-sample", 64,
                    "--train-batch-size", 128, "--logdir", tmp_path / "run")
    client = TcpClient("127.0.0.1", run.tcp_port(), timeout=30, codec="binary")
    try:
        assert run_server_inference(client, "CartPole-v1", envs_per_sim=4, max_messages=100) == 400
    finally:
        client.close()
    run.wait_until(lambda out: "update    2" in out, 30, "the second update")


@pytest.mark.slow
def test_server_inference_clients_solve_cartpole(start_run, tmp_path):
    """CartPole to a 100-episode mean of 475 trained only through `python -m shmrl.sim
    --server-inference` clients (4 processes x 4 envs) on a run with no simulators."""
    run = start_run("--env", "CartPole-v1", "--sims", 0, "--tcp-port", 0, "--logdir", tmp_path / "run")
    port = run.tcp_port()
    clients = [subprocess.Popen([sys.executable, "-m", "shmrl.sim", "--connect", f"127.0.0.1:{port}",
                                 "--server-inference", "--envs-per-sim", "4", "--seed", str(i)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(4)]
    try:
        run.wait_for("solved: return", 240)
        assert run.proc.wait(30) == 0
    finally:
        for p in clients:
            p.kill()
            p.wait(10)


def test_box_actions_are_served_unclipped_and_reach_the_store():
    spec = env_spec("Pendulum-v1")
    hub, store = make_hub(steps=4, spec=spec)
    c = Client(hub, codec="binary")
    obs = np.zeros((2, *spec.obs_shape), np.float32)
    c.send({"type": "ACT", "obs": obs})
    for _ in range(2):
        reply = c.actions()
        assert reply["actions"].dtype == np.float32 and reply["actions"].shape == (2, 1)
        c.send({"type": "ACT", "obs": obs, "rewards": np.full(2, -1.0, np.float32), "terminateds": np.zeros(2, bool),
                "truncateds": np.zeros(2, bool)})
    (batch,) = store.take()[DEFAULT_POLICY]
    assert batch.actions.shape == (4, 1) and batch.num_chunks == 2 and not c.dropped()


@pytest.mark.parametrize("codec", ["json", "binary"])
def test_dict_observations_with_an_action_mask(codec):
    """A Dict observation (an image, nested leaves, an action mask): ACT carries it as an
    object of arrays by leaf (binary) or one object per env (JSON); the served actions keep
    to each env's mask, and the steps reach the store."""
    from test_spaces import ROBOT_OBS, random_obs, robot_spec

    spec = robot_spec()
    hub, store = make_hub(steps=4, spec=spec)
    assert set(hub.config_msg["observation_leaves"]) == {"camera", "state.joints", "state.mode", "buttons",
                                                         "action_mask"}
    rng = np.random.default_rng(0)

    def wire(obs):   # the JSON form: one object per env
        return obs if codec == "binary" else [{k: v[i].tolist() for k, v in obs.items()} for i in range(2)]

    c = Client(hub, codec=codec)
    obs = random_obs(ROBOT_OBS, rng, 2)
    c.send({"type": "ACT", "obs": wire(obs)})
    for _ in range(2):
        reply = c.actions()
        assert obs["action_mask"][np.arange(2), reply["actions"]].all()   # never a forbidden move
        obs = random_obs(ROBOT_OBS, rng, 2)
        c.send({"type": "ACT", "obs": wire(obs), "rewards": np.full(2, 0.5, np.float32),
                "terminateds": np.zeros(2, bool), "truncateds": np.zeros(2, bool)})
    (batch,) = store.take()[DEFAULT_POLICY]
    assert batch.num_steps == 4 and batch.obs["camera"].dtype == np.uint8 and not c.dropped()


def test_a_held_act_is_not_taken_for_a_silent_client(net):
    """A binary client owes heartbeats, but not while its ACT waits for new weights: the
    server owes it the reply."""
    server = net.server(heartbeat_s=0.1, heartbeat_timeout=0.5)
    loop = net.hub(server, auto_publish=False, onnx_file=model_file())   # 8 env steps per sample
    sock = net.raw(server)
    sock.sendall(rllink.frame(rllink.encode_json({"type": "PING", "inference": "server", "codecs": ["binary"]})))
    assert decode_frame(recv_frame(sock))["heartbeat_s"] == 0.1
    obs = np.zeros((8, 4), np.float32)
    sock.sendall(rllink.frame(rllink.encode_binary({"type": "ACT", "obs": obs})))
    assert rllink.validate(decode_frame(recv_frame(sock)), "reply")["weights_seq_no"] == 1
    sock.sendall(rllink.frame(rllink.encode_binary({"type": "ACT", "obs": obs, "rewards": np.ones(8, np.float32),
                                                    "terminateds": np.zeros(8, bool),
                                                    "truncateds": np.zeros(8, bool)})))
    wait_until(lambda: loop.hub.waiting, 5, "the ACT held")
    time.sleep(1.0)   # twice the heartbeat timeout, in silence
    assert not loop.closed()
    loop.auto_publish = True
    assert rllink.validate(decode_frame(recv_frame(sock)), "reply")["weights_seq_no"] == 2


def test_a_bad_act_counts_its_open_steps_as_lost_not_dropped():
    hub, store = make_hub(steps=8)
    c = Client(hub)
    c.send(act(obs_of(0)))
    c.actions()
    c.send(act(obs_of(1), [1.0, 1.0]))
    c.actions()
    c.send(act(obs_of(2, k=3), [1.0] * 3))   # K changed
    assert c.dropped() and store.steps_lost == 2 and not store.steps_dropped


def test_a_binary_bool_array_holds_only_0_and_1():
    body = bytearray(rllink.encode_binary(act(obs_of(0, k=1), [1.0], [False], [False])))
    rllink.decode_request(bytes(body))
    body[-8] = 2   # the last block: truncateds, one byte, then padding
    with pytest.raises(ProtocolError, match="other than 0 and 1"):
        rllink.decode_request(bytes(body))
