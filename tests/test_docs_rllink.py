"""docs/RLLINK.md cannot drift from the code: every byte-level example in it is what
shmrl's own encoder writes for the message defined here.

An example in the page is a fenced block right after a marker line
``<!-- example: KIND NAME -->``:

- ``json NAME``: the block is the JSON body of EXAMPLES[NAME], exactly;
- ``frame-json NAME`` / ``frame-binary NAME``: the block is a hex dump of the whole frame
  (header + body) in that codec;
- ``head NAME``: the block is the JSON head of EXAMPLES[NAME]'s binary body, exactly;
- ``onnx_file NAME``: the block is an ``onnx_file`` string that decodes to ONNX_BYTES.

Regenerate the blocks after a deliberate change of the encoder with
``PYTHONPATH=$PWD python tests/test_docs_rllink.py`` (it prints each block by name).
"""
import base64
import gzip
import pathlib
import re
import socket

import numpy as np
import pytest

from conftest import wait_until
from shmrl import rllink
from shmrl.onnxio.policy import decode_onnx_file
from shmrl.transport.tcp import TcpServer

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "RLLINK.md"
MARKER = re.compile(r"^<!-- example: ([\w-]+) (\w+) -->\n```[\w-]*\n(.*?)\n```", re.M | re.S)

# The stand-in for a model file in the examples: an ONNX file is kilobytes of weights.
ONNX_BYTES = b"an ONNX model file"
# ONNX_BYTES stored in gzip (mtime 0; shmrl writes the current time there, which a reader
# ignores) and base64: a constant, as gzip's header bytes differ between Python versions.
ONNX_FILE = "H4sIAAAAAAAEAwESAO3/YW4gT05OWCBtb2RlbCBmaWxlKURtnBIAAAA="


def _chunk(obs, actions, logits, logp, rewards, terminated, **extra) -> dict:
    """An episode chunk in RLlib's key order (what its client writes), then shmrl's extras."""
    return {"obs": obs, "actions": actions, "action_dist_inputs": logits, "action_logp": logp,
            "rewards": rewards, "is_terminated": terminated, "is_truncated": False, **extra}


def _episodes() -> dict:
    """Two chunks of a 2-observation, 2-action env: one that ends (2 steps), and one still
    running when the message was full (1 step; its continuation starts from [0.5, 0.5])."""
    return {"type": "EPISODES_AND_GET_STATE", "episodes": [
        _chunk([[0.0, 0.5], [0.25, -0.5], [1.0, 0.0]], [1, 0], [[0.5, -0.5], [0.25, 0.0]], [-0.25, -0.5],
               [1.0, 1.0], True, episode_id="a1", weights_seq_no=3),
        _chunk([[0.0, -1.0], [0.5, 0.5]], [1], [[0.0, 0.0]], [-0.75], [1.0], False,
               episode_id="b1", weights_seq_no=3),
    ], "timesteps": 3}


EXAMPLES = {
    "ping": {"type": "PING"},
    "ping_shmrl": {"type": "PING", "auth_token": "s3cret", "codecs": ["binary"], "client_name": "sim-0",
                   "action_dists": ["squashed_gaussian", "uniform"]},
    "pong": {"type": "PONG"},
    "pong_binary": {"type": "PONG", "codec": "binary", "heartbeat_s": 1.0},
    "get_config": {"type": "GET_CONFIG"},
    "get_config_declared": {"type": "GET_CONFIG", "observation_shape": [3], "observation_dtype": "<f4",
                            "action_space": {"type": "Box", "shape": [1], "low": [-2.0], "high": [2.0]}},
    "set_config": {"type": "SET_CONFIG", "env_steps_per_sample": 500, "force_on_policy": True},
    "get_state": {"type": "GET_STATE"},
    "set_state": {"type": "SET_STATE", "onnx_file": ONNX_FILE, "weights_seq_no": 3},
    "episodes": _episodes(),
    "episodes_binary": rllink.validate(_episodes(), "request"),
    "episodes_recurrent": {"type": "EPISODES", "episodes": [
        _chunk([[0.5, 0.0], [0.0, 0.5]], [0], [[0.5, 0.0]], [-0.5], [0.0], False,
               state_in=[0.25, -0.25, 0.0, 0.5])], "timesteps": 1},
    "heartbeat": {"type": "HEARTBEAT", "env_steps": 1000},
    "set_config_multi": {"type": "SET_CONFIG", "env_steps_per_sample": 500, "force_on_policy": True,
                         "policy_map": "shared", "league_prob": 0.5},
    "set_state_multi": {"type": "SET_STATE", "policies": {
        "shared": {"onnx_file": ONNX_FILE, "weights_seq_no": 40},
        "shared@30": {"onnx_file": ONNX_FILE, "weights_seq_no": 30, "frozen": True}}, "weights_seq_no": 40},
    "episodes_multi": {"type": "EPISODES_AND_GET_STATE", "episodes": [
        _chunk([[1.0, 0.0], [0.0, 1.0]], [0], [[0.5, -0.5]], [-0.5], [1.0], True,
               agent_id="left", module_id="shared"),
        _chunk([[0.0, 1.0], [1.0, 0.0]], [1], [[0.0, 0.25]], [-0.5], [-1.0], True,
               agent_id="right", module_id="shared"),
    ], "timesteps": 2},
}
EXAMPLES["episodes_multi_binary"] = rllink.validate(EXAMPLES["episodes_multi"], "request")
# Server-side inference (section 11): K = 2 CartPoles; env 1's step was truncated.
EXAMPLES.update({
    "ping_inference": {"type": "PING", "codecs": ["binary"], "inference": "server"},
    "pong_inference": {"type": "PONG", "inference": "server", "codec": "binary", "heartbeat_s": 1.0},
    "set_config_inference": {"type": "SET_CONFIG", "env_steps_per_sample": 500, "force_on_policy": True,
                             "observation_shape": [4], "observation_dtype": "<f4",
                             "action_space": {"type": "Discrete", "n": 2}},
    "act_first": {"type": "ACT", "obs": [[0.5, 0.0, 0.25, 0.0], [0.0, 0.5, -0.25, 0.0]]},
    "actions": {"type": "ACTIONS", "actions": [1, 0], "weights_seq_no": 3},
    "act": {"type": "ACT", "obs": [[0.5, 0.25, 0.25, -0.5], [0.0, 0.0, 0.0, 0.0]], "rewards": [1.0, 1.0],
            "terminateds": [False, False], "truncateds": [False, True],
            "final_obs": [[0.0, 0.0, 0.0, 0.0], [2.0, 0.5, 0.125, 0.0]]},
    "actions_box": {"type": "ACTIONS", "actions": [[0.75], [-1.5]], "weights_seq_no": 3},
})
EXAMPLES["act_binary"] = rllink.validate(EXAMPLES["act"], "request")
# Server-side inference for many agents (section 11.3): a turn-based game of two players
# ("left", "right"; 2-float observations, 2 actions) in K = 2 envs; a parallel env of 3.
_SPACES = {"observation_shape": [2], "observation_dtype": "<f4", "action_space": {"type": "Discrete", "n": 2}}
EXAMPLES.update({
    "set_config_multi_inference": {"type": "SET_CONFIG", "env_steps_per_sample": 500, "force_on_policy": True,
                                   "policy_map": "shared", "league_prob": 0.0,
                                   "agent_spaces": {"left": _SPACES, "right": _SPACES}},
    "act_multi_first": {"type": "ACT", "envs": [{"obs": {"left": [1.0, 0.0]}}, {"obs": {"left": [0.0, 1.0]}}]},
    "actions_multi": {"type": "ACTIONS", "actions": [{"left": 1}, {"left": 0}], "weights_seq_no": 12},
    "act_multi": {"type": "ACT", "envs": [
        {"obs": {"right": [0.0, 1.0]}, "rewards": {}},
        {"obs": {"left": [1.0, 0.0]}, "rewards": {"left": 1.0, "right": -1.0},
         "terminateds": {"left": True, "right": True}, "reset": True}]},
    "act_multi_parallel": {"type": "ACT", "envs": [
        {"obs": {"a": [0.0, 0.5], "b": [0.5, 0.0], "c": [1.0, 1.0]}, "rewards": {"a": -0.5, "b": -0.25, "c": -0.5},
         "truncateds": {"a": True, "b": True, "c": True},
         "final_obs": {"a": [0.25, 0.0], "b": [0.0, 0.25], "c": [0.5, 0.5]}, "reset": True}]},
})
EXAMPLES["act_multi_first_binary"] = {"type": "ACT", "envs": [{"obs": {"left": np.array([1.0, 0.0], np.float32)}},
                                                              {"obs": {"left": np.array([0.0, 1.0], np.float32)}}]}
EXAMPLES["actions_binary"] = {"type": "ACTIONS", "actions": np.array([1, 0], np.int64), "weights_seq_no": 3}


def encoded(name: str, codec: str) -> bytes:
    msg = EXAMPLES[name]
    return rllink.encode_binary(msg) if codec == "binary" else rllink.encode_json(msg)


def binary_head(body: bytes) -> bytes:
    return body[8:8 + int.from_bytes(body[4:8], "little")]


def hexdump(data: bytes) -> str:
    """16 bytes a line: offset, the bytes in hex, the printable ones as text."""
    lines = []
    for off in range(0, len(data), 16):
        part = data[off:off + 16]
        text = "".join(chr(b) if 32 <= b < 127 else "." for b in part)
        lines.append(f"{off:04x}  {' '.join(f'{b:02x}' for b in part):<47}  |{text}|")
    return "\n".join(lines)


def parse_hexdump(block: str) -> bytes:
    out = bytearray()
    for line in block.splitlines():
        offset, hex_part = line[:4], line[6:6 + 47]
        assert int(offset, 16) == len(out), f"hex dump line {line!r}: offset {offset}, expected {len(out):04x}"
        out += bytes.fromhex(hex_part)
    return bytes(out)


def render(kind: str, name: str) -> str:
    """The block the page must hold for this example."""
    if kind == "json":
        return encoded(name, "json").decode("utf-8")
    if kind in ("frame-json", "frame-binary"):
        return hexdump(rllink.frame(encoded(name, kind.split("-")[1])))
    if kind == "head":
        return binary_head(encoded(name, "binary")).decode("utf-8")
    if kind == "onnx_file":
        return ONNX_FILE
    raise ValueError(f"unknown example kind {kind!r}")


def doc_examples() -> list[tuple[str, str, str]]:
    return MARKER.findall(DOC.read_text(encoding="utf-8"))


def test_the_page_has_examples_of_every_kind_and_every_message_is_shown():
    found = doc_examples()
    assert {kind for kind, _, _ in found} == {"json", "frame-json", "frame-binary", "head", "onnx_file"}
    shown = {name for _, name, _ in found}
    assert shown - {"onnx"} <= set(EXAMPLES), f"examples in the page but not defined: {shown - set(EXAMPLES)}"
    assert set(EXAMPLES) <= shown, f"examples defined but not in the page: {set(EXAMPLES) - shown}"


@pytest.mark.parametrize("kind,name,block", doc_examples(), ids=lambda x: x if len(x) < 30 else "block")
def test_example_bytes_are_what_the_encoder_writes(kind, name, block):
    if kind.startswith("frame-"):
        assert parse_hexdump(block) == rllink.frame(encoded(name, kind.split("-")[1]))
    elif kind == "onnx_file":
        assert decode_onnx_file(block) == ONNX_BYTES
    else:
        assert block == render(kind, name)


@pytest.mark.parametrize("kind,name,block", [e for e in doc_examples() if e[0] != "onnx_file"],
                         ids=lambda x: x if len(x) < 30 else "block")
def test_example_messages_are_valid_and_decode_to_themselves(kind, name, block):
    """Each example is a message a peer accepts, in the role the page gives it."""
    msg = EXAMPLES[name]
    role = "request" if msg["type"] in {t.value for t in rllink.REQUEST_TYPES} else "reply"
    if kind.startswith("frame-"):
        body = parse_hexdump(block)[rllink.HEADER_LEN:]
        assert rllink.parse_header(parse_hexdump(block)[:rllink.HEADER_LEN]) == len(body)
    else:
        body = encoded(name, "binary" if kind == "head" else "json")
    got = rllink.validate(rllink.decode(body), role)
    # Compared through the binary codec, which carries every normalized field as it is.
    assert rllink.encode_binary(got) == rllink.encode_binary(rllink.validate(msg, role))


def _doc_block(kind: str, name: str) -> str:
    return next(block for k, n, block in doc_examples() if (k, n) == (kind, name))


def _read_frame(sock: socket.socket) -> bytes:
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            part = sock.recv(n - len(data))
            assert part, "the server closed the connection"
            data += part
        return data
    header = exactly(rllink.HEADER_LEN)
    return header + exactly(int(header))


def test_a_tcp_server_speaks_the_handshake_the_page_shows():
    """The page's PING with codecs, sent as raw bytes, is answered with the page's PONG,
    and what follows comes in binary, as section 3.1 says."""
    server = TcpServer("127.0.0.1", 0, heartbeat_s=1.0, heartbeat_timeout=10.0)
    try:
        with socket.create_connection(server.address, timeout=10) as sock:
            sock.sendall(rllink.frame(_doc_block("json", "ping_shmrl").encode()))
            (conn_id, ping), = wait_until(lambda: server.poll(0.05), 10, "the PING")
            assert ping["codecs"] == ["binary"] and ping["client_name"] == "sim-0"
            assert ping["action_dists"] == ["squashed_gaussian", "uniform"]
            server.reply(conn_id, {"type": "PONG"})
            assert _read_frame(sock) == rllink.frame(_doc_block("json", "pong_binary").encode())
            sock.sendall(rllink.frame(_doc_block("json", "get_config").encode()))
            (conn_id, _), = wait_until(lambda: server.poll(0.05), 10, "the GET_CONFIG")
            server.reply(conn_id, EXAMPLES["set_config"])
            assert _read_frame(sock) == rllink.frame(rllink.encode_binary(EXAMPLES["set_config"]))
    finally:
        server.close()


def test_onnx_file_example_is_gzip_in_base64():
    raw = base64.b64decode(ONNX_FILE)
    assert raw[:3] == b"\x1f\x8b\x08"          # gzip magic, deflate
    assert gzip.decompress(raw) == ONNX_BYTES


def test_hexdump_round_trips():
    data = bytes(range(256)) + b"tail"
    assert parse_hexdump(hexdump(data)) == data


if __name__ == "__main__":
    for kind, name in [("frame-json", "ping"), *[("json", n) for n in EXAMPLES if not n.endswith("binary")],
                       ("frame-binary", "heartbeat"), ("frame-binary", "episodes_binary"),
                       ("head", "episodes_multi_binary"), ("onnx_file", "onnx")]:
        print(f"<!-- example: {kind} {name} -->\n```\n{render(kind, name)}\n```\n")


# ---------------------------------------------------------------- what the page says the server takes

def _server_takes(env: str, chunk: dict, **fields) -> str | None:
    """None when shmrl's server takes an EPISODES message of ``chunk`` (JSON) for ``env``,
    else why not: the validation of section 3 and 4, then the env's (``check_episodes``)."""
    import json

    from shmrl.envs.make import env_spec
    from shmrl.server.hub import check_episodes

    body = json.dumps({"type": "EPISODES", "episodes": [chunk], **fields}).encode()
    try:
        batch = rllink.validate(rllink.decode(body), "request")["episodes"]
    except rllink.ProtocolError as e:
        return str(e)
    return check_episodes(batch, env_spec(env))


def test_json_integers_go_where_floats_do_and_fractions_never_where_integers_go():
    """Section 4, Numbers: `1` is `1.0` wherever a float goes (mixed or not, a Box's
    actions too), and `1.0` is refused wherever an integer goes."""
    cartpole = dict(obs=[[0, 0.5, 1, 2], [1, 1, 1, 1]], actions=[1], rewards=[1], action_dist_inputs=[[0, 1]],
                    action_logp=[-1], is_terminated=True, is_truncated=False)
    pendulum = dict(cartpole, obs=[[1, 0, 0], [1, 0, 0.5]], actions=[[1]], action_dist_inputs=[[0, 0]])
    assert _server_takes("CartPole-v1", cartpole) is None
    assert _server_takes("CartPole-v1", dict(cartpole, obs=[[0, 0, 1, 2], [1, 1, 1, 1]])) is None
    assert _server_takes("Pendulum-v1", pendulum) is None                          # a Box's actions all integers
    assert _server_takes("Pendulum-v1", dict(pendulum, actions=[[1.5]])) is None
    assert "integers" in _server_takes("CartPole-v1", dict(cartpole, actions=[1.0]))
    assert "weights_seq_no" in _server_takes("CartPole-v1", dict(cartpole, weights_seq_no=3.0))
    assert "timesteps" in _server_takes("CartPole-v1", cartpole, timesteps=1.0)
    assert _server_takes("CartPole-v1", dict(cartpole, weights_seq_no=3), timesteps=1) is None


def test_an_episode_both_terminated_and_truncated_is_taken_and_trains_as_terminated():
    from shmrl.config.settings import PPOSettings, with_defaults
    from shmrl.envs.make import env_spec
    from shmrl.model.net import PolicyNet
    from shmrl.model.ppo import PPO

    both = dict(obs=[[0.0] * 4, [0.5] * 4], actions=[1], rewards=[1.0], action_dist_inputs=[[0.0, 0.0]],
                action_logp=[-0.5], is_terminated=True, is_truncated=True)
    assert _server_takes("CartPole-v1", both) is None
    ppo = PPO(PolicyNet(env_spec("CartPole-v1"), 16, "ReLU"), with_defaults(PPOSettings, gamma=0.5, gae_lambda=1.0))
    batches = [ppo.make_batch(rllink.decode_request(rllink.encode({"type": "EPISODES", "episodes": [
        dict(both, is_terminated=terminated, is_truncated=truncated)]}, "json"))["episodes"])
        for terminated, truncated in ((True, True), (True, False), (False, True))]
    np.testing.assert_allclose(batches[0].returns, batches[1].returns)   # no bootstrap: termination wins
    assert not np.allclose(batches[0].returns, batches[2].returns)        # where truncation alone bootstraps


def test_act_final_obs_both_flags_and_rows_of_envs_not_truncated():
    """Section 11.1: an env both terminated and truncated needs its row of final_obs; every
    row must fit the env once any env was truncated (the server's check, and the checker's)."""
    import json

    from shmrl.checker.rules import ActRules
    from shmrl.envs.make import env_spec

    def act(**fields) -> dict:
        return rllink.validate(rllink.decode(json.dumps({"type": "ACT", **fields}).encode()), "request")

    with pytest.raises(rllink.ProtocolError, match="final_obs' is missing"):
        act(obs=[[0, 1, 2, 3]], rewards=[1], terminateds=[True], truncateds=[True])
    assert act(obs=[[0, 1, 2, 3]], rewards=[1], terminateds=[True], truncateds=[True], final_obs=[[0, 0, 0, 0]])
    spec = env_spec("gym:FrozenLake-v1")   # a Discrete observation: 0..15
    rules = ActRules(spec)
    assert rules.check(act(obs=[0, 3]), "ACT 1") == []
    assert rules.check(act(obs=[0, 3], rewards=[0, 0], terminateds=[False, False], truncateds=[False, True],
                           final_obs=[0, 5]), "ACT 2") == []
    bad = rules.check(act(obs=[0, 3], rewards=[0, 0], terminateds=[False, False], truncateds=[False, True],
                          final_obs=[99, 5]), "ACT 3")   # row 0 (not truncated) does not fit
    assert len(bad) == 1 and "'final_obs' does not fit" in bad[0][1], bad
    why, _ = spec.obs.check(act(obs=[0], rewards=[0], terminateds=[False], truncateds=[True], final_obs=[99])["final_obs"])
    assert why and "outside 0..15" in why   # what the server's check of final_obs says of it
