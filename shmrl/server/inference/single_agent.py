"""Server-side inference (docs/RLLINK.md, "Server-side inference"): the learner runs the
policy for clients that cannot (a C engine without onnxruntime, a microcontroller).

Such a client sends ACT (its K envs' observations and the outcome of their last step) and
gets ACTIONS. ``ServerInference`` keeps, per connection, what its simulator would: the
steps of its open sample (each step's arrays for all K envs: no loop over envs), cut into
chunks by a ``Rollout`` once the sample is complete, each env's recurrent state, and the
actions (with their distribution inputs and log-probabilities) that its last ACTIONS gave. The ACTs of every client waiting in one
poll round go through one forward pass (``flush``) with the same ONNX runtime and sampler
a simulator uses (``OnnxPolicy``, ``ActionSampler``). Every ``env_steps_per_sample`` steps of a
connection, ``act`` returns its chunks, which the Hub takes exactly as an
EPISODES_AND_GET_STATE's (the same checks, the store, the hold in strict on-policy).

Used by ``shmrl.server.hub`` in the serving thread only; onnxruntime is imported when the first
ACT needs the policy, so a run without such clients never loads it here.
"""
from __future__ import annotations

import numpy as np

from shmrl.client.actor import check_policy_fits
from shmrl.envs.spec import EnvSpec
from shmrl.core.episode import EpisodeBatch, obs_map, obs_rows
from shmrl.onnxio.policy import OnnxPolicy, decode_onnx_file
from shmrl.client.rollout import Rollout
from shmrl.client.action_sampler import ActionSampler
from shmrl.server.inference.base import Inference
from shmrl.server.store import DEFAULT_POLICY


class _Slots:
    """One connection's K envs: their open sample, recurrent state and last actions.

    The first sample's steps are kept as they came (``steps``) and recorded into the
    ``Rollout`` only once it is complete: its [T, K] arrays are allocated then, so a client
    that stops after a few ACTs holds no more memory than it sent. Later steps are recorded
    as they come (``recording``): a sample's completion, in one ACT's round, then costs
    only the cut into chunks, not the recording of all its steps."""

    __slots__ = ("k", "rollout", "steps", "recording", "obs", "state", "last", "oldest", "queued", "stepped")

    def __init__(self, k: int, steps: int, obs, state_size: int):
        self.k = k
        self.rollout = Rollout(k, steps)
        self.steps: list[tuple] = []        # the first sample's steps: Rollout.record's arguments
        self.recording = False              # the rollout's arrays exist: steps go straight in
        self.obs = obs                      # what the next actions are for
        self.state = np.zeros((k, state_size), np.float32) if state_size else None
        self.last: tuple | None = None      # (actions, dist inputs, logp) of the last ACTIONS
        self.oldest: int | None = None      # the oldest version that sampled a step of the open sample
        self.queued = False                 # its ACT waits for actions (queued or held)
        self.stepped = 0                    # env steps it reported, in all
        self.rollout.start(obs, self.state)


class ServerInference(Inference):
    """The policy run for server-inference clients of a single-agent env, and their
    trajectories (``Inference``'s interface)."""

    def __init__(self, spec: EnvSpec, env_steps_per_sample: int, state_size: int = 0, seed: int = 0):
        super().__init__()
        self.spec, self.env_steps_per_sample, self.state_size = spec, env_steps_per_sample, state_size
        self.sampler = ActionSampler(spec.actions, np.random.default_rng(seed))
        self.slots: dict[str, _Slots] = {}
        self._onnx_file = None               # the current version's, until the first ACT needs it
        self._action_dist = None             # how to sample it (SET_STATE's action_dist; None: as its model says)
        self.policy: OnnxPolicy | None = None
        leaf = spec.obs.leaves[0]
        # One float32 array of the env's shape, the obs of most clients, needs no conversion.
        self._float_obs = np.float32 if not spec.obs.structured and leaf.dtype == "float32" else None
        self._obs_shape = tuple(leaf.shape)

    def load(self, version: int, policies: dict) -> None:
        if version != self.version:
            entry = policies[DEFAULT_POLICY]
            self.version, self._onnx_file, self.policy = version, entry["onnx_file"], None
            self._action_dist = entry.get("action_dist")   # SAC: squashed_gaussian, or uniform in its warm-up

    def _policy(self) -> OnnxPolicy:
        if self.policy is None:
            policy = OnnxPolicy(decode_onnx_file(self._onnx_file))
            check_policy_fits(policy, self.spec)
            self.sampler.set_dist(self._action_dist or policy.action_dist)
            self.policy = policy
        return self.policy

    # ------------------------------------------------------------ one ACT
    def act(self, conn_id: str, msg: dict) -> tuple[EpisodeBatch | None, str | None]:
        """Record an ACT: (the connection's chunks when its sample is complete, else None;
        why the ACT breaks its connection's history, else None). The connection's obs are
        checked against the env here; the chunks are checked as any client's by the Hub."""
        if "envs" in msg:
            return None, "a multi-agent ACT ('envs') in a single-agent run: send 'obs' of K envs"
        obs = msg["obs"]
        if not (type(obs) is np.ndarray and obs.dtype == self._float_obs and obs.shape[1:] == self._obs_shape):
            why, obs = self.spec.obs.check(obs)   # (a float32 array of the env's shape passes it as it is)
            if why:
                return None, why
        slots = self.slots.get(conn_id)
        k = obs_rows(obs)
        if slots is None:
            if "rewards" in msg:
                return None, "the first ACT of a connection carries no 'rewards' (no step was taken yet)"
            steps = -(-self.env_steps_per_sample // k)   # as a simulator with K envs cuts its samples
            self.slots[conn_id] = _Slots(k, steps, obs, self.state_size)
            return None, None
        if slots.queued:
            return None, "an ACT before the ACTIONS of its last one (one ACT at a time)"
        if k != slots.k:
            return None, f"ACT with {k} envs; this connection's first had {slots.k} (K is fixed per connection)"
        if "rewards" not in msg:
            return None, "an ACT without 'rewards', 'terminateds' and 'truncateds' after the first"
        final_obs = None
        if _any(msg["truncateds"]):
            why, final_obs = self.spec.obs.check(msg["final_obs"])
            if why:
                return None, f"final_obs: {why}"
        return self._record(slots, obs, msg, final_obs), None

    def _record(self, slots: _Slots, obs, msg: dict, final_obs) -> EpisodeBatch | None:
        terminated, truncated = msg["terminateds"], msg["truncateds"]
        final = done = None
        if _any(terminated) or _any(truncated):
            done = terminated | truncated
            # The step led to the episode's last observation, not to obs (the next episode's
            # first): final_obs where truncated (the learner bootstraps from it), else obs's
            # own row (a terminal observation's value is never used).
            final = obs_map(np.array, obs)
            if final_obs is not None:
                if isinstance(final, dict):
                    for name, leaf in final.items():
                        leaf[truncated] = final_obs[name][truncated]
                else:
                    final[truncated] = final_obs[truncated]
        actions, dist_inputs, logp = slots.last
        slots.stepped += slots.k
        step = (actions, dist_inputs, logp, obs, msg["rewards"], terminated, truncated, final)
        if slots.recording:
            slots.rollout.record(*step)
        else:
            slots.steps.append(step)
        if final is not None and slots.state is not None:
            slots.state[done] = 0.0     # the next episode starts from zeros
        slots.obs = obs
        if slots.rollout.t + len(slots.steps) < slots.rollout.steps:
            return None
        for step in slots.steps:
            slots.rollout.record(*step)
        slots.steps, slots.recording = [], True
        batch = slots.rollout.batch(slots.oldest)
        slots.rollout.completed.clear()
        slots.rollout.start(obs, slots.state)
        slots.rollout.resize(-(-self.env_steps_per_sample // slots.k))   # the Hub may share its batch anew
        slots.oldest = None
        return batch

    # ------------------------------------------------------------ one forward pass
    def _gather(self, conns: list[str], slots: list[_Slots]) -> list[_Slots]:
        return slots

    def _forward(self, slots: list[_Slots]) -> list[np.ndarray]:
        """One forward pass for every queued connection's envs; each one's last actions and
        recurrent state kept."""
        policy = self._policy()
        if len(slots) == 1:
            obs = slots[0].obs
        elif isinstance(slots[0].obs, dict):
            obs = {name: np.concatenate([s.obs[name] for s in slots]) for name in slots[0].obs}
        else:
            obs = np.concatenate([s.obs for s in slots])
        states = None
        if policy.state_size:
            dist_inputs, states = policy.step(obs, np.concatenate([s.state for s in slots]))
        else:
            dist_inputs = policy.logits(obs)
        actions, logp = self.sampler.sample(dist_inputs)
        self.forward_passes += 1
        self.rows += len(dist_inputs)
        actions, logp = np.asarray(actions, self.spec.actions.action_dtype), np.asarray(logp, np.float32)
        chosen, start = [], 0
        for s in slots:
            rows = slice(start, start + s.k)
            start += s.k
            s.last = (actions[rows], dist_inputs[rows], logp[rows])
            if states is not None:
                s.state = states[rows]
            s.oldest = self.version if s.oldest is None else min(s.oldest, self.version)
            chosen.append(actions[rows])
        return chosen

    def forget(self, conn_id: str) -> int:
        slots = self.slots.pop(conn_id, None)
        return 0 if slots is None else (slots.rollout.t + len(slots.steps)) * slots.k


def _any(flags: np.ndarray) -> bool:
    """``flags.any()`` for a bool array, in a tenth of its time for the few flags of an ACT."""
    return b"\x01" in flags.tobytes()
