"""Recording what clients send (--record, python -m shmrl.record), the dataset format,
its export to Minari, and starting from demonstrations (--pretrain)."""
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from conftest import need, wait_until
from shmrl.core import spaces
from shmrl.files.dataset import Dataset, DatasetWriter, manifest_for, space_from_json, space_to_json
from shmrl.envs.spec import EnvSpec
from shmrl.core.episode import Episode, EpisodeBatch
from shmrl.server.recorder import Recorder
from shmrl.server.store import EpisodeStore

IMAGE_SPEC = EnvSpec("test-dict", spaces.Dict((("image", spaces.Box((0,), (255,), (5, 5, 3), "uint8")),
                                              ("vec", spaces.Box((-1.0,), (1.0,), (3,))))),
                     spaces.MultiDiscrete((3, 2)))


def dict_obs(rng):
    return {"image": rng.integers(0, 256, (5, 5, 3), dtype=np.uint8), "vec": rng.normal(size=3).astype(np.float32)}


def play(rng, envs: int, messages: int, per_message: int, with_ids: bool, agent=None):
    """A rollout of ``envs`` envs cut into messages as a simulator cuts them: each message
    holds every env's steps since the last one (an episode that ends starts the next one in
    the same message). Returns the messages (lists of chunks) and the true episodes
    (Episode objects, unfinalized lists) by the bytes of their first image."""
    def new_episode():
        ep = Episode(dict_obs(rng), id=None, agent_id=agent)
        if not with_ids:
            ep.id = None
        truth[ep.obs[0]["image"].tobytes()] = ep_truth = {"obs": [ep.obs[0]], "steps": []}
        return ep, ep_truth

    truth, msgs = {}, []
    current = [new_episode() for _ in range(envs)]
    for _ in range(messages):
        chunks = []
        for _ in range(per_message):
            for k in range(envs):
                ep, ep_truth = current[k]
                obs = dict_obs(rng)
                step = (rng.integers(0, [3, 2]), float(rng.normal()), rng.normal(size=5).astype(np.float32),
                        float(rng.normal()))
                done = rng.random() < 0.08
                terminated, truncated = done and rng.random() < 0.5, False
                truncated = done and not terminated
                ep.add_step(step[0], step[1], obs, step[2], step[3], terminated=terminated, truncated=truncated)
                ep_truth["obs"].append(obs)
                ep_truth["steps"].append(step)
                if done:
                    ep_truth["flags"] = (terminated, truncated)
                    chunks.append(ep.finalize())
                    current[k] = new_episode()
        for k in range(envs):
            ep, ep_truth = current[k]
            following = ep.cut()
            following.id = ep.id   # None stays None: those chunks glue by observation
            chunks.append(ep.finalize())
            current[k] = (following, ep_truth)
        msgs.append(chunks)
    return msgs, truth


def counts(truth: dict) -> tuple[int, int]:
    """(episodes, of which still open at the end): one reset just before the end, with no
    step yet, is not an episode."""
    stepped = [t for t in truth.values() if t["steps"]]
    return len(stepped), sum("flags" not in t for t in stepped)


def check_episode(ep, truth: dict, stopped: bool = False):
    t = truth[ep.obs["image"][0].tobytes()]
    assert len(ep) == len(t["steps"])
    for leaf, dtype in (("image", np.uint8), ("vec", np.float32)):
        assert ep.obs[leaf].dtype == dtype
        np.testing.assert_array_equal(ep.obs[leaf], np.stack([o[leaf] for o in t["obs"]]))
    assert ep.actions.dtype == np.int64 and ep.rewards.dtype == np.float32
    np.testing.assert_array_equal(ep.actions, np.stack([s[0] for s in t["steps"]]))
    np.testing.assert_array_equal(ep.rewards, np.array([s[1] for s in t["steps"]], np.float32))
    np.testing.assert_array_equal(ep.action_dist_inputs, np.stack([s[2] for s in t["steps"]]))
    np.testing.assert_array_equal(ep.action_logp, np.array([s[3] for s in t["steps"]], np.float32))
    assert ep.stopped == stopped
    if not stopped:
        assert (ep.terminated, ep.truncated) == t["flags"]
    else:
        assert ep.truncated and not ep.terminated


def test_a_recording_reads_back_the_episodes_the_store_took_whole(tmp_path):
    """Chunks of two connections (one with episode ids, one glued by observation) and two
    policies, in messages as simulators cut them: every episode reads back with the same
    observations (a uint8 image and a float leaf), actions, rewards, flags and boundaries;
    the episodes still open at the end are there too, marked stopped."""
    rng = np.random.default_rng(0)
    store = EpisodeStore(("a", "b"))
    writer = DatasetWriter(tmp_path / "ds", manifest_for("test-dict", {"a": IMAGE_SPEC, "b": IMAGE_SPEC}))
    store.record(Recorder(writer, flush_every=0.01))
    sent = []
    for conn, pid, with_ids in (("c1", "a", True), ("c2", "b", False)):
        msgs, truth = play(rng, envs=3, messages=12, per_message=5, with_ids=with_ids)
        sent.append((pid, truth))
        for chunks in msgs:
            store.add(conn, {pid: EpisodeBatch.from_episodes(chunks)})
    store.recorder.close()
    dataset = Dataset(tmp_path / "ds")
    assert len(dataset.shards()) >= 2   # flushed as it went
    for pid, truth in sent:
        episodes = list(dataset.episodes(pid))
        assert (len(episodes), sum(ep.stopped for ep in episodes)) == counts(truth)
        for ep in episodes:
            check_episode(ep, truth, stopped=ep.stopped)
        assert sum(len(ep) for ep in episodes) == store.policies[pid].steps_received


def test_a_closed_connection_writes_its_open_episodes_and_the_manifest_round_trips(tmp_path):
    store = EpisodeStore()
    writer = DatasetWriter(tmp_path / "ds", manifest_for("test-dict", {"default": IMAGE_SPEC}))
    store.record(Recorder(writer, flush_every=60))
    msgs, truth = play(np.random.default_rng(1), envs=2, messages=3, per_message=4, with_ids=True)
    for chunks in msgs:
        store.add("c1", {"default": EpisodeBatch.from_episodes(chunks)})
    store.forget("c1")
    store.recorder.close()
    episodes = list(Dataset(tmp_path / "ds").episodes())
    assert (len(episodes), sum(ep.stopped for ep in episodes)) == counts(truth)
    for ep in episodes:
        check_episode(ep, truth, stopped=ep.stopped)
    for space in (IMAGE_SPEC.observation_space, IMAGE_SPEC.action_space, spaces.Discrete(4, 1),
                  spaces.Box((-np.inf,), (np.inf,), (2,)), spaces.Tuple((spaces.MultiBinary(3),))):
        assert space_from_json(json.loads(json.dumps(space_to_json(space)))) == space


def test_a_writer_that_falls_behind_leaves_whole_episodes_out_never_a_hole(tmp_path, caplog):
    """Memory stays bounded: with the writer stuck, messages beyond the bound wait a moment,
    then are left out of the recording with one warning, and so is every episode they had a
    chunk of; what is written is whole."""
    import threading

    store = EpisodeStore()
    writer = DatasetWriter(tmp_path / "ds", manifest_for("test-dict", {"default": IMAGE_SPEC}))
    stuck, write = threading.Event(), writer.write
    writer.write = lambda *a: (stuck.wait(30), write(*a))[1]
    recorder = Recorder(writer, flush_every=0.0, max_queued_steps=40, max_wait=0.01)
    store.record(recorder)
    msgs, truth = play(np.random.default_rng(2), envs=2, messages=30, per_message=5, with_ids=True)
    for chunks in msgs:
        store.add("c1", {"default": EpisodeBatch.from_episodes(chunks)})
    assert recorder.steps_dropped > 0
    assert sum("the recording falls behind" in r.message for r in caplog.records) == 1
    stuck.set()
    recorder.close()
    episodes = list(Dataset(tmp_path / "ds").episodes())
    assert 0 < len(episodes) < counts(truth)[0]
    for ep in episodes:
        check_episode(ep, truth, stopped=ep.stopped)


def test_a_dataset_of_another_env_is_refused_before_anything_starts(tmp_path):
    from shmrl.envs.make import env_spec

    DatasetWriter(tmp_path / "ds", manifest_for("Pendulum-v1", {"default": env_spec("Pendulum-v1")}))
    for flag in ("--record", "--pretrain"):
        done = subprocess.run([sys.executable, "-m", "shmrl.run", "--sims", "1", flag, str(tmp_path / "ds"),
                               "--logdir", str(tmp_path / "run")], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        assert flag in done.stderr and "Pendulum-v1" in done.stderr
        assert not (tmp_path / "run").exists()


def test_a_run_records_minigrid_images_whole_and_they_match_its_counts(start_run, tmp_path):
    """A real run on MiniGrid (uint8 images, a Dict observation with a Text leaf left out):
    every env step it received is in the dataset, as uint8, with the env's shapes."""
    need("minigrid", "minigrid")
    run = start_run("--env", "gym:MiniGrid-Empty-5x5-v0", "--sims", "1", "--max-env-steps", "1500",
                    "--train-batch-size", "500", "--record", tmp_path / "ds", "--logdir", tmp_path / "run")
    assert run.proc.wait(120) == 1   # the step budget
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    dataset = Dataset(tmp_path / "ds")
    episodes = list(dataset.episodes())
    assert sum(len(ep) for ep in episodes) == summary["env_steps"]
    assert all(ep.obs["image"].dtype == np.uint8 and ep.obs["image"].shape[1:] == (7, 7, 3) for ep in episodes)
    assert all(ep.terminated or ep.truncated for ep in episodes)
    assert "mission" not in episodes[0].obs


def test_a_multi_agent_run_records_each_agents_episodes_and_minari_export_refuses_them(start_run, tmp_path):
    need("pettingzoo", "pettingzoo")
    run = start_run("--env", "pz:connect_four_v3", "--sims", "1", "--max-env-steps", "800", "--train-batch-size",
                    "400", "--record", tmp_path / "ds", "--logdir", tmp_path / "run")
    assert run.proc.wait(120) == 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    dataset = Dataset(tmp_path / "ds")
    assert dataset.manifest["agents"] == ["player_0", "player_1"] and list(dataset.policy_spaces) == ["shared"]
    episodes = list(dataset.episodes())
    assert {ep.agent_id for ep in episodes} == {"player_0", "player_1"}
    assert sum(len(ep) for ep in episodes) == summary["env_steps"]
    assert all("action_mask" in ep.obs for ep in episodes)
    done = subprocess.run([sys.executable, "-m", "shmrl.record", "export", str(tmp_path / "ds"), "--minari-id",
                           "x-v0", "--minari-root", str(tmp_path / "minari")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "multi-agent" in done.stderr


def test_recording_survives_kill_9_of_the_learner(start_run, tmp_path):
    """Shards are written whole (temp name, fsync, rename): after kill -9 of the learner in
    the middle of a run, the dataset reads, with the episodes of all but the last seconds."""
    run = start_run("--sims", "2", "--max-env-steps", "10000000", "--stop-return", "inf", "--record",
                    tmp_path / "ds", "--logdir", tmp_path / "run")
    wait_until(lambda: len(Dataset(tmp_path / "ds").shards()) >= 2 if (tmp_path / "ds" / "manifest.json").exists()
               else False, 60, "two shards")
    os.kill(run.proc.pid, signal.SIGKILL)   # the learner only; its simulators see it gone
    run.proc.wait(10)
    (tmp_path / "ds" / ".shard-000099.npz.1.tmp").write_bytes(b"half a shard")   # what a kill mid-write leaves
    dataset = Dataset(tmp_path / "ds")
    episodes = list(dataset.episodes())
    assert len(episodes) > 10 and all(len(ep) == len(ep.rewards) == len(ep.obs) - 1 for ep in episodes)
    assert all(ep.terminated or ep.truncated for ep in episodes)


@pytest.mark.slow   # over 10 s: trains to a target or runs a whole tool
def test_a_dataset_recorded_by_one_run_pretrains_another(tmp_path):
    """A run records; a second one clones its policy from that dataset before PPO and
    says how well the clone fits the held-out episodes."""
    common = [sys.executable, "-m", "shmrl.run", "--sims", "1", "--env-steps-per-sample", "256", "--epochs", "2",
              "--log-every", "0"]
    done = subprocess.run([*common, "--max-env-steps", "3000", "--record", str(tmp_path / "ds"),
                           "--logdir", str(tmp_path / "a")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "recorded" in done.stdout
    done = subprocess.run([*common, "--max-env-steps", "600", "--pretrain", str(tmp_path / "ds"),
                           "--pretrain-steps", "20", "--logdir", str(tmp_path / "b")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("pretrain: policy 'default'"))
    assert "held-out episodes" in line and "action accuracy" in line and "value explained variance" in line
    done = subprocess.run([sys.executable, "-m", "shmrl.run", "--resume", str(tmp_path / "b"), "--max-env-steps",
                           "1200"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr   # it goes on from its checkpoint: no second clone
    assert "resuming from" in done.stdout and "pretrain:" not in done.stdout


def policy_file(tmp_path, env: str):
    from shmrl.envs.make import env_spec
    from shmrl.model.net import PolicyNet

    net = PolicyNet(env_spec(env), 16)
    path = tmp_path / f"{env}.onnx"
    path.write_bytes(net.template.publish(net.initial_weights(0)))
    return path


def test_recording_a_fixed_policy_of_local_simulators_stops_after_its_episodes(tmp_path):
    """--policy is what the simulators play (one weights version throughout); --episodes
    ends it; a policy of another env is refused."""
    record = [sys.executable, "-m", "shmrl.record", "--sims", "1", "--episodes", "5", "--out", str(tmp_path / "ds")]
    done = subprocess.run([*record, "--policy", str(policy_file(tmp_path, "CartPole-v1"))], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    episodes = list(Dataset(tmp_path / "ds").episodes())
    assert len(episodes) == 5 and not any(ep.stopped for ep in episodes)   # exactly those, whole
    assert len({int(s) for ep in episodes for s in ep.weights_seq_no}) == 1
    done = subprocess.run([*record, "--policy", str(policy_file(tmp_path, "Pendulum-v1"))], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("error: --policy")


@pytest.mark.slow   # ~20 s: a recording server, 4 TCP clients, Minari export and load
def test_tcp_clients_recorded_without_training_load_in_minari_and_shmrl(tmp_path):
    """python -m shmrl.record serves two TCP simulators; after Ctrl-C the dataset holds
    their episodes, and its Minari export loads with the env's spaces and the same data."""
    minari = need("minari", "minari")
    import gymnasium as gym

    rec = subprocess.Popen([sys.executable, "-m", "shmrl.record", "--tcp-port", "0", "--out", str(tmp_path / "ds")],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    clients = []
    try:
        line = wait_until(lambda: rec.stdout.readline(), 30, "the recorder's first line")
        while "listening for RLlink clients" not in line:
            line = rec.stdout.readline()
            assert line, "the recorder ended"
        port = line.rsplit(":", 1)[1].strip()
        clients = [subprocess.Popen([sys.executable, "-m", "shmrl.sim", "--connect", f"127.0.0.1:{port}",
                                     "--seed", str(i)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                   for i in range(2)]
        wait_until(lambda: len(Dataset(tmp_path / "ds").shards()) >= 1 if (tmp_path / "ds" / "manifest.json").exists()
                   else False, 60, "a shard")
        rec.send_signal(signal.SIGINT)
        out = rec.communicate(timeout=30)[0]
        assert rec.returncode == 0, out
    finally:
        for p in [rec, *clients]:
            p.kill()
            p.wait(10)
    episodes = list(Dataset(tmp_path / "ds").episodes())
    assert len({ep.source for ep in episodes}) == 2   # both clients
    env = dict(os.environ, MINARI_DATASETS_PATH=str(tmp_path / "minari"))
    done = subprocess.run([sys.executable, "-m", "shmrl.record", "export", str(tmp_path / "ds"), "--minari-id",
                           "shmrl/cartpole-test-v0"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    os.environ["MINARI_DATASETS_PATH"] = str(tmp_path / "minari")
    try:
        loaded = minari.load_dataset("shmrl/cartpole-test-v0")
        cartpole = gym.make("CartPole-v1")
        assert loaded.observation_space == cartpole.observation_space
        assert loaded.action_space == cartpole.action_space
        assert loaded.total_episodes == len(episodes)
        for mine, theirs in zip(episodes, loaded.iterate_episodes()):
            np.testing.assert_array_equal(mine.obs, theirs.observations)
            np.testing.assert_array_equal(mine.actions, theirs.actions)
            np.testing.assert_array_equal(mine.rewards, theirs.rewards)
            assert (bool(theirs.terminations[-1]), bool(theirs.truncations[-1])) == (mine.terminated, mine.truncated)
    finally:
        del os.environ["MINARI_DATASETS_PATH"]


def test_a_recording_restarts_its_simulators_as_a_training_run_does(tmp_path, monkeypatch):
    """python -m shmrl.record runs through the training run's lifecycle: its supervisor
    gets the run's --max-restarts, --restart-window and --hang-timeout, not defaults."""
    from shmrl.config.settings import Config
    from shmrl.launch import supervisor as supervisor_module
    from shmrl.trainer.lifecycle import open_run
    from shmrl.trainer.setup import set_up

    made = {}

    class Recorded:
        def __init__(self, addresses, **settings):
            made.update(settings)

    monkeypatch.setattr(supervisor_module, "Supervisor", Recorded)
    config = Config(env="CartPole-v1", sims=1, transport="tcp", record=str(tmp_path / "ds"), async_sampling=True,
                    max_restarts=2, restart_window=7.0, hang_timeout=3.0, tensorboard=False)
    servers, _ = open_run(set_up(config))
    for server in servers:
        server.close()
    assert (made["max_restarts"], made["restart_window"], made["hang_timeout"]) == (2, 7.0, 3.0)
