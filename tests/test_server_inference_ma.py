"""Server-side inference for many agents (docs/RLLINK.md §11.3): the multi-agent ACT and
ACTIONS validated in both codecs; the Hub of a multi-agent run granting it, keeping each
(connection, env, agent) trajectory (rewards to the right agent, summed until its step
ends), one forward pass per policy a round, bad ACTs closing only their connection; the
Python client playing turn-based and parallel PettingZoo envs through it; and (slow) a run
with no simulators learning from such clients alone."""
from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from broken_client import MA_BUGS
from conftest import FakeServer, conn_id_of, need, read_to_eof, recv_frame, wait_until
need("pettingzoo", "pettingzoo")
from shmrl.checker.session import check_client  # noqa: E402
from shmrl import rllink  # noqa: E402
from shmrl.envs.make import env_spec  # noqa: E402
from shmrl.envs.spec import policy_mapper  # noqa: E402
from shmrl.server.hub import Hub  # noqa: E402
from shmrl.client.multi_agent import act_loop  # noqa: E402
from shmrl.model.net import PolicyNet  # noqa: E402
from shmrl.onnxio.policy import encode_onnx_file  # noqa: E402
from shmrl.rllink import ProtocolError  # noqa: E402
from shmrl.client.simulator import run_server_inference  # noqa: E402
from shmrl.server.store import EpisodeStore  # noqa: E402
from shmrl.transport.tcp_client import TcpClient  # noqa: E402

C4 = "pz:connect_four_v3"
SPREAD = "pz:simple_spread_v3"


def make_hub(env=C4, policy_map="shared", steps=8, on_policy=False, league=None):
    """A multi-agent run's Hub with first weights published (and ``league``: snapshot ids)."""
    spec = env_spec(env)
    specs = spec.policy_specs(policy_mapper(policy_map))
    store = EpisodeStore(specs)
    hub = Hub(specs, store, env_steps_per_sample=steps, on_policy=on_policy,
              max_pending_steps=None if on_policy else 10 ** 6, multiagent=True, agents=spec.agents,
              extra_config={"policy_map": policy_map, "league_prob": 1.0 if league else 0.0})
    policies = {}
    for i, pid in enumerate(specs):
        net = PolicyNet(specs[pid], 16, "Tanh", layers=1)
        policies[pid] = {"onnx_file": encode_onnx_file(net.template.publish(net.initial_weights(i))),
                         "weights_seq_no": 1}
        for snap in league or ():
            policies[snap] = {**policies[pid], "frozen": True}
    hub.set_state(1, policies)
    return hub, store


class Client:
    """One connection to a Hub, through the codec as on the wire (``request`` answers as a
    transport client would, for ``act_loop``)."""

    def __init__(self, hub, conn_id="tcp:m0", server=None, codec="json", ping=True):
        self.hub, self.conn_id, self.server, self.codec = hub, conn_id, server or FakeServer(), codec
        if ping:
            assert self.request({"type": "PING", "inference": "server"}) == {"type": "PONG", "inference": "server"}

    def send(self, msg, flush=True) -> None:
        self.hub.handle(self.server, self.conn_id, rllink.decode_request(rllink.encode(msg, self.codec)))
        if flush:
            self.hub.flush_actions()

    def reply(self):
        mine = [m for c, m in self.server.replies if c == self.conn_id]
        self.server.replies = [(c, m) for c, m in self.server.replies if c != self.conn_id]
        assert len(mine) <= 1, mine
        return rllink.decode_reply(rllink.encode(mine[0], self.codec)) if mine else None

    def request(self, msg):
        self.send(msg)
        assert not self.dropped(), self.dropped()
        return self.reply()

    def dropped(self) -> list[str]:
        return [why for c, why in self.server.dropped if c == self.conn_id]


def board(mask=(1,) * 7, mark=0):
    """A connect_four observation (``mark``: a recognizable cell)."""
    obs = np.zeros((6, 7, 2), np.uint8)
    obs[0, 0, 0] = mark
    return {"observation": obs.tolist(), "action_mask": list(mask)}


# ------------------------------------------------------------- the wire

def test_multiagent_act_and_actions_validate_in_both_codecs():
    msg = {"type": "ACT", "envs": [
        {"obs": {"player_1": board(mark=1)}, "rewards": {"player_0": 0.5, "player_1": 0}},
        {"obs": {"player_0": board()}, "rewards": {"player_0": 1.0, "player_1": -1.0},
         "terminateds": {"player_0": True, "player_1": True}, "reset": True}]}
    for codec in ("json", "binary"):
        out = rllink.decode_request(rllink.encode(msg, codec))
        first, second = out["envs"]
        assert first["obs"]["player_1"]["observation"].shape == (1, 6, 7, 2)
        assert first["obs"]["player_1"]["observation"][0, 0, 0, 0] == 1
        assert first["rewards"] == {"player_0": 0.5, "player_1": 0.0} and first["outcome"] and not first["reset"]
        assert second["terminateds"] == {"player_0": True, "player_1": True} and second["reset"]
        actions = rllink.decode_reply(rllink.encode({"type": "ACTIONS", "actions": [{"player_1": 3}, {"player_0": 6}],
                                                     "weights_seq_no": 2}, codec))
        assert [{a: int(v) for a, v in env.items()} for env in actions["actions"]] == [{"player_1": 3}, {"player_0": 6}]
        assert actions["weights_seq_no"] == 2
    first = rllink.decode_request(rllink.encode_json({"type": "ACT", "envs": [{"obs": {"agent_0": [0.5] * 18}}]}))
    assert first["envs"][0]["obs"]["agent_0"].shape == (1, 18) and not first["envs"][0]["outcome"]


OBS = {"a": [0.0, 1.0]}


@pytest.mark.parametrize("msg, match", [
    ({"type": "ACT", "envs": []}, "1 to 4096 env objects"),
    ({"type": "ACT", "envs": {"obs": OBS}}, "list of 1 to 4096"),
    ({"type": "ACT", "envs": [{"obs": OBS}], "obs": [[0.0]]}, "beside 'envs'"),
    ({"type": "ACT", "envs": [[0.0]]}, "not an object"),
    ({"type": "ACT", "envs": [{"rewards": {}}]}, "missing field 'obs'"),
    ({"type": "ACT", "envs": [{"obs": {}}]}, "'obs' is empty"),
    ({"type": "ACT", "envs": [{"obs": OBS, "agent_ids": ["a"]}]}, "unexpected field"),
    ({"type": "ACT", "envs": [{"obs": OBS, "terminateds": {"a": True}}]}, "without 'rewards'"),
    ({"type": "ACT", "envs": [{"obs": OBS, "rewards": {"a": True}}]}, "a reward must be a number"),
    ({"type": "ACT", "envs": [{"obs": OBS, "rewards": {"a": 1e39}}]}, "non-finite reward"),
    ({"type": "ACT", "envs": [{"obs": OBS, "rewards": {"a": 10 ** 400}}]}, "non-finite reward"),
    ({"type": "ACT", "envs": [{"obs": OBS, "rewards": {"a": 1}, "truncateds": {"a": 1}}]}, "true or false"),
    ({"type": "ACT", "envs": [{"obs": {"a": [float("nan")]}}]}, "non-finite"),
    ({"type": "ACT", "envs": [{"obs": {"": [0.0]}}]}, "not a short string"),
    ({"type": "ACT", "envs": [{"obs": OBS, "rewards": {}, "truncateds": {"b": True}}]}, "no 'final_obs'"),
    ({"type": "ACT", "envs": [{"obs": OBS, "rewards": {}, "terminateds": {"a": True}}]}, "without 'reset'"),
    ({"type": "ACT", "envs": [{"obs": OBS, "rewards": {}, "reset": 1}]}, "'reset' must be true or false"),
    ({"type": "ACT", "envs": [{"obs": {f"a{i}": [0.0] for i in range(4097)}}]}, "more than 4096 observations"),
])
def test_bad_multiagent_acts_are_refused_with_the_reason(msg, match):
    with pytest.raises(ProtocolError, match=match):
        rllink.validate(msg, "request")


def test_bad_multiagent_actions_are_refused():
    with pytest.raises(ProtocolError, match="object agent -> action"):
        rllink.validate({"type": "ACTIONS", "actions": [{"a": 1}, {}], "weights_seq_no": 1}, "reply")
    with pytest.raises(ProtocolError, match="ACTIONS"):
        rllink.validate({"type": "ACTIONS", "actions": [{"a": "left"}], "weights_seq_no": 1}, "reply")
    with pytest.raises(ProtocolError, match="missing field 'weights_seq_no'"):
        rllink.validate({"type": "ACTIONS", "actions": [{"a": 1}]}, "reply")


# ------------------------------------------------------------- the Hub

def test_a_multiagent_run_grants_it_and_describes_every_agents_spaces():
    hub, _ = make_hub()
    c = Client(hub)   # PONG with "inference": "server"
    config = c.request({"type": "GET_CONFIG"})
    assert sorted(config["agent_spaces"]) == ["player_0", "player_1"]
    assert config["agent_spaces"]["player_0"] == {
        "observation_leaves": {"observation": {"shape": [6, 7, 2], "dtype": "|u1"},
                               "action_mask": {"shape": [7], "dtype": "|u1"}},
        "action_space": {"type": "Discrete", "n": 7}}
    assert config["policy_map"] == "shared"
    plain = Client(hub, "tcp:plain", c.server, ping=False)
    assert plain.request({"type": "PING"}) == {"type": "PONG"}   # a client that does not ask: as before


def test_rewards_reach_the_right_agents_trajectory_summed_until_its_step_ends():
    """A scripted connect_four game in env 0: what each player got reaches its own chunk,
    a reward given between an agent's actions is added to its step, the game's end goes to
    both, and env 1 (still playing) carries on after the reset of env 0."""
    hub, store = make_hub(steps=5)   # the agent steps that end in these 4 ACTs
    c = Client(hub)
    acts = []

    def step(envs):
        reply = c.request({"type": "ACT", "envs": envs})
        acts.append(reply["actions"])
        return reply

    step([{"obs": {"player_0": board(mark=1)}}, {"obs": {"player_0": board(mark=1)}}])
    step([{"obs": {"player_1": board(mark=2)}, "rewards": {"player_1": 0.25}},   # p1's before it acted: nobody's
          {"obs": {"player_1": board(mark=2)}, "rewards": {}}])
    step([{"obs": {"player_0": board(mark=3)}, "rewards": {"player_1": 0.5}},    # p1's step still open: owed
          {"obs": {"player_0": board(mark=3)}, "rewards": {"player_0": 0.125}}])
    # env 0: p0 wins with its second move; both players' steps end there; the env resets
    step([{"obs": {"player_0": board(mark=9)}, "rewards": {"player_0": 1.0, "player_1": -1.0},
           "terminateds": {"player_0": True, "player_1": True}, "reset": True},
          {"obs": {"player_1": board(mark=4)}, "rewards": {}}])
    chunks = store.take()["shared"]
    by_agent = {}
    for batch in chunks:
        for i, agent in enumerate(batch.agent_ids):
            start = int(batch.lengths[:i].sum())
            by_agent.setdefault((batch.episode_ids[i], agent), []).append(
                (batch.rewards[start:start + batch.lengths[i]].tolist(), bool(batch.is_terminated[i])))
    env0 = {agent: steps for (eid, agent), steps in by_agent.items() if steps[-1][1]}
    assert env0 == {"player_0": [([0.0, 1.0], True)], "player_1": [([-0.5], True)]}   # 0.5 owed + -1.0 at the end
    running = {agent: steps for (eid, agent), steps in by_agent.items() if not steps[-1][1]}
    assert running == {"player_0": [([0.125], False)], "player_1": [([0.0], False)]}
    assert [sorted(env) for env in acts[-1]] == [["player_0"], ["player_1"]]


def _play(hub, env, k, messages, codec="json", conn_id="tcp:m0", server=None):
    c = Client(hub, conn_id, server, codec)
    return act_loop(c, c.request({"type": "GET_CONFIG"}), env, seed=1, num_envs=k, max_messages=messages)


@pytest.mark.parametrize("codec", ["json", "binary"])
def test_a_turn_based_game_plays_through_it(codec):
    hub, store = make_hub(steps=64)
    assert _play(hub, C4, 4, 200, codec) == 800
    chunks = store.take()["shared"]
    steps = sum(b.num_steps for b in chunks)
    assert steps >= 700 and {a for b in chunks for a in b.agent_ids} == {"player_0", "player_1"}
    ended = np.concatenate([b.is_terminated for b in chunks])
    last = np.concatenate([b.rewards[np.cumsum(b.lengths) - 1] for b in chunks])[ended]
    assert ended.sum() >= 20 and set(last.tolist()) <= {-1.0, 0.0, 1.0} and last.sum() == 0   # zero-sum games
    assert hub.inference.forward_passes == 200   # one per ACT: one policy, one round each


@pytest.mark.parametrize("codec", ["json", "binary"])
def test_a_parallel_env_plays_through_it(codec):
    need("mpe2", "mpe2")
    hub, store = make_hub(SPREAD, steps=75)
    assert _play(hub, SPREAD, 2, 60, codec) == 360     # 3 agents x 2 envs x 60 steps
    chunks = store.take()["shared"]
    assert sum(b.num_steps for b in chunks) == 312      # 59 ACTs of 6 agent steps: 4 samples of 13 ACTs (78)
    truncated = np.concatenate([b.is_truncated for b in chunks])
    assert truncated.sum() == 12 and (np.concatenate([b.rewards for b in chunks]) < 0).all()   # 2 episodes x 2 envs


def test_one_forward_pass_per_policy_a_round_over_every_connection():
    need("mpe2", "mpe2")
    hub, store = make_hub(SPREAD, policy_map="per-agent", steps=1000)
    server = FakeServer()
    clients = [Client(hub, f"tcp:m{i}", server) for i in range(2)]
    obs = {f"agent_{i}": [0.5] * 18 for i in range(3)}
    for c in clients:
        c.send({"type": "ACT", "envs": [{"obs": obs}, {"obs": obs}]}, flush=False)
    hub.flush_actions()
    assert hub.inference.forward_passes == 3 and hub.inference.rows == 12   # 3 policies, 2 x 2 x 3 rows
    for c in clients:
        assert sorted(c.reply()["actions"][1]) == ["agent_0", "agent_1", "agent_2"]


def test_a_league_snapshot_plays_one_agent_and_its_steps_are_not_sent():
    hub, store = make_hub(steps=8, league=["shared@1"])   # league_prob 1: every episode has one snapshot
    c = Client(hub)
    act_loop(c, c.request({"type": "GET_CONFIG"}), C4, seed=2, num_envs=2, max_messages=100)
    sampler = hub.inference.slots[c.conn_id].sampler
    assert all(sorted(a.values()) == ["shared", "shared@1"] for a in sampler.assigned)
    chunks = store.take()
    assert list(chunks) == ["shared"] and sum(b.num_steps for b in chunks["shared"]) < 150   # about half


FIRST = {"type": "ACT", "envs": [{"obs": {"player_0": board()}}]}
NEXT = {"type": "ACT", "envs": [{"obs": {"player_1": board()}, "rewards": {}}]}


@pytest.mark.parametrize("case, msgs, match", [
    ("rewards first", [{"type": "ACT", "envs": [{"obs": {"player_0": board()}, "rewards": {}}]}],
     "first ACT of a connection carries no 'rewards'"),
    ("K changed", [FIRST, {"type": "ACT", "envs": [NEXT["envs"][0]] * 2}], "K is fixed"),
    ("no rewards", [FIRST, FIRST], "without 'rewards' after the connection's first"),
    ("unknown agent", [{"type": "ACT", "envs": [{"obs": {"player_7": board()}}]}], "not the env's"),
    ("obs misfit", [{"type": "ACT", "envs": [{"obs": {"player_0": {"observation": [0.0] * 3,
                                                                    "action_mask": [1] * 7}}}]}], "shape"),
    ("every action masked", [{"type": "ACT", "envs": [{"obs": {"player_0": board(mask=(0,) * 7)}}]}],
     "allows no action"),
    ("single-agent form", [{"type": "ACT", "obs": [[0.0] * 4]}], "single-agent ACT"),
])
def test_a_bad_multiagent_act_closes_only_its_connection(case, msgs, match):
    hub, store = make_hub()
    good = Client(hub, "tcp:good")
    good.send(FIRST)
    assert list(good.reply()["actions"][0]) == ["player_0"]
    bad = Client(hub, "tcp:bad", good.server)
    for msg in msgs:
        bad.send(msg)
        bad.reply()
    assert len(bad.dropped()) == 1 and match in bad.dropped()[0], bad.dropped()
    assert "tcp:bad" not in hub.inference.slots
    good.send(NEXT)
    assert not good.dropped() and list(good.reply()["actions"][0]) == ["player_1"]


def test_an_act_before_its_actions_and_a_multiagent_act_in_a_single_agent_run_are_refused():
    hub, _ = make_hub(on_policy=False)
    c = Client(hub)
    c.send(FIRST, flush=False)
    c.send(NEXT)
    assert "one ACT at a time" in c.dropped()[0]
    single = Hub({"default": env_spec("CartPole-v1")}, EpisodeStore(), env_steps_per_sample=8)
    s = Client(single, "tcp:s")
    s.send({"type": "ACT", "envs": [{"obs": {"a": [0.0] * 4}}]})
    assert "multi-agent ACT ('envs') in a single-agent run" in s.dropped()[0]


def test_an_agent_that_ended_may_not_act_again_before_its_envs_reset():
    """§11.3: an agent's episode ends once. One terminated in an ACT that acts in the next
    without 'reset' closes its connection, with the reason; after a reset it may act."""
    hub, _ = make_hub()
    ended = {"type": "ACT", "envs": [{"obs": {"player_1": board()}, "rewards": {}, "terminateds": {"player_0": True}}]}
    again = {"type": "ACT", "envs": [{"obs": {"player_0": board()}, "rewards": {}}]}
    good = Client(hub, "tcp:good")
    for msg in (FIRST, ended, {**again, "envs": [{**again["envs"][0], "reset": True}]}, NEXT):
        assert good.request(msg)["actions"], msg
    bad = Client(hub, "tcp:bad", good.server)
    bad.request(FIRST)
    bad.request(ended)
    bad.send(again)
    assert bad.reply() is None and len(bad.dropped()) == 1, bad.dropped()
    assert "env 0: agents ['player_0'] act again after their episode ended" in bad.dropped()[0]
    assert "tcp:bad" not in hub.inference.slots and not good.dropped()


def test_an_act_beyond_the_largest_of_the_env_is_refused_from_its_header():
    """The largest ACT of connect_four within rllink's limits (4096 envs, every agent's reward
    and flags) fits the bound of a client granted server-side inference, in both codecs; a
    frame over it is refused from its first bytes, never read nor decoded; a client that did
    not ask, or whose PONG did not grant it, keeps the bounds of every client."""
    from shmrl.server.serving import act_limits
    from shmrl.transport.tcp import TcpServer

    spec = env_spec(C4)
    limits = act_limits(spec)
    leaves = spec.agent_specs[spec.agents[0]].obs.leaves
    env = {"rewards": {"player_0": -1.2345678901234567e-05, "player_1": -1.1754943508222875e-38},
           "terminateds": {"player_0": True, "player_1": True}, "reset": True}
    arrays = {leaf.name: np.ones(leaf.shape, leaf.dtype) for leaf in leaves}   # binary: the leaves' dtypes
    for codec, obs, bound in (("json", board(mark=1), limits.json), ("binary", arrays, limits.binary)):
        body = rllink.encode({"type": "ACT", "envs": [{"obs": {"player_0": obs}, **env}] * 4096}, codec)
        assert len(rllink.decode_request(body)["envs"]) == 4096 and len(body) <= bound, (codec, len(body), bound)
    assert limits.json < 42_000_000 // 4   # the hostile ACT of 100,000 made-up agents: far over it
    server = TcpServer("127.0.0.1", 0, act_limits=limits, frame_timeout=60)
    socks = [socket.create_connection(server.address, timeout=10) for _ in range(3)]
    try:
        asked, declined, unasked = socks
        for sock in socks:
            ping = {"type": "PING", **({"inference": "server"} if sock is not unasked else {})}
            sock.sendall(rllink.frame(rllink.encode_json(ping)))
            wait_until(lambda: server.poll(0.05), 10, "the PING")
            server.reply(conn_id_of(sock), {"type": "PONG", **({"inference": "server"} if sock is asked else {})})
            recv_frame(sock)
        for sock in socks:   # the first bytes of an ACT 1 byte over the bound
            sock.sendall(b"%08d" % (limits.json + 1) + b'{"type": "ACT", "envs": [')
        assert wait_until(lambda: server.poll(0.05), 10, "the refusal") == [(conn_id_of(asked), None)]
        assert server.frames_rejected == 1 and not server.poll(0.5)   # the others wait for the rest
    finally:
        for sock in socks:
            sock.close()
        server.close()


def test_a_run_refuses_the_42_mb_act_of_made_up_agents_from_its_header(start_run, tmp_path):
    """The hostile ACT of 100,000 made-up agents, 42 MB of JSON from a client granted
    server-side inference (and within the run's JSON frame limit): its connection is closed
    from the first bytes, none of the rest read (a frame not finished is otherwise waited
    for 10 s), and the next client is served."""
    run = start_run("--env", C4, "--sims", 0, "--tcp-port", 0, "--max-json-frame-bytes", 64 << 20,
                    "--logdir", tmp_path / "run")
    port = run.tcp_port()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(rllink.frame(rllink.encode_json({"type": "PING", "inference": "server"})))
        assert rllink.decode(recv_frame(sock)[8:])["inference"] == "server"
        sock.sendall(b"42000000" + b'{"type": "ACT", "envs": [{"obs": {"agent_000000": {"observation": ')
        assert read_to_eof(sock, timeout=5) == b""
    client = TcpClient("127.0.0.1", port, timeout=10)
    try:
        assert client.request({"type": "PING"})["type"] == "PONG"
    finally:
        client.close()


def test_a_closed_connection_counts_its_open_agent_steps_as_lost():
    hub, store = make_hub(steps=100)
    c = Client(hub)
    c.request(FIRST)
    c.request(NEXT)
    c.request({"type": "ACT", "envs": [{"obs": {"player_0": board()}, "rewards": {}}]})
    hub.handle(c.server, c.conn_id, None)
    assert store.steps_lost == 1 and not hub.inference.slots   # player_0's step ended; player_1's had not


# ------------------------------------------------------------- over TCP, a real run

def test_the_python_client_plays_a_run_over_tcp(start_run, tmp_path):
    run = start_run("--env", C4, "--sims", 0, "--tcp-port", 0, "--env-steps-per-sample", 128,
                    "--train-batch-size", 256, "--logdir", tmp_path / "run")
    client = TcpClient("127.0.0.1", run.tcp_port(), timeout=60, codec="binary")
    try:
        assert run_server_inference(client, C4, envs_per_sim=4, max_messages=200) == 800
    finally:
        client.close()
    run.wait_until(lambda out: "update    2" in out, 60, "the second update")


def test_a_client_of_the_other_kind_of_env_is_told_so():
    hub, _ = make_hub()
    with pytest.raises(ValueError, match="multi-agent env, but CartPole-v1 is single-agent"):
        run_server_inference(Client(hub, ping=False), "CartPole-v1")
    single = Hub({"default": env_spec("CartPole-v1")}, EpisodeStore(), env_steps_per_sample=8)
    with pytest.raises(ValueError, match="server trains a single-agent policy"):
        run_server_inference(Client(single, ping=False), C4)


@pytest.mark.slow
def test_server_inference_clients_alone_train_simple_spread(start_run, tmp_path):
    """simple_spread_v3 (3 agents, one shared policy) to the reference return -22.3
    (docs/MULTIAGENT.md) trained only through 3 `python -m shmrl.sim --server-inference`
    clients of 4 envs each on a run with no simulators."""
    need("mpe2", "mpe2")
    run = start_run("--env", SPREAD, "--sims", 0, "--tcp-port", 0, "--logdir", tmp_path / "run",
                    "--max-env-steps", 400_000)
    port = run.tcp_port()
    clients = [subprocess.Popen([sys.executable, "-m", "shmrl.sim", "--connect", f"127.0.0.1:{port}",
                                 "--server-inference", "--env", SPREAD, "--envs-per-sim", "4", "--seed", str(i)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(3)]
    metrics = tmp_path / "run" / "metrics.jsonl"

    def reached():
        rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        return next((row for row in rows if row.get("return_mean", -99) >= -22.3 and row["env_steps"] > 20_000), None)

    try:
        row = wait_until(reached, 300, "a mean return of -22.3")
        print(f"return_mean {row['return_mean']:.2f} after {row['env_steps']} agent steps, {row['elapsed_s']:.1f} s")
    finally:
        for p in clients:
            p.kill()
            p.wait(10)


# ------------------------------------------------------------- the conformance checker

QUICK = dict(steps=200, hold_s=0.5, timeout=20.0)
BROKEN = Path(__file__).resolve().parent / "broken_client.py"


def check(command, env=C4, **kwargs) -> tuple[list, str]:
    out = io.StringIO()
    violations = check_client([str(c) for c in command], env, out=out, **{**QUICK, **kwargs})
    return violations, out.getvalue()


@pytest.mark.parametrize("env, codec", [(C4, "binary"), (SPREAD, "json")])
def test_the_python_client_conforms(env, codec):
    if env == SPREAD:
        need("mpe2", "mpe2")
    violations, out = check([sys.executable, "-m", "shmrl.sim", "--connect", "127.0.0.1:{port}", "--server-inference",
                             "--env", env, "--envs-per-sim", "2", "--codec", codec], env, reconnect=False)
    assert not violations, out
    assert "100 ACTs of 2 envs checked" in out and "ACT 3: waited 0.5 s" in out, out


def test_a_multiagent_client_with_each_bug_is_caught_under_its_rule():
    from concurrent.futures import ThreadPoolExecutor

    def run(bug):
        return bug, check([sys.executable, BROKEN, "--port", "{port}", "--bug", bug])

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(run, sorted(MA_BUGS)))
    for bug, (violations, out) in results:
        if MA_BUGS[bug] is None:
            assert not violations, f"{bug}:\n{out}"
            assert "connection 2: the first ACT carried no outcome again" in out, out
            continue
        assert violations and MA_BUGS[bug] in violations[0][0], f"{bug}:\n{out}"   # the bug first, then its effects


def test_the_checker_says_it_covers_multiagent_clients_with_server_inference_only():
    violations, out = check([sys.executable, "-m", "shmrl.sim", "--connect", "127.0.0.1:{port}", "--env", C4],
                            reconnect=False)
    assert [rule for rule, _ in violations] == ["RLLINK.md §11 Server-side inference"], out
    assert "server-side inference only" in out


def test_random_sequences_of_acts_close_a_connection_or_are_served_never_crash():
    """Random ACT sequences (agents acting, ending, resets, stray rewards, now and then an
    unknown agent, a wrong observation, K changed) in both codecs and both pacings: each
    ACT is served or closes its connection with a reason; the chunks the server makes of
    them pass the Hub's own checks (none is dropped as not fitting the env)."""
    rng = np.random.default_rng(3)
    agents = ["player_0", "player_1"]

    def env_obj(first: bool) -> dict:
        acting = list(rng.choice(agents + ["player_9"] if rng.random() < 0.01 else agents,
                                 rng.integers(1, 3), replace=False))
        obs = {"observation": [0.0] * 3, "action_mask": [1] * 7} if rng.random() < 0.01 else board()
        env = {"obs": {a: obs for a in acting}}
        if not first:
            env["rewards"] = {a: float(rng.choice([0.0, 1.0, -1.0])) for a in rng.choice(agents, rng.integers(0, 3))}
            if rng.random() < 0.2:
                ended = {a: True for a in rng.choice(agents, rng.integers(1, 3), replace=False)}
                env["terminateds" if rng.random() < 0.5 else "truncateds"] = ended
                env["final_obs"] = {a: board() for a in ended}
                env["reset"] = True
        return env

    served = closed = 0
    for trial in range(60):
        hub, store = make_hub(steps=int(rng.choice([1, 4, 16])), on_policy=bool(trial % 2))
        c = Client(hub, codec=("json", "binary")[trial % 2])
        k = int(rng.integers(1, 4))
        for n in range(25):
            envs = [env_obj(n == 0) for _ in range(k + (rng.random() < 0.005))]
            c.send({"type": "ACT", "envs": envs})
            if hub.waiting:   # a strict on-policy hold: the next version releases it
                hub.set_state(hub.state_msg["weights_seq_no"] + 1, hub.state_msg["policies"])
                hub.flush_actions()
            if c.dropped():
                closed += 1
                break
            assert [sorted(e) for e in c.reply()["actions"]] == [sorted(e["obs"]) for e in envs]
            served += 1
        assert "does not fit the environment" not in store.steps_dropped
    assert served > 500 and closed
