"""One simulator's shared-memory segment: its slot header and its two rings."""
from __future__ import annotations

import mmap
import os

from shmrl.transport.ring import Ring, Segment


class ClientSlot:
    """One client's segment: slot header, request ring (client -> owner) and reply ring
    (owner -> client). Shared counters are aligned u64s; the two writers' fields sit on
    separate cache lines.

    ====== ======================================================================
    offset field (written by)
    ====== ======================================================================
    0      magic u64, owner pid, request capacity, reply capacity, closed flag (owner)
    64     reason the owner closed the connection, 192 bytes UTF-8, NUL-padded (owner)
    256    name of the request doorbell FIFO to ring, 128 bytes, NUL-padded (owner)
    384    client pid u64, env steps the client has stepped u64: its heartbeat (client)
    512    request ring: 256-byte header + request capacity
    ...    reply ring: 256-byte header + reply capacity (then padding to a page)
    ====== ======================================================================
    """

    HEADER_BYTES = 512
    MAGIC = int.from_bytes(b"shmrlsl1", "little")
    _MAGIC, _OWNER_PID, _REQ_CAP, _REP_CAP, _CLOSED = 0, 1, 2, 3, 4
    _REASON = slice(64, 256)
    _DOORBELL = slice(256, 384)
    _CLIENT_PID, _ENV_STEPS = 48, 49

    def __init__(self, segment: Segment):
        self.segment, self.name = segment, segment.name
        self._hdr = segment.buf[:self.HEADER_BYTES].cast("Q")
        if self._hdr[self._MAGIC] != self.MAGIC:
            self._hdr.release()
            raise ValueError(f"{segment.name!r} is not a shmrl client slot")
        req_cap, rep_cap = self._hdr[self._REQ_CAP], self._hdr[self._REP_CAP]
        try:
            self.requests = Ring(segment.buf, self.HEADER_BYTES, req_cap)
            self.replies = Ring(segment.buf, self.HEADER_BYTES + Ring.nbytes(req_cap), rep_cap)
        except ValueError:
            self._hdr.release()
            raise

    @classmethod
    def nbytes(cls, request_capacity: int, reply_capacity: int) -> int:
        n = cls.HEADER_BYTES + Ring.nbytes(request_capacity) + Ring.nbytes(reply_capacity)
        return -(-n // mmap.PAGESIZE) * mmap.PAGESIZE

    @classmethod
    def create(cls, name: str, request_capacity: int, reply_capacity: int,
               request_doorbell: str = "") -> "ClientSlot":
        """Owner: a new slot; ``request_doorbell`` names the FIFO its client rings."""
        raw_bell = request_doorbell.encode()
        if len(raw_bell) > cls._DOORBELL.stop - cls._DOORBELL.start:
            raise ValueError(f"doorbell name too long: {request_doorbell!r}")
        seg = Segment.create(name, cls.nbytes(request_capacity, reply_capacity))
        try:
            seg.buf[cls._DOORBELL.start:cls._DOORBELL.start + len(raw_bell)] = raw_bell
            hdr = seg.buf[:cls.HEADER_BYTES].cast("Q")
            hdr[cls._OWNER_PID] = os.getpid()
            hdr[cls._REQ_CAP], hdr[cls._REP_CAP] = request_capacity, reply_capacity
            hdr[cls._MAGIC] = cls.MAGIC
            hdr.release()
            return cls(seg)
        except BaseException:
            seg.close()
            raise

    @classmethod
    def attach(cls, name: str) -> "ClientSlot":
        seg = Segment.attach(name)
        try:
            return cls(seg)
        except BaseException:
            seg.close()
            raise

    @property
    def owner_pid(self) -> int:
        return self._hdr[self._OWNER_PID]

    @property
    def request_doorbell(self) -> str:
        """Name of the FIFO (in /dev/shm) that the client rings after each request."""
        return bytes(self.segment.buf[self._DOORBELL]).rstrip(b"\0").decode()

    @property
    def client_pid(self) -> int:
        return self._hdr[self._CLIENT_PID]

    @client_pid.setter
    def client_pid(self, pid: int) -> None:
        self._hdr[self._CLIENT_PID] = pid

    @property
    def env_steps(self) -> int:
        """Env steps the client has stepped so far (it writes this as it goes)."""
        return self._hdr[self._ENV_STEPS]

    @env_steps.setter
    def env_steps(self, n: int) -> None:
        self._hdr[self._ENV_STEPS] = n

    @property
    def closed_reason(self) -> str | None:
        """Why the owner closed this connection, or None while it is open."""
        if not self._hdr[self._CLOSED]:
            return None
        return bytes(self.segment.buf[self._REASON]).rstrip(b"\0").decode("utf-8", "replace")

    def set_closed(self, reason: str) -> None:
        raw = reason.encode("utf-8")[:self._REASON.stop - self._REASON.start]
        self.segment.buf[self._REASON] = raw.ljust(self._REASON.stop - self._REASON.start, b"\0")
        self._hdr[self._CLOSED] = 1  # after the reason: a client that sees the flag sees the text

    def reset(self) -> None:
        """Owner: make the slot as new for a replacement client."""
        self.requests.reset()
        self.replies.reset()
        self._hdr[self._CLOSED] = 0
        self._hdr[self._CLIENT_PID] = 0
        self._hdr[self._ENV_STEPS] = 0

    def close(self) -> None:
        if self.segment._mm is None:
            return
        self.requests.close()
        self.replies.close()
        self._hdr.release()
        self.segment.close()
