"""FIFO doorbells: the wake-ups, and the memory barrier, of the shared-memory rings.

A doorbell is a named FIFO in /dev/shm, so that processes that only know each other's
segment names can ring one another; the owner (the learner) creates and unlinks it. Its
in-process analogue, an anonymous self-pipe, is ``base.WakePipe``.
"""
from __future__ import annotations

import errno
import math
import os
import select
import weakref

from shmrl.transport.base import ConnectionClosed


class PeerGone(ConnectionClosed):
    """The process at the other end of a doorbell has closed it or died."""


_OWNED_DOORBELLS: "weakref.WeakSet[Doorbell]" = weakref.WeakSet()


def _close_owned_in_child() -> None:
    # A forked child must not keep the owner's FIFO ends open: a client reading a reply
    # doorbell detects the owner's death by EOF, which never comes while any process
    # still holds a write end.
    for bell in list(_OWNED_DOORBELLS):
        bell._forget_in_child()


os.register_at_fork(after_in_child=_close_owned_in_child)


class Doorbell:
    """A wake-up over a named FIFO: ``ring()`` writes a byte, ``wait()`` blocks in the
    kernel until one arrives, then drains them all.

    It is also the memory barrier of the rings. The writer publishes (payload, record,
    write_pos) and then rings; the reader waits (which reads the pipe) and then reads the
    ring. The pipe write and read both take the pipe's lock in the kernel, a release and
    an acquire, so every store made before ``ring()`` is visible after the ``wait()`` that
    consumed its byte, on any CPU, not only under x86's strong store ordering.

    The owner opens the FIFO read-write and non-blocking: it never sees EOF and its writes
    never block. A client opens one end only; when the owner's end closes (it exited or
    was killed), a client's ``wait()`` raises PeerGone and its ``ring()`` too.
    """

    def __init__(self, path: str, fd: int, owner: bool):
        self.path, self._fd, self.owner = path, fd, owner
        self._owner_pid = os.getpid()
        self._poller = select.poll()
        self._poller.register(fd, select.POLLIN)
        if owner:
            _OWNED_DOORBELLS.add(self)

    @classmethod
    def create(cls, path: str) -> "Doorbell":
        os.mkfifo(path, 0o600)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        except BaseException:
            os.unlink(path)
            raise
        return cls(path, fd, owner=True)

    @classmethod
    def open(cls, path: str, mode: str) -> "Doorbell":
        """Attach to an owner's FIFO: ``mode`` "r" to wait on it, "w" to ring it."""
        flags = {"r": os.O_RDONLY, "w": os.O_WRONLY}[mode] | os.O_NONBLOCK
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            raise FileNotFoundError(f"no doorbell {path}: is its learner running?") from None
        except OSError as e:
            if e.errno == errno.ENXIO:  # write end and no reader: the owner is gone
                raise PeerGone(f"{path}: nobody is listening (the learner is gone)") from None
            raise
        return cls(path, fd, owner=False)

    def fileno(self) -> int:
        return self._fd

    def ring(self) -> None:
        try:
            os.write(self._fd, b"\0")
        except BlockingIOError:
            pass  # the FIFO is full: a wake-up is pending anyway
        except BrokenPipeError:
            raise PeerGone(f"{self.path}: nobody is listening (the learner is gone)") from None

    def wait(self, timeout: float | None) -> bool:
        """Block until rung or ``timeout`` seconds (None: forever); drain; True if rung."""
        ms = None if timeout is None else max(0, math.ceil(timeout * 1000))
        if not self._poller.poll(ms):
            return False
        self.drain()
        return True

    def drain(self) -> None:
        while True:
            try:
                chunk = os.read(self._fd, 4096)
            except BlockingIOError:
                return
            if not chunk:  # EOF: every write end is closed
                raise PeerGone(f"{self.path}: the other side closed it (the learner is gone)")
            if len(chunk) < 4096:
                return

    def peer_gone(self) -> bool:
        """True if this read end has seen its last writer close (no bytes consumed)."""
        return any(ev & select.POLLHUP for _, ev in self._poller.poll(0))

    def close(self) -> None:
        if self._fd < 0:
            return
        os.close(self._fd)
        self._fd = -1
        if self.owner and os.getpid() == self._owner_pid:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def _forget_in_child(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.owner = False
