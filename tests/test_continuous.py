"""Continuous actions: the diagonal Gaussian policy (sampler, published ONNX layout, PPO's
log-probabilities), the built-in Pendulum-v1, and a short Pendulum training."""
import math
import statistics
import threading

import numpy as np
import pytest
import torch

import shmrl
from shmrl.core.spaces import Box
from shmrl.envs.builtin import Pendulum
from shmrl.envs.make import env_spec
from shmrl.envs.spec import EnvSpec
from shmrl.core.episode import EpisodeBatch
from shmrl.eval import evaluate
from shmrl.server.serving import Serving
from shmrl.server.store import DEFAULT_POLICY
from shmrl.trainer.loop import UpdateCounts, update
from shmrl.model.net import PolicyNet
from shmrl.onnxio.policy import OnnxPolicy, init_mlp_weights, with_log_std
from shmrl.client.action_sampler import ActionSampler
from shmrl.core.spaces import action_layout
from shmrl.config.settings import Config, PPOSettings, with_defaults
from shmrl.model.ppo import PPO
from shmrl.sim import run_simulator
from shmrl.transport.inproc import InProcServer
from conftest import need, step_beside_gymnasium


# A Box observation of 3 and a Box action of 2 dimensions.
Box2D = EnvSpec("box2d", Box((-1.0,) * 3, (1.0,) * 3, (3,)), Box((-1.0, -1.0), (1.0, 1.0), (2,)))


def gaussian_sampler(d: int, seed: int) -> ActionSampler:
    return ActionSampler(action_layout(Box((-1.0,), (1.0,), (d,))), np.random.default_rng(seed))


def named(mlp: list) -> dict:
    """An MLP's weights (w0, b0, w1, b1, w2, b2) by the names of PolicyNet's graph."""
    return dict(zip(("pi.0.w", "pi.0.b", "pi.1.w", "pi.1.b", "pi.head.w", "pi.head.b"), mlp))


def gaussian_inputs(mean, log_std, rows: int = 1) -> np.ndarray:
    """Policy output 0 for ``rows`` observations: all the means, then all the log-stds."""
    return np.tile(np.concatenate([mean, log_std]).astype(np.float32), (rows, 1))


def test_gaussian_sampler_logp_is_the_normal_density():
    rng = np.random.default_rng(0)
    mean, log_std = rng.normal(size=(500, 3)), rng.uniform(-2.0, 1.0, size=(500, 3))
    inputs = np.concatenate([mean, log_std], axis=1).astype(np.float32)
    actions, logp = gaussian_sampler(3, 1).sample(inputs)
    assert actions.shape == (500, 3) and logp.shape == (500,)
    normal = torch.distributions.Normal(torch.from_numpy(inputs[:, :3]), torch.from_numpy(inputs[:, 3:]).exp())
    expected = normal.log_prob(torch.from_numpy(np.asarray(actions, np.float32))).sum(-1).numpy()
    np.testing.assert_allclose(logp, expected, rtol=1e-5, atol=1e-5)


def test_gaussian_sampler_draws_have_the_policy_mean_and_std():
    mean, std = np.array([0.5, -1.0]), np.array([0.3, 2.0])
    n = 40_000
    actions, _ = gaussian_sampler(2, 2).sample(gaussian_inputs(mean, np.log(std), n))
    # Five standard errors: a wrong mean, a swapped std or std where exp(log_std) belongs fail.
    assert np.all(np.abs(actions.mean(axis=0) - mean) < 5 * std / math.sqrt(n))
    np.testing.assert_allclose(actions.std(axis=0), std, rtol=0.02)
    assert abs(np.corrcoef(actions.T)[0, 1]) < 0.03   # diagonal: independent dimensions


def test_ppo_log_prob_equals_the_logp_sampled_from_its_published_onnx_policy():
    """Two action dimensions, non-trivial means and log-stds: the learner reads the ONNX
    output as [means, log-stds] exactly as the sampler does, so its first ratio is 1."""
    obs_dim, d = 3, 2
    net = PolicyNet(Box2D, 64, "ReLU")
    weights = named(with_log_std(init_mlp_weights([obs_dim, 64, 64, d], 1.0, np.random.default_rng(0)), [-0.5, 0.4]))
    ppo = PPO(net, with_defaults(PPOSettings), initial_weights=weights)
    for name, mine in ppo.published_weights().items():     # what it publishes after an update
        np.testing.assert_array_equal(mine, weights[name])
    policy = OnnxPolicy(net.template.publish(weights))
    obs = np.random.default_rng(1).normal(size=(256, obs_dim)).astype(np.float32)
    out = policy.logits(obs)
    with torch.no_grad():
        mean = ppo.forward(ppo.normalize(obs), values=False)[0]
        np.testing.assert_allclose(out[:, :d], mean.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out[:, d:], np.tile([-0.5, 0.4], (256, 1)), atol=1e-6)  # the log-std rows
    actions, logp = gaussian_sampler(2, 2).sample(out)
    with torch.no_grad():
        learner_logp, _ = ppo.log_prob(mean, torch.from_numpy(np.asarray(actions, np.float32)))
    np.testing.assert_allclose(learner_logp.numpy(), logp, atol=1e-4)


def test_pendulum_simulator_chunks_give_the_learner_a_ratio_of_one():
    """The whole path: a Pendulum simulator samples with the published policy, the learner
    checks its chunks against the Box space and PPO rebuilds the same log-probabilities."""
    spec = env_spec("Pendulum-v1")
    # As shmrl.run starts: the first policy is published as given, and PPO starts from it.
    net = PolicyNet(spec, 64, "ReLU")
    weights = named(with_log_std(init_mlp_weights([3, 64, 64, 1], 1.0, np.random.default_rng(0)), [-0.7]))
    ppo = PPO(net, with_defaults(PPOSettings), initial_weights=weights)
    server = InProcServer()
    learner = Serving([server], Config(env_steps_per_sample=256, train_batch_size=256), {DEFAULT_POLICY: spec},
                      {DEFAULT_POLICY: net.template}, {DEFAULT_POLICY: weights})
    client = server.connect(timeout=10)
    thread = threading.Thread(target=run_simulator, args=(client, "Pendulum-v1"), kwargs=dict(max_messages=1),
                              daemon=True)
    thread.start()
    learner.start()
    try:
        got = learner.next_batch(timeout=10)
        assert got is not None, "no batch from the simulator"
        chunks, version = got
        assert learner.store.steps_dropped == {}
        batch = ppo.make_batch(EpisodeBatch.concat(chunks[DEFAULT_POLICY]))
        assert len(batch) == 256 and batch.actions.shape == (256, 1)
        assert np.abs(batch.actions).max() > 2.0   # sampled unclipped (the env clips what it applies)
        with torch.no_grad():
            logp, _ = ppo.log_prob(ppo.forward(batch.obs, values=False)[0], torch.from_numpy(batch.actions))
        np.testing.assert_allclose(np.exp(logp.numpy() - batch.logp), 1.0, atol=1e-4)
        update(learner, {DEFAULT_POLICY: ppo}, UpdateCounts(), chunks, version)   # publishes: releases the simulator's request
        thread.join(10)
        assert not thread.is_alive()
    finally:
        learner.stop()
        server.close()


def test_pendulum_spaces_are_gymnasiums():
    need("gymnasium", "gym")
    ours, theirs = env_spec("Pendulum-v1"), env_spec("gym:Pendulum-v1")
    assert ours.observation_space == theirs.observation_space
    assert ours.action_space == theirs.action_space and ours.continuous and ours.policy_outputs == 2


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_pendulum_matches_gymnasium_step_by_step(seed):
    rng = np.random.default_rng(seed)
    # Torques out of bounds too: both clip to +-2.
    steps, term, trunc = step_beside_gymnasium(
        "Pendulum-v1", Pendulum(), seed, lambda obs: rng.uniform(-3.0, 3.0, size=1).astype(np.float32), atol=1e-6)
    assert steps == 200 and trunc and not term


def test_pendulum_training_beats_the_initial_random_policy(tmp_path, no_shm_leftovers, no_sim_leftovers):
    spec = env_spec("Pendulum-v1")
    # The run's own first policy (seed 0): near-zero means, std 1. Its greedy return is
    # about -1250, with a spread of about 85 for the mean of 20 episodes.
    net = PolicyNet(spec, 64, "ReLU")
    first = net.template.publish(net.initial_weights(seed=0))
    random_mean = statistics.fmean(evaluate(first, "Pendulum-v1", episodes=20))
    # About 6 s here; the greedy return is then about -250 (the training window's mean lags).
    summary = shmrl.train(env="Pendulum-v1", sims=2, seed=0, max_env_steps=26_000, stop_return=math.inf,
                          train_batch_size=1024, logdir=str(tmp_path))   # 25 updates in the budget
    assert summary["exit_status"] == 1 and summary["env_steps"] >= 26_000
    assert summary["env_steps_dropped"] == {}
    trained = evaluate((tmp_path / "policy.onnx").read_bytes(), "Pendulum-v1", episodes=20)
    assert statistics.fmean(trained) > random_mean + 500, (statistics.fmean(trained), random_mean)
