"""PPO, readable top to bottom: actor-critic, GAE over episode chunks, clipped update.

The only module of shmrl besides the learner that imports torch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from shmrl.episode import EpisodeBatch
from shmrl.onnx_policy import OBS_CLIP, PolicyNet, init_mlp_weights, with_log_std
from shmrl.stats import RunningMeanStd, discounted_sums

HALF_LOG_2PI = 0.5 * float(np.log(2 * np.pi))


@dataclass
class PPOConfig:
    lr: float = 1e-3
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip: float = 0.2
    epochs: int = 10
    minibatch_size: int = 512
    ent_coef: float = 0.0
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    reward_scale: float = 1.0  # rewards are multiplied by this for training (returns stay as they are)
    lr_anneal: bool = False    # the learning rate falls linearly to 0 over the run's env-step budget


def mlp(sizes: list[int], weights: list[np.ndarray], activation: str = "ReLU") -> nn.Sequential:
    """Linear layers (with ``activation`` between them) holding ``weights``: w0, b0, w1, b1, ..."""
    layers = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        linear = nn.Linear(n_in, n_out)
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(weights[2 * i]))
            linear.bias.copy_(torch.from_numpy(weights[2 * i + 1]))
        layers.append(linear)
        if i < len(sizes) - 2:
            layers.append(getattr(nn, activation)())
    return nn.Sequential(*layers)


class FlatAdam:
    """Adam with gradient-norm clipping over all parameters kept in one flat buffer.

    Parameters and their gradients are views into two flat tensors, so one step is a
    handful of tensor ops instead of a loop over every parameter, and creating it does
    not import torch._dynamo (torch.optim does, which costs over a second at start).
    Autograd accumulates into the existing ``.grad`` views in place.
    """

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-5):
        self.params = list(params)
        self.lr, (self.beta1, self.beta2), self.eps = lr, betas, eps
        n = sum(p.numel() for p in self.params)
        self.flat = torch.zeros(n)
        self.flat_grad = torch.zeros(n)
        offset = 0
        for p in self.params:
            k = p.numel()
            self.flat[offset:offset + k].copy_(p.data.reshape(-1))
            p.data = self.flat[offset:offset + k].view_as(p)
            p.grad = self.flat_grad[offset:offset + k].view_as(p)
            offset += k
        self.exp_avg = torch.zeros(n)
        self.exp_avg_sq = torch.zeros(n)
        self.t = 0

    def zero_grad(self) -> None:
        self.flat_grad.zero_()

    @torch.no_grad()
    def step(self, max_grad_norm: float | None = None) -> float:
        """Clip the gradient to ``max_grad_norm``, take one Adam step; returns the norm."""
        g = self.flat_grad
        norm = float(g.norm())
        if max_grad_norm is not None and norm > max_grad_norm:
            g.mul_(max_grad_norm / (norm + 1e-6))
        self.t += 1
        self.exp_avg.lerp_(g, 1 - self.beta1)
        self.exp_avg_sq.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
        denom = (self.exp_avg_sq / (1 - self.beta2 ** self.t)).sqrt_().add_(self.eps)
        self.flat.addcdiv_(self.exp_avg, denom, value=-self.lr / (1 - self.beta1 ** self.t))
        return norm



@dataclass
class Batch:
    """One training batch, flat over all steps of all chunks (numpy, float32/int64)."""
    obs: np.ndarray         # as the networks see them: normalized where the policy normalizes
    actions: np.ndarray
    logp: np.ndarray        # behaviour log-probabilities the clients reported
    advantages: np.ndarray
    returns: np.ndarray

    def __len__(self) -> int:
        return len(self.actions)


class PPO:
    def __init__(self, net: PolicyNet, config: PPOConfig, seed: int = 0,
                 initial_weights: dict[str, np.ndarray] | None = None):
        """``net``: the published policy (layer sizes, activation, observation normalization),
        whose actor PPO trains beside a critic of the same shape. ``initial_weights``: the
        policy to start from, as published (``shmrl.run`` publishes the first one before torch
        is loaded); by default ``net``'s own first weights for ``seed``."""
        self.net, self.config, self.continuous = net, config, net.spec.continuous
        self.rng = np.random.default_rng(seed)
        d = net.action_dims
        actor_weights = net.mlp(initial_weights if initial_weights is not None else net.initial_weights(seed))
        mean_sizes = [*net.sizes[:-1], d]
        if self.continuous:  # the published last layer is [means; log-std rows]: take it apart
            *hidden, w, b = actor_weights
            actor_weights = [*hidden, w[:d], b[:d]]
            self.log_std = nn.Parameter(torch.tensor(b[d:], dtype=torch.float32))
        self.actor = mlp(mean_sizes, actor_weights, net.activation)
        params = [*self.actor.parameters(), *([self.log_std] if self.continuous else [])]
        critic_sizes = [*net.sizes[:-1], 1]
        self.critic = mlp(critic_sizes, init_mlp_weights(critic_sizes, 1.0, np.random.default_rng([seed, 1])),
                          net.activation)
        # Observations are normalized with these statistics on their way into both networks:
        # in the published graph for the actor, in make_batch for the learner.
        self.obs_stats = RunningMeanStd(net.spec.obs_shape) if net.normalize_obs else None
        # Flat parameter order: actor, its log-std (Box), critic.
        self.optimizer = FlatAdam([*params, *self.critic.parameters()], lr=config.lr)

    def published_weights(self) -> dict[str, np.ndarray]:
        """The policy as the ONNX graph takes it: the actor (the log-std in its last layer's
        extra rows, for a Box) and the observation statistics."""
        weights = [p.detach().numpy() for p in self.actor.parameters()]
        if self.continuous:
            weights = with_log_std(weights, self.log_std.detach().numpy())
        stats = self.obs_stats
        return self.net.weights(weights, *((stats.mean, stats.var) if stats is not None else ()))

    def normalize(self, obs: np.ndarray) -> np.ndarray:
        """Observations as the networks see them (what the published graph's first nodes do)."""
        stats = self.obs_stats
        if stats is None:
            return obs
        inv_std = (1.0 / np.sqrt(stats.var + 1e-8)).astype(np.float32)
        return np.clip((obs - stats.mean.astype(np.float32)) * inv_std, -OBS_CLIP, OBS_CLIP)

    def log_prob(self, obs: torch.Tensor, actions: torch.Tensor,
                 entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log-probability of ``actions``, entropy or None), per row, under the current policy."""
        out = self.actor(obs)
        if self.continuous:  # diagonal Gaussian
            std = self.log_std.exp()
            logp = (-0.5 * ((actions - out) / std) ** 2 - self.log_std - HALF_LOG_2PI).sum(-1)
            return logp, (self.log_std + 0.5 + HALF_LOG_2PI).sum().expand(len(obs)) if entropy else None
        logp_all = torch.log_softmax(out, dim=-1)
        logp = logp_all.gather(1, actions[:, None]).squeeze(1)
        return logp, -(logp_all.exp() * logp_all).sum(-1) if entropy else None

    @torch.inference_mode()
    def values(self, obs: np.ndarray) -> np.ndarray:
        """V of observations as the networks see them (normalized)."""
        return self.critic(torch.tensor(obs)).squeeze(-1).numpy()  # a copy: obs may be read-only

    def make_batch(self, chunks: EpisodeBatch, reward_scale: float | None = None) -> Batch:
        """GAE over episode chunks, with no Python loop over steps or chunks.

        A chunk that ended terminated bootstraps with 0; one that was truncated or cut
        (still running when its client sent it) bootstraps with V(last obs). Rewards are
        multiplied by ``reward_scale`` (default: the config's).
        """
        cfg = self.config
        lengths, n = chunks.lengths, chunks.num_chunks
        obs = self.normalize(chunks.obs)
        v_all = self.values(obs)                                      # one value per obs row
        chunk_of_step = np.repeat(np.arange(n), lengths)
        step_idx = np.arange(chunks.num_steps) + chunk_of_step        # each step's obs row
        v = v_all[step_idx]
        v_next = v_all[step_idx + 1]
        # No bootstrap after the last step of a terminated chunk.
        nonterminal = np.ones(len(v_all), np.float32)
        nonterminal[chunks.obs_last[chunks.is_terminated & (lengths > 0)]] = 0.0
        scale = cfg.reward_scale if reward_scale is None else reward_scale
        rewards = chunks.rewards * np.float32(scale)
        deltas = rewards + cfg.gamma * v_next * nonterminal[step_idx + 1] - v

        # Per chunk, padded to [n_chunks, T_max]: zeros after a chunk's end keep the
        # reverse recursion exact.
        t_max = int(lengths.max()) if n else 0
        padded = np.zeros((n, t_max), np.float32)
        col = np.arange(chunks.num_steps) - chunks.offsets[chunk_of_step]
        padded[chunk_of_step, col] = deltas
        advantages = discounted_sums(padded, cfg.gamma * cfg.gae_lambda, reverse=True)[chunk_of_step, col]

        return Batch(
            obs=obs[step_idx],
            actions=np.array(chunks.actions),  # copies: decoded arrays may be read-only views
            logp=np.array(chunks.action_logp),
            advantages=advantages.astype(np.float32),
            returns=(advantages + v).astype(np.float32),
        )

    def update_obs_stats(self, chunks: EpisodeBatch) -> None:
        """Take a batch's observations into the running statistics (after training on it:
        the batch was normalized with the statistics its policy was published with)."""
        if self.obs_stats is not None:
            self.obs_stats.update(chunks.obs)

    def update(self, batch: Batch, progress: float = 0.0) -> dict:
        """``epochs`` passes of clipped-surrogate minibatch steps over ``batch``. Returns the
        losses and diagnostics averaged over the last epoch's minibatches. ``progress``: the
        fraction of the run's env-step budget trained so far (for ``lr_anneal``)."""
        cfg = self.config
        self.optimizer.lr = cfg.lr * max(1.0 - progress, 0.0) if cfg.lr_anneal else cfg.lr
        n = len(batch)
        mb = min(cfg.minibatch_size, n)
        actions = batch.actions.astype(np.float32 if self.continuous else np.int64, copy=False)
        obs, actions, logp_behaviour, returns = (torch.from_numpy(x) for x in (
            batch.obs, actions, batch.logp, batch.returns))
        advantages = torch.from_numpy(batch.advantages)
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        stats = torch.zeros(5)  # pi_loss, v_loss, entropy, approx_kl, clip_frac
        for epoch in range(cfg.epochs):
            # One gather per epoch: each minibatch below is a slice (a view), not a copy.
            perm = torch.from_numpy(self.rng.permutation(n))
            e_obs, e_actions, e_logp_b, e_adv, e_returns = (
                x[perm] for x in (obs, actions, logp_behaviour, advantages, returns))
            last_epoch = epoch == cfg.epochs - 1
            for start in range(0, n - mb + 1, mb):
                s = slice(start, start + mb)
                # The entropy costs a few ops per step: only where the loss or the stats use it.
                logp, entropy = self.log_prob(e_obs[s], e_actions[s], entropy=bool(cfg.ent_coef) or last_epoch)
                # Ratio against the behaviour policy the client sampled with; the clamp
                # keeps a client's absurd log-probability from producing inf.
                log_ratio = torch.clamp(logp - e_logp_b[s], -20.0, 20.0)
                ratio = log_ratio.exp()
                adv = e_adv[s]
                pi_loss = -torch.min(adv * ratio, adv * torch.clamp(ratio, 1 - cfg.clip, 1 + cfg.clip)).mean()
                v_loss = 0.5 * (self.critic(e_obs[s]).squeeze(-1) - e_returns[s]).pow(2).mean()
                loss = pi_loss + cfg.vf_coef * v_loss
                if cfg.ent_coef:
                    loss = loss - cfg.ent_coef * entropy.mean()
                self.optimizer.zero_grad()
                loss.backward()
                self.optimizer.step(cfg.max_grad_norm)
                if last_epoch:
                    with torch.no_grad():
                        stats += torch.stack([pi_loss, v_loss, entropy.mean(), ((ratio - 1) - log_ratio).mean(),
                                              ((ratio - 1).abs() > cfg.clip).float().mean()])
        stats /= max(n // mb, 1)
        return {**dict(zip(("pi_loss", "v_loss", "entropy", "approx_kl", "clip_frac"), stats.tolist())),
                "lr": self.optimizer.lr}

    def get_state(self) -> tuple[dict[str, np.ndarray], dict]:
        """Everything training needs to go on, as arrays and JSON-able values (no pickle):
        every parameter and both Adam moments are flat buffers of the optimizer; the
        published policy (``policy/<name>``, what a resumed run publishes before torch is
        loaded) holds the observation statistics."""
        opt = self.optimizer
        arrays = {"params": opt.flat.numpy().copy(), "exp_avg": opt.exp_avg.numpy().copy(),
                  "exp_avg_sq": opt.exp_avg_sq.numpy().copy(),
                  **{f"policy/{k}": v for k, v in self.published_weights().items()}}
        if self.obs_stats is not None:
            arrays.update(self.obs_stats.get_state("obs_stats"))
        return arrays, {"adam_t": opt.t, "rng": self.rng.bit_generator.state}

    def set_state(self, arrays: dict[str, np.ndarray], values: dict) -> None:
        opt = self.optimizer
        if self.obs_stats is not None:
            self.obs_stats.set_state(arrays, "obs_stats")
        for name, buf in (("params", opt.flat), ("exp_avg", opt.exp_avg), ("exp_avg_sq", opt.exp_avg_sq)):
            if arrays[name].shape != tuple(buf.shape):
                raise ValueError(f"checkpoint {name!r} has {arrays[name].shape[0]} values, this network "
                                 f"{buf.shape[0]}: was it saved with other layer sizes?")
            buf.copy_(torch.from_numpy(arrays[name]))
        opt.t = values["adam_t"]
        self.rng.bit_generator.state = values["rng"]
