"""A standalone RLlink client for CartPole: the template to port into a game engine.

It imports nothing from shmrl: only the standard library, numpy and onnxruntime. It
speaks RLlink's JSON variant over TCP, so it trains against `python -m shmrl.run
--tcp-port 5556` (with or without local simulators) or any RLlink JSON server.

    python examples/external_client.py --port 5556

The loop, which is all an integration has to reproduce:
1. connect; PING -> PONG; GET_CONFIG -> SET_CONFIG (env_steps_per_sample,
   force_on_policy); GET_STATE -> SET_STATE (the ONNX policy, base64 of gzip).
2. step the environment `env_steps_per_sample` times: feed the observation to the ONNX
   model (input `onnx::Gemm_0`, float32 [1, obs_dim]; output 0 = logits), sample from the
   softmax, record obs / action / reward / logits / log-probability.
3. send EPISODES_AND_GET_STATE with the chunks (an episode still running is sent as a
   chunk with both flags false and continues in the next message from its last obs),
   install the model from the SET_STATE reply, go to 2.
4. when the server goes away, reconnect and start again at 1.
"""
from __future__ import annotations

import argparse
import base64
import gzip
import json
import math
import random
import socket
import time

import numpy as np
import onnxruntime as ort


# ---------------------------------------------------------------- framing
def send_message(sock: socket.socket, msg: dict) -> None:
    body = json.dumps(msg).encode("utf-8")
    sock.sendall(b"%08d" % len(body) + body)   # 8 ASCII digits: the body's length


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("server closed the connection")
        data += chunk
    return bytes(data)


def recv_message(sock: socket.socket) -> dict:
    header = recv_exactly(sock, 8)
    if not header.isdigit():
        raise ConnectionError(f"bad frame header {header!r}")
    return json.loads(recv_exactly(sock, int(header)))


def request(sock: socket.socket, msg: dict, expect: str) -> dict:
    send_message(sock, msg)
    reply = recv_message(sock)
    if reply.get("type") != expect:
        raise ConnectionError(f"expected {expect}, got {reply.get('type')}")
    return reply


# ---------------------------------------------------------------- the policy
def load_policy(set_state: dict) -> ort.InferenceSession:
    model = gzip.decompress(base64.b64decode(set_state["onnx_file"]))
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"])


def act(session: ort.InferenceSession, obs: list[float]) -> tuple[int, list[float], float]:
    logits = session.run(None, {"onnx::Gemm_0": np.array([obs], np.float32)})[0][0].tolist()
    m = max(logits)
    probs = [math.exp(v - m) for v in logits]
    total = sum(probs)
    action = random.choices(range(len(logits)), weights=probs)[0]
    return action, logits, math.log(probs[action] / total)


# ---------------------------------------------------------------- the environment
class CartPole:
    """CartPole-v1 (gymnasium's dynamics): stands in for the game's own simulation."""

    def reset(self) -> list[float]:
        self.state = [random.uniform(-0.05, 0.05) for _ in range(4)]
        self.steps = 0
        return list(self.state)

    def step(self, action: int):
        x, x_dot, theta, theta_dot = self.state
        force = 10.0 if action == 1 else -10.0
        cos, sin = math.cos(theta), math.sin(theta)
        temp = (force + 0.05 * theta_dot ** 2 * sin) / 1.1
        theta_acc = (9.8 * sin - cos * temp) / (0.5 * (4.0 / 3.0 - 0.1 * cos ** 2 / 1.1))
        x_acc = temp - 0.05 * theta_acc * cos / 1.1
        self.state = [x + 0.02 * x_dot, x_dot + 0.02 * x_acc,
                      theta + 0.02 * theta_dot, theta_dot + 0.02 * theta_acc]
        self.steps += 1
        terminated = abs(self.state[0]) > 2.4 or abs(self.state[2]) > 12 * 2 * math.pi / 360
        truncated = self.steps >= 500
        # float32 like gymnasium's observations
        return np.float32(self.state).tolist(), 1.0, terminated, truncated


# ---------------------------------------------------------------- the client loop
def new_chunk(obs: list[float]) -> dict:
    return {"obs": [obs], "actions": [], "rewards": [], "action_dist_inputs": [], "action_logp": [],
            "is_terminated": False, "is_truncated": False}


def run_session(host: str, port: int, on_connected) -> None:
    with socket.create_connection((host, port), timeout=60) as sock:
        request(sock, {"type": "PING"}, "PONG")
        on_connected()
        config = request(sock, {"type": "GET_CONFIG"}, "SET_CONFIG")
        session = load_policy(request(sock, {"type": "GET_STATE"}, "SET_STATE"))
        steps_per_sample = config["env_steps_per_sample"]
        env = CartPole()
        chunk = new_chunk(env.reset())
        episode_return, returns = 0.0, []
        while True:
            chunks = []
            for _ in range(steps_per_sample):
                action, logits, logp = act(session, chunk["obs"][-1])
                obs, reward, terminated, truncated = env.step(action)
                for key, value in (("actions", action), ("rewards", reward), ("obs", obs),
                                   ("action_dist_inputs", logits), ("action_logp", logp)):
                    chunk[key].append(value)
                episode_return += reward
                if terminated or truncated:
                    chunk["is_terminated"], chunk["is_truncated"] = terminated, truncated
                    chunks.append(chunk)
                    returns.append(episode_return)
                    chunk, episode_return = new_chunk(env.reset()), 0.0
            if chunk["actions"]:              # still running: send what we have, continue after
                chunks.append(chunk)
                chunk = new_chunk(chunk["obs"][-1])
            # force_on_policy: wait for SET_STATE before sampling on. A strict learner answers
            # after its next update, shmrl's asynchronous one at once with its latest weights
            # (it corrects for the lag with action_logp); the client does the same either way.
            msg = {"type": "EPISODES_AND_GET_STATE", "episodes": chunks, "timesteps": steps_per_sample}
            session = load_policy(request(sock, msg, "SET_STATE"))
            if returns:
                print(f"mean return of the last {len(returns[-20:])} episodes: "
                      f"{sum(returns[-20:]) / len(returns[-20:]):.1f}", flush=True)
                returns = returns[-20:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=5556)
    p.add_argument("--retry-s", type=float, default=2.0, help="wait between reconnection attempts")
    p.add_argument("--max-retries", type=int, default=None, help="give up after this many failures in a row")
    args = p.parse_args()
    failures = 0

    def connected():
        nonlocal failures
        failures = 0

    while True:
        try:
            run_session(args.host, args.port, connected)
        except (ConnectionError, OSError) as e:   # refused, reset, closed, timed out
            failures += 1
            if args.max_retries is not None and failures > args.max_retries:
                raise SystemExit(f"giving up after {failures} failed connections: {e}")
            print(f"connection lost ({e}); reconnecting in {args.retry_s:.0f} s", flush=True)
            time.sleep(args.retry_s)


if __name__ == "__main__":
    main()
