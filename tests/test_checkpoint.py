"""Checkpoints that hold: non-finite weights are neither written nor loaded, a damaged
state.json or a folder replaced by a file is a clear CheckpointError (passed over for the
newest intact checkpoint), and a full disk removes the half-written one and keeps the rest."""
import json
import os

import numpy as np
import pytest

from shmrl.files import checkpoint
from shmrl.files.checkpoint import CheckpointError


def arrays(value: float = 0.5, size: int = 8) -> dict:
    return {"params": np.full(size, value, np.float32), "policy/pi.0.w": np.ones((2, 2), np.float32),
            "steps": np.arange(3)}


def state(**fields) -> dict:
    return {"weights_seq_no": 4, "counters": {"steps_received": 10, "steps_trained": 8, "steps_lost": 0,
                                              "episodes_completed": 1}, "ppo": {"adam_t": 2}, **fields}


def test_a_save_refuses_weights_with_nan_or_infinity_and_writes_nothing(tmp_path):
    checkpoint.save(tmp_path, 1, arrays(), state())
    for bad in (np.nan, np.inf):
        with pytest.raises(CheckpointError, match=r"000002 not written: params holds NaN or infinity"):
            checkpoint.save(tmp_path, 2, arrays(bad), state())
    assert [p.name for p in checkpoint.checkpoints_dir(tmp_path).iterdir()] == ["000001"]


def test_a_checkpoint_with_nan_weights_is_damaged_and_passed_over(tmp_path):
    checkpoint.save(tmp_path, 1, arrays(0.25), state())
    newest = checkpoint.save(tmp_path, 2, arrays(), state())
    poisoned = arrays()
    poisoned["policy/pi.0.w"][0, 1] = np.nan
    np.savez(newest / "weights.npz", **poisoned)   # as a run before this check could write it
    with pytest.raises(CheckpointError, match=r"weights.npz: policy/pi.0.w holds NaN or infinity"):
        checkpoint.load(newest)
    path, loaded, _, damaged = checkpoint.load_latest(tmp_path)
    assert path.name == "000001" and loaded["params"][0] == 0.25
    assert len(damaged) == 1 and "000002 is damaged (weights.npz: policy/pi.0.w holds NaN" in damaged[0]


@pytest.mark.parametrize("field, value, words", [
    ("update", "7", "update is '7', not a count"),
    ("weights_seq_no", 2**70, f"weights_seq_no is {2**70}, not a count"),
    ("weights_seq_no", -1, "weights_seq_no is -1"),
    ("weights_seq_no", True, "weights_seq_no is True"),
    ("counters", [1], "counters is list, not an object"),
    ("ppo", "x", "ppo is str, not an object"),
])
def test_a_state_json_field_of_the_wrong_type_is_a_clear_error(tmp_path, field, value, words):
    path = checkpoint.save(tmp_path, 3, arrays(), state())
    saved = json.loads((path / "state.json").read_text())
    saved[field] = value
    (path / "state.json").write_text(json.dumps(saved))
    with pytest.raises(CheckpointError, match="state.json: " + words.replace("(", r"\(")):
        checkpoint.load(path)
    with pytest.raises(CheckpointError, match=r"every checkpoint .* is damaged: .*000003 is damaged \(state.json"):
        checkpoint.load_latest(tmp_path)


def test_a_wrong_counter_is_named(tmp_path):
    path = checkpoint.save(tmp_path, 3, arrays(), state(counters={"steps_received": "many", "steps_trained": 0}))
    with pytest.raises(CheckpointError, match="counters.steps_received is 'many'"):
        checkpoint.load(path)


def test_a_checkpoint_folder_replaced_by_a_file(tmp_path):
    checkpoint.save(tmp_path, 1, arrays(0.25), state())
    root = checkpoint.checkpoints_dir(tmp_path)
    (root / "000002").write_text("not a folder")
    with pytest.raises(CheckpointError, match="000002 is not a folder"):
        checkpoint.load(root / "000002")
    path, _, _, damaged = checkpoint.load_latest(tmp_path)
    assert path.name == "000001" and "000002 is not a folder" in damaged[0]
    # The run going on from 000001 writes its update 2 where the file was.
    written = checkpoint.save(tmp_path, 2, arrays(), state())
    assert written.is_dir() and checkpoint.load(written)[1]["update"] == 2
    # The checkpoints folder itself a file: one clear error, not a traceback.
    other = tmp_path / "other"
    other.mkdir()
    checkpoint.checkpoints_dir(other).write_text("x")
    with pytest.raises(CheckpointError, match="cannot write checkpoint"):
        checkpoint.save(other, 1, arrays(), state())


def test_a_full_disk_removes_the_half_written_checkpoint_and_keeps_the_others(small_disk):
    checkpoint.save(small_disk, 1, arrays(size=1000), state())
    checkpoint.save(small_disk, 2, arrays(0.25, size=1000), state())
    with pytest.raises(CheckpointError, match=r"cannot write checkpoint .*000003: No space left on device "
                                              r"\(the ones before it are kept\)") as caught:
        checkpoint.save(small_disk, 3, arrays(size=200_000), state())   # 800 KB on a 200 KiB disk
    assert caught.value.__cause__ is None and caught.value.__suppress_context__   # one line, no chain
    root = checkpoint.checkpoints_dir(small_disk)
    assert sorted(os.listdir(root)) == ["000001", "000002"]   # no .writing-* left
    path, loaded, _, damaged = checkpoint.load_latest(small_disk)
    assert path.name == "000002" and loaded["params"][0] == 0.25 and damaged == []


def test_network_difference_names_the_setting():
    saved = {"hidden": 64, "layers": 2, "activation": "Tanh", "cnn": "nature", "memory": "none", "memory_size": 64,
             "normalize_obs": False, "log_std_init": -0.5, "policy_map": "shared"}
    assert checkpoint.network_difference(saved, dict(saved)) is None
    assert checkpoint.network_difference(saved, {**saved, "activation": "ReLU"}) == \
        "--activation ReLU differs from the checkpoint's --activation Tanh"
    assert checkpoint.network_difference(saved, {**saved, "policy_map": "per-agent"}).startswith("--policy-map per-agent")
    assert checkpoint.network_difference(saved, {**saved, "normalize_obs": True}).startswith("--normalize-obs True")
    older = {k: v for k, v in saved.items() if k != "log_std_init"}   # an older shmrl did not write it
    assert checkpoint.network_difference(older, {**saved, "log_std_init": 0.0}) is None


@pytest.fixture
def two_checkpoints(tmp_path):
    """Checkpoints 1 and 2 of a CartPole policy of --hidden 16, and its network."""
    from shmrl.config.settings import PPOSettings, with_defaults
    from shmrl.envs.make import env_spec
    from shmrl.model.net import PolicyNet
    from shmrl.model.ppo import PPO
    from shmrl.server.store import DEFAULT_POLICY, EpisodeStore
    from shmrl.trainer.resume import save_checkpoint

    net = PolicyNet(env_spec("CartPole-v1"), 16)
    ppo = PPO(net, with_defaults(PPOSettings))
    for update in (1, 2):
        save_checkpoint(tmp_path, update, update, EpisodeStore(), {DEFAULT_POLICY: ppo},
                        {"env": "CartPole-v1", "hidden": 16}, keep=3, multiagent=False)
    return tmp_path, {DEFAULT_POLICY: net}


def reshaped(folder, pick) -> str:
    """Replace the array of ``folder``'s weights.npz that ``pick(names)`` names by one of
    another shape; returns its name."""
    with np.load(folder / "weights.npz") as f:
        arrays = {k: f[k] for k in f.files}
    name = pick(sorted(arrays))
    arrays[name] = np.zeros((3, 3) if arrays[name].ndim == 2 else 5, arrays[name].dtype)
    np.savez(folder / "weights.npz", **arrays)
    return name


@pytest.mark.parametrize("which", ["policy weights", "optimizer state"])
def test_a_checkpoint_of_another_shape_is_passed_over_for_the_older_one(two_checkpoints, caplog, which):
    import logging

    from shmrl.trainer.resume import load_resume_checkpoint

    logdir, nets = two_checkpoints
    newest = checkpoint.checkpoints_dir(logdir) / "000002"
    pick = (lambda names: next(n for n in names if n.startswith("policy/") and n.endswith(".w"))) \
        if which == "policy weights" else (lambda names: "exp_avg")
    name = reshaped(newest, pick)
    with caplog.at_level(logging.WARNING, logger="shmrl.run"):
        path, _, state = load_resume_checkpoint(str(logdir), "CartPole-v1", 16, nets, False)
    assert path.name == "000001" and state["update"] == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert f"{newest} is damaged (it does not fit a network of --hidden 16" in warnings[0], warnings
    assert repr(name.removeprefix("policy/")) in warnings[0] and "going on from" in warnings[0]


def test_when_no_checkpoint_fits_the_network_the_resume_is_refused_naming_the_shapes(two_checkpoints):
    from shmrl.config.settings import ConfigError
    from shmrl.trainer.resume import load_resume_checkpoint

    logdir, nets = two_checkpoints
    for folder in checkpoint.all_checkpoints(logdir):
        reshaped(folder, lambda names: next(n for n in names if n.startswith("policy/") and n.endswith(".w")))
    with pytest.raises(ConfigError, match=r"000002 does not fit a network of --hidden 16 for CartPole-v1: its "
                                          r".* has shape \(3, 3\).*other layer sizes"):
        load_resume_checkpoint(str(logdir), "CartPole-v1", 16, nets, False)
