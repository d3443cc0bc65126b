import json

import numpy as np
import pytest

from shmrl import rllink
from shmrl.episode import Episode


def make_chunk(n_steps: int, start: float = 0.0) -> Episode:
    ep = Episode(np.full(4, start, np.float32))
    for t in range(n_steps):
        ep.add_step(t % 2, 1.0, np.full(4, start + t + 1, np.float32),
                    np.array([0.1, -0.1], np.float32), -0.69)
    return ep


def test_length_is_number_of_actions_and_obs_is_one_longer():
    ep = make_chunk(3)
    assert len(ep) == 3 and len(ep.obs) == 4


def test_cut_continues_from_last_obs_with_same_id():
    ep = make_chunk(3)
    nxt = ep.cut()
    assert nxt.id == ep.id and len(nxt) == 0
    np.testing.assert_array_equal(nxt.obs[0], ep.obs[-1])
    nxt.add_step(1, 1.0, np.full(4, 9.0, np.float32), np.zeros(2, np.float32), -0.5, terminated=True)
    assert nxt.is_done and len(ep) == 3          # the cut chunk is not changed by its continuation
    with pytest.raises(ValueError, match="done"):
        nxt.cut()
    with pytest.raises(ValueError, match="done"):
        nxt.add_step(0, 0.0, np.zeros(4, np.float32), np.zeros(2, np.float32), 0.0)


def test_finalize_gives_numpy_arrays_with_rllib_shapes():
    ep = make_chunk(5).finalize()
    assert ep.obs.shape == (6, 4) and ep.obs.dtype == np.float32
    assert ep.actions.shape == (5,) and ep.actions.dtype == np.int64
    assert ep.rewards.dtype == np.float32 and ep.action_logp.shape == (5,)
    assert ep.action_dist_inputs.shape == (5, 2)
    assert ep.get_return() == 5.0


def test_round_trip_through_rllink_json_and_binary():
    ep = make_chunk(4)
    ep.add_step(0, 0.5, np.zeros(4, np.float32), np.zeros(2, np.float32), -0.7, truncated=True)
    for encode in (rllink.encode_json, rllink.encode_binary):
        body = encode({"type": "EPISODES", "episodes": [ep.to_rllink()]})
        d = rllink.decode_request(body)["episodes"][0]
        back = Episode.from_rllink(d)
        assert back.id == ep.id and back.is_truncated and not back.is_terminated
        for name in ("obs", "actions", "rewards", "action_dist_inputs", "action_logp"):
            np.testing.assert_array_equal(getattr(back, name), getattr(ep, name))


def test_rllib_style_dict_without_id_or_optional_fields():
    d = {"obs": [[0.0] * 4, [1.0] * 4], "actions": [1], "rewards": [1.0],
         "action_dist_inputs": [[0.2, 0.3]], "action_logp": [-0.6],
         "is_terminated": False, "is_truncated": False}
    msg = rllink.decode_request(rllink.encode_json({"type": "EPISODES", "episodes": [d]}))
    ep = Episode.from_rllink(msg["episodes"][0])
    assert ep.id is None and len(ep) == 1 and not ep.is_done


def test_chunks_carry_every_key_rllibs_server_reads():
    """RLlib 2.48's TcpClientInferenceEnvRunner builds its episodes from exactly these keys
    (tcp_client_inference_env_runner.py, lines 318-333); a missing one kills its listener."""
    ep = make_chunk(3)
    ep.add_step(1, 1.0, np.zeros(4, np.float32), np.zeros(2, np.float32), -0.7, terminated=True)
    d = json.loads(rllink.encode_json(ep.to_rllink()))
    rllib_reads = {"obs", "actions", "rewards", "action_dist_inputs", "action_logp", "is_terminated", "is_truncated"}
    assert rllib_reads <= set(d) and d["is_terminated"] is True and d["is_truncated"] is False
    assert len(d["obs"]) == len(d["actions"]) + 1
