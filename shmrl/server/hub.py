"""The Hub: the RLlink server logic for every transport (docs/RLLINK.md).

Transports hand the Hub validated messages; the Hub also checks them against the
environment (shapes, action range) because a client's input is never trusted.
"""
from __future__ import annotations

import contextlib
import hmac
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from shmrl import rllink
from shmrl.envs.spec import EnvSpec, declared_differs
from shmrl.core.episode import EpisodeBatch, MultiAgentBatch
from shmrl.server.inference import server_inference
from shmrl.server.inference.base import Inference, NoInference
from shmrl.core.spaces import MASK_KEY
from shmrl.server.store import DEFAULT_POLICY, EpisodeStore

log = logging.getLogger("shmrl.learner")
T = rllink.MessageType
OVER_BUDGET = "over the client's budget"   # of pending env steps: why a flood's steps are dropped
_ACT = T.ACT.value

def auth_refusal(msg: dict, auth_token: str) -> str | None:
    """Why a connection's first message does not open it with ``auth_token``, or None: only
    a PING with the token does; anything else gets nothing but a closed connection (the
    reason is logged, never sent)."""
    kind = msg["type"]
    token = msg.get("auth_token", "") if kind == T.PING.value else ""
    # "surrogatepass": a lone surrogate (valid JSON) is a wrong token, not a crash.
    if hmac.compare_digest(token.encode("utf-8", "surrogatepass"), auth_token.encode()):
        return None
    return ("authentication failed: PING without the right auth_token" if kind == T.PING.value
            else f"{kind} before an authenticated PING")


def check_episodes(batch: EpisodeBatch, spec: EnvSpec, state_size: int = 0) -> str | None:
    """Why validated chunks do not fit the environment (and the policy's recurrent state of
    ``state_size`` floats), or None; fitting ones get their observations and actions in the
    stored dtypes (an image's JSON integers as bytes, a Box's as floats), and zeros where a recurrent policy's
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
    if not layout.discrete and actions.dtype.kind in "iu":   # JSON integers where floats go: 1 is 1.0
        actions = batch.actions = actions.astype(np.float32)
    mask = None
    if spec.obs.mask is not None:   # the mask each action was taken under: the obs of its step
        chunk_of_step = np.repeat(np.arange(batch.num_chunks), batch.lengths)
        mask = batch.obs[MASK_KEY][np.arange(batch.num_steps) + chunk_of_step]
    return layout.check(actions, mask)


class SingleAgentMessages:
    """A single-agent run's side of the codec's boundary: a message's chunks are its one
    policy's, and SET_STATE is RLlib's single-agent message."""

    def __init__(self, policy_specs: dict[str, EnvSpec], state_size: int):
        self.spec, self.state_size = policy_specs[DEFAULT_POLICY], state_size

    def chunks_by_policy(self, batch) -> tuple[dict, str | None]:
        """A message's chunks by policy id, and why they do not fit the run, or None."""
        if isinstance(batch, MultiAgentBatch):
            return {}, "multi-agent episodes (module_id) sent to a single-agent run"
        return {DEFAULT_POLICY: batch}, check_episodes(batch, self.spec, self.state_size)

    def set_state(self, weights_seq_no: int, policies: dict) -> dict:
        # its bytes (key order included) as RLlib's JSON has them; SAC's adds how to sample (§4.2)
        entry = policies[DEFAULT_POLICY]
        msg = {"type": T.SET_STATE.value, "onnx_file": entry["onnx_file"], "weights_seq_no": weights_seq_no}
        if "action_dist" in entry:
            msg["action_dist"] = entry["action_dist"]
        return msg


class MultiAgentMessages:
    """A multi-agent run's side of the codec's boundary: a message's chunks are by module
    id, each of a policy the run trains, of the env's agents (``agents``; empty: any);
    SET_STATE carries every policy."""

    def __init__(self, policy_specs: dict[str, EnvSpec], state_size: int, agents: frozenset):
        self.policy_specs, self.state_size, self.agents = policy_specs, state_size, agents

    def chunks_by_policy(self, batch) -> tuple[dict, str | None]:
        """A message's chunks by policy id, and why they do not fit the run, or None."""
        if not isinstance(batch, MultiAgentBatch):
            return {}, (None if not batch.num_chunks else
                        "single-agent episodes sent to a multi-agent run: every chunk needs agent_id and module_id")
        for pid, sub in batch.policies.items():
            if pid not in self.policy_specs:
                return {}, (f"chunks for policy {pid!r}, which this run does not train "
                            f"(its policies: {sorted(self.policy_specs)})")
            why = check_episodes(sub, self.policy_specs[pid], self.state_size)
            if why:
                return {}, f"policy {pid!r}: {why}"
        return batch.policies, self._unknown_agents(batch)

    def _unknown_agents(self, batch: MultiAgentBatch) -> str | None:
        """Why a message's agent ids are not the env's (each id would take a row of the
        per-agent return table, and a line of every metrics row), or None."""
        if not self.agents:
            return None
        for sub in batch.policies.values():
            unknown = set(sub.agent_ids or ()) - self.agents
            if unknown:
                return (f"agent ids {rllink.show(sorted(map(str, unknown)))} are not the env's "
                        f"(its agents: {rllink.show(sorted(self.agents))})")
        return None

    def set_state(self, weights_seq_no: int, policies: dict) -> dict:
        return {"type": T.SET_STATE.value, "policies": policies, "weights_seq_no": weights_seq_no}


def run_messages(policy_specs: dict[str, EnvSpec], multiagent: bool, state_size: int = 0, agents=None):
    """The codec's boundary of a run: ``multiagent``, its clients speak in agents and modules
    (RLlib's multi-agent messages)."""
    if multiagent:
        return MultiAgentMessages(policy_specs, state_size, frozenset(agents or ()))
    return SingleAgentMessages(policy_specs, state_size)


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


@dataclass(eq=False, slots=True)
class Connection:
    """One client connection's state in the Hub, from its first message until it closes."""
    server: object                   # the transport that owns it
    inference: Inference | NoInference   # what answers its ACTs: the run's inference once its PING asked
    authenticated: bool = False      # with an auth token: it showed it
    name: str | None = None          # the client_name its PING gave
    action_dists: tuple = ()         # the distributions its PING said it samples (RLLINK.md §3.1)
    opened: float | None = None      # time.monotonic() of its first message past authentication
    arrivals: tuple | None = None    # (time, steps) of its first chunks, (time, steps) of all
    stepped: int | None = None       # env steps its last HEARTBEAT reported
    refusals_logged: set = field(default_factory=set)   # reasons logged for it (once each)
    over_budget: bool = False        # told (in the log) that it is over its budget
    refused_in_a_row: int = 0        # its last messages with steps, every one refused for its values
    refused_why: str | None = None   # the reason of the last refusal
    first_per_sample: int = 0        # the env_steps_per_sample of its SET_CONFIG (a client may keep it)


class Hub:
    """Answers RLlink requests from any transport alike.

    PING, GET_CONFIG and GET_STATE are answered at once. Episodes go to the store.
    SET_CONFIG always says ``force_on_policy: true``: every client waits for SET_STATE
    after each batch (RLlib's client refuses anything else), which is what lets the Hub
    pace it. ``on_policy``: an EPISODES_AND_GET_STATE is answered with the *next* weights,
    as RLlib's server does; otherwise at once with the current ones, unless
    ``max_pending_steps`` already wait for the learner (that bounds the policy lag). With
    ``paced`` (an off-policy learner) such a client goes on once fewer steps wait
    (``release_if_room``), not at the next weights: the learner's gradient steps per env
    step hold however fast the clients are.
    """

    def __init__(self, policy_specs: dict[str, EnvSpec], store: EpisodeStore, env_steps_per_sample: int,
                 on_policy: bool = True, max_pending_steps: int | None = None,
                 auth_token: str | None = None, state_size: int = 0, multiagent: bool = False,
                 extra_config: dict | None = None, client_budget: int | None = None, agents=None,
                 bounds: Bounds = Bounds(), shared_batch: int | None = None, local_sims: int = 0):
        """``policy_specs``: the run's policies (policy id -> EnvSpec of its agents; a
        single-agent run's one is ``DEFAULT_POLICY``); ``multiagent``: the clients speak in
        agents and modules (RLlib's multi-agent messages); ``extra_config``: more fields
        for SET_CONFIG (a multi-agent run's policy map); ``client_budget``: the env steps one
        connection may have waiting for training, past which its chunks are dropped and
        counted (None: no budget); ``agents``: the env's agent ids, the only ones a
        multi-agent chunk may carry (None: any); ``bounds``: what a chunk may hold (chunks
        beyond them are refused and counted, the connection goes on); ``shared_batch``: the
        train batch to spread over whoever samples (``share``), None where
        ``env_steps_per_sample`` was set and stays; ``local_sims``: the simulators the
        run starts itself, counted from the start."""
        self.policy_specs, self.store = policy_specs, store
        self.messages = run_messages(policy_specs, multiagent, state_size, agents)
        self.multiagent = multiagent
        self.auth_token = auth_token
        self.max_pending_steps = max_pending_steps
        self.config_msg = {"type": T.SET_CONFIG.value, "env_steps_per_sample": env_steps_per_sample,
                           "force_on_policy": True, **(extra_config or {})}
        self.on_policy = on_policy
        self.paced = False   # waiting clients go on when the pending steps fall below max_pending_steps
        self.state_msg: dict | None = None
        self.connections: dict[str, Connection] = {}
        # Which connections the hub counts or walks each round, kept apart so that a round
        # costs nothing per open connection:
        self.sampling: set[str] = set()          # connections that have asked for weights
        self.waiting: list[str] = []             # connections waiting for the next weights, in the order answered
        self.held: set[str] = set()              # connections not read (their budget is spent), by transports that can
        self.waiting_since: float | None = None  # time.monotonic() when the first of them began
        self.bounds = bounds
        self.heartbeats_ignored = 0              # HEARTBEATs that claimed more steps than could be stepped
        self.auth_failures = 0                   # connections closed for a first message without the auth token
        self.client_budget = client_budget
        # Server-side inference: the policy run for clients that asked in their PING;
        # SET_CONFIG describes the spaces for them (and for every client).
        self.inference, spaces = server_inference(policy_specs, env_steps_per_sample, state_size, multiagent,
                                                  agents, self.config_msg)
        self.config_msg.update(spaces)
        self.shared_batch, self.local_sims = shared_batch, local_sims
        self.sharing: set[str] = set()           # connections that took a config or sample: they share the batch
        self.share()

    def set_state(self, weights_seq_no: int, policies: dict) -> None:
        """Publish new weights and release every client waiting for them. ``policies``: the
        SET_STATE ``policies`` entries (policy id -> onnx_file, weights_seq_no[, frozen])."""
        self.state_msg = self.messages.set_state(weights_seq_no, policies)
        if self.shared_batch is not None:
            self.state_msg["env_steps_per_sample"] = self.config_msg["env_steps_per_sample"]
        self.inference.load(weights_seq_no, policies)
        if not self.paced:
            self.release_waiting()

    def _shares(self, conn_id: str) -> None:
        if conn_id not in self.sharing:
            self.sharing.add(conn_id)
            self.share()

    def share(self) -> None:
        """Spread the train batch over whoever samples: each connection that took a config
        (or asked for server-side inference), and at least the run's own simulators, gets
        ``env_steps_per_sample`` = the batch / their number, rounded up. New clients read it
        in SET_CONFIG, sampling ones in every SET_STATE (RLLINK.md §3.3; a client that
        reads it only at its handshake keeps its first), and server-side inference cuts
        each connection's samples by it at once. So 4 external clients of a --sims 0 run
        each send a quarter of the batch, not the whole of it."""
        if self.shared_batch is None:
            return
        per_sample = -(-self.shared_batch // max(self.local_sims, len(self.sharing), 1))
        if per_sample == self.config_msg["env_steps_per_sample"]:
            return
        # New dicts, not changed in place: a transport may hold a reply not yet sent.
        self.config_msg = {**self.config_msg, "env_steps_per_sample": per_sample}
        self.inference.env_steps_per_sample = per_sample
        if self.state_msg is not None:
            self.state_msg = {**self.state_msg, "env_steps_per_sample": per_sample}

    def all_waiting(self) -> bool:
        return bool(self.sampling) and len(self.waiting) == len(self.sampling)

    def delivery_rate(self) -> float:
        """The env steps per second the open connections deliver together. Each one's: the
        steps of its messages after the first over the seconds between the first and the
        last (its start up left out); with one message so far, its steps over the seconds
        since its first request (a client that waits for new weights after each message)."""
        now, rate = time.monotonic(), 0.0
        for conn in self.connections.values():
            if conn.opened is not None:
                t_first, first, t_last, steps = conn.arrivals or (now, 0, now, 0)
                rate += (steps - first) / (t_last - t_first) if t_last > t_first else steps / max(now - conn.opened, 1e-3)
        return rate

    def handle(self, server, conn_id: str, msg: dict | None) -> None:
        if msg is None:
            self.forget(conn_id)
            return
        conn = self.connections.get(conn_id)
        if conn is None:
            conn = self.connections[conn_id] = Connection(server, self.inference.unasked)
        kind = msg["type"]
        if self.auth_token is not None and not conn.authenticated:
            why = auth_refusal(msg, self.auth_token)
            if why:
                self.auth_failures += 1
                conn.server.drop(conn_id, why)
                self.forget(conn_id)
                return
            conn.authenticated = True
        if conn.opened is None:
            conn.opened = time.monotonic()
        if kind == _ACT:   # first: a server-inference client sends one per env step
            self._act(conn_id, conn, msg)
        elif kind == T.HEARTBEAT.value:  # answered by nothing; the transport saw it alive
            if msg["env_steps"] is not None:
                self._heartbeat(conn_id, conn, msg["env_steps"])
        elif kind == T.PING.value:
            if "client_name" in msg:
                conn.name = msg["client_name"]
                log.info("%s is %s", conn_id, msg["client_name"])
            conn.action_dists = tuple(msg.get("action_dists", ()))
            why = self._cannot_sample(msg)
            if why:
                self._close(conn_id, conn, why)
                return
            pong = {"type": T.PONG.value}
            if msg.get("inference") == "server":   # granted where the run serves actions
                conn.inference = self.inference
                self._shares(conn_id)
                pong.update(self.inference.pong_fields)
            self._reply(conn_id, pong)
        elif kind == T.GET_CONFIG.value:
            why = self._declared_differs(msg)
            if why:
                self._close(conn_id, conn, why)
            else:
                self._shares(conn_id)
                conn.first_per_sample = conn.first_per_sample or self.config_msg["env_steps_per_sample"]
                self._reply(conn_id, self.config_msg)
        elif kind == T.GET_STATE.value:
            self.sampling.add(conn_id)
            self._reply(conn_id, self.state_msg)
        else:  # EPISODES, EPISODES_AND_GET_STATE
            if not self._take(conn_id, conn, msg["episodes"]):
                return
            if kind == T.EPISODES_AND_GET_STATE.value:
                self.sampling.add(conn_id)
                self._wait_or_answer(conn_id, conn)

    def _cannot_sample(self, msg: dict) -> str | None:
        """Why a PING's client cannot sample what this run's clients must (``--algo sac``:
        SET_CONFIG's ``action_dist``, and SET_STATE's while it differs, e.g. ``uniform`` in
        SAC's warm-up), or None: a client that runs the policy itself must list them in its
        PING's ``action_dists`` (docs/RLLINK.md §3.1, §4.2). Server-side inference is never
        refused (the server samples), nor is any client of a run that uses RLlib's
        distributions."""
        if msg.get("inference") == "server" or "action_dist" not in self.config_msg:
            return None
        needed = [self.config_msg["action_dist"]]
        now = (self.state_msg or {}).get("action_dist")
        if now is not None and now not in needed:
            needed.append(now)
        missing = [d for d in needed if d not in msg.get("action_dists", ())]
        if not missing:
            return None
        said = f"lists only {msg['action_dists']}" if "action_dists" in msg else "has no action_dists"
        return (f"refused at the handshake: this learner's policy is sampled as {' and '.join(map(repr, needed))} "
                f"(SAC, docs/RLLINK.md section 4.2), and the client's PING {said}: it cannot sample it (RLlib's "
                f"client cannot); use a shmrl client (python -m shmrl.sim, the C or JS client) or server-side "
                f"inference (PING inference: server), or train with --algo ppo")

    def unable_to_sample(self, dists) -> list[str]:
        """The open connections whose clients run the policy themselves and did not say in
        their PING that they sample each of ``dists`` (--algo auto keeps PPO for them)."""
        return [self.name(conn_id) for conn_id, conn in list(self.connections.items())
                if conn.inference is not self.inference and not set(dists) <= set(conn.action_dists)]

    def _declared_differs(self, msg: dict) -> str | None:
        """Why the spaces a GET_CONFIG declares are not the run's (naming both), or None
        (the same spaces, or none declared)."""
        if not any(key in msg for key in rllink.DECLARED_FIELDS):
            return None
        if self.multiagent:
            return ("it declares spaces, but the learner trains a multi-agent env: only a single-agent env's "
                    "spaces can be declared")
        return declared_differs(msg, self.policy_specs[DEFAULT_POLICY])

    def _take(self, conn_id: str, conn: Connection, batch) -> bool:
        """A message's chunks checked and into the store (those beyond the bounds or the
        client's budget dropped and counted); False if they do not fit the run, which
        closes the connection."""
        chunks, reason = self.messages.chunks_by_policy(batch)
        if reason:
            self._drop(conn_id, conn, reason, batch.num_steps)
            return False
        sent = sum(sub.num_steps for sub in chunks.values())
        chunks = self._refuse_out_of_bounds(conn_id, conn, chunks)
        steps = sum(sub.num_steps for sub in chunks.values())
        if sent:   # a client whose every step is refused (a broken env) is told apart from one refused now and then
            conn.refused_in_a_row = 0 if steps else conn.refused_in_a_row + 1
        if self._within_budget(conn_id, conn, steps):
            self.store.add(conn_id, chunks)
            self._hold_if_full(conn_id, conn)
            now = time.monotonic()
            t_first, first, _, total = conn.arrivals or (now, steps, now, 0)
            conn.arrivals = (t_first, first, now, total + steps)
        return True

    def _wait_or_answer(self, conn_id: str, conn: Connection) -> None:
        """A client that sent a whole sample: it waits for the next weights (on-policy, or a
        whole batch already waits), or goes on at once (its weights, or its ACT's actions)."""
        full = self.max_pending_steps is not None and self.store.pending_steps >= self.max_pending_steps
        if self.on_policy or full:
            if not self.waiting:
                self.waiting_since = time.monotonic()
            self.waiting.append(conn_id)
            conn.inference.hold(conn_id)
        else:
            conn.inference.go_on(conn_id, self._send_state)

    def _send_state(self, conn_id: str) -> None:
        self._reply(conn_id, self.state_msg)

    def _act(self, conn_id: str, conn: Connection, msg: dict) -> None:
        """An ACT (server-side inference): the outcome of the last step recorded, a
        complete sample taken as an EPISODES_AND_GET_STATE's, the actions queued for the
        round's forward pass (or held, as that message's reply would be)."""
        self.sampling.add(conn_id)
        batch, reason = conn.inference.act(conn_id, msg)
        if reason:
            self._close(conn_id, conn, reason)
        elif batch is None:
            conn.inference.queue(conn_id)
        elif self._take(conn_id, conn, batch):
            self._wait_or_answer(conn_id, conn)

    def flush_actions(self) -> None:
        """Answer the ACTs of this round with one forward pass (call once per poll round);
        a transport that can (TCP's ``batched``) sends the replies together."""
        for conn_id, reason in self.inference.flush(self._reply, self._replies_together):
            self._close(conn_id, self.connections[conn_id], reason)

    @contextlib.contextmanager
    def _replies_together(self, conn_ids: list[str]):
        with contextlib.ExitStack() as together:
            for server in {self.connections[conn_id].server for conn_id in conn_ids}:
                if hasattr(server, "batched"):
                    together.enter_context(server.batched())
            yield

    def _close(self, conn_id: str, conn: Connection, reason: str) -> None:
        """Close a connection for a bad ACT (its open steps count as lost, in ``forget``)."""
        conn.server.drop(conn_id, reason)
        self.forget(conn_id)

    def _heartbeat(self, conn_id: str, conn: Connection, env_steps: int) -> None:
        """Keep what a HEARTBEAT says was stepped (what is never sent counts as lost), unless
        more than the connection could have stepped since it opened (ignored, counted)."""
        per_sample = max(conn.first_per_sample, self.config_msg["env_steps_per_sample"])
        could = (self.store.steps_by_conn.get(conn_id, 0) + per_sample
                 + self.bounds.max_env_steps_per_s * (time.monotonic() - conn.opened))
        if env_steps > could:
            self.heartbeats_ignored += 1
            self._log_refusal(conn_id, conn, "HEARTBEAT env_steps", f"a HEARTBEAT claims {env_steps} env steps, "
                              f"more than it could have stepped ({int(could)}): ignored")
            return
        conn.stepped = max(env_steps, conn.stepped or 0)

    def _refuse_out_of_bounds(self, conn_id: str, conn: Connection, chunks: dict) -> dict:
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
                conn.refused_why = reason
                self.store.drop(reason, int(batch.lengths[bad].sum()))
                self._log_refusal(conn_id, conn, reason, f"refused {int(bad.sum())} chunk(s), {reason} "
                                  "(counted in env_steps_dropped)")
            kept[pid] = batch.select(~np.logical_or.reduce(list(refused.values())))
        return kept

    def _log_refusal(self, conn_id: str, conn: Connection, reason: str, text: str) -> None:
        if reason not in conn.refusals_logged:
            conn.refusals_logged.add(reason)
            log.warning("%s: %s (logged once per client)", self.name(conn_id), text)

    def _within_budget(self, conn_id: str, conn: Connection, steps: int) -> bool:
        """Whether the connection may add ``steps`` to those it has waiting for training
        (one message may cross the budget); if not they are dropped and counted, and the log
        says so once per connection. Those a transport can hold back are not read once
        their budget is spent (``_hold_if_full``): only what was in flight is dropped."""
        if self.client_budget is None or not steps:
            return True
        if self.store.pending_of(conn_id) < self.client_budget:
            return True
        self.store.drop(OVER_BUDGET, steps)
        if not conn.over_budget:
            conn.over_budget = True
            log.warning("%s: env steps dropped, %s (%d env steps)", self.name(conn_id), OVER_BUDGET,
                        self.client_budget)
        return False

    def _hold_if_full(self, conn_id: str, conn: Connection) -> None:
        """Backpressure: stop reading a connection whose budget is spent, where its
        transport can (TCP); ``release_held`` reads it again once its steps are trained."""
        hold = getattr(conn.server, "hold", None)
        if (self.client_budget is not None and hold is not None and conn_id not in self.held
                and self.store.pending_of(conn_id) >= self.client_budget):
            self.held.add(conn_id)
            hold(conn_id, True)

    def release_held(self) -> None:
        """Read again the held connections whose steps have gone to training."""
        for conn_id in [c for c in self.held if self.store.pending_of(c) < self.client_budget]:
            self.held.discard(conn_id)
            self.connections[conn_id].server.hold(conn_id, False)

    def release_if_room(self) -> None:
        """Paced: the waiting clients go on (with the current weights) once fewer than
        ``max_pending_steps`` wait for the learner."""
        if self.paced and self.waiting and self.store.pending_steps < self.max_pending_steps:
            self.release_waiting()

    def release_waiting(self) -> None:
        """Answer every waiting client with the current weights (new ones; or, when nothing
        is pending, no update will come to release them: chunks without steps)."""
        waiting, self.waiting, self.waiting_since = self.waiting, [], None
        for conn_id in waiting:
            self.connections[conn_id].inference.go_on(conn_id, self._send_state)

    def _reply(self, conn_id: str, msg: dict) -> None:
        self.connections[conn_id].server.reply(conn_id, msg)

    def _drop(self, conn_id: str, conn: Connection, reason: str, steps: int) -> None:
        self.store.drop("does not fit the environment", steps)
        conn.stepped = None  # its steps are dropped, not lost
        conn.server.drop(conn_id, reason)
        self.forget(conn_id)

    def name(self, conn_id: str) -> str:
        """``conn_id``, with the name the client gave in its PING."""
        conn = self.connections.get(conn_id)
        return f"{conn_id} ({conn.name})" if conn is not None and conn.name else conn_id

    def forget(self, conn_id: str) -> None:
        """The connection is closed: nothing is owed to it, its open episodes never complete;
        what it reported stepping (HEARTBEAT) beyond what it sent is counted as lost, and so
        is its open sample of server-side inference (never sent)."""
        conn = self.connections.get(conn_id)
        if conn is not None:
            lost = (conn.stepped or 0) - self.store.steps_by_conn.get(conn_id, 0)
            if lost > 0:
                self.store.steps_lost += lost
                log.warning("%s: %d env steps it had stepped but not sent are lost", self.name(conn_id), lost)
            self.store.steps_lost += conn.inference.forget(conn_id)
            del self.connections[conn_id]
        self.sampling.discard(conn_id)
        if conn_id in self.sharing:
            self.sharing.discard(conn_id)
            self.share()
        self.held.discard(conn_id)
        if conn_id in self.waiting:
            self.waiting.remove(conn_id)
        self.store.forget(conn_id)
