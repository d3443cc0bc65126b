"""Any environment (gym:ID, package.module:make_env, Python callables), the Python API
(shmrl.train), the progress display and periodic checkpoints.

Keep this module light (no torch at import): the simulator processes of the closure
test import it, since that is where the closure's globals live.
"""
import contextlib
import io
import math
import sys

import numpy as np
import onnxruntime as ort
import pytest

import shmrl
from conftest import descendants, metrics_rows, need, quick_cartpole, shm_entries, summary_of
from shmrl.files import checkpoint
from shmrl.files.logdir import finite_or_none
from shmrl.core.spaces import Box, Discrete
from shmrl.envs.make import env_spec
from shmrl.core.episode import Episode, EpisodeBatch
from shmrl.server.hub import check_episodes
from shmrl.run import parse_args

gymnasium = need("gymnasium", "gym")


class Corridor:
    """A gymnasium-style env whose return does not depend on the policy: every episode is
    ``length`` steps of ``reward``, so a run's mean return tells which env it ran."""
    observation_space = gymnasium.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gymnasium.spaces.Discrete(3)

    def __init__(self, reward: float, length: int = 10):
        self.reward, self.length, self.t = reward, length, 0

    def reset(self, seed=None, options=None):
        self.t = 0
        return np.zeros(2, np.float32), {}

    def step(self, action):
        assert action in (0, 1, 2), action
        self.t += 1
        return np.array([self.t / self.length, action - 1.0], np.float32), self.reward, False, self.t >= self.length, {}


# A user's module, for --env user_envs.drift:make_env: two-dimensional continuous actions.
DRIFT_MODULE = '''
import numpy as np
from gymnasium import spaces


class Drift:
    """Every episode is 20 steps of reward 0.5, whatever the actions."""
    observation_space = spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = spaces.Box(-1.0, 1.0, (2,), np.float32)

    def reset(self, seed=None, options=None):
        self.t = 0
        return np.zeros(3, np.float32), {}

    def step(self, action):
        # What the simulator must apply: one action of the space's shape, within its bounds.
        assert action.shape == (2,) and np.all(np.abs(action) <= 1.0), action
        self.t += 1
        return np.array([action[0], action[1], self.t / 20], np.float32), 0.5, False, self.t == 20, {}


def make_env():
    return Drift()


def make_nothing():
    return None


def make_text_env():
    env = Drift()
    env.observation_space = spaces.Text(10)
    return env


def make_integer_action_env():
    env = Drift()
    env.action_space = spaces.Box(0, 3, (2,), np.int64)
    return env
'''


def write_user_package(root) -> None:
    (root / "user_envs").mkdir()
    (root / "user_envs" / "__init__.py").write_text("")
    (root / "user_envs" / "drift.py").write_text(DRIFT_MODULE)


@pytest.fixture
def user_envs_importable(tmp_path, monkeypatch):
    """The user package on this process's path (for checks that start no simulator)."""
    write_user_package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("user_envs.drift", "user_envs"):
        sys.modules.pop(name, None)


def policy_io(path) -> tuple[int, int]:
    """(inputs, outputs) of an ONNX policy file."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.get_inputs()[0].shape[-1], session.get_outputs()[0].shape[-1]


# ------------------------------------------------------------ environments

def test_gym_id_takes_spaces_and_reward_threshold_from_gymnasium():
    spec, ref = env_spec("gym:Acrobot-v1"), gymnasium.make("Acrobot-v1")
    assert spec.observation_space == Box(tuple(ref.observation_space.low.tolist()),
                                         tuple(ref.observation_space.high.tolist()), (6,))
    assert spec.action_space == Discrete(3) and not spec.continuous
    assert spec.reward_threshold == ref.spec.reward_threshold == -100.0


def test_gym_env_trains_from_the_command_line(start_run, tmp_path):
    logdir = tmp_path / "logs"
    run = start_run("--env", "gym:Acrobot-v1", "--sims", 2, "--max-env-steps", 1024, "--env-steps-per-sample", 128,
                    "--logdir", logdir)
    run.proc.wait(timeout=60)
    assert run.proc.returncode == 1, run.output()       # the step budget, not a failure
    summary = summary_of(logdir)
    assert summary["config"]["env"] == "gym:Acrobot-v1"
    assert summary["config"]["stop_return"] == -100.0   # gymnasium's reward threshold
    assert summary["env_steps"] >= 1024 and summary["env_steps_trained"] > 0
    assert summary["env_steps_dropped"] == {} and summary["simulator_restarts"] == 0
    assert policy_io(logdir / "policy.onnx") == (6, 3)
    assert shm_entries(run.proc.pid) == [] and descendants(run.proc.pid) == []


def episode(obs_dim: int, actions: list, dist_size: int) -> EpisodeBatch:
    ep = Episode(np.zeros(obs_dim, np.float32))
    for a in actions:
        ep.add_step(a, -1.0, np.zeros(obs_dim, np.float32), np.zeros(dist_size, np.float32), -0.5)
    return EpisodeBatch.from_episodes([ep.finalize()])


@pytest.mark.parametrize("make_chunk, problem", [
    (lambda: episode(6, [0, 1, 2], 3), None),
    (lambda: episode(4, [0, 1, 2], 3), "the environment's is (6,)"),
    (lambda: episode(6, [0, 3, 1], 3), "out of range"),
    (lambda: episode(6, [0.5, 1.0], 3), "must be integers"),
    (lambda: episode(6, [0, 1], 2), "action_dist_inputs shape"),
], ids=["fits", "wrong-obs-shape", "action-out-of-range", "float-actions", "wrong-dist-inputs"])
def test_clients_data_is_checked_against_a_gym_envs_spaces(make_chunk, problem):
    reason = check_episodes(make_chunk(), env_spec("gym:Acrobot-v1"))
    assert reason is None if problem is None else problem in reason


def test_continuous_actions_are_checked_against_the_box():
    spec = env_spec("Pendulum-v1")
    ep = episode(3, [0.3, -2.5, 7.0], 2)              # any finite torque: the env clips it
    assert check_episodes(ep, spec) is None and ep.actions.shape == (3, 1)
    assert "action space" in check_episodes(episode(3, [[0.3, 0.1]], 2), spec)   # two dimensions for one
    ints = episode(3, [1, 0], 2)      # JSON integers where floats go (RLLINK.md): taken, as floats
    assert check_episodes(ints, spec) is None and ints.actions.dtype == np.float32
    assert ints.actions.ravel().tolist() == [1.0, 0.0]


def test_user_factory_module_trains_from_the_command_line(start_run, tmp_path):
    write_user_package(tmp_path)  # the run's working directory: importable, as for a user's project
    logdir = tmp_path / "logs"
    run = start_run("--env", "user_envs.drift:make_env", "--sims", 2, "--max-env-steps", 2048,
                    "--env-steps-per-sample", 256, "--logdir", logdir)
    run.proc.wait(timeout=60)
    # A simulator that sent the env a wrong or unclipped action would have died (exit 3).
    assert run.proc.returncode == 1, run.output()
    summary = summary_of(logdir)
    assert summary["return_mean"] == 10.0 and summary["episodes"] >= 100
    assert summary["env_steps_dropped"] == {} and summary["simulator_restarts"] == 0
    assert policy_io(logdir / "policy.onnx") == (3, 4)   # 2 means and 2 log-stds
    assert shm_entries(run.proc.pid) == [] and descendants(run.proc.pid) == []


def test_a_closure_is_an_env_for_training_from_python(tmp_path, no_shm_leftovers, no_sim_leftovers):
    reward = 0.25   # a local: the simulators' returns show it only if they got the closure itself
    summary = shmrl.train(env=lambda: Corridor(reward), sims=2, max_env_steps=2048, env_steps_per_sample=128,
                          logdir=str(tmp_path))
    assert summary["exit_status"] == 1                 # no reward threshold: trained to the budget
    assert summary["return_mean"] == 10 * reward and summary["episodes"] >= 100
    assert summary["env_steps_dropped"] == {} and sorted(summary["env_steps_by_client"]) == ["shm:0", "shm:1"]
    assert "<lambda>" in summary["config"]["env"]
    assert policy_io(tmp_path / "policy.onnx") == (2, 3)


@pytest.mark.parametrize("env, message", [
    ("Nope-v0", "unknown environment 'Nope-v0'"),
    ("gym:Nope-v0", "gym:Nope-v0: Environment `Nope` doesn't exist"),
    ("gym:CartPole-v9", "gym:CartPole-v9: Environment version `v9`"),
    ("no_such_module_xyz:make_env", "cannot load make_env from no_such_module_xyz"),
    ("user_envs.drift:no_such_factory", "cannot load no_such_factory from user_envs.drift"),
    ("user_envs.drift:np", "np is a module, not a function that makes an env"),
    ("user_envs.drift:make_nothing", "made 'NoneType', not an env"),
    ("user_envs.drift:make_text_env", "no observation shmrl can encode"),
    ("user_envs.drift:make_integer_action_env", "unsupported action space Box"),
])
def test_bad_env_strings_are_clear_errors(env, message, user_envs_importable, capsys):
    with pytest.raises(SystemExit) as exit:
        parse_args(["--env", env])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and message in err and "Traceback" not in err, err


def test_a_callable_that_makes_no_env_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not an env"):
        shmrl.train(env=lambda: "not an env", sims=1, logdir=str(tmp_path))


# ------------------------------------------------------------ the Python API

def test_train_with_a_config_returns_the_summary_and_writes_summary_json(tmp_path, no_shm_leftovers,
                                                                         no_sim_leftovers):
    # Random play averages about 22 (CartPole-v1); 40 takes some learning.
    summary = shmrl.train(shmrl.Config(env="CartPole-v1", sims=1, stop_return=40, max_env_steps=100_000,
                                       logdir=str(tmp_path)))
    assert summary["solved"] and summary["exit_status"] == 0 and summary["return_mean"] >= 40
    assert 0 < summary["env_steps"] < 100_000 and 0 < summary["wall_s"] < 60 and summary["updates"] >= 1
    assert summary["config"]["stop_return"] == 40 and summary["config"]["env"] == "CartPole-v1"
    assert summary_of(tmp_path) == summary


def test_train_with_keywords_runs_to_the_step_budget(tmp_path, no_shm_leftovers, no_sim_leftovers):
    summary = quick_cartpole(tmp_path, stop_return=math.inf, max_env_steps=1000)
    assert not summary["solved"] and summary["exit_status"] == 1
    assert 1000 <= summary["env_steps"] < 1000 + 128 and summary["config"]["env_steps_per_sample"] == 128
    # summary.json is strict JSON: the returned summary's inf (stop_return) is null there.
    assert summary["config"]["stop_return"] == math.inf
    assert summary_of(tmp_path) == finite_or_none(summary)


# ------------------------------------------------------------ progress display and metrics

class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def check_progress_lines(lines: list[str], rows: list[dict], every: float) -> None:
    """The lines printed are update 1's, then each time the first update at least ``every``
    seconds after the last line (timed by metrics.jsonl's elapsed_s, the same clock)."""
    printed = {int(line.split()[1]) for line in lines}
    assert len(printed) == len(lines) and 1 in printed
    last = None
    for i, row in enumerate(rows):
        if last is not None:
            gap = row["elapsed_s"] - last
            if row["update"] in printed:
                assert gap >= every - 1e-5, (row["update"], gap)
            elif i < len(rows) - 1:   # the last row is written again as the run ends, at the end's clock
                assert gap < every + 1e-5, (row["update"], gap)
        if row["update"] in printed:
            last = row["elapsed_s"]


@pytest.mark.parametrize("stdout, log_every, every", [
    (io.StringIO, None, 10.0),   # a file or a pipe: every 10 s
    (Terminal, None, 0.0),       # a terminal: every update
    (io.StringIO, 0.0, 0.0),     # --log-every 0
    (io.StringIO, 0.1, 0.1),     # --log-every 0.1
], ids=["file", "terminal", "log-every-0", "log-every-0.1"])
def test_progress_lines_depend_on_the_terminal_and_log_every_and_metrics_has_every_update(
        stdout, log_every, every, tmp_path, no_shm_leftovers, no_sim_leftovers):
    out = stdout()
    with contextlib.redirect_stdout(out):
        summary = quick_cartpole(tmp_path, stop_return=math.inf, log_every=log_every)
    assert summary["updates"] >= 20
    rows = metrics_rows(tmp_path)
    assert [row["update"] for row in rows] == list(range(1, summary["updates"] + 1))
    check_progress_lines([line for line in out.getvalue().splitlines() if line.startswith("update ")], rows, every)


def test_log_every_flag():
    assert parse_args([]).log_every is None   # decided at run time: terminal or not
    assert parse_args(["--log-every", "2.5"]).log_every == 2.5


# ------------------------------------------------------------ checkpoints

def test_checkpoints_every_n_updates_keep_only_the_last_k(tmp_path, monkeypatch, no_shm_leftovers,
                                                          no_sim_leftovers):
    saved = []   # (update, checkpoints on disk right after it was written)
    save = checkpoint.save

    def save_and_look(logdir, update, *args, **kwargs):
        path = save(logdir, update, *args, **kwargs)
        saved.append((update, sorted(p.name for p in checkpoint.checkpoints_dir(logdir).iterdir())))
        return path

    monkeypatch.setattr(checkpoint, "save", save_and_look)
    summary = quick_cartpole(tmp_path, stop_return=math.inf, checkpoint_every=3, keep_checkpoints=2)
    updates = summary["updates"]
    assert updates >= 20
    # Every 3 updates, and once more at the end (the same update again if it is a multiple of 3).
    assert [u for u, _ in saved] == [*range(3, updates + 1, 3), updates]
    written = []
    for update, on_disk in saved:
        written = sorted({*written, update})
        assert on_disk == [f"{u:06d}" for u in written[-2:]]
    for path in checkpoint.checkpoints_dir(tmp_path).iterdir():
        arrays, state = checkpoint.load(path)
        assert state["update"] == int(path.name) and arrays["params"].size > 0
    assert summary["checkpoint"] == str(checkpoint.latest(tmp_path))


def test_checkpoint_flags():
    config = parse_args(["--checkpoint-every", "5", "--keep-checkpoints", "2"])
    assert (config.checkpoint_every, config.keep_checkpoints) == (5, 2)
    assert (parse_args([]).checkpoint_every, parse_args([]).keep_checkpoints) == (0, 3)  # only at the end
    with pytest.raises(SystemExit):
        parse_args(["--keep-checkpoints", "0"])


class Shifted:
    """gymnasium's Discrete(3, start=-1): the env's actions are -1, 0 and 1."""
    observation_space = gymnasium.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gymnasium.spaces.Discrete(3, start=-1)

    def reset(self, seed=None, options=None):
        self.seen = []
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.seen.append(action)
        return np.zeros(2, np.float32), 0.0, False, False, {}


def test_a_discrete_space_with_a_start_gets_actions_of_its_own_range():
    from shmrl.envs.make import make_vec_env

    assert env_spec(Shifted).action_space == Discrete(3, start=-1)   # the policy still has 3 outputs
    envs = make_vec_env(Shifted, 3, seed=0)
    envs.reset()
    envs.step(np.array([0, 1, 2]))                                   # the policy's action indices
    assert [env.seen for env in envs._envs] == [[-1], [0], [1]]
