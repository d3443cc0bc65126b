"""Per-environment defaults, read from ``presets.toml`` beside this file (the place to
read or change them): the env's family, then the env's own table, over the house defaults
of shmrl/config.py."""
from __future__ import annotations

import functools
import tomllib
from pathlib import Path

PRESETS_FILE = Path(__file__).with_name("presets.toml")


@functools.cache
def _presets() -> dict:
    with open(PRESETS_FILE, "rb") as f:
        return tomllib.load(f)


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


def preset_tables(env, spec=None) -> tuple[dict, list[str]]:
    """(the settings the presets give ``env``, the tables they came from) for ``env`` (an
    id string or a callable) whose spec is ``spec`` (needed only to find its family). An
    env's own table builds on its family's unless it names another (``family = ""``:
    none). Settings they leave out take config.py's house defaults."""
    presets = _presets()
    out, sources = {}, []
    own = dict(presets.get("env", {}).get(env, {})) if isinstance(env, str) else {}
    family = own.pop("family", None)
    if family is None:
        family = family_of(spec, env)
    if family:
        out.update(presets["family"][family])
        sources.append(f"family.{family}")
    if own:
        out.update(own)
        sources.append(f'env."{env}"')
    return out, sources
