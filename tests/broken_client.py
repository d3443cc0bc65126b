"""A small RLlink client with one deliberate bug at a time, for tests/test_conformance.py:
the conformance checker must catch each (``--bug none`` is the correct client, which it
must pass).

    python tests/broken_client.py --port P --bug stale-policy
"""
from __future__ import annotations

import argparse
import math
import socket
import sys
import time

import numpy as np

from shmrl import rllink
from shmrl.envs.make import make_env
from shmrl.onnxio.policy import OnnxPolicy, decode_onnx_file

BUGS = {   # bug -> the section of docs/RLLINK.md the checker must name
    "none": None,
    "header": "§1 Framing",              # a header of spaces and digits
    "order": "§2 The conversation",      # GET_CONFIG before PING
    "early-episodes": "§3.3",            # episodes before it has a policy
    "obs-count": "§4 Episodes",          # as many observations as actions
    "field-type": "§4 Episodes",         # rewards as strings
    "continuity": "§4 Episodes",         # a continuation that starts from another observation
    "stale-policy": "§4.2",              # never loads the new weights
    "logp": "§4.2",                      # the log-probability of the other action
    "no-heartbeat": "§5 HEARTBEAT",      # binary agreed, no HEARTBEAT while sampling slowly
    "impatient": "§6 When replies come",  # gives up on a held reply after 0.2 s
    "no-reconnect": "§2 The conversation",  # ends when the connection is closed
    "sticky-config": "§3.2",             # keeps the first env_steps_per_sample after reconnecting
    # server-side inference (ACT/ACTIONS)
    "act-none": None,
    "act-unasked": "§11 Server-side inference",  # ACTs though its PING did not ask
    "act-first-rewards": "§11.1",        # a step's outcome in a connection's first ACT
    "act-no-outcome": "§11.1",           # a later ACT without rewards and flags
    "act-k-changes": "§11.1",            # one ACT of fewer envs
    "act-no-final-obs": "§11.1",         # truncated envs without final_obs
}
MA_BUGS = {   # a client of pz:connect_four_v3 with server-side inference (RLLINK.md §11.3)
    "ma-none": None,
    "ma-first-rewards": "§11.3",         # an outcome in a connection's first ACT
    "ma-no-outcome": "§11.3",            # an env without rewards in a later ACT
    "ma-k-changes": "§11.3",             # one ACT of fewer envs
    "ma-unknown-agent": "§11.3",         # a reward for an agent the env does not have
    "ma-no-reset": "§11.3",              # a game's end without 'reset': the ended players act again
    "ma-single-form": "§11.3",           # a single-agent ACT ('obs') for a multi-agent env
}


class Link:
    def __init__(self, port: int, bug: str):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.bug, self.codec = bug, "json"

    def send(self, msg: dict) -> None:
        body = rllink.encode(msg, self.codec)
        header = b" %07d" % len(body) if self.bug == "header" else b"%08d" % len(body)
        self.sock.sendall(header + body)

    def recv(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            part = self.sock.recv(n - len(data))
            if not part:
                raise ConnectionError("closed")
            data += part
        return data

    def request(self, msg: dict, timeout: float = 60.0) -> dict:
        self.send(msg)
        self.sock.settimeout(timeout)
        try:
            return rllink.decode(self.recv(int(self.recv(8))))
        except socket.timeout:
            self.sock.close()
            raise ConnectionError("no reply in time") from None


def sample(policy: OnnxPolicy, obs, rng, bug: str):
    logits = policy.logits(np.asarray([obs], np.float32))[0].astype(np.float64)
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    action = int(rng.choice(len(probs), p=probs))
    logp = math.log(probs[1 - action] if bug == "logp" else probs[action])
    return action, logits.tolist(), logp


def session(port: int, bug: str, rng, sticky: dict) -> None:
    link = Link(port, bug)
    if bug == "order":
        link.request({"type": "GET_CONFIG"})
    pong = link.request({"type": "PING", "codecs": ["binary"]})
    if pong.get("codec") == "binary":
        link.codec = "binary"
    if bug == "early-episodes":
        link.request({"type": "EPISODES_AND_GET_STATE", "episodes": []})
    steps = link.request({"type": "GET_CONFIG"})["env_steps_per_sample"]
    if bug == "sticky-config":
        steps = sticky.setdefault("steps", steps)
    state = link.request({"type": "GET_STATE"})
    policy, version = OnnxPolicy(decode_onnx_file(state["onnx_file"])), state["weights_seq_no"]
    env = make_env("CartPole-v1", seed=int(rng.integers(1 << 30)))
    obs, _ = env.reset()
    chunk = None
    n = 0
    while True:
        chunks, last_sent = [], time.monotonic()
        chunk = chunk or {"obs": [obs.tolist()], "actions": [], "rewards": [], "action_dist_inputs": [],
                          "action_logp": [], "episode_id": f"e{n}"}
        for _ in range(steps):
            action, logits, logp = sample(policy, obs, rng, bug)
            obs, reward, terminated, truncated, _ = env.step(action)
            for key, value in (("actions", action), ("rewards", str(reward) if bug == "field-type" else reward),
                               ("obs", obs.tolist()), ("action_dist_inputs", logits), ("action_logp", logp)):
                chunk[key].append(value)
            if terminated or truncated:
                chunks.append({**chunk, "is_terminated": terminated, "is_truncated": truncated})
                n += 1
                obs, _ = env.reset()
                chunk = {"obs": [obs.tolist()], "actions": [], "rewards": [], "action_dist_inputs": [],
                         "action_logp": [], "episode_id": f"e{n}"}
            if bug == "no-heartbeat":
                time.sleep(0.001)
            elif link.codec == "binary" and time.monotonic() - last_sent > pong["heartbeat_s"]:
                link.send({"type": "HEARTBEAT"})
                last_sent = time.monotonic()
        if chunk["actions"]:
            chunks.append({**chunk, "is_terminated": False, "is_truncated": False})
            start = env.reset()[0].tolist() if bug == "continuity" else chunk["obs"][-1]
            chunk = {"obs": [start], "actions": [], "rewards": [], "action_dist_inputs": [], "action_logp": [],
                     "episode_id": chunk["episode_id"]}
        if bug == "obs-count":
            chunks = [{**c, "obs": c["obs"][:-1]} for c in chunks]
        for c in chunks:
            c["weights_seq_no"] = version
        reply = link.request({"type": "EPISODES_AND_GET_STATE", "episodes": chunks},
                             timeout=0.2 if bug == "impatient" else 60.0)
        if reply["weights_seq_no"] != version and bug != "stale-policy":
            policy, version = OnnxPolicy(decode_onnx_file(reply["onnx_file"])), reply["weights_seq_no"]


def act_session(port: int, bug: str) -> None:
    """Server-side inference: 2 envs, the actions the server sends."""
    link = Link(port, bug)
    link.request({"type": "PING"} if bug == "act-unasked" else {"type": "PING", "inference": "server"})
    link.request({"type": "GET_CONFIG"})
    envs = [make_env("CartPole-v1", seed=i) for i in range(2)]
    msg = {"type": "ACT", "obs": [env.reset()[0].tolist() for env in envs]}
    if bug == "act-first-rewards":
        msg.update(rewards=[0.0, 0.0], terminateds=[False, False], truncateds=[False, False])
    for n in range(1, 1_000_000):
        reply = link.request(msg)
        obs, rewards, terminateds, truncateds, final_obs = [], [], [], [], []
        for env, action in zip(envs, reply["actions"]):
            o, r, terminated, truncated, _ = env.step(int(action))
            final_obs.append(o.tolist())
            if terminated or truncated:
                o = env.reset()[0]
            obs.append(o.tolist())
            rewards.append(float(r))
            terminateds.append(bool(terminated))
            truncateds.append(bool(truncated))
        if bug == "act-no-final-obs" and n == 5:
            truncateds = [True, True]
        msg = {"type": "ACT", "obs": obs, "rewards": rewards, "terminateds": terminateds, "truncateds": truncateds}
        if any(truncateds) and bug != "act-no-final-obs":
            msg["final_obs"] = final_obs
        if bug == "act-no-outcome" and n == 5:
            msg = {"type": "ACT", "obs": obs}
        if bug == "act-k-changes" and n == 5:
            msg = {key: value[:1] if isinstance(value, list) else value for key, value in msg.items()}


def ma_session(port: int, bug: str) -> None:
    """Server-side inference for 2 connect_four games, the moves the server sends."""
    from shmrl.envs.make import resolve_env
    from shmrl.envs.pettingzoo_envs import stepper

    link = Link(port, bug)
    link.request({"type": "PING", "inference": "server"})
    link.request({"type": "GET_CONFIG"})
    factory, spec = resolve_env("pz:connect_four_v3")
    envs = [stepper(factory(), k) for k in range(2)]

    def wire(by_agent):
        return {a: {key: np.asarray(v).tolist() for key, v in o.items()} for a, o in by_agent.items()}

    to_act = [env.reset() for env in envs]
    msg = {"type": "ACT", "envs": [{"obs": wire(obs), **({"rewards": {}} if bug == "ma-first-rewards" else {})}
                                   for obs in to_act]}
    for n in range(1, 1_000_000):
        reply = link.request(msg)
        msg = {"type": "ACT", "envs": []}
        for k, env in enumerate(envs):
            results, to_act[k], over = env.step({a: int(reply["actions"][k][a]) for a in to_act[k]})
            out = {"rewards": {a: r for a, (_, r, _, _) in results.items()},
                   "terminateds": {a: True for a, (_, _, term, _) in results.items() if term}}
            if over:
                to_act[k] = env.reset()
                out["reset"] = bug != "ma-no-reset"
            msg["envs"].append({"obs": wire(to_act[k]), **out})
        if n == 5 and bug == "ma-no-outcome":
            msg["envs"][1] = {"obs": msg["envs"][1]["obs"]}
        if n == 5 and bug == "ma-k-changes":
            msg["envs"] = msg["envs"][:1]
        if n == 5 and bug == "ma-unknown-agent":
            msg["envs"][0]["rewards"]["player_9"] = 1.0
        if n == 5 and bug == "ma-single-form":
            msg = {"type": "ACT", "obs": [[0.0] * 4, [0.0] * 4], "rewards": [0.0, 0.0], "terminateds": [False, False],
                   "truncateds": [False, False]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--bug", choices=sorted({**BUGS, **MA_BUGS}), default="none")
    args = p.parse_args()
    rng, sticky = np.random.default_rng(0), {}
    for attempt in range(20):
        try:
            if args.bug.startswith("act-"):
                act_session(args.port, args.bug)
            elif args.bug.startswith("ma-"):
                ma_session(args.port, args.bug)
            else:
                session(args.port, args.bug, rng, sticky)
        except (ConnectionError, OSError):
            if args.bug == "no-reconnect":
                return 1
            time.sleep(0.2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
