"""Server-side inference for many agents (docs/RLLINK.md §11.3): the learner runs the
policies for the clients of a multi-agent env that cannot.

Such a client sends, per env, the agents that act now with their observations and what
every agent got since the last ACT; it gets one action per acting agent. Each connection's
K envs are kept by a ``MultiAgentRollout.remote`` (``shmrl.client.multi_agent``): the same
bookkeeping a multi-agent simulator keeps (a chunk per agent under the policy that plays
it, the episode's policies assigned at its start, a league snapshot for one agent with
``league_prob``, a frozen policy's steps not sent), with the client stepping the envs.
What an agent got is added up until its step ends: at its next action, or its episode's
end. The ACTs of one poll round go through one forward pass per policy (``flush``), and
every ``env_steps_per_sample`` agent steps of a connection, ``act`` returns its chunks,
which the Hub takes exactly as a multi-agent EPISODES_AND_GET_STATE's.

Used by ``shmrl.server.hub`` in the serving thread only, through ``Inference``'s interface;
onnxruntime is loaded when the first ACT needs a policy.
"""
from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np

from shmrl import rllink
from shmrl.client.actor import Actor, check_policy_fits
from shmrl.envs.spec import MultiAgentSpec, policy_mapper
from shmrl.core.episode import MultiAgentBatch
from shmrl.server.inference.base import Inference
from shmrl.envs.spec import space_config
from shmrl.client.multi_agent import MultiAgentRollout, PolicySet
from shmrl.core.spaces import MASK_KEY


class _Conn:
    """One connection's envs: their agents' bookkeeping and what is owed to them."""

    __slots__ = ("k", "sampler", "owed", "ended", "queued")

    def __init__(self, sampler: MultiAgentRollout):
        self.k = sampler.num_envs
        self.sampler = sampler
        self.owed: dict = defaultdict(float)   # (env, agent) -> reward since its action, its step not ended
        self.ended = [set() for _ in range(self.k)]   # per env: the agents whose episode ended since its reset
        self.queued = False                    # its ACT waits for actions (queued or held)


class MultiAgentInference(Inference):
    """The policies run for server-inference clients of a multi-agent env, and their
    agents' trajectories (``Inference``'s interface)."""

    def __init__(self, spec: MultiAgentSpec, policy_map: str, env_steps_per_sample: int,
                 league_prob: float = 0.0, seed: int = 0):
        super().__init__()
        self.spec, self.env_steps_per_sample, self.league_prob = spec, env_steps_per_sample, league_prob
        self.mapper = policy_mapper(policy_map)
        self.agent_of = {str(a): a for a in spec.agents}   # the wire's agent ids are strings
        self.policies = PolicySet()
        self.actors: dict = {}             # pid -> its Actor (rows are whichever agents act: no state)
        self.slots: dict[str, _Conn] = {}
        self._entries: dict | None = None   # SET_STATE's policies, until an ACT needs them
        self._seeds = itertools.count(seed * 1_000_003)
        self.rng = np.random.default_rng(seed)

    def load(self, version: int, policies: dict) -> None:
        if version != self.version:
            self.version, self._entries = version, policies

    def _sync(self) -> None:
        """The published policies as ONNX models (a changed one rebuilt), the unused dropped."""
        if self._entries is None:
            return
        entries, self._entries = self._entries, None
        self.policies.update(entries)
        for pid in entries:
            spec = self._spec_of(pid)
            if spec is not None:
                check_policy_fits(self.policies.models[pid], spec)
        in_use = {pid for conn in self.slots.values() for assigned in conn.sampler.assigned
                  for pid in assigned.values()}
        self.policies.prune(in_use)
        for pid in set(self.actors) - set(self.policies.models):
            del self.actors[pid]

    def _spec_of(self, pid: str):
        """The spaces of the agents policy ``pid`` (or the policy it is a snapshot of) plays."""
        base = pid.split("@", 1)[0]
        agent = next((a for a in self.spec.agents if self.mapper(a) == base), None)
        return None if agent is None else self.spec.agent_specs[agent]

    # ------------------------------------------------------------ one ACT
    def act(self, conn_id: str, msg: dict) -> tuple[MultiAgentBatch | None, str | None]:
        """Record an ACT: (the connection's chunks when its sample is complete, else None;
        why the ACT breaks its connection's history or does not fit the env, else None)."""
        if "envs" not in msg:
            return None, "a single-agent ACT ('obs') in a multi-agent run: send 'envs', one object per env"
        self._sync()
        envs, why = self._check(msg["envs"])
        if why:
            return None, why
        conn = self.slots.get(conn_id)
        if conn is None:
            if any(env["outcome"] for env in envs):
                return None, "the first ACT of a connection carries no 'rewards' (no step was taken yet)"
            sampler = MultiAgentRollout.remote(self.spec, self.mapper, self.policies, len(envs),
                                               next(self._seeds), self.league_prob)
            conn = self.slots[conn_id] = _Conn(sampler)
            sampler.to_act = [env["obs"] for env in envs]
            return None, None
        if conn.queued:
            return None, "an ACT before the ACTIONS of its last one (one ACT at a time)"
        if len(envs) != conn.k:
            return None, f"ACT with {len(envs)} envs; this connection's first had {conn.k} (K is fixed per connection)"
        if not all(env["outcome"] for env in envs):
            return None, "an env without 'rewards' after the connection's first ACT (every ACT but the first has them)"
        why = self._acting_again(conn, envs)
        if why:
            return None, why
        sampler = conn.sampler
        waiting: dict = defaultdict(list)   # env -> its agents whose last action waits for its outcome
        for k, agent in sampler.pending:
            waiting[k].append(agent)
        for k, env in enumerate(envs):
            self._record(conn, k, env, waiting[k])
        if sampler.steps < self.env_steps_per_sample:
            return None, None
        return sampler.take(), None

    def _check(self, envs: list) -> tuple[list, str | None]:
        """The envs with their agents as the env's ids and observations in the stored form
        (one row's), or why they are not the env's."""
        out = []
        for k, env in enumerate(envs):
            where = f"env {k}"
            for field in ("obs", "rewards", "terminateds", "truncateds", "final_obs"):
                unknown = sorted(set(env[field]) - set(self.agent_of))
                if unknown:
                    return [], (f"{where} {field}: agent ids {rllink.show(unknown)} are not the env's "
                                f"(its agents: {rllink.show(sorted(self.agent_of))})")
            parsed = dict(env)
            for field in ("obs", "final_obs"):
                parsed[field] = {}
                for name, obs in env[field].items():
                    agent = self.agent_of[name]
                    layout = self.spec.agent_specs[agent].obs
                    why, stored = layout.check(obs)
                    if why:
                        return [], f"{where} {field} of {name!r}: {why}"
                    if field == "obs" and layout.mask is not None and not stored[MASK_KEY].any():
                        return [], f"{where}: the action_mask of {name!r} allows no action, yet it is to act"
                    parsed[field][agent] = ({leaf: v[0] for leaf, v in stored.items()} if isinstance(stored, dict)
                                            else stored[0])
            for field in ("rewards", "terminateds", "truncateds"):
                parsed[field] = {self.agent_of[name]: v for name, v in env[field].items()}
            out.append(parsed)
        return out, None

    @staticmethod
    def _acting_again(conn: _Conn, envs: list) -> str | None:
        """Why an agent acts after its episode ended, before its env's reset (§11.3: an
        agent's episode ends once); else None, each env's ended agents updated."""
        for k, env in enumerate(envs):
            again = set() if env["reset"] else conn.ended[k] & env["obs"].keys()
            if again:
                return (f"env {k}: agents {rllink.show(sorted(map(str, again)))} act again after their episode "
                        f"ended, before the env's reset ('reset': true starts the next episode)")
        for ended, env in zip(conn.ended, envs):
            if env["reset"]:   # the agents that ended with it were the old episode's
                ended.clear()
            else:
                ended.update(env["terminateds"], env["truncateds"])
        return None

    def _record(self, conn: _Conn, k: int, env: dict, waiting: list) -> None:
        """Env k's step as the client reports it: of the agents ``waiting`` for the outcome
        of their last action, those whose step ended (at their next action or their end)
        get it, the others' rewards wait; ``reset`` ends the episode
        (``MultiAgentRollout.record``) and ``obs`` is the next one's."""
        sampler, rewards, reset = conn.sampler, env["rewards"], env["reset"]
        term, trunc, final, acting = env["terminateds"], env["truncateds"], env["final_obs"], env["obs"]
        results = {}
        for agent in waiting:
            reward = conn.owed.pop((k, agent), 0.0) + rewards.get(agent, 0.0)
            if agent in term or agent in trunc:
                # a terminated agent's last observation is never used: its chunk's last stands in
                last = final.get(agent, sampler.open[(k, agent)].obs[-1])
                results[agent] = (last, reward, agent in term, agent in trunc)
            elif agent in acting and not reset:
                results[agent] = (acting[agent], reward, False, False)
            elif not reset:   # its step goes on (its turn has not come): what it got waits
                conn.owed[(k, agent)] = reward
        sampler.record(k, results, reset)
        sampler.to_act[k] = acting

    # ------------------------------------------------------------ one forward pass per policy
    def _gather(self, conns: list[str], slots: list[_Conn]) -> tuple[list[str], list[_Conn], dict]:
        """The queued connections with their rows by policy: pid -> [(conn, its rows of that policy)]."""
        self._sync()
        groups: dict = defaultdict(list)
        for conn_id, conn in zip(conns, slots):
            for pid, items in conn.sampler.gather().items():
                groups[pid].append((conn_id, items))
        return conns, slots, groups

    def _forward(self, gathered: tuple[list[str], list[_Conn], dict]) -> list[list[dict]]:
        """One forward pass per policy; each connection's actions, per env agent -> action."""
        conns, slots, groups = gathered
        actions = {c: [{} for _ in range(conn.k)] for c, conn in zip(conns, slots)}
        for pid, parts in groups.items():
            self._forward_policy(pid, parts, actions)
        return [actions[c] for c in conns]

    def _forward_policy(self, pid: str, parts: list, actions: dict) -> None:
        """One forward pass of policy ``pid`` for its rows of every connection."""
        agent0 = parts[0][1][0][1]
        rows = [obs for _, items in parts for _, _, obs in items]
        obs = self.spec.agent_specs[agent0].obs.stack(rows)
        chosen, logits, logp = self._actor(pid, agent0).act(obs)
        chosen = np.asarray(chosen)
        self.forward_passes += 1
        self.rows += len(rows)
        start = 0
        for conn_id, items in parts:
            mine = slice(start, start + len(items))
            start += len(items)
            self.slots[conn_id].sampler.chose(pid, items, chosen[mine], logits[mine], logp[mine])
            for (k, agent, _), action in zip(items, chosen[mine].tolist()):
                actions[conn_id][k][str(agent)] = action

    def _actor(self, pid: str, agent) -> Actor:
        model, actor = self.policies.models[pid], self.actors.get(pid)
        if actor is None:
            actor = self.actors[pid] = Actor(model, self.spec.agent_specs[agent], None, self.rng)
        elif actor.policy is not model:
            actor.load(model)
        return actor

    def forget(self, conn_id: str) -> int:
        conn = self.slots.pop(conn_id, None)
        return 0 if conn is None else conn.sampler.steps


def multiagent_inference(policy_specs: dict, agents, extra_config: dict, env_steps_per_sample: int,
                         env_id: str = "") -> tuple[MultiAgentInference, dict]:
    """The multi-agent run's server-side inference, and SET_CONFIG's ``agent_spaces`` (each
    agent's observation and action spaces, as §11's SET_CONFIG gives one env's)."""
    policy_map = extra_config.get("policy_map", "shared")
    mapper = policy_mapper(policy_map)
    agent_specs = {a: policy_specs[mapper(a)] for a in agents}
    spec = MultiAgentSpec(env_id, tuple(agents), agent_specs)
    inference = MultiAgentInference(spec, policy_map, env_steps_per_sample, float(extra_config.get("league_prob", 0)))
    return inference, {"agent_spaces": {str(a): space_config(s) for a, s in agent_specs.items()}}
