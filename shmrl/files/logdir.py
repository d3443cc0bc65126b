"""What holds the log folder together when runs collide, get killed or fill the disk.

- One writer per folder: ``take_lock`` holds an exclusive ``flock`` on ``LOGDIR/run.lock``
  (the file names the holder's pid). The kernel releases it when the process ends, however
  it ends, so a lock left by a killed run is stale by construction and is taken over (with
  a message naming the old pid); a second run while the first lives is refused with one
  line naming the holder.
- Appends are whole lines: ``append_line`` writes a line with one ``os.write`` on an
  ``O_APPEND`` descriptor, and takes a short write (a full disk) back out, so the file
  never holds half a line of ours. ``read_rows`` still drops a torn line.
- On resume, ``cut_rows`` keeps the rows up to the checkpoint's update (written to a new
  file, synced and renamed over the old one), so update numbers stay unique and
  increasing and no counter goes backwards.
- JSON never holds a bare ``NaN`` or ``Infinity`` (not JSON): ``dumps`` writes them as
  ``null``. ``write_json_file`` (and ``replace_file``) replaces a file whole or leaves the
  old one.

A run calls ``open_logdir`` once, before it writes anything: it makes the folder, takes
the lock, and on resume cuts metrics.jsonl.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import os
from pathlib import Path

from shmrl.config.settings import ConfigError

log = logging.getLogger("shmrl.run")

LOCK_FILE = "run.lock"


class LogdirWriteError(RuntimeError):
    """A file of the log folder could not be written (a full disk, an I/O error); the
    message names the file and the cause."""


def write_error(path: Path, e: OSError) -> LogdirWriteError:
    return LogdirWriteError(f"cannot write {path}: {e.strerror or e}")


# ---------------------------------------------------------------- one writer per folder

class LogdirLock:
    """The lock of one log folder, held while the object is open; ``release()`` (or the end
    of the process) gives it up."""

    def __init__(self, path: Path, fd: int):
        self.path, self._fd = path, fd

    def release(self) -> None:
        if self._fd is None:
            return
        try:   # empty: a lock file that names a pid but is not held was left by a killed run
            os.ftruncate(self._fd, 0)
        except OSError:
            pass
        os.close(self._fd)   # closing the last descriptor drops the flock
        self._fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def take_lock(logdir: Path, flag: str = "--logdir", name: str = LOCK_FILE) -> LogdirLock:
    """Lock ``logdir`` (which must exist) for this process, or raise ConfigError naming the
    pid of the run that holds it. ``flag`` is what the message calls the folder; ``name``
    the lock file in it (a dataset folder's is hidden, so readers pass over it)."""
    path = Path(logdir) / name
    try:
        # Not inherited across exec (Python's default); forked simulators come from a fork
        # server, so only this process holds the descriptor.
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ConfigError(f"{flag} {logdir}: cannot create {path.name}: {e.strerror or e}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = _pid_in(fd)
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise ConfigError(f"{flag} {logdir}: cannot lock {path.name}: {e.strerror or e}") from None
        raise ConfigError(f"{flag} {logdir}: another run (pid {holder or 'unknown'}) is writing there; "
                          f"let it end or stop it first, or choose another folder") from None
    old = _pid_in(fd)
    if old and old != os.getpid():
        log.warning("%s %s: taking over the lock of pid %s, a run that ended without releasing it "
                    "(killed?)", flag, logdir, old)
    try:
        data = f"{os.getpid()}\n".encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
    except OSError:
        pass   # the flock is what counts; the pid is for the message
    return LogdirLock(path, fd)


def _pid_in(fd: int) -> int | None:
    try:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


# ---------------------------------------------------------------- JSON without NaN

def finite_or_none(value):
    """``value`` with every non-finite float (NaN, inf) in it, at any depth, as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def dumps(value, **kwargs) -> str:
    """JSON text of ``value``, non-finite floats as ``null``."""
    return json.dumps(finite_or_none(value), allow_nan=False, **kwargs)


def write_json_file(path: Path, value) -> None:
    """Write ``value`` as JSON to ``path`` whole: a new file, synced, renamed over the old;
    on failure the old file stays and LogdirWriteError says why."""
    replace_file(Path(path), (dumps(value, indent=2) + "\n").encode())


def replace_file(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.writing")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise write_error(path, e) from None
    _sync_folder(path.parent)


def _sync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass   # the rename is done; syncing the folder only hurries it to the disk


# ---------------------------------------------------------------- line files (metrics.jsonl)

def open_lines(path: Path, append: bool) -> int:
    """A descriptor to append lines to ``path`` (emptied first unless ``append``)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if append else os.O_TRUNC)
    try:
        return os.open(path, flags, 0o644)
    except OSError as e:
        raise write_error(path, e) from None


def append_line(fd: int, line: str, path: Path) -> None:
    """Append ``line`` (no newline) and a newline in one write; if the disk takes only part
    of it, the part is cut off again and LogdirWriteError says why."""
    data = line.encode() + b"\n"
    size = os.fstat(fd).st_size
    try:
        written = os.write(fd, data)
        if written != len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError as e:
        try:
            os.ftruncate(fd, size)
        except OSError:
            pass
        raise write_error(path, e) from None


def read_rows(path: Path) -> list[dict]:
    """The JSON objects of a line file, in order; a line that is not one (the torn last line
    of a run killed mid-write) is left out."""
    return [row for row, _ in _parsed_lines(Path(path).read_bytes())]


def _parsed_lines(data: bytes) -> list[tuple[dict, bytes]]:
    out = []
    for line in data.splitlines(keepends=True):
        try:
            row = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(row, dict):
            out.append((row, line if line.endswith(b"\n") else line + b"\n"))
    return out


def cut_rows(path: Path, last_update: int) -> int:
    """Make the line file ``path`` (metrics.jsonl) end at update ``last_update``: rows after
    it, lines that are not rows, and rows an earlier resume wrote again are dropped (a
    later row replaces those with its update number and after). The file is replaced whole
    (new file, fsync, rename), so a kill leaves either the old or the new. Returns the
    number of lines dropped."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return 0
    kept: list[tuple[int, bytes]] = []
    for row, line in _parsed_lines(data):
        update = row.get("update")
        if not isinstance(update, int) or isinstance(update, bool) or update > last_update:
            continue
        while kept and kept[-1][0] >= update:
            kept.pop()
        kept.append((update, line))
    dropped = sum(1 for line in data.splitlines() if line.strip()) - len(kept)
    if dropped or not data.endswith(b"\n") and data:
        replace_file(path, b"".join(line for _, line in kept))
    return dropped


# ---------------------------------------------------------------- a run's start

def open_logdir(logdir: Path, flag: str = "--logdir", resumed_update: int | None = None) -> LogdirLock:
    """What a run does to its log folder before writing anything there: create it, lock it
    (ConfigError if another run holds it), and when it resumes from the checkpoint of
    update ``resumed_update``, cut metrics.jsonl back to that update."""
    logdir = Path(logdir)
    try:
        logdir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--logdir {logdir}: cannot create it: {e.strerror or e}") from None
    lock = take_lock(logdir, flag)
    if resumed_update is not None:
        try:
            dropped = cut_rows(logdir / "metrics.jsonl", resumed_update)
        except LogdirWriteError as e:
            lock.release()
            raise ConfigError(f"{flag} {logdir}: {e}") from None
        if dropped:
            log.warning("%s %s: dropped %d lines of metrics.jsonl written after update %d (its checkpoint's), "
                        "or torn by a kill", flag, logdir, dropped, resumed_update)
    return lock
