"""In-process transport for tests: clients run in threads of the learner's process.

Messages still go through a codec and ``rllink`` validation, exactly as they would
through shared memory or TCP, so the Hub and the simulator loop are tested unchanged.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading

from shmrl import rllink
from shmrl.transport.base import Closeable, ConnectionClosed, WakePipe

log = logging.getLogger("shmrl.transport")


class InProcServer(Closeable):
    """A ``ServerTransport`` whose clients are ``InProcClient``s from ``connect()``."""

    def __init__(self, codec: str = "binary"):
        if codec not in rllink.CODECS:
            raise ValueError(f"codec must be one of {rllink.CODECS}, not {codec!r}")
        self.codec = codec
        self._requests: queue.Queue = queue.Queue()
        self._replies: dict[str, queue.Queue] = {}
        self._closed: set[str] = set()
        self._ids = itertools.count()
        self._wake = WakePipe()
        self._lock = threading.Lock()
        self.frames_rejected = 0
        self.clients_timed_out = 0   # in-process clients have no heartbeat timeout

    def connect(self, timeout: float = 30.0) -> "InProcClient":
        conn_id = f"inproc:{next(self._ids)}"
        self._replies[conn_id] = queue.Queue()
        return InProcClient(self, conn_id, timeout)

    def fileno(self) -> int:
        return self._wake.fileno()

    def _submit(self, conn_id: str, body: bytes) -> None:
        with self._lock:
            if conn_id in self._closed:
                raise ConnectionClosed(f"{conn_id}: connection closed by the server")
            self._requests.put((conn_id, body))
            self._wake.wake()

    def poll(self, timeout: float = 0.0) -> list:
        if self._requests.empty() and timeout > 0:
            self._wake.wait(timeout)
        self._wake.drain()
        out = []
        while True:
            try:
                conn_id, body = self._requests.get_nowait()
            except queue.Empty:
                return out
            if conn_id in self._closed:
                continue
            try:
                out.append((conn_id, rllink.decode_request(body)))
            except rllink.ProtocolError as e:
                self.frames_rejected += 1
                self.drop(conn_id, str(e))
                out.append((conn_id, None))

    def reply(self, conn_id: str, msg: dict) -> None:
        if conn_id not in self._closed:
            self._replies[conn_id].put(rllink.encode(msg, self.codec))

    def timed_out(self, conn_id: str) -> bool:
        return False

    def drop(self, conn_id: str, reason: str) -> None:
        log.warning("%s: closing connection: %s", conn_id, reason)
        with self._lock:
            self._closed.add(conn_id)
        self._replies[conn_id].put(None)

    def close(self) -> None:
        with self._lock:
            for conn_id, replies in self._replies.items():
                if conn_id not in self._closed:
                    self._closed.add(conn_id)
                    replies.put(None)
            self._wake.close()


class InProcClient(Closeable):
    """A ``ClientTransport`` in a thread of the server's process."""

    def __init__(self, server: InProcServer, conn_id: str, timeout: float):
        self.server, self.conn_id, self.timeout = server, conn_id, timeout

    def send(self, msg: dict) -> None:
        self.server._submit(self.conn_id, rllink.encode(msg, self.server.codec))

    def request(self, msg: dict) -> dict:
        self.send(msg)
        try:
            body = self.server._replies[self.conn_id].get(timeout=self.timeout)
        except queue.Empty:
            raise TimeoutError(f"{self.conn_id}: no reply within {self.timeout} s") from None
        if body is None:
            raise ConnectionClosed(f"{self.conn_id}: connection closed by the server")
        return rllink.decode_reply(body)

    def heartbeat(self, env_steps: int) -> None:
        pass

    def close(self) -> None:
        pass
