"""Recurrent policies (--memory): the ONNX graph and torch agree step by step, the state
travels with the chunks and is reset at episode starts, PPO replays chunks cut in
mid-episode exactly, padding changes no loss, and a memory task is learned."""
import hashlib
import json

import numpy as np
import onnxruntime as ort
import pytest
import torch

from conftest import run_beside_example_client, summary_of
from shmrl import rllink
from shmrl.client.actor import Actor
from shmrl.core.spaces import Box, Discrete
from shmrl.envs.make import env_spec, make_vec_env
from shmrl.envs.spec import EnvSpec
from shmrl.core.episode import EpisodeBatch
from shmrl.server.hub import check_episodes
from shmrl.model.net import PolicyNet
from shmrl.client.rollout import Rollout
from shmrl.onnxio.policy import OnnxPolicy
from shmrl.config.settings import PPOSettings, with_defaults
from shmrl.model.ppo import PPO
from shmrl.client.action_sampler import ActionSampler

NOVEL = env_spec("CartPoleNoVel-v1")


def perturbed_ppo(spec, memory="lstm", max_seq_len=5, seed=0, **config):
    """A PPO whose weights are far enough from their init that the state matters."""
    net = PolicyNet(spec, 32, "ReLU", layers=1, memory=memory, memory_size=16)
    ppo = PPO(net, with_defaults(PPOSettings, max_seq_len=max_seq_len, **config), seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ppo.params.values():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
    return ppo


def policy_of(ppo) -> OnnxPolicy:
    return OnnxPolicy(ppo.net.template.publish(ppo.published_weights()))


def sample(ppo, env_id="CartPoleNoVel-v1", envs=3, steps=23, rollouts=3, seed=0):
    """Rollouts as a simulator samples them (sim.run_simulator's loop): a batch per rollout."""
    vec = make_vec_env(env_id, envs, seed)
    actor = Actor(policy_of(ppo), vec.spec, envs, np.random.default_rng(seed))
    obs = vec.reset()
    rollout, batches = Rollout(envs, steps), []
    for _ in range(rollouts):
        rollout.start(obs, actor.state)
        for _ in range(steps):
            actions, dist_inputs, logp = actor.act(obs)
            obs, rewards, terminated, truncated, final_obs = vec.step(actions)
            rollout.record(actions, dist_inputs, logp, obs, rewards, terminated, truncated, final_obs)
            if final_obs is not None:
                actor.reset(np.asarray(terminated) | np.asarray(truncated))
        batches.append(rollout.batch(1))
    return batches


@pytest.mark.parametrize("memory", ["lstm", "gru"])
def test_onnx_and_torch_give_the_same_outputs_and_states_over_an_episode(memory):
    ppo = perturbed_ppo(NOVEL, memory)
    net = ppo.net
    session = ort.InferenceSession(net.template.publish(ppo.published_weights()), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    assert names == ["onnx::Gemm_0", *(f"state_in.{i}" for i in range(2 if memory == "lstm" else 1))]
    assert [o.name for o in session.get_outputs()] == ["action_dist_inputs", *net.state_names("out")]
    env = make_vec_env("CartPoleNoVel-v1", 2, 5)
    obs, state = env.reset(), [np.zeros((2, 16), np.float32) for _ in net.state_names("in")]
    seen, outs, states = [], [], []
    for _ in range(40):
        seen.append(obs.copy())
        out, *state = session.run(None, {"onnx::Gemm_0": obs, **dict(zip(net.state_names("in"), state))})
        outs.append(out)
        states.append(np.concatenate(state, axis=1))
        obs = env.step(out.argmax(1))[0]
    with torch.no_grad():
        x = torch.from_numpy(np.stack(seen, 1).reshape(80, 4))
        out, _, last = net.sequence_torch(ppo.params, {"obs": x}, torch.zeros(2, net.state_size))
    np.testing.assert_allclose(out.numpy().reshape(2, 40, 2), np.stack(outs, 1), atol=2e-5)
    np.testing.assert_allclose(last.numpy(), states[-1], atol=2e-5)
    assert np.abs(states[-1]).max() > 0.1   # the state is not trivially zero
    # And one step at a time in torch, carrying the state, is the same thing.
    with torch.no_grad():
        s = torch.zeros(2, net.state_size)
        for t in (0, 1, 2):
            o, _, s = net.sequence_torch(ppo.params, {"obs": torch.from_numpy(seen[t])}, s)
            np.testing.assert_allclose(o.numpy(), outs[t], atol=2e-5)
            np.testing.assert_allclose(s.numpy(), states[t], atol=2e-5)


def test_without_memory_the_graph_is_byte_for_byte_what_it_was():
    """The hashes of the published models before recurrent policies existed (main at
    5507e87): RLlib's own client, and every client written against that contract, see
    exactly the same model."""
    for env, kw, digest in (
            ("CartPole-v1", {}, "7fd069e879e00aa5d12873bda91369d196fc94241fdc8d1abb749b2873e1c90e"),
            ("Pendulum-v1", {"normalize_obs": True}, "48cf9ea39bab151421970240c7966e640ec9979f46c5018835bf587d6eb4936c")):
        net = PolicyNet(env_spec(env), 64, "ReLU", **kw)
        assert net.state_size == 0 and net.state_names("in") == []
        assert hashlib.sha256(net.template.publish(net.initial_weights(3))).hexdigest() == digest


def test_state_is_reset_at_episode_starts_and_travels_with_each_chunk():
    ppo = perturbed_ppo(NOVEL)
    batches = sample(ppo, rollouts=3)
    for before, batch in zip(batches, batches[1:]):
        assert batch.state_in.shape == (batch.num_chunks, 16 * 2)
        begins_rollout = batch.offsets[:-1] % 23 == 0   # the envs' steps lie env by env, 23 each
        # Every other chunk begins an episode: it starts from zeros.
        assert (~begins_rollout).any() and (batch.state_in[~begins_rollout] == 0).all()
        # One that begins the rollout starts from zeros where the env's last chunk before ended
        # its episode, else from the state that episode had reached.
        last_before = np.searchsorted(before.offsets, np.arange(1, 4) * 23 - 1, side="right") - 1
        going_on = np.abs(batch.state_in[begins_rollout]).sum(1) > 0
        np.testing.assert_array_equal(going_on, ~before.is_done[last_before])


@pytest.mark.parametrize("memory", ["lstm", "gru"])
def test_chunks_cut_mid_episode_replay_to_the_simulators_log_probabilities(memory):
    ppo = perturbed_ppo(NOVEL, memory, max_seq_len=5)
    batches = sample(ppo, rollouts=3)
    chunks = EpisodeBatch.concat(batches[1:])   # without the rollout the episodes began in
    assert (np.abs(chunks.state_in).sum(1) > 0).any()
    batch = ppo.make_batch(chunks)
    with torch.no_grad():
        out, _, _ = ppo.net.sequence_torch(ppo.params, {k: torch.from_numpy(v) for k, v in batch.obs.items()},
                                           torch.from_numpy(batch.state))
        logp, _ = ppo.log_prob(out, torch.from_numpy(batch.actions))
    real = batch.mask > 0
    assert real.sum() == chunks.num_steps and batch.seq_len == 5 and len(batch) % 5 == 0
    np.testing.assert_allclose(logp.numpy()[real], batch.logp[real], atol=1e-5)
    # Without the stored state the replay would differ: the column matters.
    chunks.state_in = np.zeros_like(chunks.state_in)
    zeroed = ppo.make_batch(chunks)
    with torch.no_grad():
        out, _, _ = ppo.net.sequence_torch(ppo.params, {k: torch.from_numpy(v) for k, v in zeroed.obs.items()},
                                           torch.from_numpy(zeroed.state))
        logp0, _ = ppo.log_prob(out, torch.from_numpy(zeroed.actions))
    assert np.abs(logp0.numpy()[real] - zeroed.logp[real]).max() > 1e-3


def test_padding_changes_no_loss():
    """The loss of the whole batch is the same however the chunks are cut into sequences
    (with exact starting states each step's output is the same), and whatever the padding holds."""
    losses = []
    for max_seq_len in (3, 7, 64):
        ppo = perturbed_ppo(NOVEL, max_seq_len=max_seq_len)
        chunks = EpisodeBatch.concat(sample(ppo, rollouts=2, seed=1))
        batch = ppo.make_batch(chunks)
        pad = batch.mask == 0
        assert pad.any()
        obs = {k: torch.from_numpy(v.copy()) for k, v in batch.obs.items()}
        args = [torch.from_numpy(x.copy()) for x in (batch.actions, batch.logp, batch.advantages, batch.returns)]
        state, mask = torch.from_numpy(batch.state), torch.from_numpy(batch.mask)
        with torch.no_grad():
            loss, terms = ppo.loss(obs, *args, state=state, mask=mask)
            obs["obs"][torch.from_numpy(pad)] = 1e3          # garbage in the padding
            args[2][torch.from_numpy(pad)] = -1e6
            args[3][torch.from_numpy(pad)] = 1e6
            args[0][torch.from_numpy(pad)] = 1 - args[0][torch.from_numpy(pad)]
            garbage, _ = ppo.loss(obs, *args, state=state, mask=mask)
        assert float(loss) == pytest.approx(float(garbage), abs=1e-6)
        losses.append([float(t) for t in terms])
    np.testing.assert_allclose(losses[0], losses[1], atol=1e-5)
    np.testing.assert_allclose(losses[0], losses[2], atol=1e-5)


def test_state_in_crosses_both_codecs_and_is_checked():
    ppo = perturbed_ppo(NOVEL)
    batch = sample(ppo, rollouts=2)[1]
    for encode in (rllink.encode_binary, rllink.encode_json):
        msg = rllink.decode_request(encode({"type": "EPISODES", "episodes": batch}))
        got = msg["episodes"]
        np.testing.assert_allclose(got.state_in, batch.state_in, atol=1e-6)
        assert check_episodes(got, NOVEL, 32) is None
        assert "state has 16" in check_episodes(got, NOVEL, 16)
        assert "no memory" in check_episodes(got, NOVEL, 0)
    # The JSON episode carries it under "state_in": a list of floats, the graph's state_in.<i> side by side.
    episode = json.loads(rllink.encode_json({"type": "EPISODES", "episodes": batch}))["episodes"][0]
    assert len(episode["state_in"]) == 32
    bad = dict(episode, state_in=[float("nan")] * 32)
    with pytest.raises(rllink.ProtocolError, match="non-finite"):
        rllink.validate({"type": "EPISODES", "episodes": [bad]}, "request")
    with pytest.raises(rllink.ProtocolError, match="state_in"):
        rllink.validate({"type": "EPISODES", "episodes": [dict(episode, state_in=[[1.0]])]}, "request")
    # A client that sends none (whole episodes): its chunks start from zeros.
    plain = {k: v for k, v in episode.items() if k != "state_in"}
    got = rllink.validate({"type": "EPISODES", "episodes": [plain]}, "request")["episodes"]
    assert got.state_in is None and check_episodes(got, NOVEL, 32) is None
    assert got.state_in.shape == (1, 32) and not got.state_in.any()


class Recall:
    """A cue (+1 or -1) shown at the first step only, then blanks, then a query: the action
    at the query must name the cue (reward 1). At the query every episode shows the same
    observation, so a memoryless policy is right half the time."""
    spec = EnvSpec("Recall", Box((-1.0, -1.0), (1.0, 1.0), (2,)), Discrete(2))
    DELAY = 4

    def __init__(self, seed=None):
        self.rng = np.random.default_rng(seed)

    def reset(self, seed=None):
        self.cue, self.t = int(self.rng.integers(2)), 0
        return np.array([2 * self.cue - 1, 0], np.float32), {}

    def step(self, action):
        self.t += 1
        if self.t <= self.DELAY:
            return np.array([0, self.t == self.DELAY], np.float32), 0.0, False, False, {}
        return np.zeros(2, np.float32), float(int(action) == self.cue), True, False, {}


def test_a_memory_task_a_memoryless_policy_cannot_solve_is_solved():
    from shmrl.envs.make import LoopVecEnv

    net = PolicyNet(Recall.spec, 32, "ReLU", layers=1, memory="gru", memory_size=16)
    ppo = PPO(net, with_defaults(PPOSettings, lr=3e-3, epochs=4, minibatch_size=128, max_seq_len=8, gamma=0.99), seed=0)
    vec = LoopVecEnv(lambda: Recall(), 16, seed=0, spec=Recall.spec)
    sampler = ActionSampler(Recall.spec.actions, np.random.default_rng(0))
    obs, state = vec.reset(), np.zeros((16, net.state_size), np.float32)
    rollout = Rollout(16, 20)
    returns = []
    for _ in range(60):
        policy = policy_of(ppo)
        rollout.start(obs, state)
        for _ in range(20):
            logits, state = policy.step(obs, state)
            actions, logp = sampler.sample(logits)
            obs, rewards, terminated, truncated, final_obs = vec.step(actions)
            rollout.record(actions, logits, logp, obs, rewards, terminated, truncated, final_obs)
            if final_obs is not None:
                state[terminated | truncated] = 0.0
        ppo.update(ppo.make_batch(rollout.batch(1)))
        returns += rollout.completed
        rollout.completed.clear()
        if len(returns) >= 200 and np.mean(returns[-200:]) >= 0.95:
            break
    assert np.mean(returns[-200:]) >= 0.95, np.mean(returns[-200:])


@pytest.mark.slow   # over 10 s: trains to a target or runs a whole tool
def test_a_recurrent_run_learns_over_shared_memory(start_run, tmp_path):
    logdir = tmp_path / "logs"
    run = start_run("--env", "CartPoleNoVel-v1", "--memory", "gru", "--sims", 2, "--stop-return", 100,
                    "--max-env-steps", 200_000, "--logdir", logdir)
    run.proc.wait(timeout=120)
    assert run.proc.returncode == 0, run.output()
    summary = json.loads((logdir / "summary.json").read_text())
    assert summary["return_mean"] >= 100 and summary["env_steps_dropped"] == {}
    session = ort.InferenceSession(str(logdir / "policy.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["onnx::Gemm_0", "state_in.0"]
    assert [o.name for o in session.get_outputs()] == ["action_dist_inputs", "state_out.0"]
    assert session.get_inputs()[1].shape == ["batch", 64]


@pytest.mark.slow   # over 10 s: trains to a target or runs a whole tool
def test_a_recurrent_run_learns_over_tcp_json(start_run, tmp_path):
    """The simulators' chunks, state_in among them, as RLlink JSON over TCP."""
    logdir = tmp_path / "logs"
    run = start_run("--env", "CartPoleNoVel-v1", "--transport", "tcp", "--sims", 2, "--stop-return", 100,
                    "--max-env-steps", 200_000, "--logdir", logdir)
    run.proc.wait(timeout=120)
    assert run.proc.returncode == 0, run.output()
    summary = json.loads((logdir / "summary.json").read_text())
    assert summary["return_mean"] >= 100 and summary["env_steps_dropped"] == {} and summary["bad_frames"] == 0
    assert not any(c.startswith("shm:") for c in summary["env_steps_by_client"])


def test_the_external_client_runs_a_recurrent_policy(start_run, tmp_path):
    """examples/external_client.py against a recurrent policy: it feeds and carries the
    state, and every chunk it sends (with its state_in) is taken."""
    logdir = tmp_path / "logs"
    run, out = run_beside_example_client(start_run, tmp_path, "cartpole-novel", "--env", "CartPoleNoVel-v1",
                                         "--max-env-steps", 3000, "--train-batch-size", 1000,
                                         "--env-steps-per-sample", 500, "--logdir", logdir, timeout=90)
    assert run.proc.returncode == 1, run.output()     # the step budget ran out, as asked
    summary = summary_of(logdir)
    assert summary["env_steps"] >= 3000 and summary["env_steps_dropped"] == {} and summary["bad_frames"] == 0, out
    assert summary["updates"] >= 2


def test_eval_runs_a_recurrent_policy_with_its_state():
    from shmrl.eval import evaluate

    ppo = perturbed_ppo(NOVEL)
    returns = evaluate(ppo.net.template.publish(ppo.published_weights()), "CartPoleNoVel-v1", episodes=6)
    assert len(returns) == 6 and all(r >= 1 for r in returns)
