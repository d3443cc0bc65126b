"""python -m shmrl.conformance: shmrl's own clients, the JavaScript client and RLlib 2.48's
pass it; a client with each kind of bug it knows (tests/broken_client.py) is caught, under
the rule of RLLINK.md it breaks."""
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from broken_client import BUGS
from conftest import need_js_client
from shmrl.checker.session import check_client

ROOT = Path(__file__).resolve().parents[1]
BROKEN = ROOT / "tests" / "broken_client.py"

RLLIB_PYTHON = Path.home() / ".cache" / "shmrl" / "rllib-2.48-venv" / "bin" / "python"
# Short: a message of 200 steps and a reply held 0.5 s keep each check within seconds.
QUICK = dict(steps=200, hold_s=0.5, timeout=20.0)


def check(command, **kwargs) -> tuple[list, str]:
    out = io.StringIO()
    violations = check_client([str(c) for c in command], out=out, **{**QUICK, **kwargs})
    return violations, out.getvalue()


def test_shmrl_sim_conforms():
    # shmrl.sim ends when its connection ends (exit 1): no second connection to check.
    violations, out = check([sys.executable, "-m", "shmrl.sim", "--connect", "127.0.0.1:{port}"], reconnect=False)
    assert not violations, out
    assert "message 3: " in out and "waited 0.5 s for a held reply" in out, out


def test_the_example_client_conforms_and_reconnects():
    violations, out = check([sys.executable, ROOT / "examples" / "external_client.py", "--port", "{port}",
                             "--retry-s", "0.2", "--max-retries", "2"])
    assert not violations, out
    assert "connection 2, message 4" in out and "follows the new SET_CONFIG" in out, out


def test_shmrl_sim_with_server_inference_conforms():
    violations, out = check([sys.executable, "-m", "shmrl.sim", "--connect", "127.0.0.1:{port}",
                             "--server-inference", "--envs-per-sim", "2"], reconnect=False)
    assert not violations, out
    assert "ACTs of 2 envs checked" in out and "ACT 3: waited 0.5 s" in out, out


def test_the_js_client_conforms_in_both_codecs_and_with_server_inference():
    js = need_js_client()
    for flags in (["--codec", "binary"], ["--codec", "json"], ["--server-inference"],
                  ["--server-inference", "--codec", "json"]):
        violations, out = check(["node", js / "cartpole.js", "--port", "{port}", "--give-up-s", "1", *flags],
                                steps=2000)
        assert not violations, out
        assert "connection 2, message 4" in out or "connection 2: the first ACT carried no outcome" in out, out


def test_a_client_with_each_bug_is_caught_under_its_rule():
    """Each kind of bug tests/broken_client.py knows, checked at once in threads (each check
    mostly waits on its client: one after the other they took a minute)."""
    from concurrent.futures import ThreadPoolExecutor

    def run(bug):
        return bug, check([sys.executable, BROKEN, "--port", "{port}", "--bug", bug])

    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(run, sorted(BUGS)))
    for bug, (violations, out) in results:
        rule = BUGS[bug]
        if rule is None:
            assert not violations, f"{bug}:\n{out}"
            continue
        assert violations, f"the checker did not catch {bug}:\n{out}"
        assert any(rule in r for r, _ in violations), f"{bug} should break {rule}; found {violations}"
        assert f"VIOLATION [RLLINK.md {rule}" in out, f"{bug}:\n{out}"
        if bug == "no-reconnect":   # noticed when it exits, not after the timeout
            assert "connection 2: the client exited (status 1) instead of connecting" in out, out


# shmrl.sim with one SAC bug at a time (--algo sac): its PING lists no action_dists, or it
# samples output 0 as a plain Gaussian whatever SET_STATE's action_dist says.
SAC_BUGS = {
    "no-action-dists": "import shmrl.client.actor as m; m.PING_ACTION_DISTS = []",
    "plain-gaussian": "import shmrl.client.action_sampler as m; m.ActionSampler.set_dist = lambda self, dist: None",
}


def pendulum_sim(bug: str | None = None) -> list:
    run = "import sys; from shmrl.sim import main; sys.exit(main())"
    return [sys.executable, "-c", f"{SAC_BUGS[bug]}; {run}" if bug else run, "--env", "Pendulum-v1", "--connect",
            "127.0.0.1:{port}"]


def test_shmrls_sim_samples_sac_as_set_state_says_and_each_sac_bug_is_caught():
    """--algo sac: version 0 served as the warm-up's uniform, version 1 as the squashed
    Gaussian; shmrl.sim follows both (with server-side inference too, the server sampling)."""
    violations, out = check(pendulum_sim(), reconnect=False, algo="sac", env="Pendulum-v1")
    assert not violations, out
    assert "message 3: " in out, out
    violations, out = check([*pendulum_sim(), "--server-inference"], reconnect=False, algo="sac", env="Pendulum-v1",
                            steps=400)   # ACTs in all: past Pendulum's 200-step limit
    assert not violations, out
    violations, out = check(pendulum_sim("no-action-dists"), reconnect=False, algo="sac", env="Pendulum-v1")
    assert [rule for rule, _ in violations] == ["RLLINK.md §3.1 PING and PONG"], out
    assert "'squashed_gaussian' and 'uniform'" in violations[0][1]
    violations, out = check(pendulum_sim("plain-gaussian"), reconnect=False, algo="sac", env="Pendulum-v1")
    assert violations and {rule for rule, _ in violations} == {"RLLINK.md §4.2 Actions and their distribution"}, out
    assert any("sampled as 'uniform'" in text for _, text in violations), out   # version 0's message
    with pytest.raises(ValueError, match="--algo sac: .*one Box of floats"):
        check(pendulum_sim(), env="CartPole-v1", algo="sac")


def test_the_js_pendulum_conforms_to_a_sac_learner():
    js = need_js_client()
    violations, out = check(["node", js / "pendulum.js", "--port", "{port}", "--give-up-s", "1"], env="Pendulum-v1",
                            algo="sac", steps=400)
    assert not violations, out


def test_the_command_line_exits_1_on_a_violation_and_2_when_misused(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "shmrl.conformance", "--steps", "200", "--hold-s", "0", "--timeout", "20", "--",
           sys.executable, BROKEN, "--port", "{port}", "--bug", "sticky-config"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "VIOLATION [RLLINK.md §3.2" in done.stdout and "1 violation(s)" in done.stdout, done.stdout
    for bad in ([], ["--", "node", "x.js"], ["--steps", "0", "--", "x", "{port}"]):
        done = subprocess.run([sys.executable, "-m", "shmrl.conformance", *bad], capture_output=True, text=True,
                              timeout=60, env=env)
        assert done.returncode == 2 and done.stderr.startswith("error:"), (bad, done.stderr)


# A client that answers its PONG with a reset (SO_LINGER 0), not an orderly close.
RESETTING_CLIENT = """
import socket, struct, sys
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
sock.sendall(b'00000016{"type": "PING"}')
data = b""
while len(data) < 8 or len(data) < 8 + int(data[:8]):
    part = sock.recv(4096)
    if not part:
        sys.exit(1)
    data += part
sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
sock.close()
"""


def test_a_client_that_resets_its_connection_breaks_a_rule_exit_1():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "shmrl.conformance", "--steps", "200", "--hold-s", "0", "--timeout",
                           "20", "--no-reconnect", "--", sys.executable, "-c", RESETTING_CLIENT, "{port}"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "VIOLATION [RLLINK.md §2 The conversation] connection 1: the client reset the connection" in done.stdout, \
        done.stdout


def test_a_client_that_floods_its_output_costs_the_checker_only_its_tail():
    """The checker keeps the last of a client's output to show, not all of it: 48 MB written
    (then an exit instead of a connection, a violation) leave the checker's peak of Python
    memory far below them, and the output's end is shown."""
    import tracemalloc

    from shmrl.checker.session import make_models
    from shmrl.envs.make import env_spec

    make_models(env_spec("CartPole-v1"))   # what the check imports and builds first: not counted
    flood = "import sys\nfor _ in range(768):\n    sys.stdout.write('x' * 65535 + '\\n')\nprint('the end of the flood')"
    tracemalloc.start()
    try:
        violations, out = check([sys.executable, "-c", flood, "{port}"], reconnect=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert any("the client exited (status 0) instead of connecting" in text for _, text in violations), out
    assert out.rstrip().endswith("the end of the flood"), out[-500:]
    assert peak < 16 << 20, f"the checker held {peak >> 20} MiB of Python memory at its peak"


@pytest.mark.slow
def test_rllib_248s_client_conforms(tmp_path):
    """RLlib's _dummy_client (tools/rllib_compat.py starts it from its virtualenv, which
    .ci/run sets up). It crashes when its connection closes: no second connection."""
    if not RLLIB_PYTHON.exists():
        pytest.skip(f"{RLLIB_PYTHON} is missing: python tools/rllib_compat.py --setup (.ci/run does)")
    # In a scratch folder: the client writes its _temp_onnx where it runs.
    command = ["sh", "-c", f"cd {tmp_path} && exec {RLLIB_PYTHON} {ROOT / 'tools' / 'rllib_compat.py'} "
                           f"_rllib-client --port {{port}} --wait 60"]
    violations, out = check(command, reconnect=False, timeout=90.0, steps=2000)
    assert not violations, out
    assert "connection 1, message 3" in out, out


def test_the_c_client_conforms_in_both_codecs(tmp_path):
    """clients/c (server-side inference) through the checker, built as tests/test_c_client.py builds it."""
    from test_c_client import C_DIR, WARN, gcc

    binary = str(tmp_path / "cartpole")
    gcc(*WARN, "-O2", "-o", binary, str(C_DIR / "cartpole.c"), "-lm")
    for codec in ("binary", "json"):
        violations, out = check([binary, "--port", "{port}", "--envs", "2", "--codec", codec, "--max-retries", "2"])
        assert not violations, out
        assert "ACTs of 2 envs checked" in out, out


def test_a_run_that_ends_no_episode_fails_and_the_default_run_ends_them():
    """Pendulum-v1 never terminates and truncates at 200 steps: 40 steps end no episode,
    which fails the run (how a client ends one went unchecked); without --steps the run goes
    past the env's time limit and passes."""
    from shmrl.checker.rules import S_ACT, S_EPISODES, default_steps
    from shmrl.envs.make import env_spec

    assert default_steps(env_spec("CartPole-v1")) == 4000 and default_steps(env_spec("Pendulum-v1")) == 2000
    sim = [sys.executable, "-m", "shmrl.sim", "--connect", "127.0.0.1:{port}", "--env", "Pendulum-v1"]
    for flags, rule in (([], S_EPISODES), (["--server-inference"], S_ACT)):
        violations, out = check(sim + flags, env="Pendulum-v1", reconnect=False, steps=40, hold_s=0)
        assert [r for r, _ in violations] == [rule], out
        assert "no episode ended" in violations[0][1] and "time limit is 200 steps" in violations[0][1], out
    violations, out = check(sim + ["--server-inference", "--envs-per-sim", "16"], env="Pendulum-v1", reconnect=False,
                            steps=None, hold_s=0)
    assert not violations, out
    assert "201 ACTs of 16 envs checked, 16 episodes ended" in out, out   # 2000 / 16 = 125 would end none
