"""The C# client (clients/csharp): ShmrlClient.cs and CartPole.cs build with mcs as C# 7
without a warning, the CartPole physics are gymnasium's, the client passes the conformance
checker with server-side inference in both codecs, and against a fake server played here it
sends the exact handshake bytes (declaring its spaces), ACTs that shmrl's own codec decodes,
the right rewards, flags and final observations across episode ends, refuses a PONG that
does not grant server-side inference and a bad frame header, keeps the socket off the
caller's thread (SubmitStep and TryGetActions return at once while a reply is held),
heartbeats only while its caller polls, and clips Box actions. The slow test trains
CartPole through 8 C# processes."""
import json
import math
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import balancing_action, need, read_body, recv_exactly, send, summary_of
from shmrl import rllink
from shmrl.checker.session import check_client

ROOT = Path(__file__).resolve().parents[1]
CS_DIR = ROOT / "clients" / "csharp"

pytestmark = pytest.mark.skipif(shutil.which("mcs") is None or shutil.which("mono") is None,
                                reason="mcs or mono is not installed (the C# client needs them: apt-get install mono-mcs)")


@pytest.fixture(scope="module")
def build(tmp_path_factory) -> Path:
    """clients/csharp built by its Makefile into a tmp dir, and tests/csharp/Probe.cs beside it."""
    out = tmp_path_factory.mktemp("csharp")
    done = subprocess.run(["make", "-C", str(CS_DIR), f"BUILD={out}"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "-langversion:7 -warnaserror" in done.stdout and (out / "cartpole.exe").exists(), done.stdout
    done = subprocess.run(["mcs", "-langversion:7", "-warnaserror", "-warn:4", "-nologo", f"-out:{out / 'probe.exe'}",
                           str(CS_DIR / "ShmrlClient.cs"), str(ROOT / "tests" / "csharp" / "Probe.cs")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr
    return out


def start(procs, exe: Path, *args) -> subprocess.Popen:
    p = subprocess.Popen(["mono", str(exe), *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    procs.append(p)
    return p


CARTPOLE_SPACES = {"observation_shape": [4], "observation_dtype": "<f4", "action_space": {"type": "Discrete", "n": 2}}
SET_CONFIG = {"type": "SET_CONFIG", "env_steps_per_sample": 64, "force_on_policy": True,
              # fields the client does not know come first, with strings that look like JSON
              "note": {"x": [1, {"y": "}\"]"}], "z": "a\\\"b"}, "policy_map": None, **CARTPOLE_SPACES}


def handshake(server, *, codec="binary", name="cs-0", inference=True, config=SET_CONFIG, spaces=CARTPOLE_SPACES,
              heartbeat_s=1.0) -> socket.socket:
    """Accept a client and answer its PING and GET_CONFIG; checks their exact bytes (as
    Python's json.dumps writes them)."""
    conn = server.accept()
    ping = {"type": "PING", **({"codecs": ["binary"]} if codec == "binary" else {}),
            **({"client_name": name} if name else {}), "inference": "server"}
    assert read_body(conn) == json.dumps(ping).encode()
    pong = {"type": "PONG", **({"codec": "binary", "heartbeat_s": heartbeat_s} if codec == "binary" else {}),
            **({"inference": "server"} if inference else {})}
    send(conn, pong)
    if not inference:
        return conn
    body = read_body(conn)   # its spaces declared (RLLINK.md 3.2)
    assert body == json.dumps({"type": "GET_CONFIG", **spaces}).encode()
    assert rllink.decode_request(body)["action_space"] == spaces["action_space"]   # the server's own checks pass it
    send(conn, config, codec)
    return conn


def read_act(conn, codec: str) -> dict:
    body = read_body(conn)
    if codec == "binary":
        assert body[:4] == rllink.MAGIC
    else:
        assert body.startswith(b'{"type": "ACT", "obs": [[')
    rllink.decode_request(body)   # the server's own decoding and checks pass it
    msg = rllink.decode(body)
    assert msg["type"] == "ACT"
    if codec == "json":   # the client wrote float32s in their shortest round-trip form
        for key in ("obs", "final_obs", "rewards"):
            if key in msg:
                msg[key] = np.asarray(msg[key], dtype=np.float32)
    return {k: np.asarray(v) for k, v in msg.items() if k != "type"}


def actions_msg(actions, seq: int, codec: str, dtype=np.int64) -> dict:
    acts = np.asarray(actions, dtype=dtype)
    return {"type": "ACTIONS", "actions": acts if codec == "binary" else acts.tolist(), "weights_seq_no": seq}


def next_state(obs: np.ndarray, action: int) -> np.ndarray:
    """CartPole's step in float64 from a float32 observation (which rounds the state)."""
    x, x_dot, theta, theta_dot = map(float, obs)
    force = 10.0 if action == 1 else -10.0
    cos, sin = math.cos(theta), math.sin(theta)
    temp = (force + 0.05 * theta_dot ** 2 * sin) / 1.1
    thetaacc = (9.8 * sin - cos * temp) / (0.5 * (4.0 / 3.0 - 0.1 * cos ** 2 / 1.1))
    xacc = temp - 0.05 * thetaacc * cos / 1.1
    return np.array([x + 0.02 * x_dot, x_dot + 0.02 * xacc, theta + 0.02 * theta_dot, theta_dot + 0.02 * thetaacc])


# ---------------------------------------------------------------- the build and the physics

def test_cartpole_command_line(build):
    done = subprocess.run(["mono", str(build / "cartpole.exe"), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "usage: mono cartpole.exe" in done.stderr, done.stderr
    for bad in (["--envs", "0"], ["--codec", "xml"], ["--port"], ["--port", "x"]):
        done = subprocess.run(["mono", str(build / "cartpole.exe"), *bad], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and done.stderr.startswith("cartpole: "), (bad, done.stderr)


def test_physics_are_gymnasiums(build):
    """From gymnasium's own states, the C# step gives gymnasium's next state and termination."""
    gym = need("gymnasium", "gym")
    env = gym.make("CartPole-v1")
    rng = np.random.default_rng(0)
    lines, expected = [], []
    for seed in range(20):
        env.reset(seed=seed)
        while True:
            state = np.array(env.unwrapped.state, dtype=np.float64)
            action = int(rng.integers(2))
            _, _, terminated, truncated, _ = env.step(action)
            lines.append(" ".join(repr(float(v)) for v in state) + f" {action}")
            expected.append((np.array(env.unwrapped.state, dtype=np.float64), terminated))
            if terminated or truncated:
                break
    done = subprocess.run(["mono", str(build / "cartpole.exe"), "--physics-check"], input="\n".join(lines) + "\n",
                          capture_output=True, text=True, timeout=60)
    rows = [line.split() for line in done.stdout.splitlines()]
    assert len(rows) == len(expected) > 100, done.stderr
    terminations = 0
    for row, (state, terminated) in zip(rows, expected):
        np.testing.assert_allclose([float(v) for v in row[:4]], state, rtol=1e-12, atol=1e-15)
        assert bool(int(row[4])) == terminated
        terminations += terminated
    assert terminations == 20


NETSTANDARD_FACADES = ["/usr/lib/mono/4.7.1-api/Facades/netstandard.dll", "/usr/lib/mono/4.5/Facades/netstandard.dll"]


def test_uses_only_net_standard_2_0_types(build):
    """Every type cartpole.exe (ShmrlClient.cs and CartPole.cs) refers to is one that .NET
    Standard 2.0 has: one netstandard.dll forwards (mono-devel's facade; monodis from
    mono-utils reads both tables). $MONODIS and $NETSTANDARD_DLL name others."""
    monodis = os.environ.get("MONODIS") or shutil.which("monodis")
    facade = os.environ.get("NETSTANDARD_DLL") or next((f for f in NETSTANDARD_FACADES if os.path.exists(f)), None)
    if not monodis or not facade:
        pytest.skip("monodis (apt-get install mono-utils) or mono-devel's Facades/netstandard.dll is not installed")

    def table(flag: str, path) -> list[str]:
        done = subprocess.run([monodis, flag, str(path)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout.splitlines()

    standard = {m.group(1) for line in table("--exported", facade)
                if (m := re.match(r"\d+: (\S+) is in assemblyref", line))}
    used = {m.group(1).split("/")[0] for line in table("--typeref", build / "cartpole.exe")
            if (m := re.match(r"\d+: \[\w+\](\S+)", line))}
    assert len(standard) > 2000 and {"System.Net.Sockets.Socket", "System.Threading.Monitor"} <= used, (len(standard), used)
    assert used <= standard, f"not in .NET Standard 2.0: {sorted(used - standard)}"


UNITY_STUB = """
namespace UnityEngine {
    public class MonoBehaviour { }
    public static class Debug { public static void LogError(object message) { } }
}
"""


def test_the_docs_monobehaviour_compiles(build, tmp_path):
    """docs/CLIENTS.md's MonoBehaviour sketch compiles with ShmrlClient.cs (UnityEngine's two
    names it uses stubbed)."""
    doc = (ROOT / "docs" / "CLIENTS.md").read_text()
    sketch = next(b for b in re.findall(r"```csharp\n(.*?)```", doc, re.S) if "class Trainer : MonoBehaviour" in b)
    (tmp_path / "Trainer.cs").write_text(sketch)
    (tmp_path / "Unity.cs").write_text(UNITY_STUB)
    done = subprocess.run(["mcs", "-langversion:7", "-warnaserror", "-nologo", "-target:library",
                           f"-out:{tmp_path / 'trainer.dll'}", str(CS_DIR / "ShmrlClient.cs"), str(tmp_path / "Trainer.cs"),
                           str(tmp_path / "Unity.cs")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


# ---------------------------------------------------------------- the conformance checker

@pytest.mark.parametrize("codec", ["binary", "json"])
def test_conforms_with_server_inference(build, codec):
    """python -m shmrl.conformance with server-side inference: the handshake, K fixed, no
    outcome in a connection's first ACT and one in every other, observations and final_obs
    that fit CartPole, a held reply waited for, heartbeats, the reconnect, and exit 0 once
    the checker is gone (the server ended the session)."""
    import io

    out = io.StringIO()
    violations = check_client(["mono", str(build / "cartpole.exe"), "--port", "{port}", "--envs", "4", "--seed", "7",
                               "--codec", codec], steps=2000, hold_s=0.5, timeout=60.0, out=out)
    text = out.getvalue()
    assert not violations, text
    assert "ACT 3: waited 0.5 s for a held reply" in text and "episodes ended" in text, text
    assert "connection 2: the first ACT carried no outcome again" in text, text
    assert "the client exited with status 0 after the session" in text, text


# ---------------------------------------------------------------- against a fake server

@pytest.mark.parametrize("codec", ["binary", "json"])
def test_episodes_through_act(server, procs, build, codec):
    """K = 3 envs: the first ACT has obs only (and equals shmrl's encoding of them, byte for
    byte, in binary); then rewards, flags and the physics' next obs; a pole kept up for 500
    steps is truncated with its final obs and a fresh reset; one pushed over terminates. The
    server closing the connection and staying away is the session's end: exit 0, a summary."""
    p = start(procs, build / "cartpole.exe", "--port", server.port, "--envs", 3, "--name", "cs-0", "--codec", codec,
              "--give-up-s", 0.5, "--quiet")
    conn = handshake(server, codec=codec)
    if codec == "binary":
        body = read_body(conn)
        assert body == rllink.encode_binary({"type": "ACT", "obs": rllink.decode(body)["obs"]})
        rllink.decode_request(body)
        act = {"obs": np.asarray(rllink.decode(body)["obs"])}
    else:
        act = read_act(conn, codec)
    assert set(act) == {"obs"} and act["obs"].shape == (3, 4) and act["obs"].dtype == np.float32
    assert np.all(np.abs(act["obs"]) <= 0.05)
    steps, truncated_seen, terminated_seen = 0, False, False
    while not (truncated_seen and terminated_seen):
        obs = act["obs"]   # env 0 and 1 balance (500 steps, truncated); env 2 always pushes right (terminates)
        actions = [balancing_action(obs[0]), balancing_action(obs[1]), 1]
        send(conn, actions_msg(actions, steps // 64, codec), codec)
        act = read_act(conn, codec)
        steps += 1
        assert set(act) >= {"obs", "rewards", "terminateds", "truncateds"}
        assert act["rewards"].dtype == np.float32 and act["rewards"].tolist() == [1.0, 1.0, 1.0]
        assert act["terminateds"].dtype == bool and act["truncateds"].shape == (3,)
        for k in range(3):
            done = act["terminateds"][k] or act["truncateds"][k]
            seen = act["final_obs"][k] if act["truncateds"][k] else act["obs"][k]
            if not act["terminateds"][k]:
                np.testing.assert_allclose(seen, next_state(obs[k], actions[k]), atol=1e-6)   # float32 obs
            if done:
                assert np.all(np.abs(act["obs"][k]) <= 0.05)                                  # reset
        if act["truncateds"].any():
            assert steps == 500 and act["truncateds"][:2].all() and "final_obs" in act
            np.testing.assert_array_equal(act["final_obs"][2], act["obs"][2])   # a row not used: the env's obs
            truncated_seen = True
        else:
            assert "final_obs" not in act
        terminated_seen |= bool(act["terminateds"][2])
        assert steps <= 500
    conn.close()       # the run ended
    server.close()     # and nobody listens: reconnecting gives up after --give-up-s
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert re.search(r"the server ended the session \(.*\): 15\d\d env steps, \d+ episodes", out), out


def test_refuses_a_pong_without_the_inference_echo(server, procs, build):
    """A server that does not serve actions (RLlib's, an older shmrl): a clear error, exit 1,
    and no second attempt (retrying cannot help)."""
    p = start(procs, build / "cartpole.exe", "--port", server.port, "--name", "cs-0")
    handshake(server, inference=False)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 1 and "the server does not serve actions" in err and '"inference": "server"' in err, err
    server.listener.settimeout(0.5)
    with pytest.raises(socket.timeout):
        server.accept()


def test_ping_escapes_the_token_and_name(server, procs, build):
    token = 'a"b\\c d\u00e9'
    start(procs, build / "cartpole.exe", "--port", server.port, "--name", "sim #1", "--token", token, "--codec", "json")
    body = read_body(server.accept())
    assert body == json.dumps({"type": "PING", "auth_token": token, "client_name": "sim #1",
                               "inference": "server"}).encode()


@pytest.mark.parametrize("header", [b"0000001x", b"99999999"])
def test_a_bad_frame_header_drops_the_connection(server, procs, build, header):
    """A reply whose header is not 8 digits, or announces more than 64 MiB, is refused from its
    header (its body never read): the client closes that connection and starts again with PING."""
    p = start(procs, build / "cartpole.exe", "--port", server.port, "--name", "cs-0", "--give-up-s", 0.5)
    conn = server.accept()
    read_body(conn)                                   # PING
    conn.sendall(header + b'{"type": "PONG"}')
    assert conn.recv(1) == b""                        # closed by the client
    conn2 = handshake(server)                         # which starts again
    assert set(read_act(conn2, "binary")) == {"obs"}
    conn.close()
    conn2.close()
    server.close()
    out, err = p.communicate(timeout=60)
    why = "bad frame header" if header[-1:] == b"x" else "a reply of 99999999 bytes is too large"
    assert why in err, err
    assert p.returncode == 1 and "no session with 127.0.0.1" in err, err   # no ACTIONS ever came


def test_never_connected_gives_up(procs, build):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]   # bound, not listening: connections are refused
        p = start(procs, build / "cartpole.exe", "--port", port, "--give-up-s", 0.5, "--quiet")
        out, err = p.communicate(timeout=60)
    assert p.returncode == 1 and f"no session with 127.0.0.1:{port}" in err and "refused" in err.lower(), err


def test_the_socket_is_off_the_callers_thread(server, procs, build):
    """SubmitStep returns at once though nobody has accepted the connection yet; TryGetActions
    returns false, never blocking, each millisecond while the server holds the reply; then the
    actions. Polled without steps, the client sends HEARTBEATs every heartbeat_s; not polled
    (a hung main thread), it falls silent."""
    p = start(procs, build / "probe.exe", server.port, "poll")
    time.sleep(1.0)                   # the client is up and has submitted its step
    conn = handshake(server, name=None, heartbeat_s=0.1)
    read_act(conn, "binary")
    time.sleep(1.0)                   # the reply held
    send(conn, actions_msg([1, 0], 5, "binary"), "binary")
    beats = []
    while (body := read_body_or_eof(conn)) is not None:
        beats.append((time.monotonic(), rllink.decode(body)))
    silent_for = time.monotonic() - beats[-1][0] if beats else 0
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, out + err
    lines = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    assert float(lines["submit_ms"]) < 250, out
    polls, worst = re.match(r"(\d+) worst_ms ([\d.]+)", lines["polls"]).groups()
    assert int(polls) > 100 and float(worst) < 100, out
    assert lines["actions"] == "1 0 seq 5 first True", out
    assert len(beats) >= 3 and all(m == {"type": "HEARTBEAT", "env_steps": 0} for _, m in beats), beats
    assert silent_for >= 1.0, (silent_for, out)


def read_body_or_eof(conn):
    header = b""
    while len(header) < 8:
        part = conn.recv(8 - len(header))
        if not part:
            return None
        header += part
    return recv_exactly(conn, int(header))


@pytest.mark.parametrize("codec", ["binary", "json"])
def test_box_actions_are_clipped_and_discrete_start_added(server, procs, build, codec):
    """A Box action (declared with its bounds): unclipped samples come back clipped to them. A
    Discrete(3) starting at 1: the server's 0..2 come back as 1..3."""
    box = {"type": "Box", "shape": [2], "low": [-1.0, -2.0], "high": [1.0, 2.0]}
    spaces = {**CARTPOLE_SPACES, "action_space": box}
    p = start(procs, build / "probe.exe", server.port, "box", codec)
    conn = handshake(server, codec=codec, name=None, config={**SET_CONFIG, **spaces}, spaces=spaces)
    read_act(conn, codec)
    send(conn, actions_msg([[5.0, -5.0], [0.5, -0.25]], 0, codec, np.float32), codec)
    act = read_act(conn, codec)
    assert act["rewards"].tolist() == [1.0, -1.0] and not act["terminateds"].any()
    send(conn, actions_msg([[-3.0, 1.5], [-0.75, 9.0]], 1, codec, np.float32), codec)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and out.splitlines() == ["actions 1 -2 0.5 -0.25", "actions -1 1.5 -0.75 2"], out + err

    discrete = {**CARTPOLE_SPACES, "action_space": {"type": "Discrete", "n": 3, "start": 1}}
    p = start(procs, build / "probe.exe", server.port, "start", codec)
    conn = handshake(server, codec=codec, name=None, config={**SET_CONFIG, **discrete}, spaces=discrete)
    for actions in ([2, 0], [1, 1]):
        read_act(conn, codec)
        send(conn, actions_msg(actions, 0, codec), codec)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and out.splitlines() == ["actions 3 1", "actions 2 2"], out + err


def test_actions_out_of_range_drop_the_connection(server, procs, build):
    """A Discrete action outside 0..n-1 breaks the protocol: the client drops the connection
    and starts again, its next ACT a connection's first."""
    start(procs, build / "cartpole.exe", "--port", server.port, "--name", "cs-0", "--give-up-s", 0.5)
    conn = handshake(server)
    read_act(conn, "binary")
    send(conn, actions_msg([7], 0, "binary"), "binary")
    assert conn.recv(1) == b""
    conn2 = handshake(server)
    assert set(read_act(conn2, "binary")) == {"obs"}


# ---------------------------------------------------------------- against shmrl

@pytest.mark.slow
def test_trains_cartpole_through_8_csharp_clients(start_run, procs, build, tmp_path):
    """CartPole-v1 to a 100-episode mean of 475 through 8 C# client processes of 16 envs with
    server-side inference; the time from the server's start is printed (target 10 s). When
    the run ends, every client exits 0."""
    t0 = time.monotonic()
    run = start_run("--env", "CartPole-v1", "--sims", 0, "--tcp-port", 0, "--logdir", tmp_path / "run")
    port = run.tcp_port()
    clients = [start(procs, build / "cartpole.exe", "--port", port, "--envs", 16, "--name", f"cs{i}", "--seed", i,
                     "--quiet") for i in range(8)]
    assert run.proc.wait(timeout=300) == 0, run.output()[-3000:]
    took = time.monotonic() - t0
    summary = summary_of(tmp_path / "run")
    print(f"\nCartPole through 8 C# clients: solved in {took:.1f} s from the server's start "
          f"(the run's wall_s {summary['wall_s']:.1f}), load {os.getloadavg()[0]:.2f}")
    assert summary["solved"]
    for c in clients:
        out, err = c.communicate(timeout=60)
        assert c.returncode == 0 and "the server ended the session" in out, out + err
