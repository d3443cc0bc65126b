"""The conformance checker's rules about what a client sends (``python -m shmrl.conformance``
plays the server; this module judges the messages): each check returns the violations it
found as ``(rule, text)`` pairs, ``rule`` naming the section of docs/RLLINK.md broken.

The field and type checks are shmrl's own (``rllink.validate``, ``hub.check_episodes``):
what the checker calls a violation is what shmrl's server would refuse. On top of those come
the rules a server cannot check one message at a time: chunks continue where the last
message left off, output 0 comes from the model the client was sent, log-probabilities
belong to the actions, the message size follows SET_CONFIG.
"""
from __future__ import annotations

import math

import numpy as np

from shmrl import rllink
from shmrl.client.action_sampler import squashed_log_prob
from shmrl.core.episode import EpisodeBatch, obs_map, obs_rows
from shmrl.rllink.act import binary_act_arrays
from shmrl.server.hub import check_episodes

S_FRAMING = "RLLINK.md §1 Framing"
S_CONVERSATION = "RLLINK.md §2 The conversation"
S_MESSAGES = "RLLINK.md §3 Messages"
S_PING = "RLLINK.md §3.1 PING and PONG"
S_CONFIG = "RLLINK.md §3.2 GET_CONFIG and SET_CONFIG"
S_STATE = "RLLINK.md §3.3 GET_STATE and SET_STATE"
S_EPISODES = "RLLINK.md §4 Episodes"
S_ACTIONS = "RLLINK.md §4.2 Actions and their distribution"
S_HEARTBEAT = "RLLINK.md §5 HEARTBEAT"
S_REPLIES = "RLLINK.md §6 When replies come"
S_BINARY = "RLLINK.md §7 The binary codec"
S_INFERENCE = "RLLINK.md §11 Server-side inference"
S_ACT = "RLLINK.md §11.1 ACT and ACTIONS"
S_ACT_MA = "RLLINK.md §11.3 Many agents"
MIN_STEPS = 2000       # connection 1's env_steps_per_sample at least, by default (--steps)
LIMITS_PER_SAMPLE = 8  # ... and that many times the env's time limit: 3 messages take 24 envs past it


def default_steps(spec) -> int:
    """Connection 1's env_steps_per_sample when --steps is not given: enough for every env
    of a client of up to 3 * LIMITS_PER_SAMPLE envs to reach the env's time limit (where it
    has one) in the 3 messages, so that the run sees episodes end."""
    limit = getattr(spec, "max_episode_steps", None) or 0
    return max(MIN_STEPS, LIMITS_PER_SAMPLE * limit)

ATOL = 2e-3   # float32 outputs of two onnxruntime builds, and log-probs summed in float32


def read_frame(recv_exactly) -> tuple[dict | None, tuple | None]:
    """One request through ``recv_exactly(n)`` (which raises on a closed connection or a
    timeout): (the validated message, None), or (None, the violation that made it unreadable)."""
    header = recv_exactly(rllink.HEADER_LEN)
    try:
        length = rllink.parse_header(header)
    except rllink.ProtocolError as e:
        return None, (S_FRAMING, f"bad frame header: {e}")
    body = recv_exactly(length)
    try:
        msg = rllink.decode(body)
    except rllink.ProtocolError as e:
        return None, (S_BINARY if bytes(body[:4]) == rllink.MAGIC else S_FRAMING, f"the body does not decode: {e}")
    try:
        out = rllink.validate(msg, "request")
        if out["type"] == "ACT" and "obs" in out and bytes(body[:4]) == rllink.MAGIC:
            binary_act_arrays(msg)   # as shmrl's server reads a binary ACT
        return out, None
    except rllink.ProtocolError as e:
        kind = msg.get("type") if isinstance(msg, dict) else None
        rule = (S_EPISODES if isinstance(msg, dict) and "episodes" in msg else
                (S_ACT_MA if "envs" in msg else S_ACT) if kind == "ACT" else S_MESSAGES)
        text = str(e)
        return None, (rule, text if kind and text.startswith(kind) else f"{kind or '?'}: {text}")


def log_probs(layout, dist: np.ndarray, actions: np.ndarray) -> np.ndarray:
    """log pi(a) of each step's action under its distribution inputs (RLLINK.md §4.2): the
    sum over the action's parts, categorical or Gaussian."""
    dist = np.asarray(dist, np.float64)
    acts = np.asarray(actions, np.float64).reshape(len(dist), -1)
    total = np.zeros(len(dist))
    for part, cols, a_cols in layout.slices():
        x = dist[:, cols]
        if part.kind == "categorical":
            m = x.max(axis=1)
            lse = m + np.log(np.exp(x - m[:, None]).sum(axis=1))
            idx = acts[:, a_cols.start].astype(np.int64)
            total += x[np.arange(len(x)), idx] - lse
        else:
            d = x.shape[1] // 2
            mean, log_std = x[:, :d], x[:, d:]
            z = (acts[:, a_cols] - mean) / np.exp(log_std)
            total += (-0.5 * z * z - log_std).sum(axis=1) - d * 0.5 * math.log(2 * math.pi)
    return total


def box_log_probs(part, how: str, dist: np.ndarray, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(log pi(a) of each step's action of a single bounded Box sampled as ``how``, SAC's
    ``squashed_gaussian`` or ``uniform`` (RLLINK.md §4.2); which steps it is checked on):
    the squash inverted (u = atanh(y)) loses float32's precision within 1e-3 of a bound,
    so those steps are left out (their bounds are checked all the same)."""
    low, high = np.asarray(part.low, np.float64), np.asarray(part.high, np.float64)
    acts = np.asarray(actions, np.float64).reshape(len(dist), -1)
    if how == "uniform":
        return np.full(len(acts), -np.log(high - low).sum()), np.ones(len(acts), bool)
    half = (high - low) / 2
    y = (acts - low) / half - 1.0
    checked = (np.abs(y) < 1 - 1e-3).all(axis=1)
    u = np.arctanh(np.clip(y, -1 + 1e-7, 1 - 1e-7))
    d = acts.shape[1]
    mean, log_std = np.asarray(dist, np.float64)[:, :d], np.asarray(dist, np.float64)[:, d:]
    return squashed_log_prob(u, (u - mean) * np.exp(-log_std), log_std, half), checked


def _obs_rows(obs, rows) -> object:
    return obs_map(lambda v: v[rows], obs)


def _same_obs(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    return np.array_equal(a, b)


class EpisodeRules:
    """The rules over the EPISODES messages of one connection: fields (shmrl's validation),
    the env's shapes, continuity from message to message, output 0 and log-probs."""

    def __init__(self, spec, models: dict, dists: dict | None = None):
        self.spec, self.models = spec, models      # models: version -> OnnxPolicy
        self.dists = dists or {}                   # version -> SET_STATE's action_dist (SAC's); none: RLlib's
        self.open: dict = {}                       # running episodes: key -> last obs
        self.ended: set = set()                    # ids of episodes that ended
        self.uses_ids = None
        self.episodes_ended = 0                    # chunks that ended an episode, on this connection

    def new_connection(self) -> None:
        """The server forgot every running episode (RLLINK.md §2)."""
        self.open, self.ended, self.episodes_ended = {}, set(), 0

    def check(self, msg: dict, where: str, held_version: int, steps_per_sample: int) -> list[tuple]:
        batch = msg["episodes"]
        if not isinstance(batch, EpisodeBatch):
            return [(S_EPISODES, f"{where}: multi-agent chunks (module_id) sent to a single-agent env")]
        why = check_episodes(batch, self.spec)
        if why:
            return [(S_EPISODES, f"{where}: the chunks do not fit {self.spec.env_id}: {why}")]
        self.episodes_ended += int((batch.is_terminated | batch.is_truncated).sum())
        out = []
        n = batch.num_steps
        if not steps_per_sample <= n < 2 * steps_per_sample:
            out.append((S_CONFIG, f"{where}: {n} env steps in the message; SET_CONFIG asked for "
                                  f"env_steps_per_sample {steps_per_sample} (between that and twice it)"))
        out += self._versions(batch, where, held_version)
        out += self._output0(batch, where, held_version)
        out += self._continuity(batch, where)
        return out

    def _versions(self, batch: EpisodeBatch, where: str, held: int) -> list[tuple]:
        said = sorted(set(batch.weights_seq_no.tolist()) - {-1})
        if said and said != [held]:
            return [(S_EPISODES, f"{where}: chunks say weights_seq_no {said}, but the client held version "
                                f"{held} (the last SET_STATE it was sent) while sampling them")]
        return []

    def _output0(self, batch: EpisodeBatch, where: str, held: int) -> list[tuple]:
        """action_dist_inputs must be output 0 of the held model for each step's obs, and
        action_logp the log-probability of the step's action under it."""
        if not batch.num_steps:
            return []
        step_rows = np.concatenate([np.arange(f, l) for f, l in zip(batch.obs_first, batch.obs_last)])
        expected = self.models[held].logits(_obs_rows(batch.obs, step_rows))
        sent = np.asarray(batch.action_dist_inputs, np.float32)
        out = []
        if not np.allclose(sent, expected, atol=ATOL, rtol=1e-3):
            others = [v for v, m in self.models.items() if v != held
                      and np.allclose(sent, m.logits(_obs_rows(batch.obs, step_rows)), atol=ATOL, rtol=1e-3)]
            bad = int(np.argmax(np.abs(sent - expected).max(axis=1)))
            hint = (f"they are version {others[0]}'s: the new model of SET_STATE was not loaded (§3.3)" if others
                    else f"step {bad}: sent {sent[bad].tolist()}, the model gives {expected[bad].tolist()}")
            out.append((S_ACTIONS, f"{where}: action_dist_inputs are not output 0 of version {held}'s model "
                                   f"for the steps' observations; {hint}"))
        how = self.dists.get(held)
        if how is None:
            logp, checked = log_probs(self.spec.actions, sent, batch.actions), np.ones(batch.num_steps, bool)
        else:   # SAC's: the actions within the bounds, their log-probabilities as sampled
            part = self.spec.actions.parts[0]
            acts = np.asarray(batch.actions, np.float64).reshape(batch.num_steps, -1)
            outside = np.flatnonzero(((acts < np.asarray(part.low)) | (acts > np.asarray(part.high))).any(axis=1))
            if len(outside):
                i = int(outside[0])
                out.append((S_ACTIONS, f"{where}: {len(outside)} of {batch.num_steps} actions lie outside the Box's "
                                       f"bounds, sampled as {how!r} (step {i}: {acts[i].tolist()})"))
            logp, checked = box_log_probs(part, how, sent, batch.actions)
        wrong = np.flatnonzero(checked & ~np.isclose(batch.action_logp, logp, atol=ATOL, rtol=1e-4))
        if len(wrong):
            i = int(wrong[0])
            said = f", sampled as {how!r} as SET_STATE said" if how else ""
            out.append((S_ACTIONS, f"{where}: action_logp of {len(wrong)} of {batch.num_steps} steps is not the "
                                   f"log-probability of the action under action_dist_inputs{said} (step {i}: sent "
                                   f"{float(batch.action_logp[i]):.5g}, expected {logp[i]:.5g})"))
        return out

    def _continuity(self, batch: EpisodeBatch, where: str) -> list[tuple]:
        """A running episode continues in the next message, from its last obs; an ended one
        never does (RLLINK.md §4)."""
        ids = batch.episode_ids or [None] * batch.num_chunks
        out, continued, now_open = [], set(), {}
        for i, eid in enumerate(ids):
            first = _obs_rows(batch.obs, int(batch.obs_first[i]))
            if eid is not None and eid in self.ended:
                out.append((S_EPISODES, f"{where}, chunk {i}: episode_id {eid!r} continues an episode that ended"))
            key = eid if eid is not None and eid in self.open else None
            if key is None and eid is None:   # no id (RLlib's client): glued by the repeated obs
                key = next((k for k, last in self.open.items() if k not in continued and _same_obs(last, first)), None)
            if key is not None:
                continued.add(key)
                if not _same_obs(self.open[key], first):
                    out.append((S_EPISODES, f"{where}, chunk {i}: continues episode {key!r} but does not start from "
                                            f"its last observation"))
            done = bool(batch.is_terminated[i] or batch.is_truncated[i])
            name = eid if eid is not None else key if key is not None else f"{where}#{i}"
            if done:
                if eid is not None:
                    self.ended.add(eid)
            else:
                now_open[name] = _obs_rows(batch.obs, int(batch.obs_last[i]))
        for key in self.open.keys() - continued:
            out.append((S_EPISODES, f"{where}: episode {key!r}, left running in the previous message, was not "
                                    f"continued (a chunk starting from its last observation)"))
        self.open = now_open
        return out


class ActRules:
    """The rules over the ACTs of a server-inference client on one connection (RLLINK.md
    §11.1) beyond shmrl's validation of each (``rllink_act``): K fixed by the first ACT,
    the step's outcome absent from the first and present in every other, observations
    that fit the env, and ``final_obs`` too where an env was truncated (all its rows, as
    shmrl's server checks them, though it uses only the truncated envs'). For a multi-agent env
    (``multi``, its ``MultiAgentSpec``; §11.3) the same per env, with the agents the env's,
    each agent's observations fitting its spaces, and no agent acting again in an episode
    it ended before the env's reset."""

    def __init__(self, spec, multi=None):
        self.spec, self.multi = spec, multi
        self.new_connection()

    def new_connection(self) -> None:
        self.k, self.acts, self.episodes_ended = None, 0, 0
        self.ended: dict = {}    # env -> the agents whose episode ended since its reset (many agents)

    def check(self, msg: dict, where: str) -> list[tuple]:
        if self.multi is not None or "envs" in msg:
            return self._check_multi(msg, where)
        out = []
        k = obs_rows(msg["obs"])
        if self.k is None:
            self.k = k
        elif k != self.k:
            out.append((S_ACT, f"{where}: {k} envs; the connection's first ACT had {self.k} "
                               f"(K is fixed for a connection)"))
        if self.acts == 0 and "rewards" in msg:
            out.append((S_ACT, f"{where}: the connection's first ACT carries rewards, terminateds and truncateds; "
                               f"there was no step before it (they must be absent)"))
        elif self.acts and "rewards" not in msg:
            out.append((S_ACT, f"{where}: no rewards, terminateds, truncateds: every ACT but a connection's first "
                               f"carries the outcome of the step the last ACTIONS made"))
        why, _ = self.spec.obs.check(msg["obs"])
        if why:
            out.append((S_ACT, f"{where}: 'obs' does not fit {self.spec.env_id}: {why}"))
        if "rewards" in msg:
            truncated = np.asarray(msg["truncateds"])
            self.episodes_ended += int((truncated | np.asarray(msg["terminateds"])).sum())
            if truncated.any():   # every row, as shmrl's server checks it: those of envs not truncated go unused
                why, _ = self.spec.obs.check(msg["final_obs"])
                if why:
                    out.append((S_ACT, f"{where}: 'final_obs' does not fit {self.spec.env_id}: {why} (every row "
                                       f"must, the rows of envs not truncated too, though they are not used)"))
        self.acts += 1
        return out

    def _check_multi(self, msg: dict, where: str) -> list[tuple]:
        if self.multi is None:
            return [(S_ACT_MA, f"{where}: a multi-agent ACT ('envs') for {self.spec.env_id}, a single-agent env")]
        if "envs" not in msg:
            return [(S_ACT_MA, f"{where}: a single-agent ACT ('obs') for {self.multi.env_id}, a multi-agent env: "
                               f"send 'envs', one object per env")]
        out, envs = [], msg["envs"]
        if self.k is None:
            self.k = len(envs)
        elif len(envs) != self.k:
            out.append((S_ACT_MA, f"{where}: {len(envs)} envs; the connection's first ACT had {self.k} "
                                  f"(K is fixed for a connection)"))
        if self.acts == 0 and any(env["outcome"] for env in envs):
            out.append((S_ACT_MA, f"{where}: the connection's first ACT carries an outcome ('rewards'); there was "
                                  f"no step before it"))
        elif self.acts and not all(env["outcome"] for env in envs):
            out.append((S_ACT_MA, f"{where}: an env without 'rewards': every ACT but a connection's first carries "
                                  f"the outcome of the step the last ACTIONS made, for every env"))
        names = {str(a): a for a in self.multi.agents}
        for k, env in enumerate(envs):
            out += self._env_rules(k, env, names, f"{where}, env {k}")
        self.acts += 1
        return out

    def _env_rules(self, k: int, env: dict, names: dict, where: str) -> list[tuple]:
        out = []
        for field in ("obs", "final_obs", "rewards", "terminateds", "truncateds"):
            unknown = sorted(set(env[field]) - set(names))
            if unknown:
                out.append((S_ACT_MA, f"{where}: {field} names agents {unknown}, which are not "
                                      f"{self.multi.env_id}'s ({sorted(names)})"))
        for field in ("obs", "final_obs"):
            for name, obs in env[field].items():
                if name in names:
                    why, _ = self.multi.agent_specs[names[name]].obs.check(obs)
                    if why:
                        out.append((S_ACT_MA, f"{where}: {field} of {name!r} does not fit {self.multi.env_id}: {why}"))
        ended = set(env["terminateds"]) | set(env["truncateds"])
        self.episodes_ended += len(ended)
        if env["reset"]:
            self.ended[k] = set()
            return out
        again = sorted(set(env["obs"]) & self.ended.get(k, set()))
        if again:
            out.append((S_ACT_MA, f"{where}: agents {again} act again after their episode ended, before the env's "
                                  f"reset ('reset': true starts the next episode)"))
        self.ended.setdefault(k, set()).update(ended)
        return out
