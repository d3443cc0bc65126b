"""Train a policy with PPO from simulator processes that talk RLlink through shared memory.

    python -m shmrl.run --sims 8                  # CartPole-v1 until the 100-episode mean is >= 475
    python -m shmrl.run --sims 8 --logdir runs/a  # metrics.jsonl, summary.json, policy.onnx, checkpoints
    python -m shmrl.run --resume runs/a           # go on from the last checkpoint in runs/a
    python -m shmrl.run --ray auto --sims 24      # the simulators as Ray actors across a cluster
    python -m shmrl.run --env ID --help           # every flag, with its value for ID and where it came from

Simulators that die or hang are restarted (and the env steps they lose are counted); a
simulator that keeps failing fails the run. Ctrl-C and SIGTERM stop everything within
seconds and write a checkpoint first.

Exit status: 0 when the stop return is reached, 1 when the env-step budget runs out
first, 2 when the command line asks for what cannot be done (a bad flag value, an unknown
env, a port in use, a log folder that cannot be made, a checkpoint that is damaged or
does not fit; one line ``error: ...``, nothing started or written), 3 when a part of the
run fails (a simulator that keeps dying, a transport that breaks, too little shared
memory), 130 after Ctrl-C, 143 after SIGTERM.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import time
from pathlib import Path

from shmrl.config.flags import (OneLineErrorParser, add_arguments, config_from_args, setting_origins,
                                settings_parser)
from shmrl.config.settings import (AUTH_TOKEN_VAR, DECLARED_ENV, EXIT_BUDGET, EXIT_FAILED, EXIT_INTERRUPTED,  # noqa: F401
                                   EXIT_SOLVED, EXIT_USAGE, Config, ConfigError, config_from_saved, env_name,
                                   preset_values, resolve_config, validate)

log = logging.getLogger("shmrl.run")


def process_start_time() -> float:
    """Wall-clock time at which this process started (Linux /proc), else now.

    /proc/self/stat gives the start in clock ticks since boot; CLOCK_BOOTTIME is the
    same clock (/proc/stat's btime would add up to a second of rounding).
    """
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()

def _terminate(signum, frame):
    raise SystemExit(128 + signum)

def train(config: Config, t_start: float | None = None, given: set[str] | None = None) -> tuple[int, dict]:
    """The command line's training run: ``config`` checked, its Ray cluster joined where
    it asks for one, the run trained (``shmrl.trainer.loop.train_with_simulators``), then
    its learning curves plotted; returns (exit status, summary). Whatever happens (Ctrl-C
    and SIGTERM included) every process it started is stopped, every segment it made is
    unlinked, and the summary and a checkpoint are written. ``given``: the settings the
    command line gave (default: those ``config`` does not leave None)."""
    t_start = t_start if t_start is not None else time.time()
    validate(config)   # what can be checked before the env is made: nothing is started yet
    launcher = None
    if config.ray:
        # Joining the cluster waits on the network: torch's import (seconds) goes on meanwhile
        # (where to start it, and why that is safe: shmrl.model.torch_import).
        from shmrl.model.torch_import import start_torch_import

        start_torch_import()
        from shmrl.launch.ray_actors import RayLauncher

        try:
            launcher = RayLauncher(config.ray, sim_cpus=config.sim_cpus)
        except ImportError as e:
            raise ConfigError(str(e)) from None
        except ConfigError:
            raise
        except (ConnectionError, RuntimeError, ValueError) as e:  # what ray.init raises for no cluster there
            raise ConfigError(f"--ray {config.ray}: cannot connect to the Ray cluster: {e}") from None
        if not config.auth_token:  # the port is open to the cluster's network: never without a secret
            import secrets

            config = dataclasses.replace(config, auth_token=secrets.token_urlsafe(24))
            log.info("--ray: the simulators' TCP connections use a generated auth token; give --auth-token "
                     "(or $%s) to let other clients in too", AUTH_TOKEN_VAR)
    from shmrl.trainer.loop import train_with_simulators

    plot_forced = config.plot is True
    try:
        status, summary = train_with_simulators(config, t_start, launcher, given)
    finally:
        if launcher is not None and launcher.owns_ray:
            launcher.ray.shutdown()
    saved = summary.get("config", {})
    # Not after Ctrl-C, SIGTERM or a failure; and unless --plot asks, not after a run of a few
    # seconds, whose plot (matplotlib's import is most of its 0.5 s) would add a sixth to it.
    if (saved.get("plot") and status in (EXIT_SOLVED, EXIT_BUDGET)
            and (plot_forced or summary.get("wall_s", 0) >= PLOT_MIN_WALL_S)):
        from shmrl.plot import plot_run

        plot_run(saved["logdir"])
    return status, summary


PLOT_MIN_WALL_S = 20.0   # the shortest run that draws its learning curves without --plot


def build_parser(d: Config, spec=None, given: dict | None = None) -> argparse.ArgumentParser:
    """The command line, with ``d`` as the defaults (a resumed run's are its saved
    configuration): one flag per setting of shmrl/config/settings.py. ``given``: flags of the
    command line, whose values --help shows as such."""
    sources = " + ".join(preset_values(d.env, spec, d.algo)[1])
    origins = {} if d.resume else setting_origins(d.env, spec, d.algo)
    if given:
        d = dataclasses.replace(d, **given)
        origins.update({name: "the command line" for name in given})
    p = OneLineErrorParser(prog="python -m shmrl.run", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog=f"The defaults shown are those of --env {env_name(d.env)}: {sources}"
                                  + (f", saved by the run in {d.logdir}" if d.resume else "")
                                  + "; each says where it came from unless it is config.py's own. "
                                    "docs/FLAGS.md lists every flag, with each env's defaults.")
    add_arguments(p, d, origins)
    return p


def given_flags(parser: argparse.ArgumentParser, argv: list[str]) -> dict:
    """The settings ``argv`` gives (what parses of it, --help left out): --help shows them."""
    def refuse(message):
        raise ValueError(message)

    for action in parser._actions:
        action.default = argparse.SUPPRESS
    parser.error = refuse   # said once, by parse_args: not here too
    try:
        known, _ = parser.parse_known_args([a for a in argv if a not in ("-h", "--help")])
    except ValueError:   # a bad value: --help shows the defaults, parse_args says what is wrong
        return {}
    return {name: value for name, value in vars(known).items() if name != "help"}


def parse_args(argv=None) -> Config:
    return parse_command_line(argv)[0]


def parse_command_line(argv=None) -> tuple[Config, set[str]]:
    """(the run's settings, resolved for its env; the names of those the command line
    gave, which a switch to the env's slow profile leaves as they are)."""
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    # The defaults depend on the env (or on the run being resumed): find those first, so
    # that --help shows the ones that apply.
    known, _ = settings_parser(("env", "sims", "resume", "tcp_port", "algo"), "python -m shmrl.run",
                               Config(env=None)).parse_known_args(argv)
    # No --env, --sims 0 and a TCP port: the spaces the first client declares (its presets, once known).
    declared = known.env == DECLARED_ENV or (known.env is None and known.sims == 0 and known.tcp_port is not None
                                              and not known.resume)
    env = DECLARED_ENV if declared else known.env or Config.env
    from shmrl.envs.make import env_spec

    try:
        spec = None if declared else env_spec(env)
    except ValueError as e:
        OneLineErrorParser(prog="python -m shmrl.run").error(str(e))
    defaults = resolve_config(Config(env=env, sims=known.sims, algo=known.algo or Config.algo), spec)
    if known.resume:
        from shmrl.files import checkpoint

        try:  # train() says which checkpoints it passed over, and why
            _, _, state, _ = checkpoint.load_latest(Path(known.resume))
        except checkpoint.CheckpointError as e:
            build_parser(defaults, spec).error(f"--resume {known.resume}: {e}")
        defaults = dataclasses.replace(config_from_saved(state.get("config", {})), logdir=known.resume)
    given = given_flags(build_parser(defaults, spec), argv)
    p = build_parser(defaults, spec, given if "-h" in argv or "--help" in argv else None)
    config = resolve_config(config_from_args(p.parse_args(argv)), spec)
    if declared:   # its preset settings wait for its spaces (``trainer.setup.set_up``), unless given
        config = dataclasses.replace(config, **{f.name: None for f in dataclasses.fields(Config) if f.name not in given
                                                and (f.metadata["preset"] or f.name == "env_steps_per_sample")})
    try:
        validate(config, spec)
    except ConfigError as e:
        p.error(str(e))
    if spec is not None and spec.multiagent:
        from shmrl.envs.spec import policy_mapper

        try:
            spec.policy_specs(policy_mapper(config.policy_map))
        except ValueError as e:
            p.error(str(e))
    return config, set(given)


def flags_markdown() -> str:
    """docs/FLAGS.md: every flag of ``python -m shmrl.run`` with its default (config.py's,
    then each table of presets.toml that changes it) and its --help text, by section.
    ``python -m shmrl.run --flags-markdown > docs/FLAGS.md`` writes it; tests/test_docs.py
    fails when the file is not what this gives."""
    import re

    from shmrl.config.settings import HELP_SECTIONS, flag_of
    from shmrl.config.presets import all_tables

    tables = [(f"family {name}", table) for name, table in all_tables()["family"].items()]
    tables += [(f"`{name}`", table) for name, table in all_tables()["env"].items()]
    sac = all_tables().get("sac", {})   # --algo sac's own tables
    tables += [("--algo sac", {k: v for k, v in sac.items() if k != "env"})]
    tables += [(f"--algo sac `{name}`", table) for name, table in sac.get("env", {}).items()]
    shown = resolve_config(Config())
    out = ["# Flags of `python -m shmrl.run`", "",
           "Generated from shmrl/config/settings.py and shmrl/config/presets.toml by `python -m shmrl.run --flags-markdown` "
           "(tests/test_docs.py fails when it drifts). A preset setting's default is config.py's, then "
           "the env's family's, then the env's own table (presets.toml, where each value's reason is "
           "written); a flag given always wins. `python -m shmrl.run --env ID --help` shows the values "
           "for one env and where each came from. Families: `continuous` (any env whose action is a 1-D "
           "Box, unless its own table says otherwise), `minigrid` (gym:MiniGrid-*, gym:BabyAI-*), `minatar` "
           "(gym:MinAtar/*), `atari` (gym:ALE/*); `gym:ID` of a built-in env takes the built-in's table.", ""]
    seen = set()
    for cls, title in HELP_SECTIONS:
        if title not in seen:
            seen.add(title)
            out += ["", f"## {title or 'the run'}", "", "| flag | default | what it does |", "|---|---|---|"]
        for f in dataclasses.fields(cls):
            m = f.metadata
            flag = flag_of(f) + (f", --no-{flag_of(f)[2:]}" if m["kind"] is bool else "")
            house = m["house"]
            default = f"`{house}`" if house is not None else "-"
            if m["env_var"]:
                default = f"`${m['env_var']}`, else none"
            if m["preset"]:
                changes = [f"{where}: `{table[f.name]}`" for where, table in tables if f.name in table]
                default += "".join(f"; {c}" for c in changes)
            text = m["help"].format_map(vars(shown)) if m["flag_default_none"] else m["help"]
            text = re.sub(r" ?\(default: %\(default\)s\)", "", text).replace("(default: %(default)s; ", "(")
            text = text.replace("(default: %(default)s, ", "(default: ").replace("%(default)s", str(house))
            out.append("| " + " | ".join(cell.replace("|", "\\|") for cell in (f"`{flag}`", default, text)) + " |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    if (sys.argv[1:] if argv is None else list(argv)) == ["--flags-markdown"]:
        print(flags_markdown(), end="")
        return 0
    t_start = process_start_time()
    try:
        config, given = parse_command_line(argv)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        signal.signal(signal.SIGTERM, _terminate)
        # Ctrl-C stops the run cleanly even if whoever started it ignored SIGINT (a shell's
        # background job inherits it ignored, and Python then leaves it so).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        status, _ = train(config, t_start, given)
    except ConfigError as e:  # found before anything started
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except KeyboardInterrupt:  # before train() had anything to clean up
        return EXIT_INTERRUPTED
    except Exception:  # a bug: say so, and exit as a failed part (1 means the budget ran out)
        log.exception("the run failed")
        return EXIT_FAILED
    return status


if __name__ == "__main__":
    status = main()
    # By now everything is written and every process and segment of the run is gone; what is
    # left, tearing down an interpreter that has loaded torch, takes about 0.4 s (measured
    # here), which the command need not wait for.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
