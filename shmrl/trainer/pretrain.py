"""``--pretrain DATASET``: start from demonstrations. SAC takes the recorded episodes into
its replay buffer (``recorded_batches``; ``shmrl.trainer.setup.make_learners``); PPO, which
learns only from its own policy's samples, is cloned from them:

Before the first weights are published, each policy is cloned from its recorded episodes
(``shmrl.files.dataset``): the actor by maximum likelihood of the recorded actions (behaviour
cloning), the critic by regression on the returns of the recorded rewards (GAE returns
with the critic of the round before, so that truncated episodes are bootstrapped, in a
few rounds), for ``--pretrain-steps`` minibatches of 512 env steps. The observation statistics and, with ``--normalize-reward``, the reward
scale start from the dataset's. A tenth of the episodes (at least one, when there are
two or more) is held out, and the log says how well the clone fits them: the actions'
mean log-likelihood, how often the most likely action is the recorded one (a single
Discrete action) or the mean's distance to it (a single Box), and the value function's
explained variance. A dataset of another env, a damaged manifest, or one with a value
that is not finite or beyond ``--max-obs-abs`` / ``--max-reward-abs`` is refused
(ConfigError); a damaged shard is passed over with a warning.
"""
from __future__ import annotations

import time

import numpy as np

from shmrl.core import spaces
from shmrl.config.settings import ConfigError, env_name
from shmrl.files.dataset import Dataset, DatasetError, ValueBounds
from shmrl.server.store import PolicyChunks

ROUNDS = 5                 # the value targets are recomputed with the critic this often
MINIBATCH = 512            # steps per gradient step of the clone (more than PPO's: it is plain regression)
HOLD_OUT = 0.1


def dataset_policy(dataset: Dataset, pid: str, spec) -> str:
    """The dataset's policy whose episodes train run policy ``pid`` (the same id, or the
    only one of each), checked against its spaces; a ConfigError if none fits."""
    ids = list(dataset.policy_spaces)
    source = pid if pid in ids else (ids[0] if len(ids) == 1 else None)
    if source is None:
        raise ConfigError(f"--pretrain {dataset.path}: it holds policies {ids}, none of them {pid!r}")
    obs_space, action_space = dataset.policy_spaces[source]
    if (spaces.obs_layout(obs_space).leaves, spaces.action_layout(action_space).parts) != \
            (spec.obs.leaves, spec.actions.parts):
        raise ConfigError(f"--pretrain {dataset.path}: its episodes (of {dataset.env}) have other observation "
                          f"or action spaces than {spec.env_id}'s")
    return source


def recorded_batches(config, nets: dict) -> dict:
    """Each policy's recorded episodes in ``config.pretrain`` (policy id -> an EpisodeBatch,
    one chunk per episode); a ConfigError for a dataset of another env or other spaces, a
    damaged manifest, or values the learner would refuse from a client (they would poison
    the clone or the buffer)."""
    try:
        dataset = Dataset(config.pretrain, ValueBounds(config.max_obs_abs, config.max_reward_abs))
        if dataset.env != env_name(config.env):
            raise DatasetError(f"{dataset.path}: its episodes are of env {dataset.env!r}, not {env_name(config.env)!r}")
        sources = {pid: dataset_policy(dataset, pid, net.spec) for pid, net in nets.items()}
        return {pid: dataset.batch(source) for pid, source in sources.items()}
    except DatasetError as e:
        raise ConfigError(f"--pretrain: {e}") from None


def pretrain_policies(config, nets: dict, first_weights: dict) -> dict:
    """Clone each policy (policy id -> PolicyNet) from ``config.pretrain``. Returns policy id
    -> (the PPO state to start from, as ``PPO.get_state``, and the reward statistics'
    arrays or None)."""
    import torch

    from shmrl.model.ppo import PPO

    if config.memory not in (None, "none"):
        raise ConfigError("--pretrain clones feed-forward policies; give --memory none")
    batches = recorded_batches(config, nets)
    torch.set_num_threads(config.torch_threads or 1)
    out = {}
    for i, (pid, net) in enumerate(nets.items()):
        ppo = PPO(net, config, seed=config.seed + i, initial_weights=first_weights[pid])
        reward_stats, report = clone(ppo, batches[pid], config, config.seed + i)
        print(f"pretrain: policy {pid!r}: {report}", flush=True)
        out[pid] = (ppo.get_state(), reward_stats)
    return out


def clone(ppo, episodes, config, seed: int) -> tuple[dict | None, str]:
    """Behaviour-clone ``ppo``'s actor and fit its critic on ``episodes`` (an EpisodeBatch,
    one chunk per episode); returns (the reward statistics' arrays, or None, and the
    report of the fit on the held-out episodes)."""
    import torch

    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    n = episodes.num_chunks
    held = np.zeros(n, bool)
    if n >= 2:
        held[rng.choice(n, max(1, round(HOLD_OUT * n)), replace=False)] = True
    train, test = episodes.select(~held), episodes.select(held)
    rewards = PolicyChunks(reward_gamma=config.gamma if config.normalize_reward else None)
    rewards.add("dataset", train)
    scale = config.reward_scale * rewards.reward_scale()
    ppo.update_obs_stats(train)
    opt = ppo.optimizer
    per_round = max(1, config.pretrain_steps // ROUNDS)
    for _ in range(ROUNDS):
        batch = ppo.make_batch(train, reward_scale=scale)
        obs = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in batch.obs.items()}
        actions = torch.from_numpy(batch.actions.astype(ppo.layout.action_dtype, copy=False))
        returns = torch.from_numpy(batch.returns)
        for rows in minibatches(rng, len(batch), per_round):
            out, values = ppo.forward({k: v[rows] for k, v in obs.items()})
            logp, _ = ppo.log_prob(out, actions[rows], entropy=False)
            loss = -logp.mean() + config.vf_coef * 0.5 * (values - returns[rows]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            if torch.isfinite(opt.flat_grad.norm()):   # a step whose gradient is not finite is not taken
                opt.step(config.max_grad_norm)
    with torch.no_grad():   # PPO starts with fresh moments: the clone's would steer its first steps
        opt.exp_avg.zero_()
        opt.exp_avg_sq.zero_()
    opt.t = 0
    fit = fit_report(ppo, test if test.num_chunks else train, scale)
    where = f"{test.num_chunks} held-out episodes" if test.num_chunks else "its training episodes (too few to hold any out)"
    return (rewards.reward_stats.get_state("reward_stats") if rewards.reward_stats is not None else None,
            f"{train.num_chunks} episodes ({train.num_steps} steps), {ROUNDS * per_round} gradient steps "
            f"({ROUNDS * per_round * MINIBATCH / max(train.num_steps, 1):.0f} epochs) in "
            f"{time.perf_counter() - t0:.1f} s; on {where}: {fit}")


def minibatches(rng, rows: int, count: int):
    """``count`` minibatches of row indices (tensors), epoch after epoch of shuffled rows."""
    import torch

    done = 0
    while done < count:
        perm = torch.from_numpy(rng.permutation(rows))
        for start in range(0, rows, MINIBATCH):
            if done == count:
                return
            yield perm[start:start + MINIBATCH]
            done += 1


def fit_report(ppo, episodes, reward_scale: float) -> str:
    """How well the policy and value function fit ``episodes``, in words."""
    import torch

    batch = ppo.make_batch(episodes, reward_scale=reward_scale)
    with torch.no_grad():
        out, values = ppo.forward(batch.obs)
        actions = torch.from_numpy(batch.actions.astype(ppo.layout.action_dtype, copy=False))
        logp, _ = ppo.log_prob(out, actions, entropy=False)
    parts = [f"action log-likelihood {float(logp.mean()):.3f}/step"]
    if ppo.layout.single_discrete:
        parts.append(f"action accuracy {float((out.argmax(-1) == actions).float().mean()):.3f}")
    elif ppo.layout.single_box:
        parts.append(f"mean |action - clone's mean| {float((out - actions).abs().mean()):.3f}")
    returns = batch.returns
    residual = returns - values.numpy()
    explained = 1.0 - float(np.var(residual)) / max(float(np.var(returns)), 1e-8)
    parts.append(f"value explained variance {explained:.3f} (RMSE {float(np.sqrt(np.mean(residual ** 2))):.3f}, "
                 f"returns' std {float(np.std(returns)):.3f})")
    return ", ".join(parts)
