"""What the learner and the simulators know about an env: its spaces, as an ``EnvSpec``
(one agent) or a ``MultiAgentSpec`` (one EnvSpec per agent), and the map from agents to
the policies that play them (``--policy-map``).

The lowest module of the env adapters: ``shmrl.envs.make`` (the registry), ``shmrl.envs.pettingzoo_envs``
(PettingZoo) and everything above them build specs from here; it imports only
``shmrl.core.spaces`` (and the name of a declared env, ``shmrl.config.settings``).

An env's spaces travel in RLlink in one format (docs/RLLINK.md §11): SET_CONFIG describes
them to a client (``space_config``), and a client with no Python env declares its own in
GET_CONFIG the same way (§3.2), from which a learner started without --env builds its spec
(``declared_spec``).
"""
from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from shmrl.config.settings import DECLARED_ENV
from shmrl.core import spaces

SHARED_POLICY = "shared"
POLICY_MAPS = ("shared", "per-agent")


@dataclass(frozen=True)
class EnvSpec:
    """What the learner needs to know about an environment to check clients' data: its
    spaces (``shmrl.core.spaces``) and how observations and actions are laid out."""
    env_id: str
    observation_space: object
    action_space: object
    reward_threshold: float | None = None  # the return at which it counts as solved, if known
    max_episode_steps: int | None = None   # its time limit: the step at which it truncates an episode, if known
    multiagent = False   # a MultiAgentSpec's is True: one spec type or the other, asked the same way

    @functools.cached_property
    def obs(self) -> spaces.ObsLayout:
        return spaces.obs_layout(self.observation_space)

    @functools.cached_property
    def actions(self) -> spaces.ActionLayout:
        return spaces.action_layout(self.action_space)

    @property
    def obs_shape(self) -> tuple:
        """The shape of a flat observation (the only leaf of a non-structured space)."""
        return self.obs.leaves[0].shape

    @property
    def continuous(self) -> bool:
        """A single Box action (a diagonal Gaussian policy)."""
        return self.actions.single_box

    @property
    def policy_outputs(self) -> int:
        """Size of the policy's output: logits, means and log-stds of every action part."""
        return self.actions.dist_size


def space_spec(env_id: str, observation_space, action_space, threshold: float | None = None,
               max_episode_steps: int | None = None) -> EnvSpec:
    """The EnvSpec of these spaces, checked (an action mask must fit the actions)."""
    spec = EnvSpec(env_id, spaces.from_gym(observation_space), spaces.from_gym(action_space),
                   None if threshold is None else float(threshold), max_episode_steps)
    try:
        layout, actions = spec.obs, spec.actions
    except ValueError as e:
        raise ValueError(f"{env_id}: {e}") from None
    mask = layout.mask
    if mask is not None and mask.shape != (len(actions.mask_columns),):
        raise ValueError(f"{env_id}: the observation's action_mask has shape {mask.shape}; it must have one "
                         f"entry per value of every Discrete action part ({len(actions.mask_columns)})")
    return spec


def space_config(spec: EnvSpec) -> dict:
    """SET_CONFIG's description of the env's spaces, for clients that run no policy: the
    observation's shape and dtype (a structured one's leaves), and the action space as
    ACTIONS carries it."""
    leaves = spec.obs.leaves
    out = {}
    if spec.obs.structured:
        out["observation_leaves"] = {leaf.name: {"shape": list(leaf.shape), "dtype": np.dtype(leaf.dtype).str}
                                     for leaf in leaves}
    else:
        out["observation_shape"] = list(leaves[0].shape)
        out["observation_dtype"] = np.dtype(leaves[0].dtype).str
    out["action_space"] = action_space(spec.actions)
    return out


def action_space(layout) -> dict:
    """The action space as ACTIONS carries it: Discrete (n), Box (shape, low, high),
    MultiDiscrete (nvec: every part categorical) or, for mixed parts, Parts (each part's
    columns of a float32 row)."""
    parts = layout.parts
    if layout.single_discrete:
        return {"type": "Discrete", "n": parts[0].size, **({"start": parts[0].start} if parts[0].start else {})}
    if layout.single_box:
        return {"type": "Box", "shape": [parts[0].size], "low": list(parts[0].low), "high": list(parts[0].high)}
    if layout.discrete:
        return {"type": "MultiDiscrete", "nvec": [p.size for p in parts]}
    return {"type": "Parts", "parts": [{"type": "Discrete", "n": p.size} if p.kind == "categorical" else
                                       {"type": "Box", "shape": [p.size], "low": list(p.low), "high": list(p.high)}
                                       for p in parts]}


def declaration(spec) -> dict:
    """The fields of a GET_CONFIG that declares ``spec``'s spaces (docs/RLLINK.md §3.2), or
    {} where they cannot be declared (a multi-agent env, an observation that is not one
    float32 array, mixed action parts, a Box action without finite bounds)."""
    if spec.multiagent:
        return {}
    config = space_config(spec)
    action = config["action_space"]
    if config.get("observation_dtype") != "<f4" or action["type"] not in ("Discrete", "Box", "MultiDiscrete"):
        return {}
    if action["type"] == "Box" and not np.isfinite([*action["low"], *action["high"]]).all():
        return {}
    return config


def declared_spec(declared: dict) -> EnvSpec:
    """The EnvSpec of the spaces a client declared (GET_CONFIG's fields, as
    ``rllink.declared_spaces`` normalized them): a float32 observation of that shape
    without bounds, and the action space. Its env is named ``declared``."""
    shape = tuple(declared["observation_shape"])
    observation = spaces.Box((-np.inf,), (np.inf,), shape, "float32")
    action = declared["action_space"]
    if action["type"] == "Discrete":
        action_space = spaces.Discrete(action["n"], action.get("start", 0))
    elif action["type"] == "MultiDiscrete":
        action_space = spaces.MultiDiscrete(tuple(action["nvec"]))
    else:
        action_space = spaces.Box(tuple(action["low"]), tuple(action["high"]), tuple(action["shape"]), "float32")
    return space_spec(DECLARED_ENV, observation, action_space)


def declared_differs(declared: dict, spec) -> str | None:
    """Why spaces a client declared are not those of ``spec`` (a single-agent env's),
    naming both, or None when they are."""
    ours = space_config(spec)
    if space_config(declared_spec(declared)) == ours:
        return None
    return f"its declared spaces {_said(declared)} are not the learner's {spec.env_id} {_said(ours)}"


def _said(config: dict) -> str:
    """Spaces in SET_CONFIG's format, as one short phrase."""
    obs = (f"observation {config['observation_dtype']} {config['observation_shape']}" if "observation_shape" in config
           else f"observation leaves {sorted(config.get('observation_leaves', {}))}")
    action = {k: ([float(v) for v in vals] if k in ("low", "high") else vals)
              for k, vals in config["action_space"].items()}
    return f"({obs}, action {action})"


def say_left_out(spec) -> None:
    """Warn, once per env and observation leaf in this process, of what the env observes
    that shmrl leaves out (MiniGrid's ``mission``). The learner says it: a WARNING, which
    Python prints even where logging is not set up; simulators say nothing."""
    for agent_spec in spec.agent_specs.values() if spec.multiagent else [spec]:
        for path, why in agent_spec.obs.skipped:
            if (agent_spec.env_id, path) not in _SKIPPED_SAID:
                _SKIPPED_SAID.add((agent_spec.env_id, path))
                logging.getLogger("shmrl.envs").warning("%s: observation %r is left out: %s",
                                                        agent_spec.env_id, path, why)


_SKIPPED_SAID: set = set()   # (env, leaf) already said to be left out


@dataclass(frozen=True)
class MultiAgentSpec:
    """A multi-agent env's spaces: one EnvSpec per possible agent."""
    env_id: str
    agents: tuple
    agent_specs: dict = field(hash=False)
    turn_based: bool = False
    reward_threshold: float | None = None
    multiagent = True

    def policy_specs(self, mapper: Callable) -> dict:
        """policy id -> the EnvSpec of its agents, which must agree in their spaces."""
        out, first = {}, {}
        for agent in self.agents:
            pid, spec = mapper(agent), self.agent_specs[agent]
            if pid in out and (out[pid].obs, out[pid].actions) != (spec.obs, spec.actions):
                raise ValueError(f"{self.env_id}: agents {first[pid]!r} and {agent!r} map to policy {pid!r} but "
                                 f"have different spaces")
            out.setdefault(pid, spec)
            first.setdefault(pid, agent)
        return out


def load_function(flag: str, value: str, what: str) -> Callable:
    """The function ``package.module:name`` names (a user's env factory or policy map), or
    a ValueError that names the flag and why it cannot be loaded; ``what``: what the
    function is for, said when the name is not a function."""
    module, _, name = value.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{flag} {value}: cannot load {name} from {module}: {e}") from None
    if not callable(fn):
        raise ValueError(f"{flag} {value}: {name} is a {type(fn).__name__}, not a function {what}")
    return fn


def policy_mapper(policy_map: str) -> Callable:
    """agent_id -> policy_id for ``shared``, ``per-agent`` or ``package.module:fn``."""
    if policy_map == "shared":
        return lambda agent: SHARED_POLICY
    if policy_map == "per-agent":
        return str
    if not policy_map.partition(":")[2]:
        raise ValueError(f"--policy-map {policy_map!r}: shared, per-agent or package.module:fn")
    fn = load_function("--policy-map", policy_map, "of an agent id")
    return lambda agent: str(fn(agent))
