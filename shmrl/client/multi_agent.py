"""Many agents in one simulator: the multi-agent simulator loop and the self-play
evaluation (``play``). The envs themselves (``--env pz:NAME``, their specs, stepping
Parallel and turn-based envs) are the PettingZoo adapter's, ``shmrl.envs.pettingzoo_envs``; the
agent-to-policy map is ``shmrl.envs.spec.policy_mapper``.

Each agent's steps go into chunks of their own (``agent_id``) under the policy that
chose them (``module_id``): the learner trains one PPO per policy. The map from agent to
policy is ``shared`` (one policy for all, the default), ``per-agent`` (a policy named
after each agent) or ``package.module:fn`` (a function agent_id -> policy_id).

Self-play (symmetric games): every agent plays the shared policy and all of them learn;
with a league (``--league N``), the learner also publishes frozen snapshots of each
policy (``policy@version``, ``frozen: true`` in SET_STATE), and at each episode start,
with probability ``league_prob``, one agent of the episode plays a snapshot picked
uniformly instead; a frozen policy's steps are not sent.

Like ``shmrl.sim``, this never imports torch.
"""
from __future__ import annotations

import logging
import time
from collections import defaultdict, deque
from typing import Callable

import numpy as np

from shmrl import rllink
from shmrl.client.actor import Actor, check_policy_fits, check_sample, handshake as _handshake   # the name of an argument below
from shmrl.envs.make import resolve_env
from shmrl.envs.spec import MultiAgentSpec, policy_mapper
from shmrl.core.episode import Episode, EpisodeBatch, MultiAgentBatch, new_episode_id
from shmrl.onnxio.policy import OnnxPolicy, decode_onnx_file, encode_onnx_file
from shmrl.envs.pettingzoo_envs import stepper
from shmrl.core.spaces import MASK_KEY

log = logging.getLogger("shmrl.multiagent")
T = rllink.MessageType


# ------------------------------------------------------------------ the simulator loop

class PolicySet:
    """The ONNX models of SET_STATE's ``policies``, rebuilt only where the version changed.
    A snapshot the league has dropped stays until no episode plays it (``prune``)."""

    def __init__(self):
        self.models: dict = {}     # pid -> OnnxPolicy
        self.seqs: dict = {}       # pid -> weights_seq_no
        self.frozen: set = set()
        self.published: set = set()   # the pids of the latest SET_STATE

    def update(self, policies: dict) -> None:
        for pid, entry in policies.items():
            if self.seqs.get(pid) != entry["weights_seq_no"] or pid not in self.models:
                self.models[pid] = OnnxPolicy(decode_onnx_file(entry["onnx_file"]))
                self.seqs[pid] = entry["weights_seq_no"]
            if entry.get("frozen"):
                self.frozen.add(pid)
        self.published = set(policies)

    def prune(self, in_use: set) -> None:
        """Forget the models no longer published that no agent plays."""
        for pid in set(self.models) - self.published - in_use:
            del self.models[pid], self.seqs[pid]
            self.frozen.discard(pid)

    def snapshots_of(self, pid: str) -> list:
        return sorted(p for p in self.frozen & self.published if p.split("@", 1)[0] == pid)


class MultiAgentRollout:
    """K multi-agent envs, every policy's decisions batched into one ONNX call per step.

    Each env's agents get their policies at its episode start (the map, a league
    snapshot for one of them with ``league_prob``, or ``assign(k)``); finished chunks (and,
    at ``take()``, the running ones cut) are grouped per policy.
    """

    def __init__(self, factory, spec: MultiAgentSpec, mapper: Callable, policies: PolicySet, num_envs: int,
                 seed: int, league_prob: float = 0.0, opponent: Callable | None = None,
                 assign: Callable | None = None, greedy: bool = False):
        self.spec, self.mapper, self.policies = spec, mapper, policies
        self.rng = np.random.default_rng(seed)
        self.league_prob = league_prob
        self.opponent = opponent     # eval: (agent, obs) -> action, for agents of no known policy
        self.greedy = greedy         # eval: each policy's most likely action, not a sample
        self.assign = assign         # k -> {agent: policy} at each episode start, instead of the map
        self.games: deque = deque(maxlen=10_000)   # ({agent: policy}, {agent: return}) of ended episodes
        self.envs = None if factory is None else [stepper(factory(), seed * 1_000_003 + k) for k in range(num_envs)]
        self.layouts = {a: s.obs for a, s in spec.agent_specs.items()}
        self.actors: dict = {}     # pid -> the Actor of that policy (its sampler and current model)
        self.open: dict = {}       # (k, agent) -> Episode of its current chunk
        self.pending: dict = {}    # (k, agent) -> (action, dist inputs, logp): outcome not known yet
        self.assigned: list = [{} for _ in range(num_envs)]   # per env: agent -> policy
        self.episode_ids = [new_episode_id() for _ in range(num_envs)]
        self.num_envs = num_envs
        self.returns: list = [defaultdict(float) for _ in range(num_envs)]
        self.finished: list = []   # (policy, Episode) done since the last take()
        self.completed: deque = deque(maxlen=1000)   # (policy, agent, return) of finished agent episodes
        self.steps = 0             # agent steps recorded for trainable policies since the last take()
        self.to_act = [self._reset(k) for k in range(num_envs)]

    @classmethod
    def remote(cls, spec: MultiAgentSpec, mapper: Callable, policies: PolicySet, num_envs: int, seed: int,
               league_prob: float = 0.0) -> "MultiAgentRollout":
        """The bookkeeping of K envs that a client steps (server-side inference,
        ``shmrl.server.inference.multi_agent``): no envs here; whoever holds it sets ``to_act`` from the
        client's observations (already in the stored form), acts with ``gather`` and
        ``chose``, and reports each env's step with ``record``."""
        return cls(None, spec, mapper, policies, num_envs, seed, league_prob)

    def _reset(self, k: int) -> dict:
        """Env k's next episode: its policies assigned, its env reset (none when remote)."""
        self.start_episode(k)
        return {} if self.envs is None else dict(self.envs[k].reset())

    def start_episode(self, k: int) -> None:
        """A new episode id and returns for env k, and its agents' policies: the map, or a
        league snapshot for one of them with ``league_prob`` (``assign(k)`` in eval)."""
        self.episode_ids[k] = new_episode_id()
        self.returns[k] = defaultdict(float)
        if self.assign is not None:
            self.assigned[k] = self.assign(k)
            return
        assigned = self.assigned[k] = {a: self.mapper(a) for a in self.spec.agents}
        if self.league_prob and self.rng.random() < self.league_prob:
            agent = self.spec.agents[self.rng.integers(len(self.spec.agents))]
            snaps = self.policies.snapshots_of(assigned[agent])
            if snaps:
                assigned[agent] = snaps[self.rng.integers(len(snaps))]

    def _own(self, agent, obs):
        """``obs`` in the stored form, copied: an env may reuse its arrays (a remote
        client's come validated, in the stored form, and are its message's own)."""
        if self.envs is None:
            return obs
        stored = self.layouts[agent].split(obs)
        return {k: v.copy() for k, v in stored.items()} if isinstance(stored, dict) else stored.copy()

    def policy_of(self, k: int, agent) -> str:
        pid = self.assigned[k].get(agent)
        if pid is None:   # an agent that joined late, beyond possible_agents' first map
            pid = self.assigned[k][agent] = self.mapper(agent)
        return pid

    def step(self) -> None:
        """Every agent that must act acts (one ONNX call per policy), every env steps."""
        actions: list = [{} for _ in self.envs]
        for pid, items in self.gather().items():
            agent0 = items[0][1]
            if self.opponent is not None and pid not in self.policies.models:
                for k, agent, stored in items:
                    actions[k][agent] = self.opponent(agent, stored)
                    self.pending[(k, agent)] = None
                continue
            obs = self.layouts[agent0].stack([o for _, _, o in items])
            chosen, logits, logp = self._actor(pid, agent0).act(obs)
            to_env = self.spec.agent_specs[agent0].actions.to_env(
                np.asarray(chosen) if not isinstance(chosen, list) else chosen)
            self.chose(pid, items, chosen, logits, logp)
            for i, (k, agent, _) in enumerate(items):
                actions[k][agent] = to_env[i]
        for k, env in enumerate(self.envs):
            if not actions[k]:
                continue
            results, to_act, over = env.step(actions[k])
            self.record(k, results, over)
            self.to_act[k] = dict(env.reset()) if over else to_act

    def gather(self) -> dict:
        """The agents that must act now (``to_act``), by policy: pid -> [(env, agent,
        stored obs)]; a chunk is opened for each agent that has none."""
        groups: dict = defaultdict(list)
        for k, to_act in enumerate(self.to_act):
            for agent, obs in to_act.items():
                key = (k, agent)
                stored = self._own(agent, obs)
                if key not in self.open:
                    self.open[key] = Episode(stored, id=f"{self.episode_ids[k]}-{agent}", agent_id=agent,
                                             weights_seq_no=None)
                groups[self.policy_of(k, agent)].append((k, agent, stored))
        return groups

    def chose(self, pid: str, items: list, chosen, logits, logp) -> None:
        """Policy ``pid`` chose ``chosen`` (rows as ``items``, one of ``gather``'s groups):
        each waits for its outcome (``record``); a chunk's version is its first action's."""
        for i, (k, agent, _) in enumerate(items):
            self.pending[(k, agent)] = (chosen[i], logits[i], logp[i])
            if self.open[(k, agent)].weights_seq_no is None:
                self.open[(k, agent)].weights_seq_no = self.policies.seqs[pid]

    def record(self, k: int, results: dict, over: bool) -> None:
        """Env k's step: ``results`` (agent -> (next obs, reward, terminated, truncated) of
        the agents whose step ended), ``over``: the episode is over (its agents still open
        end truncated, without their last action) and the next one starts."""
        for agent, (obs, reward, term, trunc) in results.items():
            key = (k, agent)
            taken = self.pending.pop(key)
            self.returns[k][agent] += reward
            ep = self.open[key]
            if taken is not None:
                ep.add_step(taken[0], reward, self._own(agent, obs), taken[1], taken[2], term, trunc)
                if self.policy_of(k, agent) not in self.policies.frozen:
                    self.steps += 1
            if term or trunc:
                self._finish(k, agent)
        if over:
            for (kk, agent) in [key for key in self.open if key[0] == k]:
                ep = self.open[(kk, agent)]   # left without an outcome: its chunk ends truncated
                self.pending.pop((kk, agent), None)
                if len(ep):
                    ep.is_truncated = True
                self._finish(k, agent)
            self.games.append((dict(self.assigned[k]), dict(self.returns[k])))
            self.start_episode(k)

    def _actor(self, pid: str, agent) -> Actor:
        """The Actor of policy ``pid`` (made for the spaces of ``agent``, one of its
        agents), acting with the policy's latest model; the rows of its calls are
        whichever agents act, so it keeps no recurrent state."""
        model, actor = self.policies.models[pid], self.actors.get(pid)
        if actor is None:
            actor = self.actors[pid] = Actor(model, self.spec.agent_specs[agent], None, self.rng, self.greedy)
        elif actor.policy is not model:
            actor.load(model)
        return actor

    def prune_policies(self) -> None:
        """Forget the models (and their actors) no longer published that no agent plays."""
        self.policies.prune({pid for assigned in self.assigned for pid in assigned.values()})
        for pid in set(self.actors) - set(self.policies.models):
            del self.actors[pid]

    def _finish(self, k: int, agent) -> None:
        ep = self.open.pop((k, agent))
        pid = self.policy_of(k, agent)
        self.completed.append((pid, agent, self.returns[k][agent]))
        if len(ep) and pid not in self.policies.frozen and self.opponent is None:
            self.finished.append((pid, ep))

    def take(self) -> MultiAgentBatch:
        """The finished chunks and the running ones cut here, per policy (frozen ones left out)."""
        chunks = self.finished
        self.finished = []
        for key, ep in list(self.open.items()):
            pid = self.policy_of(*key)
            if len(ep) and pid not in self.policies.frozen:
                chunks.append((pid, ep))
                self.open[key] = ep.cut()
                self.open[key].weights_seq_no = None
        groups: dict = defaultdict(list)
        for pid, ep in chunks:
            groups[pid].append(ep.finalize())
        self.steps = 0
        return MultiAgentBatch({pid: EpisodeBatch.from_episodes(eps) for pid, eps in groups.items()})


def run_simulator(client, env_id, seed: int = 0, envs_per_sim: int = 1, max_messages: int | None = None,
                  log_every_s: float | None = None, auth_token: str | None = None,
                  policy_map: str | None = None, handshake: tuple | None = None) -> int:
    """``shmrl.client.simulator.run_simulator`` for a multi-agent env: sample with the learner's latest
    policies until the connection ends; returns the agent steps sent. The policy map is
    the server's (SET_CONFIG ``policy_map``) unless ``policy_map`` is given. ``handshake``:
    (SET_CONFIG, SET_STATE) where the caller has done it already."""
    config, state = handshake or _handshake(client, auth_token)
    if "policies" not in state:
        raise ValueError(f"{env_id} is a multi-agent env but the server trains a single-agent policy")
    factory, spec = resolve_env(env_id)
    if not isinstance(spec, MultiAgentSpec):
        raise ValueError(f"the server trains several policies (a multi-agent env), but {env_id} is single-agent")
    mapper = policy_mapper(policy_map or config.get("policy_map", "shared"))
    policies = PolicySet()
    policies.update(state["policies"])
    wanted = spec.policy_specs(mapper)
    if set(wanted) - set(policies.models):
        raise ValueError(f"{env_id}: the server has no policy {sorted(set(wanted) - set(policies.models))} "
                         f"(its policies: {sorted(policies.models)})")
    for pid, policy_spec in wanted.items():
        check_policy_fits(policies.models[pid], policy_spec)
    sampler = MultiAgentRollout(factory, spec, mapper, policies, envs_per_sim, seed,
                                league_prob=float(config.get("league_prob", 0.0)))
    per_sample = int(config["env_steps_per_sample"])
    sent = messages = 0
    next_log = time.monotonic() + (log_every_s or 0.0)
    while max_messages is None or messages < max_messages:
        while sampler.steps < per_sample:
            sampler.step()
            client.heartbeat(sent + sampler.steps)
        batch = sampler.take()
        for policy_batch in batch.policies.values():   # a NaN is the env's or the policy's: say so here
            check_sample(policy_batch, spec.env_id)
        reply = client.request({"type": T.EPISODES_AND_GET_STATE.value, "episodes": batch,
                                "timesteps": batch.num_steps})
        sent += batch.num_steps
        messages += 1
        if reply["type"] != T.SET_STATE.value or "policies" not in reply:
            raise ConnectionError(f"expected a multi-agent SET_STATE, got {reply['type']}")
        policies.update(reply["policies"])
        sampler.prune_policies()
        per_sample = reply.get("env_steps_per_sample", per_sample)   # the server shares its batch anew
        if log_every_s and time.monotonic() >= next_log:
            next_log += log_every_s
            log.info("sent %d agent steps; policies %s; mean returns %s", sent, policies.seqs,
                     mean_returns(sampler.completed))
    return sent


def act_loop(client, config: dict, env_id, seed: int = 0, num_envs: int = 1, max_messages: int | None = None,
             log_every_s: float | None = None) -> int:
    """``shmrl.client.simulator.run_server_inference`` for a multi-agent env (docs/RLLINK.md §11.3),
    after PING and GET_CONFIG: each ACT carries, per env, the agents that act now with
    their observations and the outcome of the last step (what each agent's step that ended
    got, who terminated or was truncated, ``reset`` where the episode ended and the env
    was reset); each ACTIONS an action per acting agent. No policy runs here. Returns the
    agent steps taken."""
    factory, spec = resolve_env(env_id)
    if not isinstance(spec, MultiAgentSpec):
        raise ValueError(f"the server trains several policies (a multi-agent env), but {env_id} is single-agent")
    served = config.get("agent_spaces")
    if served is None:
        raise ValueError(f"{env_id} is a multi-agent env but the server trains a single-agent policy")
    if sorted(served) != sorted(map(str, spec.agents)):
        raise ValueError(f"the server's agents are {sorted(served)}, {spec.env_id}'s {sorted(map(str, spec.agents))}: "
                         f"is it another env?")
    envs = [stepper(factory(), seed * 1_000_003 + k) for k in range(num_envs)]
    layouts = {a: s.obs for a, s in spec.agent_specs.items()}

    def wire(by_agent: dict) -> dict:   # agent -> observation as the ACT carries it
        return {str(a): layouts[a].split(o) for a, o in by_agent.items()}

    to_act = [env.reset() for env in envs]
    msg = {"type": T.ACT.value, "envs": [{"obs": wire(obs)} for obs in to_act]}
    returns = [defaultdict(float) for _ in envs]
    recent: deque = deque(maxlen=1000)     # (None, agent, return) of ended episodes, as ``mean_returns`` reads
    stepped = messages = 0
    next_log = time.monotonic() + (log_every_s or 0.0)
    while max_messages is None or messages < max_messages:
        reply = client.request(msg)
        messages += 1
        if reply["type"] != T.ACTIONS.value or len(reply["actions"]) != num_envs:
            raise ConnectionError(f"expected ACTIONS for {num_envs} envs, got {rllink.show(reply)}")
        msg = {"type": T.ACT.value, "envs": []}
        for k, env in enumerate(envs):
            chosen = reply["actions"][k]
            missing = [a for a in to_act[k] if str(a) not in chosen]
            if missing:
                raise ConnectionError(f"ACTIONS has no action for agents {missing} of env {k}")
            actions = {a: spec.agent_specs[a].actions.to_env(np.asarray([chosen[str(a)]]))[0] for a in to_act[k]}
            results, to_act[k], over = env.step(actions)
            stepped += len(actions)
            outcome = {"rewards": {str(a): r for a, (_, r, _, _) in results.items()},
                       "terminateds": {str(a): True for a, (_, _, term, _) in results.items() if term},
                       "truncateds": {str(a): True for a, (_, _, _, trunc) in results.items() if trunc},
                       "final_obs": wire({a: o for a, (o, _, _, trunc) in results.items() if trunc})}
            for a, (_, r, _, _) in results.items():
                returns[k][a] += r
            if over:
                recent.extend((None, a, ret) for a, ret in returns[k].items())
                returns[k] = defaultdict(float)
                to_act[k], outcome["reset"] = env.reset(), True
            msg["envs"].append({"obs": wire(to_act[k]), **outcome})
        if log_every_s and time.monotonic() >= next_log:
            next_log += log_every_s
            log.info("stepped %d agent steps; weights %s; mean returns %s", stepped, reply["weights_seq_no"],
                     mean_returns(recent))
    return stepped


def mean_returns(completed) -> dict:
    """agent -> mean return of its recent episodes."""
    by_agent: dict = defaultdict(list)
    for _, agent, ret in completed:
        by_agent[agent].append(ret)
    return {a: round(float(np.mean(r)), 3) for a, r in by_agent.items()}


# ------------------------------------------------------------------ evaluation

def random_legal_action(rng: np.random.Generator, layout):
    """A uniformly random action among those the observation's action_mask allows."""
    def choose(agent, stored):
        if isinstance(stored, dict) and MASK_KEY in stored:
            return int(rng.choice(np.flatnonzero(stored[MASK_KEY])))
        return int(rng.integers(layout[agent].dist_size))
    return choose


def play(env_id, model_bytes: bytes, opponent="random", episodes: int = 100, seed: int = 0,
         num_envs: int = 8, greedy: bool = False) -> dict:
    """Win, draw and loss rates of the policy ``model_bytes`` against ``opponent``: "random"
    (a uniformly random legal player), "self" (the same policy) or another policy's model
    bytes. The policy takes the seats in turn, game by game (for two players: half the
    games first, half second); a game is a win when the return of the policy's agent beats
    every other agent's, a draw when it ties the best of them."""
    factory, spec = resolve_env(env_id)
    if not isinstance(spec, MultiAgentSpec):
        raise ValueError(f"{env_id} is not a multi-agent env")
    agents = spec.agents
    policies = PolicySet()
    entries = {"learner": {"onnx_file": encode_onnx_file(model_bytes), "weights_seq_no": 0}}
    if isinstance(opponent, (bytes, bytearray)):
        entries["opponent"] = {"onnx_file": encode_onnx_file(bytes(opponent)), "weights_seq_no": 0}
    elif opponent not in ("random", "self"):
        raise ValueError(f"opponent must be 'random', 'self' or a policy's model bytes, not {opponent!r}")
    policies.update(entries)
    rng = np.random.default_rng(seed + 7)
    games = [0]

    def seat(k: int) -> dict:   # the learner's seat goes round, game by game
        mine = agents[games[0] % len(agents)]
        games[0] += 1
        return {a: "learner" if a == mine or opponent == "self" else "opponent" for a in agents}

    sampler = MultiAgentRollout(factory, spec, lambda a: "learner", policies, max(1, min(num_envs, episodes)),
                                seed, assign=seat, opponent=random_legal_action(rng, sampler_layouts(spec)),
                                greedy=greedy)
    wins = draws = losses = 0
    while len(sampler.games) < episodes:
        sampler.step()
    for assigned, returns in list(sampler.games)[:episodes]:
        mine = [returns[a] for a, pid in assigned.items() if pid == "learner"]
        theirs = [returns[a] for a, pid in assigned.items() if pid != "learner"]
        if opponent == "self":   # the first seat against the others
            mine, theirs = [returns[agents[0]]], [returns[a] for a in agents[1:]]
        best_other = max(theirs) if theirs else -np.inf
        if max(mine) > best_other:
            wins += 1
        elif max(mine) == best_other:
            draws += 1
        else:
            losses += 1
    n = wins + draws + losses
    return {"env": spec.env_id, "opponent": opponent if isinstance(opponent, str) else "policy",
            "episodes": n, "win_rate": wins / n, "draw_rate": draws / n, "loss_rate": losses / n}


def sampler_layouts(spec: MultiAgentSpec) -> dict:
    return {a: s.actions for a, s in spec.agent_specs.items()}

