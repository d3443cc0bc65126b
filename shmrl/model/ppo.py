"""PPO, readable top to bottom: actor-critic, GAE over episode chunks, clipped update.

With a recurrent policy (``PolicyNet(memory=...)``) PPO trains on sequences instead of
single steps, and that is the whole difference, all in ``make_batch`` (``_replay``) and
``update``:

- before the update, every chunk is run through the network from the state it carries
  (``state_in``, what the simulator's policy had before the chunk's first step) to get
  the values for GAE and the state at every ``max_seq_len``-th step;
- the chunks' steps are cut into sequences of at most ``max_seq_len`` steps (a chunk never
  spans two episodes, so neither does a sequence), each with its starting state, and laid
  out padded to ``max_seq_len`` rows with a mask;
- minibatches are whole sequences (``minibatch_size // max_seq_len`` of them); the
  network runs each one from its starting state (truncated back-propagation through
  time), and every loss term is a mean over the real steps only.

The only module of shmrl besides the learner that imports torch.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import nn

from shmrl.config.settings import PPOSettings
from shmrl.core.episode import EpisodeBatch, obs_rows
from shmrl.model.net import OBS_CLIP, PolicyNet
from shmrl.core.stats import RunningMeanStd, discounted_sums

log = logging.getLogger("shmrl.run")
HALF_LOG_2PI = 0.5 * float(np.log(2 * np.pi))
MAX_LOG_RATIO = 20.0   # beyond: the behaviour log-probability is not one a policy gave


class FlatAdam:
    """Adam with gradient-norm clipping over all parameters kept in one flat buffer.

    Parameters and their gradients are views into two flat tensors, so one step is a
    handful of tensor ops instead of a loop over every parameter, and creating it does
    not import torch._dynamo (torch.optim does, which costs over a second at start).
    Autograd accumulates into the existing ``.grad`` views in place.
    """

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps: float = 1e-5, device: str = "cpu"):
        self.params = list(params)
        self.lr, (self.beta1, self.beta2), self.eps = lr, betas, eps
        n = sum(p.numel() for p in self.params)
        self.flat = torch.zeros(n, device=device)
        self.flat_grad = torch.zeros(n, device=device)
        offset = 0
        for p in self.params:
            k = p.numel()
            self.flat[offset:offset + k].copy_(p.data.reshape(-1))
            p.data = self.flat[offset:offset + k].view_as(p)
            p.grad = self.flat_grad[offset:offset + k].view_as(p)
            offset += k
        self.exp_avg = torch.zeros(n, device=device)
        self.exp_avg_sq = torch.zeros(n, device=device)
        self.t = 0

    def zero_grad(self) -> None:
        self.flat_grad.zero_()

    @torch.no_grad()
    def step(self, max_grad_norm: float | None = None) -> torch.Tensor:
        """Clip the gradient to ``max_grad_norm``, take one Adam step; returns the gradient's
        norm as a tensor. On a GPU nothing here waits for the device (a host sync each step
        costs about as much as the step). A gradient that is not finite makes the weights
        not finite: the caller checks the norm (PPO.update undoes the whole update)."""
        g = self.flat_grad
        norm = g.norm()
        if max_grad_norm is not None:
            if g.device.type != "cpu":   # the scale stays on the device
                g.mul_(torch.where(norm > max_grad_norm, max_grad_norm / (norm + 1e-6), 1.0))
            elif (n := float(norm)) > max_grad_norm:   # on a CPU reading it costs nothing and saves ops
                g.mul_(max_grad_norm / (n + 1e-6))
        self.t += 1
        self.exp_avg.lerp_(g, 1 - self.beta1)
        self.exp_avg_sq.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
        denom = (self.exp_avg_sq / (1 - self.beta2 ** self.t)).sqrt_().add_(self.eps)
        self.flat.addcdiv_(self.exp_avg, denom, value=-self.lr / (1 - self.beta1 ** self.t))
        return norm


@dataclass
class Batch:
    """One training batch, flat over all steps of all chunks (numpy); for a recurrent
    policy, over sequences of ``seq_len`` rows each (padded; ``mask`` 1 for a real step, 0
    for padding), ``state`` the one before each sequence's first step."""
    obs: dict               # {leaf: rows}, as the networks take them (normalized where asked)
    actions: np.ndarray
    logp: np.ndarray        # behaviour log-probabilities the clients reported
    advantages: np.ndarray
    returns: np.ndarray
    mask: np.ndarray | None = None     # float32 [rows]
    state: np.ndarray | None = None    # float32 [sequences, state_size]
    seq_len: int = 1

    def __len__(self) -> int:
        return len(self.actions)


class Normalizer:
    """Running mean and variance of every normalized observation leaf, and the
    normalization the published graph's first nodes apply (``shmrl.model.net.Encoder``):
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


def tensor(x: np.ndarray, device: torch.device | str | None = None) -> torch.Tensor:
    """A tensor sharing ``x``'s memory, or of a copy where ``x`` is a read-only view (a
    decoded message's arrays are); on ``device`` (a copy there unless it is the CPU)."""
    t = torch.from_numpy(x if x.flags.writeable and x.flags.c_contiguous else np.array(x))
    return t if device is None else t.to(device)


def host(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as numpy on the CPU (its own memory where it is there already)."""
    return t.detach().cpu().numpy()


def as_leaves(obs, net: PolicyNet) -> dict:
    """Observations as {leaf name: rows}: a plain array is the single leaf's."""
    return obs if isinstance(obs, dict) else {net.spec.obs.leaves[0].name: obs}


class PPO:
    """PPO for one policy, as the trainer drives it (``shmrl.model.algorithm``): ``learn``
    (``make_batch``, ``update``, ``update_obs_stats``), ``published_weights``, ``get_state``."""
    ROW_STATS = ("pi_loss", "v_loss", "entropy", "approx_kl", "clip_frac")
    action_dist = None   # clients sample output 0 as RLlib lays it out

    def __init__(self, net: PolicyNet, config: PPOSettings, seed: int = 0,
                 initial_weights: dict[str, np.ndarray] | None = None, device: str = "cpu"):
        """``net``: the actor (published) and the critic (``shmrl.model.net``). ``config``: the
        PPO settings (shmrl.config.settings.PPOSettings' fields, resolved: a run's Config, or
        ``with_defaults(PPOSettings, lr=...)``). ``initial_weights``: the policy to start
        from, as published (``shmrl.run`` publishes the first one before torch is loaded);
        by default ``net``'s own first weights for ``seed``. ``device``: where the networks,
        the optimizer and the batches live ("cpu", "cuda"); what leaves PPO (published
        weights, its state) is numpy either way."""
        unset = [f.name for f in fields(PPOSettings) if getattr(config, f.name) is None]
        if unset:
            raise ValueError(f"PPO settings left None (resolve them first: resolve_config or with_defaults): {unset}")
        self.net, self.config, self.layout = net, config, net.spec.actions
        self.continuous = self.layout.single_box
        self.device = torch.device(device)
        self.rng = np.random.default_rng(seed)
        init = net.init_params(seed)
        log_std = np.full(len(net.log_std_rows), net.log_std_init, np.float32)
        if initial_weights is not None:   # the actor as published; the critic drawn as always
            actor, log_std = net.split_published(initial_weights)
            init.update({k: v for k, v in actor.items() if k in init})
        self.params = {name: nn.Parameter(torch.tensor(init[name], dtype=torch.float32, device=self.device))
                       for name, _, _ in net.trained_params()}
        self.log_std = (nn.Parameter(torch.tensor(log_std, dtype=torch.float32, device=self.device))
                        if len(log_std) else None)
        self.normalizer = Normalizer(net) if net.normalized else None
        # Flat parameter order: the actor's (names not vf.), its log-std, the critic's.
        actor = [p for name, p in self.params.items() if not name.startswith("vf.")]
        critic = [p for name, p in self.params.items() if name.startswith("vf.")]
        self.optimizer = FlatAdam([*actor, *([self.log_std] if self.log_std is not None else []), *critic],
                                  lr=config.lr, device=self.device)
        self.learned = 0   # updates learned (the warning of absurd log-probabilities is said every 100th)

    def learn(self, chunks: EpisodeBatch, progress: float = 0.0, reward_scale: float | None = None,
              plan: dict | None = None, publish=None) -> dict:
        """One update on ``chunks`` (GAE, then ``update`` with ``plan``: epochs, minibatch size,
        target KL), then their observations into the statistics; its stats, or
        ``{"skipped": why}`` (the weights as they were, the statistics too)."""
        result = self.update(self.make_batch(chunks, reward_scale=reward_scale), progress, **(plan or {}))
        if "skipped" in result:
            return result
        if result["ratio_out_of_bounds"] and self.learned % 100 == 0:   # now and then, not every update
            log.warning("%.1f%% of the batch's steps have a behaviour action_logp more than %g from the policy's "
                        "own (a client's absurd log-probabilities): they get no policy gradient",
                        100 * result["ratio_out_of_bounds"], MAX_LOG_RATIO)
        self.learned += 1
        self.update_obs_stats(chunks)
        return result

    def published_weights(self) -> dict[str, np.ndarray]:
        """The policy as the ONNX graph takes it: the actor, its log-std in the head's extra
        rows, and the observation statistics."""
        params = {name: host(p) for name, p in self.params.items()}
        log_std = host(self.log_std) if self.log_std is not None else None
        return self.net.publish_weights(params, log_std, self.normalizer.published() if self.normalizer else None)

    def normalize(self, obs) -> dict:
        """Observations as the networks take them ({leaf: rows}; normalized leaves as the
        published graph's first nodes make them)."""
        obs = as_leaves(obs, self.net)
        return self.normalizer(obs) if self.normalizer is not None else obs

    def forward(self, obs: dict, values: bool = True):
        """(actor output, values or None) for observations as the networks take them."""
        t = {k: tensor(v, self.device) if isinstance(v, np.ndarray) else v for k, v in obs.items()}
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
        logp = out.new_zeros(len(out))
        ent = out.new_zeros(len(out)) if entropy else None
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
        # The constant terms summed once over the action's columns, not per row.
        z = (actions - mean) * torch.exp(-log_std)
        logp = -0.5 * z.square().sum(-1) - (log_std.sum() + len(log_std) * HALF_LOG_2PI)
        return logp, (log_std + 0.5 + HALF_LOG_2PI).sum().expand(len(mean)) if entropy else None

    @torch.inference_mode()
    def values(self, obs: dict) -> np.ndarray:
        """V of observations as the networks take them (normalized, where they are)."""
        t = {k: tensor(v, self.device) for k, v in as_leaves(obs, self.net).items()}
        return host(self.net.critic_torch(self.params, t)).copy()

    def make_batch(self, chunks: EpisodeBatch, reward_scale: float | None = None) -> Batch:
        """GAE over episode chunks, with no Python loop over steps or chunks.

        A chunk that ended terminated bootstraps with 0; one that was truncated or cut
        (still running when its client sent it) bootstraps with V(last obs). Rewards are
        multiplied by ``reward_scale`` (default: the config's).
        """
        cfg = self.config
        lengths, n = chunks.lengths, chunks.num_chunks
        obs = self.normalize(chunks.obs)
        replay = self._replay(chunks, obs) if self.net.core else None
        v_all = self.values(obs) if replay is None else replay[0]    # one value per obs row
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

        batch = Batch(
            obs={k: v[step_idx] for k, v in obs.items()},
            actions=np.array(chunks.actions),  # copies: decoded arrays may be read-only views
            logp=np.array(chunks.action_logp),
            advantages=advantages.astype(np.float32),
            returns=(advantages + v).astype(np.float32),
        )
        if replay is None:
            return batch
        _, rows, mask, state = replay          # the steps laid out as padded sequences
        idx = rows.ravel()
        return Batch(obs={k: v[idx] for k, v in batch.obs.items()}, actions=batch.actions[idx],
                     logp=batch.logp[idx], advantages=batch.advantages[idx], returns=batch.returns[idx],
                     mask=mask.ravel().astype(np.float32), state=state, seq_len=rows.shape[1])

    @torch.inference_mode()
    def _replay(self, chunks: EpisodeBatch, obs: dict):
        """Every chunk run through the recurrent network from its ``state_in``, in blocks of
        ``max_seq_len`` steps. Returns (the value of every obs row, then the sequences: their
        steps [sequences, max_seq_len] (padding repeats a sequence's first step), the mask of
        real steps, and the state before each one's first step). Sequence k of a chunk holds
        its steps k * max_seq_len ...; its state is the one the block pass reached there."""
        L, n, lengths = self.config.max_seq_len, chunks.num_chunks, chunks.lengths
        blocks = -(-(int(lengths.max()) + 1) // L) if n else 0     # a chunk has one obs row more than steps
        t = np.arange(blocks * L)
        obs_row = chunks.obs_first[:, None] + np.minimum(t, lengths[:, None])   # past its end: its last obs
        state = tensor(chunks.state_in, self.device)
        states = np.empty((blocks, n, state.shape[1]), np.float32)
        values = np.empty((n, blocks * L), np.float32)
        for b in range(blocks):
            states[b] = host(state)
            idx = obs_row[:, b * L:(b + 1) * L].ravel()
            _, v, state = self.net.sequence_torch(self.params, {k: tensor(x[idx], self.device) for k, x in obs.items()},
                                                  state)
            values[:, b * L:(b + 1) * L] = host(v).reshape(n, L)
        v_all = np.zeros(obs_rows(obs), np.float32)
        real = t <= lengths[:, None]
        v_all[obs_row[real]] = values[real]
        seq_chunk, seq_block = np.nonzero(np.arange(blocks) * L < lengths[:, None])   # blocks with steps
        start = chunks.offsets[seq_chunk] + seq_block * L
        mask = np.arange(L) < np.minimum(L, lengths[seq_chunk] - seq_block * L)[:, None]
        rows = np.where(mask, start[:, None] + np.arange(L), start[:, None])
        return v_all, rows, mask, states[seq_block, seq_chunk]

    def update_obs_stats(self, chunks: EpisodeBatch) -> None:
        """Take a batch's observations into the running statistics (after training on it:
        the batch was normalized with the statistics its policy was published with)."""
        if self.normalizer is not None:
            self.normalizer.update(as_leaves(chunks.obs, self.net))

    def update(self, batch: Batch, progress: float = 0.0, epochs: int | None = None,
               minibatch_size: int | None = None, target_kl: float | None = None) -> dict:
        """``epochs`` passes (default: the config's) of clipped-surrogate minibatch steps of
        ``minibatch_size`` steps (default: the config's) over ``batch``. With ``target_kl``
        the update stops before a minibatch step whose approximate KL from the policy as
        it was when the update began is above 1.5 x ``target_kl`` (stable-baselines3's
        rule, but from the update's start: in --async the behaviour policy may be versions
        older): the trust region that bounds many epochs of small minibatches. Returns the
        losses and diagnostics averaged over the last epoch's minibatches (those taken, or
        the epoch before's if it stopped at an epoch's first; the update's first step is
        always taken, its KL being 0) and ``epochs_run`` (fractional where it stopped).
        ``progress``: the fraction of the run's env-step budget trained so far (for
        ``lr_anneal``). The units shuffled into minibatches are steps, or a recurrent
        policy's whole sequences."""
        cfg = self.config
        epochs = cfg.epochs if epochs is None else epochs
        self.optimizer.lr = cfg.lr * max(1.0 - progress, 0.0) if cfg.lr_anneal else cfg.lr
        L = batch.seq_len
        units = len(batch) // L
        mb = max(1, min((minibatch_size or cfg.minibatch_size) // L, units))   # units per minibatch
        actions = batch.actions.astype(self.layout.action_dtype, copy=False)
        dev = self.device
        obs = {k: tensor(v, dev) for k, v in batch.obs.items()}
        actions, logp_behaviour, returns = (tensor(x, dev) for x in (actions, batch.logp, batch.returns))
        advantages = tensor(batch.advantages, dev)
        mask = None if batch.mask is None else tensor(batch.mask, dev)
        state = None if batch.state is None else tensor(batch.state, dev)
        real = advantages if mask is None else advantages[mask > 0]
        advantages = (advantages - real.mean()) / (real.std() + 1e-8)
        # pi_loss, v_loss, entropy, approx_kl, clip_frac, ratio_out_of_bounds: this epoch's sums, and the last whole one's
        stats, done = torch.zeros(6, device=dev), None
        not_finite = torch.zeros((), dtype=torch.bool, device=dev)   # a GPU's: read once an epoch
        opt = self.optimizer    # to go back to if a loss or gradient is not finite
        before = (opt.flat.clone(), opt.exp_avg.clone(), opt.exp_avg_sq.clone(), opt.t)
        steps_per_epoch, steps = max(units // mb, 1), 0
        kl_limit = 1.5 * target_kl if target_kl else math.inf
        logp_start = None if target_kl is None else self._logp_now(obs, actions, state, L, units, mb)
        for epoch in range(epochs):
            # One gather per epoch: each minibatch below is a slice (a view), not a copy.
            perm = self.rng.permutation(units)
            rows = torch.from_numpy(perm if L == 1 else (perm[:, None] * L + np.arange(L)).ravel()).to(dev)
            e_obs = {k: v[rows] for k, v in obs.items()}
            e_actions, e_logp_b, e_adv, e_returns = (x[rows] for x in (actions, logp_behaviour, advantages, returns))
            e_mask = None if mask is None else mask[rows]
            e_state = None if state is None else state[torch.from_numpy(perm).to(dev)]
            e_logp_start = None if logp_start is None else logp_start[rows]
            # The stats are every epoch's where the update may stop early, else only the last's.
            keep = epoch == epochs - 1 or target_kl is not None
            stats.zero_()
            taken = 0
            for start in range(0, units - mb + 1, mb):
                s = slice(start * L, (start + mb) * L)
                loss, terms = self.loss({k: v[s] for k, v in e_obs.items()}, e_actions[s], e_logp_b[s], e_adv[s],
                                        e_returns[s], None if state is None else e_state[start:start + mb],
                                        None if mask is None else e_mask[s], entropy=bool(cfg.ent_coef) or keep,
                                        logp_start=None if logp_start is None else e_logp_start[s])
                if logp_start is not None and float(terms.pop()) > kl_limit:   # past the trust region: not taken
                    break
                self.optimizer.zero_grad()
                loss.backward()
                norm = self.optimizer.step(cfg.max_grad_norm)
                if dev.type == "cpu" and not math.isfinite(float(norm)):   # no device to wait for: at once
                    return self._skipped(before, "its loss or gradient was not finite")
                not_finite |= ~torch.isfinite(norm)
                taken += 1
                if keep:
                    stats += torch.stack(terms)
            # One host sync an epoch, not one a step: a gradient that was not finite has been
            # applied since, but the whole update is undone.
            if bool(not_finite):
                return self._skipped(before, "its loss or gradient was not finite")
            steps += taken
            if taken:
                done = stats / taken
            if taken < steps_per_epoch:
                break
        if not bool(torch.isfinite(opt.flat).all()):
            return self._skipped(before, "it made a weight not finite")
        return {**dict(zip(("pi_loss", "v_loss", "entropy", "approx_kl", "clip_frac", "ratio_out_of_bounds"),
                           done.tolist())),
                "lr": self.optimizer.lr, "epochs_run": steps / steps_per_epoch}

    @torch.no_grad()
    def _logp_now(self, obs: dict, actions, state, L: int, units: int, mb: int) -> torch.Tensor:
        """The log-probability of every row's action under the weights as they are, by
        minibatches of ``mb`` units."""
        parts = []
        for start in range(0, units, mb):
            s = slice(start * L, (start + mb) * L)
            o = {k: v[s] for k, v in obs.items()}
            out = (self.net.actor_torch(self.params, o) if state is None
                   else self.net.sequence_torch(self.params, o, state[start:start + mb])[0])
            parts.append(self.log_prob(out, actions[s], entropy=False)[0])
        return torch.cat(parts)

    def _skipped(self, before: tuple, why: str) -> dict:
        """Undo an update (parameters and Adam's moments as ``before``); its stats say why."""
        opt = self.optimizer
        for buf, saved in zip((opt.flat, opt.exp_avg, opt.exp_avg_sq), before):
            buf.copy_(saved)
        opt.t = before[3]
        return {"skipped": why}

    def loss(self, obs: dict, actions, logp_behaviour, advantages, returns, state=None, mask=None,
             entropy: bool = True, logp_start=None):
        """(the loss of a minibatch, its terms: pi_loss, v_loss, entropy, approx_kl,
        clip_frac, ratio_out_of_bounds: the fraction of steps beyond MAX_LOG_RATIO). Its rows are steps, or with ``state`` whole sequences of equal length
        (the network runs them from ``state``); ``mask`` (1: a real step, 0: padding)
        leaves padding out of every term. Without ``entropy`` that term is 0 (and cheaper).
        With ``logp_start`` (the actions' log-probabilities when the update began) the terms
        end with the approximate KL from that policy."""
        cfg = self.config
        if state is None:
            out, values = self.net.both_torch(self.params, obs)
        else:
            out, values, _ = self.net.sequence_torch(self.params, obs, state)

        def mean(x):
            return x.mean() if mask is None else (x * mask).sum() / mask.sum()

        # The entropy costs a few ops per step: only where the loss or the stats use it.
        logp, ent = self.log_prob(out, actions, entropy=entropy)
        # Ratio against the behaviour policy the client sampled with. A step whose log-ratio
        # lies beyond MAX_LOG_RATIO (a client's absurd log-probability) counts as ratio 1 and
        # gets no policy gradient, so that it cannot blow the loss up to exp(20) and beyond.
        log_ratio = logp - logp_behaviour
        in_bounds = log_ratio.detach().abs() <= MAX_LOG_RATIO
        log_ratio = torch.where(in_bounds, log_ratio, 0.0)
        ratio = log_ratio.exp()
        pi_loss = -mean(torch.min(advantages * ratio, advantages * ratio.clamp(1 - cfg.clip, 1 + cfg.clip)))
        v_loss = 0.5 * mean((values - returns).square())
        ent = mean(ent) if entropy else None
        loss = pi_loss + cfg.vf_coef * v_loss
        if ent is not None and cfg.ent_coef:
            loss = loss - cfg.ent_coef * ent
        with torch.no_grad():   # the diagnostics: no autograd graph for them
            ratio, log_ratio = ratio.detach(), log_ratio.detach()
            terms = [pi_loss.detach(), v_loss.detach(), logp.new_zeros(()) if ent is None else ent.detach(),
                     mean((ratio - 1) - log_ratio), mean(((ratio - 1).abs() > cfg.clip).float()),
                     mean((~in_bounds).float())]
            if logp_start is not None:
                moved = logp.detach() - logp_start
                terms.append(mean(moved.exp() - 1 - moved))
        return loss, terms

    def get_state(self) -> tuple[dict[str, np.ndarray], dict]:
        """Everything training needs to go on, as arrays and JSON-able values (no pickle):
        every parameter and both Adam moments are flat buffers of the optimizer; the
        published policy (``policy/<name>``, what a resumed run publishes before torch is
        loaded) holds the observation statistics."""
        opt = self.optimizer
        arrays = {"params": host(opt.flat).copy(), "exp_avg": host(opt.exp_avg).copy(),
                  "exp_avg_sq": host(opt.exp_avg_sq).copy(),
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
