"""Running statistics and discounted sums over episode chunks, in numpy (no torch): what
observation normalization, reward scaling and GAE are made of."""
from __future__ import annotations

import numpy as np


class RunningMeanStd:
    """Mean and variance of everything ``update`` has seen, per element of ``shape``
    (Chan et al.'s parallel algorithm, in float64, as stable-baselines3's VecNormalize)."""

    def __init__(self, shape: tuple = (), epsilon: float = 1e-4):
        self.mean = np.zeros(shape, np.float64)
        self.var = np.ones(shape, np.float64)
        self.count = epsilon   # as if one tiny batch of mean 0 and variance 1 had been seen

    def update(self, x: np.ndarray) -> None:
        x = np.asarray(x, np.float64).reshape(-1, *self.mean.shape)
        n = len(x)
        if not n:
            return
        mean, var = x.mean(axis=0), x.var(axis=0)
        delta, total = mean - self.mean, self.count + n
        self.mean = self.mean + delta * n / total
        self.var = (self.var * self.count + var * n + delta ** 2 * self.count * n / total) / total
        self.count = total

    def get_state(self, prefix: str) -> dict[str, np.ndarray]:
        return {f"{prefix}.mean": self.mean.copy(), f"{prefix}.var": self.var.copy(),
                f"{prefix}.count": np.array(self.count)}

    def set_state(self, arrays: dict[str, np.ndarray], prefix: str) -> None:
        mean, var = arrays[f"{prefix}.mean"], arrays[f"{prefix}.var"]
        if mean.shape != self.mean.shape or var.shape != self.var.shape:
            raise ValueError(f"checkpoint {prefix!r} statistics have shape {mean.shape}, this run's {self.mean.shape}")
        self.mean, self.var, self.count = mean.astype(np.float64), var.astype(np.float64), float(arrays[f"{prefix}.count"])


def discounted_sums(x: np.ndarray, discount: float, initial: np.ndarray | None = None,
                    reverse: bool = False) -> np.ndarray:
    """Row by row, ``y[t] = x[t] + discount * y[t - 1]`` (``y[-1] = initial``, default 0),
    or with ``reverse`` ``y[t] = x[t] + discount * y[t + 1]`` (``y[T] = initial``): the
    discounted returns of rewards, GAE's advantages from TD errors.

    ``x`` is [rows, T] (chunks padded with zeros: a zero after a chunk's end keeps the
    recursion exact for a reverse sum). Blocks of 64 steps are summed with one matrix
    product each and carried into the next with a Python step per block, not per step:
    about T/64 steps of Python for any number of rows."""
    x = np.asarray(x, np.float64)
    if reverse:
        return discounted_sums(x[:, ::-1], discount, initial)[:, ::-1]
    rows, T = x.shape
    block = 64
    nb = -(-T // block)
    padded = np.zeros((rows, nb * block))
    padded[:, :T] = x
    padded = padded.reshape(rows, nb, block)
    k = np.arange(block)
    powers = discount ** np.maximum(k[:, None] - k[None, :], 0) * (k[:, None] >= k[None, :])  # [t, s]
    local = padded @ powers.T                          # sums within each block
    decay = discount ** (k + 1)                        # what the carry into a block is worth at each step
    carry = np.zeros(rows) if initial is None else np.asarray(initial, np.float64).reshape(rows)
    for b in range(nb):
        local[:, b] += carry[:, None] * decay
        carry = local[:, b, -1]
    return local.reshape(rows, nb * block)[:, :T]
