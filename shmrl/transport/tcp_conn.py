"""One TCP client connection as the server's IO thread keeps it (``shmrl.transport.tcp``):
its socket, the frame being read, the replies being written, and what the learner's thread
shares with it under the server's lock."""
from __future__ import annotations

import collections
import socket

from shmrl.rllink_codec import HEADER_LEN


def conn_id_of(peer) -> str:
    """A connection's name in logs and counters: tcp:HOST:PORT (tcp:[HOST]:PORT for IPv6)."""
    host, port = peer[:2]
    return f"tcp:[{host}]:{port}" if ":" in host else f"tcp:{host}:{port}"


class Connection:
    """One client connection. The IO thread alone uses the socket and the fields up to
    ``events``; the rest are shared with the learner's thread, under the server's lock."""

    __slots__ = ("sock", "conn_id", "inbuf", "body_len", "frame_start", "last_traffic", "sendq", "frames",
                 "rest_until", "events", "out", "out_bytes", "owed", "unpolled", "paused", "held", "closed",
                 "reason", "offered", "codec", "heartbeat")

    def __init__(self, sock: socket.socket, conn_id: str, now: float):
        self.sock, self.conn_id = sock, conn_id
        self.inbuf = bytearray()          # the incomplete frame being read
        self.body_len: int | None = None  # its body length, once its header is in
        self.frames = 0                   # complete frames received
        self.frame_start = now            # when its first byte arrived
        self.last_traffic = now
        self.sendq: collections.deque = collections.deque()  # frames (or unsent tails) being written
        self.rest_until = 0.0             # not read before this time.monotonic(): its decoding's share
        self.events = 0                   # what the selector watches for
        self.out: list[bytes] = []        # reply frames from reply(), not yet taken by the IO thread
        self.out_bytes = 0                # reply bytes queued and not yet written
        self.owed = 0                     # requests received whose reply has not been queued
        self.unpolled = 0                 # requests waiting for poll()
        self.paused = False               # not read until poll() takes its requests
        self.held = False                 # not read until the learner lets it go (hold())
        self.closed = False               # no more requests delivered, replies ignored
        self.reason: str | None = None    # set when the learner's side closes it: why
        self.offered = False              # its last PING offered the binary codec
        self.codec = "json"               # of the replies it gets (set by reply(), learner's thread)
        self.heartbeat = False            # it was told to send heartbeats: silence means hung

    def stopped(self, now: float) -> bool:
        """Not to be read now: the learner paused or held it, or it rests after a costly frame."""
        return self.paused or self.held or self.rest_until > now

    def frame_progress(self) -> str:
        total = f"{HEADER_LEN + self.body_len}" if self.body_len is not None else f"{HEADER_LEN} header"
        return f"{len(self.inbuf)} of {total} bytes"
