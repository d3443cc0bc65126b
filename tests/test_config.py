"""shmrl/config/settings.py: every setting once, the command line generated from it, and one
validate() for the command line and shmrl.train alike."""
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
import tomllib

import pytest

import shmrl
from conftest import descendants
from shmrl.config.settings import (Config, ConfigError, PPOSettings, config_from_saved, config_with, resolve_config,
                          saved_config, validate, with_defaults)
from shmrl.envs.make import env_spec
from shmrl.files.logdir import dumps
from shmrl.config.presets import PRESETS_FILE
from shmrl.run import build_parser, parse_args

# `python -m shmrl.run --help`'s option strings before config.py generated them (main at 2a7f2fc).
OLD_OPTION_STRINGS = {
    '--activation', '--async', '--auth-token', '--checkpoint-every', '--clip', '--cnn', '--ent-coef', '--env',
    '--env-steps-per-sample', '--envs-per-sim', '--epochs', '--gae-lambda', '--gamma', '--hang-timeout', '--help',
    '--hidden', '--keep-checkpoints', '--layers', '--league', '--league-every', '--league-prob', '--log-every',
    '--log-std-init', '--logdir', '--lr', '--lr-anneal', '--max-env-steps', '--max-frame-bytes', '--max-grad-norm',
    '--max-policy-lag', '--max-seq-len', '--memory', '--memory-size', '--minibatch-size', '--no-async',
    '--no-lr-anneal', '--no-normalize-obs', '--no-normalize-reward', '--no-tensorboard', '--normalize-obs',
    '--normalize-reward', '--policy-map', '--ray', '--resume', '--reward-scale', '--seed', '--sim-cpus',
    '--sim-nice', '--sims', '--stop-return', '--tcp-host', '--tcp-port', '--tensorboard', '--torch-threads',
    '--train-batch-size', '--transport', '--vf-coef', '-h'}

# A value each flag takes, and the field it must land in (as parse_args returns it).
FLAG_VALUES = [
    (["--sims", "3"], "sims", 3), (["--seed", "7"], "seed", 7), (["--stop-return", "12.5"], "stop_return", 12.5),
    (["--max-env-steps", "5000"], "max_env_steps", 5000), (["--logdir", "runs/x"], "logdir", "runs/x"),
    (["--checkpoint-every", "4"], "checkpoint_every", 4), (["--keep-checkpoints", "2"], "keep_checkpoints", 2),
    (["--log-every", "2.5"], "log_every", 2.5), (["--tensorboard"], "tensorboard", True),
    (["--record", "demos"], "record", "demos"), (["--pretrain", "demos"], "pretrain", "demos"),
    (["--pretrain-steps", "5"], "pretrain_steps", 5),
    (["--no-tensorboard"], "tensorboard", False), (["--transport", "tcp"], "transport", "tcp"),
    (["--tcp-port", "0"], "tcp_port", 0), (["--tcp-host", "0.0.0.0"], "tcp_host", "0.0.0.0"),
    (["--auth-token", "s3cret"], "auth_token", "s3cret"), (["--max-frame-bytes", "4096"], "max_frame_bytes", 4096),
    (["--ray", "auto"], "ray", "auto"), (["--sim-cpus", "0.5"], "sim_cpus", 0.5), (["--hang-timeout", "3"], "hang_timeout", 3.0),
    (["--policy-map", "per-agent"], "policy_map", "per-agent"), (["--league", "4"], "league", 4),
    (["--league-every", "3"], "league_every", 3), (["--league-prob", "0.25"], "league_prob", 0.25),
    (["--train-batch-size", "1024"], "train_batch_size", 1024),
    (["--env-steps-per-sample", "100"], "env_steps_per_sample", 100), (["--envs-per-sim", "2"], "envs_per_sim", 2),
    (["--sim-nice", "5"], "sim_nice", 5), (["--async"], "async_sampling", True),
    (["--no-async"], "async_sampling", False), (["--max-policy-lag", "1"], "max_policy_lag", 1),
    (["--lr", "1e-4"], "lr", 1e-4), (["--gamma", "0.9"], "gamma", 0.9), (["--gae-lambda", "0.8"], "gae_lambda", 0.8),
    (["--epochs", "3"], "epochs", 3), (["--minibatch-size", "128"], "minibatch_size", 128),
    (["--ent-coef", "0.01"], "ent_coef", 0.01), (["--clip", "0.1"], "clip", 0.1), (["--vf-coef", "1"], "vf_coef", 1.0),
    (["--max-grad-norm", "2"], "max_grad_norm", 2.0), (["--lr-anneal"], "lr_anneal", True),
    (["--no-lr-anneal"], "lr_anneal", False), (["--reward-scale", "0.5"], "reward_scale", 0.5),
    (["--normalize-reward"], "normalize_reward", True), (["--no-normalize-reward"], "normalize_reward", False),
    (["--normalize-obs"], "normalize_obs", True), (["--no-normalize-obs"], "normalize_obs", False),
    (["--hidden", "16"], "hidden", 16), (["--layers", "1"], "layers", 1), (["--cnn", "small"], "cnn", "small"),
    (["--activation", "Tanh"], "activation", "Tanh"), (["--log-std-init", "-1"], "log_std_init", -1.0),
    (["--memory", "gru"], "memory", "gru"), (["--memory-size", "32"], "memory_size", 32),
    (["--max-seq-len", "8"], "max_seq_len", 8), (["--torch-threads", "0"], "torch_threads", 0),
    (["--env", "Pendulum-v1"], "env", "Pendulum-v1"),
    # settings that could not be set before config.py
    (["--return-window", "20"], "return_window", 20), (["--max-restarts", "0"], "max_restarts", 0),
    (["--restart-window", "inf"], "restart_window", math.inf),
    # the bounds of issue 22 (the weights are never poisoned)
    (["--max-obs-abs", "1e3"], "max_obs_abs", 1e3), (["--max-reward-abs", "50"], "max_reward_abs", 50.0),
    (["--max-skipped-updates", "2"], "max_skipped_updates", 2),
    # the bounds of one client (issue 22)
    (["--max-json-frame-bytes", "4096"], "max_json_frame_bytes", 4096),
    (["--client-budget", "5000"], "client_budget", 5000),
    (["--max-message-steps", "300"], "max_message_steps", 300),
    (["--max-message-chunks", "400"], "max_message_chunks", 400),
    (["--learn-per-step", "off"], "learn_per_step", "off"),
    (["--target-kl", "0.05"], "target_kl", 0.05),
    (["--slow-rate", "500"], "slow_rate", 500.0), (["--no-ortho-init"], "ortho_init", False),
    # issue 26
    (["--plot"], "plot", True), (["--verbose"], "verbose", True),
    # issue 23: a self-play run evaluated while it trains (a symmetric game's), and a time budget
    (["--eval-every", "5", "--env", "pz:connect_four_v3"], "eval_every", 5),
    (["--eval-games", "50"], "eval_games", 50), (["--stop-win-rate", "0.9"], "stop_win_rate", 0.9),
    (["--max-seconds", "60"], "max_seconds", 60.0),
    # issue 34: the learner's device
    (["--device", "cpu"], "device", "cpu"),
    # issue 36: SAC
    (["--algo", "sac", "--env", "Pendulum-v1"], "algo", "sac"), (["--buffer-size", "5000"], "buffer_size", 5000),
    (["--learning-starts", "50"], "learning_starts", 50), (["--tau", "0.01"], "tau", 0.01),
    (["--gradient-steps", "2"], "gradient_steps", 2.0), (["--target-entropy", "-2"], "target_entropy", -2.0),
    (["--publish-every", "10"], "publish_every", 10),
]


def test_every_flag_of_the_old_command_line_is_still_there():
    spec = env_spec("CartPole-v1")
    parser = build_parser(resolve_config(Config(), spec), spec)
    options = {o for action in parser._actions for o in action.option_strings}
    assert OLD_OPTION_STRINGS <= options, OLD_OPTION_STRINGS - options
    assert options - OLD_OPTION_STRINGS == {"--return-window", "--max-restarts", "--restart-window", "--max-obs-abs",
                                            "--max-reward-abs", "--max-skipped-updates", "--max-json-frame-bytes",
                                            "--client-budget", "--max-message-steps", "--max-message-chunks",
                                            "--record", "--pretrain", "--pretrain-steps",
                                            "--learn-per-step", "--target-kl", "--slow-rate", "--ortho-init", "--no-ortho-init",
                                            "--plot", "--no-plot", "--verbose", "--no-verbose",
                                            "--eval-every", "--eval-games", "--stop-win-rate", "--max-seconds",
                                            "--device", "--algo", "--buffer-size", "--learning-starts", "--tau",
                                            "--gradient-steps", "--target-entropy", "--publish-every"}
    titles = [group.title for group in parser._action_groups]
    for old in ("logs, checkpoints and resuming", "transports", "multi-agent envs (PettingZoo: --env pz:NAME)",
                "sampling and PPO"):
        assert titles.count(old) == 1, titles


@pytest.mark.parametrize("argv, name, value", FLAG_VALUES, ids=[argv[0] for argv, _, _ in FLAG_VALUES])
def test_each_flag_lands_in_its_setting(argv, name, value):
    assert getattr(parse_args(argv), name) == value
    if not argv[0].startswith("--no-"):
        assert getattr(parse_args([]), name) != value   # so the flag, not a default, put it there


def test_the_flags_cover_every_setting_once():
    flagged = {argv[0] for argv, _, _ in FLAG_VALUES}   # each entry's own flag (others may follow it)
    names = {name for _, name, _ in FLAG_VALUES}
    assert names | {"resume"} == {f.name for f in dataclasses.fields(Config)}
    assert len(flagged) == len(FLAG_VALUES)


def test_stop_return_none_trains_to_the_budget_and_survives_a_resume():
    assert parse_args(["--stop-return", "none"]).stop_return == math.inf
    assert parse_args(["--stop-return", "None"]).stop_return == math.inf
    # JSON has no infinity: summary.json and checkpoints write null, which reads back as none.
    saved = json.loads(dumps(saved_config(parse_args(["--stop-return", "none", "--restart-window", "inf"]))))
    assert saved["stop_return"] is None
    restored = config_from_saved(saved)
    assert restored.stop_return == math.inf and restored.restart_window == math.inf
    assert saved["max_seconds"] is saved["stop_win_rate"] is None   # their house defaults: none
    assert restored.max_seconds == restored.stop_win_rate == math.inf   # none as well
    given = parse_args(["--env", "pz:connect_four_v3", "--max-seconds", "none", "--stop-win-rate", "none"])
    assert given.max_seconds == given.stop_win_rate == math.inf


def test_an_unknown_keyword_to_config_is_a_type_error_too():
    with pytest.raises(TypeError, match="shmrl.Config has no setting 'lr_rate'"):
        Config(lr_rate=1.0)


def test_the_auth_token_defaults_to_its_environment_variable():
    code = "from shmrl.run import parse_args; print(parse_args([]).auth_token)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "SHMRL_AUTH_TOKEN": "from-env"}).stdout
    assert out.strip() == "from-env"


# ------------------------------------------------------------ refused at once, by the API too

@pytest.mark.parametrize("call, message", [
    (lambda: shmrl.train(Config(sims=0)), "--sims 0 runs no local simulator: give --tcp-port"),
    (lambda: shmrl.train(sims=0), "--sims 0 runs no local simulator: give --tcp-port"),
    (lambda: shmrl.train(lr=-1), "--lr must be > 0"),
    (lambda: shmrl.train(minibatch_size=0), "--minibatch-size must be >= 1"),
    (lambda: shmrl.train(Config(env="Pendulum-v1"), gamma=1.5), "--gamma must be in (0, 1]"),
    (lambda: shmrl.train(hidden=2.5), "--hidden must be a whole number"),
    (lambda: shmrl.train(activation="relu"), "--activation must be one of ReLU, Tanh"),
    (lambda: shmrl.train(device="gpu"), "--device must be one of auto, cpu, cuda"),
    (lambda: shmrl.train(ray="auto", sims=0, tcp_port=0), "--ray places simulators"),
    (lambda: shmrl.train(learning_rate=1e-3), "shmrl.Config has no setting 'learning_rate'"),
    (lambda: shmrl.Config(sim=2), "shmrl.Config has no setting 'sim' (did you mean sims?)"),
    (lambda: shmrl.train(shmrl.Config(), asynch=True), "(did you mean async_sampling?)"),
])
def test_the_api_refuses_a_bad_setting_at_once(call, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = set(descendants(os.getpid()))          # an earlier test's fork server may still live
    started = time.monotonic()
    with pytest.raises(ConfigError) as refused:
        call()
    assert time.monotonic() - started < 1.0
    assert message in str(refused.value)
    assert set(descendants(os.getpid())) <= before  # no process started
    assert list(tmp_path.iterdir()) == []           # nothing written (runs/ not made)


@pytest.mark.parametrize("name", ["lr", "gamma", "gae_lambda", "clip", "ent_coef", "vf_coef", "max_grad_norm",
                                  "reward_scale", "log_std_init", "hang_timeout", "sim_cpus", "league_prob",
                                  "log_every"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_and_inf_are_refused_where_they_mean_nothing(name, bad):
    with pytest.raises(ConfigError, match="--" + name.replace("_", "-")):
        validate(Config(**{name: bad}))


def test_inf_is_taken_where_it_means_never():
    validate(Config(stop_return=math.inf, restart_window=math.inf))   # train to the budget; count every failure
    with pytest.raises(ConfigError, match="--stop-return must be a finite number, not nan"):
        validate(Config(stop_return=math.nan))


def test_the_command_line_refuses_with_the_same_message_as_the_api(capsys):
    with pytest.raises(SystemExit) as exit:
        parse_args(["--lr", "-1"])
    assert exit.value.code == 2
    with pytest.raises(ConfigError) as refused:
        validate(Config(lr=-1.0))
    assert f"error: {refused.value} (see python -m shmrl.run --help)" in capsys.readouterr().err


# ------------------------------------------------------------ presets and house defaults

def test_a_flag_or_a_field_beats_a_preset():
    pendulum = env_spec("Pendulum-v1")
    assert resolve_config(Config(env="Pendulum-v1"), pendulum).lr == 1e-3                 # its own table
    assert resolve_config(Config(env="Pendulum-v1", lr=2e-4), pendulum).lr == 2e-4
    assert parse_args(["--env", "Pendulum-v1", "--lr", "2e-4"]).lr == 2e-4
    assert parse_args(["--env", "Pendulum-v1"]).gamma == 0.95
    # a setting no table names takes the house default
    assert parse_args(["--env", "Pendulum-v1"]).clip == with_defaults(PPOSettings).clip == 0.2


def test_halfcheetah_help_shows_its_preset_values_and_where_they_came_from():
    pytest.importorskip("mujoco", reason="the mujoco extra is not installed")
    shown = subprocess.run([sys.executable, "-m", "shmrl.run", "--env", "gym:HalfCheetah-v5", "--help"],
                           capture_output=True, text=True, timeout=60).stdout

    def help_of(flag):   # the flag's own lines, not the usage's
        return " ".join(shown.split(f"\n  {flag}")[1].split("\n  -")[0].split())

    assert '(default: 0.98, from env."gym:HalfCheetah-v5" in presets.toml)' in help_of("--gamma")  # its own table
    assert "(default: True, from family.continuous in presets.toml)" in help_of("--normalize-obs")
    assert "(default: True, from family.continuous" in help_of("--async")   # what a preset turned on
    assert "(default: 0.2)" in help_of("--clip")            # the house default
    assert 'family.continuous + env."gym:HalfCheetah-v5" in' in shown and "config.py" in shown


def help_lines(*args) -> dict[str, str]:
    """``python -m shmrl.run ARGS --help``'s text of each flag, on one line."""
    shown = subprocess.run([sys.executable, "-m", "shmrl.run", *args, "--help"], capture_output=True, text=True,
                           timeout=60).stdout
    options = shown.split("\noptions:")[1]
    return {part.split()[0].rstrip(","): " ".join(part.split()) for part in options.split("\n  -")[1:]}


def test_help_says_where_each_value_came_from_for_the_env_chosen():
    shown = help_lines("--env", "Pendulum-v1", "--lr", "0.002", "--sims", "3")
    assert "(given on the command line: 0.002)" in shown["-lr"]
    assert "(given on the command line: 3)" in shown["-sims"]
    assert '(default: 0.95, from env."Pendulum-v1" in presets.toml)' in shown["-gamma"]
    assert "(default: 2000000, from env." in shown["-max-env-steps"]
    assert "(default: 0.95)" in shown["-gae-lambda"]          # config.py's own: said without a source
    assert "0: none, only the external clients of --tcp-port" in shown["-sims"]
    assert "0: any free port" in shown["-tcp-port"]
    assert "binary codec" in shown["-transport"] and "JSON over TCP" not in shown["-transport"]


def test_gym_ids_of_built_in_envs_take_the_built_in_preset():
    """gym:Pendulum-v1 is the built-in Pendulum-v1: one env, one preset (--async and all)."""
    from shmrl.config.settings import preset_values
    assert preset_values("gym:Pendulum-v1")[0] == preset_values("Pendulum-v1")[0]
    assert preset_values("gym:CartPole-v1")[0]["lr"] == preset_values("CartPole-v1")[0]["lr"]


def test_every_key_in_the_presets_file_is_a_preset_setting():
    presets = tomllib.loads(PRESETS_FILE.read_text())
    assert "default" not in presets     # the house defaults live once, in config.py
    preset = {f.name for f in dataclasses.fields(Config) if f.metadata["preset"]}
    for table in [*presets["family"].values(), *presets["env"].values()]:
        assert set(table) - {"family"} <= preset, set(table) - preset


def test_ppo_takes_the_house_defaults_not_other_ones():
    from shmrl.model.net import PolicyNet
    from shmrl.model.ppo import PPO

    net = PolicyNet(env_spec("CartPole-v1"), 16)
    assert (PPO(net, with_defaults(PPOSettings)).config.lr, with_defaults(Config).lr) == (3e-4, 3e-4)
    assert PPO(net, with_defaults(Config, minibatch_size=64)).config.minibatch_size == 64
    with pytest.raises(ValueError, match="left None"):
        PPO(net, PPOSettings())


def test_a_configuration_saved_by_an_older_shmrl_still_loads():
    saved = json.loads(json.dumps({**dataclasses.asdict(resolve_config(Config(), env_spec("CartPole-v1"))),
                                   "auth_token": "(set)", "a_setting_of_long_ago": 1}))
    for new in ("return_window", "max_restarts", "restart_window"):
        del saved[new]
    config = config_from_saved(saved)
    assert (config.lr, config.hidden, config.auth_token, config.return_window) == (5e-3, 32, None, 100)
    validate(config)


def test_config_with_sets_fields_over_a_config():
    assert config_with(Config(env="Pendulum-v1"), lr=1e-4) == Config(env="Pendulum-v1", lr=1e-4)
    with pytest.raises(ConfigError, match="did you mean minibatch_size"):
        config_with(minibatch=64)


def test_the_return_window_is_the_runs(tmp_path, no_shm_leftovers, no_sim_leftovers):
    """--return-window reaches the store: with 3 episodes a stop return any episode reaches is
    met long before the default 100 episodes are complete."""
    summary = shmrl.train(env="CartPole-v1", sims=1, envs_per_sim=1, train_batch_size=64, stop_return=1.0,
                          return_window=3, max_env_steps=50_000, logdir=str(tmp_path), tensorboard=False)
    assert summary["solved"] and summary["exit_status"] == 0, summary
    assert 3 <= summary["episodes"] < 100 and summary["config"]["return_window"] == 3


# ------------------------------------------------------------ every command line from its settings

FACES = [("sim", "SimSettings"), ("eval", "EvalSettings"), ("record", "RecordSettings"),
         ("record export", "RecordExportSettings"), ("conformance", "ConformanceSettings"), ("plot", "PlotSettings")]


def face(name: str):
    from shmrl.config import faces
    from shmrl.config.flags import face_parser

    cls = getattr(faces, dict(FACES)[name])
    return cls, face_parser(cls, f"python -m shmrl.{name}")


def test_no_command_line_declares_a_flag_of_its_own():
    """Flags are built from settings in shmrl/config/ only, and only its flags module reads
    an environment variable for a default (the auth token's)."""
    import ast
    from pathlib import Path

    root = Path(shmrl.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.parent.name == "config":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "add_argument":
                found.append(f"{path.relative_to(root)}:{node.lineno}")
            if isinstance(node, ast.Constant) and node.value == "SHMRL_AUTH_TOKEN":
                found.append(f"{path.relative_to(root)}:{node.lineno} reads SHMRL_AUTH_TOKEN")
    assert not found, found


@pytest.mark.parametrize("name", [name for name, _ in FACES])
def test_each_command_line_has_one_argument_per_setting_with_its_default(name):
    cls, parser = face(name)
    dests = {action.dest for action in parser._actions if action.dest != "help"}
    assert dests == {f.name for f in dataclasses.fields(cls)}
    defaults = cls()
    for action in parser._actions:
        if action.dest != "help" and not action.required and action.nargs not in ("+",):
            value = action.default
            assert value == getattr(defaults, action.dest) or action.dest == "auth_token", action.dest


@pytest.mark.parametrize("name", ["sim", "record"])
def test_every_auth_token_flag_defaults_to_the_environment_variable(name, monkeypatch):
    monkeypatch.setenv("SHMRL_AUTH_TOKEN", "from-env")
    _, parser = face(name)
    assert parser.get_default("auth_token") == "from-env"


@pytest.mark.parametrize("argv, message", [
    (["python -m shmrl.sim", "--connect", "h:1", "--envs-per-sim", "0"], "--envs-per-sim must be >= 1, not 0"),
    (["python -m shmrl.eval", "p.onnx", "--episodes", "0"], "--episodes must be >= 1, not 0"),
    (["python -m shmrl.conformance", "--steps", "2"], "--steps must be >= 4, not 2"),
    (["python -m shmrl.record", "--out", "d", "--tcp-port", "70000"], "--tcp-port must be a port number"),
])
def test_a_command_line_refuses_a_value_its_setting_refuses_in_one_line(argv, message, capsys):
    from shmrl.config.flags import parse_settings

    name = argv[0].removeprefix("python -m shmrl.")
    cls, parser = face(name)
    with pytest.raises(SystemExit) as stopped:
        parse_settings(parser, cls, argv[1:])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.startswith(f"error: {message}") and err.count("\n") == 1, err
