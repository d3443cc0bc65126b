"""The simulator processes of a run: started by a launcher, watched, restarted.

A launcher places the processes: ``ForkLauncher`` forks them on this machine (the
default), ``shmrl.launch.ray_actors.RayLauncher`` makes them Ray actors across a cluster. Both
have the same small interface (``start``, ``exit_reason``, ``kill``, ``stop``); the
restart policy and the accounting of lost steps stay here, whichever places them.

``check(serving)`` runs in the learner's serving thread (``Serving(housekeeping=...)``),
the thread that owns the Hub and the transports, so a dead simulator's connection is
closed, its slot reset and a replacement started without a lock around any of them. It
talks to the serving side only through its interface for launchers (``held``,
``connection_named``, ``timed_out``, ``steps_received``, ``refused_in_a_row``, ``close``).

A simulator is replaced when its process exits (a SIGKILL included: seen within one
serving round, about 50 ms) or when it hangs: the env-step count it writes into its
shared-memory slot (its heartbeat) has not grown for ``hang_timeout`` seconds while the
learner was not itself holding it back, not counting the time it waited for a CPU (its
run-queue wait, /proc/PID/schedstat): on a machine busy with other work a simulator at
low priority may not run for seconds, and that is not a hang (nor is a request the learner
has yet to read, nor the time before its first step up to ``hang_timeout`` times the
simulators per CPU: many start one after another); over TCP, its connection (found by the name it
gives in its PING) has been gone that long, closed for missing HEARTBEATs, while its
process lives on. What it stepped but never sent is counted as lost (over TCP by the Hub,
from its last HEARTBEAT). A simulator that keeps failing (``max_restarts`` within
``restart_window`` s) fails the run instead: its environment is broken, and restarting it
forever would hide that. So does one whose every env step is refused for its values (an
env whose rewards are all out of bounds): ``REFUSED_IN_A_ROW`` messages in a row, each
refused whole, and the run fails naming the reason (a run could never fill its budget).
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import deque

from shmrl.config.settings import SIM_EXIT_REASONS, ConfigError

log = logging.getLogger("shmrl.supervisor")

# Files the learner holds open for each local simulator (measured: its segment's mapping,
# its reply FIFO, its process's sentinel and one more pipe), and for itself (its log
# folder, torch, TensorBoard, the TCP port's clients), with room to spare.
FILES_PER_SIM, FILES_OF_THE_LEARNER = 4, 256

# A simulator's messages in a row whose every env step was refused (out of bounds) before
# the run fails: its env gives nothing the run can train on (a few refused now and then
# are the bounds at work, and the run goes on).
REFUSED_IN_A_ROW = 10

# A slot's startup grace doubles with each process replaced before its first sign of work,
# up to 2**4 = 16 times the first (the restart budget ends a slot that never starts).
MAX_GRACE_DOUBLINGS = 4


def make_room_for(sims: int) -> None:
    """Raise this process's soft limit of open files (RLIMIT_NOFILE, often 1024) up to its
    hard limit when ``sims`` local simulators need more; ConfigError, one line naming the
    limit, when even the hard limit is too low (else accept() and os.open fail later, one
    traceback per simulator)."""
    import resource

    need = FILES_OF_THE_LEARNER + FILES_PER_SIM * sims
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise ConfigError(f"--sims {sims} needs about {need} open files in the learner ({FILES_PER_SIM} per "
                          f"simulator), over this process's limit of {hard} (RLIMIT_NOFILE, hard: `ulimit -Hn`); "
                          f"use at most --sims {max(0, (hard - FILES_OF_THE_LEARNER) // FILES_PER_SIM)}, or "
                          f"raise the limit (`ulimit -n {need}` as root, LimitNOFILE= for a systemd service)")
    new = hard if hard != resource.RLIM_INFINITY else need
    resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    log.info("raised the limit of open files from %d to %d for --sims %d", soft, new, sims)


def run_queue_wait_s(pid: int | None) -> float:
    """Seconds process ``pid`` has spent runnable but waiting for a CPU (0.0 when the kernel
    does not say: then every second without a step counts)."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def describe_exit(code: int | None) -> str:
    if code in SIM_EXIT_REASONS:   # the simulator said why it stopped
        return f"{SIM_EXIT_REASONS[code]} (exit code {code})"
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exited with code {code}"


class ForkLauncher:
    """Simulator processes on this machine, forked from a server that has imported only the
    simulator's modules (numpy, onnxruntime): never torch, and a fork costs ms, not the
    hundreds of ms a fresh interpreter would."""

    remote = False  # every process it starts is on this machine: its shm slot is its only way

    def __init__(self):
        self._ctx = None

    def start(self, sim: "_Sim", args: tuple):
        """Start ``sim``'s process with ``sim_process_main(*args)``; returns its handle."""
        if self._ctx is None:
            import multiprocess

            self._ctx = multiprocess.get_context("forkserver")
            transport = sim.address.split(":", 1)[0]
            self._ctx.set_forkserver_preload(["shmrl.client.simulator", f"shmrl.transport.{transport}"])
        from shmrl.client.simulator import sim_process_main

        proc = self._ctx.Process(target=sim_process_main, name=sim.name, daemon=True, args=args)
        proc.start()
        return proc

    def exit_reason(self, proc) -> str | None:
        """Why the process ended, or None while it runs."""
        return None if proc.is_alive() else describe_exit(proc.exitcode)

    def starting(self, proc) -> bool:
        """Whether the process is still being brought up (not yet its own fault if silent)."""
        return False

    def describe(self, proc) -> str:
        return f"simulator {proc.name} (pid {proc.pid})"

    def kill(self, proc) -> None:
        """End a hung process for good."""
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)
        proc.join(0)

    def stop(self, procs: list, timeout: float) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` s."""
        for p in procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(1.0)


class _Sim:
    """One simulator slot and the process that currently fills it."""

    def __init__(self, index: int, address: str, name: str):
        self.index, self.address, self.name = index, address, name
        # The shared-memory server names slot i's connection "shm:i"; over TCP the name is
        # the client's port, unknown here (its connection closes when it dies anyway).
        self.conn_id = f"shm:{index}" if address.startswith("shm:") else None
        self.proc = None
        self.started = 0.0            # time.monotonic() of this process's start
        self.steps_received_before = 0  # steps its connection had delivered before this process
        self.steps_seen = 0           # its heartbeat when last looked at
        self.connected = False        # this process has had a TCP connection (its sign of life there)
        self.progress_at = 0.0        # when the heartbeat last grew (or the learner held it back)
        self.waited_at = 0.0          # its run-queue wait (run_queue_wait_s) at progress_at
        self.tcp_conn: str | None = None  # its TCP connection, when it has one
        self.failed_time: float | None = None  # when its last process failed, until the next one samples
        self.failed_at: deque = deque()  # recent failures, for the restart budget
        self.slow_starts = 0          # its processes replaced in a row before any sign of work


class Supervisor:
    def __init__(self, addresses: list[str], *, env: str, seed: int, envs_per_sim: int = 1,
                 auth_token: str | None = None, shm_server=None, hang_timeout: float = 10.0,
                 max_restarts: int = 5, restart_window: float = 60.0, nice: int = 0, launcher=None):
        self.env, self.seed, self.envs_per_sim, self.auth_token = env, seed, envs_per_sim, auth_token
        self.nice = nice  # simulators run this much below the learner's CPU priority
        self.shm = shm_server  # heartbeats and slot resets; None: processes are only watched
        self.hang_timeout, self.max_restarts, self.restart_window = hang_timeout, max_restarts, restart_window
        # Until its first sign of work a simulator is starting, not hung: many of them on few
        # CPUs start one after another (and the learner answers their handshakes meanwhile),
        # so each may wait far longer than --hang-timeout for its first step.
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.startup_timeout = hang_timeout * max(1.0, len(addresses) / cpus)
        self.launcher = launcher if launcher is not None else ForkLauncher()
        prefix = "shmrl-ray-sim" if self.launcher.remote else "shmrl-sim"
        self.sims = [_Sim(i, a, f"{prefix}{i}") for i, a in enumerate(addresses)]
        self.restarts = 0
        self.recovery_s: list[float] = []  # from each failure to its replacement's first sign of work
        self.failure: str | None = None  # set when a simulator has failed too often
        self._lock = threading.Lock()    # the launcher, serving and main threads all start or stop
        self._stopping = False

    # ------------------------------------------------------------ starting and stopping
    def start_all(self) -> None:
        """One process per simulator, placed by the launcher."""
        for sim in self.sims:
            with self._lock:
                if self._stopping:
                    return
                self._start(sim, steps_received_before=0)

    def start_all_in_background(self) -> threading.Thread:
        """``start_all`` in a thread of its own (the fork server's start-up overlaps the
        learner's import of torch); ``joined`` waits for it."""
        def launch():
            try:
                self.start_all()
            except BaseException as e:  # joined() hands it to the caller's thread
                self._launch_error = e

        self._launch_error = None
        self._launching = threading.Thread(target=launch, name="shmrl-launcher", daemon=True)
        self._launching.start()
        return self._launching

    def joined(self) -> BaseException | None:
        """Wait for ``start_all_in_background`` to finish; returns what it raised, if anything."""
        self._launching.join()
        return self._launch_error

    def _start(self, sim: _Sim, steps_received_before: int) -> None:
        proc = self.launcher.start(sim, (sim.address, self.env, self.seed * 1000 + sim.index, self.envs_per_sim,
                                         sim.name, self.auth_token, self.nice))
        sim.proc = proc  # only once started: stop() stops every sim.proc
        sim.started = sim.progress_at = time.monotonic()
        sim.waited_at = 0.0  # a new process has waited for nothing yet
        sim.steps_received_before, sim.steps_seen, sim.connected = steps_received_before, 0, False

    def stop(self, timeout: float = 2.0) -> None:
        """Stop every simulator (SIGTERM, then SIGKILL after ``timeout`` s) and start no more."""
        with self._lock:
            self._stopping = True
            procs = [sim.proc for sim in self.sims if sim.proc is not None]
        self.launcher.stop(procs, timeout)

    def pids(self) -> list[int]:
        return [sim.proc.pid for sim in self.sims if sim.proc is not None and sim.proc.pid is not None]

    # ------------------------------------------------------------ watching (serving thread)
    def check(self, serving) -> None:
        """Replace every simulator that has exited or hung since the last look."""
        if self._stopping or self.failure:
            return
        now = time.monotonic()
        for sim in self.sims:
            with self._lock:
                if self._stopping or sim.proc is None:
                    continue
                reason = self._trouble(sim, serving, now)
                if reason:
                    self._replace(sim, reason, serving, now)
                elif self._all_refused(sim, serving):
                    return

    def _all_refused(self, sim: _Sim, serving) -> bool:
        """Fail the run (True) when ``sim``'s last ``REFUSED_IN_A_ROW`` messages had every
        env step refused: restarting it would change nothing."""
        conn_id = sim.conn_id if self._on_shm(sim) else sim.tcp_conn
        refused, why = serving.refused_in_a_row(conn_id) if conn_id is not None else (0, None)
        if refused < REFUSED_IN_A_ROW:
            return False
        self.failure = (f"{self.launcher.describe(sim.proc)}: every env step of its last {refused} messages was "
                        f"refused: {why} (counted in env_steps_dropped); its env gives nothing the run can train on")
        return True

    def _on_shm(self, sim: _Sim) -> bool:
        """Whether ``sim`` uses its shared-memory slot (a remote launcher's may use TCP)."""
        return (self.shm is not None and sim.conn_id is not None
                and (not self.launcher.remote or self.shm.client_pid(sim.index) is not None))

    def _trouble(self, sim: _Sim, serving, now: float) -> str | None:
        reason = self.launcher.exit_reason(sim.proc)
        if reason is not None:
            return reason
        if not self._on_shm(sim):
            return self._tcp_trouble(sim, serving, now)
        steps = self.shm.env_steps(sim.index)
        if steps != sim.steps_seen:
            self._back(sim, now)
        pid = self.shm.client_pid(sim.index) or (None if self.launcher.remote else getattr(sim.proc, "pid", None))
        waited = run_queue_wait_s(pid)
        if steps != sim.steps_seen or serving.held(sim.conn_id) or self.shm.request_unread(sim.index):
            # Progress, or held back by the learner (it has yet to read the simulator's request,
            # or it holds the reply back until its next update).
            sim.steps_seen, sim.progress_at, sim.waited_at = steps, now, waited
        elif (now - sim.progress_at) - (waited - sim.waited_at) > self._limit(sim):
            return (f"hung: no env step for {now - sim.progress_at:.1f} s, {waited - sim.waited_at:.1f} s of "
                    f"them waiting for a CPU ({self._limit_says(sim)})")
        return None

    def _limit(self, sim: _Sim) -> float:
        """How long ``sim`` may show no progress: --hang-timeout once its process has shown a
        sign of work (an env step, a TCP connection), the startup grace before. The grace
        doubles with each process of the slot replaced before its first sign of work: on a
        node too busy to start one within the grace (a Ray actor's worker importing on a
        loaded machine), restarting at the same pace would never let one finish starting."""
        if sim.steps_seen or sim.connected:
            return self.hang_timeout
        return self.startup_timeout * 2 ** min(sim.slow_starts, MAX_GRACE_DOUBLINGS)

    def _limit_says(self, sim: _Sim) -> str:
        if sim.steps_seen or sim.connected:
            return f"--hang-timeout {self.hang_timeout:g}"
        doubled = (f", doubled for each of the {sim.slow_starts} processes before it that did not start in time"
                   if sim.slow_starts else "")
        return (f"before its first env step: a startup grace of {self._limit(sim):g} s, --hang-timeout "
                f"{self.hang_timeout:g} times the simulators per CPU{doubled}")

    def _tcp_trouble(self, sim: _Sim, serving, now: float) -> str | None:
        """A TCP simulator's connection closed (the server closes one whose HEARTBEATs stop)
        while its process lives on, or none came within ``hang_timeout`` of its start."""
        conn_id = serving.connection_named(sim.name)
        if sim.tcp_conn is not None and conn_id != sim.tcp_conn:
            closed, sim.tcp_conn = sim.tcp_conn, None   # closed: its time starts now
            sim.progress_at = now
            if serving.timed_out(closed):
                return f"hung: its HEARTBEATs stopped, so the server closed {closed}"
        if sim.tcp_conn is None:
            sim.tcp_conn = conn_id
            if sim.tcp_conn is not None:
                sim.connected = True
                self._back(sim, now)
        if sim.tcp_conn is not None or self.launcher.starting(sim.proc):
            sim.progress_at = now
        elif now - sim.progress_at > self._limit(sim):
            return (f"hung: not connected for {now - sim.progress_at:.1f} s while its process lives "
                    f"({self._limit_says(sim)})")
        return None

    def _back(self, sim: _Sim, now: float) -> None:
        """A replacement shows its first sign of work (an env step, or its TCP connection)."""
        sim.slow_starts = 0
        if sim.failed_time is not None:
            self.recovery_s.append(now - sim.failed_time)
            log.info("simulator %s is back, %.1f s after it failed", sim.name, now - sim.failed_time)
            sim.failed_time = None

    def _replace(self, sim: _Sim, reason: str, serving, now: float) -> None:
        proc = sim.proc
        self.launcher.kill(proc)  # a hung one goes for good
        what = f"{self.launcher.describe(proc)} {reason}"
        lost, on_shm = 0, self._on_shm(sim)
        if on_shm:
            # Whatever it published whole before it died still counts; the rest is lost.
            lost = serving.close(sim.conn_id, what, stepped=self.shm.env_steps(sim.index),
                                 received_before=sim.steps_received_before)
            self.shm.reset(sim.index)
        sim.slow_starts = 0 if sim.steps_seen or sim.connected else sim.slow_starts + 1
        sim.failed_at.append(now)
        while sim.failed_at and now - sim.failed_at[0] > self.restart_window:
            sim.failed_at.popleft()
        if len(sim.failed_at) > self.max_restarts:
            self.failure = (f"{what}; it failed {len(sim.failed_at)} times within {self.restart_window:g} s, "
                            f"so it is not restarted again")
            sim.proc = None
            return
        self.restarts += 1
        if on_shm:
            log.warning("%s; %d env steps it had stepped but not sent are lost; restarting it", what, lost)
        else:  # over TCP the Hub counts them, from its HEARTBEATs, when its connection closes
            log.warning("%s; restarting it", what)
        sim.tcp_conn, sim.failed_time = None, now
        self._start(sim, serving.steps_received(sim.conn_id) if sim.conn_id else 0)
