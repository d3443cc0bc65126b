"""The TCP RLlink transport's client side (a simulator's, or any external client's in
Python): a blocking socket that reads exactly one reply frame per request within
``timeout``; it offers the binary codec in its PING and keeps HEARTBEATs going while it
samples (see ``shmrl.transport.tcp`` for the server and the two extensions, and
docs/RLLINK.md for the wire)."""
from __future__ import annotations

import math
import socket
import time

from shmrl import rllink
from shmrl.transport.base import Closeable, ConnectionClosed

_T = rllink.MessageType
_PONG = _T.PONG.value
_HEADER = rllink.HEADER_LEN


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (``"[::1]:port"`` for IPv6) -> ``(host, port)``."""
    host, sep, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT with a port from 0 to 65535 (like localhost:5556), "
                         f"got {address!r}")
    return host, int(port)



class TcpClient(Closeable):
    """A simulator's side: one blocking socket; one reply frame read per request.

    ``codec="binary"``: its PING offers the binary codec (and ``client_name``, a name for
    the server's logs); a server that takes it (shmrl's) gets binary frames and
    HEARTBEATs from then on, one that ignores it (RLlib's) JSON throughout. ``"json"``:
    offers nothing, like RLlib's own client."""

    def __init__(self, host: str, port: int, *, timeout: float = 30.0, max_frame_bytes: int = 256 << 20,
                 connect_timeout: float = 10.0, codec: str = "binary", client_name: str | None = None):
        if codec not in rllink.CODECS:
            raise ValueError(f"codec must be one of {rllink.CODECS}, not {codec!r}")
        self.address = f"{host}:{port}"
        self.timeout, self.max_frame_bytes = timeout, max_frame_bytes
        self.offer, self.client_name = codec, client_name
        self.codec = "json"                    # what it sends: binary once the server agreed
        self.heartbeat_s: float | None = None  # set by a server that wants heartbeats
        self._last_sent = time.monotonic()
        self._broken: str | None = None  # once set, the stream is out of step: every call says so
        self._sock: socket.socket | None = socket.create_connection((host, port), timeout=connect_timeout)
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.local_address = self._sock.getsockname()[:2]  # the server names us after it
        except BaseException:
            self.close()
            raise

    def send(self, msg: dict) -> None:
        """Send a request that gets no reply (EPISODES)."""
        data = rllink.frame(rllink.encode(msg, self.codec))
        sock = self._usable()
        self._last_sent = time.monotonic()
        try:
            sock.settimeout(self.timeout)  # for all of sendall, not per chunk
            sock.sendall(data)
        except TimeoutError:
            raise self._fail(TimeoutError(f"{self.address}: could not send within {self.timeout:g} s")) from None
        except OSError as e:
            raise self._fail(ConnectionClosed(f"{self.address}: {e.strerror or e}")) from e

    def request(self, msg: dict) -> dict:
        """Send a request and return its reply (validated). ConnectionClosed (a ConnectionError)
        when the server closes the connection, TimeoutError after ``timeout`` s,
        rllink.ProtocolError for a bad reply; after any of them the connection is unusable."""
        ping = msg.get("type") == _T.PING.value
        if ping and self.offer == "binary":
            msg = {**msg, "codecs": ["binary"]}
        if ping and self.client_name is not None:
            msg = {**msg, "client_name": self.client_name}
        self.send(msg)
        deadline = time.monotonic() + self.timeout
        try:
            n = rllink.parse_header(self._recv_exactly(_HEADER, deadline, "header"), self.max_frame_bytes)
            reply = rllink.decode_reply(self._recv_exactly(n, deadline, "body"))
            self._last_sent = time.monotonic()  # the server's silence clock starts at its reply too
            if ping and reply["type"] == _PONG:
                self._agree(reply)
            return reply
        except rllink.ProtocolError as e:
            raise self._fail(e) from None

    def _agree(self, pong: dict) -> None:
        """Take the codec and heartbeat a PONG names (none: JSON, no heartbeat)."""
        codec, period = pong.get("codec"), pong.get("heartbeat_s")
        if codec is None:
            return
        if codec != "binary" or self.offer != "binary":
            raise rllink.ProtocolError(f"PONG chose the codec {codec!r}, which this client did not offer")
        if period is not None and not (type(period) in (int, float) and 0 < period < math.inf):
            raise rllink.ProtocolError(f"PONG: 'heartbeat_s' must be a number > 0, got {period!r}")
        self.codec, self.heartbeat_s = codec, period

    def heartbeat(self, env_steps: int) -> None:
        """Called once per env step: a HEARTBEAT goes out when the server asked for them and
        nothing was sent for ``heartbeat_s``; so a simulator whose env hangs falls silent."""
        if self.heartbeat_s is not None and time.monotonic() - self._last_sent >= self.heartbeat_s:
            self.send({"type": _T.HEARTBEAT.value, "env_steps": env_steps})

    def _recv_exactly(self, n: int, deadline: float, what: str) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            left = deadline - time.monotonic()
            mid_reply = bool(got) or what == "body"
            try:
                if left <= 0:
                    raise TimeoutError
                self._sock.settimeout(left)
                k = self._sock.recv_into(view[got:])
            except TimeoutError:
                raise self._fail(TimeoutError(f"{self.address}: no reply within {self.timeout:g} s")) from None
            except OSError as e:
                raise self._fail(ConnectionClosed(f"{self.address}: {e.strerror or e}", mid_reply=mid_reply)) from e
            if k == 0:
                where = f" in a reply's {what} after {got} of {n} bytes" if mid_reply else ""
                raise self._fail(ConnectionClosed(f"{self.address}: the server closed the connection{where}",
                                                  mid_reply=mid_reply))
            got += k
        return buf

    def _usable(self) -> socket.socket:
        if self._broken is not None:
            raise ConnectionClosed(f"{self.address}: unusable after an earlier error ({self._broken}); reconnect")
        if self._sock is None:
            raise ConnectionClosed(f"{self.address}: the client is closed")
        return self._sock

    def _fail(self, e: Exception) -> Exception:
        """The stream is out of step (a reply may be half read, or still to come): close it."""
        self._broken = str(e)
        self.close()
        return e

    def close(self) -> None:
        """Idempotent; a request blocked in another thread ends with ConnectionClosed."""
        sock, self._sock = self._sock, None   # taken first: another thread may close it at the same time
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # close() alone would not wake a blocked recv
            except OSError:
                pass
            sock.close()
