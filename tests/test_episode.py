import json

import numpy as np
import pytest

from shmrl import rllink
from shmrl.core.episode import Episode, EpisodeBatch
from shmrl.client.rollout import Rollout


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
        back = rllink.decode_request(body)["episodes"].chunk(0)
        assert back.id == ep.id and back.is_truncated and not back.is_terminated
        for name in ("obs", "actions", "rewards", "action_dist_inputs", "action_logp"):
            np.testing.assert_array_equal(getattr(back, name), getattr(ep, name))


def test_rllib_style_dict_without_id_or_optional_fields():
    d = {"obs": [[0.0] * 4, [1.0] * 4], "actions": [1], "rewards": [1.0],
         "action_dist_inputs": [[0.2, 0.3]], "action_logp": [-0.6],
         "is_terminated": False, "is_truncated": False}
    msg = rllink.decode_request(rllink.encode_json({"type": "EPISODES", "episodes": [d]}))
    ep = msg["episodes"].chunk(0)
    assert ep.id is None and len(ep) == 1 and not ep.is_done and ep.weights_seq_no is None


def test_chunk_without_an_id_round_trips_through_json():
    """A chunk with no id leaves episode_id out: the JSON list form refuses a null id."""
    ep = Episode(np.zeros(4, np.float32))
    ep.id = None
    ep.add_step(0, 1.0, np.ones(4, np.float32), np.zeros(2, np.float32), -0.7)
    assert "episode_id" not in ep.to_rllink()
    back = rllink.decode_request(rllink.encode_json({"type": "EPISODES", "episodes": [ep.to_rllink()]}))
    assert back["episodes"].chunk(0).id is None and back["episodes"].num_steps == 1


def test_chunks_carry_every_key_rllibs_server_reads():
    """RLlib 2.48's TcpClientInferenceEnvRunner builds its episodes from exactly these keys
    (tcp_client_inference_env_runner.py, lines 318-333); a missing one kills its listener."""
    ep = make_chunk(3)
    ep.add_step(1, 1.0, np.zeros(4, np.float32), np.zeros(2, np.float32), -0.7, terminated=True)
    d = json.loads(rllink.encode_json(ep.to_rllink()))
    rllib_reads = {"obs", "actions", "rewards", "action_dist_inputs", "action_logp", "is_terminated", "is_truncated"}
    assert rllib_reads <= set(d) and d["is_terminated"] is True and d["is_truncated"] is False
    assert len(d["obs"]) == len(d["actions"]) + 1


@pytest.mark.parametrize("K", [1, 4])
def test_rollout_batch_holds_the_same_chunks_as_per_env_episodes(K):
    """Three rollouts of K envs (short episodes end inside them, some at their last step)
    give exactly the chunks that per-env Episode.add_step / cut() bookkeeping gives."""
    T, rng = 7, np.random.default_rng(3)
    lengths = [3, 1, 7, 5][:K]               # env k's episodes last lengths[k] steps (0 below: truncated)
    rollout = Rollout(K, T)
    reference = [Episode(np.full(4, 100.0 * k, np.float32)) for k in range(K)]
    obs = np.stack([ep.obs[0] for ep in reference])
    age, expected, got = [0] * K, [], []
    for _ in range(3):
        rollout.start(obs)
        finished = []
        for t in range(T):
            actions, logits, logp = rng.integers(2, size=K), rng.normal(size=(K, 2)).astype(np.float32), rng.normal(size=K)
            new_obs, rewards = rng.normal(size=(K, 4)).astype(np.float32), rng.normal(size=K).astype(np.float32)
            terminated, truncated = np.zeros(K, bool), np.zeros(K, bool)
            final_obs = new_obs.copy()
            for k in range(K):
                age[k] += 1
                if age[k] == lengths[k]:
                    (terminated if k % 2 else truncated)[k] = True
                reference[k].add_step(int(actions[k]), float(rewards[k]), new_obs[k].copy(), logits[k], float(logp[k]),
                                      terminated[k], truncated[k])
                if terminated[k] or truncated[k]:
                    finished.append(reference[k])
                    age[k] = 0
                    new_obs[k] = rng.normal(size=4)          # the env's reset observation
                    reference[k] = Episode(new_obs[k].copy())
            ended = (terminated | truncated).any()   # as vector envs give it: None when no env ended
            rollout.record(actions, logits, logp, new_obs, rewards, terminated, truncated, final_obs if ended else None)
            obs = new_obs
        expected += [ep.to_rllink() for ep in finished] + [ep.to_rllink() for ep in reference if len(ep)]
        reference = [ep.cut() if len(ep) else ep for ep in reference]
        got += rollout.batch(weights_seq_no=5).to_dicts()
    assert sum(len(c["actions"]) for c in got) == 3 * T * K
    key = lambda c: (c["obs"][0].tobytes(), len(c["actions"]))
    for want, have in zip(sorted(expected, key=key), sorted(got, key=key)):
        for name in ("obs", "actions", "rewards", "action_dist_inputs", "action_logp"):
            np.testing.assert_allclose(have[name], want[name], rtol=1e-6, err_msg=name)
        assert (have["is_terminated"], have["is_truncated"]) == (want["is_terminated"], want["is_truncated"])
        assert have["weights_seq_no"] == 5
    ids = {}                                  # a running episode keeps its id across rollouts
    for c in got:
        ids.setdefault(c["episode_id"], []).append(c)
    assert all(sum(c["is_terminated"] or c["is_truncated"] for c in chunks) <= 1 for chunks in ids.values())
    if K == 4:
        env2 = [c for c in got if c["obs"][0][0] == 200.0]      # env 2's first episode: all 7 steps of
        assert len(env2) == 1 and env2[0]["is_truncated"] is True  # the first rollout, ended by a time limit
        assert len(env2[0]["actions"]) == 7 and env2[0]["is_terminated"] is False


def test_episode_batch_holds_chunks_column_wise():
    a, b, empty = make_chunk(3), make_chunk(5, start=10.0), make_chunk(0, start=20.0)
    b.add_step(1, 2.0, np.zeros(4, np.float32), np.zeros(2, np.float32), -0.1, terminated=True)
    a.weights_seq_no = 4
    batch = EpisodeBatch.from_episodes([a.finalize(), b.finalize(), empty.finalize()])
    assert batch.num_chunks == 3 and batch.num_steps == 9 and len(batch.obs) == 12
    assert batch.lengths.tolist() == [3, 6, 0] and batch.offsets.tolist() == [0, 3, 9, 9]
    assert batch.weights_seq_no.tolist() == [4, -1, -1] and batch.is_done.tolist() == [False, True, False]
    np.testing.assert_allclose(batch.chunk_returns(), [3.0, 7.0, 0.0])
    for want, i in ((a, 0), (b, 1), (empty, 2)):
        got = batch.chunk(i)
        assert (got.id, got.is_terminated, got.weights_seq_no) == (want.id, want.is_terminated, want.weights_seq_no)
        for name in ("obs", "actions", "rewards", "action_dist_inputs", "action_logp"):
            np.testing.assert_array_equal(getattr(got, name).ravel(), getattr(want, name).ravel(), err_msg=name)
        assert got.action_dist_inputs.shape == (len(want), 2)  # an empty chunk's rows keep their width
    kept = batch.select(np.array([True, False, True]))
    assert kept.num_chunks == 2 and kept.num_steps == 3 and [c.id for c in kept.chunks()] == [a.id, empty.id]
    np.testing.assert_array_equal(kept.chunk(1).obs, empty.obs)
    both = EpisodeBatch.concat([kept, batch])
    assert both.num_chunks == 5 and both.lengths.tolist() == [3, 0, 3, 6, 0]
    np.testing.assert_array_equal(both.chunk(3).obs, b.obs)
