"""The client's side of the action distribution, in numpy: ``ActionSampler`` draws an action per
row of ``action_dist_inputs`` (the policy's output 0, laid out as ``shmrl.core.spaces``
describes: logits per categorical part, then means and log-stds per Gaussian part), gives
its log-probability, and the greedy action for evaluation.

The learner's side (log-probabilities and entropy in torch) is ``shmrl.model.ppo.PPO.log_prob``;
tests/test_actor.py checks that the two agree.

SAC's policy (``dist`` ``squashed_gaussian``, which its ONNX model's metadata and SET_CONFIG's
``action_dist`` name: docs/RLLINK.md §4.2) gives the same (mean, log_std) before a squash:
u ~ N(mean, exp(log_std)), the action low + (tanh(u) + 1) / 2 x (high - low), its
log-probability that of u less the log of the squash's and the scaling's derivatives
(``squashed_log_prob``; ``shmrl.model.sac.SAC.log_prob`` is the torch side, tests/test_sac.py
checks they agree). ``uniform``: actions uniform within the Box's bounds, whatever the policy
says (SAC's warm-up, which SET_STATE's ``action_dist`` asks for). Used by ``shmrl.client.actor`` in every simulator
and by eval; like every client module, this never imports torch.
"""
from __future__ import annotations

import math

import numpy as np

from shmrl.core.spaces import ActionLayout

HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)
LOG_2 = math.log(2.0)
DISTS = ("gaussian", "squashed_gaussian", "uniform")   # how a Box's output 0 is sampled
# What a client of this module says it samples beyond RLlib's distributions, in its PING's
# ``action_dists`` (docs/RLLINK.md §3.1): a --algo sac learner refuses a client that does not.
PING_ACTION_DISTS = ["squashed_gaussian", "uniform"]


def log_tanh_derivative(u: np.ndarray) -> np.ndarray:
    """log(1 - tanh(u)^2), without the loss of precision of 1 - tanh(u)^2 near +-1:
    2 (log 2 - u - softplus(-2u))."""
    return 2.0 * (LOG_2 - u - np.logaddexp(0.0, -2.0 * u))


def squashed_log_prob(u: np.ndarray, noise: np.ndarray, log_std: np.ndarray, half_range: np.ndarray) -> np.ndarray:
    """The log-density, per row, of the action low + (tanh(u) + 1) x half_range where
    u = mean + exp(log_std) x noise."""
    gauss = (-0.5 * noise * noise - log_std).sum(axis=1) - u.shape[1] * HALF_LOG_2PI
    return gauss - log_tanh_derivative(u).sum(axis=1) - np.log(half_range).sum()


class ActionSampler:
    """Samples an action per row of ``action_dist_inputs`` and gives its log-probability.

    A single Discrete with few logits is sampled in plain Python from a block of uniform
    numbers (numpy's per-call cost is more than a CartPole step); anything else with
    numpy: Gumbel-max per categorical part, a draw per Gaussian part. Masked actions
    arrive with logits of -1e9 (the graph applies the mask), so they are never drawn.
    """

    SMALL = 64  # logits up to this many numbers are sampled row by row in plain Python

    def __init__(self, layout: ActionLayout, rng: np.random.Generator, block: int = 4096, dist: str | None = None):
        self.layout, self.rng, self.block = layout, rng, block
        self._u, self._i = rng.random(block).tolist(), 0
        self.dist = "gaussian"
        self.set_dist(dist)

    def set_dist(self, dist: str | None) -> None:
        """Sample a Box's output 0 as ``dist`` (one of DISTS; None: a plain Gaussian)."""
        dist = dist or "gaussian"
        if dist not in DISTS:
            raise ValueError(f"action_dist {dist!r} is not one of {list(DISTS)}")
        if dist != "gaussian" and not self.layout.single_box:
            raise ValueError(f"action_dist {dist!r} takes a single Box action space")
        if dist != "gaussian":
            part = self.layout.parts[0]
            self.low = np.asarray(part.low, np.float32)
            self.half_range = (np.asarray(part.high, np.float64) - part.low).astype(np.float32) / 2
        self.dist = dist

    def _uniform(self) -> float:
        if self._i == self.block:
            self._u, self._i = self.rng.random(self.block).tolist(), 0
        u = self._u[self._i]
        self._i += 1
        return u

    def sample(self, dist_inputs: np.ndarray):
        """(actions, log-probabilities): a list of ints and of floats for a single Discrete,
        else arrays in the stored action form."""
        layout = self.layout
        if layout.single_discrete and dist_inputs.size <= self.SMALL:
            return self._categorical_small(dist_inputs)
        if layout.single_box:
            if self.dist == "squashed_gaussian":
                return self._squashed(dist_inputs)
            if self.dist == "uniform":
                return self._uniform_box(len(dist_inputs))
            return self._gaussian(dist_inputs)
        n = len(dist_inputs)
        actions = np.zeros((n, layout.action_size), layout.action_dtype)
        logp = np.zeros(n)
        for part, dist, cols in layout.slices():
            x = dist_inputs[:, dist]
            if part.kind == "categorical":
                a, lp = self._categorical(x)
                actions[:, cols.start] = a
            else:
                a, lp = self._gaussian(x)
                actions[:, cols] = a
            logp += lp
        if layout.single_discrete:
            return actions[:, 0].tolist(), logp.tolist()
        return actions, logp

    def _categorical_small(self, logits: np.ndarray):
        # A handful of numbers: plain Python beats numpy, whose every call costs
        # microseconds (about 12 us for 4 envs x 2 actions here, against about 45).
        actions, logps = [], []
        for row in logits.tolist():
            m = max(row)
            exps = [math.exp(v - m) for v in row]
            total = sum(exps)
            threshold, acc, action = self._uniform() * total, 0.0, len(row) - 1
            for i, e in enumerate(exps):
                acc += e
                if threshold < acc:
                    action = i
                    break
            actions.append(action)
            logps.append(row[action] - m - math.log(total))
        return actions, logps

    def _categorical(self, logits: np.ndarray):
        gumbel = -np.log(-np.log(self.rng.random(logits.shape)))
        actions = np.argmax(logits + gumbel, axis=1)
        m = logits.max(axis=1, keepdims=True)
        lse = m[:, 0] + np.log(np.exp(logits - m).sum(axis=1))
        return actions, logits[np.arange(len(logits)), actions] - lse

    def _gaussian(self, dist_inputs: np.ndarray):
        """All means, then all log-stds (RLlib's DiagGaussian layout); actions unclipped."""
        d = dist_inputs.shape[1] // 2
        mean, log_std = dist_inputs[:, :d], dist_inputs[:, d:]
        noise = self.rng.standard_normal(mean.shape, dtype=np.float32)
        actions = mean + np.exp(log_std) * noise
        logp = (-0.5 * noise * noise - log_std).sum(axis=1) - d * HALF_LOG_2PI
        return actions, logp

    def _squashed(self, dist_inputs: np.ndarray):
        """SAC's: u ~ N(mean, exp(log_std)), the action low + (tanh(u) + 1) x half range."""
        d = dist_inputs.shape[1] // 2
        mean, log_std = dist_inputs[:, :d], dist_inputs[:, d:]
        noise = self.rng.standard_normal(mean.shape, dtype=np.float32)
        u = mean + np.exp(log_std) * noise
        actions = self.low + (np.tanh(u) + 1) * self.half_range
        return actions.astype(np.float32), squashed_log_prob(u, noise, log_std, self.half_range)

    def _uniform_box(self, n: int):
        """Uniform within the bounds (SAC's warm-up): the log-density is -log of the volume."""
        actions = self.low + self.rng.random((n, len(self.low)), dtype=np.float32) * 2 * self.half_range
        return actions.astype(np.float32), np.full(n, -np.log(2 * self.half_range.astype(np.float64)).sum())

    def greedy(self, dist_inputs: np.ndarray):
        """The most likely action of every part (a categorical's argmax, a Gaussian's mean;
        a squashed Gaussian's squashed mean, as SAC evaluates)."""
        layout = self.layout
        if layout.single_box and self.dist != "gaussian":
            d = dist_inputs.shape[1] // 2
            return (self.low + (np.tanh(dist_inputs[:, :d]) + 1) * self.half_range).astype(np.float32)
        actions = np.zeros((len(dist_inputs), layout.action_size), layout.action_dtype)
        for part, dist, cols in layout.slices():
            x = dist_inputs[:, dist]
            if part.kind == "categorical":
                actions[:, cols.start] = x.argmax(axis=1)
            else:
                actions[:, cols] = x[:, :part.size]
        return actions[:, 0] if layout.single_discrete else actions
