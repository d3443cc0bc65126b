"""A run that records what its clients send without training (``python -m shmrl.record``):
the life of a training run (``shmrl.trainer.lifecycle``: the same transports, restarts of
its simulators and stop), serving one policy that never changes."""
from __future__ import annotations

import signal
import sys
import time

from shmrl.config.settings import EXIT_INTERRUPTED
from shmrl.core.episode import EpisodeBatch
from shmrl.server.recorder import Recorder
from shmrl.server.serving import Serving
from shmrl.trainer.lifecycle import Run
from shmrl.trainer.setup import Setup, make_serving
from shmrl.transport.tcp import TcpServer


class FixedModel:
    """A policy's "template" that always publishes the same ONNX file (``--policy``)."""

    def __init__(self, model: bytes):
        self.model = model

    def publish(self, weights) -> bytes:
        return self.model


class Recording(Run):
    """Serves ``policy`` (ONNX bytes; None: the first weights of the house network) and
    records every episode to the run's ``--record`` dataset until Ctrl-C, SIGTERM or
    ``episodes`` whole episodes; says how many came in every ``say_every`` seconds."""

    def __init__(self, setup: Setup, servers: list, supervisor, policy: bytes | None, episodes: int | None,
                 say_every: float = 10.0):
        super().__init__(setup, servers, supervisor, time.time())
        self.policy, self.episodes, self.say_every = policy, episodes, say_every

    record_flag = "--out"

    def make_recorder(self, writer) -> Recorder:
        return Recorder(writer, max_episodes=self.episodes)   # exactly that many whole episodes, nothing cut

    def make_serving(self) -> Serving:
        serving = make_serving(self.setup, self.servers, self.supervisor)
        if self.policy is not None:
            serving.templates = {pid: FixedModel(self.policy) for pid in serving.templates}
            serving.publish({pid: {} for pid in serving.templates})
        return serving

    def loop(self) -> int:
        config, serving, store = self.config, self.serving, self.serving.store
        tcp = next((server for server in self.servers if isinstance(server, TcpServer)), None)
        if config.tcp_port is not None and tcp is not None:   # the port it listens on (--tcp-port 0 picks one)
            host, port = tcp.address
            print(f"recording to {config.record}: clients connect to {host}:{port}", flush=True)
        last_said = time.monotonic()
        while self.episodes is None or store.episodes_completed < self.episodes:
            got = serving.next_batch(0.2)
            self.check_health()
            if got:   # nothing trains on it: it was recorded when it came in
                store.trained({pid: EpisodeBatch.concat(b) for pid, b in got[0].items()})
                serving.publish({})   # the same weights: releases the next batch
            if time.monotonic() - last_said >= self.say_every:
                print(f"{store.episodes_completed} episodes, {store.steps_received} env steps received", flush=True)
                last_said = time.monotonic()
        return 0

    def end(self, status: int, error: str | None, unsaid: list) -> tuple[int, dict]:
        if unsaid:   # its last shard could not be written: a failed part, whatever ended it
            print(f"error: {'; '.join(dict.fromkeys(unsaid))}", file=sys.stderr, flush=True)
            return status, {}
        # Ctrl-C and SIGTERM are how a recording without --episodes ends: done, exit 0.
        return (0 if status in (EXIT_INTERRUPTED, 128 + signal.SIGTERM) else status), {}
