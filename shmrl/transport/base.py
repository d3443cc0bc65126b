"""What every transport is: the client and server interfaces (``typing.Protocol``), the
one ``ConnectionClosed``, and the ``WakePipe`` that wakes a thread waiting in select/poll.

A transport carries RLlink messages (docs/RLLINK.md) between simulators (clients) and the
learner (server). The hub and the simulator loop see only these two interfaces, so a new
medium is a new pair of classes with these methods, nothing else.

Errors a client raises: ``ConnectionClosed`` (a ``ConnectionError``) once its connection is
unusable, whoever closed it; ``TimeoutError`` when no reply came in time (the connection is
then out of step: close it); ``rllink.ProtocolError`` (a ``ValueError``) for a reply that is
not valid RLlink. Callers that catch ``ConnectionError`` catch every way a connection ends.
"""
from __future__ import annotations

import math
import os
import select
from typing import Protocol, runtime_checkable

from shmrl import rllink


class ConnectionClosed(ConnectionError):
    """The connection is closed: by the server (the message says why), because the peer
    is gone, or because an earlier error left it out of step. Every later call raises it.
    ``mid_reply``: it closed in the middle of a reply (a server that died writing it), not
    between replies (where a server that ends its run closes its connections)."""
    mid_reply = False

    def __init__(self, message: str = "", *, mid_reply: bool = False):
        super().__init__(message)
        self.mid_reply = mid_reply


@runtime_checkable
class ClientTransport(Protocol):
    """A simulator's end of one connection. One thread uses it (the simulator loop's);
    ``close()`` may also come from another thread, and ends a blocked ``request``."""

    def send(self, msg: dict) -> None:
        """Send a request that gets no reply (EPISODES). Blocks only while the medium is
        full (up to the client's timeout, then TimeoutError); ConnectionClosed if closed."""

    def request(self, msg: dict) -> dict:
        """Send a request and return its reply, decoded and validated. ConnectionClosed,
        TimeoutError or rllink.ProtocolError as the module says."""

    def heartbeat(self, env_steps: int) -> None:
        """Called once per env step with the env steps stepped so far: liveness where the
        medium needs it (a shared counter, or a HEARTBEAT message now and then). Cheap."""

    def close(self) -> None:
        """Release the connection. Idempotent; never raises."""


@runtime_checkable
class ServerTransport(Protocol):
    """The learner's end: many connections, each named by a ``conn_id`` string
    (``shm:3``, ``tcp:10.0.0.2:51234``, ``inproc:0``). The learner's serving thread alone
    calls ``poll``, ``reply``, ``drop`` and ``timed_out``; ``close`` comes after it has
    stopped. Nothing here blocks except ``poll`` for up to its timeout."""

    frames_rejected: int
    """Bad frames received (undecodable or invalid RLlink), each of which closed its connection."""

    clients_timed_out: int
    """Connections closed for missing heartbeats (0 where the medium has none)."""

    def fileno(self) -> int:
        """A descriptor that is readable while ``poll`` may have something: for a selector."""

    def poll(self, timeout: float = 0.0) -> list[tuple[str, dict | None]]:
        """Wait up to ``timeout`` s, then return the requests waiting as ``(conn_id, msg)``,
        each ``msg`` decoded and validated, in arrival order per connection. ``msg`` None:
        that connection closed (reported once); forget its state. Never raises for what a
        client sent: a bad frame closes that connection only."""

    def reply(self, conn_id: str, msg: dict) -> None:
        """Queue ``msg`` for ``conn_id`` in the codec that client uses; never blocks. A
        closed connection's reply is ignored. ``msg`` may go to many clients and be encoded
        once, so do not change it after replying with it."""

    def drop(self, conn_id: str, reason: str) -> None:
        """Close one connection from the learner's side, logging ``reason`` (the client is
        told it, where the medium can). The caller forgets the connection's state itself."""

    def timed_out(self, conn_id: str) -> bool:
        """Whether this server closed ``conn_id`` for missing heartbeats."""

    def close(self) -> None:
        """Release everything (segments, FIFOs, sockets, threads). Idempotent."""


class Closeable:
    """``with`` support for a transport's end: ``close()`` on leaving the block.

    Deliberately no ``__del__`` here: a forked child that collects an inherited server
    would take its lock (perhaps held by a thread that does not exist in the child) and
    write to the parent's wake pipe. Where closing at collection is safe and needed
    (shared-memory files that only their owner unlinks), the class says so itself."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ReplyEncoder:
    """``rllink.encode`` for a server's replies, keeping the last message encoded in each
    codec by identity: the same SET_STATE goes to every waiting client, encoded once.
    ``framed``: return header + body as one bytes object (for a socket), else the body."""

    def __init__(self, framed: bool = False):
        self.framed = framed
        self._last: dict[str, tuple[dict, bytes]] = {}  # codec -> (message, encoded)

    def __call__(self, msg: dict, codec: str) -> bytes:
        last = self._last.get(codec)
        if last is not None and last[0] is msg:
            return last[1]
        data = rllink.encode(msg, codec)
        if self.framed:
            data = rllink.frame(data)
        self._last[codec] = (msg, data)
        return data


class WakePipe:
    """A non-blocking self-pipe: one thread ``wake()``s another that waits on ``fileno()``
    in a selector (or in ``wait``). Wake-ups coalesce: a full pipe means one is pending
    anyway. ``drain()`` empties it; the waiter drains before it looks for work, so a wake
    that comes after the look is seen by the next wait."""

    def __init__(self):
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._poller = select.poll()
        self._poller.register(self._r, select.POLLIN)

    def fileno(self) -> int:
        """The read end: readable while a wake-up is pending."""
        return self._r

    def wake(self) -> None:
        """From any thread; never blocks. Nothing once closed."""
        if self._w < 0:
            return
        try:
            os.write(self._w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full: a wake-up is pending anyway

    def wait(self, timeout: float | None) -> bool:
        """Block until woken or ``timeout`` s (None: forever); True if woken. Does not drain."""
        if self._r < 0:
            return False
        ms = None if timeout is None else max(0, math.ceil(timeout * 1000))
        return bool(self._poller.poll(ms))

    def drain(self) -> None:
        """Consume every pending wake-up."""
        if self._r < 0:
            return
        try:
            while len(os.read(self._r, 4096)) == 4096:
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        """Close both ends; afterwards ``wake``, ``wait`` and ``drain`` do nothing. Idempotent."""
        if self._r < 0:
            return
        self._poller.unregister(self._r)
        os.close(self._r)
        os.close(self._w)
        self._r = self._w = -1
