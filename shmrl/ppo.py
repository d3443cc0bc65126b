"""PPO, readable top to bottom: actor-critic, GAE over episode chunks, clipped update.

The only module of shmrl besides the learner that imports torch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from shmrl.episode import EpisodeBatch
from shmrl.net import OBS_CLIP, PolicyNet
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
    """One training batch, flat over all steps of all chunks (numpy)."""
    obs: dict               # {leaf: rows}, as the networks take them (normalized where asked)
    actions: np.ndarray
    logp: np.ndarray        # behaviour log-probabilities the clients reported
    advantages: np.ndarray
    returns: np.ndarray

    def __len__(self) -> int:
        return len(self.actions)


class Normalizer:
    """Running mean and variance of every normalized observation leaf, and the
    normalization the published graph's first nodes apply (``shmrl.net.Encoder``):
    cast, scale, subtract the mean, divide by the std, clip to +-10. In numpy: the learner
    normalizes a batch once, not every minibatch."""

    def __init__(self, net: PolicyNet):
        self.leaves = [leaf for leaf in net.leaves if leaf.name in net.normalized]
        self.stats = {leaf.name: RunningMeanStd(leaf.shape) for leaf in self.leaves}

    def scaled(self, leaf, values: np.ndarray) -> np.ndarray:
        values = values.astype(np.float32, copy=False)
        return values * np.float32(leaf.scale) if leaf.scale != 1.0 else values

    def __call__(self, obs: dict) -> dict:
        out = dict(obs)
        for leaf in self.leaves:
            stats = self.stats[leaf.name]
            inv_std = (1.0 / np.sqrt(stats.var + 1e-8)).astype(np.float32)
            out[leaf.name] = np.clip((self.scaled(leaf, obs[leaf.name]) - stats.mean.astype(np.float32)) * inv_std,
                                     -OBS_CLIP, OBS_CLIP)
        return out

    def update(self, obs: dict) -> None:
        for leaf in self.leaves:
            self.stats[leaf.name].update(self.scaled(leaf, obs[leaf.name]))

    def published(self) -> dict:
        return {name: (s.mean, s.var) for name, s in self.stats.items()}

    def get_state(self) -> dict:
        return {k: v for name, s in self.stats.items() for k, v in s.get_state(f"obs_stats.{name}").items()}

    def set_state(self, arrays: dict) -> None:
        for name, s in self.stats.items():
            s.set_state(arrays, f"obs_stats.{name}")


def tensor(x: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``x``'s memory, or of a copy where ``x`` is a read-only view (a
    decoded message's arrays are)."""
    return torch.from_numpy(x if x.flags.writeable and x.flags.c_contiguous else np.array(x))


def as_leaves(obs, net: PolicyNet) -> dict:
    """Observations as {leaf name: rows}: a plain array is the single leaf's."""
    return obs if isinstance(obs, dict) else {net.spec.obs.leaves[0].name: obs}


class PPO:
    def __init__(self, net: PolicyNet, config: PPOConfig, seed: int = 0,
                 initial_weights: dict[str, np.ndarray] | None = None):
        """``net``: the actor (published) and the critic (``shmrl.net``). ``initial_weights``:
        the policy to start from, as published (``shmrl.run`` publishes the first one before
        torch is loaded); by default ``net``'s own first weights for ``seed``."""
        self.net, self.config, self.layout = net, config, net.spec.actions
        self.continuous = self.layout.single_box
        self.rng = np.random.default_rng(seed)
        init = net.init_params(seed)
        log_std = np.full(len(net.log_std_rows), net.log_std_init, np.float32)
        if initial_weights is not None:   # the actor as published; the critic drawn as always
            actor, log_std = net.split_published(initial_weights)
            init.update({k: v for k, v in actor.items() if k in init})
        self.params = {name: nn.Parameter(torch.tensor(init[name], dtype=torch.float32))
                       for name, _, _ in net.trained_params()}
        self.log_std = nn.Parameter(torch.tensor(log_std, dtype=torch.float32)) if len(log_std) else None
        self.normalizer = Normalizer(net) if net.normalized else None
        # Flat parameter order: the actor's (names not vf.), its log-std, the critic's.
        actor = [p for name, p in self.params.items() if not name.startswith("vf.")]
        critic = [p for name, p in self.params.items() if name.startswith("vf.")]
        self.optimizer = FlatAdam([*actor, *([self.log_std] if self.log_std is not None else []), *critic],
                                  lr=config.lr)

    def published_weights(self) -> dict[str, np.ndarray]:
        """The policy as the ONNX graph takes it: the actor, its log-std in the head's extra
        rows, and the observation statistics."""
        params = {name: p.detach().numpy() for name, p in self.params.items()}
        log_std = self.log_std.detach().numpy() if self.log_std is not None else None
        return self.net.publish_weights(params, log_std, self.normalizer.published() if self.normalizer else None)

    def normalize(self, obs) -> dict:
        """Observations as the networks take them ({leaf: rows}; normalized leaves as the
        published graph's first nodes make them)."""
        obs = as_leaves(obs, self.net)
        return self.normalizer(obs) if self.normalizer is not None else obs

    def forward(self, obs: dict, values: bool = True):
        """(actor output, values or None) for observations as the networks take them."""
        t = {k: tensor(v) if isinstance(v, np.ndarray) else v for k, v in obs.items()}
        if values:
            return self.net.both_torch(self.params, t)
        return self.net.actor_torch(self.params, t), None

    def log_prob(self, out: torch.Tensor, actions: torch.Tensor,
                 entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(log-probability of ``actions``, entropy or None), per row, of the distribution
        whose trained inputs (logits, means) are ``out``; a Gaussian's log-std is a
        parameter of its own (state-independent)."""
        layout = self.layout
        if layout.single_discrete:
            logp_all = torch.log_softmax(out, dim=-1)
            logp = logp_all.gather(1, actions[:, None]).squeeze(1)
            return logp, -(logp_all.exp() * logp_all).sum(-1) if entropy else None
        if layout.single_box:
            return self._gaussian(out, actions, self.log_std, entropy)
        logp = torch.zeros(len(out))
        ent = torch.zeros(len(out)) if entropy else None
        o = s = 0   # columns of out (trained rows) and of the log-stds
        for part, _, cols in layout.slices():
            if part.kind == "categorical":
                logp_all = torch.log_softmax(out[:, o:o + part.size], dim=-1)
                logp = logp + logp_all.gather(1, actions[:, cols.start:cols.start + 1].long()).squeeze(1)
                if entropy:
                    ent = ent - (logp_all.exp() * logp_all).sum(-1)
            else:
                lp, e = self._gaussian(out[:, o:o + part.size], actions[:, cols].float(),
                                       self.log_std[s:s + part.size], entropy)
                logp = logp + lp
                if entropy:
                    ent = ent + e
                s += part.size
            o += part.size
        return logp, ent

    @staticmethod
    def _gaussian(mean, actions, log_std, entropy):
        std = log_std.exp()
        logp = (-0.5 * ((actions - mean) / std) ** 2 - log_std - HALF_LOG_2PI).sum(-1)
        return logp, (log_std + 0.5 + HALF_LOG_2PI).sum().expand(len(mean)) if entropy else None

    @torch.inference_mode()
    def values(self, obs: dict) -> np.ndarray:
        """V of observations as the networks take them (normalized, where they are)."""
        t = {k: tensor(v) for k, v in as_leaves(obs, self.net).items()}
        return self.net.critic_torch(self.params, t).numpy().copy()

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
            obs={k: v[step_idx] for k, v in obs.items()},
            actions=np.array(chunks.actions),  # copies: decoded arrays may be read-only views
            logp=np.array(chunks.action_logp),
            advantages=advantages.astype(np.float32),
            returns=(advantages + v).astype(np.float32),
        )

    def update_obs_stats(self, chunks: EpisodeBatch) -> None:
        """Take a batch's observations into the running statistics (after training on it:
        the batch was normalized with the statistics its policy was published with)."""
        if self.normalizer is not None:
            self.normalizer.update(as_leaves(chunks.obs, self.net))

    def update(self, batch: Batch, progress: float = 0.0) -> dict:
        """``epochs`` passes of clipped-surrogate minibatch steps over ``batch``. Returns the
        losses and diagnostics averaged over the last epoch's minibatches. ``progress``: the
        fraction of the run's env-step budget trained so far (for ``lr_anneal``)."""
        cfg = self.config
        self.optimizer.lr = cfg.lr * max(1.0 - progress, 0.0) if cfg.lr_anneal else cfg.lr
        n = len(batch)
        mb = min(cfg.minibatch_size, n)
        actions = batch.actions.astype(self.layout.action_dtype, copy=False)
        obs = {k: tensor(v) for k, v in batch.obs.items()}
        actions, logp_behaviour, returns = (torch.from_numpy(x) for x in (actions, batch.logp, batch.returns))
        advantages = torch.from_numpy(batch.advantages)
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        stats = torch.zeros(5)  # pi_loss, v_loss, entropy, approx_kl, clip_frac
        for epoch in range(cfg.epochs):
            # One gather per epoch: each minibatch below is a slice (a view), not a copy.
            perm = torch.from_numpy(self.rng.permutation(n))
            e_obs = {k: v[perm] for k, v in obs.items()}
            e_actions, e_logp_b, e_adv, e_returns = (x[perm] for x in (actions, logp_behaviour, advantages, returns))
            last_epoch = epoch == cfg.epochs - 1
            for start in range(0, n - mb + 1, mb):
                s = slice(start, start + mb)
                out, values = self.net.both_torch(self.params, {k: v[s] for k, v in e_obs.items()})
                # The entropy costs a few ops per step: only where the loss or the stats use it.
                logp, entropy = self.log_prob(out, e_actions[s], entropy=bool(cfg.ent_coef) or last_epoch)
                # Ratio against the behaviour policy the client sampled with; the clamp
                # keeps a client's absurd log-probability from producing inf.
                log_ratio = torch.clamp(logp - e_logp_b[s], -20.0, 20.0)
                ratio = log_ratio.exp()
                adv = e_adv[s]
                pi_loss = -torch.min(adv * ratio, adv * torch.clamp(ratio, 1 - cfg.clip, 1 + cfg.clip)).mean()
                v_loss = 0.5 * (values - e_returns[s]).pow(2).mean()
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
        if self.normalizer is not None:
            arrays.update(self.normalizer.get_state())
        return arrays, {"adam_t": opt.t, "rng": self.rng.bit_generator.state}

    def set_state(self, arrays: dict[str, np.ndarray], values: dict) -> None:
        opt = self.optimizer
        if self.normalizer is not None:
            self.normalizer.set_state(arrays)
        for name, buf in (("params", opt.flat), ("exp_avg", opt.exp_avg), ("exp_avg_sq", opt.exp_avg_sq)):
            if arrays[name].shape != tuple(buf.shape):
                raise ValueError(f"checkpoint {name!r} has {arrays[name].shape[0]} values, this network "
                                 f"{buf.shape[0]}: was it saved with other layer sizes?")
            buf.copy_(torch.from_numpy(arrays[name]))
        opt.t = values["adam_t"]
        self.rng.bit_generator.state = values["rng"]
