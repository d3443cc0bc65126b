"""Throttled gymnasium envs: a stand-in for a slow simulator (a game engine, a robot), for
shmrl and stable-baselines3 alike. Plain gymnasium, no shmrl: rl-zoo3's virtualenv imports
it too.

Every process steps at most $SLOW_SIM_STEPS_PER_S env steps per second, all its envs
together (one pace per process: a simulator with several envs, or SB3's DummyVecEnv):
each step waits for its slot, 1/rate after the last one's, and a process that stood idle
gets no burst afterwards. S processes (S simulators, or S ``python -m shmrl.sim --connect``
clients) throttled to N/S hold N env steps per second in all; tools/slow_sims.py sets it.

    SLOW_SIM_STEPS_PER_S=250 PYTHONPATH=. python -m shmrl.run --env tools.slow_sim:half_cheetah --sims 4
    SLOW_SIM_STEPS_PER_S=1000 PYTHONPATH=. python -m rl_zoo3.train --gym-packages tools.slow_sim \\
        --env ThrottledHalfCheetah-v5 ...

shmrl takes the factories below (``--env tools.slow_sim:half_cheetah``); gymnasium (and so
rl-zoo3, ``--gym-packages tools.slow_sim``) the ids ``Throttled<ID>`` this module registers. With
tools/slow_site on PYTHONPATH (its sitecustomize.py calls ``throttle_base_ids``) the base
ids themselves are throttled in every process that has $SLOW_SIM_STEPS_PER_S: shmrl then
trains ``--env gym:HalfCheetah-v5`` with that env's own presets and slow profile, as it
would a slow engine of that env (tools/slow_sims.py does so).

    SLOW_SIM_STEPS_PER_S=250 PYTHONPATH=tools/slow_site:. python -m shmrl.run --env gym:Hopper-v5 --sims 4
"""
from __future__ import annotations

import dataclasses
import os
import time

import gymnasium

RATE_VAR = "SLOW_SIM_STEPS_PER_S"
# shmrl's factory (--env tools.slow_sim:NAME) -> the gymnasium env it throttles.
BASE_IDS = {"half_cheetah": "HalfCheetah-v5", "hopper": "Hopper-v5", "cart_pole": "CartPole-v1",
            "inverted_pendulum": "InvertedPendulum-v5", "mountain_car": "MountainCarContinuous-v0",
            "pendulum": "Pendulum-v1"}


class Pace:
    """Slots 1/rate seconds apart: ``wait()`` returns at the next one."""

    def __init__(self, steps_per_s: float):
        self.interval, self.next = 1.0 / steps_per_s, 0.0

    def wait(self) -> None:
        now = time.perf_counter()
        slot = max(self.next, now)   # a process that stood idle gets no burst
        if slot > now:
            time.sleep(slot - now)
        self.next = slot + self.interval


_pace: Pace | None = None


def process_pace() -> Pace | None:
    """This process's pace, from $SLOW_SIM_STEPS_PER_S (unset or 0: unthrottled)."""
    global _pace
    rate = float(os.environ.get(RATE_VAR) or 0)
    if rate <= 0:
        return None
    if _pace is None or abs(_pace.interval * rate - 1) > 1e-9:
        _pace = Pace(rate)
    return _pace


class Throttled(gymnasium.Wrapper):
    """``env``, each step waiting for this process's pace."""

    def __init__(self, env):
        super().__init__(env)
        self.pace = process_pace()

    def step(self, action):
        if self.pace is not None:
            self.pace.wait()
        return self.env.step(action)


def make(base_id: str, **kwargs):
    return Throttled(gymnasium.make(base_id, **kwargs))


# shmrl's factories (--env tools.slow_sim:half_cheetah), plain functions: they pickle by name.
def half_cheetah():
    return make("HalfCheetah-v5")


def hopper():
    return make("Hopper-v5")


def cart_pole():
    return make("CartPole-v1")


def inverted_pendulum():
    return make("InvertedPendulum-v5")


def mountain_car():   # continuous control without mujoco: the tests' slow simulator
    return make("MountainCarContinuous-v0")


def pendulum():   # SAC's slow test (tests/test_sac.py): gymnasium's Pendulum, throttled
    return make("Pendulum-v1")


for _base in BASE_IDS.values():
    if "Throttled" + _base not in gymnasium.registry:
        gymnasium.register("Throttled" + _base, entry_point=f"{__name__}:make", kwargs={"base_id": _base},
                           reward_threshold=gymnasium.spec(_base).reward_threshold)


def _throttled_entry(_base_entry, **kwargs):
    """The entry point of a base id under ``throttle_base_ids``: its own env, throttled."""
    from gymnasium.envs.registration import load_env_creator

    creator = load_env_creator(_base_entry) if isinstance(_base_entry, str) else _base_entry
    return Throttled(creator(**kwargs))


def throttle_base_ids() -> None:
    """Throttle the base ids (HalfCheetah-v5, ...) in gymnasium's registry under their own
    names, in this process and those it forks (tools/slow_site/sitecustomize.py)."""
    for base in BASE_IDS.values():
        spec = gymnasium.registry[base]
        if spec.entry_point is not _throttled_entry:
            gymnasium.registry[base] = dataclasses.replace(
                spec, entry_point=_throttled_entry, kwargs={**spec.kwargs, "_base_entry": spec.entry_point})
