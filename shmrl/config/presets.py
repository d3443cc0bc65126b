"""Per-environment defaults, read from ``presets.toml`` beside this file (the place to
read or change them): the env's family, then the env's own table, over the house defaults
of shmrl/config/settings.py; and the slow profile (``[slow.family.NAME]``, ``[slow.env."ID"]``),
what a run switches to when its simulators turn out to be slow (shmrl/trainer/learn_per_step.py)."""
from __future__ import annotations

import functools
import tomllib
from pathlib import Path

PRESETS_FILE = Path(__file__).with_name("presets.toml")


@functools.cache
def _presets() -> dict:
    with open(PRESETS_FILE, "rb") as f:
        return tomllib.load(f)


def all_tables() -> dict:
    """presets.toml as read: {"family": {name: table}, "env": {id: table}}."""
    return _presets()


def family_of(spec, env=None) -> str | None:
    """The family whose defaults an env takes (unless its own table names another): Atari
    games (gym:ALE/*), MiniGrid (gym:MiniGrid-*, gym:BabyAI-*), MinAtar (gym:MinAtar/*),
    and continuous control (a 1-D Box action)."""
    if isinstance(env, str):
        for prefix, family in (("gym:ALE/", "atari"), ("gym:MiniGrid-", "minigrid"), ("gym:BabyAI-", "minigrid"),
                               ("gym:MinAtar/", "minatar")):
            if env.startswith(prefix):
                return family
    space = getattr(spec, "action_space", None)
    if space is not None and getattr(spec, "continuous", False) and len(space.shape) == 1:
        return "continuous"
    return None


def own_table(env) -> tuple[str | None, dict]:
    """(the name of ``env``'s own table in presets.toml, its settings); ``gym:ID`` of an env
    that shmrl also has built in (gym:CartPole-v1, gym:Pendulum-v1) takes the built-in's
    table unless it has its own: the same env gets the same settings."""
    tables = _presets().get("env", {})
    if not isinstance(env, str):
        return None, {}
    for name in (env, env.removeprefix("gym:")):
        if name in tables:
            return name, dict(tables[name])
    return None, {}


def preset_origins(env, spec=None, algo: str = "ppo") -> dict[str, str]:
    """Where each setting the presets give ``env`` comes from: ``family.NAME`` or
    ``env."ID"`` (the table of presets.toml), by setting name. With ``algo`` "sac" the
    PPO tables are left out: SAC's are ``[sac]`` (over the house defaults) and its own
    ``[sac.env."ID"]`` (rl-zoo3's SAC hyperparameters)."""
    return {key: origin for key, (origin, _) in _preset_entries(env, spec, algo).items()}


def _preset_entries(env, spec, algo: str) -> dict[str, tuple[str, object]]:
    """{setting: (the table it comes from, its value)} for ``env`` under ``algo``."""
    presets = _presets()
    if algo == "sac":
        sac = presets.get("sac", {})
        out = {key: ("sac", value) for key, value in sac.items() if key != "env"}
        tables = sac.get("env", {})
        for name in ((env, env.removeprefix("gym:")) if isinstance(env, str) else ()):
            if name in tables:
                out.update({key: (f'sac.env."{name}"', value) for key, value in tables[name].items()})
                break
        return out
    name, own = own_table(env)
    family = own.pop("family", None)
    if family is None:
        family = family_of(spec, env)
    out = {key: (f"family.{family}", value) for key, value in presets["family"][family].items()} if family else {}
    out.update({key: (f'env."{name}"', value) for key, value in own.items()})
    return out


def slow_tables(env, spec=None) -> tuple[dict, list[str]]:
    """(the settings of ``env``'s slow profile, the tables they came from): its family's
    ``[slow.family.NAME]``, then its own ``[slow.env."ID"]`` over it; ({}, []) where it has
    none. The family is the one its preset takes (``family = ""`` in its own table: none)."""
    slow = _presets().get("slow", {})
    name, own = own_table(env)
    family = own.get("family", family_of(spec, env))
    out, sources = {}, []
    if family and family in slow.get("family", {}):
        out.update(slow["family"][family])
        sources.append(f"slow.family.{family}")
    for key in (name, env.removeprefix("gym:") if isinstance(env, str) else None):
        if key and key in slow.get("env", {}):
            out.update(slow["env"][key])
            sources.append(f'slow.env."{key}"')
            break
    return out, sources


def preset_tables(env, spec=None, algo: str = "ppo") -> tuple[dict, list[str]]:
    """(the settings the presets give ``env``, the tables they came from) for ``env`` (an
    id string or a callable) whose spec is ``spec`` (needed only to find its family), for
    the algorithm ``algo`` (``preset_origins``). An env's own table builds on its family's
    unless it names another (``family = ""``: none). Settings they leave out take
    config.py's house defaults."""
    entries = _preset_entries(env, spec, algo)
    return ({key: value for key, (_, value) in entries.items()},
            list(dict.fromkeys(origin for origin, _ in entries.values())))
