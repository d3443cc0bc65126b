"""One TCP client connection as the server's IO thread keeps it (``shmrl.transport.tcp``):
its socket, the frame being read, the replies being written, and what the learner's thread
shares with it under the server's lock."""
from __future__ import annotations

import collections
import logging
import socket
import time
from typing import NamedTuple

from shmrl.rllink.codec import HEADER_LEN, ProtocolError


def conn_id_of(peer) -> str:
    """A connection's name in logs and counters: tcp:HOST:PORT (tcp:[HOST]:PORT for IPv6)."""
    host, port = peer[:2]
    return f"tcp:[{host}]:{port}" if ":" in host else f"tcp:{host}:{port}"


class BodyLimits(NamedTuple):
    """The largest frame body a connection may send in each codec; ``what`` says what they
    bound, when it is not every message."""
    json: int
    binary: int
    what: str = ""

    def check(self, n: int, binary: bool) -> None:
        """Refuse a body of ``n`` bytes in its codec (told by the body's first 4 bytes)."""
        limit, codec = (self.binary, "binary") if binary else (self.json, "JSON")
        if n > limit:
            raise ProtocolError(f"{codec} frame of {n} bytes exceeds the maximum of {limit} for {codec}{self.what}")

    def within(self, other: BodyLimits) -> BodyLimits:
        """These limits, none above ``other``'s."""
        return BodyLimits(min(self.json, other.json), min(self.binary, other.binary), self.what)


class Connection:
    """One client connection. The IO thread alone uses the socket and the fields up to
    ``events``; the rest are shared with the learner's thread, under the server's lock."""

    __slots__ = ("sock", "conn_id", "inbuf", "body_len", "frame_start", "last_traffic", "sendq", "frames",
                 "rest_until", "events", "limits", "out", "out_bytes", "owed", "unpolled", "paused", "held",
                 "closed", "reason", "offered", "asked", "codec", "heartbeat")

    def __init__(self, sock: socket.socket, conn_id: str, now: float, limits: BodyLimits):
        self.sock, self.conn_id = sock, conn_id
        self.inbuf = bytearray()          # the incomplete frame being read
        self.body_len: int | None = None  # its body length, once its header is in
        self.frames = 0                   # complete frames received
        self.frame_start = now            # when its first byte arrived
        self.last_traffic = now
        self.sendq: collections.deque = collections.deque()  # frames (or unsent tails) being written
        self.rest_until = 0.0             # not read before this time.monotonic(): its decoding's share
        self.events = 0                   # what the selector watches for
        self.limits = limits              # of its bodies: the largest ACT's once its PING asks for server-side inference
        self.out: list[bytes] = []        # reply frames from reply(), not yet taken by the IO thread
        self.out_bytes = 0                # reply bytes queued and not yet written
        self.owed = 0                     # requests received whose reply has not been queued
        self.unpolled = 0                 # requests waiting for poll()
        self.paused = False               # not read until poll() takes its requests
        self.held = False                 # not read until the learner lets it go (hold())
        self.closed = False               # no more requests delivered, replies ignored
        self.reason: str | None = None    # set when the learner's side closes it: why
        self.offered = False              # its last PING offered the binary codec
        self.asked = False                # its last PING asked for server-side inference, not yet answered
        self.codec = "json"               # of the replies it gets (set by reply(), learner's thread)
        self.heartbeat = False            # it was told to send heartbeats: silence means hung

    @classmethod
    def accepted(cls, sock: socket.socket, conn_id: str, limits: BodyLimits) -> Connection | None:
        """A connection just accepted, set up for the IO thread (None: the socket is gone)."""
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small replies go out at once
        except OSError:
            sock.close()
            return None
        return cls(sock, conn_id, time.monotonic(), limits)

    def stopped(self, now: float) -> bool:
        """Not to be read now: the learner paused or held it, or it rests after a costly frame."""
        return self.paused or self.held or self.rest_until > now

    def overdue(self, now: float, server) -> tuple[str, bool] | None:
        """Why the IO thread must close it now by the ``server``'s timeouts, and whether it
        is for missing heartbeats; None if it may go on."""
        silent = now - self.last_traffic
        if self.closed:
            return None
        if self.inbuf and not self.stopped(now):
            if now - self.frame_start > server.frame_timeout:
                return (f"frame incomplete after {server.frame_timeout:g} s: slow or stalled client "
                        f"(got {self.frame_progress()})"), False
        elif not self.frames and silent > server.hello_timeout:
            return f"sent nothing in the {server.hello_timeout:g} s after connecting", False
        elif self.owed or self.unpolled or self.out_bytes or self.held:
            return None  # the learner holds it up, not the client
        elif self.heartbeat and silent > server.heartbeat_timeout:
            return (f"no heartbeat for {silent:.1f} s (heartbeat_timeout {server.heartbeat_timeout:g} s, one due "
                    f"every {server.heartbeat_s:g} s): the client hung or its machine is gone"), True
        elif server.idle_timeout is not None and silent > server.idle_timeout:
            return f"idle for {server.idle_timeout:g} s with no reply owed", False
        return None

    def write_queued(self) -> int:
        """The IO thread's write of ``sendq``, as far as the socket takes it: the bytes sent.
        OSError: the socket is broken."""
        queue, sent = self.sendq, 0
        try:
            while queue:
                n = self.sock.send(queue[0])
                sent += n
                if n < len(queue[0]):  # the socket's buffer is full
                    queue[0] = memoryview(queue[0])[n:]
                    break
                queue.popleft()
        except (BlockingIOError, InterruptedError):
            pass
        if sent:
            self.last_traffic = time.monotonic()
        return sent

    def disconnected(self, error: OSError | None) -> tuple[str, int]:
        """Why it closed when the peer went away (``error``: how it showed), and the level
        to log it at: an orderly close between frames is no warning."""
        why = f" ({error.strerror or error})" if error is not None else ""
        if self.inbuf:
            return f"disconnected mid-frame after {self.frame_progress()}{why}", logging.WARNING
        return f"the client disconnected{why}", logging.INFO

    @staticmethod
    def drain_input(sock: socket.socket) -> None:
        """Read what is left before closing: unread input would make close() send a reset
        instead of an orderly EOF."""
        try:
            for _ in range(4):
                if not sock.recv(1 << 16):
                    break
        except OSError:
            pass

    def frame_progress(self) -> str:
        total = f"{HEADER_LEN + self.body_len}" if self.body_len is not None else f"{HEADER_LEN} header"
        return f"{len(self.inbuf)} of {total} bytes"
