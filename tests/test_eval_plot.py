"""python -m shmrl.eval with policies whose behaviour is known, and python -m shmrl.plot."""
import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import balancing_action, need, quick_cartpole
from shmrl import eval as shmrl_eval
from shmrl.onnxio.policy import OnnxPolicy, OnnxPublisher

REPO = Path(__file__).resolve().parents[1]
SIZES = [4, 2, 2, 2]  # CartPole: 4 observations, two hidden ReLU units, 2 logits


def always(action: int) -> bytes:
    """A CartPole policy whose logits ignore the observation: greedy, always ``action``."""
    z = np.zeros
    return OnnxPublisher(SIZES).publish([z((2, 4)), z(2), z((2, 2)), z(2), z((2, 2)), np.eye(2)[action]])


def balancing() -> bytes:
    """test_envs' balancing controller as a network: logits (0, z) with z = theta + 0.5 theta_dot,
    passed through the ReLUs as relu(z) - relu(-z)."""
    w0 = np.array([[0, 0, 1, 0.5], [0, 0, -1, -0.5]])
    w2 = np.array([[0, 0], [1, -1]])
    return OnnxPublisher(SIZES).publish([w0, np.zeros(2), np.eye(2), np.zeros(2), w2, np.zeros(2)])


def gymnasium_returns(action: int, seeds=range(300)) -> list[float]:
    """Returns of gymnasium's own CartPole-v1 under a constant action."""
    gymnasium = need("gymnasium", "gym")
    out = []
    for seed in seeds:
        env, total, done = gymnasium.make("CartPole-v1"), 0.0, False
        env.reset(seed=seed)
        while not done:
            _, reward, terminated, truncated, _ = env.step(action)
            total, done = total + reward, terminated or truncated
        out.append(total)
    return out


@pytest.mark.parametrize("action", [0, 1])
def test_eval_of_a_constant_policy_gives_gymnasiums_short_episodes(action, tmp_path):
    (tmp_path / "policy.onnx").write_bytes(always(action))
    proc = subprocess.run([sys.executable, "-m", "shmrl.eval", tmp_path / "policy.onnx", "--env", "CartPole-v1",
                           "--episodes", "20", "--json"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    reference = gymnasium_returns(action)   # 8 to 11 steps, pushing one way only
    assert report["episodes"] == len(report["returns"]) == 20 and not report["stochastic"]
    assert all(min(reference) <= r <= max(reference) for r in report["returns"]), report["returns"]
    assert report["return_mean"] == pytest.approx(statistics.fmean(report["returns"]))
    assert report["return_std"] == pytest.approx(statistics.pstdev(report["returns"]))
    assert report["return_std"] > 0   # different starts, different lengths


def test_eval_of_a_balancing_policy_reports_500_with_no_spread(tmp_path, capsys):
    model = balancing()
    obs = np.random.default_rng(0).uniform(-0.2, 0.2, size=(1000, 4)).astype(np.float32)
    greedy = OnnxPolicy(model).logits(obs).argmax(axis=1)
    assert greedy.tolist() == [balancing_action(o) for o in obs]   # the network is that controller
    (tmp_path / "policy.onnx").write_bytes(model)
    assert shmrl_eval.main([str(tmp_path / "policy.onnx"), "--env", "CartPole-v1", "--episodes", "20"]) == 0
    out = capsys.readouterr().out
    assert "CartPole-v1: return 500.0 ± 0.0 over 20 episodes (greedy); min 500.0, max 500.0" in out


@pytest.mark.parametrize("env, message", [
    ("Pendulum-v1", "the policy's input 'onnx::Gemm_0' takes (4,); Pendulum-v1's observation 'obs' is (3,)"),
    ("gym:Acrobot-v1", "the policy's input 'onnx::Gemm_0' takes (4,); gym:Acrobot-v1's observation 'obs' is (6,)"),
])
def test_eval_refuses_a_policy_that_does_not_fit_the_env(env, message, tmp_path, capsys):
    if env.startswith("gym:"):
        need("gymnasium", "gym")
    (tmp_path / "policy.onnx").write_bytes(always(0))
    assert shmrl_eval.main([str(tmp_path / "policy.onnx"), "--env", env]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_eval_of_a_missing_file_is_a_clear_error(tmp_path, capsys):
    assert shmrl_eval.main([str(tmp_path / "nope.onnx")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "nope.onnx" in err


def plot(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shmrl.plot", *map(str, args)],
                          capture_output=True, text=True, timeout=60)


def test_plot_draws_the_learning_curves_of_runs_into_a_png(tmp_path, no_shm_leftovers, no_sim_leftovers):
    need("matplotlib", "plot")
    runs = [tmp_path / "seed-1", tmp_path / "seed-2"]
    for seed, logdir in enumerate(runs, 1):
        quick_cartpole(logdir, seed=seed, max_env_steps=2000, plot=True)
    out = tmp_path / "curves.png"
    proc = plot(*runs, "-o", out, "--title", "CartPole-v1, 2 seeds")
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out} (2 runs)" in proc.stdout
    assert out.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    pixels = need("matplotlib.image", "plot").imread(out)
    assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 20   # something drawn, not blank
    for logdir in runs:   # each run drew its own curve as it ended
        assert (logdir / "learning_curves.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_a_run_of_a_few_seconds_draws_no_curve_unless_asked(tmp_path, monkeypatch, no_shm_leftovers,
                                                           no_sim_leftovers):
    """The end-of-run plot is matplotlib's import and a draw (~0.5 s): a sixth of a CartPole
    run. By default only runs of PLOT_MIN_WALL_S or longer draw it; --plot always does.
    The threshold is set here on either side of the run's length (beside busy loops this
    quick run took 22 s, past the 20 s of the default): the rule is tested, not the load."""
    need("matplotlib", "plot")
    import shmrl.run

    monkeypatch.setattr(shmrl.run, "PLOT_MIN_WALL_S", 1e9)
    summary = quick_cartpole(tmp_path / "short", plot=None)
    assert summary["config"]["plot"] is True                          # matplotlib is there
    assert not (tmp_path / "short" / "learning_curves.png").exists()
    monkeypatch.setattr(shmrl.run, "PLOT_MIN_WALL_S", 0.0)
    quick_cartpole(tmp_path / "long", plot=None)
    assert (tmp_path / "long" / "learning_curves.png").exists()


def test_plot_of_a_run_dir_without_metrics_is_a_clear_error(tmp_path):
    empty, started = tmp_path / "empty", tmp_path / "started"
    empty.mkdir()
    started.mkdir()
    (started / "metrics.jsonl").write_text("")   # a run that has not finished an update yet
    for run, message in ((empty, "metrics.jsonl"), (started, "has no updates yet")):
        proc = plot(run, "-o", tmp_path / "curves.png")
        assert proc.returncode == 1 and proc.stderr.startswith("error:"), proc.stderr
        assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "curves.png").exists()


def test_plot_of_a_folder_of_runs_draws_every_run_under_it(tmp_path):
    """``python -m shmrl.plot runs``, the parent folder as ``tensorboard --logdir runs``
    takes it: every run under it, one curve each, labelled by its path under the folder."""
    import json

    from shmrl.plot import run_dirs

    need("matplotlib", "plot")
    runs = tmp_path / "runs"
    for name in ("a", "b", "sweep/c"):
        (runs / name).mkdir(parents=True)
        rows = [{"env_steps": 1000 * i, "elapsed_s": 0.5 * i, "return_mean": 10.0 * i} for i in range(1, 4)]
        (runs / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (runs / "notes").mkdir()   # not a run: passed over
    assert run_dirs(runs) == [runs / "a", runs / "b", runs / "sweep" / "c"]
    assert run_dirs(runs / "a") == [runs / "a"]
    proc = plot(runs, "-o", tmp_path / "curves.png")
    assert proc.returncode == 0 and "(3 runs)" in proc.stdout, proc.stdout + proc.stderr
    assert (tmp_path / "curves.png").stat().st_size > 0
    proc = plot(runs / "notes", "-o", tmp_path / "none.png")
    assert proc.returncode == 1 and "holds none" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
