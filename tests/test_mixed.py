"""Shared-memory simulators and external TCP clients training one policy together."""
import ast
import subprocess
import sys
from pathlib import Path

from conftest import (EXAMPLE_CLIENT, descendants, metrics_rows, need, run_beside_example_client, shm_entries,
                      summary_of)



def test_shm_sims_and_tcp_clients_train_one_policy(start_run, tmp_path):
    logdir = tmp_path / "logs"
    run = start_run("--sims", 2, "--tcp-port", 0, "--stop-return", 150, "--max-env-steps", 200_000,
                    "--logdir", logdir)
    port = run.tcp_port()
    clients = [subprocess.Popen([sys.executable, "-m", "shmrl.sim", "--connect", f"127.0.0.1:{port}",
                                 "--seed", "5"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
               subprocess.Popen([sys.executable, str(EXAMPLE_CLIENT), "--port", str(port), "--max-retries", "0"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        run.proc.wait(timeout=120)
        assert run.proc.returncode == 0, run.output()
        for c in clients:   # the learner finished: both clients see it and exit
            c.wait(timeout=30)
    finally:
        for c in clients:
            c.kill()
            c.wait(5)
    summary = summary_of(logdir)
    by_client = summary["env_steps_by_client"]
    assert {c for c in by_client if c.startswith("shm:")} == {"shm:0", "shm:1"}
    tcp = [c for c in by_client if c.startswith("tcp:")]
    assert len(tcp) == 2 and all(by_client[c] > 0 for c in tcp), by_client
    assert sum(by_client.values()) == summary["env_steps"]
    assert summary["return_mean"] >= 150
    assert any(c.startswith("tcp:") for c in metrics_rows(logdir)[-1]["env_steps_by_client"])
    assert shm_entries(run.proc.pid) == [] and descendants(run.proc.pid) == []


def test_sims_over_tcp_learn_like_shm(start_run, tmp_path):
    run = start_run("--sims", 2, "--transport", "tcp", "--stop-return", 150, "--max-env-steps", 200_000,
                    "--logdir", tmp_path / "logs")
    run.proc.wait(timeout=120)
    assert run.proc.returncode == 0, run.output()
    clients = summary_of(tmp_path / "logs")["env_steps_by_client"]
    assert clients and all(c.startswith("tcp:127.0.0.1:") for c in clients), clients


def test_sims_zero_needs_a_tcp_port():
    proc = subprocess.run([sys.executable, "-m", "shmrl.run", "--sims", "0"], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 2 and "--tcp-port" in proc.stderr


def imported(nodes) -> set:
    nodes = list(nodes)
    modules = {a.name.split(".")[0] for node in nodes if isinstance(node, ast.Import) for a in node.names}
    return modules | {node.module.split(".")[0] for node in nodes if isinstance(node, ast.ImportFrom)}


def test_external_client_example_imports_nothing_from_shmrl():
    tree = ast.parse(EXAMPLE_CLIENT.read_text())
    everywhere = imported(ast.walk(tree))
    assert "shmrl" not in everywhere
    # The client needs numpy and onnxruntime; gymnasium only describes the forager's spaces to
    # the learner (forager_spaces), never imported by the client itself.
    assert imported(tree.body) - set(sys.stdlib_module_names) == {"numpy", "onnxruntime"}
    spaces_fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "forager_spaces")
    assert everywhere - set(sys.stdlib_module_names) - imported(tree.body) == imported(ast.walk(spaces_fn)) == \
        {"gymnasium"}


def test_the_external_client_trains_a_dict_observation_with_a_mask_and_a_two_part_action(start_run, tmp_path):
    """The JSON path end to end: one JSON object per step for the Dict observation, one
    list per step for the Tuple(Discrete, Box) action, the mask applied inside the graph."""
    need("gymnasium", "gym")                    # the run describes the forager's spaces with it
    logdir = tmp_path / "logs"
    run, _ = run_beside_example_client(start_run, tmp_path, "forager", "--env", "examples.external_client:forager_spaces",
                                       "--stop-return", 17, "--max-env-steps", 60_000, "--train-batch-size", 1000,
                                       "--env-steps-per-sample", 500, "--lr", 3e-3, "--logdir", logdir)
    summary = summary_of(logdir)
    assert run.proc.returncode == 0, run.output()        # learned: random play, mask and all, earns about 10
    assert summary["env_steps_dropped"] == {} and summary["bad_frames"] == 0, summary
    assert summary["return_mean"] >= 17


def test_custom_transport_example_trains_next_to_tcp():
    example = Path(__file__).parent.parent / "examples" / "custom_transport.py"
    proc = subprocess.run([sys.executable, str(example), "--updates", "3"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "update 3: return" in proc.stdout and "RLlink clients may attach to 127.0.0.1:" in proc.stdout


def _exchange(port: int, frame: bytes) -> bytes | None:
    """Send one frame; the whole reply frame, or None when the server closes the connection
    instead. Never the client's own timeout taken for a close: a loaded learner may be slow
    to refuse, so it has 60 s, and a server silent that long fails the test."""
    import socket
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(frame)
        data = b""
        try:
            while chunk := sock.recv(4096):
                data += chunk
                if len(data) >= 8 and len(data) >= 8 + int(data[:8]):
                    return data
        except ConnectionResetError:
            pass
        except TimeoutError:
            raise AssertionError(f"neither a reply nor a close within 60 s (got {data!r})") from None
        assert data == b"", f"the server closed the connection in the middle of a reply: {data!r}"
        return None


def test_auth_token_gates_every_client(start_run, tmp_path):
    """Without the run's auth token a client gets a closed connection and nothing else
    (counted in summary.json's auth_failures, not left to a log line that load can delay);
    with it, a PONG; the local simulator presents it and trains; the token is never
    written down."""
    logdir = tmp_path / "logs"
    run = start_run("--sims", 1, "--tcp-port", 0, "--auth-token", "s3cret", "--stop-return", 500,
                    "--max-env-steps", 3000, "--logdir", logdir)
    port = run.tcp_port()
    assert _exchange(port, b'00000016{"type": "PING"}') is None                      # no token: closed
    wrong = b'{"type": "PING", "auth_token": "guess"}'
    assert _exchange(port, b"%08d" % len(wrong) + wrong) is None
    early = b'{"type": "GET_STATE"}'
    assert _exchange(port, b"%08d" % len(early) + early) is None                     # not even state
    right = b'{"type": "PING", "auth_token": "s3cret"}'
    assert _exchange(port, b"%08d" % len(right) + right) == b'00000016{"type": "PONG"}'
    # Before its PING is checked, a client gets no big frame read: refused from the header
    # (a bad frame), though 100 kB is within every other limit: without that rule the
    # server would wait for the rest of the body and close a stalled frame, no bad frame.
    assert _exchange(port, b"%08d" % 100_000 + b"{" * 1000) is None
    run.proc.wait(timeout=60)              # the local simulator presents the token and trains
    assert run.proc.returncode == 1, run.output()
    summary = summary_of(logdir)
    assert summary["auth_failures"] == 3 and summary["bad_frames"] == 1, summary
    assert summary["env_steps_by_client"].get("shm:0", 0) >= 3000
    assert "s3cret" not in (logdir / "summary.json").read_text()
