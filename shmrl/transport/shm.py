"""Shared-memory RLlink transport: the learner (``ShmServer``) owns one segment per
simulator, holding that simulator's request ring and reply ring; simulators
(``ShmClient``) attach to theirs by name.

Each ring payload is a complete RLlink frame, 8 ASCII digits of body length + body: the
very bytes TCP would carry. The body is binary (numpy arrays, default) or JSON; the
server answers each client in the codec of its last request.

Wake-ups go through FIFOs in /dev/shm: one request doorbell that every client rings
after publishing, one reply doorbell per client. Nobody spins: a waiter blocks in the
kernel with a timeout. A client detects the learner's death as EOF on its reply FIFO;
that holds for clients forked from the learner too, which close their inherited copies
of the learner's FIFO ends at fork (see ``doorbell._close_owned_in_child``).
"""
from __future__ import annotations

import itertools
import logging
import os
import time

from shmrl import rllink
from shmrl.transport.base import Closeable, ConnectionClosed, ReplyEncoder
from shmrl.transport.doorbell import Doorbell, PeerGone
from shmrl.transport.ring import (DEFAULT_PREFIX, SHM_DIR, RingCorrupt, _pid_alive, check_shm_space,
                                  fifo_path, segment_name, sweep_stale)
from shmrl.transport.slot import ClientSlot

log = logging.getLogger("shmrl.transport")

def _codec_of_body(body) -> str:
    return "json" if body[:1] == b"{" else "binary"


def _frame_parts(body) -> list:
    # The ring gathers header and body without joining them into one bytes object.
    return [b"%08d" % len(body), body]


def _unframe(payload: bytes) -> memoryview:
    """The body of an RLlink frame (a view, no copy), checked against its length header."""
    n = rllink.parse_header(payload[:rllink.HEADER_LEN])
    if n != len(payload) - rllink.HEADER_LEN:
        raise rllink.ProtocolError(f"frame header announces {n} bytes, "
                                   f"but {len(payload) - rllink.HEADER_LEN} follow it")
    return memoryview(payload)[rllink.HEADER_LEN:]


def ring_bytes_for(frame_bytes: int, minimum: int) -> int:
    """The ring capacity, a power of two of at least ``minimum``, that takes frames of
    ``frame_bytes`` (a frame may fill at most half a ring)."""
    return max(minimum, 1 << (2 * (frame_bytes + 64)).bit_length())


_server_ids = itertools.count()  # several servers in one process get distinct names


class ShmServer(Closeable):
    """The learner's side. Creates, and alone unlinks, every segment and FIFO it uses.

    Names: ``{prefix}_{pid}_s{k}c{i}`` for client i's segment (and ``.fifo`` for its reply
    doorbell), ``{prefix}_{pid}_s{k}requests.fifo`` for the request doorbell.
    """

    MAX_FRAMES_PER_CLIENT = 16  # per poll(), so that one busy client cannot starve the others
    RECHECK_S = 0.01            # how soon a record that failed its checks is looked at again
    REQUEST_RING_BYTES, REPLY_RING_BYTES = 1 << 20, 1 << 18   # defaults: see serving.ring_bytes

    def __init__(self, n_clients: int, *, request_ring_bytes: int = REQUEST_RING_BYTES,
                 reply_ring_bytes: int = REPLY_RING_BYTES, prefix: str = DEFAULT_PREFIX,
                 free_bytes: int | None = None):
        self.prefix, self.n_clients = prefix, n_clients
        self._pid = os.getpid()
        self._slots: list[ClientSlot] = []
        self._reply_bells: list[Doorbell] = []
        self._request_bell: Doorbell | None = None
        self._open = [True] * n_clients
        self._codec = ["binary"] * n_clients
        self._gone: list[str] = []  # closed by the server itself: reported once by poll()
        self._recheck = False       # some ring holds a record that failed its checks
        self._conn_ids = [f"shm:{i}" for i in range(n_clients)]
        self.frames_rejected = 0    # bad frames, each of which closed its connection
        self.clients_timed_out = 0  # a ring's client has no heartbeat timeout (the supervisor watches it)
        self._encode = ReplyEncoder()
        self._closed = False
        swept = sweep_stale(prefix)
        if swept:
            log.info("removed %d files of dead runs from %s: %s", len(swept), SHM_DIR, ", ".join(swept))
        check_shm_space(n_clients * ClientSlot.nbytes(request_ring_bytes, reply_ring_bytes), free_bytes)
        k = next(_server_ids)
        try:
            bell_name = segment_name(prefix, self._pid, f"s{k}requests")
            self._request_bell = Doorbell.create(fifo_path(bell_name))
            for i in range(n_clients):
                slot = ClientSlot.create(segment_name(prefix, self._pid, f"s{k}c{i}"),
                                         request_ring_bytes, reply_ring_bytes, bell_name)
                self._slots.append(slot)
                self._reply_bells.append(Doorbell.create(fifo_path(slot.name)))
        except BaseException:
            self.close()
            raise

    def address(self, i: int) -> str:
        """What client ``i`` passes to ShmClient: the name of its segment."""
        return self._slots[i].name

    def fileno(self) -> int:
        """The request doorbell: readable when some client may have published a request."""
        return self._request_bell.fileno()

    def _index(self, conn_id: str) -> int:
        kind, _, i = conn_id.partition(":")
        if kind != "shm" or not i.isdigit() or int(i) >= self.n_clients:
            raise KeyError(f"not a connection of this server: {conn_id!r}")
        return int(i)

    def poll(self, timeout: float = 0.0) -> list[tuple[str, dict | None]]:
        """Wait up to ``timeout`` s for the doorbell, then return ``(conn_id, msg)`` for every
        request published so far (at most MAX_FRAMES_PER_CLIENT per client). ``msg`` None:
        the connection was closed for a bad frame; forget its state."""
        out = [(c, None) for c in self._gone]
        self._gone.clear()
        if self._recheck:  # a record failed its checks: look again soon even if nobody rings
            timeout = min(timeout, self.RECHECK_S)
        # Drain the doorbell before reading the rings: a request published after our look
        # at a ring rings again afterwards and wakes the next poll.
        self._request_bell.wait(0.0 if out else timeout)
        more = self._recheck = False
        for i, slot in enumerate(self._slots):
            if not self._open[i]:
                continue
            ring = slot.requests
            for _ in range(self.MAX_FRAMES_PER_CLIENT):
                try:
                    payload = ring.read()
                    if payload is None:
                        self._recheck = self._recheck or ring.pending()
                        break
                    body = _unframe(payload)
                    msg = rllink.decode_request(body)
                except Exception as e:  # untrusted input: close this connection only
                    self.frames_rejected += 1
                    self._close(i, f"{type(e).__name__}: {e}")
                    out.append((self._conn_ids[i], None))
                    break
                self._codec[i] = _codec_of_body(body)
                out.append((self._conn_ids[i], msg))
            else:
                more = more or ring.pending()
        if more:
            self._request_bell.ring()  # frames left over: keep fileno() readable
        return out

    def codec_of(self, conn_id: str) -> str:
        """The codec of this client's last request: the one its replies use."""
        return self._codec[self._index(conn_id)]

    def reply(self, conn_id: str, msg: dict) -> None:
        """Write ``msg`` to the client's reply ring. The last reply encoded is kept (by
        identity, per codec): the same SET_STATE goes to every client, encoded once. So do
        not change a message after replying with it."""
        self.reply_encoded(conn_id, self._encode(msg, self.codec_of(conn_id)))

    def reply_encoded(self, conn_id: str, body: bytes) -> None:
        """Write an encoded reply body. Never blocks: a client whose reply ring is
        full is not reading its replies and gets disconnected (reported by the next poll).
        ValueError if the body can never fit the reply ring (raise ``reply_ring_bytes``)."""
        i = self._index(conn_id)
        if not self._open[i]:
            return  # closed meanwhile; poll() reports or has reported it
        try:
            written = self._slots[i].replies.try_write(_frame_parts(body))
        except RingCorrupt as e:  # the client wrote nonsense into its read position
            written, reason = False, f"reply ring: {e}"
        else:
            reason = "reply ring full: the client does not read its replies"
        if not written:
            self._close(i, reason)
            self._gone.append(conn_id)
            self._request_bell.ring()  # so that a selector wakes and poll() reports it
            return
        self._reply_bells[i].ring()  # after publishing: the barrier for the client's read

    def drop(self, conn_id: str, reason: str) -> None:
        """Close a connection from the learner's side (the caller forgets its state itself)."""
        self._close(self._index(conn_id), reason)

    def timed_out(self, conn_id: str) -> bool:
        """Whether this server closed ``conn_id`` for a missed heartbeat: never, on a ring."""
        return False

    def _close(self, i: int, reason: str) -> None:
        if not self._open[i]:
            return
        log.warning("shm:%d: closing connection: %s", i, reason)
        self._open[i] = False
        self._slots[i].set_closed(reason)
        try:
            self._reply_bells[i].ring()  # a client waiting for a reply learns it at once
        except OSError:
            pass

    def env_steps(self, i: int) -> int:
        """Env steps client ``i`` has stepped (its heartbeat): it may have sent fewer."""
        return self._slots[i].env_steps

    def client_pid(self, i: int) -> int | None:
        return self._slots[i].client_pid or None

    def request_unread(self, i: int) -> bool:
        """Whether client ``i`` has a request in its ring that the learner has not read yet:
        it waits on the learner (a learner short of CPU), not the other way round."""
        return self._slots[i].requests.pending()

    def reset(self, i: int) -> None:
        """Make slot ``i`` as new for a replacement client (stop the old one first)."""
        self._slots[i].reset()
        self._reply_bells[i].drain()
        self._open[i], self._codec[i] = True, "binary"
        conn_id = f"shm:{i}"
        self._gone = [c for c in self._gone if c != conn_id]

    def close(self) -> None:
        """Unlink every segment and FIFO this server created. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for thing in [*self._slots, *self._reply_bells, self._request_bell]:
            if thing is not None:
                try:
                    thing.close()
                except OSError as e:
                    log.warning("closing %s: %s", getattr(thing, "name", getattr(thing, "path", thing)), e)

    def __del__(self):  # segments and FIFOs in /dev/shm outlive the process: unlink them
        try:
            self.close()
        except Exception:
            pass


class ShmClient(Closeable):
    """A simulator's side: attaches to its slot by name, never creates or unlinks."""

    def __init__(self, address: str, *, codec: str = "binary", timeout: float = 30.0):
        if codec not in rllink.CODECS:
            raise ValueError(f"codec must be one of {rllink.CODECS}, not {codec!r}")
        self.address, self.codec, self.timeout = address, codec, timeout
        self._slot: ClientSlot | None = None
        self._replies_bell = self._requests_bell = None
        self._peer_gone: PeerGone | None = None  # sticky: once gone, every call says so
        self._slot = ClientSlot.attach(address)
        try:
            pid = self._slot.client_pid
            if pid and pid != os.getpid() and _pid_alive(pid):
                raise ConnectionRefusedError(f"{address} is in use by the live process {pid}")
            self._slot.client_pid = os.getpid()
            self._replies_bell = Doorbell.open(fifo_path(address), "r")
            self._requests_bell = Doorbell.open(fifo_path(self._slot.request_doorbell), "w")
        except BaseException:
            self.close()
            raise

    def send(self, msg: dict) -> None:
        """Send a request that gets no reply (EPISODES)."""
        try:
            self._send(msg)
        except PeerGone as e:
            self._peer_gone = e
            raise

    def _send(self, msg: dict) -> None:
        self._check_open()
        parts = _frame_parts(rllink.encode(msg, self.codec))
        try:
            # The learner is rarely behind; while it is, watch for its death or a close.
            self._slot.requests.write(parts, self.timeout, while_waiting=self._check_learner)
        except TimeoutError:
            raise TimeoutError(f"{self.address}: request ring full for {self.timeout} s") from None
        self._requests_bell.ring()  # after publishing: the barrier for the server's read

    def _check_learner(self) -> None:
        if self._replies_bell.peer_gone():
            raise PeerGone(f"{self.address}: the learner is gone")
        self._check_open()

    def request(self, msg: dict) -> dict:
        """Send a request and wait for its reply (validated). PeerGone if the learner dies,
        ConnectionClosed if it closes this connection, TimeoutError after ``timeout`` s
        (then the connection is out of step, a late reply may still come: close it)."""
        try:
            return self._request(msg)
        except PeerGone as e:
            self._peer_gone = e
            raise

    def _request(self, msg: dict) -> dict:
        self._send(msg)
        deadline = time.monotonic() + self.timeout
        while True:
            payload = self._slot.replies.read()
            if payload is not None:
                return rllink.decode_reply(_unframe(payload))
            self._check_open()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.address}: no reply within {self.timeout} s")
            try:
                self._replies_bell.wait(min(left, 1.0))
            except PeerGone:
                payload = self._slot.replies.read()  # a reply published just before it died
                if payload is not None:
                    return rllink.decode_reply(_unframe(payload))
                raise

    def heartbeat(self, env_steps: int) -> None:
        """Tell the learner how many env steps this simulator has stepped: it counts as
        alive while the number grows (or while the learner itself holds it back), and a
        simulator that dies has lost what it stepped but never sent."""
        self._slot.env_steps = env_steps

    def _check_open(self) -> None:
        if self._peer_gone is not None:
            raise PeerGone(str(self._peer_gone))
        reason = self._slot.closed_reason
        if reason is not None:
            raise ConnectionClosed(f"{self.address}: the learner closed this connection: {reason}")

    def close(self) -> None:
        """Detach (never unlinks). Idempotent."""
        for bell in (self._replies_bell, self._requests_bell):
            if bell is not None:
                bell.close()
        self._replies_bell = self._requests_bell = None
        if self._slot is not None:
            if self._slot.client_pid == os.getpid():
                self._slot.client_pid = 0  # the slot is free again
            self._slot.close()
            self._slot = None

    def __del__(self):  # frees the slot for a replacement client
        try:
            self.close()
        except Exception:
            pass
