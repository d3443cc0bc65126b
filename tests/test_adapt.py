"""Learning per env step (shmrl/trainer/learn_per_step.py): the slow profile a run switches to when its
simulators are slow (and not when they are fast, nor over a flag given), the ladder of
levels, the policy that picks one from the learner's busy share, the KL bound that stops
an update, and that a run turns it on for a slow simulator (a throttled one,
tools/slow_sim.py) and keeps it off for a fast one."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import check_books, metrics_rows, summary_of
from shmrl.trainer.learn_per_step import LearnPerStep, ladder, simulators_slow
from shmrl.server.store import SWITCHED

REPO = Path(__file__).resolve().parents[1]


def test_each_level_doubles_the_gradient_steps_minibatch_first_then_epochs():
    levels = ladder(10, 256, 2048)
    assert levels == [(10, 256), (10, 128), (10, 64), (20, 64), (40, 64)]
    steps = [epochs * 2048 // mb for epochs, mb in levels]
    assert all(b == 2 * a for a, b in zip(steps, steps[1:]))
    assert ladder(4, 512, 256)[:2] == [(4, 512), (4, 128)]   # a minibatch above the batch is the batch


def policy(mode="auto", async_sampling=False):
    return LearnPerStep(mode, epochs=10, minibatch_size=256, batch_size=2048, target_kl=0.02,
                        async_sampling=async_sampling)


def feed(learning, shares):
    """Updates whose log periods (1 s each) had these busy shares; the level after each."""
    levels = []
    for share in shares:
        learning.observe(share, 1.0)
        levels.append(learning.level)
    return levels


def idle_updates(learning, share_at_0, n=40, epochs_run=None):
    """``n`` updates whose busy share is ``share_at_0`` at level 0 and doubles per level."""
    for _ in range(n):
        learning.observe(share_at_0 * 2 ** learning.level, 1.0, epochs_run)


def test_an_idle_learner_climbs_and_a_busy_one_stays_at_the_preset():
    idle = policy()
    assert idle.plan() == {"epochs": 10, "minibatch_size": 256, "target_kl": None}   # level 0: the preset's
    idle_updates(idle, 0.02)   # one level per window while the shares allow and the KL bound leaves room
    assert idle.level == 3   # 0.02 * 2**3 = 0.16 <= 0.2 (sync's target); one more would be 0.32
    assert idle.plan() == {"epochs": 20, "minibatch_size": 64, "target_kl": 0.02}
    # A fast simulator's learner (CartPole: 20-40% busy, jumping) never leaves level 0.
    busy = policy()
    assert set(feed(busy, [0.2, 0.45, 0.19, 0.3, 0.25, 0.11, 0.35] * 5)) == {0}
    # With --async an idle learner's time is free: the target is higher.
    free = policy(async_sampling=True)
    idle_updates(free, 0.1)
    assert free.level == 2


def test_a_level_the_kl_bound_cuts_short_gives_way():
    """An update the KL bound stops before it has taken the gradient steps of the level
    beneath gains nothing from the smaller minibatches: the level comes down; one that it
    merely trims is kept, but not climbed past."""
    learning = policy()
    idle_updates(learning, 0.02, n=12)
    assert learning.level == 2   # (10, 64): 10 epochs of 64-step minibatches
    # 4 of its 10 epochs at 64 steps < level 1's 10 at 128: no more learning than there
    idle_updates(learning, 0.02, n=6, epochs_run=4.0)
    assert learning.level == 1
    trimmed = policy()
    idle_updates(trimmed, 0.02, n=12)
    idle_updates(trimmed, 0.02, n=30, epochs_run=8.0)   # 8 epochs at 64 > 10 at 128: kept, not climbed
    assert trimmed.level == 2


def test_the_window_decides_not_one_update_and_a_busy_window_comes_down():
    learning = policy()
    feed(learning, [0.05, 0.05, 0.05, 0.05, 0.5, 0.05])
    assert learning.level == 0   # the window's share: 0.14, too much for sync's target
    # Batches in bursts (external clients sending at once): each burst's updates back to
    # back, then a long wait; each period's share jumps, the window's is what counts.
    bursty = policy(async_sampling=True)
    for _ in range(8):
        for busy, wall in ((0.1, 8.0), (0.1, 0.1), (0.1, 0.1), (0.1, 0.1)):
            bursty.observe(busy * 2 ** bursty.level, wall)
    assert bursty.level >= 2
    learning = policy(mode="auto")
    idle_updates(learning, 0.02)
    top = learning.level
    feed(learning, [0.6] * 6)   # the median: the learner is busy at this level
    assert learning.level < top


def test_the_flag_forces_a_level():
    on, off = policy("on"), policy("off")
    assert on.level == 4 and feed(on, [0.9] * 10)[-1] == 4
    assert off.level == 0 and feed(off, [0.01] * 10)[-1] == 0
    with pytest.raises(ValueError, match="auto, off, on"):
        policy("sometimes")


def test_many_epochs_stop_at_the_kl_bound():
    """With a target KL an update of many epochs stops early, and moves the policy less;
    without, it runs every epoch."""
    from shmrl.config.settings import PPOSettings, with_defaults
    from shmrl.envs.make import env_spec
    from shmrl.core.episode import EpisodeBatch
    from test_ppo import bandit_chunks
    from shmrl.model.net import PolicyNet
    from shmrl.model.ppo import PPO

    chunks = bandit_chunks()
    results = {}
    for target in (None, 0.005):
        ppo = PPO(PolicyNet(env_spec("CartPole-v1"), 64, "ReLU"), with_defaults(PPOSettings, lr=3e-3), seed=0)
        batch = ppo.make_batch(EpisodeBatch.from_episodes(chunks))
        results[target] = ppo.update(batch, epochs=10, minibatch_size=64, target_kl=target)
    assert results[None]["epochs_run"] == 10
    assert 0 < results[0.005]["epochs_run"] < 10
    assert results[0.005]["approx_kl"] < results[None]["approx_kl"]
    assert results[0.005]["clip_frac"] < results[None]["clip_frac"]


def run_shmrl(tmp_path, *args, steps_per_s=None, timeout=120, name="run") -> list[dict]:
    """``python -m shmrl.run`` with the repository on the path, for tools.slow_sim (and a throttle); its
    metrics rows."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    if steps_per_s:
        env["SLOW_SIM_STEPS_PER_S"] = str(steps_per_s)
    logdir = tmp_path / name
    proc = subprocess.Popen([sys.executable, "-m", "shmrl.run", "--logdir", logdir, "--log-every", "0", *args],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode in (0, 1), out[-3000:]
    assert "learner " in out and "%" in out   # the progress line shows the busy share
    (logdir / "out.txt").write_text(out)
    return metrics_rows(logdir)


def test_a_slow_simulator_gets_more_learning_per_env_step(tmp_path, no_shm_leftovers):
    # 500 env steps/s in all; an update of one epoch costs little next to a batch's 0.5 s
    rows = run_shmrl(tmp_path, "--env", "tools.slow_sim:cart_pole", "--sims", "2", "--train-batch-size", "256",
                     "--epochs", "1", "--max-env-steps", "4000", "--stop-return", "inf", steps_per_s=250)
    assert all(0 <= r["learner_share"] <= 1 for r in rows)
    assert max(r["learn_level"] for r in rows) > 0, [(r["learner_share"], r["learn_level"]) for r in rows]
    raised = [r for r in rows if r["learn_level"] > 0]
    assert all(r["epochs_run"] > 0 and r["approx_kl"] < 0.5 for r in raised)
    assert 0 < summary_of(tmp_path / "run")["learner_share"] < 0.5


def test_a_fast_simulator_keeps_the_preset(tmp_path, no_shm_leftovers):
    rows = run_shmrl(tmp_path, "--env", "CartPole-v1", "--max-env-steps", "60000")
    assert {r["learn_level"] for r in rows} == {0}, [(r["learner_share"], r["learn_level"]) for r in rows]
    assert {r["epochs_run"] for r in rows} == {4}   # the preset's
    assert summary_of(tmp_path / "run")["profile"]["name"] == "preset"   # CartPole has no slow profile


def test_the_throttle_holds_a_process_to_its_rate(monkeypatch):
    from tools import slow_sim

    monkeypatch.setenv(slow_sim.RATE_VAR, "200")
    monkeypatch.setattr(slow_sim, "_pace", None)
    env = slow_sim.cart_pole()
    env.reset(seed=0)
    import time

    start = time.perf_counter()
    for _ in range(40):
        if any(env.step(env.action_space.sample())[2:4]):
            env.reset()
    took = time.perf_counter() - start
    assert 40 / 200 * 0.9 <= took < 40 / 200 * 3, took


@pytest.mark.slow   # about 30 s on an idle machine: both trainers, throttled, at once
@pytest.mark.skipif(not Path("~/.cache/shmrl/zoo-venv/bin/python").expanduser().exists(),
                    reason="no rl-zoo3 virtualenv: `python tools/zoo.py --setup` makes it")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="--at-once pins each trainer to a core: needs 2")
@pytest.mark.parametrize("algo, env", [("ppo", "InvertedPendulum-v5"), ("sac", "Pendulum-v1")])
def test_the_slow_simulator_benchmark_runs_both_trainers_and_plots_them(tmp_path, no_shm_leftovers, algo, env):
    pytest.importorskip("mujoco", reason="the mujoco extra is not installed (the test extra has it)")
    out = tmp_path / "curves.png"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "slow_sims.py"), "--quick", "--json", "--at-once",
                           "--algo", algo, "--plot", str(out)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    (run,) = result["envs"][env]["runs"]
    assert run["sb3"]["command"].startswith(f"python -m rl_zoo3.train --algo {algo}")
    # --at-once: each on its own core, at the same time
    assert result["at_once"] and run["sb3"]["core"] != run["shmrl"]["core"]
    (sb3_start, sb3_end), (shmrl_start, shmrl_end) = run["sb3"]["span"], run["shmrl"]["span"]
    assert sb3_start < shmrl_end and shmrl_start < sb3_end
    for who in ("shmrl", "sb3"):
        # SAC's quick run: 1500 env steps, each a gradient step (in 180 s at the most)
        assert run[who]["curve"] and run[who]["env_steps"] >= (2000 if algo == "ppo" else 1000), who
        # throttled: neither samples faster than the rate (a little slack for the rate's clock)
        steps = [p["env_steps"] for p in run[who]["curve"]]
        assert steps == sorted(steps)
    learner = run["shmrl"]["learner"]
    assert 0 <= learner["learner_share_median"] <= 1 and learner["algo"] == algo
    assert learner["approx_kl_max"] < 1 if algo == "ppo" else learner["grad_steps"] > 0
    assert out.read_bytes().startswith(b"\x89PNG")


# ---------------------------------------------------------------- the slow profile

def test_every_slow_table_changes_only_what_a_switch_may_change():
    from shmrl.trainer.learn_per_step import SLOW_SETTINGS
    from shmrl.config.presets import all_tables

    slow = all_tables()["slow"]
    tables = [*slow["family"].values(), *slow["env"].values()]
    assert tables and all(set(t) <= SLOW_SETTINGS for t in tables)
    assert not SLOW_SETTINGS & {"sims", "envs_per_sim", "env_steps_per_sample", "max_env_steps", "transport"}


def test_the_slow_profile_keeps_what_is_given_and_sizes_messages_for_both():
    from shmrl.trainer.learn_per_step import slow_config
    from shmrl.config.settings import Config, resolve_config
    from shmrl.envs.make import env_spec

    spec = env_spec("gym:MountainCarContinuous-v0")   # the continuous family: its slow table
    config = resolve_config(Config(env="gym:MountainCarContinuous-v0", sims=4), spec)
    fast, slow, sources = slow_config(config, spec, set())
    assert sources == ["slow.family.continuous"]
    assert (fast.hidden, slow.hidden, slow.log_std_init, slow.train_batch_size) == (64, 256, -2.0, 512)
    assert fast.env_steps_per_sample == slow.env_steps_per_sample == 128   # the smaller batch's share
    _, given, _ = slow_config(config, spec, {"hidden", "env_steps_per_sample"})
    assert (given.hidden, given.epochs, given.env_steps_per_sample) == (64, 10, 512)
    cartpole = resolve_config(Config(env="CartPole-v1"), env_spec("CartPole-v1"))
    assert slow_config(cartpole, env_spec("CartPole-v1"), set())[1] is None   # no slow table


def test_slow_is_below_the_rate_and_says_so():
    slow, line = simulators_slow(870.4, 3000.0)
    assert slow and "870 env steps/s < --slow-rate 3000" in line
    fast, line = simulators_slow(12000.0, 3000.0)
    assert not fast and "fast (12000" in line


def test_chunks_of_the_profile_before_are_dropped_not_trained():
    from shmrl.core.episode import EpisodeBatch
    from shmrl.server.store import EpisodeStore
    from test_ppo import bandit_chunks

    store = EpisodeStore()
    for seq in (1, 2):
        chunks = bandit_chunks(n=4)
        for chunk in chunks:
            chunk.weights_seq_no = seq
        store.add("c", {"default": EpisodeBatch.from_episodes(chunks)})
    taken = store.take(version=2, min_seq=2)["default"]
    assert {int(s) for b in taken for s in b.weights_seq_no} == {2}
    assert store.steps_dropped[SWITCHED] == sum(b.num_steps for b in taken)


def slow_mountain_car(tmp_path, *flags, name="run", steps_per_s=500):
    """A continuous env of the family's slow table on 2 simulators at ``steps_per_s`` each."""
    rows = run_shmrl(tmp_path, "--env", "tools.slow_sim:mountain_car", "--sims", "2", "--max-env-steps", "4096",
                     "--stop-return", "inf", *flags, steps_per_s=steps_per_s, name=name)
    return rows, summary_of(tmp_path / name), (tmp_path / name / "out.txt").read_text()


def test_a_slow_simulator_switches_to_the_slow_profile(tmp_path, no_shm_leftovers):
    rows, summary, out = slow_mountain_car(tmp_path)   # 1000 env steps/s in all
    profile = summary["profile"]
    assert profile["name"] == "slow" and profile["sim_rate"] < 3000, profile
    assert "simulators slow (" in out
    assert (summary["config"]["hidden"], summary["config"]["train_batch_size"]) == (256, 512)
    assert not summary["config"]["async_sampling"]   # the family's preset samples on; its slow profile waits
    assert {r["epochs_run"] for r in rows if r["learn_level"] == 0} == {10}   # the slow table's
    assert all(r["batch_steps"] <= 2 * 512 for r in rows)
    # the first batch, sampled by the preset's network, was dropped: counted, never trained
    assert summary["env_steps_dropped"][SWITCHED] >= 2048
    check_books(summary, tmp_path / "run")
    # the policy published last is the slow profile's: its 256x256 layer alone is 256 KiB of floats
    assert (tmp_path / "run" / "policy.onnx").stat().st_size > 4 * 256 * 256


@pytest.mark.slow   # over 10 s: trains to a target or runs a whole tool
def test_a_flag_given_wins_over_the_slow_profile_and_off_never_switches(tmp_path, no_shm_leftovers):
    _, summary, _ = slow_mountain_car(tmp_path, "--hidden", "32", "--epochs", "3", name="given")
    assert summary["profile"]["name"] == "slow"
    assert (summary["config"]["hidden"], summary["config"]["epochs"], summary["config"]["log_std_init"]) == (32, 3, -2.0)
    _, summary, out = slow_mountain_car(tmp_path, "--learn-per-step", "off", name="off")
    assert summary["profile"]["name"] == "preset" and "simulators" not in out
    assert summary["config"]["hidden"] == 64 and SWITCHED not in summary["env_steps_dropped"]


def test_on_takes_the_slow_profile_from_the_start(tmp_path, no_shm_leftovers):
    _, summary, _ = slow_mountain_car(tmp_path, "--learn-per-step", "on", "--max-env-steps", "1500", "--hidden", "32",
                                      steps_per_s=2000)
    assert summary["profile"] == {"name": "slow", "why": "--learn-per-step on", "tables": ["slow.family.continuous"]}
    assert (summary["config"]["hidden"], summary["config"]["log_std_init"]) == (32, -2.0)
    assert SWITCHED not in summary["env_steps_dropped"]


def test_a_fast_simulator_keeps_the_preset_profile_and_ppo(tmp_path, no_shm_leftovers):
    # Unthrottled MountainCar delivers thousands of env steps/s on a quiet machine, a few
    # hundred at a load of 20 (its simulators at nice 19): the bar is low for a loaded test machine.
    # A budget of several batches: unthrottled simulators sampling on (--async) may deliver
    # 4096 env steps before the learner's first update, and the run would end with none.
    # --algo auto: the same one measurement keeps PPO too.
    rows, summary, out = slow_mountain_car(tmp_path, "--slow-rate", "100", "--max-env-steps", "16384",
                                           "--algo", "auto", steps_per_s=None)
    assert summary["profile"]["name"] == "preset" and summary["profile"]["sim_rate"] >= 100, summary["profile"]
    assert "simulators fast (" in out
    assert summary["config"]["hidden"] == 64 and SWITCHED not in summary["env_steps_dropped"]
    assert summary["config"]["algo"] == "ppo"
    assert summary["profile"]["algo"] == "--algo auto: PPO, the simulators are fast"
    assert rows[0]["batch_steps"] >= 2048   # the preset's batch from the first update
    assert "pi_loss" in rows[0] and "q_mean" not in rows[0]


# ---------------------------------------------------------------- --algo auto

def test_auto_on_slow_simulators_trains_sac_from_the_measuring_batch_and_resumes_as_sac(tmp_path, no_shm_leftovers):
    flags = ("--algo", "auto", "--hidden", "32", "--learning-starts", "1000", "--buffer-size", "20000")
    rows, summary, out = slow_mountain_car(tmp_path, *flags)   # 1000 env steps/s in all, 4096 of them
    profile = summary["profile"]
    assert profile["name"] == "sac" and profile["sim_rate"] < 2000 and "--algo auto" in profile["why"], profile
    assert "--algo auto trains SAC" in out
    config = summary["config"]
    assert config["algo"] == "sac" and config["hidden"] == 32                    # the flag given, kept
    assert (config["normalize_obs"], config["normalize_reward"], config["log_std_init"]) == (False, False, 0.0)
    # PPO's first batch (its preset's 2048 env steps) went into SAC's buffer, where it
    # counted toward the warm-up: nothing dropped, SAC's first update already trains.
    assert SWITCHED not in summary["env_steps_dropped"]
    assert rows[0]["buffer_steps"] > 2048 and rows[0]["grad_steps"] > 0 and "q_mean" in rows[0]
    check_books(summary)   # trained: the updates' batches and the measuring one, which has no row of its own
    measured = summary["env_steps_trained"] - sum(r["batch_steps"] for r in rows)
    assert measured >= 2048 and rows[0]["buffer_steps"] == measured + rows[0]["batch_steps"]
    before = rows[-1]["grad_steps"]
    rows = run_shmrl(tmp_path, "--resume", tmp_path / "run", "--algo", "auto", "--max-env-steps", "6000",
                     "--stop-return", "inf", steps_per_s=500)   # auto: the checkpoint's algorithm
    assert summary_of(tmp_path / "run")["config"]["algo"] == "sac" and rows[-1]["grad_steps"] > before


def test_auto_takes_sacs_presets_under_the_flags_given_and_keeps_the_runs_shape():
    from shmrl.config.settings import Config
    from shmrl.server.store import DEFAULT_POLICY
    from shmrl.trainer.setup import set_up

    setup = set_up(Config(env="Pendulum-v1", algo="auto", lr=0.01, sims=2, tensorboard=False, plot=False))
    ppo, sac = setup.config, setup.sac.config
    assert (ppo.algo, sac.algo) == ("ppo", "sac") and "PPO's preset until the first batch" in setup.profile["algo"]
    assert ppo.lr == sac.lr == 0.01                                     # given: both keep it
    assert (ppo.hidden, sac.hidden, sac.learning_starts) == (64, 256, 100)   # each its own presets
    assert (sac.max_env_steps, sac.stop_return, sac.sims) == (ppo.max_env_steps, ppo.stop_return, 2)
    assert ppo.env_steps_per_sample == sac.env_steps_per_sample == 32  # SAC's Pendulum batch of 64, shared
    assert setup.ring_nets()[DEFAULT_POLICY] is setup.sac.nets[DEFAULT_POLICY]   # the rings carry the larger


@pytest.mark.parametrize("env, fields, says", [
    ("CartPole-v1", {}, "SAC takes one Box of floats"),
    ("Pendulum-v1", {"normalize_reward": True}, "--normalize-reward"),
    ("Pendulum-v1", {"memory": "lstm"}, "no recurrent core"),
])
def test_auto_keeps_ppo_where_sac_cannot_train(env, fields, says):
    from shmrl.config.settings import Config
    from shmrl.trainer.setup import set_up

    setup = set_up(Config(env=env, algo="auto", tensorboard=False, plot=False, **fields))
    assert setup.config.algo == "ppo" and setup.sac is None
    assert setup.profile["algo"].startswith("--algo auto: PPO (") and says in setup.profile["algo"], setup.profile


def test_the_delivery_rate_leaves_each_clients_start_up_out(monkeypatch):
    """Two clients: one whose first message came after a slow start and then one a second
    (100 steps/s from then on), one that has sent a single message since its PING."""
    from conftest import FakeServer
    from shmrl.server import hub as hub_module
    from shmrl import rllink
    from shmrl.envs.make import env_spec
    from shmrl.server.hub import Hub
    from shmrl.server.store import DEFAULT_POLICY, EpisodeStore
    from test_flood import one_step_chunks

    now = [0.0]
    monkeypatch.setattr(hub_module.time, "monotonic", lambda: now[0])
    hub, server = Hub({DEFAULT_POLICY: env_spec("CartPole-v1")}, EpisodeStore(), 100, on_policy=False), FakeServer()

    def send(conn_id, at, steps):
        now[0] = at
        hub.handle(server, conn_id, rllink.validate({"type": "EPISODES", "episodes": one_step_chunks(1, steps)},
                                                    "request"))

    hub.handle(server, "a", {"type": "PING"})
    send("a", 5.0, 100)     # 5 s of start up: not counted
    send("a", 6.0, 100)
    send("a", 7.0, 100)
    hub.handle(server, "b", {"type": "PING"})   # at 7 s
    send("b", 9.0, 50)      # one message: 50 steps in the 2 s since its PING
    now[0] = 9.0
    assert hub.delivery_rate() == pytest.approx(100 + 25)
