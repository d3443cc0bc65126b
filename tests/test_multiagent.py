"""Multi-agent training (shmrl.client.multi_agent): the wire format, the simulator loop over
Parallel and turn-based PettingZoo envs, the policy map, per-policy learning, self-play
evaluation and the league."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import FakeServer, need, run_beside_example_client, summary_of
need("pettingzoo", "pettingzoo")
from gymnasium import spaces as gs  # noqa: E402
from pettingzoo import AECEnv, ParallelEnv  # noqa: E402

import shmrl  # noqa: E402
from shmrl import rllink  # noqa: E402
from shmrl.envs.make import resolve_env  # noqa: E402
from shmrl.core.episode import Episode, EpisodeBatch, MultiAgentBatch  # noqa: E402
from shmrl.server.hub import Hub  # noqa: E402
from shmrl.server.serving import Serving  # noqa: E402
from shmrl.server.store import EpisodeStore  # noqa: E402
from shmrl.client.multi_agent import MultiAgentRollout, PolicySet, play, policy_mapper  # noqa: E402
from shmrl.onnxio.policy import encode_onnx_file  # noqa: E402
from shmrl.config.settings import Config, resolve_config  # noqa: E402
from shmrl.trainer.setup import policy_net  # noqa: E402


class Relay(ParallelEnv):
    """Four agents guess the bit they are shown (reward 1 when right). ``c`` leaves after 3
    steps (terminated), ``b`` after 5 (truncated), ``d`` joins at step 2; the episode ends
    at step 8."""
    metadata = {"name": "relay"}
    possible_agents = ["a", "b", "c", "d"]

    def __init__(self):
        self.rng = np.random.default_rng(0)

    def observation_space(self, agent):
        return gs.Box(0.0, 1.0, (2,), np.float32)

    def action_space(self, agent):
        return gs.Discrete(2)

    def _obs(self, agents):
        self.bits = {a: int(self.rng.integers(2)) for a in agents}
        return {a: np.eye(2, dtype=np.float32)[self.bits[a]] for a in agents}

    def reset(self, seed=None, options=None):
        if seed is not None:
            self.rng = np.random.default_rng(seed)
        self.t, self.agents = 0, ["a", "b", "c"]
        return self._obs(self.agents), {a: {} for a in self.agents}

    def step(self, actions):
        self.t += 1
        rewards = {a: float(actions[a] == self.bits[a]) for a in actions}
        terms = {a: (a == "c" and self.t == 3) or self.t == 8 for a in actions}
        truncs = {a: a == "b" and self.t == 5 for a in actions}
        obs = self._obs(list(actions))
        self.agents = [a for a in self.agents if not (terms[a] or truncs[a])]
        if self.t == 2:
            self.agents.append("d")
            self.bits["d"] = int(self.rng.integers(2))
            obs["d"] = np.eye(2, dtype=np.float32)[self.bits["d"]]
        return obs, rewards, terms, truncs, {a: {} for a in obs}


class FirstWins(AECEnv):
    """Two players take one turn each; the first to move wins (+1, -1): no skill at all."""
    metadata = {"name": "first_wins"}
    possible_agents = ["p0", "p1"]

    def observation_space(self, agent):
        return gs.Dict({"observation": gs.Box(0, 1, (2,), np.int8), "action_mask": gs.Box(0, 1, (3,), np.int8)})

    def action_space(self, agent):
        return gs.Discrete(3)

    def observe(self, agent):
        return {"observation": np.zeros(2, np.int8), "action_mask": np.array([0, 1, 1], np.int8)}

    def reset(self, seed=None, options=None):
        self.agents = list(self.possible_agents)
        self.agent_selection, self.turns = "p0", 0
        self.rewards = {a: 0.0 for a in self.agents}
        self._cumulative_rewards = {a: 0.0 for a in self.agents}
        self.terminations = {a: False for a in self.agents}
        self.truncations = {a: False for a in self.agents}
        self.infos = {a: {} for a in self.agents}

    def step(self, action):
        agent = self.agent_selection
        if self.terminations[agent] or self.truncations[agent]:
            self._was_dead_step(action)
            return
        assert action in (1, 2), f"masked action {action} played"
        self.turns += 1
        if self.turns == 2:
            self.rewards = {"p0": 1.0, "p1": -1.0}
            self.terminations = {a: True for a in self.agents}
        self._cumulative_rewards = {a: self._cumulative_rewards[a] + self.rewards[a] for a in self.agents}
        self.agent_selection = "p1" if agent == "p0" else "p0"


def model_for(env, agent, seed=0) -> bytes:
    _, spec = resolve_env(env)
    cfg = resolve_config(Config(env=env, hidden=16), spec)
    net = policy_net(cfg, spec.agent_specs[agent])
    return net.template.publish(net.initial_weights(seed))


def policies_of(env, pids, agent) -> PolicySet:
    ps = PolicySet()
    ps.update({pid: {"onnx_file": encode_onnx_file(model_for(env, agent, i)), "weights_seq_no": 1}
               for i, pid in enumerate(pids)})
    return ps


# ---------------------------------------------------------------- the wire

def ma_batch() -> MultiAgentBatch:
    def ep(agent, n, done):
        e = Episode(np.zeros(3, np.float32), agent_id=agent, weights_seq_no=4)
        for i in range(n):
            e.add_step(i % 2, 0.5, np.full(3, i, np.float32), np.zeros(2, np.float32), -0.7,
                       terminated=done and i == n - 1)
        return e.finalize()
    return MultiAgentBatch({"p0": EpisodeBatch.from_episodes([ep("a", 2, True), ep("b", 3, False)]),
                            "p1": EpisodeBatch.from_episodes([ep(7, 1, True)])})


@pytest.mark.parametrize("encode", [rllink.encode_json, rllink.encode_binary])
def test_multiagent_episodes_round_trip_through_both_codecs(encode):
    sent = ma_batch()
    msg = rllink.decode_request(encode({"type": "EPISODES", "episodes": sent, "timesteps": sent.num_steps}))
    got = msg["episodes"]
    assert isinstance(got, MultiAgentBatch) and sorted(got.policies) == ["p0", "p1"]
    for pid, batch in sent.policies.items():
        back = got.policies[pid]
        assert back.agent_ids == batch.agent_ids
        assert back.lengths.tolist() == batch.lengths.tolist()
        assert np.array_equal(back.obs, batch.obs) and np.array_equal(back.actions, batch.actions)
        assert back.is_terminated.tolist() == batch.is_terminated.tolist()
    assert msg["timesteps"] == 6


def test_multiagent_json_is_rllib_list_with_agent_and_module_ids():
    body = json.loads(rllink.encode_json({"type": "EPISODES", "episodes": ma_batch(), "timesteps": 6}))
    assert [(e["agent_id"], e["module_id"]) for e in body["episodes"]] == [("a", "p0"), ("b", "p0"), (7, "p1")]


def test_single_agent_messages_carry_no_multiagent_fields():
    batch = EpisodeBatch.from_episodes([ma_batch().policies["p0"].chunk(0)])
    batch.agent_ids = None
    body = rllink.encode_json({"type": "EPISODES", "episodes": batch, "timesteps": 2})
    assert b"agent_id" not in body and b"module_id" not in body
    assert b"agent_id" not in rllink.encode_binary({"type": "EPISODES", "episodes": batch, "timesteps": 2})
    assert isinstance(rllink.decode_request(body)["episodes"], EpisodeBatch)


def episode_json(**extra) -> dict:
    return {"obs": [[0.0], [1.0]], "actions": [1], "rewards": [1.0], "action_dist_inputs": [[0.0, 0.0]],
            "action_logp": [-0.69], "is_terminated": True, "is_truncated": False, **extra}


@pytest.mark.parametrize("episodes, message", [
    ([episode_json(agent_id="a")], "both 'agent_id' and 'module_id'"),
    ([episode_json(agent_id="a", module_id="p"), episode_json()], "single-agent or multi-agent"),
    ([episode_json(agent_id=[1], module_id="p")], "'agent_id' must be"),
    ([episode_json(agent_id="a", module_id=3)], "'module_id' must be"),
    ([episode_json(agent_id="a", module_id="x" * 300)], "'module_id' must be"),
])
def test_bad_multiagent_episodes_are_refused(episodes, message):
    with pytest.raises(rllink.ProtocolError, match=message):
        rllink.decode_request(json.dumps({"type": "EPISODES", "episodes": episodes}).encode())


def test_set_state_with_policies_is_validated():
    ok = rllink.validate({"type": "SET_STATE", "weights_seq_no": 3,
                          "policies": {"p": {"onnx_file": "x", "weights_seq_no": 2, "frozen": True}}})
    assert ok["policies"]["p"]["weights_seq_no"] == 2
    for bad in ({}, {"p": {"onnx_file": 1, "weights_seq_no": 2}}, {"p": {"onnx_file": "x"}},
                {"p": {"onnx_file": "x", "weights_seq_no": 1, "frozen": "yes"}}):
        with pytest.raises(rllink.ProtocolError):
            rllink.validate({"type": "SET_STATE", "weights_seq_no": 3, "policies": bad})


def test_a_chunk_for_an_unknown_policy_closes_only_that_connection():
    _, spec = resolve_env(Relay)
    specs = spec.policy_specs(policy_mapper("shared"))
    store = EpisodeStore(specs)
    hub = Hub(specs, store, 64, on_policy=False, multiagent=True)
    hub.set_state(1, {"shared": {"onnx_file": "x", "weights_seq_no": 1}})
    server = FakeServer()

    def episodes(pid, agent="a"):
        e = Episode(np.zeros(2, np.float32), agent_id=agent)
        e.add_step(1, 1.0, np.zeros(2, np.float32), np.zeros(2, np.float32), -0.7, terminated=True)
        return {"type": "EPISODES_AND_GET_STATE",
                "episodes": MultiAgentBatch({pid: EpisodeBatch.from_episodes([e.finalize()])})}
    hub.handle(server, "good", episodes("shared"))
    hub.handle(server, "bad", episodes("nobody"))
    hub.handle(server, "single", {"type": "EPISODES", "episodes": ma_batch().policies["p1"]})
    assert [c for c, _ in server.dropped] == ["bad", "single"]
    assert "'nobody'" in server.dropped[0][1] and "agent_id and module_id" in server.dropped[1][1]
    assert store.steps_received == 1 + 2 and store.policies["shared"].steps_received == 1
    assert store.steps_dropped == {"does not fit the environment": 2}
    assert [c for c, m in server.replies] == ["good"] and "policies" in server.replies[0][1]


# ---------------------------------------------------------------- the simulator loop

def test_agents_that_leave_and_join_mid_episode_have_balanced_chunks():
    _, spec = resolve_env(Relay)
    sampler = MultiAgentRollout(Relay, spec, policy_mapper("shared"), policies_of(Relay, ["shared"], "a"),
                                num_envs=2, seed=1)
    acted = 0
    for _ in range(40):   # 5 episodes of each env
        acted += sum(len(t) for t in sampler.to_act)
        sampler.step()
    batch = sampler.take().policies["shared"]
    assert batch.num_steps == acted == 2 * 5 * (8 + 5 + 3 + 6)   # a, b, c, d steps per episode
    by_agent = {}
    for i, agent in enumerate(batch.agent_ids):
        by_agent.setdefault(agent, []).append(i)
    ends = {a: (batch.is_terminated[ix].sum(), batch.is_truncated[ix].sum()) for a, ix in by_agent.items()}
    assert ends == {"a": (10, 0), "b": (0, 10), "c": (10, 0), "d": (10, 0)}
    assert sorted(batch.lengths[by_agent["c"]].tolist()) == [3] * 10
    # Each chunk's rewards are its agent's: 1 exactly where the action was the bit shown.
    assert set(batch.rewards.tolist()) <= {0.0, 1.0}


def test_the_policy_map_routes_each_agents_steps_to_its_policy(tmp_path):
    import sys
    import types

    mod = types.ModuleType("ma_map_for_test")
    mod.team = lambda agent: "left" if agent in ("a", "b") else "right"
    sys.modules["ma_map_for_test"] = mod
    for policy_map, expect in (("per-agent", {"a": "a", "b": "b", "c": "c", "d": "d"}),
                               ("ma_map_for_test:team", {"a": "left", "b": "left", "c": "right", "d": "right"})):
        mapper = policy_mapper(policy_map)
        _, spec = resolve_env(Relay)
        pids = sorted(set(expect.values()))
        sampler = MultiAgentRollout(Relay, spec, mapper, policies_of(Relay, pids, "a"), num_envs=1, seed=0)
        for _ in range(12):
            sampler.step()
        batch = sampler.take()
        assert sorted(batch.policies) == pids
        for pid, sub in batch.policies.items():
            assert {expect[a] for a in sub.agent_ids} == {pid}


def test_turn_based_rewards_at_the_end_go_to_both_players():
    sampler = MultiAgentRollout(FirstWins, resolve_env(FirstWins)[1], policy_mapper("shared"),
                                policies_of(FirstWins, ["shared"], "p0"), num_envs=3, seed=0)
    for _ in range(2 * 4):
        sampler.step()
    batch = sampler.take().policies["shared"]
    assert set(batch.lengths.tolist()) == {1} and batch.is_terminated.all()
    rewards = dict(zip(batch.agent_ids, batch.rewards.tolist()))
    assert rewards == {"p0": 1.0, "p1": -1.0}
    assert set(batch.actions.tolist()) <= {1, 2}   # the mask: action 0 never played


def test_self_play_evaluation_counts_wins():
    model = model_for(FirstWins, "p0")
    # The policy takes both seats in turn: it wins exactly the games it moves first in.
    assert play(FirstWins, model, "random", episodes=40)["win_rate"] == 0.5
    assert play(FirstWins, model, model, episodes=40)["loss_rate"] == 0.5
    assert play(FirstWins, model, "self", episodes=10)["win_rate"] == 1.0   # seat 0 against seat 1


def test_the_league_keeps_the_last_snapshots_frozen():
    _, spec = resolve_env(FirstWins)
    specs = spec.policy_specs(policy_mapper("shared"))
    cfg = resolve_config(Config(env=FirstWins, hidden=16), spec)
    net = policy_net(cfg, specs["shared"])
    learner = Serving([], Config(env_steps_per_sample=64, train_batch_size=64, league=2, league_every=1), specs,
                      {"shared": net.template}, {"shared": net.initial_weights(0)}, multiagent=True)
    try:
        for update in range(1, 5):
            learner.publish({"shared": net.initial_weights(update)}, update=update)
        learner.poll(0.0)
        policies = learner.hub.state_msg["policies"]
        assert sorted(policies) == ["shared", "shared@4", "shared@5"]
        assert policies["shared@4"]["frozen"] and not policies["shared"].get("frozen")
        ps = PolicySet()
        ps.update(policies)
        assert ps.snapshots_of("shared") == ["shared@4", "shared@5"]
    finally:
        learner.stop()


# ---------------------------------------------------------------- training

def test_a_parallel_env_trains_per_agent_policies_and_resumes(tmp_path, capsys, no_shm_leftovers,
                                                              no_sim_leftovers):
    summary = shmrl.train(env=Relay, policy_map="per-agent", sims=1, envs_per_sim=2, max_env_steps=6000,
                          train_batch_size=1000, minibatch_size=250, hidden=16, lr=3e-3, logdir=str(tmp_path),
                          log_every=0, verbose=True)
    # The progress lines fit 100 columns: each agent's and policy's return go on the detail lines.
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("update ", "   "))]
    assert lines and max(map(len, lines)) <= 100, "\n".join(lines)
    assert all(" | won " in line for line in lines if line.startswith("update ") and "no episode" not in line)
    assert any("policy a=" in line for line in lines) and any(" d=" in line for line in lines)
    assert summary["exit_status"] == 1 and summary["error"] is None
    n = summary["env_steps"]
    assert n == summary["env_steps_trained"] + summary["env_steps_pending"] + sum(
        summary["env_steps_dropped"].values())
    assert sorted(summary["return_by_policy"]) == ["a", "b", "c", "d"]
    assert sorted(summary["return_by_agent"]) == ["a", "b", "c", "d"]
    # Guessing the bit shown is learnt: 'a' plays 8 steps an episode, 4 at random.
    assert summary["return_by_agent"]["a"] > 5.0
    assert sorted(p.name for p in tmp_path.glob("policy-*.onnx")) == [f"policy-{a}.onnx" for a in "abcd"]
    again = shmrl.train(env=Relay, policy_map="per-agent", sims=1, envs_per_sim=2, max_env_steps=8000,
                        train_batch_size=1000, minibatch_size=250, hidden=16, lr=3e-3, logdir=str(tmp_path),
                        resume=str(tmp_path))
    assert again["resumed_from"] and again["env_steps"] >= 8000
    assert again["weights_seq_no"] > summary["weights_seq_no"]
    assert again["return_by_agent"]["a"] > 5.0


def test_the_external_client_trains_two_agents_over_json(start_run, tmp_path):
    """The JSON path of the README's example: chunks with agent_id and module_id from a
    client that imports nothing of shmrl, SET_STATE with one model per policy."""
    logdir = tmp_path / "logs"
    run, _ = run_beside_example_client(start_run, tmp_path, "pair", "--env", "examples.external_client:pair_spaces",
                                       "--policy-map", "per-agent", "--stop-return", 6.5, "--max-env-steps", 60_000,
                                       "--train-batch-size", 1000, "--env-steps-per-sample", 500, "--lr", 3e-3,
                                       "--logdir", logdir)
    summary = summary_of(logdir)
    assert run.proc.returncode == 0, run.output()    # random play earns 5 (left) and 2.5 (right)
    assert summary["env_steps_dropped"] == {} and summary["bad_frames"] == 0, summary
    assert summary["return_by_agent"]["left"] > 7 and summary["return_by_agent"]["right"] > 3.5
    assert sorted(summary["return_by_policy"]) == ["left", "right"]


def test_a_league_snapshot_plays_one_seat_and_its_steps_are_not_sent():
    _, spec = resolve_env(FirstWins)
    model = model_for(FirstWins, "p0")
    policies = PolicySet()
    policies.update({"shared": {"onnx_file": encode_onnx_file(model), "weights_seq_no": 7},
                     "shared@3": {"onnx_file": encode_onnx_file(model), "weights_seq_no": 3, "frozen": True}})
    sampler = MultiAgentRollout(FirstWins, spec, policy_mapper("shared"), policies, num_envs=4, seed=0,
                                league_prob=1.0)
    for _ in range(2 * 5):
        sampler.step()
    games = list(sampler.games)
    assert len(games) == 4 * 5
    for assigned, _ in games:   # every game: one seat the snapshot, the other the learner
        assert sorted(assigned.values()) == ["shared", "shared@3"]
    batch = sampler.take()
    assert sorted(batch.policies) == ["shared"] and batch.policies["shared"].num_steps == 4 * 5
    assert set(batch.policies["shared"].weights_seq_no.tolist()) == {7}


@pytest.mark.parametrize("args, message", [
    (["--policy-map", "no_such_module_xyz:fn"], "cannot load fn from no_such_module_xyz"),
    (["--policy-map", "sideways"], "shared, per-agent or package.module:fn"),
    (["--league", "-1"], "--league must be >= 0"),
])
def test_bad_multiagent_flags_are_one_line_errors(args, message):
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-m", "shmrl.run", "--env", "pz:connect_four_v3", *args],
                          capture_output=True, text=True, timeout=60, cwd=Path(__file__).parent.parent)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and message in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_snapshot_dropped_from_the_league_plays_out_its_episodes():
    model = encode_onnx_file(model_for(FirstWins, "p0"))
    ps = PolicySet()
    ps.update({"shared": {"onnx_file": model, "weights_seq_no": 5},
               "shared@3": {"onnx_file": model, "weights_seq_no": 3, "frozen": True}})
    ps.update({"shared": {"onnx_file": model, "weights_seq_no": 6},
               "shared@6": {"onnx_file": model, "weights_seq_no": 6, "frozen": True}})
    assert ps.snapshots_of("shared") == ["shared@6"]        # no new episode picks shared@3
    ps.prune({"shared", "shared@3"})                         # an episode still plays it
    assert "shared@3" in ps.models and "shared@3" in ps.frozen
    ps.prune({"shared"})
    assert sorted(ps.models) == ["shared", "shared@6"]


def test_eval_cli_plays_against_random_and_against_a_run_folder(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "policy-shared.onnx").write_bytes(model_for("pz:connect_four_v3", "player_0", seed=1))
    (tmp_path / "me.onnx").write_bytes(model_for("pz:connect_four_v3", "player_0", seed=2))
    for opponent in ("random", str(tmp_path / "run")):
        proc = subprocess.run([sys.executable, "-m", "shmrl.eval", str(tmp_path / "me.onnx"), "--env",
                               "pz:connect_four_v3", "--opponent", opponent, "--episodes", "20", "--json"],
                              capture_output=True, text=True, timeout=60, cwd=Path(__file__).parent.parent)
        assert proc.returncode == 0, proc.stderr
        r = json.loads(proc.stdout)
        assert r["episodes"] == 20 and abs(r["win_rate"] + r["draw_rate"] + r["loss_rate"] - 1) < 1e-9


@pytest.mark.parametrize("server_env, sim_env, message", [
    ("pz:connect_four_v3", "CartPole-v1", "CartPole-v1 is single-agent"),
    ("CartPole-v1", "pz:connect_four_v3", "a single-agent policy cannot play"),
])
def test_a_simulator_whose_env_does_not_fit_the_run_says_so(start_run, tmp_path, server_env, sim_env, message):
    import subprocess
    import sys

    run = start_run("--sims", 0, "--tcp-port", 0, "--env", server_env, "--logdir", tmp_path / "logs")
    port = run.tcp_port()
    proc = subprocess.run([sys.executable, "-m", "shmrl.sim", "--connect", f"127.0.0.1:{port}", "--env", sim_env],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


NAN_PAIR = '''
import math

import numpy as np
from gymnasium import spaces
from pettingzoo import ParallelEnv


class NanPair(ParallelEnv):
    """Two agents; at the third step agent 'b' gets a NaN reward."""
    metadata = {"name": "nan_pair"}
    possible_agents = ["a", "b"]

    def observation_space(self, agent):
        return spaces.Box(-1.0, 1.0, (2,), np.float32)

    def action_space(self, agent):
        return spaces.Discrete(2)

    def reset(self, seed=None, options=None):
        self.t, self.agents = 0, list(self.possible_agents)
        return {a: np.zeros(2, np.float32) for a in self.agents}, {a: {} for a in self.agents}

    def step(self, actions):
        self.t += 1
        rewards = {a: math.nan if (a == "b" and self.t == 3) else 1.0 for a in actions}
        done = {a: self.t >= 10 for a in actions}
        return ({a: np.zeros(2, np.float32) for a in actions}, rewards, done,
                {a: False for a in actions}, {a: {} for a in actions})
'''


def test_a_multiagent_envs_nan_ends_the_run_with_one_line_naming_it(start_run, tmp_path):
    """The multi-agent loop checks its chunks as the single-agent one does: the env's NaN is
    named by the simulator and in the run's one error line, not dropped as a bad chunk."""
    (tmp_path / "broken_ma.py").write_text(NAN_PAIR)   # the run's working directory: importable
    run = start_run("--env", "broken_ma:NanPair", "--sims", 1, "--max-env-steps", 4096,
                    "--env-steps-per-sample", 64, "--max-restarts", 0, "--logdir", tmp_path / "logs")
    run.proc.wait(timeout=90)
    out = run.output()
    assert run.proc.returncode == 3, out[-3000:]
    assert "returned a reward that is not finite (nan)" in out, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error: simulator")]
    assert len(errors) == 1, out[-3000:]
    assert "stopped: its env returned an observation or reward that is not finite" in errors[0], out[-3000:]
    summary = summary_of(tmp_path / "logs")
    assert "not finite" in summary["error"] and summary["env_steps"] == 0
