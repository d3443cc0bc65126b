"""The Hub, the episode store and the simulator loop, over the in-process transport."""
import math
import threading

import numpy as np
import pytest

import shmrl
from shmrl.core.episode import Episode, EpisodeBatch
from shmrl.model.net import PolicyNet
from shmrl.config.settings import Config, PPOSettings, with_defaults
from shmrl.model.ppo import PPO
from shmrl.server.serving import Serving
from shmrl.client.action_sampler import ActionSampler
from shmrl.core.spaces import Discrete, action_layout
from shmrl.server.store import DEFAULT_POLICY, EpisodeStore
from shmrl.trainer.loop import UpdateCounts, train_with_servers, update
from shmrl.transport.inproc import InProcServer

from conftest import SPEC, chunk, request_while_serving, serve_until, simulator_threads


def test_store_glues_continuations_by_obs_and_by_id():
    store = EpisodeStore(window=10)

    def add(conn_id, *eps):
        store.add(conn_id, {DEFAULT_POLICY: EpisodeBatch.from_episodes(list(eps))})

    a = chunk(0.0, 3)
    a.id = None
    add("c1", a)                                    # open, no id: glued by its last obs
    b = chunk(3.0, 2, terminated=True)
    b.id = None
    add("c2", b)                                    # other connection: a separate episode
    assert list(store.returns) == [2.0]
    add("c1", b)                                    # continues a on c1
    assert list(store.returns) == [2.0, 5.0] and list(store.lengths) == [2, 5]
    add("c1", chunk(0.0, 4, id="e1"), chunk(60.0, 2, id="e3"))
    add("c1", chunk(50.0, 1, id="e1", truncated=True))   # glued by id, obs need not match
    assert list(store.returns)[-1] == 5.0
    add("c1", chunk(62.0, 0, id="e3"))              # an empty continuation keeps e3 open
    add("c1", chunk(62.0, 1, id="e3", terminated=True))
    assert list(store.returns)[-1] == 3.0 and list(store.lengths)[-1] == 3
    add("c1", chunk(0.0, 4, id="e2"))
    store.forget("c1")                              # c1 closed: e2 can no longer complete
    add("c1", chunk(4.0, 1, id="e2", terminated=True))
    assert list(store.returns)[-1] == 1.0
    steps = 3 + 2 + 2 + 4 + 2 + 1 + 1 + 4 + 1
    assert store.steps_received == store.pending_steps == steps
    batches = store.take()[DEFAULT_POLICY]
    assert sum(b.num_chunks for b in batches) == 9 and store.pending_steps == 0 and store.in_flight == steps
    assert store.steps_trained == 0                 # the learner counts them once its update is done


def test_store_drops_stale_chunks_and_takes_the_oldest_first():
    store = EpisodeStore()
    old, new = chunk(0.0, 5, id="a"), chunk(10.0, 7, id="b")
    old.weights_seq_no, new.weights_seq_no = 1, 4
    unknown = chunk(20.0, 3, id="c")               # no version (RLlib's client): counts as current
    store.add("c", {DEFAULT_POLICY: EpisodeBatch.from_episodes([old, new, unknown])})
    store.add("c", {DEFAULT_POLICY: EpisodeBatch.from_episodes([chunk(30.0, 6, id="d")])})
    first = store.take(version=4, max_lag=2, max_steps=5)[DEFAULT_POLICY]
    assert [b.chunk(i).id for b in first for i in range(b.num_chunks)] == ["b", "c"]
    assert store.steps_dropped == {"stale": 5} and store.pending_steps == 6
    kept = first[0].chunk(0)
    np.testing.assert_array_equal(kept.obs, new.obs)  # the chunk that stayed is whole
    assert store.steps_received == store.in_flight + store.pending_steps + 5


def truncated_episodes(count: int, length: int, reward: float) -> EpisodeBatch:
    """``count`` CartPole episodes of ``length`` steps of ``reward`` each, truncated."""
    eps = []
    for i in range(count):
        ep = Episode(np.full(4, 0.01 * i, np.float32), id=f"e{i}")
        for t in range(length):
            ep.add_step(0, reward, np.full(4, 0.01 * i, np.float32), np.zeros(2, np.float32), -0.7,
                        truncated=t == length - 1)
        eps.append(ep.finalize())
    return EpisodeBatch.from_episodes(eps)


def test_one_step_truncated_episodes_cannot_fake_solved(learner_and_server):
    """A truncated episode completes one (a return in the window "solved" is judged on) only
    at the env's time limit (CartPole's 500 steps): 100 one-step episodes at the best return
    are trained on and complete nothing; terminated ones count at any length."""
    learner, _, _ = learner_and_server
    store = learner.store
    store.add("c", {DEFAULT_POLICY: truncated_episodes(100, 1, 500.0)})
    store.add("c", {DEFAULT_POLICY: truncated_episodes(10, 499, 1.0)})
    assert store.steps_received == 100 + 4990 and store.pending_steps == 5090   # their steps are trained on
    assert store.episodes_completed == 0 and list(store.returns) == [] and math.isnan(store.return_mean())
    store.add("c", {DEFAULT_POLICY: truncated_episodes(2, 500, 1.0)})         # at the time limit: complete
    store.add("c", {DEFAULT_POLICY: EpisodeBatch.from_episodes([chunk(0.5, 1, terminated=True)])})
    assert list(store.returns) == [500.0, 500.0, 1.0] and store.episodes_completed == 3


def test_without_a_known_time_limit_a_truncated_episode_needs_two_steps():
    store = EpisodeStore(window=100)
    store.add("c", {DEFAULT_POLICY: truncated_episodes(100, 1, 500.0)})
    assert store.episodes_completed == 0 and list(store.returns) == []
    store.add("c", {DEFAULT_POLICY: truncated_episodes(3, 2, 1.0)})
    assert list(store.returns) == [2.0, 2.0, 2.0]


@pytest.fixture
def learner_and_server():
    server = InProcServer()
    ppo = PPO(PolicyNet(SPEC, 64), with_defaults(PPOSettings, epochs=2, minibatch_size=64))
    learner = Serving([server], Config(env_steps_per_sample=32, train_batch_size=64), {DEFAULT_POLICY: SPEC},
                      {DEFAULT_POLICY: ppo.net.template}, {DEFAULT_POLICY: ppo.published_weights()})
    yield learner, server, ppo
    learner.stop()
    server.close()


def test_handshake_and_on_policy_wait(learner_and_server):
    learner, server, ppo = learner_and_server
    client = server.connect(timeout=5)
    replies = {}

    def talk():
        replies["pong"] = client.request({"type": "PING"})
        replies["config"] = client.request({"type": "GET_CONFIG"})
        replies["state"] = client.request({"type": "GET_STATE"})
        ep = chunk(0.0, 32)
        replies["next"] = client.request({"type": "EPISODES_AND_GET_STATE",
                                          "episodes": [ep.to_rllink()], "timesteps": 32})

    t = threading.Thread(target=talk, daemon=True)
    t.start()
    serve_until(learner, lambda: "state" in replies, 10, "the handshake's replies")
    # The episodes arrive and are handed over as a batch; the client must wait until an
    # update publishes new weights.
    batches, version = serve_until(learner, lambda: learner.next_batch(timeout=0), 10, "the episodes as a batch")
    assert "next" not in replies and learner.hub.all_waiting()
    assert sum(b.num_steps for b in batches[DEFAULT_POLICY]) == 32 and version == 1
    update(learner, {DEFAULT_POLICY: ppo}, UpdateCounts(), batches, version)
    serve_until(learner, lambda: "next" in replies, 10, "the new weights")
    t.join(5)
    assert replies["pong"]["type"] == "PONG"
    assert replies["config"] == {"type": "SET_CONFIG", "env_steps_per_sample": 32, "force_on_policy": True,
                                 "observation_shape": [4], "observation_dtype": "<f4",
                                 "action_space": {"type": "Discrete", "n": 2}}
    assert replies["state"]["weights_seq_no"] == 1 and replies["next"]["weights_seq_no"] == 2


@pytest.mark.parametrize("bad, reason", [
    (dict(obs_dim=3), "has shape (3,), the environment's is (4,)"),
    (dict(action=2), "out of range"),
])
def test_episodes_that_do_not_fit_the_env_close_only_that_connection(learner_and_server, bad, reason, caplog):
    learner, server, _ = learner_and_server
    good, evil = server.connect(timeout=5), server.connect(timeout=5)
    closed = request_while_serving(learner, evil, {"type": "EPISODES_AND_GET_STATE", "timesteps": 4,
                                                   "episodes": [chunk(0.0, 4, **bad).to_rllink()]},
                                   what="the bad client closed")
    assert isinstance(closed, ConnectionError), closed
    store = learner.store   # counted as received and dropped, never trained on
    assert reason in caplog.text and store.pending_steps == 0 and store.steps_received == 4
    assert store.steps_dropped == {"does not fit the environment": 4}
    pong = request_while_serving(learner, good, {"type": "PING"}, what="the good client's PONG")
    assert pong["type"] == "PONG"


def test_simulator_loop_learns_in_process(tmp_path):
    """Simulators in threads behind the in-process transport, trained by shmrl's own loop
    (train_with_servers): the return climbs well above random (~22)."""
    server = InProcServer()
    threads = simulator_threads(server)
    try:
        config = shmrl.Config(sims=0, seed=0, hidden=64, lr=3e-3, epochs=6, minibatch_size=256, train_batch_size=512,
                              env_steps_per_sample=256, max_env_steps=30 * 512 + 1, stop_return=math.inf,
                              torch_threads=1, tensorboard=False, logdir=str(tmp_path), log_every=0)
        status, summary = train_with_servers(config, [server])   # closes the server when done
    finally:
        server.close()
        for t in threads:
            t.join(10)
    assert status == 1 and summary["updates"] == 30 and summary["error"] is None   # the step budget
    assert summary["return_mean"] > 100
    assert not any(t.is_alive() for t in threads)


def test_sampler_matches_softmax_probabilities_and_logp():
    sampler = ActionSampler(action_layout(Discrete(3)), np.random.default_rng(0))
    logits = np.array([[0.0, 1.0, -1.0]], np.float32)
    p = np.exp(logits[0]) / np.exp(logits[0]).sum()
    counts = np.zeros(3)
    for _ in range(20000):
        (a,), (logp,) = sampler.sample(logits)
        counts[a] += 1
        assert abs(logp - np.log(p[a])) < 1e-5
    np.testing.assert_allclose(counts / counts.sum(), p, atol=0.015)
    small = np.tile(logits, (8, 1))             # a few rows: the plain-Python path, row by row
    draws = [sampler.sample(small) for _ in range(2500)]
    actions = np.concatenate([a for a, _ in draws])
    np.testing.assert_allclose(np.bincount(actions, minlength=3) / len(actions), p, atol=0.015)
    np.testing.assert_allclose(np.concatenate([lp for _, lp in draws]), np.log(p[actions]), atol=1e-5)
    batch = np.tile(logits, (4000, 1))          # the batched (Gumbel-max) path
    actions, logps = sampler.sample(batch)
    np.testing.assert_allclose(np.bincount(actions, minlength=3) / 4000, p, atol=0.03)
    np.testing.assert_allclose(logps, np.log(p[actions]), atol=1e-5)
