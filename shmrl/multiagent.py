"""Many agents in one simulator: PettingZoo envs, the agent-to-policy map, and the
multi-agent simulator loop.

An env is multi-agent when it is a PettingZoo ``ParallelEnv`` (every live agent acts at
each step) or ``AECEnv`` (agents act in turn, as in connect_four); ``--env pz:NAME``
makes ``NAME``'s ``parallel_env()`` where it has one, else its ``env()``, from
``pettingzoo.classic``/``butterfly``/``sisl`` or ``mpe2``.

Each agent's steps go into chunks of their own (``agent_id``) under the policy that
chose them (``module_id``): the learner trains one PPO per policy. The map from agent to
policy is ``shared`` (one policy for all, the default), ``per-agent`` (a policy named
after each agent) or ``package.module:fn`` (a function agent_id -> policy_id).

Turn-based (AEC) envs are stepped turn by turn: an agent's step ends when its next turn
comes (or its episode ends), with the reward it got meanwhile (``env.last()``'s
cumulative reward), so a reward given at the end of a game goes to both players.

Self-play (symmetric games): every agent plays the shared policy and all of them learn;
with a league (``--league N``), the learner also publishes frozen snapshots of each
policy (``policy@version``, ``frozen: true`` in SET_STATE), and at each episode start,
with probability ``league_prob``, one agent of the episode plays a snapshot picked
uniformly instead; a frozen policy's steps are not sent.

Like ``shmrl.sim``, this never imports torch.
"""
from __future__ import annotations

import importlib
import logging
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from shmrl import rllink
from shmrl.episode import Episode, EpisodeBatch, MultiAgentBatch, new_episode_id

log = logging.getLogger("shmrl.multiagent")
T = rllink.MessageType
SHARED_POLICY = "shared"
POLICY_MAPS = ("shared", "per-agent")
PZ_PACKAGES = ("pettingzoo.classic", "pettingzoo.butterfly", "pettingzoo.sisl", "mpe2")


# ------------------------------------------------------------------ envs and specs

def is_multiagent(env) -> bool:
    """A PettingZoo env (Parallel or AEC): its spaces are functions of the agent."""
    return hasattr(env, "possible_agents") and callable(getattr(env, "observation_space", None))


def is_turn_based(env) -> bool:
    """An AECEnv (one agent at a time), not a ParallelEnv."""
    return hasattr(env, "agent_selection") or hasattr(env, "agent_iter")


def pz_make(name: str):
    """``pettingzoo.<family>.<name>`` or ``mpe2.<name>``: its parallel_env() if it has one,
    else its env(). Where the module has a ``raw_env``, it is used without PettingZoo's
    safety wrappers (order enforcement, bounds assertions, ending the game on an illegal
    move), which cost about 2/3 of a connect_four or simple_spread step here: shmrl
    steps the API in order, and its policies never choose a masked action."""
    import warnings

    for package in PZ_PACKAGES:
        try:
            with warnings.catch_warnings():   # PettingZoo 1.27 deprecates these modules for its registry,
                warnings.simplefilter("ignore", DeprecationWarning)   # whose envs come wrapped
                module = importlib.import_module(f"{package}.{name}")
        except ImportError as e:
            if getattr(e, "name", "") not in (f"{package}.{name}", package, package.split(".")[0]):
                raise ValueError(f"--env pz:{name}: {e} (pip install 'shmrl[pettingzoo]')") from None
            continue
        raw = getattr(module, "raw_env", None)
        if raw is not None:
            if hasattr(module, "parallel_env"):
                from pettingzoo.utils.conversions import aec_to_parallel

                return aec_to_parallel(raw())
            return raw()
        make = getattr(module, "parallel_env", None) or getattr(module, "env")
        return make()
    raise ValueError(f"--env pz:{name}: no such env in {', '.join(PZ_PACKAGES)} (installed: pip install "
                     f"'shmrl[pettingzoo]' and 'shmrl[mpe2]')")


@dataclass(frozen=True)
class MultiAgentSpec:
    """A multi-agent env's spaces: one EnvSpec per possible agent."""
    env_id: str
    agents: tuple
    agent_specs: dict = field(hash=False)
    turn_based: bool = False
    reward_threshold: float | None = None
    multiagent = True

    def policy_specs(self, mapper: Callable) -> dict:
        """policy id -> the EnvSpec of its agents, which must agree in their spaces."""
        out, first = {}, {}
        for agent in self.agents:
            pid, spec = mapper(agent), self.agent_specs[agent]
            if pid in out and (out[pid].obs, out[pid].actions) != (spec.obs, spec.actions):
                raise ValueError(f"{self.env_id}: agents {first[pid]!r} and {agent!r} map to policy {pid!r} but "
                                 f"have different spaces")
            out.setdefault(pid, spec)
            first.setdefault(pid, agent)
        return out


def multiagent_spec(env, env_id: str) -> MultiAgentSpec:
    from shmrl.envs import space_spec

    return MultiAgentSpec(env_id, tuple(env.possible_agents),
                          {a: space_spec(f"{env_id}[{a}]", env.observation_space(a), env.action_space(a))
                           for a in env.possible_agents}, is_turn_based(env))


def policy_mapper(policy_map: str) -> Callable:
    """agent_id -> policy_id for ``shared``, ``per-agent`` or ``package.module:fn``."""
    if policy_map == "shared":
        return lambda agent: SHARED_POLICY
    if policy_map == "per-agent":
        return str
    module, _, name = policy_map.partition(":")
    if not name:
        raise ValueError(f"--policy-map {policy_map!r}: shared, per-agent or package.module:fn")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--policy-map {policy_map}: cannot load {name} from {module}: {e}") from None
    return lambda agent: str(fn(agent))


# ------------------------------------------------------------------ stepping

class ParallelStepper:
    """A ParallelEnv as turns: every live agent acts at once."""

    def __init__(self, env, seed: int | None):
        self.env, self.seed = env, seed

    def reset(self) -> dict:
        obs, _ = self.env.reset(seed=self.seed)
        self.seed = None
        return dict(obs)

    def step(self, actions: dict) -> tuple[dict, dict, bool]:
        """(results: agent -> (next obs, reward, terminated, truncated) of the agents that
        acted, the agents to act next -> obs, whether the episode is over)."""
        obs, rewards, terms, truncs, _ = self.env.step(actions)
        results = {a: (obs[a], float(rewards.get(a, 0.0)), bool(terms.get(a, False)), bool(truncs.get(a, False)))
                   for a in actions if a in obs}
        live = set(self.env.agents)
        to_act = {a: o for a, o in obs.items() if a in live and not (terms.get(a) or truncs.get(a))}
        return results, to_act, not to_act


class TurnStepper:
    """An AECEnv stepped turn by turn: an agent's step ends at its next turn or its end."""

    def __init__(self, env, seed: int | None):
        self.env, self.seed = env, seed
        self.acted: set = set()     # agents whose last action still waits for its outcome

    def reset(self) -> dict:
        self.env.reset(seed=self.seed)
        self.seed = None
        self.acted = set()
        return self._advance({})[1]

    def step(self, actions: dict) -> tuple[dict, dict, bool]:
        (agent, action), = actions.items()
        self.env.step(action)
        self.acted.add(agent)
        results, to_act = self._advance({})
        return results, to_act, not to_act

    def _advance(self, results: dict) -> tuple[dict, dict]:
        env = self.env
        while env.agents:
            agent = env.agent_selection
            obs, reward, term, trunc, _ = env.last()
            if agent in self.acted:
                self.acted.discard(agent)
                results[agent] = (obs, float(reward), bool(term), bool(trunc))
            if term or trunc:
                env.step(None)
                continue
            return results, {agent: obs}
        return results, {}


def stepper(env, seed: int | None):
    return TurnStepper(env, seed) if is_turn_based(env) else ParallelStepper(env, seed)


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
        from shmrl.onnx_policy import OnnxPolicy, decode_onnx_file

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


class MultiAgentSampler:
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
        self.envs = [stepper(factory(), seed * 1_000_003 + k) for k in range(num_envs)]
        self.layouts = {a: s.obs for a, s in spec.agent_specs.items()}
        self.actions = {a: s.actions for a, s in spec.agent_specs.items()}
        from shmrl.spaces import Sampler

        self.samplers = {a: Sampler(s.actions, self.rng) for a, s in spec.agent_specs.items()}
        self.open: dict = {}       # (k, agent) -> Episode of its current chunk
        self.pending: dict = {}    # (k, agent) -> (action, dist inputs, logp): outcome not known yet
        self.assigned: list = [{} for _ in range(num_envs)]   # per env: agent -> policy
        self.episode_ids = [new_episode_id() for _ in range(num_envs)]
        self.returns: list = [defaultdict(float) for _ in range(num_envs)]
        self.finished: list = []   # (policy, Episode) done since the last take()
        self.completed: deque = deque(maxlen=1000)   # (policy, agent, return) of finished agent episodes
        self.steps = 0             # agent steps recorded for trainable policies since the last take()
        self.to_act = [self._reset(k) for k in range(num_envs)]

    def _reset(self, k: int) -> dict:
        self.episode_ids[k] = new_episode_id()
        self.returns[k] = defaultdict(float)
        env = self.envs[k]
        if self.assign is not None:
            self.assigned[k] = self.assign(k)
            return dict(env.reset())
        assigned = self.assigned[k] = {a: self.mapper(a) for a in self.spec.agents}
        if self.league_prob and self.rng.random() < self.league_prob:
            agent = self.spec.agents[self.rng.integers(len(self.spec.agents))]
            snaps = self.policies.snapshots_of(assigned[agent])
            if snaps:
                assigned[agent] = snaps[self.rng.integers(len(snaps))]
        return {a: o for a, o in env.reset().items()}

    def _own(self, agent, obs):
        """``obs`` in the stored form, copied: an env may reuse its arrays."""
        stored = self.layouts[agent].split(obs)
        return {k: v.copy() for k, v in stored.items()} if isinstance(stored, dict) else stored.copy()

    def policy_of(self, k: int, agent) -> str:
        pid = self.assigned[k].get(agent)
        if pid is None:   # an agent that joined late, beyond possible_agents' first map
            pid = self.assigned[k][agent] = self.mapper(agent)
        return pid

    def step(self) -> None:
        """Every agent that must act acts (one ONNX call per policy), every env steps."""
        groups: dict = defaultdict(list)
        for k, to_act in enumerate(self.to_act):
            for agent, obs in to_act.items():
                key = (k, agent)
                stored = self._own(agent, obs)
                if key not in self.open:
                    self.open[key] = Episode(stored, id=f"{self.episode_ids[k]}-{agent}", agent_id=agent,
                                             weights_seq_no=None)
                groups[self.policy_of(k, agent)].append((k, agent, stored))
        actions: list = [{} for _ in self.envs]
        for pid, items in groups.items():
            agent0 = items[0][1]
            if self.opponent is not None and pid not in self.policies.models:
                for k, agent, stored in items:
                    actions[k][agent] = self.opponent(agent, stored)
                    self.pending[(k, agent)] = None
                continue
            obs = self.layouts[agent0].stack([o for _, _, o in items])
            logits = self.policies.models[pid].logits(obs)
            if self.greedy:
                chosen = self.samplers[agent0].greedy(logits)
                logp = np.zeros(len(chosen))
            else:
                chosen, logp = self.samplers[agent0].sample(logits)
            to_env = self.actions[agent0].to_env(np.asarray(chosen) if not isinstance(chosen, list) else chosen)
            for i, (k, agent, _) in enumerate(items):
                self.pending[(k, agent)] = (chosen[i], logits[i], logp[i])
                actions[k][agent] = to_env[i]
                if self.open[(k, agent)].weights_seq_no is None:
                    self.open[(k, agent)].weights_seq_no = self.policies.seqs[pid]
        for k, env in enumerate(self.envs):
            if not actions[k]:
                continue
            results, to_act, over = env.step(actions[k])
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
                to_act = self._reset(k)
            self.to_act[k] = to_act

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
    """``shmrl.sim.run_simulator`` for a multi-agent env: sample with the learner's latest
    policies until the connection ends; returns the agent steps sent. The policy map is
    the server's (SET_CONFIG ``policy_map``) unless ``policy_map`` is given. ``handshake``:
    (SET_CONFIG, SET_STATE) where the caller has done it already."""
    from shmrl.envs import resolve_env
    from shmrl import sim

    config, state = handshake or sim.handshake(client, auth_token)
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
        sim.check_policy_fits(policies.models[pid], policy_spec)
    sampler = MultiAgentSampler(factory, spec, mapper, policies, envs_per_sim, seed,
                                league_prob=float(config.get("league_prob", 0.0)))
    per_sample = int(config["env_steps_per_sample"])
    sent = messages = 0
    next_log = time.monotonic() + (log_every_s or 0.0)
    while max_messages is None or messages < max_messages:
        while sampler.steps < per_sample:
            sampler.step()
            client.heartbeat(sent + sampler.steps)
        batch = sampler.take()
        reply = client.request({"type": T.EPISODES_AND_GET_STATE.value, "episodes": batch,
                                "timesteps": batch.num_steps})
        sent += batch.num_steps
        messages += 1
        if reply["type"] != T.SET_STATE.value or "policies" not in reply:
            raise ConnectionError(f"expected a multi-agent SET_STATE, got {reply['type']}")
        policies.update(reply["policies"])
        policies.prune({pid for assigned in sampler.assigned for pid in assigned.values()})
        if log_every_s and time.monotonic() >= next_log:
            next_log += log_every_s
            log.info("sent %d agent steps; policies %s; mean returns %s", sent, policies.seqs,
                     mean_returns(sampler.completed))
    return sent


def mean_returns(completed) -> dict:
    """agent -> mean return of its recent episodes."""
    by_agent: dict = defaultdict(list)
    for _, agent, ret in completed:
        by_agent[agent].append(ret)
    return {a: round(float(np.mean(r)), 3) for a, r in by_agent.items()}


# ------------------------------------------------------------------ evaluation

def random_legal_action(rng: np.random.Generator, layout):
    """A uniformly random action among those the observation's action_mask allows."""
    from shmrl.spaces import MASK_KEY

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
    from shmrl.envs import resolve_env

    factory, spec = resolve_env(env_id)
    if not isinstance(spec, MultiAgentSpec):
        raise ValueError(f"{env_id} is not a multi-agent env")
    agents = spec.agents
    policies = PolicySet()
    entries = {"learner": {"onnx_file": _as_onnx_file(model_bytes), "weights_seq_no": 0}}
    if isinstance(opponent, (bytes, bytearray)):
        entries["opponent"] = {"onnx_file": _as_onnx_file(bytes(opponent)), "weights_seq_no": 0}
    elif opponent not in ("random", "self"):
        raise ValueError(f"opponent must be 'random', 'self' or a policy's model bytes, not {opponent!r}")
    policies.update(entries)
    rng = np.random.default_rng(seed + 7)
    games = [0]

    def seat(k: int) -> dict:   # the learner's seat goes round, game by game
        mine = agents[games[0] % len(agents)]
        games[0] += 1
        return {a: "learner" if a == mine or opponent == "self" else "opponent" for a in agents}

    sampler = MultiAgentSampler(factory, spec, lambda a: "learner", policies, max(1, min(num_envs, episodes)),
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


def _as_onnx_file(model_bytes: bytes) -> str:
    from shmrl.onnx_policy import encode_onnx_file

    return encode_onnx_file(model_bytes)
