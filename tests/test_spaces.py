"""The space layer: every observation and action space shmrl trains, through both codecs,
validation, the ONNX graph, the sampler, PPO's log-probabilities and action masks."""
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch

from conftest import need, request_while_serving
from shmrl import rllink
from shmrl.envs.spec import EnvSpec
from shmrl.core.episode import Episode, EpisodeBatch
from shmrl.server.hub import check_episodes
from shmrl.server.serving import Serving
from shmrl.server.store import DEFAULT_POLICY
from shmrl.model.net import MASKED_LOGIT, PolicyNet
from shmrl.onnxio.policy import OnnxPolicy
from shmrl.config.settings import Config, PPOSettings, with_defaults
from shmrl.model.ppo import PPO
from shmrl.client.action_sampler import ActionSampler
from shmrl.core.spaces import action_layout, from_gym, obs_layout
from shmrl.transport.inproc import InProcServer

gs = need("gymnasium", "gym").spaces

# A robot with a camera, its joints, a mode and a mask over its three moves.
ROBOT_OBS = gs.Dict({
    "camera": gs.Box(0, 255, (12, 10, 3), np.uint8),
    "state": gs.Dict({"joints": gs.Box(-1.0, 1.0, (5,), np.float32), "mode": gs.Discrete(4)}),
    "buttons": gs.MultiBinary(2),
    "mission": gs.Text(20),
    "action_mask": gs.Box(0, 1, (3,), np.int8),
})
MOVES = gs.Discrete(3)


def robot_spec(action_space=MOVES, observation_space=ROBOT_OBS) -> EnvSpec:
    return EnvSpec("robot", from_gym(observation_space), from_gym(action_space))


def random_obs(space, rng, rows):
    """``rows`` observations of a gymnasium space in the stored form (dict of leaves)."""
    space.seed(int(rng.integers(1 << 30)))
    layout = obs_layout(space)
    samples = [space.sample() for _ in range(rows)]
    for s in samples:
        if isinstance(s, dict) and "action_mask" in s:
            s["action_mask"] = np.ones_like(s["action_mask"])
            s["action_mask"][int(rng.integers(len(s["action_mask"])))] = 0   # one move forbidden
    return layout.stack([layout.split(s) for s in samples])


# ------------------------------------------------------------ describing spaces

def test_observation_leaves_of_a_nested_dict():
    layout = obs_layout(ROBOT_OBS)
    leaves = {leaf.name: leaf for leaf in layout.leaves}
    assert set(leaves) == {"camera", "state.joints", "state.mode", "buttons", "action_mask"}
    assert (leaves["camera"].dtype, leaves["camera"].encoding, leaves["camera"].input_name) == \
        ("uint8", "image", "obs.camera")
    assert leaves["camera"].scale == pytest.approx(1 / 255)
    assert (leaves["state.mode"].dtype, leaves["state.mode"].encoding, leaves["state.mode"].sizes) == \
        ("int64", "onehot", (4,))
    assert (leaves["buttons"].dtype, leaves["buttons"].shape) == ("uint8", (2,))
    assert layout.mask is leaves["action_mask"] and layout.mask.input_name == "action_mask"
    assert layout.skipped == (("mission", "a Text space, which shmrl cannot encode"),)
    assert obs_layout(gs.Box(-1, 1, (4,))).leaves[0].input_name == "onnx::Gemm_0"   # RLlib's client feeds this
    assert obs_layout(gs.Tuple((gs.Discrete(3), gs.Box(-1, 1, (2,))))).leaves[1].name == "1"
    bools = obs_layout(gs.Box(0, 1, (10, 10, 4), bool)).leaves[0]                     # MinAtar
    assert (bools.dtype, bools.encoding, bools.scale) == ("uint8", "image", 1.0)


@pytest.mark.parametrize("space, dist, shape, dtype", [
    (gs.Discrete(5, start=2), 5, (), np.int64),
    (gs.Box(-2.0, 2.0, (3,)), 6, (3,), np.float32),
    (gs.MultiDiscrete([3, 2, 4]), 9, (3,), np.int64),
    (gs.MultiBinary(3), 6, (3,), np.int64),
    (gs.Tuple((gs.Discrete(2), gs.Box(-1.0, 1.0, (2,)))), 6, (3,), np.float32),
    (gs.Dict({"fire": gs.MultiBinary(1), "move": gs.Box(-1.0, 1.0, (1,))}), 4, (2,), np.float32),
])
def test_action_layouts_and_the_env_actions_they_rebuild(space, dist, shape, dtype):
    layout = action_layout(space)
    assert (layout.dist_size, layout.action_shape, layout.action_dtype) == (dist, shape, dtype)
    rng = np.random.default_rng(0)
    actions, _ = ActionSampler(layout, rng).sample(rng.normal(size=(64, dist)).astype(np.float32) * 3)
    assert np.asarray(actions).shape == (64, *shape)
    for a in layout.to_env(np.asarray(actions)):
        assert space.contains(a if not isinstance(space, gs.Box) else np.asarray(a, np.float32)), a


# ------------------------------------------------------------ both codecs and validation

def robot_batch(rng, spec=None, chunks=(3, 5)) -> EpisodeBatch:
    spec = spec or robot_spec()
    eps = []
    for n in chunks:
        obs = random_obs(ROBOT_OBS, rng, n + 1)
        ep = Episode({k: v[0] for k, v in obs.items()})
        for t in range(n):
            allowed = np.flatnonzero(obs["action_mask"][t])
            ep.add_step(int(rng.choice(allowed)), float(rng.normal()), {k: v[t + 1] for k, v in obs.items()},
                        rng.normal(size=spec.policy_outputs).astype(np.float32), -1.1, truncated=t == n - 1)
        eps.append(ep.finalize())
    return EpisodeBatch.from_episodes(eps)


@pytest.mark.parametrize("codec", ["binary", "json"])
def test_dict_observations_round_trip_through_both_codecs(codec):
    spec, sent = robot_spec(), robot_batch(np.random.default_rng(1))
    msg = {"type": "EPISODES", "episodes": sent, "timesteps": sent.num_steps}
    body = rllink.encode_binary(msg) if codec == "binary" else rllink.encode_json(msg)
    if codec == "json":
        assert b'"camera": [[[' in body and b'"state.mode": ' in body   # one JSON object per step
    got = rllink.decode_request(body)["episodes"]
    assert check_episodes(got, spec) is None
    for name, value in sent.obs.items():
        np.testing.assert_array_equal(got.obs[name], value)
        assert got.obs[name].dtype == value.dtype, name          # images stay bytes, both ways
    np.testing.assert_array_equal(got.actions, sent.actions)


@pytest.mark.parametrize("break_it, reason", [
    (lambda o: o.pop("camera"), "obs has no 'camera'"),
    (lambda o: o.update(extra=o["buttons"]), "unknown keys ['extra']"),
    (lambda o: o.update(camera=o["camera"][:, :5]), "obs 'camera' has shape (5, 10, 3)"),
    (lambda o: o.update(camera=o["camera"].astype(np.int64) + 200), "outside 0..255"),
    (lambda o: o.__setitem__("state.mode", o["state.mode"] + 4), "outside 0..3"),
    (lambda o: o.update(buttons=o["buttons"].astype(np.float32) / 2), "obs 'buttons' must be integers"),
])
def test_observations_that_do_not_fit_are_refused_with_a_reason(break_it, reason):
    batch = robot_batch(np.random.default_rng(2))
    obs = dict(batch.obs)
    break_it(obs)
    batch.obs = obs
    why = check_episodes(batch, robot_spec())
    assert why is not None and reason in why, why


def test_an_action_its_mask_forbids_is_refused():
    batch = robot_batch(np.random.default_rng(3))
    mask = batch.obs["action_mask"]
    first_step_obs = 0                                  # chunk 0's first step sees obs row 0
    batch.actions = batch.actions.copy()
    batch.actions[0] = int(np.flatnonzero(mask[first_step_obs] == 0)[0])
    assert "action_mask forbids" in check_episodes(batch, robot_spec())


def test_a_bad_dict_observation_closes_only_its_connection(caplog):
    spec = robot_spec()
    net = PolicyNet(spec, 16)
    server = InProcServer(codec="json")
    learner = Serving([server], Config(env_steps_per_sample=8, train_batch_size=10_000), {DEFAULT_POLICY: spec},
                      {DEFAULT_POLICY: net.template}, {DEFAULT_POLICY: net.initial_weights(0)})
    good, evil = server.connect(timeout=5), server.connect(timeout=5)
    bad = robot_batch(np.random.default_rng(4))
    bad.obs = {**bad.obs, "camera": bad.obs["camera"][:, :, :4]}
    try:
        closed = request_while_serving(learner, evil, {"type": "PING"}, {
            "type": "EPISODES_AND_GET_STATE", "episodes": bad, "timesteps": bad.num_steps}, what="the bad client closed")
        pong = request_while_serving(learner, good, {"type": "PING"}, what="the good client's PONG")
    finally:
        learner.stop()
        server.close()
    assert isinstance(closed, ConnectionError), closed
    assert "obs 'camera' has shape (12, 4, 3)" in caplog.text and pong["type"] == "PONG"
    assert learner.store.steps_dropped == {"does not fit the environment": bad.num_steps}


# ------------------------------------------------------------ the graph and torch agree

DISCRETE_AND_BOX = gs.Tuple((gs.Discrete(3), gs.Box(-1.0, 1.0, (2,))))


@pytest.mark.parametrize("observation_space, action_space, normalize", [
    (ROBOT_OBS, MOVES, False),
    (ROBOT_OBS, MOVES, True),
    (ROBOT_OBS, DISCRETE_AND_BOX, True),                          # the mask covers the Discrete part only
    (gs.Box(0, 255, (4, 84, 84), np.uint8), MOVES, False),        # Atari's frame stack: the Nature CNN, CHW
    (gs.Box(0, 1, (10, 10, 4), bool), MOVES, False),              # MinAtar: a small CNN, HWC
    (gs.Tuple((gs.MultiDiscrete([3, 5]), gs.Box(-3.0, 3.0, (2, 2)))), DISCRETE_AND_BOX, True),
])
def test_the_onnx_policy_and_the_torch_actor_agree(observation_space, action_space, normalize):
    spec = robot_spec(action_space, observation_space)
    net = PolicyNet(spec, 32, "Tanh", normalize_obs=normalize, log_std_init=-0.5)
    ppo = PPO(net, with_defaults(PPOSettings), seed=3)
    rng = np.random.default_rng(5)
    if ppo.normalizer is not None:   # statistics far from 0 and 1: the graph must apply them
        for _ in range(2):
            ppo.normalizer.update(_as_dict(random_obs(observation_space, rng, 50), spec))
    model = net.template.publish(ppo.published_weights())
    onnx.checker.check_model(onnx.load_from_string(model), full_check=True)
    policy = OnnxPolicy(model)
    assert {i.name for i in policy.session.get_inputs()} == {leaf.input_name for leaf in spec.obs.leaves}
    obs = random_obs(observation_space, rng, 7)
    out = policy.logits(obs)
    assert out.shape == (7, spec.policy_outputs)
    with torch.no_grad():
        trained = ppo.forward(ppo.normalize(obs), values=False)[0].numpy()
    np.testing.assert_allclose(out[:, net.trained_rows], trained, rtol=1e-4, atol=1e-4)
    if len(net.log_std_rows):
        np.testing.assert_allclose(out[:, net.log_std_rows], -0.5, atol=1e-6)
    if spec.obs.mask is not None:   # forbidden values, and only they, have a logit of -1e9
        logits = out[:, spec.actions.mask_columns]
        np.testing.assert_array_equal(logits < -1e8, obs["action_mask"] == 0)


def _as_dict(obs, spec):
    return obs if isinstance(obs, dict) else {spec.obs.leaves[0].name: obs}


# ------------------------------------------------------------ masks, sampling, log-probabilities

def test_masked_actions_are_never_sampled_and_have_no_probability():
    spec = robot_spec()
    net = PolicyNet(spec, 16)
    ppo = PPO(net, with_defaults(PPOSettings), seed=0)
    with torch.no_grad():   # a head that strongly prefers move 0 (forbidden half of the time below)
        ppo.params["pi.head.b"][:] = torch.tensor([8.0, 0.0, 0.0])
    policy = OnnxPolicy(net.template.publish(ppo.published_weights()))
    rng = np.random.default_rng(6)
    obs = random_obs(ROBOT_OBS, rng, 2000)
    out = policy.logits(obs)
    sampler = ActionSampler(spec.actions, np.random.default_rng(7))
    actions, logp = sampler.sample(out)
    actions = np.asarray(actions)
    allowed = obs["action_mask"][np.arange(2000), actions]
    assert allowed.all()                                               # never a masked one
    assert (actions == 0).mean() > 0.5                                 # the preferred one where allowed
    greedy = sampler.greedy(out)
    assert obs["action_mask"][np.arange(2000), greedy].all()
    with torch.no_grad():
        logits = ppo.forward(ppo.normalize(obs), values=False)[0]
        learner_logp, entropy = ppo.log_prob(logits, torch.from_numpy(actions))
        probs = torch.softmax(logits, -1).numpy()
    np.testing.assert_allclose(learner_logp.numpy(), logp, atol=1e-4)   # the ratio starts at 1
    assert probs[obs["action_mask"] == 0].max() == 0.0
    allowed_only = np.where(obs["action_mask"] == 1, probs, 1.0)
    np.testing.assert_allclose(entropy.numpy(), -(probs * np.log(allowed_only)).sum(-1), atol=1e-5)
    # The published graph moves a masked logit to MASKED_LOGIT (the logit itself is below float32's step there).
    masked = out[:, spec.actions.mask_columns][obs["action_mask"] == 0]
    assert masked.size and np.allclose(masked, MASKED_LOGIT, rtol=1e-6), masked[:5]


@pytest.mark.parametrize("action_space", [
    gs.MultiDiscrete([3, 2, 4]),
    gs.Tuple((gs.Discrete(3), gs.Box(-1.0, 1.0, (2,)), gs.MultiBinary(2))),
])
def test_ppo_log_probabilities_equal_the_samplers_and_torch_distributions(action_space):
    spec = robot_spec(action_space, gs.Box(-1.0, 1.0, (6,)))
    net = PolicyNet(spec, 32, log_std_init=-0.3)
    ppo = PPO(net, with_defaults(PPOSettings), seed=1)
    obs = np.random.default_rng(8).normal(size=(500, 6)).astype(np.float32)
    out = OnnxPolicy(net.template.publish(ppo.published_weights())).logits(obs)
    actions, logp = ActionSampler(spec.actions, np.random.default_rng(9)).sample(out)
    with torch.no_grad():
        trained = ppo.forward(ppo.normalize(obs), values=False)[0]
        mine, entropy = ppo.log_prob(trained, torch.from_numpy(actions))
    np.testing.assert_allclose(mine.numpy(), logp, atol=1e-4)
    # Independently, part by part, with torch.distributions.
    expected, expected_entropy = torch.zeros(500), torch.zeros(500)
    t_out, t_act = torch.from_numpy(out), torch.from_numpy(np.asarray(actions, np.float32))
    for part, dist, cols in spec.actions.slices():
        x = t_out[:, dist]
        if part.kind == "categorical":
            d = torch.distributions.Categorical(logits=x)
            expected += d.log_prob(t_act[:, cols.start].long())
        else:
            d = torch.distributions.Normal(x[:, :part.size], x[:, part.size:].exp())
            expected += d.log_prob(t_act[:, cols]).sum(-1)
            d = torch.distributions.Independent(d, 1)
        expected_entropy += d.entropy()
    np.testing.assert_allclose(mine.numpy(), expected.numpy(), atol=1e-4)
    np.testing.assert_allclose(entropy.numpy(), expected_entropy.numpy(), atol=1e-4)


# ------------------------------------------------------------ real environments, end to end

@pytest.mark.parametrize("env, inputs", [
    ("gym:MiniGrid-DoorKey-5x5-v0", {"obs.image": "tensor(uint8)", "obs.direction": "tensor(int64)"}),
    # MinAtar's run takes over 20 s: the slow set's, as the Atari one below.
    pytest.param("gym:MinAtar/Breakout-v1", {"obs": "tensor(uint8)"}, marks=pytest.mark.slow),
])
def test_image_and_dict_environments_train_end_to_end(env, inputs, tmp_path, caplog, monkeypatch, no_shm_leftovers,
                                                      no_sim_leftovers):
    import logging

    import shmrl
    from shmrl.envs import spec as envspec

    monkeypatch.setattr(envspec, "_SKIPPED_SAID", set())   # said once per process: this test's process
    caplog.set_level(logging.INFO, logger="shmrl.envs")

    pytest.importorskip("minigrid" if "MiniGrid" in env else "minatar", reason="its extra is not installed")
    # Its simulators at the learner's priority: at nice 19 beside two busy loops they stepped 4
    # env steps/s and MinAtar's 6000 ran past the 300-s timeout (a loaded .ci/run).
    summary = shmrl.train(env=env, sims=2, envs_per_sim=2, max_env_steps=6000, train_batch_size=1024,
                          logdir=str(tmp_path), tensorboard=False, sim_nice=0)
    assert summary["exit_status"] == 1 and summary["updates"] >= 3, summary        # the step budget
    assert summary["env_steps_dropped"] == {} and summary["bad_frames"] == 0, summary
    policy = OnnxPolicy((tmp_path / "policy.onnx").read_bytes())
    assert {i.name: i.type for i in policy.session.get_inputs()} == inputs
    if "MiniGrid" in env:   # its Text mission cannot be encoded: said once, never silently
        assert "observation 'mission' is left out" in caplog.text


@pytest.mark.slow
def test_an_atari_game_is_preprocessed_and_trains_end_to_end(tmp_path, no_shm_leftovers, no_sim_leftovers):
    """gym:ALE/* is built with gymnasium's own Atari preprocessing (84x84 grey, 4 stacked,
    uint8 throughout) and trains through the rings with the preset's Nature CNN; a short
    budget: the suite checks that it runs, tools/zoo.py measures how well."""
    pytest.importorskip("ale_py", reason="the atari extra is not installed (the test extra has it)")
    import shmrl
    from shmrl.envs.make import env_spec, make_env

    env = make_env("gym:ALE/Breakout-v5", seed=0)
    try:
        obs, _ = env.reset(seed=0)
        assert obs.shape == (4, 84, 84) and obs.dtype == np.uint8
        assert env_spec("gym:ALE/Breakout-v5").action_space.n == 4
    finally:
        env.close()
    torch.set_num_threads(1)
    summary = shmrl.train(env="gym:ALE/Breakout-v5", sims=1, envs_per_sim=2, max_env_steps=768, sim_nice=0,
                          train_batch_size=256, minibatch_size=128, logdir=str(tmp_path), tensorboard=False)
    assert summary["exit_status"] == 1 and summary["updates"] >= 2, summary
    assert torch.get_num_threads() == os.cpu_count()     # the preset's torch_threads 0: every core
    assert summary["env_steps_dropped"] == {} and summary["bad_frames"] == 0, summary
    policy = OnnxPolicy((tmp_path / "policy.onnx").read_bytes())
    (obs_input,) = policy.session.get_inputs()
    assert obs_input.name == "obs" and obs_input.type == "tensor(uint8)" and obs_input.shape[1:] == [4, 84, 84]


def test_what_is_left_out_is_said_once_without_setting_logging_up():
    """The learner warns (Python prints a WARNING with no logging set up); making the env's
    spec, as every simulator does, says nothing."""
    pytest.importorskip("minigrid", reason="the minigrid extra is not installed")
    code = ("from shmrl.envs.make import env_spec; from shmrl.envs.spec import say_left_out\n"
            "spec = env_spec('gym:MiniGrid-DoorKey-5x5-v0'); env_spec('gym:MiniGrid-DoorKey-5x5-v0')\n"
            "print('made', flush=True); say_left_out(spec); say_left_out(spec)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == "made\n", out.stderr
    said = [line for line in out.stderr.splitlines() if "left out" in line]
    assert said == ["gym:MiniGrid-DoorKey-5x5-v0: observation 'mission' is left out: a MissionSpace space, "
                    "which shmrl cannot encode"], out.stderr
