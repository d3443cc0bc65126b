"""The simulator loop: environments + ONNX policy + an RLlink client over any transport.

It is written only against the client side of a transport (``request``, ``send``,
``close``), so the same loop runs over shared memory, TCP or in-process queues. It never
imports torch: numpy and onnxruntime only, like an external client in a game engine.
``run_simulator`` samples with the policy the server sends (client-side inference);
``run_server_inference`` sends observations and gets actions (ACT/ACTIONS);
``sim_process_main`` is what the learner's launcher starts in a simulator process.
"""
from __future__ import annotations

from collections import deque
import logging
import os
import signal
import sys
import time

import numpy as np

from shmrl import rllink
from shmrl.client import multi_agent as multiagent
from shmrl.client.actor import Actor, SimulatorError, check_sample, handshake
from shmrl.envs.make import env_spec, make_vec_env
from shmrl.envs.spec import declaration
from shmrl.client.rollout import Rollout
from shmrl.onnxio.policy import OnnxPolicy, decode_onnx_file
from shmrl.client.action_sampler import ActionSampler
from shmrl.config.faces import REPLY_TIMEOUT_S   # how long a simulator of a run waits for any one reply
from shmrl.transport.base import ConnectionClosed

log = logging.getLogger("shmrl.sim")
T = rllink.MessageType


def make_sampler(spec, rng: np.random.Generator) -> ActionSampler:
    """The sampler an Actor for ``spec`` uses (tools/bench.py times it alone)."""
    return ActionSampler(spec.actions, rng)


def run_simulator(client, env_id: str = "CartPole-v1", seed: int = 0, envs_per_sim: int = 1,
                  max_messages: int | None = None, log_every_s: float | None = None,
                  auth_token: str | None = None, declare: bool = False) -> int:
    """Sample with the learner's latest policy until the connection ends.

    ``envs_per_sim`` envs are stepped together (one batched ONNX call per step); every
    message carries ``env_steps_per_sample`` steps of them, cut into per-episode chunks.
    Returns the number of env steps sent. ``max_messages`` bounds the loop (tests);
    ``log_every_s`` logs progress (steps sent, recent returns) that often. A server that
    trains several policies (SET_STATE ``policies``: a multi-agent env) gets
    ``shmrl.client.multi_agent``'s loop. The policy acts through ``shmrl.client.actor.Actor``.

    A recurrent policy (its graph takes ``state_in.<i>``) gets each env's state, zeroed
    where an episode starts; every chunk carries the state before its first step.
    ``declare``: the GET_CONFIG declares the env's spaces, where they can be declared (a
    learner without an env trains them, one with an env refuses other spaces).
    """
    config, state = handshake(client, auth_token, declaration(env_spec(env_id)) if declare else None)
    try:
        if "policies" in state:
            return multiagent.run_simulator(client, env_id, seed, envs_per_sim, max_messages, log_every_s,
                                            handshake=(config, state))
        return _sample(client, config, state, env_id, seed, envs_per_sim, max_messages, log_every_s)
    except ConnectionClosed as e:
        if e.mid_reply:
            raise
        raise SessionEnded(f"the server ended the session ({e})") from e


class SessionEnded(ConnectionClosed):
    """The server closed the connection between replies after the session had started:
    the end of its run (``python -m shmrl.sim`` exits 0)."""


def _sample(client, config: dict, state: dict, env_id: str, seed: int, envs_per_sim: int,
            max_messages: int | None, log_every_s: float | None) -> int:
    """``run_simulator``'s loop, after the handshake: sample, send, load new weights."""
    steps_per_env = -(-int(config["env_steps_per_sample"]) // envs_per_sim)
    seq = state["weights_seq_no"]
    envs = make_vec_env(env_id, envs_per_sim, seed * 1_000_003)
    # SET_STATE's action_dist: how to sample now (SAC's warm-up: uniform); none: as the model says
    actor = Actor(OnnxPolicy(decode_onnx_file(state["onnx_file"])), envs.spec, envs_per_sim,
                  np.random.default_rng(seed), action_dist=state.get("action_dist"))
    rollout = Rollout(envs_per_sim, steps_per_env)
    obs = envs.reset()
    sent = messages = stepped = 0
    recent: deque = deque(maxlen=100)             # returns of the episodes completed lately
    next_log = time.monotonic() + (log_every_s or 0.0)

    while max_messages is None or messages < max_messages:
        rollout.start(obs, actor.state)
        for _ in range(steps_per_env):
            actions, dist_inputs, logp = actor.act(obs)
            obs, rewards, terminated, truncated, final_obs = envs.step(actions)
            rollout.record(actions, dist_inputs, logp, obs, rewards, terminated, truncated, final_obs)
            if final_obs is not None:   # an episode ended somewhere: the next starts from zeros
                actor.reset(np.asarray(terminated) | np.asarray(truncated))
            stepped += envs_per_sim
            client.heartbeat(stepped)  # a simulator whose env hangs stops counting
        n_steps = steps_per_env * envs_per_sim
        batch = rollout.batch(seq)
        check_sample(batch, env_id)   # a NaN is the env's or the policy's: say so here, not as a drop
        reply = client.request({"type": T.EPISODES_AND_GET_STATE.value, "episodes": batch,
                                "timesteps": n_steps})
        sent += n_steps
        messages += 1
        if reply["type"] != T.SET_STATE.value:
            raise ConnectionError(f"expected SET_STATE, got {reply['type']}")
        if reply["weights_seq_no"] != seq:
            seq = reply["weights_seq_no"]
            actor.load(OnnxPolicy(decode_onnx_file(reply["onnx_file"])), reply.get("action_dist"))
        if "env_steps_per_sample" in reply:   # the server shares its batch anew (RLLINK.md §3.3)
            steps_per_env = -(-reply["env_steps_per_sample"] // envs_per_sim)
            rollout.resize(steps_per_env)
        recent.extend(rollout.completed)
        rollout.completed.clear()
        if log_every_s and time.monotonic() >= next_log:
            next_log += log_every_s
            mean = f"{sum(recent) / len(recent):.1f}" if recent else "n/a"
            log.info("sent %d env steps; weights %s; mean return of the last %d episodes: %s",
                     sent, seq, len(recent), mean)
    return sent


def run_server_inference(client, env_id: str = "CartPole-v1", seed: int = 0, envs_per_sim: int = 1,
                         max_messages: int | None = None, log_every_s: float | None = None,
                         auth_token: str | None = None, declare: bool = False) -> int:
    """Step the envs with actions the server chooses (server-side inference, docs/RLLINK.md):
    each ACT carries the envs' observations and the outcome of their last step, each
    ACTIONS the next actions; the server keeps the trajectories. No policy runs here (no
    onnxruntime). Returns the env steps taken; ``max_messages`` bounds the ACTs (tests)."""
    ping = {"type": T.PING.value, "inference": "server"}
    if auth_token is not None:
        ping["auth_token"] = auth_token
    pong = client.request(ping)
    if pong["type"] != T.PONG.value or pong.get("inference") != "server":
        raise ConnectionError("the server does not serve actions (its PONG did not grant 'inference': 'server'); "
                              "run without --server-inference")
    try:
        return _act_loop(client, env_id, seed, envs_per_sim, max_messages, log_every_s, declare)
    except ConnectionClosed as e:
        if e.mid_reply:
            raise
        raise SessionEnded(f"the server ended the session ({e})") from e


def _act_loop(client, env_id: str, seed: int, envs_per_sim: int, max_messages: int | None,
              log_every_s: float | None, declare: bool = False) -> int:
    """``run_server_inference``'s loop, after PING: ACT, step the envs with the ACTIONS, repeat."""
    spec = env_spec(env_id)
    config = client.request({"type": T.GET_CONFIG.value, **(declaration(spec) if declare else {})})
    if spec.multiagent:   # per env: the agents that act now
        return multiagent.act_loop(client, config, env_id, seed, envs_per_sim, max_messages, log_every_s)
    if "agent_spaces" in config:
        raise ValueError(f"the server trains a multi-agent env, but {env_id} is single-agent")
    envs = make_vec_env(env_id, envs_per_sim, seed * 1_000_003)
    check_spaces(config, envs.spec)
    msg = {"type": T.ACT.value, "obs": envs.reset()}
    stepped = messages = 0
    returns, recent = np.zeros(envs_per_sim), deque(maxlen=100)
    next_log = time.monotonic() + (log_every_s or 0.0)
    while max_messages is None or messages < max_messages:
        reply = client.request(msg)
        messages += 1
        if reply["type"] != T.ACTIONS.value or len(reply["actions"]) != envs_per_sim:
            raise ConnectionError(f"expected ACTIONS for {envs_per_sim} envs, got {rllink.show(reply)}")
        obs, rewards, terminated, truncated, final_obs = envs.step(reply["actions"])
        msg = {"type": T.ACT.value, "obs": obs, "rewards": np.asarray(rewards, np.float32),
               "terminateds": np.asarray(terminated, bool), "truncateds": np.asarray(truncated, bool)}
        stepped += envs_per_sim
        returns += rewards
        if final_obs is not None:
            msg["final_obs"] = final_obs
            done = msg["terminateds"] | msg["truncateds"]
            recent.extend(returns[done].tolist())
            returns[done] = 0.0
        if log_every_s and time.monotonic() >= next_log:
            next_log += log_every_s
            mean = f"{sum(recent) / len(recent):.1f}" if recent else "n/a"
            log.info("stepped %d env steps; weights %s; mean return of the last %d episodes: %s",
                     stepped, reply["weights_seq_no"], len(recent), mean)
    return stepped


def check_spaces(config: dict, spec) -> None:
    """A ValueError unless SET_CONFIG's spaces (shmrl's server describes them) are the env's."""
    layout = spec.obs
    if "observation_shape" in config and (layout.structured or
                                          tuple(config["observation_shape"]) != layout.leaves[0].shape):
        raise ValueError(f"the server trains observations of shape {config['observation_shape']}; "
                         f"{spec.env_id}'s are {[leaf.shape for leaf in layout.leaves]}: is it another env?")
    if "observation_leaves" in config and (not layout.structured or sorted(config["observation_leaves"])
                                           != sorted(leaf.name for leaf in layout.leaves)):
        raise ValueError(f"the server trains the observation leaves {sorted(config['observation_leaves'])}; "
                         f"{spec.env_id} has {[leaf.name for leaf in layout.leaves]}: is it another env?")


def set_process_name(name: str) -> None:
    """Show ``name`` in ps/top (Linux, best effort): simulators are easy to tell apart."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


def sim_process_main(address: str, env_id: str, seed: int, envs_per_sim: int = 1,
                     name: str = "shmrl-sim", auth_token: str | None = None, nice: int = 0) -> None:
    """Entry point of a simulator process started by ``shmrl.run``.

    Ctrl-C reaches the whole process group; the learner decides how to stop, so the
    simulator ignores SIGINT and ends when its learner closes the connection or
    sends SIGTERM. ``nice``: how much lower than the learner's this process's CPU
    priority is (the learner's update is what everyone waits for).
    """
    from shmrl.transport import connect

    set_process_name(name)
    if nice:
        os.nice(nice)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # A strict on-policy reply waits for the update, and the first one for the learner to
    # load torch: with many simulators on few CPUs that takes far longer than a client's
    # usual 30 s. The learner's death is seen at once anyway (end-of-file, a closed socket).
    client = connect(address, REPLY_TIMEOUT_S, name=name)
    try:
        run_simulator(client, env_id, seed, envs_per_sim, auth_token=auth_token)
    except ConnectionError:
        pass  # the learner has finished or died: nothing left to do
    except TimeoutError as e:   # one line, not a traceback: the learner is alive but stuck
        print(f"error: {name}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except SimulatorError as e:   # the learner's supervisor reads the cause from the exit status
        print(f"error: {name}: {e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)
    finally:
        client.close()
