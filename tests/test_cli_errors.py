"""Start-up mistakes a user can make give one line ``error: ...`` and exit status 2, with
nothing started and nothing written; a damaged checkpoint falls back to an intact one."""
import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import need, shmrl_files

pytestmark = pytest.mark.usefixtures("no_shm_leftovers")


def command(module: str, *args, cwd=None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, proc.stderr
    for fragment in fragments:
        assert fragment in err, err


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A short CartPole run with a checkpoint after every update (three are kept)."""
    logdir = tmp_path_factory.mktemp("trained") / "run"
    proc = command("shmrl.run", "--sims", 2, "--max-env-steps", 8000, "--checkpoint-every", 1,
                   "--logdir", logdir, "--no-tensorboard", timeout=120)
    assert proc.returncode == 1, proc.stderr     # the step budget
    assert len(list((logdir / "checkpoints").iterdir())) == 3
    return logdir


@pytest.fixture
def run_copy(trained, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------ shmrl.run

def test_a_tcp_port_in_use(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        child = subprocess.Popen([sys.executable, "-m", "shmrl.run", "--sims", "1", "--tcp-port", str(port),
                                  "--logdir", str(tmp_path / "a")], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        out, err = child.communicate(timeout=60)
    assert_one_line_error(subprocess.CompletedProcess(child.args, child.returncode, out, err),
                          f"--tcp-port {port}", "already in use")
    # The shared-memory rings made before the port was tried are gone (segments are named
    # after their owner's pid; other runs on the machine may have theirs).
    assert not [f for f in shmrl_files() if f.startswith(f"shmrl_{child.pid}_")]


@pytest.mark.parametrize("args, fragments", [
    (["--tcp-port", 99999], ["--tcp-port must be a port number from 0 to 65535", "not 99999"]),
    (["--tcp-port", -1], ["--tcp-port must be", "not -1"]),
    (["--tcp-port", 0, "--tcp-host", "192.0.2.1"], ["192.0.2.1 is not an address of this machine"]),
    (["--logdir", "/proc/self/no/such/dir"], ["--logdir /proc/self/no/such/dir", "cannot create it"]),
    (["--hidden", 0], ["--hidden must be >= 1, not 0"]),
    (["--torch-threads", -1], ["--torch-threads must be >= 0, not -1"]),
    (["--gamma", 1.5], ["--gamma must be in (0, 1], not 1.5"]),
    (["--lr", "nan"], ["--lr must be a finite number, not nan"]),
    (["--max-restarts", -1], ["--max-restarts must be >= 0"]),
    (["--no-such-flag"], ["unrecognized arguments: --no-such-flag"]),
    (["--env", "Nope-v0"], ["unknown environment 'Nope-v0'"]),
    (["--sims", 0], ["--sims 0", "--tcp-port"]),
])
def test_bad_command_lines_of_run(args, fragments, tmp_path):
    proc = command("shmrl.run", "--sims", 1, *args, cwd=tmp_path)
    assert_one_line_error(proc, *fragments)
    assert not (tmp_path / "runs").exists()     # nothing written


def test_a_logdir_that_is_a_file(tmp_path):
    (tmp_path / "taken").write_text("a file, not a folder")
    assert_one_line_error(command("shmrl.run", "--sims", 1, "--logdir", tmp_path / "taken"), "cannot create it")


def test_resume_with_another_env_changes_nothing(run_copy):
    before = snapshot(run_copy)
    proc = command("shmrl.run", "--resume", run_copy, "--env", "Pendulum-v1")
    assert_one_line_error(proc, "trained on CartPole-v1, not Pendulum-v1")
    assert snapshot(run_copy) == before


def test_resume_with_other_layer_sizes_changes_nothing(run_copy):
    before = snapshot(run_copy)
    proc = command("shmrl.run", "--resume", run_copy, "--hidden", 64)
    assert_one_line_error(proc, "does not fit", "--hidden 64", "shape (32, 4)", "other layer sizes")
    assert snapshot(run_copy) == before


def test_resume_without_a_checkpoint(tmp_path):
    assert_one_line_error(command("shmrl.run", "--resume", tmp_path), "no checkpoint in")


def test_resume_falls_back_from_a_damaged_checkpoint_to_the_newest_intact_one(run_copy):
    *older, newest = sorted((run_copy / "checkpoints").iterdir())
    weights = newest / "weights.npz"
    weights.write_bytes(weights.read_bytes()[:100])     # truncated, as by a full disk
    proc = command("shmrl.run", "--resume", run_copy, "--max-env-steps", 10_000, "--log-every", 0, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert f"{newest} is damaged (BadZipFile" in proc.stderr and f"going on from {older[-1]}" in proc.stdout + \
        proc.stderr, proc.stderr
    assert f"resuming from {older[-1]} (update {int(older[-1].name)}" in proc.stdout, proc.stdout
    summary = json.loads((run_copy / "summary.json").read_text())
    assert summary["resumed_from"] == str(older[-1])


def test_resume_when_every_checkpoint_is_damaged_changes_nothing(run_copy):
    for folder in (run_copy / "checkpoints").iterdir():
        (folder / "state.json").write_text("{")
    before = snapshot(run_copy)
    proc = command("shmrl.run", "--resume", run_copy)
    assert_one_line_error(proc, "every checkpoint in", "is damaged", "JSONDecodeError")
    assert snapshot(run_copy) == before


# ------------------------------------------------------------ shmrl.sim and shmrl.eval

@pytest.mark.parametrize("args, fragments", [
    (["--connect", "localhost"], ["--connect", "expected HOST:PORT"]),
    (["--connect", "localhost:1", "--env", "Nope-v0"], ["unknown environment"]),
    (["--connect", "localhost:1", "--envs-per-sim", 0], ["--envs-per-sim"]),
    ([], ["one of the arguments --connect --attach is required"]),
])
def test_bad_command_lines_of_sim(args, fragments):
    assert_one_line_error(command("shmrl.sim", *args), *fragments)


def test_a_simulator_whose_env_does_not_fit_the_servers_policy(start_run, tmp_path):
    run = start_run("--sims", 0, "--tcp-port", 0, "--logdir", tmp_path / "server")
    proc = command("shmrl.sim", "--connect", f"127.0.0.1:{run.tcp_port(timeout=60)}", "--env", "Pendulum-v1", "--timeout", 30)
    assert_one_line_error(proc, "input 'onnx::Gemm_0' takes (4,); Pendulum-v1's observation 'obs' is (3,)")


def test_a_policy_that_does_not_fit_the_simulators_env():
    from shmrl.client.actor import check_policy_fits
    from shmrl.envs.make import env_spec
    from shmrl.model.net import PolicyNet
    from shmrl.onnxio.policy import OnnxPolicy

    net = PolicyNet(env_spec("CartPole-v1"), 8, "Tanh")
    with pytest.raises(ValueError, match=r"input 'onnx::Gemm_0' takes \(4,\); Pendulum-v1's observation 'obs' is \(3,\)"):
        check_policy_fits(OnnxPolicy(net.template.publish(net.initial_weights(0))), env_spec("Pendulum-v1"))


def test_bad_command_lines_of_eval(trained, tmp_path):
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"not a model")
    policy = trained / "policy.onnx"
    assert_one_line_error(command("shmrl.eval", tmp_path / "nope.onnx"), "nope.onnx", "No such file")
    assert_one_line_error(command("shmrl.eval", garbage), "not an ONNX model")
    assert_one_line_error(command("shmrl.eval", policy, "--env", "Pendulum-v1"), "Pendulum-v1's observation 'obs' is (3,)")
    assert_one_line_error(command("shmrl.eval", policy, "--episodes", 0), "--episodes")


def test_eval_of_an_env_gymnasium_does_not_have(trained):
    need("gymnasium", "gym")
    assert_one_line_error(command("shmrl.eval", trained / "policy.onnx", "--env", "gym:Nope-v0"), "doesn't exist")


def test_ray_flags_without_ray_installed_or_without_simulators(tmp_path):
    """Without Ray, --ray is a one-line error (nothing started); nothing else imports Ray."""
    code = ("import sys; sys.modules['ray'] = None\n"   # as if Ray were not installed
            "from shmrl import run\n"
            "status = run.main(['--ray', 'auto', '--sims', '2', '--logdir', 'x'])\n"
            "assert 'ray' not in [m.split('.')[0] for m in sys.modules if sys.modules[m] is not None]\n"
            "sys.exit(status)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert_one_line_error(proc, "--ray needs Ray: pip install -e '.[ray]'")
    assert not (tmp_path / "x").exists()
    assert_one_line_error(command("shmrl.run", "--ray", "auto", "--sims", 0, "--tcp-port", 0), "--ray places simulators")
    assert_one_line_error(command("shmrl.run", "--sim-cpus", 0), "--sim-cpus must be > 0")
