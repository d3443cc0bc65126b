"""Spaces from the client (docs/RLLINK.md §3.2): a GET_CONFIG may declare the client's
observation and action spaces; a learner started with ``--sims 0 --tcp-port P`` and no
--env trains the first client's, and refuses in one line a later client whose spaces
differ, or that declares none while it has no env; with --env, a declaration must match."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shmrl import rllink
from shmrl.envs.make import env_spec
from shmrl.envs.spec import declaration, declared_differs, declared_spec
from shmrl.transport import connect
from shmrl.transport.base import ConnectionClosed
from conftest import summary_of

ROOT = Path(__file__).resolve().parents[1]
CARTPOLE = {"observation_shape": [4], "observation_dtype": "<f4", "action_space": {"type": "Discrete", "n": 2}}
PENDULUM = {"observation_shape": [3], "observation_dtype": "<f4",
            "action_space": {"type": "Box", "shape": [1], "low": [-2.0], "high": [2.0]}}


def get_config(**fields) -> dict:
    return rllink.validate({"type": "GET_CONFIG", **fields}, "request")


# ---------------------------------------------------------------- the message

@pytest.mark.parametrize("declared", [
    CARTPOLE, PENDULUM,
    {"observation_shape": [2, 3], "observation_dtype": "<f4", "action_space": {"type": "MultiDiscrete", "nvec": [3, 2]}},
    {"observation_shape": [1], "observation_dtype": "<f4", "action_space": {"type": "Discrete", "n": 3, "start": -1}},
])
def test_a_declaration_is_taken_as_it_came(declared):
    assert get_config(**declared) == {"type": "GET_CONFIG", **declared}


def test_a_get_config_without_a_declaration_is_as_before():
    assert get_config() == {"type": "GET_CONFIG"}


def test_box_bounds_may_be_json_integers():
    box = {"type": "Box", "shape": [1], "low": [-2], "high": [2]}
    msg = get_config(**{**PENDULUM, "action_space": box})
    assert msg["action_space"]["low"] == [-2.0] and type(msg["action_space"]["low"][0]) is float


@pytest.mark.parametrize("fields, says", [
    ({"observation_shape": [4]}, "needs all of observation_shape, observation_dtype, action_space"),
    ({**CARTPOLE, "observation_dtype": "|u1"}, "cannot be declared: only \"<f4\""),
    ({**CARTPOLE, "observation_shape": [4.0]}, "'observation_shape' must be a list"),
    ({**CARTPOLE, "observation_shape": []}, "'observation_shape' must be a list"),
    ({**CARTPOLE, "observation_shape": [0]}, "'observation_shape' must be a list"),
    ({"observation_leaves": {"a": {"shape": [1], "dtype": "<f4"}}}, "'observation_leaves'"),
    ({**CARTPOLE, "action_space": {"type": "Parts", "parts": []}}, "Discrete, Box or MultiDiscrete"),
    ({**CARTPOLE, "action_space": "Discrete"}, "Discrete, Box or MultiDiscrete"),
    ({**CARTPOLE, "action_space": {"type": "Discrete"}}, "missing field 'n'"),
    ({**CARTPOLE, "action_space": {"type": "Discrete", "n": True}}, "'n' must be an int"),
    ({**CARTPOLE, "action_space": {"type": "Discrete", "n": 2, "shape": [1]}}, "unexpected field 'shape'"),
    ({**CARTPOLE, "action_space": {"type": "MultiDiscrete", "nvec": [2, 0]}}, "'nvec' must be a list"),
    ({**PENDULUM, "action_space": {"type": "Box", "shape": [1], "low": [-1e400], "high": [2.0]}}, "finite numbers"),
    ({**PENDULUM, "action_space": {"type": "Box", "shape": [2], "low": [-2.0], "high": [2.0]}}, "list of 2 finite"),
    ({**PENDULUM, "action_space": {"type": "Box", "shape": [1], "low": [2.0], "high": [2.0]}}, "below its 'high'"),
    ({**PENDULUM, "action_space": {"type": "Box", "shape": [1, 1], "low": [0], "high": [1]}}, "shape' must be [d]"),
])
def test_a_malformed_declaration_is_a_protocol_error(fields, says):
    with pytest.raises(rllink.ProtocolError, match=None) as e:
        get_config(**fields)
    assert says in str(e.value) and str(e.value).startswith("GET_CONFIG"), str(e.value)


def test_a_declaration_survives_the_json_codec():
    body = rllink.encode({"type": "GET_CONFIG", **PENDULUM}, "json")
    assert rllink.decode_request(body) == {"type": "GET_CONFIG", **PENDULUM}


# ---------------------------------------------------------------- the spec it makes

@pytest.mark.parametrize("env", ["CartPole-v1", "Pendulum-v1"])
def test_an_envs_own_declaration_matches_it(env):
    spec = env_spec(env)
    declared = get_config(**json.loads(json.dumps(declaration(spec), default=float)))
    assert declared_differs(declared, spec) is None
    made = declared_spec(declared)
    assert made.env_id == "declared" and made.obs_shape == spec.obs_shape
    assert made.policy_outputs == spec.policy_outputs and made.continuous == spec.continuous


def test_other_spaces_are_named_both():
    why = declared_differs(get_config(**PENDULUM), env_spec("CartPole-v1"))
    assert "[3]" in why and "Box" in why and "CartPole-v1" in why and "[4]" in why and "Discrete" in why, why


def test_what_cannot_be_declared_is_not():
    assert declaration(env_spec("CartPole-v1")) == CARTPOLE
    assert declaration(env_spec("pz:connect_four_v3")) == {} if _has("pettingzoo") else True


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# ---------------------------------------------------------------- a real learner

def handshake(port: int, **declared) -> dict:
    """PING, then GET_CONFIG with ``declared``: SET_CONFIG (ConnectionClosed if refused)."""
    client = connect(f"tcp:127.0.0.1:{port}", timeout=120)
    try:
        assert client.request({"type": "PING"})["type"] == "PONG"
        return client.request({"type": "GET_CONFIG", **declared})
    finally:
        client.close()


def refused(port: int, **declared) -> bool:
    try:
        handshake(port, **declared)
    except ConnectionClosed:
        return True
    return False


def test_a_learner_without_env_trains_the_first_clients_spaces_and_refuses_others(start_run, procs, tmp_path):
    run = start_run("--sims", 0, "--tcp-port", 0, "--max-env-steps", 1024, "--train-batch-size", 512,
                    "--logdir", tmp_path / "run")
    port = run.tcp_port(timeout=120)
    run.wait_for("waiting for a client to declare its spaces on", timeout=60)
    # (a) a client that declares CartPole's spaces (shmrl.sim --declare declares its env's)
    sim = subprocess.Popen([sys.executable, "-m", "shmrl.sim", "--connect", f"127.0.0.1:{port}", "--declare", "--timeout", "300"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    procs.append(sim)
    run.wait_for("training the spaces", timeout=120)
    # (b) a later client whose declared spaces differ: refused in one line; one that matches is served,
    # and so is one that declares nothing (as every client before declarations)
    assert refused(port, **PENDULUM)
    run.wait_for("are not the learner's declared", timeout=60)
    assert handshake(port, **CARTPOLE)["observation_shape"] == [4]
    assert handshake(port)["observation_shape"] == [4]
    assert run.proc.wait(timeout=300) == 1, run.output()[-3000:]   # the step budget, after the updates
    summary = summary_of(tmp_path / "run")
    assert summary["config"]["env"] == "declared" and summary["updates"] >= 1, summary
    assert sim.wait(timeout=60) == 0
    lines = [line for line in run.output().splitlines() if "WARNING" in line and "closing connection" in line]
    assert len(lines) == 1, lines


def test_a_first_client_that_declares_nothing_gets_the_default_env(start_run, tmp_path):
    """RLlib's client, and every client written before declarations, send a bare GET_CONFIG:
    a learner without --env trains the default env for them, as it always did. Before any
    GET_CONFIG, a request that needs an env closes its connection and the run waits on."""
    run = start_run("--sims", 0, "--tcp-port", 0, "--logdir", tmp_path / "run")
    port = run.tcp_port(timeout=120)
    early = connect(f"tcp:127.0.0.1:{port}", timeout=120)
    try:
        with pytest.raises(ConnectionClosed):
            early.request({"type": "GET_STATE"})
    finally:
        early.close()
    assert run.proc.poll() is None
    config = handshake(port)                                         # (c) no declaration: CartPole-v1
    assert config["observation_shape"] == [4] and config["action_space"] == {"type": "Discrete", "n": 2}
    assert refused(port, **PENDULUM)                                 # then other spaces are refused
    assert handshake(port, **CARTPOLE)["observation_shape"] == [4]
    os.killpg(run.proc.pid, signal.SIGINT)
    assert run.proc.wait(timeout=60) == 130, run.output()[-3000:]
    assert summary_of(tmp_path / "run")["config"]["env"] == "CartPole-v1"


def test_a_learner_with_env_refuses_other_declared_spaces(start_run, tmp_path):
    run = start_run("--env", "CartPole-v1", "--sims", 0, "--tcp-port", 0, "--logdir", tmp_path / "run")
    port = run.tcp_port(timeout=120)
    assert handshake(port, **CARTPOLE)["env_steps_per_sample"] >= 1      # (d) the same spaces
    assert handshake(port)["observation_shape"] == [4]                    # none declared: as before
    assert refused(port, **PENDULUM)                                      # other spaces
    run.wait_for("its declared spaces (observation <f4 [3]", timeout=60)
    assert "are not the learner's CartPole-v1 (observation <f4 [4]" in run.output()
    assert run.proc.poll() is None


def test_a_malformed_declaration_closes_only_its_connection(start_run, tmp_path):
    run = start_run("--sims", 0, "--tcp-port", 0, "--logdir", tmp_path / "run")
    port = run.tcp_port(timeout=120)
    assert refused(port, **{**CARTPOLE, "observation_dtype": "<f8"})
    run.wait_for("'observation_dtype' '<f8' cannot be declared", timeout=60)
    assert run.proc.poll() is None


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_the_c_clients_cartpole_trains_without_env(start_run, procs, tmp_path):
    exe = tmp_path / "cartpole"
    subprocess.run(["gcc", "-std=c99", "-Wall", "-Wextra", "-pedantic", "-Werror", "-O2", "-o", str(exe),
                    str(ROOT / "clients" / "c" / "cartpole.c"), "-lm"], check=True, timeout=300)
    run = start_run("--sims", 0, "--tcp-port", 0, "--max-env-steps", 2048, "--train-batch-size", 512,
                    "--logdir", tmp_path / "run")
    port = run.tcp_port(timeout=120)
    c = subprocess.Popen([str(exe), "--port", str(port), "--envs", "8", "--name", "c0"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    procs.append(c)
    assert run.proc.wait(timeout=300) == 1, run.output()[-3000:]
    assert "training the spaces" in run.output() and "action {'type': 'Discrete', 'n': 2}" in run.output()
    summary = summary_of(tmp_path / "run")
    assert summary["config"]["env"] == "declared" and summary["updates"] >= 1, summary
    assert c.wait(timeout=60) == 0


def test_the_env_s_frame_limits_reach_the_server_the_lobby_held():
    """Once the first client's spaces are known, the TCP server the lobby opened gets the
    env's frame and ACT limits (tighter than --max-frame-bytes) for new connections, though
    the run holds it through the lobby's Replay."""
    import collections

    from shmrl.config.settings import Config, resolve_config
    from shmrl.server.lobby import Replay
    from shmrl.server.serving import open_tcp, open_transports
    from shmrl.trainer.setup import policy_net

    spec = env_spec("CartPole-v1")
    config = resolve_config(Config(env="CartPole-v1", sims=0, tcp_port=0), spec)
    server = open_tcp(config, "127.0.0.1")
    try:
        assert server.act_limits is None and server.body_limits.binary == config.max_frame_bytes
        servers, _, _ = open_transports(config, spec, {"default": policy_net(config, spec)}, None,
                                        Replay(server, [], collections.Counter()))
        assert len(servers) == 1 and servers[0].server is server
        assert server.body_limits.binary < config.max_frame_bytes and server.act_limits is not None
    finally:
        server.close()
