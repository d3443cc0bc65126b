"""The learner: the Hub (RLlink server logic for every transport), the episode store,
and the loop that turns received chunks into PPO updates and ONNX versions.

Transports hand the Hub validated messages; the Hub also checks them against the
environment (shapes, action range) because a client's input is never trusted.
"""
from __future__ import annotations

import hmac
import logging
import os
import queue
import selectors
import threading
import time
from collections import deque

import numpy as np

from shmrl import rllink
from shmrl.envs import EnvSpec
from shmrl.episode import EpisodeBatch, MultiAgentBatch, obs_row_bytes
from shmrl.onnx_graph import ModelTemplate
from shmrl.spaces import MASK_KEY
from shmrl.onnx_policy import encode_onnx_file
from shmrl.stats import RunningMeanStd, discounted_sums

log = logging.getLogger("shmrl.learner")
T = rllink.MessageType
PENDING_AT_CHECKPOINT = "not yet trained when the checkpoint was taken"


class EpisodeStore:
    """Batches of chunks waiting for the next update, and the returns of complete episodes.

    Continuation chunks are glued to the episode they continue by id when the client
    sends one, else by their first observation being the last one of an open chunk on
    the same connection (RLlib's client sends no id; with one env per client this is
    its order of messages).
    """

    def __init__(self, window: int = 100, reward_gamma: float | None = None):
        """``reward_gamma``: keep the running variance of each stream's discounted return
        (``reward_stats``), by which rewards are scaled for training (VecNormalize's reward
        normalization, at the learner and per client stream instead of in a wrapper)."""
        self.pending: list[EpisodeBatch] = []
        self.pending_steps = 0
        self.returns: deque = deque(maxlen=window)
        self.lengths: deque = deque(maxlen=window)
        self.episodes_completed = 0
        self.steps_received = 0
        self.steps_taken = 0       # handed to the trainer (by the serving thread)
        self.steps_trained = 0     # trained on (by the training thread, once its update is done)
        self.steps_dropped: dict[str, int] = {}
        self.steps_lost = 0        # stepped by a simulator that died before sending them: never received
        self.steps_by_conn: dict[str, int] = {}
        self.first_steps_at: float | None = None   # time.time() when the first env steps arrived
        # glue key -> (return, length, discounted return) of an episode so far
        self._open: dict[tuple, tuple[float, int, float]] = {}
        self.reward_gamma = reward_gamma
        self.reward_stats = RunningMeanStd() if reward_gamma is not None else None
        self.window = window
        self.returns_by_agent: dict = {}   # multi-agent chunks: agent id -> its recent returns

    def add(self, conn_id: str, batch: EpisodeBatch) -> None:
        """Take a message's chunks: their steps wait for training, their returns complete
        episodes (one Python step per chunk, none per env step)."""
        ids = batch.episode_ids
        obs, first, last = batch.obs, batch.obs_first.tolist(), batch.obs_last.tolist()
        before = [self._open.pop((conn_id, "id", ids[i]) if ids is not None and ids[i] is not None
                                 else (conn_id, "obs", obs_row_bytes(obs, first[i])), (0.0, 0, 0.0))
                  for i in range(batch.num_chunks)]
        discounted = self._discounted_returns(batch, [b[2] for b in before])
        for i, (ret, length, done) in enumerate(zip(batch.chunk_returns().tolist(), batch.lengths.tolist(),
                                                     batch.is_done.tolist())):
            ret, length = ret + before[i][0], length + before[i][1]
            if done:
                if batch.agent_ids is not None:
                    self.returns_by_agent.setdefault(batch.agent_ids[i], deque(maxlen=self.window)).append(ret)
                self.returns.append(ret)
                self.lengths.append(length)
                self.episodes_completed += 1
            else:
                eid = ids[i] if ids is not None else None
                key = (conn_id, "id", eid) if eid is not None else (conn_id, "obs", obs_row_bytes(obs, last[i]))
                self._open[key] = (ret, length, discounted[i])
        if batch.num_steps:
            if self.first_steps_at is None:
                self.first_steps_at = time.time()
            self.pending.append(batch)
            self.pending_steps += batch.num_steps
            self.steps_received += batch.num_steps
            self.steps_by_conn[conn_id] = self.steps_by_conn.get(conn_id, 0) + batch.num_steps

    def _discounted_returns(self, batch: EpisodeBatch, carries: list[float]) -> list[float]:
        """Each chunk's discounted return at its last step, going on from ``carries`` (its
        episode's so far); every step's goes into ``reward_stats``. Zeros without them."""
        if self.reward_stats is None or not batch.num_steps:
            return [0.0] * batch.num_chunks
        lengths = batch.lengths
        chunk_of_step = np.repeat(np.arange(batch.num_chunks), lengths)
        col = np.arange(batch.num_steps) - batch.offsets[chunk_of_step]
        padded = np.zeros((batch.num_chunks, int(lengths.max())))
        padded[chunk_of_step, col] = batch.rewards
        sums = discounted_sums(padded, self.reward_gamma, np.asarray(carries))
        self.reward_stats.update(sums[chunk_of_step, col])
        return np.where(lengths > 0, sums[np.arange(batch.num_chunks), np.maximum(lengths - 1, 0)],
                        carries).tolist()

    def reward_scale(self) -> float:
        """1 / the standard deviation of discounted returns (1 without ``reward_stats``)."""
        return 1.0 if self.reward_stats is None else float(1.0 / np.sqrt(self.reward_stats.var + 1e-8))

    def forget(self, conn_id: str) -> None:
        """A connection closed: its open episodes will never complete."""
        for key in [k for k in self._open if k[0] == conn_id]:
            del self._open[key]

    def drop(self, reason: str, steps: int) -> None:
        """Count steps received but not trained on (never silently lost)."""
        self.steps_received += steps
        self.steps_dropped[reason] = self.steps_dropped.get(reason, 0) + steps

    def take(self, version: int = 0, max_lag: int | None = None, max_steps: int | None = None) -> list[EpisodeBatch]:
        """The oldest pending batches, up to ``max_steps`` steps (the last one may go over;
        None: all), without the chunks sampled with weights more than ``max_lag`` versions
        older than ``version``, which are dropped as stale. Chunks without a version
        (RLlib's client sends none) count as current."""
        if max_lag is not None:
            fresh = []
            for batch in self.pending:
                seq = batch.weights_seq_no
                stale = (seq >= 0) & (version - seq > max_lag)
                if stale.any():
                    n_stale = int(batch.lengths[stale].sum())
                    self.steps_dropped["stale"] = self.steps_dropped.get("stale", 0) + n_stale
                    self.pending_steps -= n_stale
                    batch = batch.select(~stale)
                if batch.num_steps:
                    fresh.append(batch)
            self.pending = fresh
        n, steps = 0, 0
        while n < len(self.pending) and (max_steps is None or steps < max_steps):
            steps += self.pending[n].num_steps
            n += 1
        taken, self.pending = self.pending[:n], self.pending[n:]
        self.pending_steps -= steps
        self.steps_taken += steps
        return taken

    @property
    def in_flight(self) -> int:
        """Steps taken for an update that has not finished (or never will: the run ended)."""
        return self.steps_taken - self.steps_trained

    def counters(self) -> dict:
        """The counts and the return window, for a checkpoint. Steps not yet trained on
        (pending or in flight) count as dropped: a run resumed from it never trains on them."""
        dropped = dict(self.steps_dropped)
        untrained = self.pending_steps + self.in_flight
        if untrained:
            dropped[PENDING_AT_CHECKPOINT] = dropped.get(PENDING_AT_CHECKPOINT, 0) + untrained
        return {"steps_received": self.steps_received, "steps_trained": self.steps_trained,
                "steps_dropped": dropped, "steps_lost": self.steps_lost,
                "steps_by_conn": dict(self.steps_by_conn), "episodes_completed": self.episodes_completed,
                "returns": list(self.returns), "lengths": list(self.lengths)}

    def restore(self, counters: dict, arrays: dict | None = None) -> None:
        """Continue from ``counters()`` of an earlier run (and the reward statistics among
        its checkpoint's ``arrays``, if this store keeps them)."""
        if self.reward_stats is not None and arrays is not None and "reward_stats.mean" in arrays:
            self.reward_stats.set_state(arrays, "reward_stats")
        for key in ("steps_received", "steps_trained", "steps_lost", "episodes_completed"):
            setattr(self, key, int(counters[key]))
        self.steps_taken = self.steps_trained
        self.steps_dropped = {k: int(v) for k, v in counters["steps_dropped"].items()}
        self.steps_by_conn = {k: int(v) for k, v in counters["steps_by_conn"].items()}
        self.returns.extend(counters["returns"])
        self.lengths.extend(counters["lengths"])

    def return_mean(self) -> float:
        returns = list(self.returns)   # one C-level copy: the serving thread may append
        return float(np.mean(returns)) if returns else float("nan")

    def agent_return_means(self) -> dict:
        return {str(a): float(np.mean(list(r))) for a, r in list(self.returns_by_agent.items()) if r}


class MultiStore(EpisodeStore):
    """The episode stores of a multi-agent run: one per policy (its pending chunks, glue,
    return window and reward statistics), with the run's counts and one return window of
    every agent's episodes here. ``take`` hands over every policy's pending chunks as one
    MultiAgentBatch."""

    def __init__(self, policies, window: int = 100, reward_gamma: float | None = None):
        super().__init__(window)
        self.policies = {pid: EpisodeStore(window, reward_gamma) for pid in policies}

    def add(self, conn_id: str, batch: MultiAgentBatch) -> None:
        for pid, sub in batch.policies.items():
            store = self.policies[pid]
            done_before = store.episodes_completed
            store.add(conn_id, sub)
            new = store.episodes_completed - done_before
            if new:
                self.returns.extend(list(store.returns)[-new:])
                self.episodes_completed += new
        steps = batch.num_steps
        if steps:
            if self.first_steps_at is None:
                self.first_steps_at = time.time()
            self.pending_steps += steps
            self.steps_received += steps
            self.steps_by_conn[conn_id] = self.steps_by_conn.get(conn_id, 0) + steps

    def forget(self, conn_id: str) -> None:
        for store in self.policies.values():
            store.forget(conn_id)

    def take(self, version: int = 0, max_lag: int | None = None, max_steps: int | None = None) -> list:
        taken = {}
        for pid, store in self.policies.items():
            batches = store.take(version, max_lag)
            if batches:
                taken[pid] = EpisodeBatch.concat(batches)
        steps = sum(b.num_steps for b in taken.values())
        stale = sum(store.steps_dropped.pop("stale", 0) for store in self.policies.values())
        if stale:
            self.steps_dropped["stale"] = self.steps_dropped.get("stale", 0) + stale
        self.pending_steps = sum(store.pending_steps for store in self.policies.values())
        self.steps_taken += steps
        return [MultiAgentBatch(taken)] if taken else []

    def counters(self) -> dict:
        return {**super().counters(), "policies": {pid: store.counters() for pid, store in self.policies.items()}}

    def restore(self, counters: dict, arrays: dict | None = None) -> None:
        super().restore(counters)
        for pid, store in self.policies.items():
            saved = counters.get("policies", {}).get(pid)
            if saved is not None:
                store.restore(saved, None if arrays is None else
                              {k.split("/", 2)[2]: v for k, v in arrays.items() if k.startswith(f"policies/{pid}/")})

    def agent_return_means(self) -> dict:
        return {a: r for store in self.policies.values() for a, r in store.agent_return_means().items()}

    def policy_return_means(self) -> dict:
        return {pid: store.return_mean() for pid, store in self.policies.items()}


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


def check_multiagent(batch, policy_specs: dict | None) -> str | None:
    """Why a message's chunks do not fit the run (single- or multi-agent, its policies and
    their envs), or None."""
    multi = isinstance(batch, MultiAgentBatch)
    if policy_specs is None:
        return "multi-agent episodes (module_id) sent to a single-agent run" if multi else None
    if not multi:
        return None if not batch.num_chunks else \
            "single-agent episodes sent to a multi-agent run: every chunk needs agent_id and module_id"
    for pid, sub in batch.policies.items():
        if pid not in policy_specs:
            return f"chunks for policy {pid!r}, which this run does not train (its policies: {sorted(policy_specs)})"
        why = check_episodes(sub, policy_specs[pid])
        if why:
            return f"policy {pid!r}: {why}"
    return None


class Hub:
    """Answers RLlink requests from any transport alike.

    PING, GET_CONFIG and GET_STATE are answered at once. Episodes go to the store.
    SET_CONFIG always says ``force_on_policy: true``: every client waits for SET_STATE
    after each batch (RLlib's client refuses anything else), which is what lets the Hub
    pace it. ``on_policy``: an EPISODES_AND_GET_STATE is answered with the *next* weights,
    as RLlib's server does; otherwise at once with the current ones, unless
    ``max_pending_steps`` already wait for the learner (that bounds the policy lag).
    """

    def __init__(self, spec: EnvSpec, store: EpisodeStore, env_steps_per_sample: int,
                 on_policy: bool = True, max_pending_steps: int | None = None,
                 auth_token: str | None = None, state_size: int = 0, policy_specs: dict | None = None,
                 extra_config: dict | None = None):
        """``policy_specs``: a multi-agent run's policies (policy id -> EnvSpec of its agents);
        ``extra_config``: more fields for SET_CONFIG (a multi-agent run's policy map)."""
        self.spec, self.store, self.state_size = spec, store, state_size
        self.policy_specs = policy_specs
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

    def set_state(self, weights_seq_no: int, onnx_file) -> None:
        """Publish new weights and release every client waiting for them. ``onnx_file``: a
        multi-agent run's is a dict of SET_STATE ``policies`` entries."""
        # The single-agent message keeps its bytes (key order included): RLlib's JSON.
        self.state_msg = {"type": T.SET_STATE.value,
                          ("policies" if isinstance(onnx_file, dict) else "onnx_file"): onnx_file,
                          "weights_seq_no": weights_seq_no}
        waiting, self.waiting, self.waiting_since = self.waiting, [], None
        for conn_id in waiting:
            self._reply(conn_id, self.state_msg)

    def all_waiting(self) -> bool:
        return bool(self.sampling) and len(self.waiting) == len(self.sampling)

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
            if not hmac.compare_digest(token.encode(), self.auth_token.encode()):
                self.servers[conn_id].drop(conn_id, "authentication failed: PING without the right auth_token"
                                           if kind == T.PING.value else f"{kind} before an authenticated PING")
                self.forget(conn_id)
                return
            self.authenticated.add(conn_id)
        if kind == T.HEARTBEAT.value:  # answered by nothing; the transport saw it alive
            if msg["env_steps"] is not None:
                self.stepped[conn_id] = max(msg["env_steps"], self.stepped.get(conn_id, 0))
        elif kind == T.PING.value:
            if "client_name" in msg:
                self.names[conn_id] = msg["client_name"]
                log.info("%s is %s", conn_id, msg["client_name"])
            self._reply(conn_id, {"type": T.PONG.value})
        elif kind == T.GET_CONFIG.value:
            self._reply(conn_id, self.config_msg)
        elif kind == T.GET_STATE.value:
            self.sampling.add(conn_id)
            self._reply(conn_id, self.state_msg)
        else:  # EPISODES, EPISODES_AND_GET_STATE
            batch = msg["episodes"]
            reason = check_multiagent(batch, self.policy_specs)
            if reason is None and self.policy_specs is None:
                reason = check_episodes(batch, self.spec, self.state_size)
            if reason:
                self._drop(conn_id, reason, batch.num_steps)
                return
            self.store.add(conn_id, batch)
            if kind == T.EPISODES_AND_GET_STATE.value:
                self.sampling.add(conn_id)
                full = self.max_pending_steps is not None and self.store.pending_steps >= self.max_pending_steps
                if self.on_policy or full:
                    if not self.waiting:
                        self.waiting_since = time.monotonic()
                    self.waiting.append(conn_id)
                else:
                    self._reply(conn_id, self.state_msg)

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
        self.names.pop(conn_id, None)
        self.sampling.discard(conn_id)
        self.authenticated.discard(conn_id)
        if conn_id in self.waiting:
            self.waiting.remove(conn_id)
        self.store.forget(conn_id)
        self.servers.pop(conn_id, None)


class Learner:
    """Serves the transports from one thread while another trains.

    The serving thread owns the Hub, the store and every server: it answers requests,
    and when a batch is ready hands its chunks over through a queue. The training thread
    runs PPO on them (torch releases the GIL, so requests keep being answered) and hands
    the new ONNX model back the same way. No lock is shared; at most one batch is in
    flight. ``on_policy``: clients wait for each new version; otherwise they keep sampling
    while the learner trains, a client is held back only while a whole batch is already
    waiting, and chunks more than ``max_policy_lag`` versions old are dropped as stale.
    """

    def __init__(self, spec: EnvSpec, servers: list, *, policy: ModelTemplate, initial_weights: dict,
                 env_steps_per_sample: int, train_batch_size: int,
                 on_policy: bool = True, max_policy_lag: int = 2, auth_token: str | None = None,
                 window: int = 100, first_weights_seq_no: int = 1, housekeeping=None,
                 reward_gamma: float | None = None, batch_wait_timeout: float | None = None,
                 state_size: int = 0, policy_specs: dict | None = None,
                 extra_config: dict | None = None, league_size: int = 0, league_every: int = 10):
        """Publishes ``initial_weights`` (into the graph ``policy``) at once, as version
        ``first_weights_seq_no``: clients can sample before the trainer (torch) is even
        loaded. ``housekeeping(learner)``, if given, runs in the serving thread after every
        round of requests (the supervisor watches the simulators from there).
        ``reward_gamma``: scale rewards by the running std of discounted returns (see
        ``EpisodeStore``). ``batch_wait_timeout``: once a client waits for new weights, the
        batch waits at most this long for the clients still sampling (one that went silent,
        heartbeat or not, must not stall everyone), then trains on what it has.
        ``state_size``: the floats of a recurrent policy's state (0: none).

        A multi-agent run (``shmrl.multiagent``) gives ``policy_specs`` (policy id -> EnvSpec),
        and ``policy`` and ``initial_weights`` as dicts by policy id: each policy has its own
        store, PPO and ONNX model, all published together in SET_STATE's ``policies``. With
        ``league_size``, every ``league_every`` updates a frozen copy of each policy joins
        the league (``policy@version``), which keeps the last ``league_size`` of them."""
        self.spec, self.servers = spec, servers
        self.train_batch_size = train_batch_size
        self.max_policy_lag = max_policy_lag
        self.multi = policy_specs is not None
        self.store = (MultiStore(policy_specs, window, reward_gamma) if self.multi
                      else EpisodeStore(window, reward_gamma))
        self.hub = Hub(spec, self.store, env_steps_per_sample, on_policy,
                       max_pending_steps=None if on_policy else train_batch_size, auth_token=auth_token,
                       state_size=state_size, policy_specs=policy_specs, extra_config=extra_config)
        self.league_size, self.league_every = league_size, max(1, league_every)
        self.league: dict = {}          # "policy@version" -> (version, ONNX file): frozen snapshots
        self.model_seqs: dict = {}      # policy id -> the version its current model was published at
        self.policy = policy
        self.housekeeping = housekeeping
        self.batch_wait_timeout = batch_wait_timeout
        self.short_batches = 0                     # trained without a client that was too slow
        self.weights_seq_no = first_weights_seq_no - 1
        self.updates = 0
        self.model_bytes = b""
        self._batches: queue.Queue = queue.Queue(maxsize=1)
        self._published: queue.Queue = queue.Queue()
        self._batch_out = False                    # a batch was handed over, no new weights yet
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None  # why the serving thread ended, if it did
        self._selector = selectors.DefaultSelector()
        for fd in [self._wake_r, *(server.fileno() for server in servers)]:
            self._selector.register(fd, selectors.EVENT_READ)
        self.publish(initial_weights)
        self.poll(0.0)

    # ------------------------------------------------------------ the serving thread
    def poll(self, timeout: float) -> int:
        """One round of serving: new weights out, requests in, a ready batch handed over.
        Returns the number of requests handled."""
        if timeout > 0:
            self._selector.select(timeout)
        try:
            os.read(self._wake_r, 1 << 12)
        except BlockingIOError:
            pass
        while not self._published.empty():
            version, onnx_file = self._published.get_nowait()
            self.hub.set_state(version, onnx_file)
            self._batch_out = False
        n = self.serve_requests()
        if self.housekeeping is not None:
            self.housekeeping(self)
        if not self._batch_out and self.ready():
            # Asynchronous clients go on sampling while a batch trains: a batch is still one
            # batch, so that learning per env step is what it is on-policy; the rest waits.
            max_lag = None if self.hub.on_policy else self.max_policy_lag
            batches = self.store.take(self.weights_seq_no, max_lag, self.train_batch_size)
            self._batches.put((batches, self.weights_seq_no))
            self._batch_out = True
        return n

    def serve_requests(self) -> int:
        """Answer every request waiting in the transports; returns how many there were."""
        n = 0
        for server in self.servers:
            for conn_id, msg in server.poll(0.0):
                self.hub.handle(server, conn_id, msg)
                n += 1
        return n

    def disconnect(self, conn_id: str, reason: str) -> None:
        """Close one connection from the learner's side (serving thread only)."""
        server = self.hub.servers.get(conn_id)
        if server is not None:
            server.drop(conn_id, reason)
        self.hub.forget(conn_id)

    def ready(self) -> bool:
        pending, hub = self.store.pending_steps, self.hub
        if pending >= self.train_batch_size or (pending > 0 and hub.all_waiting()):
            return True
        if (pending > 0 and hub.waiting_since is not None and self.batch_wait_timeout is not None
                and time.monotonic() - hub.waiting_since > self.batch_wait_timeout):
            silent = sorted(hub.sampling - set(hub.waiting))
            self.short_batches += 1
            log.warning("the batch waited %.1f s for %s; training on the %d env steps it has without them",
                        time.monotonic() - hub.waiting_since, ", ".join(map(hub.name, silent)), pending)
            return True
        return False

    def start(self) -> None:
        """Serve in a background thread until ``stop()``."""
        self._thread = threading.Thread(target=self._serve, name="shmrl-hub", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                self.poll(0.05)
        except BaseException as e:  # a bug or a broken transport: the run must end, not hang
            log.exception("the serving thread failed")
            self.failure = e

    def _wake(self) -> None:
        """Make the serving thread's next wait return at once."""
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full: a wake-up is pending anyway

    def stop(self) -> None:
        self._stop.set()
        self._wake()  # the serving thread stops now, not at its next timeout
        if self._thread is not None:
            self._thread.join(5.0)
        self._selector.close()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)

    # ------------------------------------------------------------ the training thread
    def next_batch(self, timeout: float) -> tuple[list[EpisodeBatch], int] | None:
        """The chunks of the next update and the weights version they were taken at, or None."""
        try:
            return self._batches.get(timeout=timeout)
        except queue.Empty:
            return None

    def publish(self, weights: dict) -> None:
        """Export ``weights`` as the next version; the serving thread sends it out. A
        multi-agent run's ``weights`` are by policy id (those not given stay as they were)."""
        self.weights_seq_no += 1
        if not self.multi:
            self.model_bytes = self.policy.publish(weights)
            self._published.put((self.weights_seq_no, encode_onnx_file(self.model_bytes)))
            self._wake()
            return
        if not isinstance(self.model_bytes, dict):
            self.model_bytes, self._files = {}, {}
        for pid, w in weights.items():
            self.model_bytes[pid] = self.policy[pid].publish(w)
            self._files[pid] = encode_onnx_file(self.model_bytes[pid])
            self.model_seqs[pid] = self.weights_seq_no
        if self.league_size and self.updates and self.updates % self.league_every == 0:
            for pid in weights:
                self.league[f"{pid}@{self.weights_seq_no}"] = (self.weights_seq_no, self._files[pid])
                mine = sorted((k for k in self.league if k.split("@", 1)[0] == pid), key=lambda k: self.league[k][0])
                for old in mine[:-self.league_size]:
                    del self.league[old]
        policies = {pid: {"onnx_file": f, "weights_seq_no": self.model_seqs[pid]} for pid, f in self._files.items()}
        policies.update({name: {"onnx_file": f, "weights_seq_no": seq, "frozen": True}
                         for name, (seq, f) in self.league.items()})
        self._published.put((self.weights_seq_no, policies))
        self._wake()

    def train(self, ppo, batches: list[EpisodeBatch], version: int, progress: float = 0.0) -> dict | None:
        """One PPO update on the chunks of ``batches``, then publish the new weights (and
        observation statistics). ``progress``: the fraction of the step budget trained."""
        t0 = time.perf_counter()
        if self.multi:
            return self._train_policies(ppo, batches, version, progress, t0)
        if not batches:
            self.publish(ppo.published_weights())   # releases any client held back; nothing to learn from
            return None
        chunks = EpisodeBatch.concat(batches)
        seq = chunks.weights_seq_no
        lags = version - seq[seq >= 0]
        scale = ppo.config.reward_scale * self.store.reward_scale()
        batch = ppo.make_batch(chunks, reward_scale=scale)
        stats = ppo.update(batch, progress)
        ppo.update_obs_stats(chunks)
        self.store.steps_trained += chunks.num_steps   # only this thread writes it
        self.updates += 1
        self.publish(ppo.published_weights())
        stats.update(update=self.updates, batch_steps=chunks.num_steps,
                     policy_lag=float(lags.mean()) if len(lags) else 0.0,
                     train_s=time.perf_counter() - t0, weights_seq_no=self.weights_seq_no, reward_scale=scale)
        return stats

    def _train_policies(self, ppos: dict, batches: list, version: int, progress: float, t0: float) -> dict | None:
        """A multi-agent update: each policy's PPO on its own chunks, then one publication.
        The stats are the step-weighted means over the policies trained, and per policy."""
        if not batches:
            self.publish({})
            return None
        chunks = batches[0].policies
        per_policy, lags, steps = {}, [], 0
        for pid, sub in chunks.items():
            ppo = ppos[pid]
            seq = sub.weights_seq_no
            lags.extend((version - seq[seq >= 0]).tolist())
            scale = ppo.config.reward_scale * self.store.policies[pid].reward_scale()
            batch = ppo.make_batch(sub, reward_scale=scale)
            per_policy[pid] = {**ppo.update(batch, progress), "batch_steps": sub.num_steps, "reward_scale": scale}
            ppo.update_obs_stats(sub)
            steps += sub.num_steps
        self.store.steps_trained += steps
        self.updates += 1
        self.publish({pid: ppos[pid].published_weights() for pid in chunks})
        total = sum(p["batch_steps"] for p in per_policy.values())
        stats = {k: sum(p[k] * p["batch_steps"] for p in per_policy.values()) / total
                 for k in ("pi_loss", "v_loss", "entropy", "approx_kl", "clip_frac", "lr", "reward_scale")}
        stats.update(update=self.updates, batch_steps=total, policy_lag=float(np.mean(lags)) if lags else 0.0,
                     train_s=time.perf_counter() - t0, weights_seq_no=self.weights_seq_no, policies=per_policy)
        return stats
