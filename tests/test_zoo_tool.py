"""tools/zoo.py's quick mode: shmrl and SB3 with rl-zoo3's settings, in turns, on a
MuJoCo env; the table's figures and the plot come out of real runs."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools import zoo

REPO = Path(__file__).resolve().parents[1]
ZOO_PYTHON = Path("~/.cache/shmrl/zoo-venv/bin/python").expanduser()


def test_a_trainer_is_stopped_at_its_time_even_when_this_tool_was_started_ignoring_sigint(tmp_path):
    """A background job of a script (``nohup python tools/zoo.py &``) starts with SIGINT
    ignored, and so would every Python it starts: rl-zoo3 then trained on until the SIGKILL
    a minute later, and its curve ran past --seconds. The trainer must still get Ctrl-C."""
    trainer = ("import time\ntry:\n    print('training', flush=True); time.sleep(120)\n"
               "except KeyboardInterrupt:\n    print('interrupted: saving', flush=True)\n")
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        start = time.monotonic()
        # 4 s: time for the trainer to start (into its try) even on a loaded machine
        zoo.stop_after([sys.executable, "-c", trainer], 4.0, tmp_path, tmp_path / "log")
        took = time.monotonic() - start
    finally:
        signal.signal(signal.SIGINT, previous)
    assert "interrupted: saving" in (tmp_path / "log").read_text()
    assert took < 30, took   # not the 60-s SIGKILL


@pytest.mark.slow   # among the suite's longest (25-35 s): both trainers run
@pytest.mark.skipif(not ZOO_PYTHON.exists(), reason="no rl-zoo3 virtualenv: `python tools/zoo.py --setup` "
                                                    "makes it (.ci/run does, before the tests)")
def test_the_mujoco_benchmark_runs_both_trainers_and_plots_them(tmp_path, no_shm_leftovers):
    pytest.importorskip("mujoco", reason="the mujoco extra is not installed (the test extra has it)")
    out = tmp_path / "curves.png"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "zoo.py"), "--quick", "--json",
                           "--plot", str(out)], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    env = result["envs"]["InvertedPendulum-v5"]
    run = env["runs"][0]
    for who in ("shmrl", "sb3"):
        curve = run[who]["curve"]
        assert curve and all(p["wall_s"] <= result["seconds"] + 5 for p in curve), who
        steps = [p["env_steps"] for p in curve]
        assert steps == sorted(steps) and steps[-1] > 0, who
        assert run[who]["env_steps_per_s"] > 0 and run[who]["env_steps"] >= steps[-1] - 1000, who
    assert run["shmrl"]["final"]["return_mean"] > run["shmrl"]["curve"][0]["return_mean"]   # it learns
    assert run["comparison"]["sb3_return"] is not None and env["shmrl_final"] is not None
    assert out.read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow   # among the suite's longest (25-35 s): both trainers run
@pytest.mark.skipif(not ZOO_PYTHON.exists(), reason="no rl-zoo3 virtualenv: `python tools/zoo.py --setup` "
                                                    "makes it (.ci/run does, before the tests)")
def test_the_recurrent_baseline_runs_recurrent_ppo_and_shmrl_and_plots_them(tmp_path, no_shm_leftovers):
    """tools/recurrent_baseline.py --quick: sb3-contrib's RecurrentPPO (rl-zoo3's ppo_lstm
    settings) and shmrl's LSTM on CartPoleNoVel-v1, in turns, compared at the same return."""
    out = tmp_path / "curves.png"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "recurrent_baseline.py"), "--quick", "--json",
                           "--plot", str(out)], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    env = result["envs"]["CartPoleNoVel-v1"]
    assert env["target"] == 475.0
    run = env["runs"][0]
    for who in ("shmrl", "sb3"):
        curve = run[who]["curve"]
        assert curve and all(p["wall_s"] <= result["seconds"] + 5 for p in curve), who
        steps = [p["env_steps"] for p in curve]
        assert steps == sorted(steps) and steps[-1] > 0, who
    assert "ppo_lstm" in run["sb3"]["command"] and "CartPoleNoVel-v1" in run["shmrl"]["command"]
    assert run["shmrl"]["final"]["return_mean"] > run["shmrl"]["curve"][0]["return_mean"]   # it learns
    c = run["comparison"]
    assert c["target"] == 475.0 and c["sb3_final_return"] == run["sb3"]["curve"][-1]["return_mean"]
    assert c["sb3_reached_target"] is False and c["speedup"] is None   # not in 10 s
    assert c["shmrl_wall_s_to_sb3_final"] is not None
    assert out.read_bytes().startswith(b"\x89PNG")


def test_a_run_cut_short_of_a_step_count_has_no_return_there():
    curve = [{"env_steps": 50_000, "wall_s": 100.0, "return_mean": 10.0},
             {"env_steps": 120_000, "wall_s": 900.0, "return_mean": 20.0}]
    assert zoo.at_steps(curve, 100_000) == 10.0
    assert zoo.at_steps(curve, 300_000) is None          # stopped by its time cap at 120k
    assert zoo.at_steps(curve + [{"env_steps": 299_500, "wall_s": 950.0, "return_mean": 30.0}], 300_000) == 30.0
    assert zoo.at_steps([], 1000) is None
