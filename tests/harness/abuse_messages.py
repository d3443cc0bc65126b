"""Hostile messages, one attack at a time, against a whole ``python -m shmrl.run --sims 0
--tcp-port 0 --auth-token ...``: the learner's memory and a good client's round trips
under each (issue 22, items 13-18).

    python -m tests.harness.abuse_messages [--seconds 5] [--only NAME ...] [--json]
    python -m tests.harness.abuse_messages --quick --json   # seconds: the cheap attacks, short windows

The good client is tests/harness/abuse.py's (a fresh interpreter, RLlib's framing: PING,
GET_STATE and, every --train-every s, EPISODES_AND_GET_STATE, which waits for one PPO
update). Its window 'quiet' comes first, then one window per attack, each attacker a
thread of this process that reconnects whenever the server closes it, and first a
control, 'busy': a second honest client sampling flat out (binary EPISODES_AND_GET_STATE
of one sample each), so that the learner trains without a pause, as it does while a
flooder feeds it (the floods' steps are trained on, up to the flooder's budget at a time):

  flood-binary   EPISODES (no reply) of one sample each, binary codec, as fast as it can
  flood-json     the same in JSON
  huge-binary    one EPISODES of 600,000 one-step chunks (binary)
  huge-json      one JSON EPISODES of 330,000 zero-step chunks (about 59 MB)
  empty          EPISODES_AND_GET_STATE with no chunks, and with one zero-step chunk
  surrogate      a PING whose auth_token is a lone surrogate ("\\ud800", valid JSON)
  agent-ids      multi-agent chunks of made-up agents ("mallory", 10**30, ...)

Each row gives the good client's median round trip per request kind (and the 99th
percentile of PING's and GET_STATE's) and its ratio to 'quiet', the server's VmRSS before and at its peak, what the attacker saw (messages sent,
replies, connections closed) and whether the run still lives. Exit status 0 when, under
every attack, the medians of PING and GET_STATE are within --max-ratio of 'quiet' (for
the floods: of 'quiet' or of 'busy'), the peak VmRSS within --max-growth-mib of the start
and the run alive; else 1; 2 on an error.
"""
from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import threading

import numpy as np

from shmrl import rllink
from shmrl.core.episode import EpisodeBatch
from tools.shared import median, percentile

from .abuse import GoodClient, RssSampler, Server, recv_exactly

TOKEN = "abuse-messages-token"
# --quick: only checks that the tool works (its figures are not ones to quote).
QUICK = {"seconds": 0.5, "only": ["empty", "surrogate", "agent-ids"], "train_every": 0.2}
ATTACKS = ("flood-binary", "flood-json", "huge-binary", "huge-json", "empty", "surrogate", "agent-ids")
CONTROL = "busy"   # not an attack: a second honest client sampling flat out, so the trainer never rests


def chunks(n: int, steps_each: int, seed: int = 0) -> EpisodeBatch:
    """``n`` CartPole-shaped chunks of ``steps_each`` steps (0: an observation only)."""
    rng, steps = np.random.default_rng(seed), n * steps_each
    return EpisodeBatch(obs=rng.normal(0, 0.05, (steps + n, 4)).astype(np.float32),
                        actions=rng.integers(0, 2, steps), rewards=np.ones(steps, np.float32),
                        action_dist_inputs=np.zeros((steps, 2), np.float32),
                        action_logp=np.full(steps, -0.69, np.float32), lengths=np.full(n, steps_each),
                        is_terminated=np.zeros(n, bool), is_truncated=np.zeros(n, bool))


def framed(msg: dict, codec: str) -> bytes:
    return rllink.frame(rllink.encode(msg, codec))


class Attacker:
    """One attack in a thread until ``stop()``: connect, say PING, attack, reconnect when
    the server closes the connection; counts what happened."""

    def __init__(self, name: str, port: int, steps_per_message: int):
        self.name, self.port = name, port
        self.sent = self.replies = self.closed = 0
        self._stop = threading.Event()
        self._frames = self._build(name, steps_per_message)
        self._thread = threading.Thread(target=self._run, name=f"attack-{name}", daemon=True)

    @staticmethod
    def _build(name: str, steps: int) -> dict:
        if name.startswith("flood"):
            codec = name.split("-")[1]
            return {"codec": codec, "frame": framed({"type": "EPISODES", "episodes": chunks(8, steps // 8)}, codec),
                    "reply": False}
        if name == "huge-binary":
            return {"codec": "binary", "frame": framed({"type": "EPISODES", "episodes": chunks(600_000, 1)},
                                                       "binary"), "reply": False}
        if name == "huge-json":
            return {"codec": "json", "frame": framed({"type": "EPISODES", "episodes": chunks(330_000, 0)}, "json"),
                    "reply": False}
        if name == CONTROL:
            return {"codec": "binary", "frame": framed({"type": "EPISODES_AND_GET_STATE",
                                                        "episodes": chunks(8, steps // 8)}, "binary"), "reply": True}
        if name == "empty":
            return {"codec": "json", "frames": [
                framed({"type": "EPISODES_AND_GET_STATE", "episodes": []}, "json"),
                framed({"type": "EPISODES_AND_GET_STATE", "episodes": chunks(1, 0)}, "json")], "reply": True}
        if name == "surrogate":
            return {"codec": "json", "hello": rllink.frame(b'{"type": "PING", "auth_token": "\\ud800"}')}
        if name == "agent-ids":
            eps = [{"obs": [[0.0] * 4] * 3, "actions": [0, 1], "rewards": [1.0, 1.0],
                    "action_dist_inputs": [[0.0, 0.0]] * 2, "action_logp": [-0.69] * 2, "is_terminated": True,
                    "is_truncated": False, "agent_id": agent, "module_id": "shared"}
                   for agent in ("mallory", 10 ** 30 % (1 << 62), "eve")]
            return {"codec": "json", "frame": framed({"type": "EPISODES", "episodes": eps}, "json"), "reply": False}
        raise ValueError(f"unknown attack {name!r}")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=5) as sock:
                    self._session(sock)
            except (OSError, ValueError):
                self.closed += 1
                self._stop.wait(0.01)

    def _reply(self, sock: socket.socket) -> bytes:
        return recv_exactly(sock, rllink.parse_header(recv_exactly(sock, rllink.HEADER_LEN)))

    def _session(self, sock: socket.socket) -> None:
        f = self._frames
        if "hello" in f:   # the attack is the PING itself: the server must close the connection
            sock.sendall(f["hello"])
            self.sent += 1
            if not sock.recv(1):
                raise ConnectionError("closed")
            self.replies += 1
            return
        codecs = {"codecs": ["binary"]} if f["codec"] == "binary" else {}
        sock.sendall(framed({"type": "PING", "auth_token": TOKEN, **codecs}, "json"))
        self._reply(sock)
        if f["reply"]:
            sock.sendall(framed({"type": "GET_STATE"}, "json"))
            self._reply(sock)
        i = 0
        while not self._stop.is_set():
            data = f["frames"][i % len(f["frames"])] if "frames" in f else f["frame"]
            sock.sendall(data)
            self.sent, i = self.sent + 1, i + 1
            if f["reply"]:
                self._reply(sock)
                self.replies += 1

    def stats(self) -> dict:
        return {"sent": self.sent, "replies": self.replies, "closed": self.closed}


def window(good: GoodClient, rss: RssSampler, label: str, seconds: float) -> dict:
    rss.phase = label
    before = rss.now_mib()
    out = good.measure(label, seconds)
    return {"rtt_ms": {k: median(v) * 1000 if v else None for k, v in out["rtt_s"].items()},
            "rtt_p99_ms": {k: percentile(v, 99) * 1000 if v else None for k, v in out["rtt_s"].items()},
            "rss_before_mib": before, "rss_peak_mib": max(rss.of(label), default=before)}


def attack_all(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="shmrl-abuse-messages-") as logdir:
        server = Server(logdir, 64 << 20, extra=("--auth-token", TOKEN))
        rss = RssSampler(server.pid)
        good = None
        try:
            good = GoodClient(server.port, args)
            start_mib = rss.now_mib()
            rows = {"quiet": window(good, rss, "quiet", args.seconds)}
            for name in [CONTROL, *(args.only or ATTACKS)]:
                attacker = Attacker(name, server.port, good.hello["steps_per_message"])
                attacker.start()
                try:
                    row = window(good, rss, name, args.seconds)
                finally:
                    attacker.stop()
                row["attacker"] = attacker.stats()
                row["run_alive"] = server.proc.poll() is None
                rows[name] = row
            alive = server.proc.poll() is None
        finally:
            if good is not None:
                good.stop()
            rss.stop()
            server.stop()
    ok = alive
    for name, row in rows.items():
        row["ratio"] = ratios(row, rows["quiet"])
        row["ratio_to_busy"] = ratios(row, rows[CONTROL])
        if name not in ("quiet", CONTROL):
            # A flood's steps are trained on (the learner never rests, as with 'busy'):
            # its reference is the busier of the two; every other attack's is 'quiet'.
            ref = [row["ratio"]] + ([row["ratio_to_busy"]] if name.startswith("flood") else [])
            within = any(all(r[k] is not None and r[k] <= args.max_ratio for k in ("PING", "GET_STATE")) for r in ref)
            ok &= within and row["run_alive"] and row["rss_peak_mib"] - start_mib <= args.max_growth_mib
    return {"ok": bool(ok), "start_rss_mib": start_mib, "seconds": args.seconds, "rows": rows}


def ratios(row: dict, ref: dict) -> dict:
    return {k: (v / ref["rtt_ms"][k] if v and ref["rtt_ms"].get(k) else None) for k, v in row["rtt_ms"].items()}


def show(result: dict) -> None:
    print(f"server VmRSS at start: {result['start_rss_mib']:.0f} MiB; {result['seconds']:g} s per window")
    print(f"{'attack':<13} {'PING ms':>9} {'GET_STATE ms':>13} {'E&GS ms':>9}  {'p99 P/G ms':>11}  {'x quiet P/G':>11}"
          f"  {'x busy P/G':>11}  {'RSS peak MiB':>12}  {'sent':>7} {'replies':>7} {'closed':>6}  alive")
    for name, row in result["rows"].items():
        rtt, p99, att = row["rtt_ms"], row["rtt_p99_ms"], row.get("attacker", {})

        def ms(k):
            return f"{rtt[k]:.2f}" if rtt.get(k) is not None else "-"

        def pair(ratio):
            return "/".join(f"{ratio[k]:.2f}" if ratio.get(k) else "-" for k in ("PING", "GET_STATE"))
        tail = "/".join(f"{p99[k]:.1f}" if p99.get(k) is not None else "-" for k in ("PING", "GET_STATE"))
        print(f"{name:<13} {ms('PING'):>9} {ms('GET_STATE'):>13} {ms('EPISODES_AND_GET_STATE'):>9}  {tail:>11}  "
              f"{pair(row['ratio']):>11}  {pair(row['ratio_to_busy']):>11}  "
              f"{row['rss_peak_mib']:>12.0f}  {att.get('sent', '-'):>7} {att.get('replies', '-'):>7} "
              f"{att.get('closed', '-'):>6}  {row.get('run_alive', True)}")
    print("ok" if result["ok"] else "FAILED")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.harness.abuse_messages", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=5.0, help="each window (default: %(default)s)")
    p.add_argument("--only", nargs="+", choices=ATTACKS, help="these attacks only")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    p.add_argument("--gap-ms", type=float, default=10.0, help="the good client's pause (default: %(default)s)")
    p.add_argument("--train-every", type=float, default=0.5,
                   help="seconds between the good client's EPISODES_AND_GET_STATE (default: %(default)s)")
    p.add_argument("--max-ratio", type=float, default=2.0, help="largest RTT ratio that passes (default: %(default)s)")
    p.add_argument("--max-growth-mib", type=float, default=512.0,
                   help="largest rise of the server's VmRSS over its start (default: %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help=f"seconds: {QUICK} (flags given still win); checks the tool, not the server")
    if "--quick" in argv:
        p.set_defaults(**QUICK)
    args = p.parse_args(argv)
    args.token = TOKEN
    try:
        result = attack_all(args)
    except KeyboardInterrupt:
        return 130
    except (RuntimeError, TimeoutError, OSError) as e:
        print(f"error: abuse messages: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        show(result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
