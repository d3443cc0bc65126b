"""TCP under abuse: a good client's round-trip times and the learner's memory while four
kinds of hostile clients attack its RLlink port at once.

    python -m tests.harness.abuse [--rounds 3] [--abuse-seconds 12] [--idle 200] [--json]
    python -m tests.harness.abuse --quick --json   # seconds: one short round, 4 MiB frames, 20 idle

Hostile messages, one attack at a time (floods, huge messages, empty ones, a bad token,
foreign agents): tests/harness/abuse_messages.py, which uses this file's server and good client.

The server is the real thing: ``python -m shmrl.run --sims 0 --tcp-port 0`` (no auth
token, the TCP defaults of the command line: 10 s frame timeout, no idle timeout, 64 MiB
frames) in its own process group, learner thread, training thread and torch included.
One good client (a fresh interpreter running this module, raw sockets, RLlib's framing)
times PING->PONG, GET_STATE->SET_STATE and, every --train-every s,
EPISODES_AND_GET_STATE->SET_STATE (which waits for one PPO update on its steps), in
these windows, every round:

  unloaded           nobody else
  abused             all at once, each reconnecting whenever the server drops it:
                     slowloris   a valid PING frame, one byte a second
                     idle        --idle connections, opened and left silent
                     endless     a header announcing the largest body allowed, a body that is
                                 valid JSON as far as it goes, then 'x' non-stop at
                                 --endless-mib-s (default 32: a 64 MiB frame in 2 s)
                     non-reader  --nonreader-rps GET_STATE a second, never reading a SET_STATE
  abused, line rate  the same, the endless client as fast as the socket takes it
  control            only that line-rate stream, aimed at a sink process instead of the
                     server: the load it puts on the machine, without the server's share

On a machine of few cores, a line-rate loopback stream takes about a core at each end,
so 'abused, line rate' measures the machine as much as the server; 'control' says how
much. The gate is the 'abused' window. The server's RSS (VmRSS, read with psutil) is sampled
every 50 ms; which abusers the server dropped, why and when, comes from its log. Figures
are medians over the rounds of each window's median; the load average before and after
is reported, as the machine may be shared.

Exit status: 0 when the good client's median RTT in 'abused' is within --max-ratio (2) of
the unloaded one for every request kind and the server's memory is bounded (see --help),
1 otherwise, 2 on an error, 130 after Ctrl-C. Every process and socket started here is
stopped, on failure and Ctrl-C too; no /dev/shm/shmrl_* file is left.
"""
from __future__ import annotations

# Only the standard library, numpy and shmrl's codec (no torch) at module level, like tools/bench.py.
import argparse
import json
import math
import os
import queue
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from shmrl import rllink
from tools.shared import (cpu_s, finished, group_alive, median, own_shm_files, percentile, print_method,
                          repo_on_pythonpath, rss_kib, started)

# The processes this harness starts for itself run it again, as a module from the repository's root.
SELF = [sys.executable, "-m", "tests.harness.abuse"]
MiB = 1 << 20
KINDS = ("PING", "GET_STATE", "EPISODES_AND_GET_STATE")
REPLY_OF = {"PING": b'"PONG"', "GET_STATE": b'"SET_STATE"', "EPISODES_AND_GET_STATE": b'"SET_STATE"'}
ROLES = ("slowloris", "idle", "endless", "non-reader")
WAIT_S = 60.0  # the longest any single wait may take before the tool gives up


# ---------------------------------------------------------------- small helpers

def frame(msg: dict) -> bytes:
    """A frame as RLlib 2.48's client writes one (json.dumps, 8-digit length header)."""
    return rllink.frame(rllink.encode_json(msg))


# ---------------------------------------------------------------- the server

class Server:
    """``python -m shmrl.run --sims 0 --tcp-port 0`` in its own process group; its output
    read by a thread into timestamped lines."""

    LISTENING = re.compile(r"listening for RLlink clients on (\S+):(\d+)")

    def __init__(self, logdir: str, max_frame_bytes: int, extra: tuple = ()):
        env = repo_on_pythonpath({k: v for k, v in os.environ.items() if k != "SHMRL_AUTH_TOKEN"})  # auth-free
        self.cmd = [sys.executable, "-m", "shmrl.run", "--env", "CartPole-v1", "--sims", "0", "--tcp-port", "0",
                    "--max-frame-bytes", str(max_frame_bytes), "--stop-return", "1e9",
                    "--max-env-steps", str(10 ** 12), "--logdir", logdir, "--log-every", "0", *extra]
        self.lines: list[tuple[float, str]] = []   # (time.monotonic(), line), appended by the reader
        self._new = threading.Condition()
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, start_new_session=True, cwd=logdir)
        self.pid = self.proc.pid
        self.exit_code: int | None = None
        self._reader = threading.Thread(target=self._read, name="abuse-server-log", daemon=True)
        self._reader.start()
        try:
            self.port = int(self.wait_for(self.LISTENING, WAIT_S).group(2))
        except BaseException:
            self.stop()
            raise

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._new:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self._new.notify_all()
        with self._new:
            self.lines.append((time.monotonic(), None))
            self._new.notify_all()

    def wait_for(self, pattern: re.Pattern, timeout: float) -> re.Match:
        deadline, seen = time.monotonic() + timeout, 0
        with self._new:
            while True:
                for _, line in self.lines[seen:]:
                    if line is None:
                        tail = "\n".join(x for _, x in self.lines[-20:] if x)
                        raise RuntimeError(f"shmrl.run exited ({self.proc.wait(5)}) before "
                                           f"{pattern.pattern!r}:\n{tail}")
                    m = pattern.search(line)
                    if m:
                        return m
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"shmrl.run: {pattern.pattern!r} not within {timeout:.0f} s")
                self._new.wait(left)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM to the group (shmrl.run stops as after Ctrl-C; SIGINT would be ignored if
        this tool was started with it ignored, as a background job is), SIGKILL if it is
        not gone in time."""
        if self.exit_code is not None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.exit_code = self.proc.wait(timeout)
                break
            except subprocess.TimeoutExpired:
                print(f"warning: shmrl.run still running {timeout:g} s after {sig.name}", file=sys.stderr, flush=True)
        deadline = time.monotonic() + timeout
        while group_alive(self.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if group_alive(self.pid):
            os.killpg(self.pid, signal.SIGKILL)
        self._reader.join(5)
        self.proc.stdout.close()


class RssSampler:
    """VmRSS of one pid every ``period`` s, in a thread, each sample with its phase."""

    def __init__(self, pid: int, period: float = 0.05):
        self.pid, self.period = pid, period
        self.samples: list[tuple[float, str, int]] = []  # (time.monotonic(), phase, KiB)
        self.phase = "start"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="abuse-rss", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            kib = rss_kib(self.pid)
            if kib is not None:
                self.samples.append((time.monotonic(), self.phase, kib))

    def now_mib(self) -> float:
        kib = rss_kib(self.pid)
        return math.nan if kib is None else kib / 1024

    def of(self, phase: str) -> list[float]:
        return [kib / 1024 for _, p, kib in self.samples if p == phase]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


# ---------------------------------------------------------------- the good client

class GoodClient:
    """This file as a fresh interpreter (``_good-client``): one connection for the whole
    run, told over stdin what to measure, answering one JSON line per window."""

    def __init__(self, port: int, args):
        cmd = [*SELF, "_good-client", "--port", str(port),
               "--gap-ms", str(args.gap_ms), "--train-every", str(args.train_every),
               *(["--token", args.token] if getattr(args, "token", None) else [])]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=repo_on_pythonpath())
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, name="abuse-good-client", daemon=True).start()
        try:
            self.hello = self._answer(WAIT_S)
        except BaseException:
            self.stop()
            raise

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _answer(self, timeout: float) -> dict:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"the good client gave no answer within {timeout:.0f} s") from None
        if line is None:
            raise RuntimeError(f"the good client exited with code {self.proc.wait(5)}")
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"the good client: {out['error']}")
        return out

    def measure(self, label: str, seconds: float) -> dict:
        self.proc.stdin.write(json.dumps({"label": label, "seconds": seconds}) + "\n")
        self.proc.stdin.flush()
        return self._answer(seconds + WAIT_S)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # EOF: it exits after its window, or is killed
                self.proc.wait(1)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(5)


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError(f"the server closed the connection after {got} of {n} bytes")
        got += k
    return bytes(buf)


def exchange(sock: socket.socket, data: bytes, kind: str) -> float:
    """Send one request frame, read its reply frame; the round trip in seconds."""
    t0 = time.perf_counter()
    sock.sendall(data)
    body = recv_exactly(sock, rllink.parse_header(recv_exactly(sock, rllink.HEADER_LEN)))
    rtt = time.perf_counter() - t0
    if REPLY_OF[kind] not in body[:40]:
        raise ConnectionError(f"{kind}: unexpected reply {body[:60]!r}")
    return rtt


def episode_frame(steps: int, rng: np.random.Generator) -> bytes:
    """One finished CartPole-shaped episode of ``steps`` steps, as RLlib's client sends it."""
    obs = rng.normal(0, 0.05, (steps + 1, 4)).astype(np.float32)
    logits = rng.normal(0, 0.1, (steps, 2)).astype(np.float32)
    actions = rng.integers(0, 2, steps)
    shifted = logits - logits.max(axis=1, keepdims=True)
    logp = shifted[np.arange(steps), actions] - np.log(np.exp(shifted).sum(axis=1))
    ep = {"obs": obs.tolist(), "actions": actions.tolist(), "rewards": [1.0] * steps,
          "action_dist_inputs": logits.tolist(), "action_logp": logp.tolist(),
          "is_terminated": True, "is_truncated": False}
    return frame({"type": "EPISODES_AND_GET_STATE", "episodes": [ep], "timesteps": steps})


def good_client(args) -> int:
    """Hidden: the good client. Handshake, warm-up (a few PPO updates: torch is loaded and
    trained once), then one window per command line on stdin."""
    def say(obj):
        print(json.dumps(obj), flush=True)

    try:
        sock = socket.create_connection(("127.0.0.1", args.port), timeout=WAIT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        exchange(sock, frame({"type": "PING", **({"auth_token": args.token} if args.token else {})}), "PING")
        sock.sendall(frame({"type": "GET_CONFIG"}))
        config = json.loads(recv_exactly(sock, rllink.parse_header(recv_exactly(sock, rllink.HEADER_LEN))))
        steps = int(config["env_steps_per_sample"])
        frames = {"PING": frame({"type": "PING"}), "GET_STATE": frame({"type": "GET_STATE"}),
                  "EPISODES_AND_GET_STATE": episode_frame(steps, np.random.default_rng(0))}
        exchange(sock, frames["GET_STATE"], "GET_STATE")
        t0 = time.monotonic()
        for _ in range(3):  # the first answer waits for torch to load and train once
            exchange(sock, frames["EPISODES_AND_GET_STATE"], "EPISODES_AND_GET_STATE")
        for _ in range(50):
            exchange(sock, frames["PING"], "PING")
            exchange(sock, frames["GET_STATE"], "GET_STATE")
        say({"local": "tcp:%s:%d" % sock.getsockname()[:2], "steps_per_message": steps,
             "warmup_s": time.monotonic() - t0, "episode_frame_bytes": len(frames["EPISODES_AND_GET_STATE"])})
    except (OSError, ValueError) as e:
        say({"error": f"handshake: {e!r}"})
        return 1
    gap, train_every = args.gap_ms / 1000, args.train_every
    for line in sys.stdin:
        cmd = json.loads(line)
        rtts: dict[str, list[float]] = {k: [] for k in KINDS}
        replies: list[float] = []  # time.monotonic() of every reply
        start = time.monotonic()
        end, next_train, i = start + cmd["seconds"], start + train_every / 2, 0
        try:
            while time.monotonic() < end:
                if time.monotonic() >= next_train:
                    kind, next_train = "EPISODES_AND_GET_STATE", next_train + train_every
                else:
                    kind, i = KINDS[i % 2], i + 1
                rtts[kind].append(exchange(sock, frames[kind], kind))
                replies.append(time.monotonic())
                time.sleep(gap)
        except (OSError, ValueError) as e:
            say({"error": f"window {cmd['label']}: {e!r} after {time.monotonic() - start:.2f} s"})
            return 1
        gaps = np.diff([start, *replies, time.monotonic()])
        say({"label": cmd["label"], "seconds": time.monotonic() - start, "rtt_s": rtts,
             "max_gap_between_replies_s": float(gaps.max())})
    sock.close()
    return 0


# ---------------------------------------------------------------- the abusers

class Abusers:
    """Hostile clients of ``roles``, as threads of this process, from start() to stop().
    Each reconnects whenever it is dropped; ``idle`` connections stay silent."""

    def __init__(self, port: int, *, roles=ROLES, idle: int = 0, endless_rate: float = 0.0,
                 nonreader_rps: float = 1000.0, max_frame_bytes: int = 64 << 20):
        self.port, self.roles, self.idle_n = port, roles, idle
        self.endless_rate, self.nonreader_rps, self.max_frame_bytes = endless_rate, nonreader_rps, max_frame_bytes
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.socks: set[socket.socket] = set()
        self.conns: dict[str, tuple[str, float]] = {}  # conn_id -> (role, time.monotonic() connected)
        self.stats = {role: {"connections": 0, "bytes_sent": 0, "send_failures": 0} for role in ROLES}
        self.errors: list[str] = []
        self.threads: list[threading.Thread] = []
        self.idle: list[socket.socket] = []

    def connect(self, role: str, rcvbuf: int | None = None) -> socket.socket:
        s = socket.socket()
        with self._lock:
            self.socks.add(s)
        if rcvbuf:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        s.settimeout(5.0)
        s.connect(("127.0.0.1", self.port))
        conn_id = "tcp:%s:%d" % s.getsockname()[:2]
        with self._lock:
            self.conns[conn_id] = (role, time.monotonic())
            self.stats[role]["connections"] += 1
        return s

    def discard(self, s: socket.socket) -> None:
        with self._lock:
            self.socks.discard(s)
        try:
            s.close()
        except OSError:
            pass

    def start(self) -> None:
        for _ in range(self.idle_n):
            self.idle.append(self.connect("idle"))
        for role, fn in (("slowloris", self._slowloris), ("endless", self._endless),
                         ("non-reader", self._non_reader)):
            if role in self.roles:
                t = threading.Thread(target=self._guard, args=(role, fn), name=f"abuse-{role}", daemon=True)
                t.start()
                self.threads.append(t)

    def _guard(self, role: str, fn) -> None:
        while not self._stop.is_set():
            try:
                s = self.connect(role, 4096 if role == "non-reader" else None)
            except OSError as e:
                if not self._stop.is_set():
                    self.errors.append(f"{role}: connect: {e!r}")
                self._stop.wait(0.5)
                continue
            try:
                fn(s)
            except OSError:
                if not self._stop.is_set():  # the server closed it: come back for more
                    self.stats[role]["send_failures"] += 1
            except Exception as e:  # a bug here: report it, do not spin
                self.errors.append(f"{role}: {e!r}")
                return
            finally:
                self.discard(s)

    @staticmethod
    def _closed(s: socket.socket) -> bool:
        """Whether the server has closed ``s`` (EOF or a reset); for sockets that get no data."""
        if not select.select([s], [], [], 0)[0]:
            return False
        try:
            return s.recv(1 << 16, socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def _slowloris(self, s: socket.socket) -> None:
        data = frame({"type": "PING"})
        while not self._stop.is_set():
            for i in range(len(data)):
                if self._closed(s):
                    raise ConnectionResetError("closed by the server")
                s.sendall(data[i:i + 1])
                self.stats["slowloris"]["bytes_sent"] += 1
                if self._stop.wait(1.0):
                    return
            s.recv(1 << 16)  # whole at last (only without a frame timeout): its PONG

    def _endless(self, s: socket.socket) -> None:
        """A header announcing the largest body allowed, then a body that is valid JSON as far
        as it goes (no check of its first bytes can refuse it) and never ends."""
        rate = self.endless_rate * MiB
        s.sendall(b"%08d" % self.max_frame_bytes + b'{"type": "EPISODES", "episodes": [], "pad": "')
        chunk = b"x" * (64 << 10)
        t0, sent = time.monotonic(), 0
        while not self._stop.is_set():
            if rate:
                ahead = sent / rate - (time.monotonic() - t0)
                if ahead > 0 and self._stop.wait(ahead):
                    return
            s.sendall(chunk)
            sent += len(chunk)
            self.stats["endless"]["bytes_sent"] += len(chunk)

    def _non_reader(self, s: socket.socket) -> None:
        rps = self.nonreader_rps
        burst = max(1, round(rps / 20))
        data = frame({"type": "GET_STATE"}) * burst
        t0, n = time.monotonic(), 0
        while not self._stop.is_set():
            ahead = n / rps - (time.monotonic() - t0)
            if ahead > 0 and self._stop.wait(ahead):
                return
            s.sendall(data)  # never reads, not even to look for EOF: a send fails once dropped
            n += burst
            self.stats["non-reader"]["bytes_sent"] += len(data)

    def idle_still_open(self) -> int:
        return sum(not self._closed(s) for s in self.idle)

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            socks = list(self.socks)
        for s in socks:  # wakes a thread blocked in sendall on it
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self.threads:
            t.join(10)
        for s in socks:
            self.discard(s)
        self.idle = []
        alive = [t.name for t in self.threads if t.is_alive()]
        if alive:
            raise RuntimeError(f"abuser threads did not stop: {alive}")


class Sink:
    """This file as a fresh interpreter (``_sink``): accepts connections and throws away
    what they send. The control window aims the line-rate stream at it instead of the
    server: the same load on the machine, none on the server."""

    def __init__(self):
        self.proc = subprocess.Popen([*SELF, "_sink"], env=repo_on_pythonpath(), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        try:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the sink exited with code {self.proc.wait(5)}")
            self.port = int(line)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(5)
        self.proc.stdout.close()


def sink(args) -> int:
    """Hidden: discard whatever arrives, until stdin closes."""
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)

    def drain(conn):
        buf = bytearray(256 << 10)
        with conn:
            try:
                while conn.recv_into(buf):
                    pass
            except OSError:
                pass

    def accept():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=drain, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    sys.stdin.read()  # until the parent closes it (or dies)
    listener.close()
    return 0


# ---------------------------------------------------------------- the measurement

CLOSING = re.compile(r"(tcp:\S+): closing connection: (.*)$")


def drops_from_log(server: Server, conns: dict, since: int) -> list[dict]:
    """The server's 'closing connection' lines from index ``since``, matched to abusers;
    the closes of connections that the abusers themselves ended are left out."""
    out = []
    for t, line in server.lines[since:]:
        m = CLOSING.search(line or "")
        if not m:
            continue
        role, t_connect = conns.get(m.group(1), ("?", None))
        reason = m.group(2)
        kind = reason_kind(reason)
        if kind in ("client left", "client left mid-frame") and role != "?":
            continue
        out.append({"role": role, "conn_id": m.group(1), "reason": reason, "kind": kind,
                    "after_connect_s": None if t_connect is None else t - t_connect})
    return out


def reason_kind(reason: str) -> str:
    for key, kind in (("frame incomplete after", "frame timeout"), ("not reading its replies", "max_out_bytes"),
                      ("max_buffered_bytes", "max_buffered_bytes"), ("client disconnected", "client left"),
                      ("disconnected mid-frame", "client left mid-frame"), ("idle for", "idle timeout"),
                      ("not valid JSON", "invalid JSON at the end of the body")):
        if key in reason:
            return kind
    return reason[:60]


def window_stats(w: dict) -> dict:
    return {k: {"n": len(v), "median_ms": median(v) * 1e3, "p99_ms": percentile(v, 99) * 1e3,
                "max_ms": max(v) * 1e3 if v else math.nan} for k, v in w["rtt_s"].items()}


WINDOWS = ("unloaded", "abused", "abused, line rate", "control")
QUICK = {"rounds": 1, "unloaded_seconds": 1.0, "abuse_seconds": 3.0, "line_rate_seconds": 0.0, "idle": 20,
         "max_frame_bytes": 4 << 20}   # --quick
GATED = "abused"


def window_plan(args) -> list[tuple[str, float]]:
    plan = [("unloaded", args.unloaded_seconds), ("abused", args.abuse_seconds)]
    if args.line_rate_seconds:
        plan += [("abused, line rate", args.line_rate_seconds), ("control", args.line_rate_seconds)]
    return plan


def method_text(args) -> str:
    """How abuse() measures, for the report: the same sentence whatever the outcome."""
    max_frame = args.max_frame_bytes
    rate = f"{args.endless_mib_s:g} MiB/s" if args.endless_mib_s else "line rate"
    return (
        f"`python -m shmrl.run --sims 0 --tcp-port 0 --max-frame-bytes {max_frame}` (its TCP defaults: "
        f"10 s frame timeout, no idle timeout, 64 MiB max_out_bytes, 1024 connections, no auth) in its "
        f"own process group. A good client (its own interpreter, one connection, raw sockets, RLlib "
        f"framing) sends PING and GET_STATE alternately with {args.gap_ms:g} ms between requests, and "
        f"every {args.train_every:g} s an EPISODES_AND_GET_STATE of env_steps_per_sample steps, whose "
        f"SET_STATE comes after one PPO update; after a warm-up (3 updates, 100 requests). Each of "
        f"--rounds {args.rounds}: 'unloaded' {args.unloaded_seconds:g} s; 'abused' {args.abuse_seconds:g} s "
        f"while at once a slowloris sends a PING frame one byte a second, {args.idle} connections sit "
        f"idle, an endless client announces a {max_frame}-byte body, starts it as valid JSON and sends "
        f"'x' at {rate}, a non-reader sends {args.nonreader_rps:g} GET_STATE/s and never reads "
        f"(SO_RCVBUF 4096), each reconnecting whenever dropped"
        + (f"; 'abused, line rate' {args.line_rate_seconds:g} s, the same with the endless client as fast "
           f"as the socket takes it; 'control' {args.line_rate_seconds:g} s, that line-rate stream into a "
           f"sink process instead of the server (the machine's load without the server's)"
           if args.line_rate_seconds else "")
        + ". A last 'unloaded' window follows. Per window: median, p99, max RTT per request kind; "
        "figures: medians over rounds of window medians; ratio: window / unloaded. The gate is the "
        "'abused' window. Server VmRSS every 50 ms; drops and reasons from its log.")


def abuse(args) -> dict:
    max_frame = args.max_frame_bytes
    result = started(
        "abuse", method_text(args),
        rounds=args.rounds, abuse_seconds=args.abuse_seconds, unloaded_seconds=args.unloaded_seconds,
        line_rate_seconds=args.line_rate_seconds, idle=args.idle, endless_mib_s=args.endless_mib_s,
        nonreader_rps=args.nonreader_rps, gap_ms=args.gap_ms, train_every=args.train_every,
        max_frame_bytes=max_frame, max_ratio=args.max_ratio, max_growth_mib=args.max_growth_mib,
        max_drift_mib=args.max_drift_mib)
    server = sampler = client = abusers = sink_proc = None
    tmp = tempfile.TemporaryDirectory(prefix="shmrl-abuse-")
    rounds, drops = [], []
    try:
        t0 = time.monotonic()
        server = Server(tmp.name, max_frame)
        sampler = RssSampler(server.pid)
        client = GoodClient(server.port, args)
        if args.line_rate_seconds:
            sink_proc = Sink()
        result["server"] = {"pid": server.pid, "port": server.port, "command": " ".join(server.cmd[1:]),
                            "ready_s": time.monotonic() - t0, "good_client": client.hello}
        cpu0 = cpu_s([server.pid])
        rss_before = sampler.now_mib()
        for r in range(args.rounds):
            row = {"round": r, "windows": {}, "rss_mib": {}, "abusers": {}}
            for name, seconds in window_plan(args):
                since = len(server.lines)
                if name == "unloaded":
                    abusers = None
                elif name == "control":
                    abusers = Abusers(sink_proc.port, roles=("endless",), max_frame_bytes=max_frame)
                else:
                    abusers = Abusers(server.port, idle=args.idle, nonreader_rps=args.nonreader_rps,
                                      endless_rate=args.endless_mib_s if name == "abused" else 0.0,
                                      max_frame_bytes=max_frame)
                sampler.phase = f"{name} {r}"
                c0 = cpu_s([server.pid])
                if abusers:
                    abusers.start()
                w = client.measure(f"{name} {r}", seconds)
                stats = window_stats(w)
                stats["max_gap_between_replies_s"] = w["max_gap_between_replies_s"]
                stats["server_cpu_s"] = cpu_s([server.pid]) - c0
                rss = sampler.of(f"{name} {r}")
                row["rss_mib"][name] = {"peak": max(rss), "end": sampler.now_mib()}
                if abusers:
                    idle_open = abusers.idle_still_open()
                    errors, conns = abusers.errors, abusers.conns
                    abusers.stop()
                    if errors:
                        raise RuntimeError(f"abusers failed: {errors}")
                    if name != "control":
                        time.sleep(0.3)  # the server logs the closes of the sockets we just closed
                        drops.extend({**d, "round": r, "window": name}
                                     for d in drops_from_log(server, conns, since))
                        row["abusers"][name] = {"idle_open_at_end": idle_open, **abusers.stats}
                    abusers = None
                row["windows"][name] = stats
            rounds.append(row)
        sampler.phase = "after"
        after = client.measure("after", args.unloaded_seconds)
        rss_after = sampler.now_mib()
        result["server"]["cpu_s_total"] = cpu_s([server.pid]) - cpu0
    finally:
        try:
            if abusers is not None:
                abusers.stop()
        finally:
            for thing in (sink_proc, client, sampler):
                if thing is not None:
                    thing.stop()
            if server is not None:
                server.stop()
                left = own_shm_files(server.pid)
                result["cleanup"] = {"server_exit_code": server.exit_code, "shm_files_left": left,
                                     "server_group_alive": group_alive(server.pid)}
                for name in left:  # --sims 0 makes none; never leave one behind if it did
                    os.unlink(f"/dev/shm/{name}")
            tmp.cleanup()
    return finished(summarize(args, result, rounds, drops, after, rss_before, rss_after))


def summarize(args, result: dict, rounds: list[dict], drops: list[dict], after: dict, rss_before: float,
              rss_after: float) -> dict:
    """The figures over rounds, the memory, the drops by window and role, and the gates."""
    result["rounds"] = rounds
    result["after"] = window_stats(after)
    result["drops"] = drops
    summary = {}
    names = [n for n, _ in window_plan(args)]
    for kind in KINDS:
        s = summary[kind] = {}
        for name in names:
            s[name] = {"median_ms": median([x["windows"][name][kind]["median_ms"] for x in rounds]),
                       "p99_ms": median([x["windows"][name][kind]["p99_ms"] for x in rounds]),
                       "max_ms": max(x["windows"][name][kind]["max_ms"] for x in rounds)}
        for name in names[1:]:
            s[name]["ratio"] = s[name]["median_ms"] / s["unloaded"]["median_ms"]
        s["after"] = {"median_ms": result["after"][kind]["median_ms"], "p99_ms": result["after"][kind]["p99_ms"]}
    result["summary"] = summary
    abused = [n for n in names if n != "unloaded" and n != "control"]
    peaks = [max(x["rss_mib"][n]["peak"] for n in abused) for x in rounds]
    rests = [x["rss_mib"]["unloaded"]["end"] for x in rounds] + [rss_after]
    result["memory"] = {
        "rss_before_mib": rss_before, "rss_peak_mib": max(peaks), "rss_after_mib": rss_after,
        "peak_growth_mib": max(peaks) - rss_before, "peaks_by_round_mib": peaks, "at_rest_mib": rests,
        "drift_mib": {"peak": peaks[-1] - peaks[0], "at_rest": rests[-1] - rests[0]},
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
        # Bounded: the peak never exceeds the start by more than --max-growth-mib, and from the
        # first round to the last neither the peak nor the resting RSS climbs by more than
        # --max-drift-mib (what glibc may keep of freed big buffers; see --help).
        "bounded": bool(max(peaks) - rss_before <= args.max_growth_mib
                        and peaks[-1] - peaks[0] <= args.max_drift_mib
                        and rests[-1] - rests[0] <= args.max_drift_mib)}
    by_role = {}
    for d in drops:
        x = by_role.setdefault(d["window"], {}).setdefault(d["role"], {"drops": 0, "reasons": {}, "after_connect_s": []})
        x["drops"] += 1
        x["reasons"][d["kind"]] = x["reasons"].get(d["kind"], 0) + 1
        if d["after_connect_s"] is not None:
            x["after_connect_s"].append(d["after_connect_s"])
    result["drops_by_window_and_role"] = by_role
    result["ok_rtt"] = all(s[GATED]["ratio"] <= args.max_ratio for s in summary.values())
    if "abused, line rate" in names:  # reported, not gated: see 'control'
        result["line_rate_within_max_ratio"] = all(s["abused, line rate"]["ratio"] <= args.max_ratio
                                                   for s in summary.values())
    result["ok"] = result["ok_rtt"] and result["memory"]["bounded"]
    return result


def show(r: dict) -> None:
    p = r["params"]
    names = [n for n in WINDOWS if n in r["summary"]["PING"]]
    print(f"abuse: a good client's round trips to `python -m shmrl.run --sims 0 --tcp-port` while hostile "
          f"clients attack at once; medians over {p['rounds']} rounds (ms; x: ratio to unloaded)")
    head = "".join(f" | {n:>24}" for n in names)
    print(f"  {'request -> reply':<36}{head} | {'after':>14}")
    for kind, s in r["summary"].items():
        cells = ""
        for n in names:
            x = s[n]
            cell = f"{x['median_ms']:.2f} p99 {x['p99_ms']:.1f}" + (f" {x['ratio']:.2f}x" if "ratio" in x else "")
            cells += f" | {cell:>24}"
        print(f"  {kind + ' -> ' + ('PONG' if kind == 'PING' else 'SET_STATE'):<36}{cells} | "
              f"{s['after']['median_ms']:>6.2f} p99 {s['after']['p99_ms']:.1f}")
    print("  per round: PING / GET_STATE / EPISODES_AND_GET_STATE median ms, requests, longest gap "
          "between replies, server cpu-s, server VmRSS peak MiB:")
    for x in r["rounds"]:
        for n in names:
            w = x["windows"][n]
            meds = " / ".join(f"{w[k]['median_ms']:.2f}" for k in KINDS)
            print(f"    {x['round']} {n:<18}: {meds} ms, {sum(w[k]['n'] for k in KINDS):4d} requests, "
                  f"gap {w['max_gap_between_replies_s'] * 1e3:4.0f} ms, cpu {w['server_cpu_s']:5.2f} s, "
                  f"rss {x['rss_mib'][n]['peak']:.1f}")
    m = r["memory"]
    print(f"  server VmRSS: {m['rss_before_mib']:.1f} MiB before; peak under abuse by round "
          f"{', '.join(f'{v:.1f}' for v in m['peaks_by_round_mib'])}; at rest after each round "
          f"{', '.join(f'{v:.1f}' for v in m['at_rest_mib'][1:])}: {'bounded' if m['bounded'] else 'NOT BOUNDED'} "
          f"(peak growth {m['peak_growth_mib']:.1f} MiB, limit {p['max_growth_mib']:g}; drift from the first "
          f"round to the last: peak {m['drift_mib']['peak']:+.1f}, at rest {m['drift_mib']['at_rest']:+.1f} MiB, "
          f"limit {p['max_drift_mib']:g}{'; ' + str(m['malloc_env']) if m['malloc_env'] else ''})")
    print("  dropped by the server (seconds from the abuser's connect to the line in the server's log):")
    for window, roles in r["drops_by_window_and_role"].items():
        for role in [*ROLES, *sorted(set(roles) - set(ROLES))]:
            x = roles.get(role)
            if x is None:
                print(f"    {window:<18} {role:<11}: never dropped")
                continue
            t = x["after_connect_s"]
            reasons = ", ".join(f"{k} x{v}" for k, v in x["reasons"].items())
            when = f"after {min(t):.2f}-{max(t):.2f} s (median {median(t):.2f})" if t else ""
            print(f"    {window:<18} {role:<11}: {x['drops']:3d} drops ({reasons}) {when}")
    for x in r["rounds"]:
        for window, st in x["abusers"].items():
            print(f"    round {x['round']} {window}: idle still open at the end {st['idle_open_at_end']}/{p['idle']}; "
                  + "; ".join(f"{role} {st[role]['connections']} conn, {st[role]['bytes_sent'] / MiB:.1f} MiB sent"
                              for role in ("slowloris", "endless", "non-reader")))
    c = r["cleanup"]
    print(f"  cleanup: shmrl.run exit {c['server_exit_code']} after SIGTERM, its process group gone: "
          f"{not c['server_group_alive']}, /dev/shm files left: {c['shm_files_left'] or 'none'}")
    print(f"  {'PASS' if r['ok'] else 'FAIL'}: '{GATED}' median RTT <= {p['max_ratio']:g}x unloaded for every "
          f"kind: {r['ok_rtt']}; memory bounded: {m['bounded']}")
    if "line_rate_within_max_ratio" in r:
        print(f"  not gated: 'abused, line rate' median RTT <= {p['max_ratio']:g}x unloaded for every kind: "
              f"{r['line_rate_within_max_ratio']} (compare 'control': the same stream aimed at a sink)")


# ---------------------------------------------------------------- command line

def parse_args(argv: list[str]) -> argparse.Namespace:
    if argv[:1] in (["_good-client"], ["_sink"]):  # hidden: processes this tool starts for itself
        p = argparse.ArgumentParser()
        p.add_argument("cmd")
        if argv[0] == "_good-client":
            p.add_argument("--port", type=int, required=True)
            p.add_argument("--gap-ms", type=float, required=True)
            p.add_argument("--train-every", type=float, required=True)
            p.add_argument("--token", default=None)
        return p.parse_args(argv)
    p = argparse.ArgumentParser(prog="python -m tests.harness.abuse", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--quick", action="store_true",
                   help="seconds, not minutes, to check that it works (figures not to quote): one round, "
                        "'unloaded' 1 s, 'abused' 3 s (shorter than the frame timeout: the slowloris is not "
                        "dropped), no line-rate windows, 20 idle, --max-frame-bytes 4 MiB; flags given still win")
    p.add_argument("--rounds", type=int, default=3, help="rounds of windows; figures are medians (default: %(default)s)")
    p.add_argument("--abuse-seconds", type=float, default=12.0,
                   help="'abused' window; longer than the 10 s frame timeout, so that the slowloris is "
                        "dropped (default: %(default)s)")
    p.add_argument("--line-rate-seconds", type=float, default=5.0,
                   help="'abused, line rate' and 'control' windows (0: none) (default: %(default)s)")
    p.add_argument("--unloaded-seconds", type=float, default=3.0, help="'unloaded' window (default: %(default)s)")
    p.add_argument("--idle", type=int, default=200, help="idle connections (default: %(default)s)")
    p.add_argument("--endless-mib-s", type=float, default=32.0,
                   help="the endless client's rate in 'abused', MiB/s (0: line rate) (default: %(default)s)")
    p.add_argument("--nonreader-rps", type=float, default=1000.0,
                   help="GET_STATE requests a second of the non-reader (default: %(default)s)")
    p.add_argument("--gap-ms", type=float, default=10.0,
                   help="the good client's pause between requests (default: %(default)s)")
    p.add_argument("--train-every", type=float, default=0.5,
                   help="seconds between the good client's EPISODES_AND_GET_STATE, one PPO update each "
                        "(default: %(default)s)")
    p.add_argument("--max-frame-bytes", type=int, default=64 << 20,
                   help="the server's --max-frame-bytes, announced by the endless client (default: %(default)s)")
    p.add_argument("--max-ratio", type=float, default=2.0,
                   help="largest 'abused' / 'unloaded' median RTT that passes (default: %(default)s)")
    p.add_argument("--max-growth-mib", type=float, default=512.0,
                   help="largest rise of the server's VmRSS under abuse over its VmRSS before (default: "
                        "%(default)s: an endless frame costs its buffer and a copy, 64 MiB each by default, "
                        "and its decoding)")
    p.add_argument("--max-drift-mib", type=float, default=128.0,
                   help="largest climb, from the first round to the last, of the server's peak and of its "
                        "VmRSS at rest (default: %(default)s). glibc keeps up to 64 MiB per thread arena of "
                        "freed big buffers (its dynamic mmap and trim thresholds follow the largest freed "
                        "block, up to 32 MiB): run with MALLOC_MMAP_THRESHOLD_=131072 (it reaches the "
                        "server) to see the live memory alone, where a leak would show in MiB per round")
    if "--quick" in argv:
        p.set_defaults(**QUICK)
    args = p.parse_args(argv)
    positive = (args.rounds, args.abuse_seconds, args.unloaded_seconds, args.nonreader_rps, args.train_every,
                args.max_frame_bytes, args.max_growth_mib, args.max_drift_mib)
    if min(positive) <= 0 or min(args.idle, args.endless_mib_s, args.line_rate_seconds) < 0:
        p.error("--rounds, --abuse-seconds, --unloaded-seconds, --nonreader-rps, --train-every, "
                "--max-frame-bytes and the limits must be > 0; --idle, --endless-mib-s and "
                "--line-rate-seconds >= 0")
    return args


def _terminate(signum, frame_):
    raise SystemExit(128 + signum)  # unwinds through every finally: processes and sockets go


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if getattr(args, "cmd", None) in ("_good-client", "_sink"):
        # Ctrl-C in a terminal reaches the whole group: the parent stops its workers itself
        # (they end when their stdin closes).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        return good_client(args) if args.cmd == "_good-client" else sink(args)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        result = abuse(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError, OSError) as e:
        print(f"error: abuse: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        show(result)
        print_method(result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
