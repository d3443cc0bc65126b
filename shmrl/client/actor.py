"""The actor: what every client loop shares, written once for the simulator loop
(``shmrl.sim``), the multi-agent loop (``shmrl.client.multi_agent``) and evaluation
(``shmrl.eval``).

``Actor`` is an ONNX policy, the sampler of its action distribution and, for a recurrent
policy, the state of each env: ``act(obs)`` gives the actions, the distribution inputs
(output 0 of the graph) and the actions' log-probabilities; ``reset(rows)`` zeroes the
state of the envs whose episode ended. The distribution's client side (sampling and
log-probabilities in numpy) is ``shmrl.client.action_sampler.ActionSampler``; the learner's side (torch
log-probabilities) is ``shmrl.model.ppo.PPO.log_prob``; tests/test_actor.py checks they agree.

``handshake`` and ``check_policy_fits`` are the first steps of every simulator: the
RLlink messages that start a session (docs/RLLINK.md) and the check that the server's
policy takes the env's observations.

Like every client module, this never imports torch: numpy and onnxruntime only.
"""
from __future__ import annotations

import numpy as np

from shmrl import rllink
from shmrl.config.settings import SIM_EXIT_ALL_MASKED, SIM_EXIT_ENV_NOT_FINITE, SIM_EXIT_POLICY_NOT_FINITE
from shmrl.onnxio.policy import OnnxPolicy
from shmrl.client.action_sampler import PING_ACTION_DISTS, ActionSampler
from shmrl.core.spaces import MASK_KEY

T = rllink.MessageType


class SimulatorError(RuntimeError):
    """The env or the policy gives what no run can train on; ``exit_code``
    (``shmrl.config.settings.SIM_EXIT_REASONS``) tells the learner which, when the simulator stops."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class TokenRefused(ConnectionError):
    """The server closed the connection in reply to PING: what a server that checks auth
    tokens does with a wrong one, or none (docs/RLLINK.md, "Authentication")."""


def check_sample(batch, env_id: str) -> None:
    """Raise SimulatorError where a message's chunks hold a value that is not finite: the
    env's (an observation, a reward) or else the policy's (its distribution inputs)."""
    for name, leaf in (batch.obs.items() if isinstance(batch.obs, dict) else [("obs", batch.obs)]):
        if leaf.dtype.kind == "f" and not np.isfinite(leaf).all():
            raise SimulatorError(f"the env {env_id} returned an observation {name!r} that is not finite "
                                 f"({leaf[~np.isfinite(leaf)].flat[0]})", SIM_EXIT_ENV_NOT_FINITE)
    if not np.isfinite(batch.rewards).all():
        raise SimulatorError(f"the env {env_id} returned a reward that is not finite "
                             f"({batch.rewards[~np.isfinite(batch.rewards)][0]})", SIM_EXIT_ENV_NOT_FINITE)
    if not np.isfinite(batch.action_dist_inputs).all():
        raise SimulatorError("the policy's outputs (action_dist_inputs) are not finite: its weights are "
                             "poisoned", SIM_EXIT_POLICY_NOT_FINITE)


class Actor:
    """An OnnxPolicy + a ActionSampler + the recurrent state of ``num_envs`` envs.

    ``greedy``: every part's most likely action (a categorical's argmax, a Gaussian's
    mean; a masked action never is: its logit is -1e9), with log-probabilities of 0, as
    evaluations act. ``num_envs=None`` keeps no state: the rows of each call are any
    agents' (the multi-agent loop), so a recurrent policy is refused.
    """

    def __init__(self, policy: OnnxPolicy, spec, num_envs: int | None, rng: np.random.Generator,
                 greedy: bool = False, action_dist: str | None = None):
        check_policy_fits(policy, spec)
        self.sampler = ActionSampler(spec.actions, rng)   # its distribution: load's
        self.greedy = greedy
        self.num_envs = num_envs
        self.state = None   # [num_envs, state_size] before the next step; None: no memory
        self.env_id = getattr(spec, "env_id", "the env")
        # The action_mask's columns of each categorical part: each needs one allowed value.
        self.mask_parts = [] if spec.obs.mask is None else np.cumsum(
            [0] + [p.size for p in spec.actions.parts if p.kind == "categorical"])
        self.load(policy, action_dist)

    def load(self, policy: OnnxPolicy, action_dist: str | None = None) -> None:
        """Act with ``policy`` from now on (new weights of the same network): each env
        keeps its state. ``action_dist``: how to sample its output 0 (SET_STATE's, e.g.
        "uniform" in SAC's warm-up); by default as the model's metadata says."""
        if policy.state_size and self.num_envs is None:
            raise ValueError("recurrent policies are single-agent for now: a multi-agent env takes --memory none")
        self.policy = policy
        self.sampler.set_dist(action_dist or policy.action_dist)
        if policy.state_size and self.state is None:   # the first model: every episode starts from zeros
            self.state = policy.initial_state(self.num_envs)

    def act(self, obs):
        """(actions, distribution inputs, log-probabilities) for a batch of observations:
        the actions as ``ActionSampler.sample`` gives them (a list of ints for a single Discrete,
        else an array in the stored form); the state steps on."""
        if self.state is None:
            dist_inputs = self.policy.logits(obs)
        else:
            dist_inputs, self.state = self.policy.step(obs, self.state)
        if len(self.mask_parts):
            self.check_mask(obs[MASK_KEY])
        if self.greedy:
            return self.sampler.greedy(dist_inputs), dist_inputs, np.zeros(len(dist_inputs))
        actions, logp = self.sampler.sample(dist_inputs)
        return actions, dist_inputs, logp

    def check_mask(self, mask: np.ndarray) -> None:
        """Raise SimulatorError where an observation's action_mask allows no value of an
        action part: every action would be one the env forbids."""
        for start, stop in zip(self.mask_parts[:-1], self.mask_parts[1:]):
            if not mask[:, start:stop].any(axis=1).all():
                raise SimulatorError(f"the env {self.env_id} gave an action_mask that forbids every action "
                                     f"(columns {start}..{stop - 1} all 0)", SIM_EXIT_ALL_MASKED)

    def reset(self, rows) -> None:
        """An episode starts in these envs (a boolean mask or indices): from zeros."""
        if self.state is not None:
            self.state[rows] = 0.0


def handshake(client, auth_token: str | None = None, declare: dict | None = None) -> tuple[dict, dict]:
    """PING (with the shared secret, if any), GET_CONFIG (declaring the spaces ``declare``
    gives: ``shmrl.envs.spec.declaration``), GET_STATE: returns (SET_CONFIG, SET_STATE)."""
    ping = {"type": T.PING.value, "action_dists": list(PING_ACTION_DISTS)}   # it samples SAC's (RLLINK.md §3.1)
    if auth_token is not None:
        ping["auth_token"] = auth_token
    try:
        pong = client.request(ping)
    except ConnectionError as e:
        if getattr(e, "mid_reply", True):
            raise
        # A server that checks tokens closes the connection in reply to a PING with a wrong
        # one (or none), and says nothing (docs/RLLINK.md, "Authentication"): name the cause.
        raise TokenRefused(f"{e} in reply to PING: the server refused the connection: "
                           f"{'wrong' if auth_token is not None else 'missing'} auth token? (or a server older than "
                           f"this client, which refuses its PING's action_dists: the server's log says why)") from e
    if pong["type"] != T.PONG.value:
        raise ConnectionError(f"expected PONG, got {pong['type']}")
    config = client.request({"type": T.GET_CONFIG.value, **(declare or {})})
    if config["type"] != T.SET_CONFIG.value:
        raise ConnectionError(f"expected SET_CONFIG, got {config['type']}")
    state = client.request({"type": T.GET_STATE.value})
    if state["type"] != T.SET_STATE.value:
        raise ConnectionError(f"expected SET_STATE, got {state['type']}")
    return config, state


def check_policy_fits(policy: OnnxPolicy, spec) -> None:
    """A ValueError unless the policy takes the env's observations and gives its action
    distribution: a simulator started with another env than the learner's."""
    layout, n_out = spec.obs, policy.n_outputs
    if layout.flat or not layout.structured:
        fed = {policy.input_name: layout.leaves[0]}
    else:
        fed = {policy.input_for(leaf.name): leaf for leaf in layout.leaves}
    missing = [leaf.name for name, leaf in fed.items() if name is None]
    if missing:
        raise ValueError(f"the policy has no input for the observation {missing}; {spec.env_id}'s are "
                         f"{[leaf.name for leaf in layout.leaves]}: was it trained on another env?")
    # A model from elsewhere (RLlib's) may leave a size unnamed: check what it states.
    for name, leaf in fed.items():
        have = tuple(policy.inputs[name].shape[1:])
        if any(isinstance(h, int) and h != n for h, n in zip(have, leaf.shape)) or len(have) != len(leaf.shape):
            raise ValueError(f"the policy's input {name!r} takes {have}; {spec.env_id}'s observation "
                             f"{leaf.name!r} is {leaf.shape}: was it trained on another env?")
    if isinstance(n_out, int) and n_out != spec.policy_outputs:
        raise ValueError(f"the policy gives {n_out} outputs; {spec.env_id} needs {spec.policy_outputs}: was "
                         f"it trained on another env?")
