"""shmrl.rllink: exact RLlib bytes, both codecs, validation, and fuzzing."""
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from shmrl import rllink
from shmrl.core.episode import EpisodeBatch
from shmrl.rllink import ProtocolError, decode, decode_reply, decode_request, validate

from conftest import rllib_frame

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def rllib_episode(t: int, seed: int = 0, terminated: bool = True) -> dict:
    """An episode chunk built the way RLlib's _dummy_client builds one (key order included)."""
    rng = np.random.default_rng(seed)
    return {
        "obs": [rng.normal(size=4).astype(np.float32).tolist() for _ in range(t + 1)],
        "actions": [int(a) for a in rng.integers(0, 2, t)],
        "action_dist_inputs": [rng.normal(size=2).astype(np.float32).tolist() for _ in range(t)],
        "action_logp": [float(np.log(np.float32(0.5))) for _ in range(t)],
        "rewards": [1.0] * t,
        "is_terminated": terminated,
        "is_truncated": False,
    }


def np_episode(t: int, continuous: bool = False, obs_shape=(3, 2), seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "obs": rng.normal(size=(t + 1, *obs_shape)).astype(np.float32),
        "actions": rng.normal(size=(t, 2)).astype(np.float32) if continuous else rng.integers(0, 3, t),
        "rewards": rng.normal(size=t).astype(np.float32),
        "action_dist_inputs": rng.normal(size=(t, 4 if continuous else 3)).astype(np.float32),
        "action_logp": rng.normal(size=t).astype(np.float32),
        "is_terminated": False,
        "is_truncated": True,
        "episode_id": "ab-1",
        "weights_seq_no": 3,
    }


def episodes_request(*episodes, type="EPISODES_AND_GET_STATE", **extra) -> dict:
    """These episodes in one request (conftest's ``episodes_msg`` records CartPole steps instead)."""
    return {"type": type, "episodes": list(episodes), **extra}


DELETE = object()


def bad_episode(**changes) -> dict:
    ep = rllib_episode(3)
    for key, value in changes.items():
        if value is DELETE:
            del ep[key]
        else:
            ep[key] = value
    return episodes_request(ep)


# ------------------------------------------------------------- exact bytes

def test_ping_is_exactly_the_24_bytes_rllib_sends():
    assert rllink.frame(rllink.encode_json({"type": "PING"})) == b'00000016{"type": "PING"}'
    assert rllink.frame(rllink.encode_json({"type": rllink.MessageType.PING})) == b'00000016{"type": "PING"}'


@pytest.mark.parametrize("msg", [
    {"type": "PONG"},
    {"type": "GET_CONFIG"},
    {"type": "GET_STATE"},
    {"type": "SET_CONFIG", "env_steps_per_sample": 500, "force_on_policy": True},
    {"type": "SET_STATE", "onnx_file": "H4sIAAAAAAAA/8tNzMnPz0lNAQBKqFMsBgAAAA==", "weights_seq_no": 12},
    {"type": "EPISODES_AND_GET_STATE", "episodes": [rllib_episode(7), rllib_episode(3, seed=1)], "timesteps": 10},
])
def test_json_frames_are_byte_identical_to_rllib(msg):
    wire = rllink.frame(rllink.encode_json(msg))
    assert wire == rllib_frame(msg)
    assert rllink.parse_header(wire[:8]) == len(wire) - 8


def test_numpy_values_encode_like_their_lists():
    ep = rllib_episode(5)
    as_numpy = dict(ep, obs=np.asarray(ep["obs"], np.float32), actions=np.asarray(ep["actions"]),
                    action_logp=[np.float32(x) for x in ep["action_logp"]], rewards=np.ones(5))
    assert rllink.encode_json({"type": "EPISODES", "episodes": [as_numpy]}) == \
        json.dumps({"type": "EPISODES", "episodes": [ep]}).encode()
    with pytest.raises(TypeError, match="bytes"):
        rllink.encode_json({"type": "SET_STATE", "onnx_file": b"raw", "weights_seq_no": 1})


def test_message_types():
    assert all(t.value == t.name for t in rllink.MessageType)
    assert {t.value for t in rllink.REQUEST_TYPES} == {"PING", "GET_CONFIG", "GET_STATE", "EPISODES",
                                                      "EPISODES_AND_GET_STATE", "HEARTBEAT", "ACT"}
    assert {t.value for t in rllink.REPLY_TYPES} == {"PONG", "SET_CONFIG", "SET_STATE", "ACTIONS"}
    assert "PING" in rllink.REQUEST_TYPES


# ------------------------------------------------------------- framing

def test_headers_rllib_writes_are_accepted():
    for n in (0, 16, 12345678, rllink.MAX_BODY_LEN):
        assert rllink.parse_header(str(n).zfill(8).encode()) == n
    assert rllink.parse_header(bytearray(b"00000016")) == rllink.parse_header(memoryview(b"00000016")) == 16


@pytest.mark.parametrize("header, match", [
    (b"0000001a", "not 8 ASCII digits"), (b" 0000016", "not 8 ASCII digits"),
    (b"+0000016", "not 8 ASCII digits"), (b"-0000016", "not 8 ASCII digits"),
    (b"0000_016", "not 8 ASCII digits"), (b"0000016", "not 8 ASCII digits"),
    (b"000000016", "not 8 ASCII digits"), ("\u0661" * 8, "must be bytes"),
    ("00000016", "must be bytes"), (b"", "not 8 ASCII digits"),
])
def test_malformed_headers_are_rejected(header, match):
    with pytest.raises(ProtocolError, match=match):
        rllink.parse_header(header)


def test_unicode_digits_in_header_bytes_are_rejected():
    with pytest.raises(ProtocolError, match="not 8 ASCII digits"):
        rllink.parse_header("\u0661\u0662".encode() + b"0000")  # int() would accept "١٢0000"


def test_oversize_frames_are_refused_from_the_header():
    assert rllink.parse_header(b"00001000", max_body_len=1000) == 1000
    with pytest.raises(ProtocolError, match="frame of 1001 bytes exceeds the maximum of 1000"):
        rllink.parse_header(b"00001001", max_body_len=1000)
    with pytest.raises(ValueError, match="exceeds"):
        rllink.frame(bytes(rllink.MAX_BODY_LEN + 1))


# ------------------------------------------------------------- round trips

CODECS = {"json": rllink.encode_json, "binary": rllink.encode_binary}
SIMPLE = [
    {"type": "PING"}, {"type": "PING", "auth_token": "s3cret"}, {"type": "PONG"}, {"type": "GET_CONFIG"},
    {"type": "GET_STATE"}, {"type": "SET_CONFIG", "env_steps_per_sample": 500, "force_on_policy": False},
    {"type": "SET_STATE", "onnx_file": "aGVsbG8=", "weights_seq_no": 0},
]


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("msg", SIMPLE, ids=lambda m: m["type"])
def test_simple_messages_round_trip(codec, msg):
    body = CODECS[codec](msg)
    assert decode(body) == msg
    assert validate(decode(memoryview(body))) == msg
    role = "request" if msg["type"] in rllink.REQUEST_TYPES else "reply"
    assert (decode_request if role == "request" else decode_reply)(body) == msg


@pytest.mark.parametrize("form", ["list", "batch"])
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("type", ["EPISODES", "EPISODES_AND_GET_STATE"])
def test_numpy_episodes_round_trip(codec, type, form):
    for eps in ([np_episode(6), np_episode(0, seed=2), np_episode(3, seed=3)],
                [np_episode(4, continuous=True, seed=1), np_episode(2, continuous=True, seed=4)]):
        sent = eps if form == "list" else EpisodeBatch.from_episodes(eps)
        got = decode_request(CODECS[codec]({"type": type, "episodes": sent, "timesteps": sum(
            len(e["actions"]) for e in eps)}))
        batch = got["episodes"]
        assert got["type"] == type and got["timesteps"] == batch.num_steps and batch.num_chunks == len(eps)
        for i, w in enumerate(eps):
            g = batch.chunk(i)
            assert g.obs.dtype == np.float32 and g.obs.shape == w["obs"].shape
            np.testing.assert_array_equal(g.obs, w["obs"])
            np.testing.assert_array_equal(g.actions, w["actions"])
            assert g.actions.dtype == (np.float32 if w["actions"].dtype.kind == "f" else np.int64)
            for key in ("rewards", "action_dist_inputs", "action_logp"):
                # Even an empty chunk's rows have their shape: JSON's [] takes it from the others.
                assert getattr(g, key).dtype == np.float32 and getattr(g, key).shape == w[key].shape
                np.testing.assert_array_equal(getattr(g, key), w[key])
            assert (g.is_terminated, g.is_truncated, g.id, g.weights_seq_no) == (False, True, "ab-1", 3)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("other, what", [
    (np_episode(2, obs_shape=(4,)), "observations of shape"),
    (np_episode(2, continuous=True), "disagree in 'actions'"),
    (dict(np_episode(2), action_dist_inputs=np.zeros((2, 5), np.float32)), "disagree in 'action_dist_inputs'"),
])
def test_the_episodes_of_one_message_must_fit_together(codec, other, what):
    with pytest.raises(ProtocolError, match=what):
        decode_request(CODECS[codec](episodes_request(np_episode(3), other)))


def test_rllib_json_episodes_validate_to_float32_and_int64():
    ep = rllib_episode(20)
    alias = {("terminateds" if k == "is_terminated" else "truncateds" if k == "is_truncated" else k): v
             for k, v in ep.items()}
    for sent in (ep, alias):
        got = decode_request(rllink.encode_json(episodes_request(sent, timesteps=20)))
        out = got["episodes"].chunk(0)
        assert out.id is None and out.weights_seq_no is None   # nothing made up for RLlib's client
        assert out.obs.dtype == np.float32 and out.obs.shape == (21, 4)
        assert out.actions.dtype == np.int64 and out.actions.shape == (20,)
        assert out.action_dist_inputs.shape == (20, 2) and out.rewards.shape == (20,)
        assert out.is_terminated is True and out.is_truncated is False
        np.testing.assert_array_equal(out.obs, np.asarray(ep["obs"], np.float32))  # float32 exactly preserved
    assert validate(episodes_request(dict(ep, terminateds=True)))["episodes"].chunk(0).is_terminated is True


def test_counts_are_normalized_to_timesteps():
    eps = [rllib_episode(3), rllib_episode(2)]
    assert validate(episodes_request(*eps))["timesteps"] == 5
    for counts in ({"env_steps": 5}, {"timesteps": 5}, {"env_steps": 5, "timesteps": 5}):
        out = validate(episodes_request(*eps, **counts))
        assert list(out) == ["type", "episodes", "timesteps"] and out["timesteps"] == 5
    assert validate(episodes_request(type="EPISODES"))["timesteps"] == 0


def test_validate_returns_a_new_message_and_leaves_the_input_alone():
    msg = episodes_request(dict(rllib_episode(3), episode_id=7), timesteps=3)
    before = json.dumps(msg)
    out = validate(msg, "request")
    assert out is not msg and json.dumps(msg) == before
    reply = {"type": "SET_CONFIG", "env_steps_per_sample": 8, "force_on_policy": True, "extra": [1]}
    assert validate(reply, "reply") == reply and validate(reply) is not reply


@pytest.mark.parametrize("body_type", [bytes, bytearray])
def test_binary_decode_does_not_copy_arrays(body_type):
    batch = EpisodeBatch.from_episodes([np_episode(50), np_episode(7, seed=1)])
    body = body_type(rllink.encode_binary({"type": "EPISODES", "episodes": batch}))
    out = decode_request(body)["episodes"]
    raw = np.frombuffer(body, np.uint8)
    for key in ("obs", "actions", "rewards", "action_dist_inputs", "action_logp"):
        assert np.shares_memory(getattr(out, key), raw), key
        assert getattr(out, key).ctypes.data % 8 == (raw.ctypes.data % 8)  # blocks are 8-aligned in the body
    view = decode(memoryview(body)[:])["episodes"]["obs"]
    assert np.shares_memory(view, raw)


def test_binary_columnar_episodes_cost_a_few_blocks_however_many_chunks():
    def head_of(batch):
        body = rllink.encode_binary({"type": "EPISODES", "episodes": batch})
        return body[8:8 + int.from_bytes(body[4:8], "little")].decode()

    few = EpisodeBatch.from_episodes([np_episode(3, seed=i) for i in range(2)])
    many = EpisodeBatch.from_episodes([np_episode(3, seed=i) for i in range(200)])
    assert head_of(few).count("__nd__") == head_of(many).count("__nd__") == 9
    assert rllink.encode_json({"type": "EPISODES", "episodes": few}) == rllink.encode_json(
        {"type": "EPISODES", "episodes": few.to_dicts()})    # JSON: RLlib's list form, same bytes


COLUMNS = EpisodeBatch.from_episodes([np_episode(3), np_episode(0, seed=1), np_episode(2, seed=2)]).columns()


@pytest.mark.parametrize("change, match", [
    (dict(extra=np.zeros(3)), "unexpected field 'extra'"),
    (dict(rewards=None), "missing field 'rewards'"),
    (dict(lengths=np.array([3, -1, 3])), "'lengths' must lie between"),
    (dict(lengths=np.array([3.0, 0.0, 2.0])), "1-D array of integers"),
    (dict(lengths=np.array([3, 0, 3])), "5 actions, but 'lengths' add up to 6"),
    (dict(obs=np.zeros((6, 3, 2), np.float32)), "'obs' has 6 rows, expected"),
    (dict(rewards=np.zeros(4, np.float32)), "'rewards' has shape"),
    (dict(action_logp=np.zeros((5, 2), np.float32)), "'action_logp' has shape"),
    (dict(is_terminated=np.zeros(2, bool)), "'is_terminated' must be an array of 3 booleans"),
    (dict(is_truncated=np.zeros(3, np.int64)), "'is_truncated' must be an array of 3 booleans"),
    (dict(weights_seq_no=np.array([1, -2, 3])), "'weights_seq_no' must be"),
    (dict(episode_id=["a", "b"]), "'episode_id' must be a list of 3"),
    (dict(episode_id=["a", True, "c"]), "'episode_id' must be a list of 3"),
    (dict(obs=np.full((8, 3, 2), np.nan, np.float32)), "non-finite value in 'obs'"),
    (dict(actions=np.array([0, 1, 2, 0, 1.5])), None),  # float actions are a Box's: accepted here
])
def test_columnar_episodes_are_validated_like_the_list_form(change, match):
    cols = {k: v for k, v in {**COLUMNS, **change}.items() if v is not None}
    body = binary_body(*_head_and_data({"type": "EPISODES", "episodes": {"__cols__": cols}}))
    if match is None:
        decode_request(body)
    else:
        with pytest.raises(ProtocolError, match=match):
            decode_request(body)


def _head_and_data(msg):
    """The head and data section of msg's binary body (to rebuild it with binary_body)."""
    body = rllink.encode_binary(msg)
    head_len = int.from_bytes(body[4:8], "little")
    return json.loads(body[8:8 + head_len]), body[-(-(8 + head_len) // 8) * 8:]


def test_a_json_object_cannot_pass_for_columnar_episodes():
    cols = json.loads(rllink.encode_json({"c": COLUMNS}))["c"]      # the same columns, as JSON lists
    with pytest.raises(ProtocolError, match="'episodes' must be a list"):
        decode_request(rllink.encode_json({"type": "EPISODES", "episodes": {"__cols__": cols}}))
    with pytest.raises(ProtocolError, match="malformed columnar episodes"):
        decode_request(binary_body({"type": "EPISODES", "episodes": {"__cols__": [], "x": 1}}))


def test_binary_codec_carries_bytes_and_converts_dtypes():
    odd = {"type": "SET_STATE", "onnx_file": b"\x00model\xff", "weights_seq_no": 9,
           "big_endian": np.arange(5, dtype=">f8"), "strided": np.arange(12, dtype=np.int32).reshape(3, 4)[:, ::2],
           "half": np.ones(3, np.float16), "u16": np.arange(3, dtype=np.uint16), "flags": np.array([True, False]),
           "scalar": np.float32(2.5), "zero_d": np.array(7), "nested": {"a": [np.zeros((2, 0)), b""]}}
    got = decode_reply(rllink.encode_binary(odd))
    assert got["onnx_file"] == b"\x00model\xff" and got["weights_seq_no"] == 9
    assert got["big_endian"].dtype == np.dtype("<f8") and got["big_endian"].tolist() == [0, 1, 2, 3, 4]
    assert got["strided"].tolist() == [[0, 2], [4, 6], [8, 10]] and got["strided"].dtype == np.int32
    assert got["half"].dtype == np.float32 and got["u16"].dtype == np.int32
    assert got["flags"].tolist() == [True, False] and got["scalar"] == 2.5
    assert got["zero_d"].shape == () and got["zero_d"] == 7
    assert got["nested"]["a"][0].shape == (2, 0) and got["nested"]["a"][1] == b""
    for bad in (np.zeros(2, np.complex64), np.array(["a"]), np.array([object()]), np.zeros(1, np.uint64)):
        with pytest.raises(ValueError, match="cannot carry"):
            rllink.encode_binary({"type": "PONG", "x": bad})


def test_binary_layout():
    body = rllink.encode_binary({"type": "GET_STATE", "x": np.arange(3, dtype="<f4")})
    head_len = int.from_bytes(body[4:8], "little")
    head = json.loads(body[8:8 + head_len])
    assert body[:4] == rllink.MAGIC and body[:1] != b"{"
    assert head == {"type": "GET_STATE", "x": {"__nd__": ["<f4", [3], 0, 12]}}
    start = -(-(8 + head_len) // 8) * 8
    assert body[start:start + 12] == np.arange(3, dtype="<f4").tobytes()


# ------------------------------------------------------------- rejections

@pytest.mark.parametrize("body, match", [
    (b"", "empty body"),
    (b"PING", "neither a JSON object nor binary"),
    (b'[{"type": "PING"}]', "neither a JSON object nor binary"),
    (b'{"type": "PING"', "not valid JSON"),
    (b'{"type": "PI\xffNG"}', "not valid JSON"),  # invalid UTF-8
    (b'{"type": "\xed\xa0\x80"}', "not valid JSON"),  # an encoded surrogate is not UTF-8
    (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "not valid JSON"),
    (b'{"type": "PING"} {}', "not valid JSON"),
    ("{}", "must be bytes"),
])
def test_undecodable_bodies(body, match):
    with pytest.raises(ProtocolError, match=match):
        decode(body)


@pytest.mark.parametrize("msg, role, match", [
    ({}, "request", "no 'type'"),
    ({"type": 3}, "request", "unknown message type 3"),
    ({"type": "FOO"}, None, "unknown message type 'FOO'"),
    ({"type": "ping"}, None, "unknown message type"),
    ({"type": "PONG"}, "request", "'PONG' is a reply type, not a request"),
    ({"type": "SET_STATE", "onnx_file": "", "weights_seq_no": 1}, "request", "reply type"),
    ({"type": "PING"}, "reply", "request type, not a reply"),
    ({"type": "PING", "auth_token": 5}, "request", "'auth_token' must be a string"),
    ({"type": "GET_STATE", "weights": 1}, "request", "GET_STATE: unexpected field 'weights'"),
    ({"type": "EPISODES"}, "request", "EPISODES: missing field 'episodes'"),
    ({"type": "EPISODES", "episodes": {}}, "request", "'episodes' must be a list"),
    ({"type": "EPISODES", "episodes": [], "timesteps": "0"}, "request", "'timesteps' must be an int >= 0, got '0'"),
    ({"type": "EPISODES", "episodes": [], "timesteps": True}, "request", "'timesteps' must be an int"),
    ({"type": "EPISODES", "episodes": [], "timesteps": -1}, "request", "'timesteps' must be an int >= 0"),
    ({"type": "EPISODES", "episodes": [], "foo": 1}, "request", "unexpected field 'foo'"),
    ({"type": "EPISODES", "episodes": [[]]}, "request", "episode 0 is a list, not an object"),
    ({"type": "SET_CONFIG", "force_on_policy": True}, "reply", "missing field 'env_steps_per_sample'"),
    ({"type": "SET_CONFIG", "env_steps_per_sample": 0, "force_on_policy": True}, "reply", "int >= 1"),
    ({"type": "SET_CONFIG", "env_steps_per_sample": 5, "force_on_policy": 1}, "reply", "'force_on_policy' must be"),
    ({"type": "SET_STATE", "weights_seq_no": 1}, "reply", "missing field 'onnx_file'"),
    ({"type": "SET_STATE", "onnx_file": None, "weights_seq_no": 1}, "reply", "'onnx_file' must be a string"),
    ({"type": "SET_STATE", "onnx_file": "", "weights_seq_no": -1}, "reply", "'weights_seq_no' must be an int >= 0"),
    ([{"type": "PING"}], None, "must be an object"),
])
def test_ill_formed_messages(msg, role, match):
    with pytest.raises(ProtocolError, match=match):
        validate(msg, role)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("msg, match", [
    (bad_episode(rewards=DELETE), "episode 0: missing field 'rewards'"),
    (bad_episode(is_terminated=DELETE), "missing field 'is_terminated' \\(or 'terminateds'\\)"),
    (bad_episode(foo=1), "episode 0: unexpected field 'foo'"),
    (bad_episode(actions="0101"), "'actions' is not an array of numbers \\(got strings\\)"),
    (bad_episode(actions=3), "'actions' is a single value"),
    (bad_episode(is_terminated=1), "'is_terminated' must be true or false, got 1"),
    (bad_episode(is_truncated=None), "'is_truncated' must be true or false"),
    (bad_episode(terminateds=False), "'is_terminated' and its alias 'terminateds' disagree"),
    (bad_episode(obs=[[0.0] * 4] * 3), "'obs' has 3 entries, expected len\\(actions\\)\\+1 = 4"),
    (bad_episode(obs=[[0.0] * 4] * 5), "'obs' has 5 entries, expected len\\(actions\\)\\+1 = 4"),
    (bad_episode(obs=[]), "'obs' has 0 entries"),
    (bad_episode(rewards=[1.0, 1.0]), "'rewards' has 2 entries, expected len\\(actions\\) = 3"),
    (bad_episode(action_logp=[[0.0]] * 3), "'action_logp' has shape \\(3, 1\\), expected \\(3,\\)"),
    (bad_episode(action_dist_inputs=[[0.0, 1.0]] * 4), "'action_dist_inputs' has 4 entries"),
    (bad_episode(obs=[[0.0] * 4, [0.0] * 3, [0.0] * 4, [0.0] * 4]), "'obs' is not a regular"),
    (bad_episode(obs=[[0.0] * 4, [0.0] * 4, [0.0] * 4, [0.0, 0.0, [0.0], 0.0]]), "'obs' is not a regular"),
    (bad_episode(obs=[[0.0] * 4, [0.0] * 4, [0.0] * 4, [0.0, 0.0, "x", 0.0]]), "'obs' is not an array of numbers"),
    (bad_episode(obs=[[0.0] * 4, [0.0] * 4, [0.0] * 4, [0.0, 0.0, None, 0.0]]), "'obs' is not an array of numbers"),
    (bad_episode(obs=[[0.0] * 4, [0.0] * 4, [0.0] * 4, [0.0, NAN, 0.0, 0.0]]), "episode 0: non-finite value in 'obs'"),
    (bad_episode(rewards=[1.0, INF, 1.0]), "episode 0: non-finite value in 'rewards'"),
    (bad_episode(rewards=[1.0, 1e300, 1.0]), "non-finite value in 'rewards'"),  # inf in float32
    (bad_episode(action_logp=[-INF, 0.0, 0.0]), "non-finite value in 'action_logp'"),
    (bad_episode(actions=[[0.5, NAN]] * 3), "non-finite value in 'actions'"),
    (bad_episode(actions=[True, False, True]), "'actions' holds booleans"),
    (bad_episode(actions=[1, True, 0]), "'actions' holds booleans"),
    (bad_episode(rewards=[1.0, False, 1.0]), "'rewards' holds booleans"),
    (bad_episode(obs=[[0.0] * 4, [0.0] * 4, [0.0] * 4, [0.0, 1.0, True, 0.0]]), "'obs' holds booleans"),
    (bad_episode(actions=[0, 10 ** 30, 1]), "'actions' holds an integer that does not fit int64"),
    (bad_episode(actions=[0, 2 ** 63, 1]), "does not fit int64"),
    (bad_episode(actions=[-1, 2 ** 63, 1]), "does not fit int64"),
    (bad_episode(rewards=[1, 10 ** 30, 1]), "does not fit int64"),
    (bad_episode(episode_id=1.5), "'episode_id' must be a string or an int"),
    (bad_episode(weights_seq_no=-2), "'weights_seq_no' must be an int >= 0"),
    (bad_episode(weights_seq_no=True), "'weights_seq_no' must be an int"),
    (episodes_request(rllib_episode(3), rllib_episode(2), timesteps=6), "'timesteps' = 6 but the episodes hold 5 steps"),
    (episodes_request(rllib_episode(3), env_steps=2), "'env_steps' = 2 but the episodes hold 3"),
    (episodes_request(rllib_episode(3), env_steps=3, timesteps=4), "'timesteps' = 4 and 'env_steps' = 3 disagree"),
    (episodes_request(rllib_episode(1), dict(rllib_episode(2), rewards=[1.0])), "episode 1: 'rewards' has 1 entries"),
])
def test_ill_formed_episodes(msg, match):
    with pytest.raises(ProtocolError, match=match):
        validate(msg, "request")


@pytest.mark.parametrize("codec", CODECS)
def test_non_finite_numbers_are_rejected_after_decoding(codec):
    ep = np_episode(3)
    ep["obs"][2, 1, 0] = np.nan
    with pytest.raises(ProtocolError, match="episode 0: non-finite value in 'obs'"):
        decode_request(CODECS[codec](episodes_request(ep)))
    body = json.dumps(episodes_request(dict(rllib_episode(2), rewards=[1.0, float("inf")]))).encode()
    assert b"Infinity" in body
    with pytest.raises(ProtocolError, match="non-finite value in 'rewards'"):
        decode_request(body)


def test_numpy_bool_arrays_and_object_arrays_are_rejected():
    for key, value in [("rewards", np.array([True, False, True])), ("obs", np.zeros((4, 4), bool)),
                       ("action_logp", np.array([1.0, None, 2.0], dtype=object))]:
        with pytest.raises(ProtocolError, match=f"'{key}'"):
            validate(bad_episode(**{key: value}))


def binary_body(head: dict, data: bytes = bytes(64)) -> bytes:
    text = json.dumps(head).encode()
    pad = bytes(-(8 + len(text)) % 8)
    return rllink.MAGIC + len(text).to_bytes(4, "little") + text + pad + data


@pytest.mark.parametrize("descriptor, match", [
    ({"__nd__": ["<f4", [4], 0, 16]}, None),
    ({"__nd__": ["<f4", [4], 56, 16]}, "outside the 64-byte data section"),
    ({"__nd__": ["<f4", [4], 4, 16]}, "not 8-aligned"),
    ({"__nd__": ["<f4", [4], -8, 16]}, "ints >= 0"),
    ({"__nd__": ["<f4", [4], 0.0, 16]}, "ints >= 0"),
    ({"__nd__": [">f4", [4], 0, 16]}, "dtype '>f4' is not one of"),
    ({"__nd__": ["O", [4], 0, 16]}, "dtype 'O' is not one of"),
    ({"__nd__": [4, [4], 0, 16]}, "dtype 4 is not one of"),
    ({"__nd__": ["<f4", [5], 0, 16]}, "make 20 bytes, not 16"),
    ({"__nd__": ["<f4", [-4], 0, 16]}, "shape"),
    ({"__nd__": ["<f4", [1] * 33, 0, 4]}, "at most 32"),
    ({"__nd__": ["<f4", 4, 0, 16]}, "shape"),
    ({"__nd__": ["<f4", [True], 0, 4]}, "shape"),
    ({"__nd__": ["<f4", [4], 0]}, "malformed array descriptor"),
    ({"__nd__": ["<f4", [4], 0, 16], "x": 1}, "malformed array descriptor"),
    ({"__nd__": "<f4"}, "malformed array descriptor"),
    ({"__nd__": ["<f8", [2 ** 62, 0], 0, 0]}, "not valid"),  # numpy refuses the shape
    ({"__b__": [0, 65]}, "outside"),
    ({"__b__": [0]}, "malformed bytes descriptor"),
    ({"__b__": [3, 1]}, "not 8-aligned"),
])
def test_malformed_binary_descriptors(descriptor, match):
    body = binary_body({"type": "PONG", "x": descriptor})
    if match is None:
        assert decode_reply(body)["x"].shape == (4,)
    else:
        with pytest.raises(ProtocolError, match=match):
            decode(body)


def test_malformed_binary_bodies():
    good = rllink.encode_binary(episodes_request(np_episode(5)))
    assert decode_request(good)
    cases = [
        (good[:6], "shorter than its 8-byte preamble"),
        (good[:-8], "outside"),  # truncated data
        (good[:40], "overruns"),  # truncated head
        (rllink.MAGIC + (2 ** 32 - 1).to_bytes(4, "little"), "overruns"),
        (binary_body([1, 2]), "JSON list, not an object"),
        (rllink.MAGIC + b"\x02\x00\x00\x00\xff\xfe" + bytes(8), "not valid"),
        (binary_body({"type": "PONG", "b": {"__nd__": ["|b1", [2], 0, 2]}}, b"\x01\x07" + bytes(6)), "bool array"),
    ]
    for body, match in cases:
        with pytest.raises(ProtocolError, match=match):
            decode(body)


# ------------------------------------------------------------- fuzzing

VALID_MESSAGES = [
    {"type": "PING"}, {"type": "GET_CONFIG"},
    episodes_request(rllib_episode(3), rllib_episode(0, seed=1, terminated=False), timesteps=3),
    episodes_request(np_episode(2), np_episode(1, seed=1), type="EPISODES"),
    {"type": "EPISODES", "episodes": EpisodeBatch.from_episodes([np_episode(2, continuous=True),
                                                                 np_episode(0, continuous=True)])},
]
VALID_FRAMES = [rllink.frame(encode(m)) for m in VALID_MESSAGES for encode in CODECS.values()]


def only_protocol_errors(frame: bytes):
    try:
        rllink.parse_header(frame[:8])
    except ProtocolError:
        pass
    for fn in (decode_request, decode_reply, lambda b: validate(decode(b))):
        try:
            assert isinstance(fn(frame[8:]), dict)
        except ProtocolError:
            pass


@FUZZ
@given(st.binary(max_size=300))
def test_fuzz_arbitrary_bytes(data):
    only_protocol_errors(data)
    only_protocol_errors(b"00000000" + b"{" + data)
    only_protocol_errors(b"00000000" + rllink.MAGIC + data)


positions = st.integers(0, 600) | st.integers(0, 10 ** 6)  # the header and binary head, or anywhere


@FUZZ
@given(st.sampled_from(VALID_FRAMES), st.lists(st.tuples(positions, st.integers(0, 255)), max_size=6),
       st.none() | positions)
def test_fuzz_mutated_frames(frame, flips, cut):
    data = bytearray(frame)
    for pos, byte in flips:
        data[pos % len(data)] = byte
    only_protocol_errors(bytes(data[:cut] if cut is not None else data))


json_scalars = st.one_of(st.floats(), st.integers(-2 ** 70, 2 ** 70), st.booleans(), st.text(max_size=3), st.none())
junk = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=2), inner, max_size=2), max_leaves=12)
descriptor_values = st.one_of(st.integers(-2 ** 40, 2 ** 40), st.text(max_size=4), st.none(),
                              st.lists(st.integers(-3, 10 ** 6), max_size=34),
                              st.sampled_from(["<f4", "<f8", "<i8", "<i4", "|u1", "|b1"]))


@FUZZ
@given(st.data())
def test_fuzz_binary_descriptors(data):
    head, data_section = _head_and_data(VALID_MESSAGES[3])
    ep = head["episodes"][data.draw(st.integers(0, 1))]
    spec = ep[data.draw(st.sampled_from(["obs", "actions", "rewards", "action_dist_inputs", "action_logp"]))]["__nd__"]
    spec[data.draw(st.integers(0, 3))] = data.draw(descriptor_values)
    try:
        out = decode_request(binary_body(head, data_section))
    except ProtocolError:
        return
    assert out["timesteps"] == out["episodes"].num_steps


@FUZZ
@given(st.data())
def test_fuzz_columnar_descriptors(data):
    head, data_section = _head_and_data(VALID_MESSAGES[4])
    cols = head["episodes"]["__cols__"]
    key = data.draw(st.sampled_from(sorted(cols)))
    if isinstance(cols[key], dict):
        spec = cols[key]["__nd__"]
        spec[data.draw(st.integers(0, 3))] = data.draw(descriptor_values)
    else:
        cols[key] = data.draw(junk)
    try:
        out = decode_request(binary_body(head, data_section))
    except ProtocolError:
        return
    batch = out["episodes"]
    assert out["timesteps"] == batch.num_steps == len(batch.actions) == len(batch.rewards)
    assert len(batch.obs) == batch.num_steps + batch.num_chunks and np.isfinite(batch.obs).all()


@st.composite
def episode_dicts(draw):
    """Mostly well-formed episodes, each field sometimes corrupted in one of many ways."""
    t = draw(st.integers(0, 5))
    obs_shape = draw(st.sampled_from([(), (3,), (2, 2)]))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))  # values need no shrinking: quicker

    def arr(shape, ints=False):
        a = rng.integers(0, 5, shape) if ints else rng.normal(0, 100, shape)
        return a if draw(st.booleans()) else a.tolist()

    ep = {"obs": arr((t + 1, *obs_shape)),
          "actions": arr((t,), ints=True) if draw(st.booleans()) else arr((t, 2)),
          "rewards": arr((t,)), "action_dist_inputs": arr((t, 2)), "action_logp": arr((t,)),
          "is_terminated": draw(st.booleans()), "is_truncated": draw(st.booleans())}
    corrupted = False
    for key in draw(st.lists(st.sampled_from(sorted(ep) + ["extra"]), max_size=2)):
        corrupted = True
        how = draw(st.sampled_from(["junk", "leaf", "length", "drop"]))
        value = ep.get(key)
        if how == "junk" or not isinstance(value, list) or not value:
            ep[key] = draw(junk)
        elif how == "leaf":  # one bad scalar deep inside an otherwise good list
            # Down only through levels of non-empty lists: a field corrupted before (junk) may
            # hold a ragged list, whose elements are scalars or empty lists beside lists.
            target = value
            while all(isinstance(x, list) and x for x in target):
                target = target[draw(st.integers(0, len(target) - 1))]
            target[draw(st.integers(0, len(target) - 1))] = draw(json_scalars)
        elif how == "length":
            value.append(value[-1])
        else:
            ep.pop(key, None)
    return ep, corrupted


@FUZZ
@given(episode_dicts(), st.sampled_from([None, "json", "binary"]))
def test_fuzz_episode_validation(ep_and_flag, codec):
    ep, corrupted = ep_and_flag
    msg = episodes_request(ep)
    try:
        if codec is not None:
            try:
                msg = decode(CODECS[codec](msg))
            except (TypeError, ValueError):  # encode refuses what it cannot carry
                return
        out = validate(msg, "request")
    except ProtocolError as e:
        assert corrupted, e
        event("rejected")
        return
    event("accepted")
    e = out["episodes"].chunk(0)
    t = len(e.actions)
    assert out["timesteps"] == t
    assert e.obs.dtype == np.float32 and e.obs.shape[0] == t + 1 and e.obs.ndim >= 1
    assert e.actions.dtype in (np.int64, np.float32) and e.actions.ndim >= 1
    for key in ("rewards", "action_logp"):
        assert getattr(e, key).dtype == np.float32 and getattr(e, key).shape == (t,)
    assert e.action_dist_inputs.dtype == np.float32 and len(e.action_dist_inputs) == t
    for key in ("obs", "rewards", "action_dist_inputs", "action_logp"):
        assert np.isfinite(getattr(e, key)).all()
    assert type(e.is_terminated) is bool and type(e.is_truncated) is bool
