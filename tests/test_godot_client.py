"""The Godot client (clients/godot): the addon's RLlink client node, driving the demo's
cart-pole of Godot's own bodies, passes the conformance checker in both codecs (CartPole-v1's
spaces, units and ranges); a random policy scores below 50 while a hand-coded balancing
controller keeps the pole up for the whole episode; heartbeats go out between ACTs that are
frames apart; the node stops with a clear error (exit 1) when the PONG does not grant
server-side inference or a reply's header is not 8 digits, and after the give-up time when
no server is ever there; the demo's command line exits 2 when misused. The slow test trains the demo to a 100-episode
mean of 450 through 4 headless Godot processes (docs/CLIENTS.md, "Godot").

Every Godot process runs headless (godot3-server, Debian's godot3-server package: Godot
3.2.3) under a timeout and is killed in teardown if still running."""
import io
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import read_body, summary_of
from shmrl import rllink
from shmrl.checker.session import check_client

GODOT = shutil.which("godot3-server")
ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "clients" / "godot" / "demo"
FIXED_FPS = 50          # the demo's physics_fps: one physics frame a frame, no real-time sync

pytestmark = pytest.mark.skipif(GODOT is None, reason="godot3-server is not installed (Godot 3.2.3 headless: "
                                                      "apt-get install godot3-server); the Godot client needs it")


def godot_command(*args) -> list[str]:
    return [GODOT, "--path", str(DEMO), "--fixed-fps", str(FIXED_FPS), "--", *map(str, args)]


# Godot 3 complains about the C locale on stderr (harmlessly); a named one keeps its output clean.
GODOT_ENV = {**os.environ, "LANG": "en_US.UTF-8", "LC_ALL": "en_US.UTF-8"}


def run_godot(*args, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(godot_command(*args), capture_output=True, text=True, timeout=timeout, env=GODOT_ENV)


def start(procs, *args) -> subprocess.Popen:
    p = subprocess.Popen(godot_command(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=GODOT_ENV)
    procs.append(p)
    return p


def test_the_demo_conforms_in_both_codecs():
    """python -m shmrl.conformance's checks (CartPole-v1 by default: every observation within
    its space, the episode ends, the outcome of every step, the reconnect), then the demo
    gives up on the vanished server within the checker's grace and exits 0."""
    for codec, agents in (("binary", 2), ("json", 3)):
        buf = io.StringIO()
        violations = check_client(godot_command("--port", "{port}", "--agents", agents, "--codec", codec, "--no-progress"),
                                  hold_s=0.5, timeout=60.0, out=buf)
        out = buf.getvalue()
        assert not violations, out
        offered = "binary offered" if codec == "binary" else "JSON only"
        assert f"connection 1: PING ({offered}, server-side inference) answered" in out, out
        assert re.search(rf"connection 1: \d+ ACTs of {agents} envs checked, \d+ episodes ended", out), out
        assert "connection 2: the first ACT carried no outcome again" in out, out
        assert "the client exited with status 0 after the session" in out, out


def mean_return(out: str, policy: str) -> float:
    found = re.findall(rf"mean return over \d+ episodes: ([\d.]+) \({policy} policy\)", out)
    assert len(found) == 1, out
    return float(found[0])


def test_a_random_policy_scores_below_50_and_a_balancing_controller_holds_the_pole_up():
    """The demo is a real balance task: random pushes drop the pole in about 20 steps, and
    conftest's balancing_action (push toward the side the pole falls to) holds it for the
    whole 500-step episode in Godot's physics too."""
    done = run_godot("--random", 200, "--agents", 4, "--seed", 7)
    assert done.returncode == 0, done.stdout + done.stderr
    random_mean = mean_return(done.stdout, "random")
    assert 5 < random_mean < 50, done.stdout
    done = run_godot("--balance", 8, "--agents", 4, "--seed", 7)
    assert done.returncode == 0, done.stdout + done.stderr
    assert mean_return(done.stdout, "balancing") == 500.0, done.stdout


def test_the_command_line_exits_2_when_misused():
    for bad in (["--agents", 2], ["--port", "x"], ["--port", 5556, "--codec", "xml"], ["--frobnicate", 1]):
        done = run_godot(*bad, timeout=30)
        assert done.returncode == 2 and "usage: godot3-server" in done.stderr, (bad, done.stdout, done.stderr)


@pytest.fixture
def listener():
    s = socket.create_server(("127.0.0.1", 0))
    s.settimeout(30)
    yield s
    s.close()


def test_a_pong_without_server_inference_stops_the_client_with_a_clear_error(procs, listener):
    """RLlib's server (or an older shmrl) answers the PING with a bare PONG: the node asked
    for server-side inference and did not get it, so it stops (exit 1) and says why, without
    retrying."""
    client = start(procs, "--port", listener.getsockname()[1], "--agents", 2, "--name", "g-0")
    conn, _ = listener.accept()
    conn.settimeout(30)
    with conn:
        ping = rllink.decode_request(read_body(conn))
        assert ping == {"type": "PING", "codecs": ["binary"], "client_name": "g-0", "inference": "server"}
        conn.sendall(rllink.frame(rllink.encode({"type": "PONG"}, "json")))
        out, err = client.communicate(timeout=30)
    assert client.returncode == 1, out + err
    assert "the server does not serve actions (its PONG did not grant 'inference': 'server')" in err, err


def test_a_reply_whose_header_is_not_8_digits_is_refused(procs, listener):
    client = start(procs, "--port", listener.getsockname()[1], "--codec", "json")
    conn, _ = listener.accept()
    conn.settimeout(30)
    with conn:
        assert rllink.decode_request(read_body(conn))["inference"] == "server"
        conn.sendall(b'0000 16x{"type": "PONG"}')
        out, err = client.communicate(timeout=30)
    assert client.returncode == 1, out + err
    assert "bad frame header" in err and "8 ASCII digits" in err, err


def test_heartbeats_go_out_between_acts_that_are_frames_apart(procs, listener):
    """In real time (no --fixed-fps: 50 physics frames a second) with an action every 10
    frames, 0.2 s pass between ACTs: the node sends a HEARTBEAT whenever nothing went out for
    the PONG's heartbeat_s (0.05 s), with the env steps of the connection so far, in binary."""
    command = [GODOT, "--path", str(DEMO), "--", "--port", str(listener.getsockname()[1]), "--agents", "2",
               "--frames-per-action", "10", "--no-progress"]
    client = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=GODOT_ENV)
    procs.append(client)
    conn, _ = listener.accept()
    conn.settimeout(30)
    with conn:
        assert rllink.decode_request(read_body(conn))["codecs"] == ["binary"]
        conn.sendall(rllink.frame(rllink.encode({"type": "PONG", "codec": "binary", "heartbeat_s": 0.05,
                                                 "inference": "server"}, "json")))
        assert rllink.decode_request(read_body(conn))["type"] == "GET_CONFIG"
        conn.sendall(rllink.frame(rllink.encode({"type": "SET_CONFIG", "env_steps_per_sample": 100,
                                                 "force_on_policy": True}, "binary")))
        beats, acts = [], 0
        while acts < 4:
            body = read_body(conn)
            assert body[:4] == rllink.MAGIC
            msg = rllink.decode_request(body)
            if msg["type"] == "HEARTBEAT":
                beats.append((acts, msg["env_steps"]))
                continue
            assert msg["type"] == "ACT"
            acts += 1
            conn.sendall(rllink.frame(rllink.encode({"type": "ACTIONS", "actions": np.ones(2, np.int64),
                                                     "weights_seq_no": 0}, "binary")))
    # after ACT n (n >= 1) the agents have stepped 2 * (n - 1) env steps: those of the ACTs before
    assert len(beats) >= 6, beats
    assert {acts for acts, _ in beats} >= {1, 2, 3}, beats
    assert all(steps == 2 * (acts - 1) for acts, steps in beats), beats


def test_a_server_that_is_never_there_ends_the_client_with_exit_1_after_the_give_up_time(procs):
    with socket.socket() as s:   # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    client = start(procs, "--port", port)
    out, err = client.communicate(timeout=60)
    took = time.monotonic() - t0
    assert client.returncode == 1 and f"cannot connect to 127.0.0.1:{port}" in err, out + err
    assert 5 <= took < 30, took   # GIVE_UP_S = 5 of retries, then it gives up


@pytest.mark.slow
def test_trains_the_demo_through_4_headless_godot_processes(start_run, procs, tmp_path):
    """The demo's cart-pole to a 100-episode mean of 450 through 4 headless Godot processes of
    16 cart-poles each, from a learner that has no env: it trains the spaces the first
    process declares, with its default presets. Prints the time from the learner's start
    (target: 60 s) and the env steps per second; every Godot process exits 0 when the run
    ends."""
    t0 = time.monotonic()
    run = start_run("--sims", 0, "--tcp-port", 0, "--stop-return", 450, "--logdir", tmp_path / "run")
    port = run.tcp_port()
    games = [start(procs, "--port", port, "--agents", 16, "--seed", i, "--name", f"godot{i}", "--no-progress")
             for i in range(4)]
    assert run.proc.wait(timeout=400) == 0, run.output()[-3000:]
    took = time.monotonic() - t0
    summary = summary_of(tmp_path / "run")
    print(f"\nthe Godot demo through 4 headless processes: solved in {took:.1f} s from the learner's start "
          f"(the run's wall_s {summary['wall_s']:.1f}), {summary['env_steps']} env steps at "
          f"{summary['env_steps_per_s']:.0f}/s, load {os.getloadavg()[0]:.2f}")
    assert summary["solved"] and summary["return_mean"] >= 450, summary
    assert "training the spaces" in run.output() and "'Discrete', 'n': 2" in run.output(), run.output()[-3000:]
    assert summary["bad_frames"] == 0, summary
    for g in games:
        out, err = g.communicate(timeout=60)
        assert g.returncode == 0 and "the server ended the session" in out, out + err
