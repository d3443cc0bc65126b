"""Every command a user runs ends cleanly and says why: shmrl.sim and the example client
exit 0 when the learner's run ends, stop trying after --max-retries, and name a refused
auth token; eval names the argument that is wrong."""
import signal
import socket
import subprocess
import sys

import pytest

from conftest import EXAMPLE_CLIENT, metrics_rows, need, wait_until

TOKEN = "s3cret"


def client(kind: str, port: int, *args) -> subprocess.Popen:
    command = ([sys.executable, "-m", "shmrl.sim", "--connect", f"127.0.0.1:{port}"] if kind == "sim" else
               [sys.executable, str(EXAMPLE_CLIENT), "--port", str(port)])
    return subprocess.Popen([*command, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return proc.returncode, out, err


def test_clients_exit_0_when_the_run_ends_and_1_for_a_refused_token(start_run, tmp_path):
    logdir = tmp_path / "run"
    run = start_run("--env", "CartPole-v1", "--sims", 0, "--tcp-port", 0, "--auth-token", TOKEN, "--stop-return", 1e9,
                    "--logdir", logdir)
    port = run.tcp_port(timeout=60)
    good = [client("sim", port, "--auth-token", TOKEN), client("example", port, "--auth-token", TOKEN)]
    refused = {("sim", "wrong"): client("sim", port, "--auth-token", "wrong"),
               ("sim", "missing"): client("sim", port),
               ("example", "wrong"): client("example", port, "--auth-token", "wrong")}
    try:
        for (kind, token), proc in refused.items():
            status, out, err = finish(proc)
            assert status == 1, (kind, out, err)
            assert "the server refused the connection" in err and "auth token?" in err, (kind, err)
            assert (f"{token} auth token?" if kind == "sim" else "wrong or missing auth token?") in err, err
        # The run ends (Ctrl-C) only once both good clients have sent it steps: a budget could
        # run out before a client slowed by load had connected, which would then find no server.
        def clients_counted():
            assert run.proc.poll() is None, run.output()
            try:
                return sum(n > 0 for n in metrics_rows(logdir)[-1]["env_steps_by_client"].values()) >= 2
            except (OSError, IndexError, ValueError):   # no row yet
                return False
        wait_until(clients_counted, 60, "both good clients' steps in the run's metrics")
        run.proc.send_signal(signal.SIGINT)
        run.proc.wait(timeout=60)
        assert run.proc.returncode == 130, run.output()
        for proc in good:   # the run ended: both clients see the session end, and exit 0 at once
            status, out, err = finish(proc, timeout=30)
            assert status == 0, (out, err)
            assert "error" not in err, err
    finally:
        for proc in [*refused.values(), *good]:
            proc.kill()


@pytest.fixture
def free_port() -> int:
    """A port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_clients_give_up_after_max_retries_when_nothing_listens(free_port):
    procs = [client("sim", free_port, "--max-retries", 2, "--retry-s", 0.1),
             client("example", free_port, "--max-retries", 2, "--retry-s", 0.1)]
    for proc in procs:
        status, out, err = finish(proc, timeout=30)
        assert status == 1, (out, err)
        assert "3 failed attempts in a row" in err, err


def test_the_example_clients_help_shows_its_defaults():
    out = subprocess.run([sys.executable, str(EXAMPLE_CLIENT), "--help"], capture_output=True, text=True,
                         timeout=30).stdout
    for default in ("(default: 5556)", "(default: 5)", "(default: 2.0)", "(default: cartpole)"):
        assert default in out, out


def test_eval_names_the_opponent_when_the_opponent_is_wrong(tmp_path):
    need("pettingzoo", "pettingzoo")
    policy = tmp_path / "policy-shared.onnx"
    policy.write_bytes(b"whatever: the opponent is looked at first")
    proc = subprocess.run([sys.executable, "-m", "shmrl.eval", str(policy), "--env", "pz:connect_four_v3",
                           "--opponent", "rnd"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert err.startswith("error: --opponent rnd: No such file or directory: not random, self,") and "\n" not in err
