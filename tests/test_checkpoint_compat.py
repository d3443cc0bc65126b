"""Checkpoints written by shmrl before the trainer was split into store, hub and trainer
(tests/data/main-ckpt-*: a CartPole run and a two-policy PettingZoo run of main at commit
2a7f2fc, both with --normalize-reward) still resume, and new checkpoints keep their layout."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import shm_entries

DATA = Path(__file__).parent / "data"


def resume_copy(name: str, tmp_path: Path, start_run, max_env_steps: int) -> tuple[dict, dict, dict]:
    """Resume a copy of fixture ``name`` until ``max_env_steps``; (the saved state, the new
    summary, the new checkpoint's arrays)."""
    logdir = tmp_path / name
    shutil.copytree(DATA / name, logdir)
    saved = json.loads((logdir / "checkpoints" / "000001" / "state.json").read_text())
    run = start_run("--resume", logdir, "--max-env-steps", max_env_steps, "--no-tensorboard")
    run.proc.wait(timeout=120)
    assert run.proc.returncode == 1, run.output()   # the step budget
    assert shm_entries(run.proc.pid) == []
    summary = json.loads((logdir / "summary.json").read_text())
    with np.load(summary["checkpoint"] + "/weights.npz") as z:
        arrays = {k: z[k] for k in z.files}
    return saved, summary, arrays


def assert_went_on(saved: dict, summary: dict) -> None:
    assert summary["resumed_from"].endswith("000001") and summary["error"] is None
    assert summary["updates"] > saved["update"] and summary["weights_seq_no"] > saved["weights_seq_no"]
    assert summary["env_steps"] > saved["counters"]["steps_received"]
    assert summary["episodes"] > saved["counters"]["episodes_completed"]
    assert summary["config"]["hidden"] == 16 and summary["config"]["normalize_reward"] is True


def test_a_single_agent_checkpoint_of_main_resumes(tmp_path, start_run):
    saved, summary, arrays = resume_copy("main-ckpt-single", tmp_path, start_run, 4096)
    assert_went_on(saved, summary)
    # Same layout as main writes: the published policy under policy/, reward statistics at the top.
    assert {"params", "exp_avg", "exp_avg_sq", "reward_stats.mean", "reward_stats.count"} <= set(arrays)
    assert any(k.startswith("policy/") for k in arrays) and not any(k.startswith("policies/") for k in arrays)
    assert float(arrays["reward_stats.count"]) > 2048   # went on from the saved statistics
    assert (tmp_path / "main-ckpt-single" / "policy.onnx").exists()


def test_a_multi_agent_checkpoint_of_main_resumes(tmp_path, start_run):
    pytest.importorskip("pettingzoo")
    saved, summary, arrays = resume_copy("main-ckpt-multi", tmp_path, start_run, 4096)
    assert_went_on(saved, summary)
    assert sorted(summary["return_by_policy"]) == ["player_0", "player_1"]
    for pid in ("player_0", "player_1"):
        assert {f"policies/{pid}/{k}" for k in ("params", "exp_avg", "reward_stats.mean")} <= set(arrays)
        assert any(k.startswith(f"policies/{pid}/policy/") for k in arrays)
        assert float(arrays[f"policies/{pid}/reward_stats.count"]) > saved["counters"]["policies"][pid][
            "steps_received"]
        assert (tmp_path / "main-ckpt-multi" / f"policy-{pid}.onnx").exists()
    assert not any(k.startswith("policy/") for k in arrays)
