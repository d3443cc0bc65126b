"""The PettingZoo env adapter: ``--env pz:NAME``, the spec of a PettingZoo env, and
stepping its agents.

An env is multi-agent when it is a PettingZoo ``ParallelEnv`` (every live agent acts at
each step) or ``AECEnv`` (agents act in turn, as in connect_four); ``--env pz:NAME``
makes ``NAME``'s ``parallel_env()`` where it has one, else its ``env()``, from
``pettingzoo.classic``/``butterfly``/``sisl`` or ``mpe2``.

Turn-based (AEC) envs are stepped turn by turn: an agent's step ends when its next turn
comes (or its episode ends), with the reward it got meanwhile (``env.last()``'s
cumulative reward), so a reward given at the end of a game goes to both players.

PettingZoo itself is imported only when a ``pz:`` env is made: this module is part of
the env registry (``shmrl.envs.make``), which every simulator imports.
"""
from __future__ import annotations

import importlib

from shmrl.envs.spec import MultiAgentSpec, space_spec

PZ_PACKAGES = ("pettingzoo.classic", "pettingzoo.butterfly", "pettingzoo.sisl", "mpe2")


def is_multiagent(env) -> bool:
    """A PettingZoo env (Parallel or AEC): its spaces are functions of the agent."""
    return hasattr(env, "possible_agents") and callable(getattr(env, "observation_space", None))


def is_turn_based(env) -> bool:
    """An AECEnv (one agent at a time), not a ParallelEnv."""
    return hasattr(env, "agent_selection") or hasattr(env, "agent_iter")


def pz_make(name: str):
    """``pettingzoo.<family>.<name>`` or ``mpe2.<name>``: its parallel_env() if it has one,
    else its env(). Where the module has a ``raw_env``, it is used without PettingZoo's
    safety wrappers (order enforcement, bounds assertions, ending the game on an illegal
    move), which cost about 2/3 of a connect_four or simple_spread step here: shmrl
    steps the API in order, and its policies never choose a masked action."""
    import warnings

    for package in PZ_PACKAGES:
        try:
            with warnings.catch_warnings():   # PettingZoo 1.27 deprecates these modules for its registry,
                warnings.simplefilter("ignore", DeprecationWarning)   # whose envs come wrapped
                module = importlib.import_module(f"{package}.{name}")
        except ImportError as e:
            if getattr(e, "name", "") not in (f"{package}.{name}", package, package.split(".")[0]):
                raise ValueError(f"--env pz:{name}: {e} (pip install -e '.[pettingzoo]' in shmrl's clone)") from None
            continue
        raw = getattr(module, "raw_env", None)
        if raw is not None:
            if hasattr(module, "parallel_env"):
                from pettingzoo.utils.conversions import aec_to_parallel

                return aec_to_parallel(raw())
            return raw()
        make = getattr(module, "parallel_env", None) or getattr(module, "env")
        return make()
    raise ValueError(f"--env pz:{name}: no such env in {', '.join(PZ_PACKAGES)} (installed: pip install "
                     f"'shmrl[pettingzoo]' and 'shmrl[mpe2]')")


def multiagent_spec(env, env_id: str) -> MultiAgentSpec:
    return MultiAgentSpec(env_id, tuple(env.possible_agents),
                          {a: space_spec(f"{env_id}[{a}]", env.observation_space(a), env.action_space(a))
                           for a in env.possible_agents}, is_turn_based(env))


# ------------------------------------------------------------------ stepping

class ParallelStepper:
    """A ParallelEnv as turns: every live agent acts at once."""

    def __init__(self, env, seed: int | None):
        self.env, self.seed = env, seed

    def reset(self) -> dict:
        obs, _ = self.env.reset(seed=self.seed)
        self.seed = None
        return dict(obs)

    def step(self, actions: dict) -> tuple[dict, dict, bool]:
        """(results: agent -> (next obs, reward, terminated, truncated) of the agents that
        acted, the agents to act next -> obs, whether the episode is over)."""
        obs, rewards, terms, truncs, _ = self.env.step(actions)
        results = {a: (obs[a], float(rewards.get(a, 0.0)), bool(terms.get(a, False)), bool(truncs.get(a, False)))
                   for a in actions if a in obs}
        live = set(self.env.agents)
        to_act = {a: o for a, o in obs.items() if a in live and not (terms.get(a) or truncs.get(a))}
        return results, to_act, not to_act


class TurnStepper:
    """An AECEnv stepped turn by turn: an agent's step ends at its next turn or its end."""

    def __init__(self, env, seed: int | None):
        self.env, self.seed = env, seed
        self.acted: set = set()     # agents whose last action still waits for its outcome

    def reset(self) -> dict:
        self.env.reset(seed=self.seed)
        self.seed = None
        self.acted = set()
        return self._advance({})[1]

    def step(self, actions: dict) -> tuple[dict, dict, bool]:
        (agent, action), = actions.items()
        self.env.step(action)
        self.acted.add(agent)
        results, to_act = self._advance({})
        return results, to_act, not to_act

    def _advance(self, results: dict) -> tuple[dict, dict]:
        env = self.env
        while env.agents:
            agent = env.agent_selection
            obs, reward, term, trunc, _ = env.last()
            if agent in self.acted:
                self.acted.discard(agent)
                results[agent] = (obs, float(reward), bool(term), bool(trunc))
            if term or trunc:
                env.step(None)
                continue
            return results, {agent: obs}
        return results, {}


def stepper(env, seed: int | None):
    return TurnStepper(env, seed) if is_turn_based(env) else ParallelStepper(env, seed)
