"""Low-level shared-memory pieces: /dev/shm housekeeping, segments, and the
single-producer/single-consumer ring of frames. (The FIFO doorbells that wake a ring's
reader are in ``doorbell``, the per-client segment that holds two rings in ``slot``.)

Nothing here is a lock shared between processes: a process killed at any instant leaves
nothing that blocks another one. Only the owner (the learner) creates and unlinks files
in /dev/shm; clients attach by name. Names are ``{prefix}_{owner_pid}_{tag}``, so the
leftovers of a killed run can be found (``sweep_stale``).

``multiprocessing.shared_memory`` is deliberately not used: before Python 3.13 its
resource tracker unlinks segments that a process merely attached to (CPython gh-82300).
"""
from __future__ import annotations

import errno
import math
import mmap
import os
import re
import struct
import time
import zlib

import _posixshmem

SHM_DIR = "/dev/shm"
DEFAULT_PREFIX = "shmrl"
MiB = 1 << 20


class ShmSpaceError(RuntimeError):
    """/dev/shm has too little free space for the segments."""


class RingCorrupt(RuntimeError):
    """A ring holds a record that cannot be valid (stale, torn by a bug, or overwritten)."""


# ---------------------------------------------------------------- /dev/shm housekeeping

def segment_name(prefix: str, owner_pid: int, tag: str) -> str:
    return f"{prefix}_{owner_pid}_{tag}"


def fifo_path(name: str, directory: str = SHM_DIR) -> str:
    return os.path.join(directory, name + ".fifo")


def shm_free_bytes(path: str = SHM_DIR) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def check_shm_space(bytes_needed: int, free_bytes: int | None = None, path: str = SHM_DIR) -> None:
    """Raise ShmSpaceError, saying how to fix it, if ``path`` cannot hold ``bytes_needed``."""
    free = shm_free_bytes(path) if free_bytes is None else free_bytes
    if bytes_needed > free:
        raise ShmSpaceError(_space_message(bytes_needed, free, path))


def _space_message(needed: int, free: int, path: str = SHM_DIR) -> str:
    suggest_gib = max(1, math.ceil(2 * needed / (1 << 30)))  # room for a second run
    return (f"shared memory: {needed / MiB:.1f} MiB needed in {path} but only {free / MiB:.1f} MiB "
            f"free. Raise the limit: in Docker, run with --shm-size={suggest_gib}g; on a host, "
            f"`sudo mount -o remount,size={suggest_gib}G {path}`; or use fewer simulators or "
            f"smaller rings.")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, belongs to someone else
        return True
    return True


def sweep_stale(prefix: str = DEFAULT_PREFIX, directory: str = SHM_DIR) -> list[str]:
    """Unlink the segments and FIFOs ``{prefix}_{pid}_*`` of processes that no longer
    exist (a run killed before it could clean up). Files of live pids are never touched."""
    pattern = re.compile(re.escape(prefix) + r"_(\d+)_")
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return []
    removed, alive = [], {}
    for entry in sorted(entries):
        m = pattern.match(entry)
        if not m:
            continue
        pid = int(m.group(1))
        if pid not in alive:
            alive[pid] = pid <= 0 or _pid_alive(pid)
        if alive[pid]:
            continue
        try:
            os.unlink(os.path.join(directory, entry))
            removed.append(entry)
        except FileNotFoundError:
            pass  # another sweeper got there first
    return removed


# ---------------------------------------------------------------- segments

class Segment:
    """A named shared-memory file, mapped read-write into this process."""

    def __init__(self, name: str, mm: mmap.mmap, owner: bool):
        self.name, self._mm, self.owner = name, mm, owner
        self._owner_pid = os.getpid()
        self.buf = memoryview(mm)

    @classmethod
    def create(cls, name: str, size: int) -> "Segment":
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                # Reserve every page now: a full /dev/shm fails here with ENOSPC instead of
                # killing a process with SIGBUS when it first touches a page.
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise ShmSpaceError(_space_message(size, shm_free_bytes())) from None
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(fd, size)  # a file system without fallocate
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            _posixshmem.shm_unlink("/" + name)
            raise
        os.close(fd)  # the mapping keeps the memory
        return cls(name, mm, owner=True)

    @classmethod
    def attach(cls, name: str) -> "Segment":
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_RDWR, 0)
        except FileNotFoundError:
            raise FileNotFoundError(f"no shared-memory segment {name!r}: is its learner running?") from None
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        return cls(name, mm, owner=False)

    def close(self) -> None:
        """Unmap; the owner (in the process that created it, not a forked child) also unlinks."""
        if self._mm is None:
            return
        self.buf.release()
        try:
            self._mm.close()
        except BufferError:
            pass  # a view is still alive somewhere: the mapping goes when it is collected
        self._mm = None
        if self.owner and os.getpid() == self._owner_pid:
            try:
                _posixshmem.shm_unlink("/" + self.name)
            except FileNotFoundError:
                pass


# ---------------------------------------------------------------- the ring

_RECORD = struct.Struct("<QII")   # absolute position of the record, payload length, crc
_RECORD_BYTES = _RECORD.size      # 16
_WRAP = 0xFFFFFFFF                # length of a wrap marker: "continue at offset 0"
# The crc is salted so that zeroed memory (a fresh or reset ring) never reads as a valid
# empty record at position 0: crc32(b"shmrl" + payload).
_CRC_SALT = zlib.crc32(b"shmrl")
_WRITE, _READ = 0, 16             # indices of the u64 positions in the ring header


def _as_bytes(part) -> bytes | bytearray | memoryview:
    if isinstance(part, (bytes, bytearray)):
        return part
    return memoryview(part).cast("B")  # numpy arrays, memoryviews: flat bytes, no copy


class Ring:
    """A single-producer/single-consumer ring of variable-size frames in shared memory.

    Region at ``offset`` (64-byte aligned): a 256-byte header, then ``capacity`` data bytes.
    The header holds ``write_pos`` (u64 at +0, total bytes published, written only by the
    writer) and ``read_pos`` (u64 at +128, total bytes consumed, written only by the
    reader), each on its own pair of cache lines. A record is ``[u64 position][u32
    length][u32 crc]`` + payload, padded to 8 bytes, and never crosses the end of the
    data area: if it does not fit, the writer leaves a wrap marker (length 0xFFFFFFFF)
    when at least 16 bytes remain (fewer: the reader wraps by itself) and starts again at
    offset 0; the skipped bytes count as used.

    Writer order: payload, record header, then ``write_pos`` (one aligned 8-byte store).
    A writer killed before that last store has published nothing. The reader copies the
    payload out and checks the record's position (== read_pos, else a stale slot) and
    crc before it moves ``read_pos``, so it never yields a torn frame.
    """

    HEADER_BYTES = 256
    RETRIES = 3  # consecutive failed checks of the same record before it counts as corrupt

    def __init__(self, buf: memoryview, offset: int, capacity: int):
        if offset % 64 or capacity % 64 or capacity < 256:
            raise ValueError(f"ring offset {offset} and capacity {capacity} must be multiples "
                             f"of 64, and capacity at least 256")
        if offset + self.HEADER_BYTES + capacity > len(buf):
            raise ValueError(f"a ring at {offset} with capacity {capacity} does not fit "
                             f"in a {len(buf)}-byte buffer")
        self.capacity = capacity
        self._pos = buf[offset:offset + self.HEADER_BYTES].cast("Q")
        self._data = buf[offset + self.HEADER_BYTES:offset + self.HEADER_BYTES + capacity]
        # Largest padded record that fits at every offset, even on an empty ring whose
        # write position sits just short of the end (skip < record, skip + record <= capacity).
        self.max_payload = ((capacity + 8) // 2 & ~7) - _RECORD_BYTES
        self._bad_pos, self._bad_count = -1, 0

    @classmethod
    def nbytes(cls, capacity: int) -> int:
        return cls.HEADER_BYTES + capacity

    @property
    def write_pos(self) -> int:
        return self._pos[_WRITE]

    @property
    def read_pos(self) -> int:
        return self._pos[_READ]

    # -- writer

    def try_write(self, parts) -> bool:
        """Publish one frame made of ``parts`` (bytes-like, gathered without joining);
        False if the ring has not enough free space now."""
        parts = [_as_bytes(p) for p in parts]
        n = sum(len(p) for p in parts)
        if n > self.max_payload:
            raise ValueError(f"a frame of {n} bytes is larger than the {self.max_payload} bytes this ring "
                             f"can hold (capacity {self.capacity} bytes): use larger rings")
        cap, data = self.capacity, self._data
        w, r = self._pos[_WRITE], self._pos[_READ]
        if not 0 <= w - r <= cap:
            raise RingCorrupt(f"ring positions out of range: write {w}, read {r}, capacity {cap}")
        size = (_RECORD_BYTES + n + 7) & ~7
        off = w % cap
        skip = 0 if size <= cap - off else cap - off
        if (w - r) + skip + size > cap:
            return False
        if skip:
            if skip >= _RECORD_BYTES:
                _RECORD.pack_into(data, off, w, _WRAP, 0)
            off = 0
        crc, o = _CRC_SALT, off + _RECORD_BYTES
        for p in parts:
            data[o:o + len(p)] = p
            crc = zlib.crc32(p, crc)
            o += len(p)
        _RECORD.pack_into(data, off, w + skip, n, crc)
        self._pos[_WRITE] = w + skip + size  # publish: last, a single aligned 8-byte store
        return True

    def write(self, parts, timeout: float | None = None, while_waiting=None) -> None:
        """Like try_write, but wait for space (sleeping 50 µs, doubling up to 2 ms: a full
        ring is the rare case); TimeoutError after ``timeout`` seconds (None: forever).
        ``while_waiting()``, if given, runs before each sleep: it raises to stop waiting
        (the reader is gone, the connection closed)."""
        if self.try_write(parts):
            return
        parts = [_as_bytes(p) for p in parts]  # converted once for the retries
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 50e-6
        while not self.try_write(parts):
            if while_waiting is not None:
                while_waiting()
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"ring full for {timeout} s: its reader is not keeping up")
            time.sleep(delay)
            delay = min(2 * delay, 2e-3)

    # -- reader

    def pending(self) -> bool:
        return self._pos[_WRITE] != self._pos[_READ]

    def read(self, strict: bool = False) -> bytes | None:
        """The next frame (a copy), or None if nothing is published yet.

        A record that fails its checks may merely not be visible yet: on a weakly ordered
        CPU, a reader that sees ``write_pos`` before it has consumed the doorbell byte the
        writer rings afterwards may see stale record bytes. So a failed check returns None
        and the record is tried again on the next call (callers read after each doorbell
        wake-up); the ``RETRIES``-th consecutive failure of the same record, or the first
        with ``strict=True``, raises RingCorrupt.
        """
        cap, data = self.capacity, self._data
        r, w = self._pos[_READ], self._pos[_WRITE]
        if r == w:
            return None
        if not 0 < w - r <= cap:
            raise RingCorrupt(f"ring positions out of range: write {w}, read {r}, capacity {cap}")
        off = r % cap
        pos = r
        if cap - off < _RECORD_BYTES:  # too little room for even a marker: implicit wrap
            pos, off = r + cap - off, 0
        else:
            marker_pos, n, _ = _RECORD.unpack_from(data, off)
            if n == _WRAP:
                if marker_pos != r:
                    return self._failed(r, strict, f"wrap marker at position {r} says {marker_pos}")
                pos, off = r + cap - off, 0
        rec_pos, n, crc = _RECORD.unpack_from(data, off)
        end = pos + ((_RECORD_BYTES + n + 7) & ~7)
        if rec_pos != pos:
            return self._failed(r, strict, f"stale record at position {pos}: it says {rec_pos}")
        if n > cap - off - _RECORD_BYTES or end > w:
            return self._failed(r, strict, f"record at position {pos} has impossible length {n}")
        payload = bytes(data[off + _RECORD_BYTES:off + _RECORD_BYTES + n])  # the one copy
        if zlib.crc32(payload, _CRC_SALT) != crc:  # checked on the copy: what we return
            return self._failed(r, strict, f"crc mismatch in the {n}-byte record at position {pos}")
        self._bad_count = 0
        self._pos[_READ] = end
        return payload

    def _failed(self, r: int, strict: bool, reason: str) -> None:
        if r != self._bad_pos:
            self._bad_pos, self._bad_count = r, 0
        self._bad_count += 1
        if strict or self._bad_count >= self.RETRIES:
            raise RingCorrupt(reason)
        return None

    # -- owner

    def reset(self) -> None:
        """Empty the ring and zero its data (owner only, with no peer attached): a new
        writer starts at position 0 and finds no old record that could pass for its own."""
        self._pos[_WRITE] = 0
        self._pos[_READ] = 0
        self._data[:] = bytes(self.capacity)
        self._bad_pos, self._bad_count = -1, 0

    def close(self) -> None:
        """Release this ring's views of the shared buffer (so the segment can be unmapped)."""
        self._pos.release()
        self._data.release()
