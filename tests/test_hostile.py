"""Hostile clients cannot poison the weights nor fake a result (issue 22, items 6-8, 10, 11).

Raw-socket clients speak both codecs (RLlib's JSON frames, shmrl's binary columns) to the
real TcpServer and Hub; each sends values outside the documented bounds and must see its
chunks refused and counted while its connection, and everyone else's, goes on. The PPO and
trainer tests feed a poisoned batch past the Hub: the update is skipped, the weights stay.
"""
import json
import logging
import math

import numpy as np
import pytest

from shmrl import rllink
from shmrl.client.actor import SimulatorError, check_sample
from shmrl.launch.supervisor import describe_exit
from shmrl.config.settings import SIM_EXIT_POLICY_NOT_FINITE, Config, ConfigError, PPOSettings, with_defaults
from shmrl.core.episode import EpisodeBatch
from shmrl.model.net import PolicyNet
from shmrl.model.ppo import PPO
from shmrl.server.serving import Serving
from shmrl.server.store import DEFAULT_POLICY, EpisodeStore
from shmrl.trainer.loop import UpdateCounts, update
from conftest import (SPEC, binary_episodes, binary_frame, conn_id_of, decode_frame, episodes_msg, recv_frame,
                      rllib_frame, wait_until)

CODECS = ["json", "binary"]


def hostile(codec: str, steps: int = 8, seed: int = 3, **columns) -> bytes:
    """An honest EPISODES_AND_GET_STATE of ``steps`` CartPole steps, then each of
    ``columns`` (a field -> fn(its values) -> the hostile values) applied, in ``codec``."""
    if codec == "json":
        msg = episodes_msg(steps, seed)
        for ep in msg["episodes"]:
            for key, fn in columns.items():
                ep[key] = fn(ep[key])
        return rllib_frame(msg)
    msg = binary_episodes(steps, seed)
    batch = msg["episodes"]
    for key, fn in columns.items():
        setattr(batch, key, fn(getattr(batch, key)))
    return binary_frame(msg)


def talk(sock, codec: str, frame: bytes) -> dict:
    """Send ``frame``, get the reply (the connection must still be served)."""
    sock.sendall(frame)
    data = recv_frame(sock)
    return decode_frame(data) if codec == "binary" else json.loads(data[8:])


def open_client(net, server, codec: str):
    s = net.raw(server)
    s.sendall(rllib_frame({"type": "PING", "client_name": "mallory", "codecs": [codec]}
                          if codec == "binary" else {"type": "PING", "client_name": "mallory"}))
    recv_frame(s)
    return s


def refusal_lines(caplog, reason: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and reason in r.getMessage()]


def filled(value: float, keep_sign: bool = False):
    """A column's values replaced by ``value`` (with each one's sign), as a list (JSON) or
    an array (binary) like the one it replaces."""
    def fn(v):
        a = np.asarray(v, np.float32)
        out = (np.sign(a) if keep_sign else np.ones_like(a)) * np.float32(value)
        return out.astype(np.float32).tolist() if isinstance(v, list) else out.astype(a.dtype)
    return fn


ATTACKS = {   # item 6: finite but absurd observations and rewards; item 7: an absurd action_logp
    "observation out of bounds": {"obs": filled(3e38, keep_sign=True)},
    "reward out of bounds": {"rewards": filled(3e38)},
    "action_logp out of bounds": {"action_logp": filled(2.0)},   # a probability of e^2 (discrete actions)
}


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("reason", list(ATTACKS))
def test_absurd_values_are_refused_per_chunk_counted_and_logged_once(net, caplog, codec, reason):
    server = net.server()
    hub = net.hub(server)
    s = open_client(net, server, codec)
    for _ in range(3):
        assert talk(s, codec, hostile(codec, **ATTACKS[reason]))["type"] == "SET_STATE"   # served all along
    assert talk(s, codec, hostile(codec, seed=4))["type"] == "SET_STATE"                 # an honest message
    store = hub.store
    assert store.steps_dropped == {reason: 24}
    assert store.steps_received == 32 and store.pending_steps == 8     # only the honest steps wait
    assert all(np.all(np.abs(b.obs) < 1e6) and np.all(np.abs(b.rewards) < 1e6) and np.all(b.action_logp <= 0)
               for _, b in store.policies[DEFAULT_POLICY].pending)
    lines = refusal_lines(caplog, reason)
    assert len(lines) == 1 and "(mallory)" in lines[0] and conn_id_of(s) in lines[0], lines
    assert hub.closed() == []


def seq_frame(codec: str, claim: int) -> bytes:
    """An honest message whose chunks claim weights version ``claim``."""
    if codec == "json":
        msg = episodes_msg(8, 3)
        for ep in msg["episodes"]:
            ep["weights_seq_no"] = claim
        return rllib_frame(msg)
    msg = binary_episodes(8, 3)
    batch = msg["episodes"]
    batch.weights_seq_no = np.full(batch.num_chunks, claim, np.int64)   # the codec carries no uint64
    return binary_frame(msg)


@pytest.mark.parametrize("codec", CODECS)
def test_a_version_from_the_future_is_refused_never_a_negative_lag(net, caplog, codec):   # item 8
    server = net.server()
    hub = net.hub(server)
    s = open_client(net, server, codec)
    for claim in (2**62, 2**63, 2**64) if codec == "json" else (2**62, 2**63 - 1, 2**62 + 7):
        assert talk(s, codec, seq_frame(codec, claim))["type"] == "SET_STATE"
    assert talk(s, codec, seq_frame(codec, 1))["type"] == "SET_STATE"     # a version it was sent
    store = hub.store
    assert store.steps_dropped == {"weights_seq_no from the future": 24}
    pending = store.policies[DEFAULT_POLICY].pending
    assert len(pending) == 1 and set(pending[0][1].weights_seq_no.tolist()) == {1}   # a lag of >= 0 only
    assert len(refusal_lines(caplog, "weights_seq_no from the future")) == 1
    assert hub.closed() == [] and not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("codec", CODECS)
def test_zero_step_chunks_complete_no_episode(net, codec):   # item 10
    server = net.server()
    hub = net.hub(server)
    s = open_client(net, server, codec)
    obs = [0.01, 0.02, 0.03, 0.04]
    empty = [{"obs": [obs], "actions": [], "action_dist_inputs": [], "action_logp": [], "rewards": [],
              "is_terminated": done == "terminated", "is_truncated": done == "truncated"}
             for done in ("truncated", "terminated") for _ in range(50)]
    msg = {"type": "EPISODES_AND_GET_STATE", "episodes": empty, "timesteps": 0}
    frame = rllib_frame(msg) if codec == "json" else binary_frame(
        {**msg, "episodes": rllink.validate(msg, "request")["episodes"]})
    assert talk(s, codec, frame)["type"] == "SET_STATE"
    store = hub.store
    assert store.episodes_completed == 0 and list(store.returns) == [] and store.steps_received == 0
    # An open episode that a zero-step chunk ends is complete, with the steps it had.
    opened = episodes_msg(3, 5)
    opened["episodes"] = [{**opened["episodes"][0], "is_terminated": False, "is_truncated": False,
                           "episode_id": "e1"}]
    closing = {"type": "EPISODES_AND_GET_STATE", "timesteps": 0, "episodes": [{
        "obs": [opened["episodes"][0]["obs"][-1]], "actions": [], "action_dist_inputs": [], "action_logp": [],
        "rewards": [], "is_terminated": False, "is_truncated": True, "episode_id": "e1"}]}
    for m in (opened, closing):
        talk(s, codec, rllib_frame(m) if codec == "json" else binary_frame(
            {**m, "episodes": rllink.validate(m, "request")["episodes"]}))
    assert list(store.returns) == [3.0] and list(store.lengths) == [3]


@pytest.mark.parametrize("codec", CODECS)
def test_an_impossible_heartbeat_is_ignored_not_counted_as_lost(net, caplog, codec):   # item 11
    server = net.server()
    hub = net.hub(server)
    s = open_client(net, server, codec)
    heartbeat = {"type": "HEARTBEAT", "env_steps": 2**63 - 1}
    s.sendall(rllib_frame(heartbeat) if codec == "json" else binary_frame(heartbeat))
    assert talk(s, codec, hostile(codec))["type"] == "SET_STATE"
    honest = {"type": "HEARTBEAT", "env_steps": 8 + 40}   # 40 stepped, never sent: lost
    s.sendall(rllib_frame(honest) if codec == "json" else binary_frame(honest))
    wait_until(lambda: getattr(hub.hub.connections.get(conn_id_of(s)), "stepped", None) == 48, 5.0, "the honest HEARTBEAT")
    s.close()
    wait_until(lambda: bool(hub.closed()), 5.0, "the connection to close")
    assert hub.store.steps_lost == 40 and hub.store.steps_received == 8
    assert hub.hub.heartbeats_ignored == 1
    assert len(refusal_lines(caplog, "more than it could have stepped")) == 1


# ---------------------------------------------------------------- past the Hub: the update

def cartpole_ppo(**settings) -> PPO:
    return PPO(PolicyNet(SPEC, 16), with_defaults(PPOSettings, epochs=2, minibatch_size=32, **settings), seed=0)


def honest_chunks(steps: int = 64, seed: int = 0) -> EpisodeBatch:
    return rllink.validate(episodes_msg(steps, seed), "request")["episodes"]


def test_a_non_finite_loss_skips_the_update_and_keeps_the_weights():   # item 6, past the Hub
    ppo = cartpole_ppo()
    before = ppo.published_weights()
    adam = (ppo.optimizer.exp_avg.clone(), ppo.optimizer.t)
    poisoned = honest_chunks()
    poisoned.rewards = np.full_like(poisoned.rewards, 3e38)
    result = ppo.update(ppo.make_batch(poisoned))
    assert result == {"skipped": "its loss or gradient was not finite"}
    after = ppo.published_weights()
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert ppo.optimizer.t == adam[1] and bool((ppo.optimizer.exp_avg == adam[0]).all())
    assert "skipped" not in ppo.update(ppo.make_batch(honest_chunks(seed=1)))   # it trains on after


def test_an_absurd_behaviour_logp_cannot_blow_up_the_loss():   # item 7, past the Hub
    ppo = cartpole_ppo()
    chunks = honest_chunks()
    chunks.action_logp = np.full_like(chunks.action_logp, -100.0)
    stats = ppo.update(ppo.make_batch(chunks))
    assert math.isfinite(stats["pi_loss"]) and abs(stats["pi_loss"]) < 10, stats   # today: about 1e8
    assert abs(stats["approx_kl"]) < 1, stats
    assert stats["ratio_out_of_bounds"] == 1.0                        # measured: every step beyond the bound
    assert honest_stats()["ratio_out_of_bounds"] == 0.0


def honest_stats() -> dict:
    ppo = cartpole_ppo()
    return ppo.update(ppo.make_batch(honest_chunks()))


def test_trainer_skips_counts_and_never_publishes_nan():
    ppo = cartpole_ppo()
    serving = Serving([], Config(env_steps_per_sample=64, train_batch_size=64), {DEFAULT_POLICY: SPEC},
                      {DEFAULT_POLICY: ppo.net.template}, {DEFAULT_POLICY: ppo.published_weights()})
    counts = UpdateCounts()
    try:
        model = serving.model_bytes[DEFAULT_POLICY]
        poisoned = honest_chunks()
        serving.store.add("c", {DEFAULT_POLICY: poisoned})
        poisoned.rewards = np.full_like(poisoned.rewards, 3e38)   # as if it got past the Hub
        batches = serving.store.take(serving.weights_seq_no)
        assert update(serving, {DEFAULT_POLICY: ppo}, counts, batches, serving.weights_seq_no) is None
        assert (counts.done, counts.skipped, counts.skipped_in_a_row) == (0, 1, 1)
        assert serving.model_bytes[DEFAULT_POLICY] == model and serving.weights_seq_no == 2   # clients released
        store = serving.store
        assert store.steps_dropped == {"update skipped: loss or gradient not finite": 64}
        assert store.in_flight == 0 and store.steps_received == store.steps_trained + 64
        nan_weights = {k: np.full_like(v, np.nan) for k, v in ppo.published_weights().items()}
        serving.publish({DEFAULT_POLICY: nan_weights})
        assert serving.model_bytes[DEFAULT_POLICY] == model       # never published
        serving.store.add("c", {DEFAULT_POLICY: honest_chunks(seed=2)})
        stats = update(serving, {DEFAULT_POLICY: ppo}, counts, serving.store.take(serving.weights_seq_no),
                       serving.weights_seq_no)
        assert stats["update"] == 1 and counts.skipped_in_a_row == 0
        assert serving.model_bytes[DEFAULT_POLICY] != model
    finally:
        serving.stop()


def test_store_books_balance_after_a_skip():
    store = EpisodeStore()
    store.add("c", {DEFAULT_POLICY: honest_chunks(32)})
    taken = store.take()
    store.skipped({DEFAULT_POLICY: EpisodeBatch.concat(taken[DEFAULT_POLICY])}, "update skipped: x")
    counters = store.counters()
    assert counters["steps_dropped"] == {"update skipped: x": 32} and store.in_flight == 0


# ---------------------------------------------------------------- the env's NaN, a NaN policy, a mask of nothing

BROKEN_ENVS = '''
import math

import numpy as np
from gymnasium import spaces


class NanEnv:
    """CartPole-shaped; its third step's reward is NaN."""
    observation_space = spaces.Box(-1.0, 1.0, (4,), np.float32)
    action_space = spaces.Discrete(2)

    def reset(self, seed=None, options=None):
        self.t = 0
        return np.zeros(4, np.float32), {}

    def step(self, action):
        self.t += 1
        return np.zeros(4, np.float32), math.nan if self.t == 3 else 1.0, False, self.t >= 20, {}


class MaskedOutEnv:
    """Every observation's action_mask forbids all three moves."""
    observation_space = spaces.Dict({"obs": spaces.Box(-1.0, 1.0, (2,), np.float32),
                                     "action_mask": spaces.Box(0, 1, (3,), np.int8)})
    action_space = spaces.Discrete(3)

    def reset(self, seed=None, options=None):
        return {"obs": np.zeros(2, np.float32), "action_mask": np.zeros(3, np.int8)}, {}

    def step(self, action):
        return self.reset()[0], 1.0, False, False, {}
'''


@pytest.mark.parametrize("env, sim_says, run_says", [
    ("NanEnv", "returned a reward that is not finite (nan)",
     "stopped: its env returned an observation or reward that is not finite (NaN or inf) (exit code 10)"),
    ("MaskedOutEnv", "gave an action_mask that forbids every action",
     "stopped: its env's action_mask forbids every action (exit code 12)"),
])
def test_the_runs_error_names_the_envs_nan_or_its_empty_mask(start_run, tmp_path, env, sim_says, run_says):
    pytest.importorskip("gymnasium", reason="the broken envs are gymnasium envs (pip install 'shmrl[gym]')")
    (tmp_path / "broken_envs.py").write_text(BROKEN_ENVS)   # the run's working directory: importable
    run = start_run("--env", f"broken_envs:{env}", "--sims", 1, "--max-env-steps", 4096,
                    "--env-steps-per-sample", 64, "--max-restarts", 0, "--logdir", tmp_path / "logs")
    run.proc.wait(timeout=90)
    out = run.output()
    assert run.proc.returncode == 3, out[-3000:]
    assert sim_says in out, out[-3000:]                                    # the simulator says so
    errors = [line for line in out.splitlines() if line.startswith("error: simulator")]
    assert len(errors) == 1 and run_says in errors[0], out[-3000:]         # and the run's one error line
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert run_says in summary["error"] and summary["env_steps"] == 0


def test_a_nan_policy_is_named_by_the_simulator():
    batch = honest_chunks(16)
    check_sample(batch, "CartPole-v1")                       # honest: nothing to say
    batch.action_dist_inputs = np.full_like(batch.action_dist_inputs, np.nan)
    with pytest.raises(SimulatorError, match="the policy's outputs") as e:
        check_sample(batch, "CartPole-v1")
    assert e.value.exit_code == SIM_EXIT_POLICY_NOT_FINITE
    assert "the policy's outputs are not finite" in describe_exit(SIM_EXIT_POLICY_NOT_FINITE)


def test_nan_first_weights_are_refused_not_served():
    ppo = cartpole_ppo()
    nan_weights = {k: np.full_like(v, np.nan) for k, v in ppo.published_weights().items()}
    with pytest.raises(ConfigError, match="the first weights of policy 'default' are not finite"):
        Serving([], Config(env_steps_per_sample=64, train_batch_size=64), {DEFAULT_POLICY: SPEC},
                {DEFAULT_POLICY: ppo.net.template}, {DEFAULT_POLICY: nan_weights})


def test_refused_steps_do_not_spend_the_step_budget(start_run, tmp_path):   # dropped flood steps
    """Chunks refused as they come in are counted (env_steps, env_steps_dropped) but never
    accepted: a hostile client cannot end a run by sending steps it will not train on."""
    import socket
    import time

    run = start_run("--env", "CartPole-v1", "--sims", 0, "--tcp-port", 0, "--max-env-steps", 128, "--train-batch-size", 64,
                    "--env-steps-per-sample", 64, "--logdir", tmp_path / "logs")
    with socket.create_connection(("127.0.0.1", run.tcp_port()), timeout=60) as s:
        s.settimeout(60)
        s.sendall(rllib_frame({"type": "PING"}))
        recv_frame(s)
        talk(s, "json", hostile("json", steps=64, seed=8))   # answered after update 1: the trainer runs
        for seed in range(4):   # 256 steps refused, twice the budget
            assert talk(s, "json", hostile("json", steps=64, seed=seed, rewards=filled(3e38)))["type"] == "SET_STATE"
        time.sleep(0.5)   # the training loop looks at the budget every 50 ms
        assert run.proc.poll() is None, run.output()[-3000:]
        s.sendall(hostile("json", steps=64, seed=9))   # 64 honest steps more: the budget is spent
        run.proc.wait(timeout=90)
    out = run.output()
    assert run.proc.returncode == 1 and "step budget exhausted" in out, out[-3000:]
    summary = json.loads((tmp_path / "logs" / "summary.json").read_text())
    assert summary["env_steps"] == 384 and summary["env_steps_accepted"] == 128, summary
    assert summary["env_steps_trained"] + summary["env_steps_pending"] == 128
    assert summary["env_steps_dropped"] == {"reward out of bounds": 256}
