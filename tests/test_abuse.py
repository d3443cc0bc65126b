"""TCP under abuse, all at once: a slowloris, 200 idle connections, an endless frame and a
client that never reads its SET_STATE, against the real TcpServer and Hub, while a good
client's round trips are timed side by side with an unloaded window.

The abusers are tests/harness/abuse.py's own (that tool measures the same against a whole
``python -m shmrl.run``, with the command line's timeouts); here the server's limits are
scaled down so that every abuser is dropped within seconds.
"""
import json
import statistics
import time

import numpy as np
import psutil

from conftest import conn_id_of, episodes_msg, log_lines, recv_frame, rllib_frame
from harness import abuse as abuse_tool

FRAME_TIMEOUT = 1.0
MAX_FRAME = 4 << 20
MAX_OUT = 1 << 20
STATE = "x" * (32 << 10)        # each SET_STATE: 32 KiB, so the non-reader owes 1 MiB after ~32


def rss_mib() -> float:
    return psutil.Process().memory_info().rss / (1 << 20)


def held_bytes(server) -> tuple[int, int]:
    """Bytes of incomplete frames of all connections together, and the most bytes of
    replies queued for one connection."""
    with server._lock:
        conns = list(server._conns.values())
        return sum(len(c.inbuf) for c in conns), max((c.out_bytes for c in conns), default=0)


def good_window(sock, seconds: float, server, samples: list) -> tuple[list[float], float]:
    """PING, GET_STATE and EPISODES_AND_GET_STATE in turn for ``seconds``: their round
    trips, and the longest time between two replies. The server's held bytes go to
    ``samples`` after every reply."""
    frames = [(rllib_frame({"type": "PING"}), b'"PONG"'), (rllib_frame({"type": "GET_STATE"}), b'"SET_STATE"'),
              (rllib_frame(episodes_msg(8, seed=1)), b'"SET_STATE"')]
    rtts, start = [], time.monotonic()
    last, longest, i = start, 0.0, 0
    while time.monotonic() - start < seconds:
        data, expect = frames[i % 3]
        i += 1
        t0 = time.perf_counter()
        sock.sendall(data)
        reply = recv_frame(sock)
        rtts.append(time.perf_counter() - t0)
        assert expect in reply[8:40], reply[:60]
        now = time.monotonic()
        longest, last = max(longest, now - last), now
        samples.append(held_bytes(server))
        time.sleep(0.003)
    return rtts, max(longest, time.monotonic() - last)


def test_four_abusers_at_once_leave_the_good_client_served_and_memory_bounded(net, caplog):  # noqa: F811
    server = net.server(frame_timeout=FRAME_TIMEOUT, max_frame_bytes=MAX_FRAME, max_out_bytes=MAX_OUT)
    hub = net.hub(server, onnx_file=STATE)                      # publishes at once: an instant update
    good = net.raw(server)
    good_id = conn_id_of(good)
    samples: list = []
    good_window(good, 0.3, server, samples)                     # warm-up
    unloaded, unloaded_gap = good_window(good, 1.0, server, samples)
    rss0 = rss_mib()
    abusers = abuse_tool.Abusers(server.address[1], idle=200, endless_rate=16.0, nonreader_rps=1000.0,
                                 max_frame_bytes=MAX_FRAME)
    try:
        abusers.start()
        abused, abused_gap = good_window(good, 3.0, server, samples)
        rss1 = rss_mib()
        idle_open = abusers.idle_still_open()
        roles = {conn_id: role for conn_id, (role, _) in abusers.conns.items()}
        connected = {conn_id: t for conn_id, (_, t) in abusers.conns.items()}
        stats = json.loads(json.dumps(abusers.stats))
        assert not abusers.errors, abusers.errors
    finally:
        abusers.stop()
    again, _ = good_window(good, 0.5, server, samples)          # and after: still the same connection

    # The good client was answered all through, about as fast as before: the median round
    # trip within 3x (or 5 ms: below that it is the machine's noise), and with its pauses of
    # 3 ms between requests at least a third as many replies per second.
    med_u, med_a = statistics.median(unloaded), statistics.median(abused)
    rate_u, rate_a = len(unloaded) / 1.0, len(abused) / 3.0
    seen = (f"median RTT {med_u * 1e3:.2f} ms unloaded, {med_a * 1e3:.2f} ms abused; p99 "
            f"{np.percentile(unloaded, 99) * 1e3:.1f} / {np.percentile(abused, 99) * 1e3:.1f} ms; replies/s "
            f"{rate_u:.0f} / {rate_a:.0f}; longest gap {unloaded_gap * 1e3:.0f} / {abused_gap * 1e3:.0f} ms")
    assert med_a <= max(3 * med_u, 0.005), seen
    assert rate_a >= rate_u / 3 and abused_gap < 1.0, seen
    assert again and good_id not in hub.closed()

    # Memory: what the server held never went past its limits (the endless client's frame,
    # at most max_frame_bytes and one read beyond; replies owed to a non-reader, at most
    # max_out_bytes and one reply), and this process did not grow by more than that.
    worst_in, worst_out = max(s[0] for s in samples), max(s[1] for s in samples)
    assert worst_in <= MAX_FRAME + 8 + server.RECV_BYTES + 1024, worst_in
    assert worst_out <= MAX_OUT + len(STATE) + 1024, worst_out
    assert rss1 - rss0 < 64, (rss0, rss1)

    # Each kind of abuser was dropped, for its own reason, in its own time; idle ones never.
    reasons: dict[str, set] = {}
    for conn_id, role in roles.items():
        for line in log_lines(caplog, conn_id):
            reasons.setdefault(role, set()).add(abuse_tool.reason_kind(line.split("closing connection: ", 1)[1]))
    assert "frame timeout" in reasons.get("slowloris", ()), reasons
    clock = time.time() - time.monotonic()                      # caplog's clock minus the abusers'
    slow = [(r.created - clock) - connected[conn_id] for r in caplog.records
            for conn_id in [r.getMessage().split(": ", 1)[0]] if roles.get(conn_id) == "slowloris"
            and "frame incomplete" in r.getMessage()]
    assert slow and all(FRAME_TIMEOUT <= t < FRAME_TIMEOUT + 1.0 for t in slow), slow
    assert "invalid JSON at the end of the body" in reasons.get("endless", ()), reasons
    assert "max_out_bytes" in reasons.get("non-reader", ()), reasons
    assert stats["endless"]["connections"] >= 3 and stats["non-reader"]["connections"] >= 2, stats
    assert "idle" not in reasons and idle_open == 200, (reasons.get("idle"), idle_open)
    assert set(hub.closed()) <= set(roles)                      # nobody else was closed
