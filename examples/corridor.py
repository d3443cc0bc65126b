"""A simulator of your own, as small as one gets: walk right along a corridor to its end.

    python -m shmrl.run --env examples.corridor:make_env --sims 2     # from the repository's root

What shmrl needs of an env is gymnasium's interface: ``observation_space`` and
``action_space`` (gymnasium spaces), ``reset(seed=None) -> (obs, info)`` and
``step(action) -> (obs, reward, terminated, truncated, info)``. ``make_env`` is what
``--env package.module:make_env`` calls, once in every simulator process.
"""
import numpy as np
from gymnasium import spaces


class Corridor:
    """The agent starts at cell 0 of ``length`` cells; action 1 steps right, 0 left. Reaching
    the last cell ends the episode with reward 1; every step costs 0.01; after 3 x length
    steps the episode is cut short (truncated). The best return is 1 - 0.01 x (length - 1)."""

    def __init__(self, length: int = 8):
        self.length = length
        self.observation_space = spaces.Box(0.0, 1.0, (length,), np.float32)   # the cell, one-hot
        self.action_space = spaces.Discrete(2)
        self.spec = None   # no registered gymnasium spec: give --stop-return (or train to the budget)
        self.position = self.steps = 0

    def _obs(self) -> np.ndarray:
        obs = np.zeros(self.length, np.float32)
        obs[self.position] = 1.0
        return obs

    def reset(self, seed=None, options=None):
        self.position = self.steps = 0
        return self._obs(), {}

    def step(self, action):
        self.position = max(0, min(self.length - 1, self.position + (1 if int(action) == 1 else -1)))
        self.steps += 1
        terminated = self.position == self.length - 1
        reward = (1.0 if terminated else 0.0) - 0.01
        return self._obs(), reward, terminated, self.steps >= 3 * self.length, {}


def make_env():
    return Corridor()
