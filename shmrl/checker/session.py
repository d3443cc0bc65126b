"""The conformance checker's scripted server: it starts the client under test, leads it
through two connections (``Checker.run``: the handshake, a held reply, a new policy
version, a refused reply, a reconnect with a changed config) and judges every frame with
the rules of ``shmrl.checker.rules``. ``python -m shmrl.conformance`` is its command line.
"""
from __future__ import annotations

import os
import select
import shlex
import socket
import subprocess
import sys
import threading
import time

import numpy as np

from shmrl import rllink
from shmrl.checker.rules import (S_ACT, S_CONVERSATION, S_EPISODES, S_HEARTBEAT, S_INFERENCE, S_PING, S_REPLIES,
                                 S_STATE, ActRules, EpisodeRules, default_steps, read_frame)
from shmrl.config.faces import EXIT_GRACE_S, ConformanceSettings
from shmrl.onnxio.graph import SQUASHED_GAUSSIAN

DEFAULTS = ConformanceSettings()   # the command line's defaults are the API's
HEARTBEAT_S = 0.02          # asked of a binary client: short, so that sampling a message needs several
SILENCE_S = 2.0             # the longest silence allowed while it samples (100 heartbeats: a loaded machine)
OUTPUT_TAIL_BYTES = 64 << 10   # of the client's output, the last kept to show; the rest is read and dropped


class Closed(Exception):
    """The client closed the connection (or sent nothing in time)."""


def broken(e: OSError) -> Closed:
    """``Closed`` for a socket error on the client's connection: a reset (or a broken pipe) is
    the client's doing, a violation as a close is, not a fault of the checker's command line."""
    what = ("the client reset the connection" if isinstance(e, ConnectionResetError) else
            "the client broke the connection" if isinstance(e, ConnectionError) else "the connection failed")
    return Closed(f"{what} ({e.strerror or e})")


class OutputTail:
    """The last ``limit`` bytes of what a process writes to ``pipe``, read by a thread of its
    own: a client that floods its output neither blocks on it nor fills the checker's memory."""

    def __init__(self, pipe, limit: int = OUTPUT_TAIL_BYTES):
        self.pipe, self.limit = pipe, limit
        self.data = bytearray()
        self.thread = threading.Thread(target=self._read, name="client-output", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        with self.pipe:
            while chunk := os.read(self.pipe.fileno(), 1 << 16):
                self.data += chunk
                if len(self.data) > 2 * self.limit:   # trimmed once per limit read, not at every chunk
                    del self.data[:-self.limit]

    def text(self, wait_s: float = 1.0) -> str:
        """What was kept, once the pipe is closed (or ``wait_s`` has passed: a process that
        left a child of its own holding it)."""
        self.thread.join(wait_s)
        return bytes(self.data[-self.limit:]).decode("utf-8", "replace")


class Connection:
    """One accepted client connection: frames in (with their arrival times), replies out."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.codec = "json"
        self.deadline = 0.0
        self.version = 0                  # the policy version the client holds
        self.heartbeat_s: float | None = None
        self.beats = self.reported = 0    # HEARTBEATs while sampling; the last env_steps one said
        self.sampling_s = 0.0             # time between a reply and the next message, in all
        self.server_inference = False     # the PING asked for it (and the checker granted it)

    def recv_exactly(self, n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            left = self.deadline - time.monotonic()
            if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                raise Closed("nothing sent in time")
            try:
                part = self.sock.recv(n - len(data))
            except OSError as e:
                raise broken(e) from None
            if not part:
                raise Closed("the client closed the connection")
            data += part
        return bytes(data)

    def request(self, timeout: float):
        """(message, violation, arrival time) of the next frame within ``timeout`` s."""
        self.deadline = time.monotonic() + timeout
        msg, violation = read_frame(self.recv_exactly)
        return msg, violation, time.monotonic()

    def quiet_for(self, seconds: float) -> bool:
        """True if the client sent nothing for ``seconds`` (and is still connected)."""
        return not select.select([self.sock], [], [], seconds)[0]

    def reply(self, msg: dict) -> None:
        try:
            self.sock.sendall(rllink.frame(rllink.encode(msg, self.codec)))
        except OSError as e:
            raise broken(e) from None

    def close(self) -> None:
        self.sock.close()


class Checker:
    """The scripted server and its findings (``violations``: (rule, text) pairs)."""

    def __init__(self, spec, models: dict, onnx_files: dict, reconnect: bool = DEFAULTS.reconnect,
                 timeout: float = DEFAULTS.timeout, hold_s: float = DEFAULTS.hold_s, out=sys.stdout, multi=None,
                 dists: dict | None = None):
        """``spec``: the env's (a multi-agent env's: its agents', which share their spaces;
        ``multi``: its MultiAgentSpec, whose clients the checker covers with server-side
        inference only); ``dists``: SET_STATE's ``action_dist`` by version (--algo sac)."""
        from shmrl.envs.spec import space_config
        from shmrl.client.action_sampler import ActionSampler

        self.dists = dists or {}
        self.spec, self.rules, self.act_rules = spec, EpisodeRules(spec, models, self.dists), ActRules(spec, multi)
        self.multi = multi
        self.onnx_files, self.reconnect, self.timeout, self.out = onnx_files, reconnect, timeout, out
        self.hold_s = hold_s
        self.client: subprocess.Popen | None = None   # the client under test, to notice its exit
        self.spaces = space_config(spec)    # SET_CONFIG describes them to every client, as shmrl's does
        if self.dists:
            self.spaces["action_dist"] = SQUASHED_GAUSSIAN
        if multi is not None:
            self.spaces = {"policy_map": "shared", "league_prob": 0.0,
                           "agent_spaces": {str(a): space_config(s) for a, s in multi.agent_specs.items()}}
        self.sampler = ActionSampler(spec.actions, np.random.default_rng(0))
        self.violations: list[tuple[str, str]] = []
        self.checked: list[str] = []        # what the run exercised, for the summary
        self.stepped = 0                    # env steps received on the connection
        self.min_acts = 0                   # connection 1's ACTs at least (by default: past the time limit)

    def violate(self, rule: str, text: str) -> None:
        self.violations.append((rule, text))
        print(f"VIOLATION [{rule}] {text}", file=self.out, flush=True)

    def note(self, text: str) -> None:
        self.checked.append(text)
        print(f"ok: {text}", file=self.out, flush=True)

    def set_state(self, version: int) -> dict:
        dist = {"action_dist": self.dists[version]} if version in self.dists else {}
        return {"type": "SET_STATE", "onnx_file": self.onnx_files[version], "weights_seq_no": version, **dist}

    def actions(self, version: int, act: dict) -> dict:
        """ACTIONS for an ACT's observations, sampled from that version's model (many
        agents: each env's acting agents, all rows in one call)."""
        if "envs" in act:
            layout = self.spec.obs
            rows = [(k, name, layout.check(obs)[1])
                    for k, env in enumerate(act["envs"]) for name, obs in env["obs"].items()]
            # an observation that does not fit (a rule broken, said already) gets zeros
            parts = [layout.empty(1) if obs is None else obs for _, _, obs in rows]
            obs = ({leaf.name: np.concatenate([p[leaf.name] for p in parts]) for leaf in layout.leaves}
                   if layout.structured else np.concatenate(parts))
            chosen, _ = self.sampler.sample(self.rules.models[version].logits(obs))
            per_env = [{} for _ in act["envs"]]
            for (k, name, _), action in zip(rows, np.asarray(chosen).tolist()):
                per_env[k][name] = action
            return {"type": "ACTIONS", "actions": per_env, "weights_seq_no": version}
        obs = act["obs"]
        if self.dists:
            self.sampler.set_dist(self.dists[version])
        actions, _ = self.sampler.sample(self.rules.models[version].logits(obs))
        return {"type": "ACTIONS", "actions": np.asarray(actions, self.spec.actions.action_dtype),
                "weights_seq_no": version}

    # ------------------------------------------------------------ the conversation

    def next_request(self, conn: Connection, timeout: float, where: str, sampling_since: float | None = None):
        """The next request that is not a HEARTBEAT (those are checked here, as are the
        silences between frames while the client samples); None when the stream broke."""
        last = sampling_since
        beats = 0
        while True:
            msg, bad, at = conn.request(timeout)
            if bad:
                self.violate(bad[0], f"{where}: {bad[1]}")
                return None
            if last is not None and conn.heartbeat_s and at - last > SILENCE_S:
                self.violate(S_HEARTBEAT, f"{where}: {at - last:.2f} s without a frame while sampling; the PONG "
                                          f"asked for one every {conn.heartbeat_s} s")
            last = at if sampling_since is not None else None
            if msg["type"] != "HEARTBEAT":
                conn.beats += beats
                return msg
            beats += 1
            if msg.get("env_steps") is not None:
                if msg["env_steps"] < conn.reported:
                    self.violate(S_HEARTBEAT, f"{where}: HEARTBEAT env_steps went down, {conn.reported} -> "
                                              f"{msg['env_steps']} (the total stepped since connecting)")
                if msg["env_steps"] < self.stepped:
                    self.violate(S_HEARTBEAT, f"{where}: HEARTBEAT env_steps {msg['env_steps']} is below the "
                                              f"{self.stepped} env steps already sent on this connection")
                conn.reported = max(conn.reported, msg["env_steps"])

    def handshake(self, conn: Connection, steps_per_sample: int, label: str):
        """PING, GET_CONFIG and GET_STATE, in that order (GET_CONFIG may come after GET_STATE):
        True once the client may sample; a server-inference client's first ACT (it needs
        neither GET_CONFIG nor GET_STATE); False when the conversation broke."""
        msg = self.next_request(conn, self.timeout, f"{label}, first frame")
        if msg is None:
            return False
        if msg["type"] != "PING":
            self.violate(S_CONVERSATION, f"{label}: the first request is {msg['type']}, not PING")
            return False
        pong = {"type": "PONG"}
        if "binary" in msg.get("codecs", []):
            pong.update(codec="binary", heartbeat_s=HEARTBEAT_S)
            conn.codec, conn.heartbeat_s = "binary", HEARTBEAT_S
        if msg.get("inference") == "server":
            pong["inference"], conn.server_inference = "server", True
        missing = sorted(set(self.dists.values()) - set(msg.get("action_dists", ())))
        if missing and not conn.server_inference:   # a SAC learner closes it here (RLLINK.md §3.1)
            self.violate(S_PING, f"{label}: the PING of a client that runs the policy itself does not list "
                                 f"{' and '.join(map(repr, missing))} in action_dists, which a --algo sac learner "
                                 f"serves (§4.2): it would be refused at the handshake")
            return False
        conn.reply(pong)
        self.note(f"{label}: PING ({'binary offered' if conn.heartbeat_s else 'JSON only'}"
                  f"{', server-side inference' if conn.server_inference else ''}) answered")
        if self.multi is not None and not conn.server_inference:
            self.violate(S_INFERENCE, f"{label}: a client of {self.multi.env_id}, a multi-agent env, whose PING did "
                                      f"not ask for server-side inference: the checker covers multi-agent clients "
                                      f"with server-side inference only (§11.3)")
            return False
        have = set()
        while conn.server_inference or have != {"SET_CONFIG", "SET_STATE"}:
            msg = self.next_request(conn, self.timeout, f"{label}, handshake")
            if msg is None:
                return False
            if msg["type"] == "GET_CONFIG":
                conn.reply({"type": "SET_CONFIG", "env_steps_per_sample": steps_per_sample, "force_on_policy": True,
                            **self.spaces})
                have.add("SET_CONFIG")
            elif msg["type"] == "GET_STATE":
                conn.reply(self.set_state(conn.version))
                have.add("SET_STATE")
            elif msg["type"] == "ACT" and conn.server_inference:
                self.note(f"{label}: handshake PING{', GET_CONFIG' if have else ''}, then ACT")
                return msg
            elif msg["type"] == "ACT":
                self.violate(S_INFERENCE, f"{label}: ACT from a client whose PING did not ask for server-side "
                                          f"inference (\"inference\": \"server\")")
                return False
            else:
                rule = S_STATE if msg["type"].startswith("EPISODES") else S_CONVERSATION
                self.violate(rule, f"{label}: {msg['type']} before the handshake was done (it has "
                                   f"{sorted(have) or 'nothing'}; it needs SET_CONFIG and SET_STATE)")
                return False
        self.note(f"{label}: handshake PING, GET_CONFIG, GET_STATE")
        return True

    def acts(self, conn: Connection, msg: dict, n: int, label: str, hold_at: int = 0, new_version_at: int = 0) -> bool:
        """Check ``n`` ACTs (``msg`` the first), answering all but the last with ACTIONS from
        the version the connection holds; hold the reply to ACT ``hold_at``, switch to
        version 1 at ACT ``new_version_at``. True if the conversation is still in step."""
        for i in range(1, n + 1):
            where = f"{label}, ACT {i}"
            for rule, text in self.act_rules.check(msg, where):
                self.violate(rule, text)
            if ("envs" in msg) != (self.multi is not None):
                return False   # the other env kind's form (a rule broken): no ACTIONS can answer it
            if i == n:
                return True
            if i == hold_at and not self.hold(conn, self.hold_s, where):
                return False
            if i == new_version_at:
                conn.version = 1
            conn.reply(self.actions(conn.version, msg))
            msg = self.next_request(conn, self.timeout, f"{label}, ACT {i + 1}", sampling_since=time.monotonic())
            if msg is None:
                return False
            if msg["type"] != "ACT":
                self.violate(S_ACT, f"{where}: a server-inference client sends ACT after ACTIONS, not {msg['type']}")
                return False
        return True

    def act_script(self, conn: Connection, first: dict, label: str, steps: int) -> None:
        """Connection 1: an ACT per step of K envs for ``steps`` env steps, a held reply, a new
        version; the last ACT is refused (closed). Connection 2: 10 ACTs, the last answered."""
        self.act_rules.new_connection()
        if "envs" in first:
            k = len(first["envs"])
        else:
            k = len(first["obs"]) if not isinstance(first["obs"], dict) else len(next(iter(first["obs"].values())))
        if label == "connection 1":
            n = max(-(-steps // k), 12, self.min_acts)
            if self.acts(conn, first, n, label, hold_at=3, new_version_at=6):
                ended = self.act_rules.episodes_ended
                if ended:
                    self.note(f"{label}: {n} ACTs of {k} envs checked, {ended} episodes ended")
                else:
                    self.unended(S_ACT, f"{label}: {n} ACTs of {k} envs", n - 1)
        elif self.acts(conn, first, 10, label):
            self.note(f"{label}: the first ACT carried no outcome again, 10 ACTs checked")
            conn.reply(self.actions(conn.version, first))

    def episodes(self, conn: Connection, n: int, steps_per_sample: int, label: str) -> bool:
        """Message n: an EPISODES_AND_GET_STATE, checked; True if the stream is still in step."""
        where = f"{label}, message {n}"
        since = time.monotonic()
        msg = self.next_request(conn, self.timeout, where, sampling_since=since)
        conn.sampling_s += time.monotonic() - since
        if msg is None:
            return False
        if msg["type"] != "EPISODES_AND_GET_STATE":
            rule = S_REPLIES if msg["type"] == "EPISODES" else S_CONVERSATION
            self.violate(rule, f"{where}: expected EPISODES_AND_GET_STATE (force_on_policy is true), got {msg['type']}")
            return False
        for rule, text in self.rules.check(msg, where, conn.version, steps_per_sample):
            self.violate(rule, text)
        self.stepped += msg["episodes"].num_steps
        self.note(f"{where}: {msg['episodes'].num_chunks} chunks, {msg['episodes'].num_steps} env steps checked")
        return True

    def hold(self, conn: Connection, seconds: float, where: str) -> bool:
        """Hold a reply: the client must wait (HEARTBEATs are allowed, nothing else)."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if conn.quiet_for(left):
                break
            try:
                msg, bad, _ = conn.request(1.0)
            except Closed:
                self.violate(S_REPLIES, f"{where}: the client closed the connection while its reply was held "
                                        f"{seconds:g} s (a strict on-policy server holds it through an update)")
                return False
            if bad or msg["type"] != "HEARTBEAT":
                self.violate(S_CONVERSATION, f"{where}: sent {bad[1] if bad else msg['type']} while its reply "
                                             f"was held; a client waits for the reply to its request")
                return False
        self.note(f"{where}: waited {seconds:g} s for a held reply")
        return True

    def unended(self, rule: str, what: str, per_env: int | None) -> None:
        """No episode ended on connection 1: how the client ends one (the flags, a reset, a new
        chunk or final_obs) went unchecked, so the run cannot pass."""
        limit = self.spec.max_episode_steps
        self.violate(rule, f"{what}, and no episode ended: how the client ends an episode was not checked. "
                           + (f"Each env stepped {per_env} times; " if per_env else "")
                           + (f"{self.spec.env_id}'s time limit is {limit} steps: " if limit else "")
                           + "give more --steps (connection 1's env steps per message; a server-inference "
                             "client's in all)")

    def accept(self, listener: socket.socket, label: str) -> socket.socket | None:
        """The client's next connection; None (a violation) if it exits or does not connect
        within the timeout."""
        again = " (after a closed connection it must reconnect with PING)" if label != "connection 1" else ""
        deadline = time.monotonic() + self.timeout
        listener.settimeout(0.2)
        while True:
            try:
                sock, _ = listener.accept()
                sock.settimeout(self.timeout)   # for sending replies; reading goes through select
                return sock
            except socket.timeout:
                pass
            status = self.client.poll() if self.client is not None else None
            if status is not None:
                self.violate(S_CONVERSATION, f"{label}: the client exited (status {status}) instead of "
                                             f"connecting{again}")
                return None
            if time.monotonic() > deadline:
                self.violate(S_CONVERSATION, f"{label}: the client did not connect within {self.timeout:g} s{again}")
                return None

    def session(self, listener: socket.socket, label: str, steps_per_sample: int, script) -> Connection | None:
        """Accept a connection and run ``script(conn)`` on it after the handshake."""
        sock = self.accept(listener, label)
        if sock is None:
            return None
        conn = Connection(sock)
        conn.version = max(self.onnx_files) if label != "connection 1" else 0
        self.rules.new_connection()
        self.stepped = 0
        try:
            started = self.handshake(conn, steps_per_sample, label)
            if isinstance(started, dict):
                self.act_script(conn, started, label, steps_per_sample * (4 if label != "connection 1" else 1))
            elif started:
                script(conn)
        except Closed as e:
            self.violate(S_CONVERSATION, f"{label}: {e} in the middle of the conversation")
        return conn

    def script_1(self, steps: int):
        def run(conn: Connection):
            if not self.episodes(conn, 1, steps, "connection 1"):
                return
            if not self.hold(conn, self.hold_s, "connection 1, message 1"):
                return
            conn.version = 1
            conn.reply(self.set_state(1))
            if not self.episodes(conn, 2, steps, "connection 1"):
                return
            conn.reply(self.set_state(1))   # the same version again: nothing to reload
            if not self.episodes(conn, 3, steps, "connection 1"):
                return
            if not self.rules.episodes_ended:
                self.unended(S_EPISODES, f"connection 1: 3 messages, {self.stepped} env steps", None)
            if conn.heartbeat_s and not conn.server_inference:
                if conn.beats:
                    self.note(f"connection 1: {conn.beats} HEARTBEATs while sampling")
                elif conn.sampling_s < 10 * HEARTBEAT_S:
                    self.note(f"connection 1: heartbeats not exercised (it sampled 3 messages in "
                              f"{conn.sampling_s:.2f} s; more --steps would)")
                else:
                    self.violate(S_HEARTBEAT, "connection 1: binary was agreed, but no HEARTBEAT came in the "
                                              f"{conn.sampling_s:.2f} s it sampled 3 messages "
                                              f"(heartbeat_s {HEARTBEAT_S})")
        return run

    def script_2(self, steps: int):
        def run(conn: Connection):
            if self.episodes(conn, 4, steps, "connection 2"):
                self.note("connection 2: the message follows the new SET_CONFIG")
                conn.reply(self.set_state(conn.version))
        return run

    def run(self, listener: socket.socket, steps: int) -> None:
        conn = self.session(listener, "connection 1", steps, self.script_1(steps))
        if conn is None:
            return
        conn.close()                          # refused: the reply to message 3 never comes
        if self.reconnect:
            conn = self.session(listener, "connection 2", max(steps // 4, 1), self.script_2(max(steps // 4, 1)))
            if conn is not None:
                conn.close()


def make_models(spec, hidden: int = 32, algo: str = "ppo") -> tuple[dict, dict]:
    """Two versions of a policy for ``spec`` (SAC's actor for ``algo`` sac) whose output 0
    differ clearly: {version: OnnxPolicy}, {version: onnx_file}."""
    from shmrl.model.net import PolicyNet, SquashedGaussianNet
    from shmrl.onnxio.policy import OnnxPolicy, encode_onnx_file

    net = (SquashedGaussianNet if algo == "sac" else PolicyNet)(spec, hidden, "ReLU")
    models, files = {}, {}
    for version in (0, 1):
        weights = net.initial_weights(version)
        bias = weights["pi.head.b"]
        bias[net.trained_rows] += 0.5 * version * np.where(np.arange(len(net.trained_rows)) % 2, -1.0, 1.0)
        model = net.template.publish(weights)
        models[version], files[version] = OnnxPolicy(model), encode_onnx_file(model)
    return models, files


def check_client(command: list[str], env: str = DEFAULTS.env, reconnect: bool = DEFAULTS.reconnect,
                 steps: int | None = DEFAULTS.steps, timeout: float = DEFAULTS.timeout,
                 hold_s: float = DEFAULTS.hold_s, out=sys.stdout, algo: str = DEFAULTS.algo) -> list[tuple[str, str]]:
    """Run the client ``command`` (``{port}`` replaced) against the scripted server; the
    violations it found. The client is stopped at the end, whatever happened. ``steps``:
    connection 1's env_steps_per_sample; None: ``default_steps`` of the env, and a
    server-inference client's ACTs past its time limit. ``algo``: the learner played (sac:
    version 0 sampled uniformly, as SAC's warm-up, version 1 as its squashed Gaussian; a
    ValueError for an env SAC cannot train)."""
    from shmrl.config.algos import sac_refusal
    from shmrl.config.settings import Config
    from shmrl.envs.make import env_spec

    spec, multi = env_spec(env), None
    why = sac_refusal(Config(env=env), spec) if algo == "sac" else None
    if why:
        raise ValueError(f"--algo sac: {why.split(': give')[0]}")
    if spec.multiagent:   # its clients with server-side inference, agents of one policy
        from shmrl.envs.spec import policy_mapper

        multi, (spec,) = spec, spec.policy_specs(policy_mapper("shared")).values()
    models, files = make_models(spec, algo=algo)
    dists = {0: "uniform", 1: SQUASHED_GAUSSIAN} if algo == "sac" else None
    checker = Checker(spec, models, files, reconnect, timeout, hold_s, out, multi, dists)
    if steps is None:
        steps = default_steps(multi or spec)
        checker.min_acts = (getattr(multi or spec, "max_episode_steps", None) or 0) + 1
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        argv = [part.replace("{port}", str(port)) for part in command]
        print(f"checking: {shlex.join(argv)}", file=out, flush=True)
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        client_output = OutputTail(proc.stdout)
        checker.client = proc
        try:
            checker.run(listener, steps)
            listener.close()                  # the session is over: a reconnecting client finds no server
            try:   # a grace period to end on its own (no rule: RLlib's client never does)
                print(f"the client exited with status {proc.wait(timeout=EXIT_GRACE_S)} after the session",
                      file=out, flush=True)
            except subprocess.TimeoutExpired:
                print(f"the client was still running {EXIT_GRACE_S:g} s after the session: stopped", file=out,
                      flush=True)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
        if checker.violations:
            tail = client_output.text()[-3000:]
            print(f"the client's output (last 3000 characters):\n{tail}", file=out, flush=True)
    return checker.violations
