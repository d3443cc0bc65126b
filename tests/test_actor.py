"""The actor (shmrl.client.actor): the action distribution's two sides agree (the client's numpy
sampler and the learner's torch log-probability), greedy acting, and the recurrent state
each env carries."""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from shmrl.client.actor import Actor
from shmrl.envs.make import env_spec
from shmrl.envs.spec import EnvSpec
from shmrl.model.net import PolicyNet
from shmrl.onnxio.policy import OnnxPolicy, OnnxPublisher, init_mlp_weights
from shmrl.model.ppo import PPO
from shmrl.client.action_sampler import ActionSampler
from shmrl.core.spaces import Box, Dict, Discrete, MultiDiscrete, Tuple, action_layout

ACTION_SPACES = {
    "Discrete (few logits: sampled in plain Python)": Discrete(5),
    "Discrete (many logits: numpy)": Discrete(100),
    "MultiDiscrete": MultiDiscrete((3, 4)),
    "Box": Box((-1.0,), (1.0,), (3,)),
    "Tuple(Discrete, Box)": Tuple((Discrete(3), Box((-2.0,), (2.0,), (2,)))),
    "Dict(Box, MultiDiscrete)": Dict((("move", Box((-1.0,), (1.0,), (2,))), ("pick", MultiDiscrete((2, 3))))),
}


def torch_log_prob(layout, dist_inputs: np.ndarray, actions) -> np.ndarray:
    """The learner's log-probability (PPO.log_prob) of ``actions`` under ``dist_inputs`` as
    the graph gives them: the trained columns (logits, means) go in as PPO's output, the
    Gaussian parts' log-stds (one per dimension, the same in every row) as its log_std."""
    trained, log_std = [], []
    for part, dist, _ in layout.slices():
        block = dist_inputs[:, dist]
        trained.append(block[:, :part.size])
        if part.kind == "gaussian":
            log_std.append(block[0, part.size:])
    ppo = types.SimpleNamespace(layout=layout, _gaussian=PPO._gaussian,
                                log_std=torch.tensor(np.concatenate(log_std)) if log_std else None)
    actions = torch.as_tensor(np.asarray(actions))
    logp, _ = PPO.log_prob(ppo, torch.tensor(np.concatenate(trained, axis=1)), actions, entropy=False)
    return logp.numpy()


def dist_inputs_for(layout, rows: int, rng: np.random.Generator) -> np.ndarray:
    """Random logits and means in every row; each Gaussian log-std the same in all rows
    (the learner's is a parameter of its own, not a function of the observation)."""
    x = rng.normal(0.0, 1.5, (rows, layout.dist_size)).astype(np.float32)
    for part, dist, _ in layout.slices():
        if part.kind == "gaussian":
            x[:, dist.start + part.size:dist.stop] = rng.uniform(-1.0, 0.5, part.size)
    return x


@pytest.mark.parametrize("space", ACTION_SPACES.values(), ids=ACTION_SPACES.keys())
def test_sampler_and_torch_give_the_same_log_probability(space):
    layout = action_layout(space)
    rng = np.random.default_rng(0)
    dist_inputs = dist_inputs_for(layout, 64, rng)
    actions, logp = ActionSampler(layout, rng).sample(dist_inputs)
    expected = torch_log_prob(layout, dist_inputs, actions)
    np.testing.assert_allclose(np.asarray(logp, np.float64), expected, rtol=1e-4, atol=1e-4)
    # The actions are the distribution's: some differ from the most likely one (no argmax in disguise).
    assert not np.array_equal(np.asarray(actions), np.asarray(ActionSampler(layout, rng).greedy(dist_inputs)))


def test_the_log_probability_differs_for_other_actions():
    """The agreement above is about these actions: the same logits with other actions
    give other log-probabilities on both sides."""
    layout = action_layout(Discrete(5))
    dist_inputs = dist_inputs_for(layout, 8, np.random.default_rng(1))
    a = np.zeros(8, np.int64)
    b = np.full(8, 4, np.int64)
    assert not np.allclose(torch_log_prob(layout, dist_inputs, a), torch_log_prob(layout, dist_inputs, b))


def mlp_policy(obs_dim: int, n_out: int, seed: int = 0) -> OnnxPolicy:
    sizes = [obs_dim, 16, n_out]
    return OnnxPolicy(OnnxPublisher(sizes).publish(init_mlp_weights(sizes, 1.0, np.random.default_rng(seed))))


def test_greedy_actor_takes_the_most_likely_action_with_log_probability_zero():
    spec = env_spec("CartPole-v1")
    policy = mlp_policy(4, 2)
    obs = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
    actions, dist_inputs, logp = Actor(policy, spec, 32, np.random.default_rng(0), greedy=True).act(obs)
    np.testing.assert_array_equal(actions, policy.logits(obs).argmax(axis=1))
    np.testing.assert_array_equal(logp, np.zeros(32))
    sampled, _, sampled_logp = Actor(policy, spec, 32, np.random.default_rng(0)).act(obs)
    assert (np.asarray(sampled_logp) < 0).all()


def test_actor_refuses_a_policy_of_another_env():
    with pytest.raises(ValueError, match="trained on another env"):
        Actor(mlp_policy(3, 2), env_spec("CartPole-v1"), 1, np.random.default_rng(0))


def recurrent_policy(spec: EnvSpec, seed: int = 0) -> OnnxPolicy:
    net = PolicyNet(spec, 16, "Tanh", layers=1, memory="gru", memory_size=8)
    weights = net.initial_weights(seed)
    rng = np.random.default_rng(seed)
    weights = {k: (v + rng.normal(0, 0.5, v.shape)).astype(v.dtype) for k, v in weights.items()}
    return OnnxPolicy(net.template.publish(weights))


def test_recurrent_state_steps_on_is_reset_per_env_and_survives_new_weights():
    spec = env_spec("CartPoleNoVel-v1")
    obs = np.random.default_rng(0).normal(size=(3, *spec.obs_shape)).astype(np.float32)
    actor = Actor(recurrent_policy(spec), spec, 3, np.random.default_rng(0))
    assert actor.state.shape == (3, 8) and not actor.state.any()
    first = actor.act(obs)[1]
    assert actor.state.any(axis=1).all()
    second = actor.act(obs)[1]
    assert not np.allclose(first, second)   # the same observation, another state: other outputs
    actor.reset(np.array([False, True, False]))
    assert not actor.state[1].any() and actor.state[[0, 2]].any(axis=1).all()
    kept = actor.state.copy()
    actor.load(recurrent_policy(spec, seed=1))
    np.testing.assert_array_equal(actor.state, kept)   # new weights, the same episodes
    actor.reset(2)
    assert not actor.state[2].any() and actor.state[0].any()


def test_an_actor_without_env_rows_refuses_a_recurrent_policy():
    """The multi-agent loop's rows are whichever agents act: no state to carry."""
    spec = env_spec("CartPoleNoVel-v1")
    with pytest.raises(ValueError, match="single-agent"):
        Actor(recurrent_policy(spec), spec, None, np.random.default_rng(0))
