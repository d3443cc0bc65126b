import numpy as np
import pytest
import torch

from shmrl.core.episode import Episode, EpisodeBatch
from shmrl.envs.make import env_spec
from shmrl.model.net import PolicyNet
from shmrl.onnxio.policy import (INPUT_NAME, ONNX_ACTIVATIONS, OUTPUT_NAME, OnnxPolicy, OnnxPublisher,
                               decode_onnx_file, encode_onnx_file, init_mlp_weights)
from shmrl.config.settings import PPOSettings, with_defaults
from shmrl.model.ppo import PPO

CARTPOLE = env_spec("CartPole-v1")


def cartpole_ppo(config=None, seed=0, **net):
    return PPO(PolicyNet(CARTPOLE, 64, "ReLU", **net), config or with_defaults(PPOSettings), seed=seed)


def actor_out(ppo, obs: np.ndarray) -> torch.Tensor:
    """The actor's trained outputs (logits, means) for raw observations."""
    with torch.no_grad():
        return ppo.forward(ppo.normalize(obs), values=False)[0]


def random_chunk(rng, n, terminated=False, truncated=False):
    ep = Episode(rng.normal(size=4).astype(np.float32))
    for t in range(n):
        ep.add_step(int(rng.integers(2)), float(rng.normal()), rng.normal(size=4).astype(np.float32),
                    rng.normal(size=2).astype(np.float32), -0.7,
                    terminated=terminated and t == n - 1, truncated=truncated and t == n - 1)
    return ep.finalize()


def naive_gae(chunk, values, gamma, lam):
    """Textbook GAE with a Python loop, to check the vectorized one against."""
    n = len(chunk.actions)
    adv = np.zeros(n)
    last = 0.0
    for t in reversed(range(n)):
        nonterminal = 0.0 if (chunk.is_terminated and t == n - 1) else 1.0
        delta = chunk.rewards[t] + gamma * values[t + 1] * nonterminal - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv


def test_vectorized_gae_matches_textbook_gae():
    rng = np.random.default_rng(0)
    ppo = cartpole_ppo(with_defaults(PPOSettings, gamma=0.97, gae_lambda=0.9))
    chunks = [random_chunk(rng, 7, terminated=True), random_chunk(rng, 0), random_chunk(rng, 12),
              random_chunk(rng, 1, terminated=True), random_chunk(rng, 5, truncated=True)]
    batch = ppo.make_batch(EpisodeBatch.from_episodes(chunks))
    expected = np.concatenate([naive_gae(c, ppo.values(c.obs), 0.97, 0.9) for c in chunks])
    np.testing.assert_allclose(batch.advantages, expected, rtol=1e-4, atol=1e-5)
    values = np.concatenate([ppo.values(c.obs)[:-1] for c in chunks])
    np.testing.assert_allclose(batch.returns, expected + values, rtol=1e-4, atol=1e-5)
    assert len(batch) == 25 and batch.obs["obs"].shape == (25, 4)
    np.testing.assert_array_equal(batch.obs["obs"][:7], chunks[0].obs[:-1])


def bandit_chunks(n: int = 256, seed: int = 1) -> list:
    """One-step CartPole-shaped episodes in which action 1 is rewarded and action 0 is not."""
    rng = np.random.default_rng(seed)
    chunks = []
    for t in range(n):
        c = Episode(rng.normal(size=4).astype(np.float32))
        c.add_step(t % 2, float(t % 2), np.zeros(4, np.float32), np.zeros(2, np.float32),
                   float(np.log(0.5)), terminated=True)
        chunks.append(c.finalize())
    return chunks


def test_update_moves_policy_toward_advantaged_action():
    ppo = cartpole_ppo(with_defaults(PPOSettings, lr=3e-3, epochs=4, minibatch_size=64))
    chunks = bandit_chunks()
    obs = np.stack([c.obs[0] for c in chunks])
    before = torch.softmax(actor_out(ppo, obs), -1)[:, 1].mean().item()
    for _ in range(5):
        ppo.update(ppo.make_batch(EpisodeBatch.from_episodes(chunks)))
    after = torch.softmax(actor_out(ppo, obs), -1)[:, 1].mean().item()
    assert after > before + 0.05


def test_onnx_publication_matches_torch_actor_and_rllib_input_name():
    ppo = cartpole_ppo(seed=3)
    publisher = ppo.net.template
    model = publisher.publish(ppo.published_weights())
    policy = OnnxPolicy(decode_onnx_file(encode_onnx_file(model)))
    assert policy.session.get_inputs()[0].name == INPUT_NAME == "onnx::Gemm_0"
    for batch in (1, 8):  # dynamic batch dimension
        obs = np.random.default_rng(batch).normal(size=(batch, 4)).astype(np.float32)
        expected = actor_out(ppo, obs).numpy()
        np.testing.assert_allclose(policy.logits(obs), expected, rtol=1e-5, atol=1e-6)
    # A new version changes only weights: the same graph gives the new actor's outputs.
    with torch.no_grad():
        for name, p in ppo.params.items():
            if name.startswith("pi."):
                p.add_(0.1)
    model2 = publisher.publish(ppo.published_weights())
    assert len(model2) == len(model) and model2 != model
    obs = np.ones((2, 4), np.float32)
    expected = actor_out(ppo, obs).numpy()
    np.testing.assert_allclose(OnnxPolicy(model2).logits(obs), expected, rtol=1e-5, atol=1e-6)


def onnx_helper_model(sizes, params, activation):
    """The same graph built with the onnx package: the reference for the bytes shmrl writes."""
    from onnx import TensorProto, helper, numpy_helper
    nodes, x = [], INPUT_NAME
    inits = [numpy_helper.from_array(p, f"{'wb'[k % 2]}{k // 2}") for k, p in enumerate(params)]
    for i in range(len(sizes) - 1):
        last = i == len(sizes) - 2
        pre = OUTPUT_NAME if last else f"z{i}"
        nodes.append(helper.make_node("Gemm", [x, f"w{i}", f"b{i}"], [pre], transB=1))
        if not last:
            x = f"h{i}"
            nodes.append(helper.make_node(ONNX_ACTIVATIONS[activation], [pre], [x]))
    graph = helper.make_graph(
        nodes, "shmrl_policy", [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, ["batch", sizes[0]])],
        [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["batch", sizes[-1]])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="shmrl")
    model.ir_version = 8
    return model


@pytest.mark.parametrize("sizes, activation", [([4, 64, 64, 2], "ReLU"), ([3, 200, 2], "Tanh"), ([17, 5], "ReLU")])
def test_hand_written_onnx_is_what_the_onnx_package_writes(sizes, activation):
    import onnx
    params = init_mlp_weights(sizes, 0.5, np.random.default_rng(len(sizes)))
    model = OnnxPublisher(sizes, activation).publish(params)
    reference = onnx_helper_model(sizes, params, activation)
    assert model == reference.SerializeToString()
    onnx.checker.check_model(onnx.load_from_string(model), full_check=True)
    x = np.random.default_rng(0).normal(size=(3, sizes[0])).astype(np.float32)
    h = x
    for i in range(len(sizes) - 1):
        h = h @ params[2 * i].T + params[2 * i + 1]
        if i < len(sizes) - 2:
            h = np.maximum(h, 0) if activation == "ReLU" else np.tanh(h)
    np.testing.assert_allclose(OnnxPolicy(model).logits(x), h, rtol=1e-5, atol=1e-6)


def test_initial_weights_are_orthogonal_with_the_given_gains():
    w0, b0, w1, b1, w2, b2 = init_mlp_weights([4, 64, 64, 2], 0.01, np.random.default_rng(1))
    np.testing.assert_allclose(w0.T @ w0, 2 * np.eye(4), atol=1e-5)       # gain sqrt(2), columns
    np.testing.assert_allclose(w1 @ w1.T, 2 * np.eye(64), atol=1e-5)
    np.testing.assert_allclose(w2 @ w2.T, 1e-4 * np.eye(2), atol=1e-8)     # the small last layer
    assert not (b0.any() or b1.any() or b2.any()) and w0.dtype == np.float32
    again = init_mlp_weights([4, 64, 64, 2], 0.01, np.random.default_rng(1))
    assert all((a == b).all() for a, b in zip(again, [w0, b0, w1, b1, w2, b2]))
    ppo = cartpole_ppo(seed=1)                                               # PPO's default actor
    published = ppo.published_weights()
    mine = [published[n] for n in ("pi.0.w", "pi.0.b", "pi.1.w", "pi.1.b", "pi.head.w", "pi.head.b")]
    assert all((a == b).all() for a, b in zip(mine, again))


def test_publish_rejects_wrong_shapes():
    publisher = OnnxPublisher([4, 8, 2])
    with pytest.raises(ValueError, match="shape"):
        publisher.publish([np.zeros((8, 5)), np.zeros(8), np.zeros((2, 8)), np.zeros(2)])


def test_flat_adam_matches_torch_adam_with_clipping():
    from shmrl.model.ppo import FlatAdam

    def mlp(sizes, weights):
        layers = []
        for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            linear = torch.nn.Linear(n_in, n_out)
            with torch.no_grad():
                linear.weight.copy_(torch.from_numpy(weights[2 * i]))
                linear.bias.copy_(torch.from_numpy(weights[2 * i + 1]))
            layers += [linear, torch.nn.ReLU()]
        return torch.nn.Sequential(*layers[:-1])
    torch.manual_seed(0)
    weights = init_mlp_weights([4, 16, 3], 1.0, np.random.default_rng(0))
    net_a = mlp([4, 16, 3], weights)
    net_b = mlp([4, 16, 3], weights)
    ours = FlatAdam(net_a.parameters(), lr=1e-2)
    ref = torch.optim.Adam(net_b.parameters(), lr=1e-2, eps=1e-5)
    for step in range(20):
        x = torch.randn(32, 4)
        ours.zero_grad()
        (net_a(x) ** 2).mean().mul(10).backward()
        ours.step(max_grad_norm=0.5)
        ref.zero_grad()
        (net_b(x) ** 2).mean().mul(10).backward()
        torch.nn.utils.clip_grad_norm_(net_b.parameters(), 0.5)
        ref.step()
    for pa, pb in zip(net_a.parameters(), net_b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=1e-4, atol=1e-6)


def plain_ppo_update(ppo: PPO, batch, rng, target_kl: float | None) -> tuple[list, dict]:
    """The PPO update written plainly, CleanRL's way, for ``PPO.update`` to be checked
    against: torch.optim.Adam over the same parameters (a copy), clip_grad_norm_, the
    Gaussian's log-probability from torch.distributions, a host sync for every check, and
    minibatches gathered from ``rng``'s permutations as the update draws them. Returns the
    parameters after it and the last epoch's mean losses."""
    cfg = ppo.config
    params = {k: v.detach().clone().requires_grad_() for k, v in ppo.params.items()}
    log_std = ppo.log_std.detach().clone().requires_grad_()
    order = [p for k, p in params.items() if not k.startswith("vf.")] + [log_std] + \
        [p for k, p in params.items() if k.startswith("vf.")]
    opt = torch.optim.Adam(order, lr=cfg.lr, eps=1e-5)
    obs = {k: torch.from_numpy(v) for k, v in batch.obs.items()}
    actions, logp_b, returns = (torch.from_numpy(x) for x in (batch.actions, batch.logp, batch.returns))
    adv = torch.from_numpy(batch.advantages)
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)

    def logp_of(rows):
        out, values = ppo.net.both_torch(params, {k: v[rows] for k, v in obs.items()})
        dist = torch.distributions.Normal(out, log_std.exp())
        return dist.log_prob(actions[rows]).sum(-1), dist.entropy().sum(-1), values

    with torch.no_grad():
        logp_start = logp_of(torch.arange(len(batch)))[0]
    n, mb = len(batch), cfg.minibatch_size
    for epoch in range(cfg.epochs):
        sums, taken = np.zeros(2), 0
        perm = torch.from_numpy(rng.permutation(n))
        for start in range(0, n - mb + 1, mb):
            rows = perm[start:start + mb]
            logp, entropy, values = logp_of(rows)
            moved = (logp - logp_start[rows]).detach()
            if target_kl and float((moved.exp() - 1 - moved).mean()) > 1.5 * target_kl:
                return order, {"pi_loss": sums[0] / max(taken, 1), "v_loss": sums[1] / max(taken, 1), "stopped": True}
            ratio = (logp - logp_b[rows]).exp()
            a = adv[rows]
            pi_loss = -torch.min(a * ratio, a * ratio.clamp(1 - cfg.clip, 1 + cfg.clip)).mean()
            v_loss = 0.5 * ((values - returns[rows]) ** 2).mean()
            loss = pi_loss + cfg.vf_coef * v_loss - cfg.ent_coef * entropy.mean()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(order, cfg.max_grad_norm)
            opt.step()
            sums += [pi_loss.item(), v_loss.item()]
            taken += 1
    return order, {"pi_loss": sums[0] / taken, "v_loss": sums[1] / taken, "stopped": False}


@pytest.mark.parametrize("target_kl", [None, 0.02, 1e-4])
def test_update_computes_what_a_plain_ppo_update_computes(target_kl):
    """PPO.update's cheaper path (flat Adam, diagnostics outside autograd, one host sync an
    epoch) gives the same losses and weights as the plain update on the same minibatches,
    without a KL stop and with one, which ends both at the same step (1e-4 stops early)."""
    import dataclasses

    from tools.update_bench import CASES, case_config, fake_messages

    case = next(c for c in CASES if c.name == "mlp64-mb256")
    spec, config = case_config(case)
    config = dataclasses.replace(config, train_batch_size=1024, minibatch_size=128, epochs=4, ent_coef=0.01, max_grad_norm=0.05,
                                 lr_anneal=False)
    from shmrl.trainer.setup import policy_net

    net = policy_net(config, spec)
    ppo = PPO(net, config, seed=3)
    batch = ppo.make_batch(EpisodeBatch.concat(fake_messages(net, config, seed=3)))
    rng = np.random.default_rng()
    rng.bit_generator.state = ppo.rng.bit_generator.state       # the same permutations
    reference, plain = plain_ppo_update(ppo, batch, rng, target_kl)
    result = ppo.update(batch, target_kl=target_kl)
    assert (result["epochs_run"] < config.epochs) == plain["stopped"] == (target_kl == 1e-4), result
    assert result["pi_loss"] == pytest.approx(plain["pi_loss"], rel=1e-3, abs=1e-6)
    assert result["v_loss"] == pytest.approx(plain["v_loss"], rel=1e-4)
    torch.testing.assert_close(ppo.optimizer.flat, torch.cat([p.detach().reshape(-1) for p in reference]),
                               rtol=1e-4, atol=1e-5)
