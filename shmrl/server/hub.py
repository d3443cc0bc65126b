"""The Hub: the RLlink server logic for every transport (docs/RLLINK.md).

Transports hand the Hub validated messages; the Hub also checks them against the
environment (shapes, action range) because a client's input is never trusted.
"""
from __future__ import annotations

import contextlib
import hmac
import logging
import time
from dataclasses import dataclass

import numpy as np

from shmrl import rllink
from shmrl.envs.spec import EnvSpec
from shmrl.core.episode import EpisodeBatch, MultiAgentBatch
from shmrl.server.inference.single_agent import ServerInference, space_config
from shmrl.server.inference.multi_agent import multiagent_inference
from shmrl.core.spaces import MASK_KEY
from shmrl.server.store import DEFAULT_POLICY, EpisodeStore

log = logging.getLogger("shmrl.learner")
T = rllink.MessageType
OVER_BUDGET = "over the client's budget"   # of pending env steps: why a flood's steps are dropped
_ACT = T.ACT.value

def check_episodes(batch: EpisodeBatch, spec: EnvSpec, state_size: int = 0) -> str | None:
    """Why validated chunks do not fit the environment (and the policy's recurrent state of
    ``state_size`` floats), or None; fitting ones get their observations and actions in the
    stored dtypes (an image's JSON integers as bytes), and zeros where a recurrent policy's
    chunks came without ``state_in`` (the state an episode starts from)."""
    if batch.state_in is None:
        if state_size:
            batch.state_in = np.zeros((batch.num_chunks, state_size), np.float32)
    elif not state_size:
        return "the chunks carry 'state_in', but the policy has no memory"
    elif batch.state_in.shape[1:] != (state_size,):
        return f"'state_in' has {batch.state_in.shape[1:]} values per chunk; the policy's state has {state_size}"
    if batch.num_chunks:
        why, obs = spec.obs.check(batch.obs)
        if why:
            return why
        batch.obs = obs
    if not batch.num_steps:
        return None
    layout, actions = spec.actions, batch.actions
    if batch.action_dist_inputs.shape[1:] != (layout.dist_size,):
        return f"action_dist_inputs shape {batch.action_dist_inputs.shape[1:]} != ({layout.dist_size},)"
    if layout.single_box and actions.ndim == 1 and layout.action_size == 1:
        actions = batch.actions = actions.reshape(len(actions), 1)
    mask = None
    if spec.obs.mask is not None:   # the mask each action was taken under: the obs of its step
        chunk_of_step = np.repeat(np.arange(batch.num_chunks), batch.lengths)
        mask = batch.obs[MASK_KEY][np.arange(batch.num_steps) + chunk_of_step]
    return layout.check(actions, mask)


def chunks_by_policy(batch, policy_specs: dict, multiagent: bool, state_size: int = 0) -> tuple[dict, str | None]:
    """A message's chunks by policy id, and why they do not fit the run (its kind, its
    policies and their envs) or None. The boundary of the codec: a multi-agent message's
    chunks are by module id; a single-agent run's are its one policy's."""
    sent_multi = isinstance(batch, MultiAgentBatch)
    if sent_multi != multiagent:
        if multiagent and not batch.num_chunks:
            return {}, None
        return {}, ("multi-agent episodes (module_id) sent to a single-agent run" if sent_multi else
                    "single-agent episodes sent to a multi-agent run: every chunk needs agent_id and module_id")
    if not multiagent:
        return {DEFAULT_POLICY: batch}, check_episodes(batch, policy_specs[DEFAULT_POLICY], state_size)
    for pid, sub in batch.policies.items():
        if pid not in policy_specs:
            return {}, (f"chunks for policy {pid!r}, which this run does not train "
                        f"(its policies: {sorted(policy_specs)})")
        why = check_episodes(sub, policy_specs[pid], state_size)
        if why:
            return {}, f"policy {pid!r}: {why}"
    return batch.policies, None


@dataclass(frozen=True)
class Bounds:
    """What a client's chunk may hold (docs/OPERATIONS.md, "What shmrl guarantees"): finite but absurd
    values would make the loss, then every weight, NaN."""
    max_obs_abs: float = 1e6       # float observation leaves (images, uint8, are exempt)
    max_reward_abs: float = 1e6
    max_env_steps_per_s: float = 1e7   # a HEARTBEAT's env_steps grow at most this fast per connection


LOGP_TOLERANCE = 1e-3   # a discrete action's log-probability above this is no probability


def _per_chunk(bad_rows: np.ndarray, rows_per_chunk: np.ndarray) -> np.ndarray:
    """Which chunks hold a bad row (rows laid out chunk after chunk)."""
    n = len(rows_per_chunk)
    if not bad_rows.any():
        return np.zeros(n, bool)
    return np.bincount(np.repeat(np.arange(n), rows_per_chunk)[bad_rows], minlength=n) > 0


def refused_chunks(batch: EpisodeBatch, spec: EnvSpec, bounds: Bounds, version: int) -> dict[str, np.ndarray]:
    """The chunks (a boolean mask per reason; a chunk under its first reason only) that hold
    values outside the documented bounds: observations or rewards too large (or not finite),
    behaviour log-probabilities that no policy gives (not finite, above 0 for discrete
    actions), a ``weights_seq_no`` beyond the server's current ``version``. Numpy per
    message, no loop over steps. (A finite but absurdly negative log-probability is PPO's
    to bound: ``shmrl.model.ppo.MAX_LOG_RATIO``; only the learner knows its policy's own.)"""
    n, lengths = batch.num_chunks, batch.lengths
    if not n:
        return {}
    bad_obs = np.zeros(n, bool)
    for leaf in (batch.obs.values() if isinstance(batch.obs, dict) else [batch.obs]):
        if leaf.dtype.kind == "f" and leaf.size:
            bad_obs |= _per_chunk(~(np.abs(leaf) <= bounds.max_obs_abs).reshape(len(leaf), -1).all(axis=1),
                                  lengths + 1)
    found = {"observation out of bounds": bad_obs,
             "reward out of bounds": _per_chunk(~(np.abs(batch.rewards) <= bounds.max_reward_abs), lengths)}
    logp = batch.action_logp
    bad_logp = ~(logp <= LOGP_TOLERANCE) if spec.actions.discrete else ~np.isfinite(logp)
    found["action_logp out of bounds"] = _per_chunk(bad_logp, lengths)
    seq = batch.weights_seq_no    # -1: not said; below that, an unsigned number that wrapped
    found["weights_seq_no from the future"] = (seq > version) | (seq < -1)
    taken = np.zeros(n, bool)
    for reason, bad in found.items():
        found[reason] = bad & ~taken
        taken |= bad
    return {reason: bad for reason, bad in found.items() if bad.any()}


class Hub:
    """Answers RLlink requests from any transport alike.

    PING, GET_CONFIG and GET_STATE are answered at once. Episodes go to the store.
    SET_CONFIG always says ``force_on_policy: true``: every client waits for SET_STATE
    after each batch (RLlib's client refuses anything else), which is what lets the Hub
    pace it. ``on_policy``: an EPISODES_AND_GET_STATE is answered with the *next* weights,
    as RLlib's server does; otherwise at once with the current ones, unless
    ``max_pending_steps`` already wait for the learner (that bounds the policy lag).
    """

    def __init__(self, policy_specs: dict[str, EnvSpec], store: EpisodeStore, env_steps_per_sample: int,
                 on_policy: bool = True, max_pending_steps: int | None = None,
                 auth_token: str | None = None, state_size: int = 0, multiagent: bool = False,
                 extra_config: dict | None = None, client_budget: int | None = None, agents=None,
                 bounds: Bounds = Bounds()):
        """``policy_specs``: the run's policies (policy id -> EnvSpec of its agents; a
        single-agent run's one is ``DEFAULT_POLICY``); ``multiagent``: the clients speak in
        agents and modules (RLlib's multi-agent messages); ``extra_config``: more fields
        for SET_CONFIG (a multi-agent run's policy map); ``client_budget``: the env steps one
        connection may have waiting for training, past which its chunks are dropped and
        counted (None: no budget); ``agents``: the env's agent ids, the only ones a
        multi-agent chunk may carry (None: any); ``bounds``: what a chunk may hold (chunks
        beyond them are refused and counted, the connection goes on)."""
        self.policy_specs, self.store, self.state_size = policy_specs, store, state_size
        self.multiagent = multiagent
        self.auth_token = auth_token
        self.authenticated: set[str] = set()     # with an auth token: connections that showed it
        self.max_pending_steps = max_pending_steps
        self.config_msg = {"type": T.SET_CONFIG.value, "env_steps_per_sample": env_steps_per_sample,
                           "force_on_policy": True, **(extra_config or {})}
        self.on_policy = on_policy
        self.state_msg: dict | None = None
        self.servers: dict[str, object] = {}     # conn_id -> the server that owns it
        self.sampling: set[str] = set()          # connections that have asked for weights
        self.waiting: list[str] = []             # connections waiting for the next weights
        self.waiting_since: float | None = None  # time.monotonic() when the first of them began
        self.names: dict[str, str] = {}          # conn_id -> the client_name its PING gave
        self.stepped: dict[str, int] = {}        # conn_id -> env steps its last HEARTBEAT reported
        self.bounds = bounds
        self.opened: dict[str, float] = {}       # conn_id -> time.monotonic() of its first message
        self.arrivals: dict[str, tuple] = {}     # conn_id -> (time, steps) of its first message, (time, steps) of all
        self.refusals_logged: set = set()        # (conn_id, reason): each is logged once per client
        self.heartbeats_ignored = 0              # HEARTBEATs that claimed more steps than could be stepped
        self.client_budget = client_budget
        self.agents = None if agents is None else frozenset(agents)
        self.over_budget: set[str] = set()       # connections told (in the log) that they are over budget
        self.held: set[str] = set()              # connections not read (their budget is spent), by transports that can
        # Server-side inference: the policy run for clients that asked in their PING;
        # SET_CONFIG describes the spaces for them (and for every client). A multi-agent
        # run's needs its agents and policy map (shmrl.server.inference.multi_agent).
        self.inference = None
        self.served: set[str] = set()            # connections granted server-side inference
        if not multiagent:
            spec = policy_specs[DEFAULT_POLICY]
            self.inference = ServerInference(spec, env_steps_per_sample, state_size)
            self.config_msg.update(space_config(spec))
        elif agents is not None and "policy_map" in self.config_msg and not state_size:
            self.inference, spaces = multiagent_inference(policy_specs, agents, self.config_msg,
                                                          env_steps_per_sample)
            self.config_msg.update(spaces)

    def set_state(self, weights_seq_no: int, policies: dict) -> None:
        """Publish new weights and release every client waiting for them. ``policies``: the
        SET_STATE ``policies`` entries (policy id -> onnx_file, weights_seq_no[, frozen])."""
        if self.multiagent:
            self.state_msg = {"type": T.SET_STATE.value, "policies": policies, "weights_seq_no": weights_seq_no}
        else:   # RLlib's single-agent message, its bytes (key order included) as RLlib's JSON has them
            self.state_msg = {"type": T.SET_STATE.value, "onnx_file": policies[DEFAULT_POLICY]["onnx_file"],
                              "weights_seq_no": weights_seq_no}
        if self.inference is not None:
            self.inference.load(weights_seq_no, policies if self.multiagent else policies[DEFAULT_POLICY]["onnx_file"])
        self.release_waiting()

    def all_waiting(self) -> bool:
        return bool(self.sampling) and len(self.waiting) == len(self.sampling)

    def delivery_rate(self) -> float:
        """The env steps per second the open connections deliver together. Each one's: the
        steps of its messages after the first over the seconds between the first and the
        last (its start up left out); with one message so far, its steps over the seconds
        since its first request (a client that waits for new weights after each message)."""
        now, rate = time.monotonic(), 0.0
        for conn_id, opened in self.opened.items():
            t_first, first, t_last, steps = self.arrivals.get(conn_id, (now, 0, now, 0))
            rate += (steps - first) / (t_last - t_first) if t_last > t_first else steps / max(now - opened, 1e-3)
        return rate

    def handle(self, server, conn_id: str, msg: dict | None) -> None:
        self.servers[conn_id] = server
        if msg is None:
            self.forget(conn_id)
            return
        kind = msg["type"]
        if self.auth_token is not None and conn_id not in self.authenticated:
            # Only a PING with the token opens a connection; anything else gets nothing
            # but a closed connection (the reason is logged, never sent).
            token = msg.get("auth_token", "") if kind == T.PING.value else ""
            # "surrogatepass": a lone surrogate (valid JSON) is a wrong token, not a crash.
            if not hmac.compare_digest(token.encode("utf-8", "surrogatepass"), self.auth_token.encode()):
                self.servers[conn_id].drop(conn_id, "authentication failed: PING without the right auth_token"
                                           if kind == T.PING.value else f"{kind} before an authenticated PING")
                self.forget(conn_id)
                return
            self.authenticated.add(conn_id)
        if kind == _ACT:   # first: a server-inference client sends one per env step
            self._act(conn_id, msg)
            return
        self.opened.setdefault(conn_id, time.monotonic())
        if kind == T.HEARTBEAT.value:  # answered by nothing; the transport saw it alive
            if msg["env_steps"] is not None:
                self._heartbeat(conn_id, msg["env_steps"])
        elif kind == T.PING.value:
            if "client_name" in msg:
                self.names[conn_id] = msg["client_name"]
                log.info("%s is %s", conn_id, msg["client_name"])
            pong = {"type": T.PONG.value}
            if msg.get("inference") == "server" and self.inference is not None:
                self.served.add(conn_id)
                pong["inference"] = "server"
            self._reply(conn_id, pong)
        elif kind == T.GET_CONFIG.value:
            self._reply(conn_id, self.config_msg)
        elif kind == T.GET_STATE.value:
            self.sampling.add(conn_id)
            self._reply(conn_id, self.state_msg)
        else:  # EPISODES, EPISODES_AND_GET_STATE
            if not self._take(conn_id, msg["episodes"]):
                return
            if kind == T.EPISODES_AND_GET_STATE.value:
                self.sampling.add(conn_id)
                self._wait_or_answer(conn_id)

    def _take(self, conn_id: str, batch) -> bool:
        """A message's chunks checked and into the store (those beyond the bounds or the
        client's budget dropped and counted); False if they do not fit the run, which
        closes the connection."""
        chunks, reason = chunks_by_policy(batch, self.policy_specs, self.multiagent, self.state_size)
        reason = reason or self._unknown_agents(batch)
        if reason:
            self._drop(conn_id, reason, batch.num_steps)
            return False
        chunks = self._refuse_out_of_bounds(conn_id, chunks)
        steps = sum(sub.num_steps for sub in chunks.values())
        if self._within_budget(conn_id, steps):
            self.store.add(conn_id, chunks)
            self._hold_if_full(conn_id)
            now = time.monotonic()
            t_first, first, _, total = self.arrivals.get(conn_id, (now, steps, now, 0))
            self.arrivals[conn_id] = (t_first, first, now, total + steps)
        return True

    def _wait_or_answer(self, conn_id: str) -> None:
        """A client that sent a whole sample: it waits for the next weights (on-policy, or a
        whole batch already waits), or goes on at once (its weights, or its ACT's actions)."""
        full = self.max_pending_steps is not None and self.store.pending_steps >= self.max_pending_steps
        if self.on_policy or full:
            if not self.waiting:
                self.waiting_since = time.monotonic()
            self.waiting.append(conn_id)
            if conn_id in self.served:
                self.inference.hold(conn_id)
        else:
            self._answer(conn_id)

    def _answer(self, conn_id: str) -> None:
        if conn_id in self.served:
            self.inference.queue(conn_id)   # answered by the round's forward pass
        else:
            self._reply(conn_id, self.state_msg)

    def _act(self, conn_id: str, msg: dict) -> None:
        """An ACT (server-side inference): the outcome of the last step recorded, a
        complete sample taken as an EPISODES_AND_GET_STATE's, the actions queued for the
        round's forward pass (or held, as that message's reply would be)."""
        if conn_id not in self.served:
            self._close(conn_id, "ACT from a client whose PING did not ask for server-side inference"
                        if self.inference is not None else
                        "ACT in a run that does not serve actions (its PONG said so)")
            return
        if "envs" in msg and not self.multiagent:
            self._close(conn_id, "a multi-agent ACT ('envs') in a single-agent run: send 'obs' of K envs")
            return
        self.opened.setdefault(conn_id, time.monotonic())
        self.sampling.add(conn_id)
        batch, reason = self.inference.act(conn_id, msg)
        if reason:
            self._close(conn_id, reason)
        elif batch is None:
            self.inference.queue(conn_id)
        elif self._take(conn_id, batch):
            self._wait_or_answer(conn_id)

    def flush_actions(self) -> None:
        """Answer the ACTs of this round with one forward pass (call once per poll round);
        a transport that can (TCP's ``batched``) sends the replies together."""
        if self.inference is not None and self.inference.queued:
            with contextlib.ExitStack() as together:
                for server in {self.servers.get(conn_id) for conn_id in self.inference.queued}:
                    if hasattr(server, "batched"):
                        together.enter_context(server.batched())
                for conn_id, reason in self.inference.flush(self._reply):
                    self._close(conn_id, reason)

    def _close(self, conn_id: str, reason: str) -> None:
        """Close a connection for a bad ACT (its open steps count as lost, in ``forget``)."""
        self.servers[conn_id].drop(conn_id, reason)
        self.forget(conn_id)

    def _heartbeat(self, conn_id: str, env_steps: int) -> None:
        """Keep what a HEARTBEAT says was stepped (what is never sent counts as lost), unless
        more than the connection could have stepped since it opened (ignored, counted)."""
        could = (self.store.steps_by_conn.get(conn_id, 0) + self.config_msg["env_steps_per_sample"]
                 + self.bounds.max_env_steps_per_s * (time.monotonic() - self.opened[conn_id]))
        if env_steps > could:
            self.heartbeats_ignored += 1
            self._log_refusal(conn_id, "HEARTBEAT env_steps", f"a HEARTBEAT claims {env_steps} env steps, more "
                              f"than it could have stepped ({int(could)}): ignored")
            return
        self.stepped[conn_id] = max(env_steps, self.stepped.get(conn_id, 0))

    def _refuse_out_of_bounds(self, conn_id: str, chunks: dict) -> dict:
        """``chunks`` (by policy id) without those outside the bounds (``refused_chunks``),
        whose steps are counted as dropped by reason, each reason logged once per client."""
        version = self.state_msg["weights_seq_no"] if self.state_msg else 0
        kept = {}
        for pid, batch in chunks.items():
            refused = refused_chunks(batch, self.policy_specs[pid], self.bounds, version)
            if not refused:
                kept[pid] = batch
                continue
            for reason, bad in refused.items():
                self.store.drop(reason, int(batch.lengths[bad].sum()))
                self._log_refusal(conn_id, reason, f"refused {int(bad.sum())} chunk(s), {reason} "
                                  "(counted in env_steps_dropped)")
            kept[pid] = batch.select(~np.logical_or.reduce(list(refused.values())))
        return kept

    def _log_refusal(self, conn_id: str, reason: str, text: str) -> None:
        if (conn_id, reason) not in self.refusals_logged:
            self.refusals_logged.add((conn_id, reason))
            log.warning("%s: %s (logged once per client)", self.name(conn_id), text)

    def _unknown_agents(self, batch) -> str | None:
        """Why a multi-agent message's agent ids are not the env's (each id would take a
        row of the per-agent return table, and a line of every metrics row), or None."""
        if self.agents is None or not isinstance(batch, MultiAgentBatch):
            return None
        for sub in batch.policies.values():
            unknown = set(sub.agent_ids or ()) - self.agents
            if unknown:
                return (f"agent ids {rllink.show(sorted(map(str, unknown)))} are not the env's "
                        f"(its agents: {rllink.show(sorted(self.agents))})")
        return None

    def _within_budget(self, conn_id: str, steps: int) -> bool:
        """Whether the connection may add ``steps`` to those it has waiting for training
        (one message may cross the budget); if not they are dropped and counted, and the log
        says so once per connection. Those a transport can hold back are not read once
        their budget is spent (``_hold_if_full``): only what was in flight is dropped."""
        if self.client_budget is None or not steps:
            return True
        if self.store.pending_of(conn_id) < self.client_budget:
            return True
        self.store.drop(OVER_BUDGET, steps)
        if conn_id not in self.over_budget:
            self.over_budget.add(conn_id)
            log.warning("%s: env steps dropped, %s (%d env steps)", self.name(conn_id), OVER_BUDGET,
                        self.client_budget)
        return False

    def _hold_if_full(self, conn_id: str) -> None:
        """Backpressure: stop reading a connection whose budget is spent, where its
        transport can (TCP); ``release_held`` reads it again once its steps are trained."""
        hold = getattr(self.servers[conn_id], "hold", None)
        if (self.client_budget is not None and hold is not None and conn_id not in self.held
                and self.store.pending_of(conn_id) >= self.client_budget):
            self.held.add(conn_id)
            hold(conn_id, True)

    def release_held(self) -> None:
        """Read again the held connections whose steps have gone to training."""
        for conn_id in [c for c in self.held if self.store.pending_of(c) < self.client_budget]:
            self.held.discard(conn_id)
            self.servers[conn_id].hold(conn_id, False)

    def release_waiting(self) -> None:
        """Answer every waiting client with the current weights (new ones; or, when nothing
        is pending, no update will come to release them: chunks without steps)."""
        waiting, self.waiting, self.waiting_since = self.waiting, [], None
        for conn_id in waiting:
            self._answer(conn_id)

    def _reply(self, conn_id: str, msg: dict) -> None:
        self.servers[conn_id].reply(conn_id, msg)

    def _drop(self, conn_id: str, reason: str, steps: int) -> None:
        self.store.drop("does not fit the environment", steps)
        self.stepped.pop(conn_id, None)  # its steps are dropped, not lost
        self.servers[conn_id].drop(conn_id, reason)
        self.forget(conn_id)

    def name(self, conn_id: str) -> str:
        """``conn_id``, with the name the client gave in its PING."""
        name = self.names.get(conn_id)
        return f"{conn_id} ({name})" if name else conn_id

    def forget(self, conn_id: str) -> None:
        """The connection is closed: nothing is owed to it, its open episodes never complete;
        what it reported stepping (HEARTBEAT) beyond what it sent is counted as lost."""
        if conn_id in self.stepped:
            lost = self.stepped.pop(conn_id) - self.store.steps_by_conn.get(conn_id, 0)
            if lost > 0:
                self.store.steps_lost += lost
                log.warning("%s: %d env steps it had stepped but not sent are lost", self.name(conn_id), lost)
        if self.inference is not None and conn_id in self.served:
            self.served.discard(conn_id)
            self.store.steps_lost += self.inference.forget(conn_id)   # its open rollout: never sent
        self.names.pop(conn_id, None)
        self.opened.pop(conn_id, None)
        self.arrivals.pop(conn_id, None)
        self.refusals_logged = {key for key in self.refusals_logged if key[0] != conn_id}
        self.over_budget.discard(conn_id)
        self.held.discard(conn_id)
        self.sampling.discard(conn_id)
        self.authenticated.discard(conn_id)
        if conn_id in self.waiting:
            self.waiting.remove(conn_id)
        self.store.forget(conn_id)
        self.servers.pop(conn_id, None)

