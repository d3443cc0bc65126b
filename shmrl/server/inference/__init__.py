"""Server-side inference: the learner runs the policy for clients that send observations."""
from __future__ import annotations

from shmrl.server.inference.base import NOT_SERVED, Inference, NoInference
from shmrl.server.inference.multi_agent import multiagent_inference
from shmrl.envs.spec import space_config
from shmrl.server.inference.single_agent import ServerInference
from shmrl.server.store import DEFAULT_POLICY


def server_inference(policy_specs: dict, env_steps_per_sample: int, state_size: int, multiagent: bool,
                     agents, config: dict) -> tuple[Inference | NoInference, dict]:
    """A run's server-side inference, and what SET_CONFIG adds to describe the spaces to
    its clients. A multi-agent run serves actions only when it knows its agents and policy
    map (``config``: SET_CONFIG's fields) and its policies have no memory."""
    if not multiagent:
        spec = policy_specs[DEFAULT_POLICY]
        return ServerInference(spec, env_steps_per_sample, state_size), space_config(spec)
    if agents is None or "policy_map" not in config or state_size:
        return NoInference(NOT_SERVED), {}
    return multiagent_inference(policy_specs, agents, config, env_steps_per_sample)
