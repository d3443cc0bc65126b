"""SAC, readable top to bottom: soft actor-critic for one Box action with finite bounds,
as CleanRL's sac_continuous_action.py and stable-baselines3's SAC write it.

- The actor (``SquashedGaussianNet``, published as ONNX) gives (mean, log_std) of a Gaussian
  over u; the action is low + (tanh(u) + 1) / 2 x (high - low). The critics see the squashed
  action y = tanh(u) in [-1, 1], so their inputs do not depend on the env's units.
- Twin Q-networks (two MLPs of --layers x --hidden, run as one batched pass) and their
  target copies, moved --tau toward them after every gradient step (Polyak averaging).
- A learned temperature alpha (log alpha trained toward the target entropy, -|A| unless
  --target-entropy says otherwise).
- A replay buffer (``ReplayBuffer``) in the learner, a ring of --buffer-size env steps fed
  by every chunk the learner accepts, from any transport. It stores raw observations.
  With --normalize-obs the observation statistics are updated from the chunks as they
  arrive and applied when a minibatch is sampled (to its observations and next
  observations alike), and the published policy normalizes with the same statistics:
  every minibatch is normalized as the current policy would see it. (rl-zoo3's SAC
  presets do not normalize; shmrl's [sac] tables leave it off.)
- For the run's first --learning-starts env steps the clients act uniformly at random
  (SET_STATE's ``action_dist``: ``uniform``) and nothing is trained; then every env step
  received owes --gradient-steps gradient steps, each on --minibatch-size steps sampled
  uniformly from the buffer, with the weights published every --publish-every of them.
  Clients never wait for an update (``Algorithm.off_policy``), but a learner slower than
  its clients paces them: the serving side hands over at most a train batch at a time, and
  a client that sends while one waits goes on once the learner took it (``Hub.paced``). So
  each update pays what its steps owe (``replay_ratio``: --gradient-steps), as SB3's env
  waits for its gradient steps; a debt beyond two batches' worth (clients the transport
  cannot pace) is forgiven.

The log-probabilities a client reports (``shmrl.client.action_sampler.squashed_log_prob``)
are those of the env's action, scaling included; ``log_prob`` here is the same in torch (a
test checks they agree). Training uses the log-probability of y (no scaling term), as
stable-baselines3 does, so that the target entropy -|A| means what it means there.

A checkpoint keeps the networks, targets, temperature, Adam moments, the observation
statistics and the counts; not the replay buffer (up to gigabytes): a resumed run fills
it again with its policy's actions (no second warm-up) and trains once it holds a
minibatch.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from shmrl.core.episode import EpisodeBatch
from shmrl.model.net import SquashedGaussianNet
from shmrl.model.ppo import FlatAdam, Normalizer, as_leaves, host, tensor

LOG_2 = math.log(2.0)
HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def log_tanh_derivative(u: torch.Tensor) -> torch.Tensor:
    """log(1 - tanh(u)^2) = 2 (log 2 - u - softplus(-2u)), exact near +-1."""
    return 2.0 * (LOG_2 - u - torch.nn.functional.softplus(-2.0 * u))


class ReplayBuffer:
    """The last ``capacity`` env steps as a ring of numpy arrays (the oldest overwritten):
    raw observations per leaf and the next ones, actions in the env's units, rewards (times
    the reward scale), and 1 where the step ended its episode terminated (no bootstrap).
    ``nbytes`` is all it holds, allocated at once."""

    def __init__(self, capacity: int, leaves, action_size: int, seed: int = 0):
        self.capacity, self.size, self.pos = capacity, 0, 0
        self.obs = {leaf.name: np.zeros((capacity, *leaf.shape), leaf.dtype) for leaf in leaves}
        self.next_obs = {leaf.name: np.zeros((capacity, *leaf.shape), leaf.dtype) for leaf in leaves}
        self.actions = np.zeros((capacity, action_size), np.float32)
        self.rewards = np.zeros(capacity, np.float32)
        self.dones = np.zeros(capacity, np.float32)
        self.rng = np.random.default_rng(seed)

    @property
    def nbytes(self) -> int:
        arrays = [*self.obs.values(), *self.next_obs.values(), self.actions, self.rewards, self.dones]
        return sum(a.nbytes for a in arrays)

    def add(self, obs: dict, next_obs: dict, actions: np.ndarray, rewards: np.ndarray, dones: np.ndarray) -> None:
        """Steps in order; past the end of the ring they overwrite the oldest."""
        n = len(rewards)
        if n > self.capacity:   # only the last capacity steps would survive
            obs, next_obs = ({k: v[-self.capacity:] for k, v in o.items()} for o in (obs, next_obs))
            actions, rewards, dones, n = actions[-self.capacity:], rewards[-self.capacity:], dones[-self.capacity:], \
                self.capacity
        idx = (self.pos + np.arange(n)) % self.capacity
        for k in self.obs:
            self.obs[k][idx] = obs[k]
            self.next_obs[k][idx] = next_obs[k]
        self.actions[idx] = actions.reshape(n, -1)
        self.rewards[idx] = rewards
        self.dones[idx] = dones
        self.pos = int((self.pos + n) % self.capacity)
        self.size = min(self.size + n, self.capacity)

    def sample(self, n: int) -> tuple:
        idx = self.rng.integers(0, self.size, n)
        return ({k: v[idx] for k, v in self.obs.items()}, {k: v[idx] for k, v in self.next_obs.items()},
                self.actions[idx], self.rewards[idx], self.dones[idx])


def transitions(chunks: EpisodeBatch, leaves) -> tuple:
    """(obs, next obs, actions, rewards, terminated) of every step of ``chunks``: step t of
    a chunk goes from its obs row t to row t + 1; only a terminated chunk's last step ends
    without bootstrap (a truncated or cut one's next obs is its last)."""
    n = chunks.num_chunks
    chunk_of_step = np.repeat(np.arange(n), chunks.lengths)
    row = np.arange(chunks.num_steps) + chunk_of_step
    obs = {leaf.name: np.asarray(v) for leaf, v in zip(leaves, [as_obs(chunks.obs, leaf) for leaf in leaves])}
    done = np.zeros(chunks.num_steps, np.float32)
    last = chunks.offsets[1:] - 1
    ended = chunks.is_terminated & (chunks.lengths > 0)
    done[last[ended]] = 1.0
    return ({k: v[row] for k, v in obs.items()}, {k: v[row + 1] for k, v in obs.items()},
            np.asarray(chunks.actions, np.float32), np.asarray(chunks.rewards, np.float32), done)


def as_obs(obs, leaf):
    return obs[leaf.name] if isinstance(obs, dict) else obs


def critic_layout(net: SquashedGaussianNet, config) -> list[tuple[str, tuple]]:
    """(name, shape) of the twin critics' weights: each layer's two copies stacked, [2, out, in]."""
    n_in = sum(math.prod(leaf.shape) for leaf in net.leaves) + net.spec.actions.action_size
    sizes = [n_in] + [config.hidden] * config.layers + [1]
    out = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        out += [(f"q.{i}.w", (2, b, a)), (f"q.{i}.b", (2, 1, b))]
    return out


def state_sizes(net: SquashedGaussianNet, config=None) -> dict:
    """The flat arrays of SAC's state (``SAC.get_state``) and their sizes for ``net``."""
    actor = sum(math.prod(shape) for name, shape, _ in net.trained_params() if not name.startswith("vf."))
    cfg = config or _NetConfig(net)
    critic = sum(math.prod(shape) for _, shape in critic_layout(net, cfg))
    return {"actor.params": actor, "actor.exp_avg": actor, "actor.exp_avg_sq": actor, "critic.params": critic,
            "critic.exp_avg": critic, "critic.exp_avg_sq": critic, "critic.target": critic, "log_alpha.params": 1,
            "log_alpha.exp_avg": 1, "log_alpha.exp_avg_sq": 1}


class _NetConfig:
    def __init__(self, net):
        self.hidden, self.layers = net.hidden, net.layers


class SAC:
    ROW_STATS = ("actor_loss", "critic_loss", "q_mean", "alpha", "entropy", "replay_ratio", "grad_steps",
                 "buffer_steps")

    def __init__(self, net: SquashedGaussianNet, config, seed: int = 0,
                 initial_weights: dict[str, np.ndarray] | None = None, device: str = "cpu"):
        """``net``: the actor (published); ``config``: the run's settings (resolved);
        ``initial_weights``: the actor as published first; ``device``: where the networks,
        optimizers and minibatches live."""
        self.net, self.config, self.device = net, config, torch.device(device)
        torch.manual_seed(seed)
        init = net.init_params(seed)
        if initial_weights is not None:
            actor, _ = net.split_published(initial_weights)
            init.update({k: v for k, v in actor.items() if k in init})
        self.params = {name: torch.nn.Parameter(torch.tensor(init[name], dtype=torch.float32, device=self.device))
                       for name, _, _ in net.trained_params() if not name.startswith("vf.")}
        rng = np.random.default_rng([seed, 2])
        self.q = {}
        for name, shape in critic_layout(net, config):   # torch's default: uniform within 1/sqrt(inputs)
            bound = 1 / math.sqrt(shape[2] if name.endswith(".w") else self.q[name[:-1] + "w"].shape[2])
            self.q[name] = torch.nn.Parameter(torch.tensor(rng.uniform(-bound, bound, shape), dtype=torch.float32,
                                                           device=self.device))
        self.log_alpha = torch.nn.Parameter(torch.zeros(1, device=self.device))
        self.actor_opt = FlatAdam(self.params.values(), lr=config.lr, eps=1e-8, device=self.device)
        self.critic_opt = FlatAdam(self.q.values(), lr=config.lr, eps=1e-8, device=self.device)
        self.alpha_opt = FlatAdam([self.log_alpha], lr=config.lr, eps=1e-8, device=self.device)
        self.target_flat = self.critic_opt.flat.clone()
        self.q_target, offset = {}, 0
        for name, p in self.q.items():
            self.q_target[name] = self.target_flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        d = net.spec.actions.action_size
        self.target_entropy = -float(d) if config.target_entropy is None else float(config.target_entropy)
        part = net.spec.actions.parts[0]
        self.low = torch.tensor(part.low, dtype=torch.float32, device=self.device)
        self.half_range = torch.tensor((np.asarray(part.high) - np.asarray(part.low)) / 2, dtype=torch.float32,
                                       device=self.device)
        self.normalizer = Normalizer(net) if net.normalized else None
        self.buffer = ReplayBuffer(config.buffer_size, net.leaves, d, seed)
        self.steps_seen = 0        # env steps taken into the buffer, in all (a resumed run's too)
        self.grad_steps = 0
        self.owed = 0.0            # gradient steps owed for the env steps received

    # ------------------------------------------------------------ what the trainer asks
    @property
    def action_dist(self) -> str:
        """How clients sample now: uniformly until --learning-starts env steps, then the policy."""
        return "uniform" if self.steps_seen < self.config.learning_starts else "squashed_gaussian"

    def published_weights(self) -> dict[str, np.ndarray]:
        params = {name: host(p) for name, p in self.params.items()}
        return self.net.publish_weights(params, None, self.normalizer.published() if self.normalizer else None)

    def learn(self, chunks: EpisodeBatch, progress: float = 0.0, reward_scale: float = 1.0, plan: dict | None = None,
              publish=None) -> dict | None:
        """Take ``chunks`` into the buffer, then pay the gradient steps owed (publishing every
        --publish-every); None while the warm-up lasts (nothing to publish)."""
        cfg = self.config
        self.remember(chunks, reward_scale)
        if self.steps_seen < cfg.learning_starts or self.buffer.size < cfg.minibatch_size:
            return None
        # A batch is at most two train batches (``EpisodeStore.take``): one update pays what
        # they owe, and no more (a longer one would keep the loop from its budgets).
        most = max(1, math.ceil(2 * cfg.train_batch_size * cfg.gradient_steps))
        owed = self.owed + chunks.num_steps * cfg.gradient_steps
        n = int(min(owed, most))
        self.owed = min(owed - n, most)
        sums, taken = torch.zeros(5, device=self.device), 0
        for _ in range(n):
            terms = self.gradient_step()
            if terms is None:
                return {"skipped": "its loss or gradient was not finite"}
            sums += terms
            taken += 1
            if publish is not None and self.grad_steps % cfg.publish_every == 0 and taken < n:
                publish(self.published_weights())
        means = (sums / max(taken, 1)).tolist()
        return {**dict(zip(("actor_loss", "critic_loss", "q_mean", "alpha", "entropy"), means)),
                "replay_ratio": taken / max(chunks.num_steps, 1), "lr": cfg.lr, "epochs_run": 1.0,
                "grad_steps": self.grad_steps, "buffer_steps": self.buffer.size}

    def remember(self, chunks: EpisodeBatch, reward_scale: float = 1.0) -> None:
        """Take ``chunks`` into the replay buffer (and the observation statistics), learning
        nothing: they count toward --learning-starts (--algo auto's measuring batch, sampled
        by PPO's first policy, goes in here)."""
        obs, next_obs, actions, rewards, dones = transitions(chunks, self.net.leaves)
        self.buffer.add(obs, next_obs, actions, rewards * np.float32(reward_scale), dones)
        if self.normalizer is not None:
            self.normalizer.update(as_leaves(chunks.obs, self.net))
        self.steps_seen += chunks.num_steps

    # ------------------------------------------------------------ the update
    def normalize(self, obs: dict) -> dict:
        return self.normalizer(obs) if self.normalizer is not None else obs

    def features(self, obs: dict) -> torch.Tensor:
        """The critics' observation input: every leaf flattened (scaled where not normalized)."""
        parts = []
        for leaf in self.net.leaves:
            x = obs[leaf.name].reshape(len(obs[leaf.name]), -1).float()
            if leaf.name not in self.net.normalized and leaf.scale != 1.0:
                x = x * leaf.scale
            parts.append(x)
        return torch.cat(parts, dim=1)

    def q_values(self, feats: torch.Tensor, y: torch.Tensor, q: dict) -> torch.Tensor:
        """Both critics' Q(s, y) in one batched pass: [2, batch]."""
        x = torch.cat([feats, y], dim=1).expand(2, -1, -1)
        layers = len(q) // 2
        for i in range(layers):
            x = torch.baddbmm(q[f"q.{i}.b"], x, q[f"q.{i}.w"].transpose(1, 2))
            if i < layers - 1:
                x = torch.relu(x)
        return x.squeeze(-1)

    def sample(self, obs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(y = tanh(u), log-probability of y) for u drawn from the actor (reparametrized)."""
        out = self.net.actor_torch(self.params, obs)
        d = out.shape[1] // 2
        mean, log_std = out[:, :d], out[:, d:]
        noise = torch.randn_like(mean)
        u = mean + log_std.exp() * noise
        logp = (-0.5 * noise.square() - log_std).sum(1) - d * HALF_LOG_2PI - log_tanh_derivative(u).sum(1)
        return torch.tanh(u), logp

    def target(self, next_feats, next_obs, rewards, dones, alpha) -> torch.Tensor:
        """r + gamma (1 - terminated) (min of the target critics at (s', y') - alpha log pi(y'|s'))."""
        with torch.no_grad():
            y_next, logp_next = self.sample(next_obs)
            q_next = self.q_values(next_feats, y_next, self.q_target).min(0).values - alpha * logp_next
            return rewards + self.config.gamma * (1.0 - dones) * q_next

    def gradient_step(self) -> torch.Tensor | None:
        """One gradient step of the temperature, the critics and the actor on a minibatch from
        the buffer, then the targets' Polyak step; returns its terms, or None if not finite."""
        cfg, dev = self.config, self.device
        obs, next_obs, actions, rewards, dones = self.buffer.sample(cfg.minibatch_size)
        obs = {k: tensor(v, dev) for k, v in self.normalize(obs).items()}
        next_obs = {k: tensor(v, dev) for k, v in self.normalize(next_obs).items()}
        y = ((tensor(actions, dev) - self.low) / self.half_range - 1.0).clamp(-1.0, 1.0)
        rewards, dones = tensor(rewards, dev), tensor(dones, dev)
        feats, next_feats = self.features(obs), self.features(next_obs)
        # The temperature, from the actor's log-probabilities as they are (SB3's order).
        y_pi, logp_pi = self.sample(obs)
        alpha_loss = -(self.log_alpha * (logp_pi.detach() + self.target_entropy)).mean()
        self.alpha_opt.zero_grad()
        alpha_loss.backward()
        self.alpha_opt.step()
        alpha = self.log_alpha.detach().exp()
        # The critics toward the soft Bellman target.
        target = self.target(next_feats, next_obs, rewards, dones, alpha)
        q = self.q_values(feats, y, self.q)
        critic_loss = 0.5 * (q - target).square().mean(1).sum()
        self.critic_opt.zero_grad()
        critic_loss.backward()
        self.critic_opt.step()
        # The actor: maximize min Q - alpha log pi, through the critics as they are now (not trained here).
        frozen = {k: v.detach() for k, v in self.q.items()}
        q_pi = self.q_values(feats, y_pi, frozen).min(0).values
        actor_loss = (alpha * logp_pi - q_pi).mean()
        self.actor_opt.zero_grad()
        actor_loss.backward()
        norm = self.actor_opt.step()
        with torch.no_grad():
            self.target_flat.lerp_(self.critic_opt.flat, cfg.tau)
        self.grad_steps += 1
        terms = torch.stack([actor_loss.detach(), critic_loss.detach(), q.detach().mean(), alpha[0],
                             -logp_pi.detach().mean()])
        if not bool(torch.isfinite(terms).all() & torch.isfinite(norm)):
            return None
        return terms

    # ------------------------------------------------------------ the client's distribution, in torch
    def log_prob(self, dist_inputs: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """The log-density of env actions under (mean, log_std) rows, scaling included: what a
        client reports (``shmrl.client.action_sampler.squashed_log_prob``)."""
        d = dist_inputs.shape[1] // 2
        mean, log_std = dist_inputs[:, :d], dist_inputs[:, d:]
        y = ((actions - self.low) / self.half_range - 1.0).clamp(-1 + 1e-7, 1 - 1e-7)
        u = torch.atanh(y)
        z = (u - mean) * torch.exp(-log_std)
        gauss = (-0.5 * z.square() - log_std).sum(1) - d * HALF_LOG_2PI
        return gauss - log_tanh_derivative(u).sum(1) - torch.log(self.half_range).sum()

    # ------------------------------------------------------------ checkpoints
    def get_state(self) -> tuple[dict[str, np.ndarray], dict]:
        """Everything but the replay buffer, as arrays and JSON (no pickle)."""
        arrays = {"critic.target": host(self.target_flat).copy(),
                  **{f"policy/{k}": v for k, v in self.published_weights().items()}}
        for name, opt in (("actor", self.actor_opt), ("critic", self.critic_opt), ("log_alpha", self.alpha_opt)):
            arrays.update({f"{name}.params": host(opt.flat).copy(), f"{name}.exp_avg": host(opt.exp_avg).copy(),
                           f"{name}.exp_avg_sq": host(opt.exp_avg_sq).copy()})
        if self.normalizer is not None:
            arrays.update(self.normalizer.get_state())
        values = {"adam_t": [self.actor_opt.t, self.critic_opt.t, self.alpha_opt.t], "steps_seen": self.steps_seen,
                  "grad_steps": self.grad_steps, "owed": self.owed, "buffer": "not kept: refilled after a resume"}
        return arrays, values

    def set_state(self, arrays: dict[str, np.ndarray], values: dict) -> None:
        if self.normalizer is not None:
            self.normalizer.set_state(arrays)
        for name, opt in (("actor", self.actor_opt), ("critic", self.critic_opt), ("log_alpha", self.alpha_opt)):
            for part, buf in (("params", opt.flat), ("exp_avg", opt.exp_avg), ("exp_avg_sq", opt.exp_avg_sq)):
                found = arrays[f"{name}.{part}"]
                if found.shape != tuple(buf.shape):
                    raise ValueError(f"checkpoint {name}.{part!r} has {found.shape[0]} values, this network "
                                     f"{buf.shape[0]}: was it saved with other layer sizes?")
                buf.copy_(torch.from_numpy(found))
        self.target_flat.copy_(torch.from_numpy(arrays["critic.target"]))
        self.actor_opt.t, self.critic_opt.t, self.alpha_opt.t = values["adam_t"]
        self.steps_seen, self.grad_steps, self.owed = values["steps_seen"], values["grad_steps"], values["owed"]
