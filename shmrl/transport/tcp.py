"""TCP RLlink transport: RLlib's JSON variant, for external clients and remote simulators.

A frame is 8 ASCII digits (the body's length) + a JSON body, byte-compatible with RLlib
2.46-2.48 (see docs/RLLINK.md, "Interoperating with RLlib 2.48").

Two shmrl extensions, which a client gets only when it asks (RLlib's never does, so it
keeps getting JSON byte for byte): a PING with ``"codecs": ["binary"]`` is answered with a
PONG carrying ``"codec": "binary"`` and ``"heartbeat_s"``; from then on both sides may
send the rings' binary codec (the server decodes either codec from anyone, and answers
that client in binary), and the client owes a HEARTBEAT at least every ``heartbeat_s``
while it samples. Such a client silent for ``heartbeat_timeout`` while no reply is owed
to it is hung (or its machine is gone): its connection is closed and counted in
``clients_timed_out``.

``TcpServer`` (the learner's side) is a ``ServerTransport`` (see transport/base.py). One
background IO thread owns every socket: it accepts, reads without blocking, refuses a
frame from its header when it is too large, decodes and validates requests, and writes
queued replies as fast as each socket takes them, so a client that waits for SET_STATE,
stalls mid-frame or stops reading never holds up another. Nor does one that floods: a
connection that sends without waiting for replies, and whose frame was costly to
decode (JSON), rests for a multiple of that cost before its next frame is read, and
replies go out before a flooder's next frame is decoded. The learner's thread only trades
queues with it under one lock: ``poll`` takes the validated requests (``fileno()`` is a
``WakePipe``, readable while some wait, woken once per step of the IO thread for all it
decoded); ``drop`` and ``reply`` queue work and wake the IO thread through a second one
(once for all the replies of a ``batched`` block).

``TcpClient`` (a simulator's side, ``shmrl.transport.tcp_client``, importable from here
too) is a ``ClientTransport``: one reply frame per request within ``timeout``.
"""
from __future__ import annotations

import collections
import contextlib
import errno
import logging
import math
import selectors
import socket
import threading
import time

from shmrl import rllink
from shmrl.rllink.act import ActHeads, ActionsFrames
from shmrl.transport.base import Closeable, ReplyEncoder, WakePipe
from shmrl.transport.tcp_conn import BodyLimits, Connection, conn_id_of

log = logging.getLogger("shmrl.transport")

_T = rllink.MessageType
_ANSWERED = frozenset(t.value for t in (_T.PING, _T.GET_CONFIG, _T.GET_STATE, _T.EPISODES_AND_GET_STATE,
                                        _T.ACT))
_PONG = _T.PONG.value
_EPISODES = _T.EPISODES.value
_HEADER = rllink.HEADER_LEN
_READ, _WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE
_LISTENER, _WAKE = object(), object()  # selector tags besides connections


class TcpServer(Closeable):
    """The learner's side: many clients on one port, served by one IO thread."""

    MAX_UNPOLLED = 64        # requests of one connection waiting for poll() before it is not read
    RECV_BYTES = 256 << 10   # one read, so also what may arrive beyond MAX_UNPOLLED
    MAX_ACCEPTS = 64         # per wake-up: a burst of connections cannot starve the clients
    ACCEPT_PAUSE_S = 0.5     # out of file descriptors: try accepting again after this long
    # A connection whose frame took the IO thread t seconds to decode (JSON is the slow one)
    # is not read again for REST_FACTOR * t: one client, flooding, gets at most 1/(1 +
    # REST_FACTOR) of the thread (and of the GIL it holds meanwhile), and the rest is left to
    # the others' requests and replies. Cheaper frames (binary, PINGs) never rest.
    REST_FACTOR = 3.0
    MIN_REST_S = 0.0005

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, max_frame_bytes: int = 64 << 20,
                 frame_timeout: float = 10.0, idle_timeout: float | None = None,
                 max_out_bytes: int = 64 << 20, max_connections: int = 1024,
                 max_buffered_bytes: int = 256 << 20, first_frame_max_bytes: int | None = None,
                 hello_timeout: float = 30.0, heartbeat_s: float = 1.0, heartbeat_timeout: float = 10.0,
                 max_json_frame_bytes: int | None = None, max_binary_frame_bytes: int | None = None,
                 limits: rllink.MessageLimits | None = None, act_limits: BodyLimits | None = None):
        if frame_timeout <= 0 or hello_timeout <= 0 or (idle_timeout is not None and idle_timeout <= 0):
            raise ValueError("frame_timeout, hello_timeout and idle_timeout must be > 0 (idle_timeout None: off)")
        if not 0 < heartbeat_s < heartbeat_timeout:
            raise ValueError("heartbeat_s must be > 0 and below heartbeat_timeout")
        # What a client that asked for the binary codec is told to keep, and how long its
        # silence is borne while it owes the next request (a hung env, a dead machine).
        self.heartbeat_s, self.heartbeat_timeout = heartbeat_s, heartbeat_timeout
        self.clients_timed_out = 0       # connections closed for missing heartbeats
        self._timed_out: collections.deque = collections.deque(maxlen=1024)  # their conn_ids, latest last
        # A connection that has sent no byte this long after connecting is closed: every RLlink
        # client starts with a PING, and silent sockets must not fill max_connections. (Once a
        # client has spoken, silence may just be sampling: only idle_timeout ends that.)
        self.hello_timeout = hello_timeout
        if max_frame_bytes < 0 or min(max_out_bytes, max_connections, max_buffered_bytes) <= 0:
            raise ValueError("max_frame_bytes must be >= 0, max_out_bytes, max_connections and "
                             "max_buffered_bytes > 0")
        self.max_frame_bytes, self.max_out_bytes = max_frame_bytes, max_out_bytes
        # Each codec's frames may be held smaller, judged from the body's first 4 bytes: JSON
        # costs the IO thread far more per byte (a 59 MB frame of tiny episodes: seconds when no
        # other client is read); a binary frame need not exceed the largest ``limits`` allow.
        self.body_limits = BodyLimits(max_frame_bytes if max_json_frame_bytes is None else max_json_frame_bytes,
                                      max_frame_bytes if max_binary_frame_bytes is None else max_binary_frame_bytes)
        # A client whose PING asks for server-side inference sends ACTs: none beyond ``act_limits``
        # (the largest ACT of the run's env), unless its PONG does not grant it.
        self.act_limits = None if act_limits is None else act_limits.within(self.body_limits)
        self.limits = limits
        # The largest first frame of a connection: with an auth token the first request must
        # be a PING, so nobody unauthenticated gets a big frame read and decoded.
        self.first_frame_max_bytes = max_frame_bytes if first_frame_max_bytes is None else first_frame_max_bytes
        # Incomplete frames of all connections together: many clients each sending a large
        # frame must not take the machine's memory (the largest one is closed instead).
        self.max_buffered_bytes = max_buffered_bytes
        self._encode = ReplyEncoder(framed=True)
        self._act_heads = ActHeads(lambda body: rllink.decode_request(body, self.limits))
        self._actions_frame = ActionsFrames()
        self.frame_timeout, self.idle_timeout = frame_timeout, idle_timeout
        self.max_connections = max_connections
        self._lock = threading.Lock()
        self._inbox: list[tuple[Connection, dict | None]] = []  # for poll(); None: closed
        self._conns: dict[str, Connection] = {}   # the open connections
        self._todo: set[Connection] = set()       # replies to write, a close or a resume for the IO thread
        self._wake_pending = False           # a byte is in the wake pipe
        self._batching = False               # inside batched(): replies wake the IO thread at its end
        self._ready_owed = False             # requests queued this step; the ready pipe not yet woken (IO thread)
        self._stopping = self._closed = False
        self._refused = 0                    # connections refused since the last one accepted
        self.frames_rejected = 0             # bad frames, each of which closed its connection
        self._accept_paused_until: float | None = None
        self._tick = max(0.01, min(1.0, frame_timeout / 4, hello_timeout / 4, (idle_timeout or math.inf) / 4,
                                   heartbeat_timeout / 8))
        self._next_check = 0.0
        self._resting: set[Connection] = set()   # connections with a rest_until (IO thread)
        self._recv_buf = memoryview(bytearray(self.RECV_BYTES))
        self._listener = self._selector = self._thread = None
        self._ready = self._wake = None
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            self._listener = socket.create_server((host, port), family=family,
                                                  backlog=max(128, socket.SOMAXCONN))  # SO_REUSEADDR on POSIX
            self._listener.setblocking(False)
            self.address: tuple[str, int] = self._listener.getsockname()[:2]
            self._ready = WakePipe()  # readable while requests wait: fileno()
            self._wake = WakePipe()   # wakes the IO thread
            self._selector = selectors.DefaultSelector()
            self._selector.register(self._listener, _READ, _LISTENER)
            self._selector.register(self._wake.fileno(), _READ, _WAKE)
            self._thread = threading.Thread(target=self._run, name=f"shmrl-tcp-{self.address[1]}", daemon=True)
            self._thread.start()
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- the learner's thread

    def fileno(self) -> int:
        """Readable while requests (or closed connections) wait for poll()."""
        return self._ready.fileno()

    def poll(self, timeout: float = 0.0) -> list[tuple[str, dict | None]]:
        """Wait up to ``timeout`` s for requests, then return every ``(conn_id, msg)`` queued,
        in arrival order. ``msg`` None: that connection closed (once per connection); forget
        its state. Nothing more arrives from a connection after drop()."""
        if self._closed:
            return []
        if timeout > 0:
            self._ready.wait(timeout)
        out, resume = [], False
        with self._lock:
            items, self._inbox = self._inbox, []
            if items:
                self._ready.drain()
            for conn, msg in items:
                if msg is None:
                    out.append((conn.conn_id, None))
                    continue
                conn.unpolled -= 1
                if conn.reason is not None:  # dropped by the learner since it arrived
                    continue
                if conn.paused and not conn.closed:
                    conn.paused, resume = False, True
                    self._todo.add(conn)
                out.append((conn.conn_id, msg))
            if resume:
                self._wake_io_locked()
        return out

    def reply(self, conn_id: str, msg: dict) -> None:
        """Queue ``msg`` for ``conn_id`` in its codec (JSON unless it asked for binary); never
        blocks. Unknown or closed: ignored. A client with more than ``max_out_bytes`` of
        replies unread is disconnected. ``msg`` is not copied (the same SET_STATE goes to
        many clients): do not change it afterwards."""
        with self._lock:  # conn.codec changes only here, in this thread
            conn = self._conns.get(conn_id)
            if conn is None or conn.closed:
                return
            codec, negotiate = conn.codec, conn.offered and msg["type"] == _PONG
            if conn.asked and msg["type"] == _PONG:   # a PONG that does not grant it lifts the ACT bound
                conn.asked, conn.limits = False, conn.limits if msg.get("inference") == "server" else self.body_limits
        if negotiate:  # the answer to a PING that offered the binary codec: still JSON
            agreed = {**msg, "codec": "binary", "heartbeat_s": self.heartbeat_s}
            data = rllink.frame(rllink.encode(agreed, "json"))
        else:
            data = (codec == "binary" and self._actions_frame(msg)
                    or self._encode(msg, codec))  # SET_STATE goes to every waiting client: encoded once
        with self._lock:
            if conn.closed:
                return
            if negotiate:
                conn.codec, conn.heartbeat, conn.offered = "binary", True, False
            conn.owed = max(0, conn.owed - 1)
            conn.out.append(data)
            conn.out_bytes += len(data)
            if conn.out_bytes > self.max_out_bytes:
                self._close_later_locked(conn, f"not reading its replies: {conn.out_bytes} bytes queued "
                                               f"(max_out_bytes {self.max_out_bytes})")
            self._todo.add(conn)
            if not self._batching:
                self._wake_io_locked()

    @contextlib.contextmanager
    def batched(self):
        """The replies of this block (the ACTIONS of one forward pass) go out together at its
        end: the IO thread is woken once, not at the first to take the GIL in turns with the
        thread still replying (which costs much of the server's CPU per ACT with many clients)."""
        self._batching = True
        try:
            yield
        finally:
            self._batching = False
            with self._lock:
                if self._todo:
                    self._wake_io_locked()

    def hold(self, conn_id: str, held: bool = True) -> None:
        """Stop reading ``conn_id`` (backpressure: the learner has enough of its steps), or
        with ``held`` False read it again. Its replies still go out; while held it cannot
        time out. Unknown or closed: ignored."""
        with self._lock:
            conn = self._conns.get(conn_id)
            if conn is None or conn.closed or conn.held == held:
                return
            conn.held = held
            self._todo.add(conn)
            self._wake_io_locked()

    def timed_out(self, conn_id: str) -> bool:
        """Whether ``conn_id`` was closed for missing HEARTBEATs (one of the last 1024)."""
        with self._lock:
            return conn_id in self._timed_out

    def drop(self, conn_id: str, reason: str) -> None:
        """Close one connection, logging ``reason``; poll() reports it closed (msg None)."""
        with self._lock:
            conn = self._conns.get(conn_id)
            if conn is not None and not conn.closed:
                self._close_later_locked(conn, reason)

    def close(self) -> None:
        """Stop the IO thread and close every socket. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = self._stopping = True
            if self._thread is not None:
                self._wake_io_locked()
        if self._thread is not None:
            self._thread.join(10)
            if self._thread.is_alive():  # stuck: leave it the pipes it still uses
                log.warning("TCP IO thread did not stop within 10 s")
                return
        else:
            self._release()
        for pipe in (self._ready, self._wake):
            if pipe is not None:
                pipe.close()

    def _close_later_locked(self, conn: Connection, reason: str) -> None:
        conn.closed, conn.reason = True, reason
        self._todo.add(conn)
        self._wake_io_locked()

    def _wake_io_locked(self) -> None:
        if not self._wake_pending:
            self._wake_pending = True
            self._wake.wake()

    # ---------------------------------------------------------------- the IO thread

    def _run(self) -> None:
        try:
            while not self._stopping:
                try:
                    self._step()
                except Exception:  # a bug here must not end the thread: every client would hang
                    log.exception("TCP IO thread: unexpected error; carrying on")
                    time.sleep(0.1)
                finally:
                    self._signal_ready()
        finally:
            self._release()

    def _step(self) -> None:
        timeout = self._tick
        if self._resting:
            timeout = max(0.0, min(timeout, min(c.rest_until for c in self._resting) - time.monotonic()))
        ready = self._selector.select(0.0 if self._resting else timeout)
        if self._resting and not ready and len(self._conns) <= 1:
            # Nobody else to make room for: a rest would only slow the client that earned it
            # (one JSON client sending flat out would run at a fraction of its speed). With others connected
            # it holds, idle or not: a request may arrive any moment, and must not find the
            # thread in a flooder's next decode (which would hold an honest PING up many times over).
            self._wake_rested(math.inf)
            return
        if self._resting and not ready:
            ready = self._selector.select(timeout)
        for key, mask in ready:
            if key.data is _LISTENER:
                self._accept()
            elif key.data is not _WAKE:
                self._guarded(key.data, self._serve, mask)
        if self._wake_pending:
            self._take_work()
        now = time.monotonic()
        if self._resting:
            self._wake_rested(now)
        if now >= self._next_check:
            self._next_check = now + self._tick
            self._check_timers(now)

    def _guarded(self, conn: Connection, fn, *args) -> None:
        """Run ``fn(conn, *args)``; an unexpected exception closes this connection only."""
        if conn.sock is None:
            return
        try:
            fn(conn, *args)
        except Exception as e:
            log.error("%s: unexpected error", conn.conn_id, exc_info=True)
            self._close(conn, f"internal error: {e!r}"[:300])

    def _accept(self) -> None:
        for _ in range(self.MAX_ACCEPTS):
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("cannot accept connections (%s); trying again in %g s",
                                e.strerror, self.ACCEPT_PAUSE_S)
                    self._selector.unregister(self._listener)
                    self._accept_paused_until = time.monotonic() + self.ACCEPT_PAUSE_S
                    return
                continue  # the client gave up before we accepted it (ECONNABORTED and the like)
            conn_id = conn_id_of(peer)
            if len(self._conns) >= self.max_connections:
                if not self._refused:
                    log.warning("%s: refused: %d connections open (max_connections); refusing more "
                                "until one closes", conn_id, len(self._conns))
                self._refused += 1
                sock.close()
                continue
            if self._refused:
                log.info("accepting connections again after refusing %d", self._refused)
                self._refused = 0
            conn = Connection.accepted(sock, conn_id, self.body_limits)
            if conn is None:
                continue
            with self._lock:
                self._conns[conn_id] = conn
            log.info("%s: connected", conn_id)
            self._guarded(conn, self._set_events)

    def _serve(self, conn: Connection, mask: int) -> None:
        if mask & _READ and not conn.stopped(time.monotonic()):
            self._read(conn)
        if mask & _WRITE and conn.sock is not None:
            self._write(conn)

    def _read(self, conn: Connection) -> None:
        try:
            n = conn.sock.recv_into(self._recv_buf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._disconnected(conn, e)
            return
        if n == 0:
            self._disconnected(conn)
            return
        now = conn.last_traffic = time.monotonic()
        if not conn.inbuf:
            conn.frame_start = now
        conn.inbuf += self._recv_buf[:n]
        if len(conn.inbuf) > self.RECV_BYTES and self._buffered() > self.max_buffered_bytes:
            largest = max((c for c in self._conns.values() if c.sock is not None), key=lambda c: len(c.inbuf))
            self._close(largest, f"incomplete frames of all clients exceed max_buffered_bytes "
                                 f"({self.max_buffered_bytes}): this one is the largest "
                                 f"({largest.frame_progress()})")
            if largest is conn:
                return
        self._parse(conn, now)

    def _buffered(self) -> int:
        """Bytes of incomplete frames held for all connections (IO thread)."""
        return sum(len(c.inbuf) for c in self._conns.values())

    def _parse(self, conn: Connection, now: float) -> None:
        """Deliver every complete frame in the buffer; the header is checked before the body
        is waited for, so an oversize or malformed frame is refused from its first 8 bytes."""
        buf = conn.inbuf
        try:
            while True:
                if conn.body_len is None:
                    if len(buf) < _HEADER:
                        return
                    conn.body_len = rllink.parse_header(
                        buf[:_HEADER], self.max_frame_bytes if conn.frames else self.first_frame_max_bytes)
                end = _HEADER + conn.body_len
                if len(buf) >= _HEADER + 4 or len(buf) >= end:
                    conn.limits.check(conn.body_len, buf[_HEADER:_HEADER + 4] == rllink.MAGIC)
                if len(buf) < end:
                    return
                body = bytes(memoryview(buf)[_HEADER:end])  # one copy; the view is gone before del
                del buf[:end]
                conn.body_len, conn.frame_start = None, now
                conn.frames += 1
                started = time.perf_counter()
                msg = self._act_heads(body)   # rllink.decode_request, a binary ACT's head parsed once
                if msg["type"] == _EPISODES or buf:   # it sends without waiting for replies
                    self._rest(conn, time.perf_counter() - started)
                if not self._deliver(conn, msg):
                    return
                if conn.stopped(now):
                    return   # what else was read waits in the buffer until it may be read again
        except rllink.ProtocolError as e:
            self.frames_rejected += 1
            self._close(conn, str(e))
        finally:
            if conn.sock is not None and conn.stopped(now):
                self._set_events(conn)  # stop reading until poll() catches up or the rest ends

    def _rest(self, conn: Connection, cost: float) -> None:
        """Fairness: after a frame that cost ``cost`` s to decode, ``conn`` waits its turn. Only
        a client that sends without waiting for replies (EPISODES, or frames pipelined behind
        this one) rests: one that waits for each reply is paced by the replies already."""
        if cost >= self.MIN_REST_S:
            conn.rest_until = time.monotonic() + self.REST_FACTOR * cost
            self._resting.add(conn)

    def _wake_rested(self, until: float) -> None:
        """Read again the connections whose rest is over by ``until`` (inf: all of them), and
        their frames already in."""
        now = time.monotonic()
        for conn in [c for c in self._resting if c.rest_until <= until]:
            self._resting.discard(conn)
            conn.rest_until = 0.0
            if conn.sock is not None:
                self._guarded(conn, self._set_events)
                if conn.inbuf and not conn.stopped(now):
                    self._guarded(conn, self._parse, now)

    def _deliver(self, conn: Connection, msg: dict) -> bool:
        with self._lock:
            if conn.closed:  # dropped meanwhile
                return False
            conn.unpolled += 1
            if msg["type"] in _ANSWERED:
                conn.owed += 1
            if msg["type"] == _T.PING.value:
                conn.offered = "binary" in msg.get("codecs", ())
                conn.asked = self.act_limits is not None and msg.get("inference") == "server"
                conn.limits = self.act_limits if conn.asked else self.body_limits
            # After EPISODES (no reply, so nothing else paces the client) the connection
            # is not read until the learner has taken it: a flooder over its budget gets
            # held (``hold``) before more of its frames are decoded only to be dropped.
            if conn.unpolled >= self.MAX_UNPOLLED or msg["type"] == _EPISODES:
                conn.paused = True
            self._queue_locked(conn, msg)
        return True

    def _queue_locked(self, conn: Connection, msg: dict | None) -> None:
        if not self._inbox:
            self._ready_owed = True   # woken at the end of this step (_signal_ready)
        self._inbox.append((conn, msg))

    def _signal_ready(self) -> None:
        """Wake the learner's thread once for all the requests of a step of the IO thread, so
        that it answers them in one round (server-side inference: one forward pass)."""
        if self._ready_owed:
            self._ready_owed = False
            with self._lock:
                if self._inbox:
                    self._ready.wake()

    def _take_work(self) -> None:
        """Replies, closes and resumes that the learner's thread queued."""
        with self._lock:
            self._wake_pending = False
            self._wake.drain()
            todo, self._todo = self._todo, set()
            work = []
            for conn in todo:
                work.append((conn, conn.out, conn.reason))
                conn.out = []
        for conn, frames, reason in work:
            if reason is not None:
                self._guarded(conn, self._close, reason)
            else:
                conn.sendq.extend(frames)
                self._guarded(conn, self._write)
        # Every reply is on its way before a resumed flooder's next frame is decoded: that
        # decode would otherwise hold up the reply the learner has just queued.
        for conn, _, reason in work:
            if reason is None and conn.inbuf and conn.sock is not None and not conn.stopped(time.monotonic()):
                self._guarded(conn, self._parse, time.monotonic())   # frames read before a pause

    def _write(self, conn: Connection) -> None:
        try:
            sent = conn.write_queued()
        except OSError as e:
            self._disconnected(conn, e)
            return
        if sent:
            with self._lock:
                conn.out_bytes -= sent
        self._set_events(conn)

    def _set_events(self, conn: Connection) -> None:
        want = (0 if conn.stopped(time.monotonic()) else _READ) | (_WRITE if conn.sendq else 0)
        if want == conn.events:
            return
        if want & _READ and not conn.events & _READ and conn.inbuf:
            conn.frame_start = time.monotonic()  # the pause was ours, not the client's
        if not conn.events:
            self._selector.register(conn.sock, want, conn)
        elif not want:
            self._selector.unregister(conn.sock)
        else:
            self._selector.modify(conn.sock, want, conn)
        conn.events = want

    def _check_timers(self, now: float) -> None:
        if self._accept_paused_until is not None and now >= self._accept_paused_until:
            self._accept_paused_until = None
            self._selector.register(self._listener, _READ, _LISTENER)
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:
            self._guarded(conn, self._check_conn, now)

    def _check_conn(self, conn: Connection, now: float) -> None:
        overdue = conn.overdue(now, self)
        if overdue is not None:
            reason, hung = overdue
            if hung:
                with self._lock:
                    self.clients_timed_out += 1
                    self._timed_out.append(conn.conn_id)
            self._close(conn, reason)

    def _disconnected(self, conn: Connection, error: OSError | None = None) -> None:
        self._close(conn, *conn.disconnected(error))

    def _close(self, conn: Connection, reason: str, level: int = logging.WARNING) -> None:
        """Close the socket and report the connection closed through poll(), once."""
        sock = conn.sock
        if sock is None:
            return
        log.log(level, "%s: closing connection: %s", conn.conn_id, reason)
        conn.sock = None
        self._resting.discard(conn)
        try:
            if conn.events:
                self._selector.unregister(sock)
        except (KeyError, ValueError, OSError):
            pass
        conn.drain_input(sock)
        sock.close()
        conn.events = 0
        conn.sendq.clear()
        del conn.inbuf[:]
        with self._lock:
            conn.closed = True
            conn.out, conn.out_bytes = [], 0
            if self._conns.get(conn.conn_id) is conn:
                del self._conns[conn.conn_id]
            self._todo.discard(conn)
            self._queue_locked(conn, None)

    def _release(self) -> None:
        with self._lock:
            conns = list(self._conns.values())
            self._conns.clear()
        for conn in conns:
            if conn.sock is not None:
                conn.sock.close()
                conn.sock = None
        for thing in (self._selector, self._listener):
            if thing is not None:
                thing.close()
