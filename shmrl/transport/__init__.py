"""The pluggable transport layer: one RLlink schema, several media.

Every medium has a client side and a server side with the same narrow interface, the
``ClientTransport`` and ``ServerTransport`` protocols of ``shmrl.transport.base`` (each
method's contract is written there, with the one ``ConnectionClosed`` they raise)::

    reply = client.request(msg)    # send a request, wait for its reply (a validated dict)
    client.send(msg)               # send a request that gets no reply (EPISODES)
    client.heartbeat(env_steps)    # env steps stepped so far: liveness where the medium needs it
    client.close()

    server.fileno()                # readable when requests may be waiting (for selectors)
    server.poll(timeout)           # -> [(conn_id, msg)], msg validated; None = connection closed
    server.reply(conn_id, msg)
    server.drop(conn_id, reason)   # close one connection, logging why
    server.timed_out(conn_id)      # closed for missing heartbeats?
    server.frames_rejected, server.clients_timed_out   # counters for the metrics
    server.close()                 # release everything (segments, sockets)

Implementations: ``shm`` (shared-memory rings, the default), ``tcp`` (RLlink's JSON
variant over TCP, for external clients; shmrl's own clients agree on the binary codec and
send heartbeats), ``inproc`` (threads, for tests). All encode with ``rllink.encode``.
"""
from shmrl.transport.base import ClientTransport, ConnectionClosed, ServerTransport, WakePipe

__all__ = ["ClientTransport", "ConnectionClosed", "ServerTransport", "WakePipe", "connect"]


def connect(address: str, timeout: float = 30.0, *, codec: str = "binary",
            name: str | None = None) -> ClientTransport:
    """A client for ``address``: ``shm:SEGMENT`` (a learner's simulator slot) or
    ``tcp:HOST:PORT`` (an RLlink server: shmrl's agrees on ``codec`` and takes heartbeats,
    RLlib's speaks JSON; ``name`` goes into the PING, for the server's logs)."""
    kind, _, rest = address.partition(":")
    if kind == "shm":
        from shmrl.transport.shm import ShmClient
        return ShmClient(rest, timeout=timeout, codec=codec)
    if kind == "tcp":
        from shmrl.transport.tcp_client import TcpClient, parse_address
        return TcpClient(*parse_address(rest), timeout=timeout, codec=codec, client_name=name)
    raise ValueError(f"unknown address {address!r}: expected shm:SEGMENT or tcp:HOST:PORT")
