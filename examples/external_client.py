"""A standalone RLlink client: the template to port into a game engine.

It imports nothing from shmrl: only the standard library, numpy and onnxruntime. It
speaks RLlink's JSON variant over TCP, so it trains against `python -m shmrl.run
--tcp-port 5556` (with or without local simulators) or any RLlink JSON server.

    python examples/external_client.py --port 5556                 # CartPole-v1
    python examples/external_client.py --port 5556 --game cartpole-novel   # its velocities hidden:
        # a recurrent policy, the learner runs with --env CartPoleNoVel-v1
    python examples/external_client.py --port 5556 --game forager  # a Dict observation,
        # an action mask and a two-part action; the learner runs with
        # --env examples.external_client:forager_spaces (spaces only: the game is here)
    python examples/external_client.py --port 5556 --game pair     # two agents, one of
        # which leaves mid-episode; the learner runs with
        # --env examples.external_client:pair_spaces [--policy-map per-agent]

Multi-agent (docs/MULTIAGENT.md): every chunk also carries `agent_id` and
`module_id` (the policy that chose its actions, by the server's SET_CONFIG `policy_map`),
and SET_STATE carries `policies`: module_id -> {onnx_file, weights_seq_no}.

The loop, which is all an integration has to reproduce:
1. connect; PING -> PONG; GET_CONFIG -> SET_CONFIG (env_steps_per_sample,
   force_on_policy); GET_STATE -> SET_STATE (the ONNX policy, base64 of gzip).
2. step the environment `env_steps_per_sample` times: feed the observation to the ONNX
   model and sample from output 0 (see below), record obs / action / reward / output 0 /
   log-probability.
3. send EPISODES_AND_GET_STATE with the chunks (an episode still running is sent as a
   chunk with both flags false and continues in the next message from its last obs),
   install the model from the SET_STATE reply (and its `env_steps_per_sample`, where it
   has one: the learner shares its batch over the clients connected), go to 2.
4. when the server closes the connection between replies, its run is over, or it wants
   the client back (a restarted server, a conformance checker): go to 1 at once, and if
   that attempt fails, exit 0. When it cannot be reached (not started yet) or the
   connection is lost mid-reply, try again at 1, up to --max-retries times in a row
   (default 5, --retry-s 2 s apart), then exit 1. A server that checks an auth token
   closes the connection in reply to a PING without the right one: exit 1 ("wrong or
   missing auth token?").

A recurrent policy (the learner runs with --memory lstm|gru) has inputs `state_in.<i>` and
outputs `state_out.<i>`, float32 [1, memory_size] each: feed zeros at an episode's first
step and each step's `state_out.<i>` into the next one's `state_in.<i>`; every chunk
carries the state before its first step as "state_in", a flat list (`state_in.0` then
`state_in.1` ...): zeros for a chunk that begins an episode, the running state for one
that continues it. `Policy` below does all of it; nothing else changes.

The ONNX contract (docs/ENVIRONMENTS.md, "The ONNX policy"): a flat Box observation is fed as input
`onnx::Gemm_0`, float32 [1, obs_dim]. A Dict observation feeds one input per leaf,
`obs.<leaf>` (nested keys joined with dots), in the leaf's dtype (float32; uint8 for an
image; int64 for a Discrete), and its `action_mask` to the input `action_mask` (uint8):
the graph gives masked actions a logit of -1e9, so sampling never picks them. Output 0
holds every action part side by side: a Discrete's logits, a Box's means then log-stds.
On the wire a Dict observation is a JSON object per step, and a multi-part action one
list of numbers per step (a Discrete part as its index).
"""
from __future__ import annotations

import argparse
import base64
import gzip
import json
import math
import os
import random
import socket
import sys
import time

import numpy as np
import onnxruntime as ort


# ---------------------------------------------------------------- framing
class ServerClosed(ConnectionError):
    """The server closed the connection; ``between_replies``: not in the middle of a reply
    (how a server ends its run, or refuses a PING)."""

    def __init__(self, message: str, between_replies: bool):
        super().__init__(message)
        self.between_replies = between_replies


def send_message(sock: socket.socket, msg: dict) -> None:
    body = json.dumps(msg).encode("utf-8")
    try:
        sock.sendall(b"%08d" % len(body) + body)   # 8 ASCII digits: the body's length
    except (BrokenPipeError, ConnectionResetError):
        raise ServerClosed("the server closed the connection", between_replies=True) from None


def recv_exactly(sock: socket.socket, n: int, reply_start: bool = False) -> bytes:
    data = bytearray()
    while len(data) < n:
        try:
            chunk = sock.recv(n - len(data))
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            raise ServerClosed("the server closed the connection", between_replies=reply_start and not data)
        data += chunk
    return bytes(data)


def recv_message(sock: socket.socket) -> dict:
    header = recv_exactly(sock, 8, reply_start=True)
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
class Policy:
    """The ONNX model of a SET_STATE and, if it is recurrent (inputs state_in.<i>), its
    state: ``state`` carries over from the policy it replaces (same episode, new weights)."""

    def __init__(self, set_state: dict, state: dict | None = None):
        model = gzip.decompress(base64.b64decode(set_state["onnx_file"]))
        self.session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.state_inputs = sorted((i for i in self.session.get_inputs() if i.name.startswith("state_in.")),
                                   key=lambda i: int(i.name.split(".")[1]))
        self.state = state if state is not None else {}
        if set(self.state) != {i.name for i in self.state_inputs}:
            self.reset()

    def reset(self) -> None:
        """An episode begins: zeros."""
        self.state = {i.name: np.zeros((1, i.shape[-1]), np.float32) for i in self.state_inputs}

    def flat_state(self) -> list[float] | None:
        """The state now, as a chunk's "state_in" (None: the policy has no memory)."""
        return np.concatenate([self.state[i.name] for i in self.state_inputs], axis=1)[0].tolist() \
            if self.state_inputs else None

    def run(self, feeds: dict) -> list[float]:
        """Output 0 for one observation's inputs; the state moves on a step."""
        out = dict(zip(self.outputs, self.session.run(None, {**feeds, **self.state})))
        self.state = {name: out[name.replace("state_in.", "state_out.")] for name in self.state}
        return out[self.outputs[0]][0].tolist()


def categorical(logits: list[float]) -> tuple[int, float]:
    """An index drawn from softmax(logits), and its log-probability."""
    m = max(logits)
    probs = [math.exp(v - m) for v in logits]
    action = random.choices(range(len(logits)), weights=probs)[0]
    return action, math.log(probs[action] / sum(probs))


def act(policy: Policy, obs: list[float]) -> tuple[int, list[float], float]:
    """CartPole: one Discrete action from a flat observation."""
    logits = policy.run({"onnx::Gemm_0": np.array([obs], np.float32)})
    action, logp = categorical(logits)
    return action, logits, logp


def act_forager(policy: Policy, obs: dict) -> tuple[list[float], list[float], float]:
    """The forager: a Dict observation (one input per leaf, the mask among them) and a
    Tuple(Discrete(3), Box(1)) action: output 0 is [3 logits, mean, log-std]."""
    feeds = {"obs.position": np.array([obs["position"]], np.float32),
             "obs.target": np.array([obs["target"]], np.int64),
             "action_mask": np.array([obs["action_mask"]], np.uint8)}
    out = policy.run(feeds)
    move, logp = categorical(out[:3])                   # masked moves have logits of -1e9
    mean, log_std = out[3], out[4]
    noise = random.gauss(0.0, 1.0)
    speed = mean + math.exp(log_std) * noise            # unclipped: the game clips what it applies
    logp += -0.5 * noise * noise - log_std - 0.5 * math.log(2 * math.pi)
    return [float(move), speed], out, logp


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


class CartPoleNoVel(CartPole):
    """CartPole with the velocities hidden (observed as 0): the learner runs with --env
    CartPoleNoVel-v1, whose preset has --memory lstm; only a recurrent policy learns it."""

    def reset(self) -> list[float]:
        return self._hide(super().reset())

    def step(self, action: int):
        obs, reward, terminated, truncated = super().step(action)
        return self._hide(obs), reward, terminated, truncated

    @staticmethod
    def _hide(obs: list[float]) -> list[float]:
        obs[1] = obs[3] = 0.0
        return obs


class Forager:
    """A game with a Dict observation and an action mask: walk toward the target side of a
    1-D world. Each step one of the three moves (left, stay, right) is forbidden (never
    the target's); the right move earns 1, the speed costs a little. 20 steps an episode."""

    def reset(self) -> dict:
        self.steps, self.position = 0, random.uniform(-1.0, 1.0)
        return self._observe()

    def _observe(self) -> dict:
        self.target = random.randrange(3)
        mask = [1, 1, 1]
        mask[random.choice([m for m in range(3) if m != self.target])] = 0
        return {"position": [self.position], "target": self.target, "action_mask": mask}

    def step(self, action: list[float]):
        move, speed = int(action[0]), min(max(action[1], 0.0), 1.0)
        self.position = min(max(self.position + (move - 1) * 0.1 * speed, -1.0), 1.0)
        reward = (1.0 if move == self.target else 0.0) - 0.05 * speed
        self.steps += 1
        return self._observe(), reward, False, self.steps >= 20


def forager_spaces():
    """The forager's spaces, for the learner: `--env examples.external_client:forager_spaces`
    (with --sims 0: it only needs the spaces). Only here is gymnasium imported."""
    from gymnasium import spaces

    class Spaces:
        observation_space = spaces.Dict({"position": spaces.Box(-1.0, 1.0, (1,), np.float32),
                                         "target": spaces.Discrete(3),
                                         "action_mask": spaces.MultiBinary(3)})
        action_space = spaces.Tuple((spaces.Discrete(3), spaces.Box(0.0, 1.0, (1,), np.float32)))

    return Spaces()


class Pair:
    """Two agents, each shown a side (one-hot) to pick: reward 1 when right. "right" leaves
    after 5 steps, "left" plays all 10: agents of one episode may end at different times."""
    agents = ("left", "right")

    def reset(self) -> dict:
        self.steps = 0
        return self._observe(self.agents)

    def _observe(self, agents) -> dict:
        self.sides = {a: random.randrange(2) for a in agents}
        return {a: [1.0, 0.0] if side == 0 else [0.0, 1.0] for a, side in self.sides.items()}

    def step(self, actions: dict):
        """(obs, rewards, terminated, truncated) by agent, for the agents that acted."""
        self.steps += 1
        rewards = {a: 1.0 if actions[a] == self.sides[a] else 0.0 for a in actions}
        done = {a: self.steps >= (5 if a == "right" else 10) for a in actions}
        return self._observe(list(actions)), rewards, done, {a: False for a in actions}


def pair_spaces():
    """The pair's spaces, for the learner: `--env examples.external_client:pair_spaces`.
    A PettingZoo-style object: possible_agents, and spaces as functions of the agent."""
    from gymnasium import spaces

    class Spaces:
        possible_agents = list(Pair.agents)

        def observation_space(self, agent):
            return spaces.Box(0.0, 1.0, (2,), np.float32)

        def action_space(self, agent):
            return spaces.Discrete(2)

    return Spaces()


DECLARED = {"cartpole": {"observation_shape": [4], "observation_dtype": "<f4",
                         "action_space": {"type": "Discrete", "n": 2}}}
GAMES = {"cartpole": (CartPole, act), "cartpole-novel": (CartPoleNoVel, act), "forager": (Forager, act_forager),
         "pair": (Pair, act)}


# ---------------------------------------------------------------- the client loop
def new_chunk(obs, policy: Policy) -> dict:
    chunk = {"obs": [obs], "actions": [], "rewards": [], "action_dist_inputs": [], "action_logp": [],
             "is_terminated": False, "is_truncated": False}
    state = policy.flat_state()
    if state is not None:       # a recurrent policy: the state before the chunk's first step
        chunk["state_in"] = state
    return chunk


class Refused(Exception):
    """The server closed the connection in reply to PING: a wrong or missing auth token."""


def run_session(host: str, port: int, on_connected, game: str = "cartpole", auth_token: str | None = None) -> None:
    make_env, act = GAMES[game]
    with socket.create_connection((host, port), timeout=60) as sock:
        ping = {"type": "PING"} if auth_token is None else {"type": "PING", "auth_token": auth_token}
        try:
            request(sock, ping, "PONG")
        except ServerClosed as e:
            if not e.between_replies:
                raise
            # A server that checks tokens closes the connection, saying nothing, on a wrong one.
            raise Refused("the server refused the connection: wrong or missing auth token?") from None
        on_connected()
        # CartPole's spaces declared (docs/RLLINK.md §3.2): a learner started without --env trains them.
        config = request(sock, {"type": "GET_CONFIG", **DECLARED.get(game, {})}, "SET_CONFIG")
        if game == "pair":
            return run_multiagent(sock, config, make_env(), act)
        policy = Policy(request(sock, {"type": "GET_STATE"}, "SET_STATE"))
        steps_per_sample = config["env_steps_per_sample"]
        env = make_env()
        chunk = new_chunk(env.reset(), policy)
        episode_return, returns = 0.0, []
        while True:
            chunks = []
            for _ in range(steps_per_sample):
                action, logits, logp = act(policy, chunk["obs"][-1])
                obs, reward, terminated, truncated = env.step(action)
                for key, value in (("actions", action), ("rewards", reward), ("obs", obs),
                                   ("action_dist_inputs", logits), ("action_logp", logp)):
                    chunk[key].append(value)
                episode_return += reward
                if terminated or truncated:
                    chunk["is_terminated"], chunk["is_truncated"] = terminated, truncated
                    chunks.append(chunk)
                    returns.append(episode_return)
                    policy.reset()
                    chunk, episode_return = new_chunk(env.reset(), policy), 0.0
            if chunk["actions"]:              # still running: send what we have, continue after
                chunks.append(chunk)
                chunk = new_chunk(chunk["obs"][-1], policy)
            # force_on_policy: wait for SET_STATE before sampling on. A strict learner answers
            # after its next update, shmrl's asynchronous one at once with its latest weights
            # (it corrects for the lag with action_logp); the client does the same either way.
            msg = {"type": "EPISODES_AND_GET_STATE", "episodes": chunks, "timesteps": steps_per_sample}
            state = request(sock, msg, "SET_STATE")
            policy = Policy(state, policy.state)
            # The learner shares its train batch over the clients connected: as they come and
            # go, SET_STATE may carry this client's new share (RLLINK.md §3.3).
            steps_per_sample = state.get("env_steps_per_sample", steps_per_sample)
            if returns:
                print(f"mean return of the last {len(returns[-20:])} episodes: "
                      f"{sum(returns[-20:]) / len(returns[-20:]):.1f}", flush=True)
                returns = returns[-20:]


def run_multiagent(sock: socket.socket, config: dict, env, act) -> None:
    """The same loop with several agents: a chunk per agent, under the policy (module) it
    plays; an agent's chunk ends when the agent is done, whatever the others do."""
    state = request(sock, {"type": "GET_STATE"}, "SET_STATE")
    policies = {m: Policy(p) for m, p in state["policies"].items()}
    module_of = {a: "shared" if config.get("policy_map", "shared") == "shared" else a for a in env.agents}
    steps_per_sample = config["env_steps_per_sample"]
    obs = env.reset()
    chunks = {a: new_chunk(o, policies[module_of[a]]) for a, o in obs.items()}
    returns = []
    while True:
        done_chunks, steps = [], 0
        while steps < steps_per_sample:
            acted = {a: act(policies[module_of[a]], chunks[a]["obs"][-1]) for a in chunks}
            obs, rewards, terminated, truncated = env.step({a: x[0] for a, x in acted.items()})
            for a, (action, logits, logp) in acted.items():
                chunk = chunks[a]
                for key, value in (("actions", action), ("rewards", rewards[a]), ("obs", obs[a]),
                                   ("action_dist_inputs", logits), ("action_logp", logp)):
                    chunk[key].append(value)
                steps += 1
                if terminated[a] or truncated[a]:
                    chunk["is_terminated"], chunk["is_truncated"] = terminated[a], truncated[a]
                    done_chunks.append({**chunk, "agent_id": a, "module_id": module_of[a]})
                    returns.append(sum(chunk["rewards"]))
                    del chunks[a]
            if not chunks:                      # every agent is done: a new episode
                chunks = {a: new_chunk(o, policies[module_of[a]]) for a, o in env.reset().items()}
        for a, chunk in list(chunks.items()):   # still running: sent, continued after
            if chunk["actions"]:
                done_chunks.append({**chunk, "agent_id": a, "module_id": module_of[a]})
                chunks[a] = new_chunk(chunk["obs"][-1], policies[module_of[a]])
        msg = {"type": "EPISODES_AND_GET_STATE", "episodes": done_chunks, "timesteps": steps}
        state = request(sock, msg, "SET_STATE")
        policies = {m: Policy(p) for m, p in state["policies"].items()}
        steps_per_sample = state.get("env_steps_per_sample", steps_per_sample)   # its share (RLLINK.md §3.3)
        if returns:
            print(f"mean agent return of the last {len(returns[-20:])} agent episodes: "
                  f"{sum(returns[-20:]) / len(returns[-20:]):.2f}", flush=True)
            returns = returns[-20:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="the learner's host (default: %(default)s)")
    p.add_argument("--port", type=int, default=5556, help="the learner's --tcp-port (default: %(default)s)")
    p.add_argument("--auth-token", default=os.environ.get("SHMRL_AUTH_TOKEN"), metavar="SECRET",
                   help="the learner's --auth-token, if it has one (default: $SHMRL_AUTH_TOKEN)")
    p.add_argument("--max-retries", type=int, default=5, metavar="N",
                   help="when the learner cannot be reached or the connection is lost mid-reply, try again "
                        "up to N times in a row, then exit 1 (default: %(default)s)")
    p.add_argument("--retry-s", type=float, default=2.0, metavar="S",
                   help="seconds between attempts (default: %(default)s)")
    p.add_argument("--game", choices=sorted(GAMES), default="cartpole", help="what to play (default: %(default)s)")
    args = p.parse_args(argv)
    failures = 0

    def connected():
        nonlocal failures, ended
        failures, ended = 0, False

    ended = False   # the last session ended with the server closing between replies
    while True:
        try:
            run_session(args.host, args.port, connected, args.game, args.auth_token)
        except ServerClosed as e:
            if e.between_replies:   # the learner's run ended, or it wants us back: one attempt tells
                ended = True
                continue
            failures += 1
            error = e
        except (Refused, ConnectionError, OSError) as e:   # refused, reset, timed out
            if ended:   # right after a session: the server that ended it is gone (or closing)
                print("the server ended the session", flush=True)
                return 0
            if isinstance(e, Refused):
                print(f"error: {e}", file=sys.stderr)
                return 1
            failures += 1
            error = e
        if failures > args.max_retries:
            print(f"error: giving up after {failures} failed attempts in a row: {error}", file=sys.stderr)
            return 1
        print(f"connection failed ({error}); trying again in {args.retry_s:g} s", flush=True)
        time.sleep(args.retry_s)


if __name__ == "__main__":
    sys.exit(main())
