"""--device: where the learner's PPO lives. This machine has no GPU: the tests run cpu and
auto (which must take the CPU here), the refusal of cuda, auto's rule with a GPU mocked,
and checkpoints that hold CPU arrays whatever the device (tools/gpu_check.py checks the
GPU path itself where there is one)."""
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import shmrl
from conftest import descendants, quick_cartpole
from shmrl.config.settings import Config, ConfigError, resolve_config
from shmrl.core.spaces import Box, Discrete
from shmrl.envs.spec import EnvSpec
from shmrl.model.ppo import PPO
from shmrl.run import parse_args
from shmrl.server.store import DEFAULT_POLICY
from shmrl.trainer import setup as trainer_setup
from shmrl.trainer.setup import LARGE_MINIBATCH, learner_device, make_ppos, policy_net, set_up

ROOT = Path(__file__).resolve().parents[1]
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this test is of a machine without a CUDA GPU")
ATARI = EnvSpec("gym:ALE/Breakout-v5", Box((0,), (255,), (4, 84, 84), "uint8"), Discrete(4))
CHEETAH = EnvSpec("gym:HalfCheetah-v5", Box((-np.inf,), (np.inf,), (17,)), Box((-1.0,), (1.0,), (6,)))


def preset_net(spec, **fields):
    config = resolve_config(Config(env=spec.env_id, **fields), spec)
    return config, {DEFAULT_POLICY: policy_net(config, spec)}


def test_the_device_flag_takes_auto_cpu_or_cuda_and_defaults_to_auto(capsys):
    assert parse_args([]).device == "auto"
    assert parse_args(["--device", "cpu"]).device == "cpu"
    assert parse_args(["--device", "cuda"]).device == "cuda"   # refused only where the run is set up
    with pytest.raises(SystemExit) as refused:
        parse_args(["--device", "gpu"])
    assert refused.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "--device" in err[0], err


@no_gpu
def test_device_cuda_without_cuda_is_refused_by_the_api_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = set(descendants(os.getpid()))
    with pytest.raises(ConfigError, match=r"--device cuda: torch \S+ is a CPU build; give --device cpu or auto"):
        shmrl.train(device="cuda", sims=1, logdir=str(tmp_path / "run"))
    assert set(descendants(os.getpid())) <= before   # no process started
    assert list(tmp_path.iterdir()) == []            # nothing written


@no_gpu
def test_device_cuda_without_cuda_is_one_error_line_and_exit_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "shmrl.run", "--device", "cuda", "--sims", "1", "--logdir",
                           str(tmp_path / "run")], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --device cuda: torch "), proc.stderr
    assert "CPU build" in lines[0] and "docs/OPERATIONS.md" in lines[0]
    assert not (tmp_path / "run").exists()


@no_gpu
def test_auto_takes_the_cpu_here_says_so_once_and_summary_json_records_it(tmp_path, caplog):
    setup = set_up(Config(env="CartPole-v1", sims=1, logdir=str(tmp_path / "a")))
    with caplog.at_level(logging.INFO, logger="shmrl.run"):
        ppos = make_ppos(setup)
        make_ppos(setup)                                # the same choice again is not said again
    said = [r.getMessage() for r in caplog.records if "learner on" in r.getMessage()]
    assert said == ["learner on cpu (--device auto: torch sees no CUDA GPU)"]
    assert setup.device == "cpu"
    ppo = ppos[DEFAULT_POLICY]
    assert ppo.device == torch.device("cpu") and ppo.optimizer.flat.device.type == "cpu"
    summary = quick_cartpole(tmp_path / "run", max_env_steps=600)
    assert summary["device"] == "cpu" and summary["config"]["device"] == "auto"
    summary = quick_cartpole(tmp_path / "cpu", max_env_steps=600, device="cpu")
    assert summary["device"] == "cpu" and summary["config"]["device"] == "cpu"


def test_auto_puts_a_conv_net_or_large_minibatches_on_a_gpu_and_small_mlps_on_the_cpu(monkeypatch):
    assert f"minibatches of {LARGE_MINIBATCH} steps or more" in Config.__dataclass_fields__["device"].metadata["help"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # a GPU, as far as shmrl can tell
    assert trainer_setup.cuda_available()
    trainer_setup.check_device(Config(device="cuda"))                # not refused where there is one
    config, nets = preset_net(ATARI)
    assert next(iter(nets.values())).convolutional
    assert learner_device(config, nets, True) == ("cuda", "a convolutional network, and a CUDA GPU")
    assert learner_device(config, nets, False) == ("cpu", "torch sees no CUDA GPU")
    config, nets = preset_net(CHEETAH)                               # MLP 64x64, minibatch 256
    assert not next(iter(nets.values())).convolutional
    device, why = learner_device(config, nets, True)
    assert device == "cpu" and f"minibatches of 256 < {LARGE_MINIBATCH} steps" in why
    config, nets = preset_net(CHEETAH, minibatch_size=LARGE_MINIBATCH)
    assert learner_device(config, nets, True)[0] == "cuda"
    for given in ("cpu", "cuda"):                                    # a device given is taken as it is
        config, nets = preset_net(ATARI, device=given)
        assert learner_device(config, nets, True) == (given, "as given")


def test_a_checkpoint_holds_cpu_arrays_and_loads_onto_the_ppo_of_another_run():
    """What a PPO saves is numpy (a cuda run's too: every tensor goes through the CPU), and
    the PPO that loads it puts it on its own device; here both are the CPU's."""
    from shmrl.core.episode import EpisodeBatch
    from tools.update_bench import CASES, case_config, fake_messages

    case = next(c for c in CASES if c.name == "mlp64-mb256")
    spec, config = case_config(case, quick=True)
    net = policy_net(config, spec)
    ppo = PPO(net, config, seed=0, device="cpu")
    ppo.update(ppo.make_batch(EpisodeBatch.concat(fake_messages(net, config))))
    arrays, values = ppo.get_state()
    assert all(isinstance(a, np.ndarray) for a in arrays.values())
    other = PPO(net, config, seed=1, device="cpu")
    other.set_state({k: a.copy() for k, a in arrays.items()}, values)
    for name in ("flat", "exp_avg", "exp_avg_sq"):
        assert torch.equal(getattr(other.optimizer, name), getattr(ppo.optimizer, name)), name
    weights = other.published_weights()
    assert all(isinstance(w, np.ndarray) for w in weights.values())
    assert all(np.array_equal(w, arrays[f"policy/{k}"]) for k, w in weights.items())
