"""Recordings under faults (docs/OPERATIONS.md, "What shmrl guarantees"): one writer per
dataset folder and no shard ever replaced, a recording that cannot write is a failed part,
damaged shards passed over and damaged manifests refused, poisoned or mismatched datasets
refused by --pretrain and export, and the real port of ``python -m shmrl.record --tcp-port 0``."""
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from conftest import need, wait_until
from shmrl.config.settings import ConfigError
from shmrl.envs.make import env_spec
from shmrl.files.dataset import Dataset, DatasetWriter, manifest_for

# Runs a module as ``python -m`` does, on a disk where every shard write fails with ENOSPC
# (the manifest still fits): a full disk, injected at the file write.
FULL_DISK = """
import builtins, errno, os, runpy, sys

real_open = builtins.open


class FullDisk:
    def __init__(self, f):
        self._f = f

    def write(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def open_on_a_full_disk(file, mode="r", *args, **kwargs):
    f = real_open(file, mode, *args, **kwargs)
    return FullDisk(f) if os.path.basename(str(file)).startswith(".shard") and "w" in mode else f


builtins.open = open_on_a_full_disk
sys.argv = sys.argv[1:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""

QUICK_RUN = ("--sims", "1", "--env-steps-per-sample", "256", "--epochs", "2", "--log-every", "0", "--no-plot",
             "--no-tensorboard")


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def shmrl_command(module: str, *args, timeout: float = 120, cwd=None, full_disk: bool = False):
    """``python -m shmrl.MODULE ARGS`` to its end, in a session of its own that is killed
    whole (its simulators too) if it outlives ``timeout``."""
    head = [sys.executable, "-c", FULL_DISK, f"shmrl.{module}"] if full_disk else [sys.executable, "-m",
                                                                                   f"shmrl.{module}"]
    args = [*head, *map(str, args)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=10)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def cartpole_arrays(rng, lengths: list[int]) -> dict:
    """A shard's arrays, but its policy id, of CartPole episodes of ``lengths`` steps
    (docs/RECORDING.md's format)."""
    episodes, steps = len(lengths), sum(lengths)
    return {"lengths": np.array(lengths, np.int64),
            "terminated": np.ones(episodes, bool), "truncated": np.zeros(episodes, bool),
            "stopped": np.zeros(episodes, bool), "agent_id": np.array([""] * episodes),
            "episode_id": np.array([""] * episodes), "source": np.array(["test"] * episodes),
            "obs": rng.normal(size=(steps + episodes, 4)).astype(np.float32),
            "actions": rng.integers(0, 2, steps).astype(np.int64), "rewards": np.ones(steps, np.float32),
            "action_logp": np.full(steps, -0.69, np.float32), "action_dist_inputs": np.zeros((steps, 2), np.float32),
            "weights_seq_no": np.ones(steps, np.int64)}


def cartpole_dataset(path, shards: int = 3, env: str = "CartPole-v1", poison=None):
    """A dataset of ``shards`` shards of two CartPole episodes each, written file by file as
    a writer leaves them; ``poison(arrays)`` changes the last shard's arrays."""
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps(manifest_for(env, {"default": env_spec("CartPole-v1")})))
    rng = np.random.default_rng(0)
    for i in range(1, shards + 1):
        arrays = cartpole_arrays(rng, [20, 30])
        if poison is not None and i == shards:
            poison(arrays)
        np.savez(path / f"shard-{i:06d}.npz", policy_id=np.array("default"), **arrays)
    return path


def damage(path):
    """Shard 2 cut in half (np.load raises BadZipFile), shard 3's lengths lying."""
    shard = path / "shard-000002.npz"
    shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])
    with np.load(path / "shard-000003.npz") as z:
        arrays = dict(z)
    arrays["lengths"] = np.array([25, 30], np.int64)   # 55 steps; the shard holds 50
    np.savez(path / "shard-000003.npz", **arrays)


def pretrain(tmp_path, dataset, *args, timeout: float = 120):
    return shmrl_command("run", *QUICK_RUN, "--max-env-steps", "600", "--pretrain", dataset, "--pretrain-steps", "20",
                         "--logdir", tmp_path / "run", *args, timeout=timeout, cwd=tmp_path)


# ---------------------------------------------------------------- one writer per dataset folder

def test_a_dataset_folder_has_one_writer_and_no_shard_is_ever_replaced(tmp_path):
    ds, rng = tmp_path / "ds", np.random.default_rng(1)
    manifest = manifest_for("CartPole-v1", {"default": env_spec("CartPole-v1")})
    first = DatasetWriter(ds, manifest)
    with pytest.raises(ConfigError, match=re.escape(f"--record {ds}: another run (pid {os.getpid()}) is writing "
                                                    "there")):
        DatasetWriter(ds, manifest)
    mine = first.write("default", cartpole_arrays(rng, [5]))
    theirs = ds / "shard-000002.npz"   # the number this writer would take next, taken by someone else
    theirs.write_bytes(b"their shard")
    assert first.write("default", cartpole_arrays(rng, [6])).name == "shard-000003.npz"
    assert (mine.name, theirs.read_bytes()) == ("shard-000001.npz", b"their shard")
    first.close()
    second = DatasetWriter(ds, manifest)   # free again: it appends after the highest shard
    assert second.write("default", cartpole_arrays(rng, [7])).name == "shard-000004.npz"
    second.close()
    assert [len(ep) for ep in Dataset(ds).episodes()] == [5, 6, 7]   # theirs is damaged: passed over


def test_a_second_writer_on_a_live_recording_is_refused_in_one_line(start_run, tmp_path):
    ds = tmp_path / "ds"
    first = start_run("--sims", "1", "--stop-return", "inf", "--max-env-steps", "10000000", "--record", ds,
                      "--logdir", tmp_path / "a", "--no-tensorboard")
    first.wait_until(lambda out: (ds / "manifest.json").exists(), 90, "the first run's manifest")
    for module, args, flag in [("run", ("--sims", "1", "--max-env-steps", "2000", "--record", ds, "--logdir",
                                        tmp_path / "b", "--no-tensorboard"), "--record"),
                               ("record", ("--sims", "1", "--episodes", "3", "--out", ds), "--out")]:
        done = shmrl_command(module, *args, cwd=tmp_path)
        assert done.returncode == 2, done.stdout + done.stderr
        assert error_lines(done.stderr) == [f"error: {flag} {ds}: another run (pid {first.proc.pid}) is writing "
                                            "there; let it end or stop it first, or choose another folder"]
        assert "Traceback" not in done.stderr
    assert not (tmp_path / "b").exists()   # refused before its log folder was made
    first.proc.send_signal(signal.SIGINT)
    assert first.proc.wait(60) == 130, first.output()
    said = re.search(r"recorded (\d+) episodes \((\d+) env steps\)", first.output())
    dataset = Dataset(ds)
    episodes = list(dataset.episodes())   # all the first run said it wrote, nothing overwritten
    assert said and (len(episodes), sum(len(ep) for ep in episodes)) == (int(said[1]), int(said[2]))
    assert not dataset.damaged


# ---------------------------------------------------------------- a recording that cannot write

def test_a_recording_on_a_full_disk_fails_with_one_error_line(tmp_path):
    done = shmrl_command("record", "--sims", "1", "--episodes", "30", "--out", tmp_path / "ds", full_disk=True)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = error_lines(done.stderr)
    assert len(errors) == 1 and "No space left on device" in errors[0], done.stderr
    assert Dataset(tmp_path / "ds").shards() == []


def test_a_training_run_whose_recording_cannot_write_stops_with_exit_3(tmp_path):
    done = shmrl_command("run", *QUICK_RUN, "--stop-return", "inf", "--max-env-steps", "60000", "--record",
                         tmp_path / "ds", "--logdir", tmp_path / "run", full_disk=True, timeout=180, cwd=tmp_path)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = error_lines(done.stderr)
    assert len(errors) == 1 and "recording" in errors[0] and "No space left on device" in errors[0], done.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["exit_status"] == 3 and "No space left on device" in summary["error"]
    assert summary["env_steps"] < 60000   # it stopped, it did not train on without its recording


# ---------------------------------------------------------------- damaged shards and manifests

def test_damaged_shards_are_passed_over_with_one_warning_naming_them(tmp_path, caplog):
    ds = cartpole_dataset(tmp_path / "ds", shards=4)
    damage(ds)
    dataset = Dataset(ds)
    with caplog.at_level(logging.WARNING, logger="shmrl.dataset"):
        episodes = list(dataset.episodes())
        assert len(dataset.batch("default").lengths) == 4   # said once, not again
    assert [len(ep) for ep in episodes] == [20, 30, 20, 30]   # shards 1 and 4
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert "shard-000002.npz" in warnings[0] and "shard-000003.npz" in warnings[0]


@pytest.mark.parametrize("manifest", ["[1]", '{"format": "shmrl-dataset", "version": 1, "env": "CartPole-v1", '
                                             '"policies": {"default": {"observation_space": 5}}}'])
def test_a_damaged_manifest_is_refused_by_export_and_pretrain_in_one_line(tmp_path, capsys, monkeypatch, manifest):
    from shmrl import record

    need("minari", "minari")
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari"))   # export sets it: restored after
    ds = cartpole_dataset(tmp_path / "ds")
    (ds / "manifest.json").write_text(manifest)
    assert record.main(["export", ds, "--minari-id", "x-v0", "--minari-root", tmp_path / "minari"]) == 2
    errors = error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and "manifest.json" in errors[0], errors
    done = pretrain(tmp_path, ds)
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(error_lines(done.stderr)) == 1 and "--pretrain" in done.stderr and "Traceback" not in done.stderr


def test_export_prints_no_warning_the_user_did_not_cause_and_takes_the_metadata_it_is_given(tmp_path, monkeypatch):
    """Minari warns about every piece of metadata left None (author, permalink, ...): an
    export without them prints nothing but its line; given, they are the dataset's."""
    minari = need("minari", "minari")
    ds = cartpole_dataset(tmp_path / "ds")
    env = dict(os.environ, MINARI_DATASETS_PATH=str(tmp_path / "minari"), PYTHONWARNINGS="always")
    for name, extra in (("shmrl/plain-v0", []), ("shmrl/signed-v0", ["--author", "Ada", "--author-email",
                                                                      "ada@example.org", "--code-permalink",
                                                                      "https://example.org/shmrl@abc"])):
        done = subprocess.run([sys.executable, "-m", "shmrl.record", "export", ds, "--minari-id", name, *extra],
                              capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 0 and done.stderr == "", done.stderr
        assert done.stdout.startswith("exported 6 episodes"), done.stdout
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari"))
    meta = minari.load_dataset("shmrl/signed-v0").storage.metadata
    assert (meta["author"], meta["author_email"], meta["code_permalink"]) == \
        ({"Ada"}, {"ada@example.org"}, "https://example.org/shmrl@abc")


def test_export_and_pretrain_pass_over_damaged_shards(tmp_path):
    need("minari", "minari")
    ds = cartpole_dataset(tmp_path / "ds", shards=4)
    damage(ds)
    env = dict(os.environ, MINARI_DATASETS_PATH=str(tmp_path / "minari"))
    done = subprocess.run([sys.executable, "-m", "shmrl.record", "export", ds, "--minari-id", "shmrl/damaged-v0"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "exported 4 episodes" in done.stdout and "Traceback" not in done.stderr
    passed = [line for line in done.stderr.splitlines() if "passed over" in line]
    assert len(passed) == 1 and "shard-000002.npz" in passed[0] and "shard-000003.npz" in passed[0], done.stderr
    done = pretrain(tmp_path, ds)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "pretrain: policy 'default': 3 episodes" in done.stdout
    assert sum("passed over 2 damaged shards" in line for line in done.stderr.splitlines()) == 1, done.stderr


# ---------------------------------------------------------------- poisoned or mismatched datasets

def set_obs(value):
    def poison(arrays):
        arrays["obs"][7, 2] = value
    return poison


def set_reward(value):
    def poison(arrays):
        arrays["rewards"][3] = value
    return poison


@pytest.mark.parametrize("poison", [set_obs(math.nan), set_obs(math.inf), set_obs(1e38), set_reward(1e38)],
                         ids=["nan-obs", "inf-obs", "1e38-obs", "1e38-reward"])
def test_poisoned_datasets_are_refused_by_export_and_pretrain(tmp_path, capsys, monkeypatch, poison):
    from shmrl import record
    from shmrl.config.settings import Config
    from shmrl.trainer.setup import set_up

    need("minari", "minari")
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari"))   # export sets it: restored after
    ds = cartpole_dataset(tmp_path / "ds", poison=poison)
    assert record.main(["export", ds, "--minari-id", "x-v0", "--minari-root", tmp_path / "minari"]) == 2
    errors = error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and "shard-000003.npz: poisoned" in errors[0], errors
    assert not (tmp_path / "minari").exists() or not any((tmp_path / "minari").rglob("*.hdf5"))
    with pytest.raises(ConfigError, match=r"--pretrain: .*shard-000003\.npz: poisoned"):
        set_up(Config(env="CartPole-v1", sims=1, pretrain=str(ds), pretrain_steps=10, logdir=str(tmp_path / "run")))


def test_pretrain_refuses_nan_observations_and_another_envs_dataset_in_one_line(tmp_path):
    """What the command line says (set_up raises it): one line, exit 2, before anything starts."""
    for name, dataset, why in [("nan", cartpole_dataset(tmp_path / "nan", poison=set_obs(math.nan)), "poisoned"),
                               ("other-env", cartpole_dataset(tmp_path / "gym", env="gym:CartPole-v1"),
                                "its episodes are of env 'gym:CartPole-v1', not 'CartPole-v1'")]:
        done = pretrain(tmp_path, dataset, "--logdir", tmp_path / f"run-{name}")
        assert done.returncode == 2, done.stdout + done.stderr
        errors = error_lines(done.stderr)
        assert len(errors) == 1 and errors[0].startswith("error: --pretrain") and why in errors[0], done.stderr
        assert "Traceback" not in done.stderr and not (tmp_path / f"run-{name}").exists()


# ---------------------------------------------------------------- the port it listens on

@pytest.mark.timeout(120)   # its reads of the recorder's lines block
def test_record_with_tcp_port_0_prints_the_port_it_listens_on(tmp_path):
    rec = subprocess.Popen([sys.executable, "-m", "shmrl.record", "--tcp-port", "0", "--out", str(tmp_path / "ds")],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        lines = []

        def said_where_clients_connect():
            lines.append(rec.stdout.readline())
            assert lines[-1] or rec.poll() is None, "".join(lines)
            return "clients connect to" in lines[-1]

        wait_until(said_where_clients_connect, 60, "the line that says where clients connect")
        listening = re.search(r"listening for RLlink clients on [\d.]+:(\d+)", "".join(lines))
        said = re.search(r"clients connect to [\d.]+:(\d+)", lines[-1])
        assert listening and said and said.group(1) == listening.group(1) != "0", "".join(lines)
        rec.send_signal(signal.SIGINT)
        rec.communicate(timeout=30)
        assert rec.returncode == 0
    finally:
        if rec.poll() is None:
            os.killpg(rec.pid, signal.SIGKILL)
            rec.wait(10)
