"""A run's life, written once for training and for recording (``python -m shmrl.record``):
open the transports and the supervisor of its simulators, serve, start the simulators,
loop, and always stop: whatever happens (Ctrl-C and SIGTERM included) every process it
started is stopped, every segment it made is unlinked and every server closed.

``Run`` holds what every run has (its set-up, servers, supervisor, serving side and
``--record``'s dataset writer) and calls the parts a kind of run fills in:
``take_folders``, ``make_serving``, ``prepare``, ``loop`` and ``end``. The folders a run
writes are taken first, before anything is written or started: a dataset folder (as a
log folder) has one writer at a time. A recording that cannot write fails the run (exit
3), however it ends. ``shmrl.trainer.loop.Training`` is one kind,
``shmrl.trainer.recording.Recording`` the other.
"""
from __future__ import annotations

import contextlib
import signal
import sys
import threading

from shmrl.config.settings import EXIT_FAILED, EXIT_INTERRUPTED, ConfigError
from shmrl.files.checkpoint import CheckpointError
from shmrl.files.logdir import LogdirWriteError
from shmrl.server.recorder import Recorder
from shmrl.server.serving import Serving, open_transports
from shmrl.trainer.setup import Setup, open_recording


HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def signals_held():
    """Ctrl-C and SIGTERM that come during the block take effect as it ends: what the block
    writes (an update's count, its steps trained, its metrics row) is written whole or not
    at all, whatever the moment of the signal. Only the main thread runs signal handlers:
    elsewhere the block holds nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught, before, done = [], {}, []

    def hold(signum, frame):
        if done:   # a signal between the block's end and the handler's return: its own handler
            _handle(signum, before[signum], frame)
        else:
            caught.append(signum)

    try:
        for signum in HELD_SIGNALS:
            if signal.getsignal(signum) is not None:   # None: a handler not set from Python, left as it is
                before[signum] = signal.signal(signum, hold)
        yield
    finally:
        done.append(True)
        for signum, handler in before.items():
            signal.signal(signum, handler)
        if caught:
            _handle(caught[0], before[caught[0]], None)


def _handle(signum: int, handler, frame) -> None:
    """What ``handler`` (as ``signal.signal`` returned it) does with ``signum``."""
    if callable(handler):
        handler(signum, frame)
    elif handler != signal.SIG_IGN:   # the default action (SIGTERM's: the process ends)
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)


class RunFailed(RuntimeError):
    """A part of the run failed (a simulator died, a transport broke)."""


def open_run(setup: Setup, launcher=None, tcp=None) -> tuple[list, object]:
    """The run's servers and the supervisor of its simulators (None without simulators),
    which restarts them as the run's settings say (--max-restarts within
    --restart-window, --hang-timeout). RunFailed when /dev/shm is too small for the rings.
    ``tcp``: its TCP server, already open (a run that waited for a client's spaces)."""
    from shmrl.launch.supervisor import Supervisor, make_room_for
    from shmrl.transport.ring import ShmSpaceError

    config = setup.config
    if config.sims and not (launcher is not None and launcher.remote):
        make_room_for(config.sims)
    try:
        servers, addresses, shm = open_transports(config, setup.spec, setup.ring_nets(), launcher, tcp)
    except ShmSpaceError as e:
        raise RunFailed(str(e)) from None
    supervisor = None if not addresses else Supervisor(
        addresses, env=config.env, seed=config.seed, envs_per_sim=config.envs_per_sim, auth_token=config.auth_token,
        shm_server=shm, hang_timeout=config.hang_timeout, nice=config.sim_nice, launcher=launcher,
        max_restarts=config.max_restarts, restart_window=config.restart_window)
    return servers, supervisor


class Run:
    """One run of ``setup`` over ``servers`` (closed when it ends), with the simulators of
    ``supervisor`` (or None); ``t_start``: when its process started."""

    def __init__(self, setup: Setup, servers: list, supervisor, t_start: float):
        self.setup, self.servers, self.supervisor, self.t_start = setup, servers, supervisor, t_start
        self.serving: Serving | None = None
        self.writer = None   # --record's DatasetWriter, holding its folder's lock from the start to the end

    @property
    def config(self):
        return self.setup.config

    def run(self) -> tuple[int, dict]:
        """Serve, start the simulators, loop until the loop returns an exit status, and
        always stop; returns (exit status, summary) as ``end`` says them. ConfigError
        (nothing written or started, the servers closed) when a folder it writes is another
        run's."""
        try:
            self.take_folders()
        except ConfigError:
            self.close()
            raise
        status, error, unsaid, summary = EXIT_FAILED, None, [], {}
        try:
            self.serving = self.make_serving()
            if self.writer is not None:   # before the first client is served: every chunk is recorded
                self.serving.store.record(self.make_recorder(self.writer))
            self.serving.start()
            if self.supervisor:
                self.supervisor.start_all_in_background()
            self.prepare()
            launch_error = self.supervisor.joined() if self.supervisor else None
            if launch_error is not None:
                raise RunFailed(f"could not start the simulators: {launch_error!r}")
            status = self.loop()
        except RunFailed as e:
            error = str(e)
            print(f"error: {e}", file=sys.stderr, flush=True)
        except (LogdirWriteError, CheckpointError) as e:   # a full disk: end() says so, with what else failed
            error = str(e)
            unsaid.append(error)
        except KeyboardInterrupt:
            status = EXIT_INTERRUPTED
        except SystemExit as e:  # SIGTERM (see run._terminate)
            status = e.code if isinstance(e.code, int) else EXIT_FAILED
        finally:
            self.stop()
            failure = self.recording_failure()
            if failure is not None and error is None:   # its last shard, written at the stop, could not be
                status, error = EXIT_FAILED, failure
                unsaid.append(failure)
            try:
                if self.serving is not None:
                    status, summary = self.end(status, error, unsaid)
            finally:
                self.close()
        return status, summary

    def check_health(self) -> None:
        """RunFailed once the supervisor or the serving thread has failed."""
        if self.supervisor and self.supervisor.failure:
            raise RunFailed(self.supervisor.failure)
        if self.serving.failure:
            raise RunFailed(f"the learner's serving thread failed: {self.serving.failure!r}")
        if self.recording_failure() is not None:
            raise RunFailed(self.recording_failure())

    def recording_failure(self) -> str | None:
        """Why ``--record``'s writer stopped (a shard it could not write), or None."""
        recorder = self.serving.store.recorder if self.serving is not None else None
        if recorder is None or recorder.failure is None:
            return None
        return f"the recording failed: {recorder.failure}"

    def stop(self) -> None:
        """The serving thread and the simulators stop; from here on the store stands still."""
        if self.serving is not None:
            self.serving.stop()
            if self.serving.store.recorder is not None:   # --record: the episodes still open are written too
                self.serving.store.recorder.close()
        if self.supervisor is not None:
            self.supervisor.stop()

    def close(self) -> None:
        """The last step, after ``end``: every server closed, the dataset folder given up."""
        try:
            for server in self.servers:
                server.close()
        finally:
            if self.writer is not None:
                self.writer.close()

    # ------------------------------------------------------------ what a kind of run fills in
    record_flag = "--record"   # what its messages call the dataset folder

    def take_folders(self) -> None:
        """Take the folders the run writes, before anything is written or started
        (ConfigError if another run writes there): ``--record``'s dataset."""
        if self.config.record:
            self.writer = open_recording(self.setup, self.record_flag)

    def make_recorder(self, writer) -> Recorder:
        """What records every chunk the store takes, into ``writer``."""
        return Recorder(writer)

    def make_serving(self) -> Serving:
        raise NotImplementedError

    def prepare(self) -> None:
        """What the run needs before its loop, done while the simulators start."""

    def loop(self) -> int:
        """The run's work until it ends; returns the exit status."""
        raise NotImplementedError

    def end(self, status: int, error: str | None, unsaid: list) -> tuple[int, dict]:
        """After the stop: what the run writes and says; returns (exit status, summary).
        ``unsaid``: errors not printed yet."""
        return status, {}
