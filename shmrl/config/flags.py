"""The command lines of shmrl, built from the settings: one flag (or positional argument)
per field of a settings group, its default, help, metavar and choices taken from the field
(``shmrl.config.settings.setting``), its value checked by the field's check.

``python -m shmrl.run`` takes every field of ``Config``, under the headings of
``HELP_SECTIONS`` (``add_arguments``); the other command lines take the fields of their own
group of ``shmrl.config.faces`` (``face_parser``, ``parse_settings``). Every one reports a
bad command line as one line, ``error: ...``, and exit status 2 (``OneLineErrorParser``).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os

from shmrl.config.presets import preset_origins
from shmrl.config.settings import EXIT_USAGE, HELP_SECTIONS, Config, ConfigError, check_fields, flag_of


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse that reports a bad command line as one line, ``error: ...``, and exit 2."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"error: {message} (see {self.prog} --help)\n")


def add_arguments(parser: argparse.ArgumentParser, defaults: Config, origins: dict | None = None) -> None:
    """One flag per field of Config, under the headings of HELP_SECTIONS, with ``defaults``
    as the defaults shown and taken; ``origins``: where a default came from, by field
    name (``setting_origins``), said after it in --help."""
    groups = {None: parser}
    for cls, title in HELP_SECTIONS:
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        for f in dataclasses.fields(cls):
            add_flag(groups[title], f, defaults, (origins or {}).get(f.name))


def setting_origins(env, spec=None, algo: str = "ppo") -> dict[str, str]:
    """Where each preset setting of ``env`` that is not the house default comes from, as
    --help says it: ``env."CartPole-v1" in presets.toml``, ``family.continuous in ...``."""
    return {name: f"{origin} in presets.toml" for name, origin in preset_origins(env, spec, algo).items()}


def add_flag(group, f: dataclasses.Field, defaults, origin: str | None = None) -> None:
    """Setting ``f`` as an argument of ``group`` (a parser or one of its groups), with its
    value in ``defaults`` as the default; ``origin``: where that default came from."""
    m = f.metadata
    default = None if m["flag_default_none"] else getattr(defaults, f.name)
    if m["env_var"]:
        default = os.environ.get(m["env_var"])
    help = m["help"].format_map(vars(defaults)) if m["flag_default_none"] else m["help"]
    if origin == "the command line":
        help = help.replace("(default: %(default)s", "(given on the command line: %(default)s", 1)
    elif origin:
        help = help.replace("(default: %(default)s", f"(default: %(default)s, from {origin}", 1)
    kind = number_or_none if m["allow_inf"] else m["kind"]
    if m["positional"]:   # argparse names a positional's destination by its first argument
        kwargs = {"type": kind, "nargs": m["nargs"], "metavar": m["metavar"], "help": help}
        if m["nargs"] in ("?", "*"):
            kwargs["default"] = default
        group.add_argument(f.name, **kwargs)
        return
    kwargs = {"dest": f.name, "default": default, "help": help}
    if m["kind"] is bool and m["switch"]:
        kwargs["action"] = "store_false" if default else "store_true"
    elif m["kind"] is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs.update(type=kind, choices=m["choices"], metavar=m["metavar"], nargs=m["nargs"])
    if m["required"]:
        kwargs["required"] = True
    group.add_argument(*([m["short"]] if m["short"] else []), flag_of(f), **kwargs)


def number_or_none(text: str) -> float:
    """A float flag that may be infinite: ``none`` means never (infinity)."""
    if text.strip().lower() == "none":
        return math.inf
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or none, not {text!r}") from None


def settings_from_args(args: argparse.Namespace, cls=Config):
    """The ``cls`` (Config or a face's settings) that parsed ``args`` hold."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def config_from_args(args: argparse.Namespace) -> Config:
    return settings_from_args(args, Config)


# ---------------------------------------------------------------- the other command lines

def face_parser(cls, prog: str, description: str | None = None, usage: str | None = None) -> OneLineErrorParser:
    """The command line ``prog`` of the settings group ``cls``: one argument per field, in
    the fields' order, each with the field's default; the fields of one ``one_of`` name
    form a group of which exactly one must be given."""
    parser = OneLineErrorParser(prog=prog, description=description, usage=usage,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults, exclusive = cls(), {}
    for f in dataclasses.fields(cls):
        group = f.metadata["one_of"]
        if group and group not in exclusive:
            exclusive[group] = parser.add_mutually_exclusive_group(required=True)
        add_flag(exclusive[group] if group else parser, f, defaults)
    return parser


def parse_settings(parser: argparse.ArgumentParser, cls, argv=None):
    """``argv`` parsed by ``parser`` (``face_parser(cls, ...)``) into a checked ``cls``; a
    value that fails its field's check is the parser's error (one line, exit 2)."""
    settings = settings_from_args(parser.parse_args(argv), cls)
    try:
        check_fields(settings)
    except ConfigError as e:
        parser.error(str(e))
    return settings


def settings_parser(names: tuple[str, ...], prog: str, defaults: Config | None = None) -> OneLineErrorParser:
    """A parser of only the settings ``names`` of Config, without --help, for a command
    line read in two passes (``parse_known_args`` first finds what the defaults depend on)."""
    parser = OneLineErrorParser(prog=prog, add_help=False)
    fields = {f.name: f for f in dataclasses.fields(Config)}
    for name in names:
        add_flag(parser, fields[name], defaults if defaults is not None else Config())
    return parser
