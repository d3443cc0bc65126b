"""Faults: simulators killed or hung, a learner interrupted and resumed, too little shared
memory, and the accounting of every env step through all of it."""
import errno
import json
import os
import re
import signal
import time
from pathlib import Path

import multiprocess
import numpy as np
import pytest

from conftest import (all_gone, alive, check_books, descendants, make_episode, metrics_rows, process_name,
                      process_state, read_to_eof, serve_until, shm_entries, summary_of, wait_until)
from shmrl.config.settings import Config
from shmrl.envs.make import env_spec
from shmrl.core.episode import EpisodeBatch
from shmrl.server.serving import Serving
from shmrl.server.store import DEFAULT_POLICY
from shmrl.model.net import PolicyNet
from shmrl.launch.supervisor import Supervisor
from shmrl.transport.shm import ShmClient, ShmServer

fork = multiprocess.get_context("fork")


def sims_of(run) -> dict[str, int]:
    """Simulator process name -> pid, for a run's live simulators."""
    return {name: pid for pid in descendants(run.proc.pid)
            if (name := process_name(pid)).startswith("shmrl-sim") and alive(pid)}


def wait_for_new_sim(run, name: str, old_pid: int, timeout: float = 10.0) -> int:
    def restarted():
        pid = sims_of(run).get(name)
        return pid if pid and pid != old_pid else None
    try:
        return wait_until(restarted, timeout, f"{name} restarted")
    except AssertionError as e:
        raise AssertionError(f"{e}; output:\n{run.output()[-5000:]}") from None


def kill_while_sampling(pid: int, timeout: float = 5.0) -> None:
    """SIGKILL ``pid`` at a moment it is runnable (stepping its envs), not asleep waiting
    for its reply: then it dies holding steps it has not sent."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process_state(pid) not in ("running", ""):
        time.sleep(0.001)
    os.kill(pid, signal.SIGKILL)


def test_a_killed_simulator_is_noticed_restarted_and_training_finishes(start_run, tmp_path):
    logdir = tmp_path / "logs"
    run = start_run("--sims", 3, "--stop-return", 150, "--max-env-steps", 200_000, "--logdir", logdir)
    run.wait_for("update    2 |", timeout=60)
    victim = sims_of(run)["shmrl-sim1"]
    t_kill = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    run.wait_for(f"(pid {victim}) was killed by SIGKILL", timeout=5)
    assert time.monotonic() - t_kill < 1.0                      # noticed within a second
    wait_for_new_sim(run, "shmrl-sim1", victim)
    run.proc.wait(timeout=120)
    assert run.proc.returncode == 0, run.output()               # and the run still solves
    summary = summary_of(logdir)
    assert summary["simulator_restarts"] == 1 and summary["return_mean"] >= 150
    check_books(summary, logdir)
    assert shm_entries(run.proc.pid) == [] and descendants(run.proc.pid) == []


def test_simulators_killed_mid_frame_never_yield_a_torn_frame(start_run, tmp_path):
    """Asynchronous simulators with long messages spend much of their time sampling and
    writing frames: kill them while they run, one slot after another. Whatever they were
    writing is never decoded (no connection is closed for a bad frame), their unsent steps
    are counted as lost, and the books still balance."""
    logdir = tmp_path / "logs"
    # No budget that could run out while the kills go on (a run that ends stops its
    # simulators, and a pid picked a moment before is gone): the test ends the run itself.
    run = start_run("--sims", 4, "--async", "--stop-return", 1e9, "--max-env-steps", 10**9,
                    "--env-steps-per-sample", 2048, "--logdir", logdir)
    run.wait_for("update    2 |", timeout=60)
    rng = np.random.default_rng(0)
    for k in range(6):
        name = f"shmrl-sim{k % 4}"
        pid = sims_of(run)[name]
        time.sleep(rng.uniform(0.05, 0.3))
        kill_while_sampling(pid)
        wait_for_new_sim(run, name, pid)
    last_update = int(re.findall(r"update +(\d+) \|", run.output())[-1])
    run.wait_for(f"update {last_update + 2:4d} |", timeout=60)
    os.killpg(run.proc.pid, signal.SIGINT)                      # trains on after the kills; then Ctrl-C
    run.proc.wait(timeout=60)
    out = run.output()
    assert run.proc.returncode == 130, out                      # interrupted, not a failure
    assert not re.search(r"crc|torn|stale record|ProtocolError|not valid", out), out
    summary = summary_of(logdir)
    assert summary["simulator_restarts"] == 6
    assert summary["env_steps_lost"] > 0                        # they died holding unsent steps
    check_books(summary, logdir)


def test_a_hung_simulator_is_found_by_its_heartbeat_and_restarted(start_run, tmp_path):
    logdir = tmp_path / "logs"
    # Simulators at the learner's priority: on a loaded machine the default --sim-nice 19
    # could keep a healthy one from stepping for the short --hang-timeout this test uses.
    # No step budget that could run out first: the test ends the run itself.
    run = start_run("--sims", 3, "--async", "--hang-timeout", 2, "--sim-nice", 0, "--stop-return", 1e9,
                    "--max-env-steps", 10**9, "--logdir", logdir)
    run.wait_for("update    2 |", timeout=60)
    victim = sims_of(run)["shmrl-sim2"]
    os.kill(victim, signal.SIGSTOP)                             # its env makes no more progress
    run.wait_for(f"simulator shmrl-sim2 (pid {victim}) hung: no env step for", timeout=10)
    wait_for_new_sim(run, "shmrl-sim2", victim)
    assert not alive(victim)                                    # the hung one is gone for good
    last_update = int(re.findall(r"update +(\d+) \|", run.output())[-1])
    run.wait_for(f"update {last_update + 2:4d} |", timeout=60)   # trains on; then Ctrl-C
    os.killpg(run.proc.pid, signal.SIGINT)
    run.proc.wait(timeout=60)
    assert run.proc.returncode == 130, run.output()
    summary = summary_of(logdir)
    # The victim's restart, and only startup graces besides: on a loaded machine a simulator
    # may take longer than this test's short grace (3 s) to make its first env step, and be
    # replaced then (seen beside two busy loops); a running simulator is never taken for hung.
    restarts = [line for line in run.output().splitlines() if line.endswith("restarting it")]
    assert summary["simulator_restarts"] == len(restarts) >= 1, run.output()
    others = [line for line in restarts if f"(pid {victim})" not in line]
    assert all("before its first env step" in line for line in others), run.output()
    check_books(summary, logdir)


def test_time_a_simulator_waits_for_a_cpu_is_not_taken_for_a_hang(monkeypatch):
    """On a machine busy with other work, a low-priority simulator may be runnable and not
    run for seconds: only the time it could have run without stepping counts as hung."""
    from types import SimpleNamespace

    import shmrl.launch.supervisor as supervisor

    shm = SimpleNamespace(env_steps=lambda i: 7, client_pid=lambda i: 4321, request_unread=lambda i: False)
    launcher = SimpleNamespace(remote=False, exit_reason=lambda proc: None)
    sup = Supervisor(["shm:slot"], env="CartPole-v1", seed=0, shm_server=shm, hang_timeout=1.0,
                     launcher=launcher)
    sim = sup.sims[0]
    sim.proc, sim.steps_seen, sim.progress_at, sim.waited_at = object(), 7, 100.0, 2.0
    serving = SimpleNamespace(held=lambda conn_id: False)
    asked = []

    def waited(pid):
        asked.append(pid)
        return wait_now

    monkeypatch.setattr(supervisor, "run_queue_wait_s", waited)
    wait_now = 6.5          # 5 s without a step, 4.5 of them waiting for a CPU: 0.5 s it could run
    assert sup._trouble(sim, serving, now=105.0) is None
    wait_now = 6.8          # 6 s without a step, 4.8 waiting: 1.2 s it could run, past the timeout
    why = sup._trouble(sim, serving, now=106.0)
    assert why.startswith("hung: no env step for 6.0 s, 4.8 s of them waiting for a CPU"), why
    assert asked == [4321, 4321]        # the slot's own client process
    # Without schedstat (or waiting for nothing) every second counts, as before.
    monkeypatch.setattr(supervisor, "run_queue_wait_s", lambda pid: 2.0)
    assert sup._trouble(sim, serving, now=101.5).startswith("hung: no env step for 1.5 s")


def test_run_queue_wait_is_read_for_a_live_process_and_zero_for_none():
    from shmrl.launch.supervisor import run_queue_wait_s

    def waited_ns() -> int:         # the kernel's own count: schedstat's second field
        with open(f"/proc/{os.getpid()}/schedstat") as f:
            return int(f.read().split()[1])

    if not os.path.exists(f"/proc/{os.getpid()}/schedstat"):
        pytest.skip("this kernel has no /proc/PID/schedstat")
    before = waited_ns()
    seconds = run_queue_wait_s(os.getpid())
    assert before / 1e9 <= seconds <= waited_ns() / 1e9, (before, seconds)
    assert run_queue_wait_s(None) == 0.0 and run_queue_wait_s(2 ** 22 + 12345) == 0.0   # no such process


def test_a_simulator_that_keeps_dying_fails_the_run(start_run):
    run = start_run("--sims", 2, "--stop-return", 1e9, "--max-env-steps", 10_000_000,
                    "--max-restarts", 2, "--restart-window", 45)  # the defaults: 5 within 60 s
    run.wait_for("update    1 |", timeout=60)
    pid = sims_of(run)["shmrl-sim0"]
    for _ in range(2):                                          # two restarts are allowed...
        os.kill(pid, signal.SIGKILL)
        pid = wait_for_new_sim(run, "shmrl-sim0", pid)
    os.kill(pid, signal.SIGKILL)                                # ...the third failure is not
    run.proc.wait(timeout=30)
    assert run.proc.returncode == 3, run.output()
    assert "shmrl-sim0" in run.output() and "failed 3 times within 45 s" in run.output()
    assert shm_entries(run.proc.pid) == [] and descendants(run.proc.pid) == []


def sends_60_of_100(address: str) -> None:
    client = ShmClient(address)
    client.heartbeat(100)                                       # stepped 100...
    client.send({"type": "EPISODES", "episodes": [make_episode(60, seed=1).to_rllink()],
                 "timesteps": 60})                              # ...sent 60, then dies
    os._exit(9)


def test_supervisor_counts_the_steps_a_dead_simulator_never_sent(no_shm_leftovers):
    server = ShmServer(1)
    learner = supervisor = None
    try:
        supervisor = Supervisor([f"shm:{server.address(0)}"], env="CartPole-v1", seed=0, shm_server=server)
        net = PolicyNet(env_spec("CartPole-v1"), 64)
        learner = Serving([server], Config(env_steps_per_sample=64, train_batch_size=10_000),
                          {DEFAULT_POLICY: net.spec}, {DEFAULT_POLICY: net.template},
                          {DEFAULT_POLICY: net.initial_weights(0)})
        doomed = fork.Process(target=sends_60_of_100, args=(server.address(0),), name="doomed")
        doomed.start()
        doomed.join(10)
        supervisor.sims[0].proc = doomed                        # as if the supervisor had started it
        supervisor.check(learner)
        assert learner.store.steps_received == 60               # its whole frame still counts
        assert learner.store.steps_lost == 40 and supervisor.restarts == 1
        replacement = supervisor.sims[0].proc
        assert replacement is not doomed and replacement.is_alive()
        serve_until(learner, lambda: learner.store.steps_received > 60, 20,   # the new simulator works the reset slot
                    "steps from the replacement simulator")
    finally:
        if supervisor:
            supervisor.stop()
        if learner:
            learner.stop()
        server.close()


@pytest.mark.slow   # over 10 s: trains to a target or runs a whole tool
def test_sigterm_writes_a_checkpoint_and_resume_goes_on_from_it(start_run, tmp_path):
    logdir = tmp_path / "logs"
    first = start_run("--sims", 4, "--seed", 3, "--stop-return", 1e9, "--max-env-steps", 10_000_000,
                      "--logdir", logdir)
    first.wait_for("update    4 |", timeout=60)
    family = descendants(first.proc.pid)
    first.proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    first.proc.wait(timeout=10)
    all_gone(family, 3 - (time.monotonic() - t0), "the run and its simulators to end")   # all of it, in 3 s
    assert first.proc.returncode == 143, first.output()
    assert shm_entries(first.proc.pid) == []
    stopped = summary_of(logdir)
    checkpoint = json.loads((logdir / "checkpoints" / f"{stopped['updates']:06d}" / "state.json").read_text())
    assert checkpoint["weights_seq_no"] == stopped["weights_seq_no"]
    assert checkpoint["counters"]["steps_received"] == stopped["env_steps"]
    assert checkpoint["counters"]["steps_trained"] == stopped["env_steps_trained"]
    check_books(stopped, logdir)                         # a batch taken but not trained is not "trained"

    second = start_run("--resume", logdir, "--stop-return", 150)    # same run, a reachable target
    second.proc.wait(timeout=120)
    assert second.proc.returncode == 0, second.output()
    assert f"resuming from {logdir}/checkpoints/{stopped['updates']:06d}" in second.output()
    assert f"update {stopped['updates'] + 1:4d} |" in second.output()   # the numbering goes on
    resumed = summary_of(logdir)
    assert resumed["solved"] and resumed["return_mean"] >= 150
    assert resumed["env_steps"] > stopped["env_steps"] and resumed["weights_seq_no"] > stopped["weights_seq_no"]
    assert resumed["config"]["seed"] == 3 and resumed["config"]["stop_return"] == 150
    check_books(resumed, logdir)
    rows = metrics_rows(logdir)
    updates = [r["update"] for r in rows]                       # one file, both runs, in order
    assert updates[0] == 1 and updates[-1] == resumed["updates"] and stopped["updates"] + 1 in updates
    assert all(a["update"] < b["update"] and a["env_steps"] < b["env_steps"]    # counts go on, never restart
               and a["weights_seq_no"] < b["weights_seq_no"] for a, b in zip(rows, rows[1:]))


def test_too_little_shared_memory_is_a_clear_error_at_start(monkeypatch, capsys, tmp_path, no_shm_leftovers):
    from shmrl.transport import ring

    monkeypatch.setattr(ring, "shm_free_bytes", lambda path=ring.SHM_DIR: 3 << 20)   # a 3 MiB /dev/shm
    err = failed_run_stderr(tmp_path, capsys)
    assert re.search(r"shared memory: [\d.]+ MiB needed in /dev/shm but only 3\.0 MiB free", err), err


def failed_run_stderr(tmp_path, capsys) -> str:
    """What `python -m shmrl.run --sims 8` prints when it ends at start for want of shared
    memory: the message names the size and how to raise it, exit status 3, no traceback."""
    from shmrl import run

    sigterm = signal.getsignal(signal.SIGTERM)
    sigint = signal.getsignal(signal.SIGINT)
    try:
        status = run.main(["--sims", "8", "--logdir", str(tmp_path / "logs")])
    finally:  # run.main sets both handlers: give pytest its own back
        signal.signal(signal.SIGTERM, sigterm)
        signal.signal(signal.SIGINT, sigint)
    err = capsys.readouterr().err
    assert status == 3, err
    assert "--shm-size=" in err and "Traceback" not in err
    return err


def test_a_simulator_that_cannot_be_started_leaves_stop_working():
    class Refused(fork.Process):
        def start(self):
            raise OSError("fork refused")

    class RefusingContext:
        Process = Refused

    supervisor = Supervisor(["shm:nowhere0", "shm:nowhere1"], env="CartPole-v1", seed=0)
    supervisor.launcher._ctx = RefusingContext()
    with pytest.raises(OSError):
        supervisor.start_all()
    assert [sim.proc for sim in supervisor.sims] == [None, None]
    supervisor.stop()  # nothing was started, so nothing to join (was: AssertionError)


def test_a_checkpoint_restores_weights_optimizer_and_rng_exactly(tmp_path):
    """What --resume rests on: PPO's state through checkpoint.save and load (npz + JSON)
    into a fresh PPO of another seed makes the next update the same one."""
    from shmrl.files import checkpoint
    from shmrl.config.settings import PPOSettings, with_defaults
    from shmrl.model.ppo import PPO

    net = PolicyNet(env_spec("CartPole-v1"), 64, normalize_obs=True)

    def chunks(seed):
        return EpisodeBatch.from_episodes([make_episode(48, seed + k).finalize() for k in range(4)])

    config = with_defaults(PPOSettings, epochs=2, minibatch_size=64)
    first = PPO(net, config, seed=1)
    first.update(first.make_batch(chunks(0)))                  # Adam's moments and step count are not zero
    arrays, values = first.get_state()
    checkpoint.save(tmp_path, 1, arrays, {"ppo": values})
    loaded, state = checkpoint.load(checkpoint.latest(tmp_path))
    second = PPO(net, config, seed=2)
    second.set_state(loaded, state["ppo"])
    for name, a in first.published_weights().items():            # observation statistics included
        np.testing.assert_array_equal(a, second.published_weights()[name])
    stats = [ppo.update(ppo.make_batch(chunks(10))) for ppo in (first, second)]  # minibatch order: the rng
    assert stats[0] == pytest.approx(stats[1], rel=1e-6, abs=1e-7)
    after = [ppo.get_state()[0] for ppo in (first, second)]
    for name in ("params", "exp_avg", "exp_avg_sq"):
        np.testing.assert_allclose(after[0][name], after[1][name], rtol=1e-6, atol=1e-8)


def test_dev_shm_filling_up_after_the_check_is_the_same_clear_error_never_a_sigbus(monkeypatch, capsys, tmp_path,
                                                                                   no_shm_leftovers):
    """The free-space check can pass and /dev/shm still fill up before the segments are made
    (another run starting beside this one). Every segment's pages are reserved when it is
    created (posix_fallocate), so that is an error at start, never a SIGBUS when a page is
    first touched; the segments made before it are unlinked."""

    real, calls = os.posix_fallocate, []

    def full_after_two(fd, offset, length):
        calls.append(length)
        if len(calls) > 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", full_after_two)
    err = failed_run_stderr(tmp_path, capsys)
    assert len(calls) == 3
    assert re.search(r"shared memory: [\d.]+ MiB needed in /dev/shm but only [\d.]+ MiB free", err), err


# ---------------------------------------------------------------- access

# Every module that reads a transport's bytes, a checkpoint or a recording.
WIRE_MODULES = ["rllink/*.py", "core/*.py", "transport/*.py", "onnxio/*.py", "client/*.py", "server/**/*.py",
                "files/checkpoint.py", "files/dataset.py", "trainer/resume.py", "sim.py"]


def test_no_pickle_on_any_wire(net, caplog, tmp_path):
    """Nothing that reads a transport's bytes or a checkpoint can unpickle: no such module
    imports a pickle-like deserializer, numpy loads refuse pickles, and a pickled message
    (one that would run code if unpickled, among them) is refused by the decoders that every
    transport uses, and over TCP closes its connection."""
    import ast
    import pickle

    from shmrl import rllink

    root = Path(__file__).resolve().parent.parent / "shmrl"
    paths = sorted({p for pattern in WIRE_MODULES for p in root.glob(pattern)})
    assert len(paths) > 30
    for path in paths:
        name = path.relative_to(root)
        tree = ast.parse(path.read_text())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not imported & {"pickle", "_pickle", "cPickle", "dill", "marshal", "shelve", "cloudpickle",
                               "multiprocess", "multiprocessing", "joblib"}, (name, imported)
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            if ast.unparse(call.func) in ("np.load", "numpy.load"):
                assert "allow_pickle=False" in ast.unparse(call), (name, ast.unparse(call))
    assert "rllink.decode_request" in (root / "transport/tcp.py").read_text()   # the decoders checked below
    assert "rllink.decode_request" in (root / "transport/shm.py").read_text()

    class Trap:
        def __reduce__(self):
            return os.mkdir, (str(tmp_path / "unpickled"),)

    bodies = [pickle.dumps({"type": "PING"}, protocol=p) for p in range(pickle.HIGHEST_PROTOCOL + 1)]
    bodies.append(pickle.dumps({"type": "PING", "x": Trap()}))
    for body in bodies:
        for decode in (rllink.decode_request, rllink.decode_reply):
            with pytest.raises(rllink.ProtocolError):
                decode(body)
    server = net.server()
    net.hub(server)
    for body in bodies[-2:]:
        s = net.raw(server)
        s.sendall(b"%08d" % len(body) + body)
        assert read_to_eof(s) == b""
    assert not (tmp_path / "unpickled").exists()
    assert server.frames_rejected == 2 and "neither a JSON object nor binary" in caplog.text


def test_tcp_listens_on_loopback_unless_told_otherwise(start_run):
    """The learner's TCP port (--tcp-port, and --transport tcp for local simulators) is
    reachable from this machine only, unless --tcp-host says otherwise."""
    from shmrl.config.settings import Config
    from shmrl.run import parse_args
    from shmrl.transport.tcp import TcpServer

    assert parse_args(["--sims", "0", "--tcp-port", "0"]).tcp_host == Config().tcp_host == "127.0.0.1"
    with TcpServer(port=0) as server:                           # the class's own default too
        assert server.address[0] == "127.0.0.1"
    run = start_run("--sims", 0, "--tcp-port", 0, "--stop-return", 1e9)
    run.wait_for("listening for RLlink clients on", timeout=30)  # printed from the bound socket's address
    assert re.search(r"listening for RLlink clients on 127\.0\.0\.1:\d+\n", run.output()), run.output()


def open_files_limit(soft: int, hard: int):
    """A preexec_fn that starts a run with this RLIMIT_NOFILE."""
    def preexec():
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return preexec


def test_sims_beyond_the_open_files_limit_are_refused_in_one_line(start_run, tmp_path):
    """Each local simulator costs the learner a few open files: a --sims that the hard
    limit cannot hold is refused at start, naming the limit, instead of failing later with
    one traceback per simulator."""
    from shmrl.launch.supervisor import FILES_OF_THE_LEARNER, FILES_PER_SIM

    need = FILES_OF_THE_LEARNER + FILES_PER_SIM * 16
    run = start_run("--sims", 16, "--logdir", tmp_path / "logs", preexec_fn=open_files_limit(need - 8, need - 8))
    run.proc.wait(timeout=60)
    out = run.output()
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert run.proc.returncode == 2 and "Traceback" not in out, out[-3000:]
    assert len(errors) == 1 and f"--sims 16 needs about {need} open files" in errors[0], out[-3000:]
    assert f"limit of {need - 8} (RLIMIT_NOFILE" in errors[0] and "use at most --sims 14" in errors[0]
    assert not list(tmp_path.glob("shmrl-sim*"))


def test_a_low_soft_open_files_limit_is_raised_to_the_hard_one(start_run, tmp_path):
    from shmrl.launch.supervisor import FILES_OF_THE_LEARNER, FILES_PER_SIM

    soft = FILES_OF_THE_LEARNER + FILES_PER_SIM   # room for one simulator, not for two
    run = start_run("--sims", 2, "--max-env-steps", 2048, "--train-batch-size", 1024, "--logdir", tmp_path / "logs",
                    preexec_fn=open_files_limit(soft, 4096))
    run.proc.wait(timeout=120)
    out = run.output()
    assert run.proc.returncode == 1 and "Traceback" not in out, out[-3000:]   # the step budget ran out
    assert f"raised the limit of open files from {soft} to 4096 for --sims 2" in out, out[-3000:]


def test_a_simulator_is_not_hung_before_its_first_step_within_the_startup_grace(monkeypatch):
    """Many simulators on few CPUs start one after another: before its first env step a
    simulator gets --hang-timeout times the simulators per CPU, after it --hang-timeout."""
    from types import SimpleNamespace

    import shmrl.launch.supervisor as supervisor

    monkeypatch.setattr(supervisor.os, "sched_getaffinity", lambda pid: {0, 1})
    steps, unread = {"now": 0}, {"now": False}
    shm = SimpleNamespace(env_steps=lambda i: steps["now"], client_pid=lambda i: None,
                          request_unread=lambda i: unread["now"])
    launcher = SimpleNamespace(remote=False, exit_reason=lambda proc: None)
    sup = Supervisor([f"shm:slot{i}" for i in range(8)], env="CartPole-v1", seed=0, shm_server=shm,
                     hang_timeout=1.0, launcher=launcher)
    assert sup.startup_timeout == 4.0                                 # 8 simulators on 2 CPUs
    sim = sup.sims[0]
    sim.proc, sim.progress_at = object(), 100.0
    serving = SimpleNamespace(held=lambda conn_id: False)
    assert sup._trouble(sim, serving, now=103.5) is None               # starting: 3.5 s is within 4
    why = sup._trouble(sim, serving, now=104.5)
    assert why.startswith("hung: no env step for 4.5 s") and "before its first env step" in why, why
    steps["now"] = 5                                                   # it stepped: --hang-timeout from now
    assert sup._trouble(sim, serving, now=105.0) is None
    why = sup._trouble(sim, serving, now=106.5)
    assert why.startswith("hung: no env step for 1.5 s") and "(--hang-timeout 1)" in why, why
    unread["now"] = True    # its request waits in its ring for a learner short of CPU: not its hang
    assert sup._trouble(sim, serving, now=120.0) is None and sup._trouble(sim, serving, now=130.0) is None



def test_the_startup_grace_doubles_for_a_slot_whose_processes_do_not_start_in_time(monkeypatch):
    """A node too busy to start a simulator within the startup grace (a Ray actor's worker
    importing on a loaded machine took 15 s against 4) used to see it replaced every 4 s
    for ever; each replacement before a first sign of work now doubles the slot's grace,
    and the first connection brings it back to the start."""
    from types import SimpleNamespace

    import shmrl.launch.supervisor as supervisor

    monkeypatch.setattr(supervisor.os, "sched_getaffinity", lambda pid: {0, 1})
    started = []
    launcher = SimpleNamespace(remote=True, exit_reason=lambda proc: None, starting=lambda proc: False,
                               kill=lambda proc: None, describe=lambda proc: "simulator s (Ray actor)",
                               start=lambda sim, args: started.append(sim.index) or object())
    connection = {"now": None}
    serving = SimpleNamespace(connection_named=lambda name: connection["now"], timed_out=lambda conn: False,
                              steps_received=lambda conn: 0, refused_in_a_row=lambda conn: (0, None))
    sup = Supervisor(["tcp:a"], env="CartPole-v1", seed=0, hang_timeout=4.0, max_restarts=10,
                     restart_window=1000.0, launcher=launcher)
    clock = {"now": 0.0}
    monkeypatch.setattr(supervisor.time, "monotonic", lambda: clock["now"])
    sup.start_all()
    sim = sup.sims[0]

    def replaced_after(limit: float) -> bool:
        """Whether slot 0 is replaced at ``limit`` s past its process's start, and not before."""
        t0, n = sim.started, len(started)
        clock["now"] = t0 + limit - 0.1
        sup.check(serving)
        kept = len(started) == n
        clock["now"] = t0 + limit + 0.1
        sup.check(serving)
        return kept and len(started) > n and started[-1] == 0

    assert replaced_after(4.0) and replaced_after(8.0) and replaced_after(16.0)
    assert sup._limit(sim) == 32.0 and "a startup grace of 32 s" in sup._limit_says(sim)
    assert "doubled for each of the 3 processes" in sup._limit_says(sim)
    connection["now"] = "tcp:127.0.0.1:5"          # this one connects: its sign of work
    clock["now"] += 1.0
    sup.check(serving)
    assert sim.connected and sim.slow_starts == 0 and sup._limit(sim) == 4.0
    assert sup.recovery_s and sup.failure is None

SLOW_START_ENV = '''
import time

import numpy as np
from gymnasium import spaces


class SlowStart:
    """CartPole-shaped, but making one takes 1.5 s (a game engine loading its level)."""
    observation_space = spaces.Box(-1.0, 1.0, (4,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self):
        time.sleep(1.5)

    def reset(self, seed=None, options=None):
        self.t = 0
        return np.zeros(4, np.float32), {}

    def step(self, action):
        self.t += 1
        return np.zeros(4, np.float32), 1.0, False, self.t >= 20, {}
'''


def test_simulators_slower_to_start_than_the_hang_timeout_are_not_restarted(start_run, tmp_path):
    """Six simulators on one CPU whose env takes longer to make than --hang-timeout: none
    is taken for hung before its first step (they used to be restarted over and over)."""
    pytest.importorskip("gymnasium", reason="the env is a gymnasium-style class")
    (tmp_path / "slow_env.py").write_text(SLOW_START_ENV)   # the run's working directory: importable
    run = start_run("--env", "slow_env:SlowStart", "--sims", 6, "--hang-timeout", 1, "--max-env-steps", 1536,
                    "--train-batch-size", 768, "--sim-nice", 0, "--logdir", tmp_path / "logs",
                    preexec_fn=lambda: os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]}))
    run.proc.wait(timeout=120)
    out = run.output()
    assert run.proc.returncode == 1 and "hung" not in out and "Traceback" not in out, out[-3000:]
    assert summary_of(tmp_path / "logs")["simulator_restarts"] == 0
