"""The serving side of the learner: one thread that answers every transport through the
Hub, keeps the episode store, hands ready batches to the trainer and sends its new weights
out; and the transports a run opens.

The trainer talks to it through ``next_batch`` and ``publish``; a launcher (the
supervisor) through ``connection_named``, ``held``, ``timed_out``, ``steps_received``
and ``close``, from the serving thread (``housekeeping``), never through its attributes.
"""
from __future__ import annotations

import errno
import logging
import math
import queue
import selectors
import socket
import threading
import time

import numpy as np

from shmrl import rllink
from shmrl.config.settings import ConfigError
from shmrl.envs.spec import EnvSpec
from shmrl.server.hub import Bounds, Hub
from shmrl.onnxio.graph import ModelTemplate
from shmrl.onnxio.policy import encode_onnx_file
from shmrl.rllink.act import act_body_bytes
from shmrl.server.store import SWITCHED, EpisodeStore
from shmrl.transport.base import WakePipe

log = logging.getLogger("shmrl.learner")


class Serving:
    """Serves the transports from one thread while another trains.

    The serving thread owns the Hub, the store and every server: it answers requests,
    and when a batch is ready hands its chunks over through a queue. The training thread
    runs PPO on them (torch releases the GIL, so requests keep being answered) and hands
    the new ONNX model back the same way. No lock is shared; at most one batch is in
    flight. ``on_policy``: clients wait for each new version; otherwise they keep sampling
    while the learner trains, a client is held back only while a whole batch is already
    waiting, and chunks more than ``max_policy_lag`` versions old are dropped as stale.
    """

    def __init__(self, servers: list, config, policy_specs: dict[str, EnvSpec], templates: dict[str, ModelTemplate],
                 initial_weights: dict[str, dict], *, multiagent: bool = False, first_weights_seq_no: int = 1,
                 housekeeping=None, state_size: int = 0, extra_config: dict | None = None, agents=None,
                 shared_batch: int | None = None, off_policy: bool = False, action_dists: dict | None = None):
        """Serves the policies ``policy_specs`` (policy id -> EnvSpec; a single-agent run's
        one is ``DEFAULT_POLICY``) and publishes their ``initial_weights`` (into the graphs
        ``templates``, by policy id) at once, as version ``first_weights_seq_no``: clients
        can sample before the trainer (torch) is even loaded. Each policy has its own
        chunks, PPO and ONNX model, all published together. ``multiagent``: the clients
        speak RLlib's multi-agent messages (see ``Hub``).

        ``config`` (the run's ``Config``) gives the sizes (train batch, sample), the
        pacing (``async_sampling``, ``max_policy_lag``), ``auth_token``, the return window,
        reward normalization (rewards scaled by the running std of discounted returns, see
        ``PolicyChunks``), the league (every ``league_every`` updates a frozen copy of each
        policy joins it as ``policy@version``; it keeps the last ``league`` of them), each
        client's budget of pending env steps, and ``hang_timeout``: once a client waits for
        new weights, the batch waits at most this long for the clients still sampling (one
        that went silent must not stall everyone), then trains on what it has.

        ``housekeeping(serving)``, if given, runs in the serving thread after every round
        of requests (the supervisor watches the simulators from there). ``state_size``: the
        floats of a recurrent policy's state (0: none). ``extra_config``: more fields for
        SET_CONFIG (a multi-agent run's policy map); ``agents``: a multi-agent env's agent
        ids, the only ones its chunks may carry. ``shared_batch``: the train batch spread over
        whoever samples (``Hub.share``); None: every client gets ``config.env_steps_per_sample``.

        ``off_policy`` (SAC, ``shmrl.model.algorithm``): no client ever waits for an update,
        no chunk is too old, and a batch (up to the train batch) is handed over as soon as
        any step waits. The clients are paced (``Hub.paced``): one that sends while a train
        batch of steps waits goes on once the learner has taken them, so that a learner
        slower than its clients keeps its gradient steps per env step. ``action_dists``:
        per policy id, how its clients are to sample output 0 now (SET_STATE's
        ``action_dist``; None: as the model says), changed by ``publish``."""
        self.servers, self.multiagent = servers, multiagent
        self.off_policy = off_policy
        self.action_dists = {pid: d for pid, d in (action_dists or {}).items() if d}
        self.train_batch_size = config.train_batch_size
        self.max_policy_lag = config.max_policy_lag
        on_policy = not (config.async_sampling or off_policy)
        reward_gamma = config.gamma if config.normalize_reward else None
        time_limit = min((getattr(spec, "max_episode_steps", None) or 0 for spec in policy_specs.values()), default=0)
        self.store = EpisodeStore(policy_specs, config.return_window, reward_gamma, time_limit or None)
        self.hub = Hub(policy_specs, self.store, config.env_steps_per_sample, on_policy,
                       max_pending_steps=None if on_policy else self.train_batch_size,
                       auth_token=config.auth_token,
                       state_size=state_size, multiagent=multiagent, extra_config=extra_config,
                       client_budget=client_budget(config), agents=agents,
                       bounds=Bounds(max_obs_abs=config.max_obs_abs, max_reward_abs=config.max_reward_abs),
                       shared_batch=shared_batch, local_sims=config.sims)
        self.hub.paced = off_policy
        self.league_size, self.league_every = config.league or 0, max(1, config.league_every or 1)
        self.league: dict = {}          # "policy@version" -> (version, ONNX file): frozen snapshots
        self.model_seqs: dict = {}      # policy id -> the version its current model was published at
        self.templates = templates
        self.model_bytes: dict[str, bytes] = {}   # policy id -> its current ONNX model
        self._files: dict[str, str] = {}           # policy id -> the same, as SET_STATE's onnx_file
        self.housekeeping = housekeeping
        self.batch_wait_timeout = config.hang_timeout
        # Each field has one writer, so no lock: short_batches and first_batch_rate are the
        # serving thread's (the trainer only reads them); weights_seq_no, the models and the
        # league are the training thread's (publish), whose versions reach the serving thread
        # through _published. The update counts are the trainer's alone (UpdateCounts).
        self.short_batches = 0                     # trained without a client that was too slow
        self.weights_seq_no = first_weights_seq_no - 1
        self._batches: queue.Queue = queue.Queue(maxsize=1)
        self._published: queue.Queue = queue.Queue()
        self._batch_out = False                    # a batch was handed over, no new weights yet
        self.min_seq = 0                           # chunks of older weights are another profile's: dropped
        self.first_batch_rate: float | None = None   # env steps/s the clients delivered until the first batch
        self._wake_pipe = WakePipe()               # publish() and stop() wake the serving thread
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None  # why the serving thread ended, if it did
        self._selector = selectors.DefaultSelector()
        for fd in [self._wake_pipe.fileno(), *(server.fileno() for server in servers)]:
            self._selector.register(fd, selectors.EVENT_READ)
        try:
            self.publish(initial_weights)
        except ConfigError:
            self.stop()   # its pipe and selector
            raise
        self.poll(0.0)

    # ------------------------------------------------------------ the serving thread
    def poll(self, timeout: float) -> int:
        """One round of serving: new weights out, requests in, a ready batch handed over.
        Returns the number of requests handled."""
        if timeout > 0:
            self._selector.select(timeout)
        self._wake_pipe.drain()
        while not self._published.empty():
            version, policies = self._published.get_nowait()
            if version is not None:   # None: the batch was taken, no new weights (``taken``)
                self.hub.set_state(version, policies)
            self._batch_out = False
        n = self._serve_requests()
        if self.housekeeping is not None:
            self.housekeeping(self)
        if not self._batch_out and not self.store.pending_steps and self.hub.all_waiting():
            self.hub.release_waiting()   # they sent chunks without steps: no update will come
        if not self._batch_out and self._batches.empty() and self.ready():   # (SAC publishes mid-update)
            # Asynchronous clients go on sampling while a batch trains: a batch is still one
            # batch, so that learning per env step is what it is on-policy; the rest waits.
            max_lag = None if self.hub.on_policy or self.off_policy else self.max_policy_lag
            if self.first_batch_rate is None:
                self.first_batch_rate = self.hub.delivery_rate()
            batches = self.store.take(self.weights_seq_no, max_lag, self.train_batch_size, self.min_seq)
            self._batches.put((batches, self.weights_seq_no))
            self._batch_out = True
        self.hub.release_if_room()   # off-policy: the clients the learner held go on
        self.hub.flush_actions()   # server-side inference: this round's ACTs, one forward pass
        if self.hub.held:
            self.hub.release_held()
        return n

    def _serve_requests(self) -> int:
        """Answer every request waiting in the transports; returns how many there were."""
        n = 0
        for server in self.servers:
            for conn_id, msg in server.poll(0.0):
                self._handle(server, conn_id, msg)
                n += 1
        return n

    def _handle(self, server, conn_id: str, msg: dict | None) -> None:
        """One request; whatever it raises closes its connection only, never the run."""
        try:
            self.hub.handle(server, conn_id, msg)
        except Exception as e:
            log.exception("%s: its %s raised", self.hub.name(conn_id), (msg or {}).get("type", "close"))
            server.drop(conn_id, f"internal error on its input: {type(e).__name__}: {e}"[:300])
            self.hub.forget(conn_id)

    # ------------------------------------------------------------ for launchers (serving thread only)
    def connection_named(self, name: str) -> str | None:
        """The open connection whose client gave ``name`` in its PING, or None."""
        return next((conn_id for conn_id, conn in self.hub.connections.items() if conn.name == name), None)

    def refused_in_a_row(self, conn_id: str) -> tuple[int, str | None]:
        """How many of the connection's last messages had every env step refused for its
        values (out of bounds), and the reason of the last refusal."""
        conn = self.hub.connections.get(conn_id)
        return (conn.refused_in_a_row, conn.refused_why) if conn is not None else (0, None)

    def held(self, conn_id: str) -> bool:
        """Whether the learner holds the connection back (it waits for new weights)."""
        return conn_id in self.hub.waiting

    def timed_out(self, conn_id: str) -> bool:
        """Whether a server closed the connection for missing heartbeats."""
        return any(server.timed_out(conn_id) for server in self.servers)

    def steps_received(self, conn_id: str) -> int:
        """The env steps received over the connection so far (a restarted simulator's slot
        keeps its connection id, and its count)."""
        return self.store.steps_by_conn.get(conn_id, 0)

    def close(self, conn_id: str, reason: str, stepped: int = 0, received_before: int = 0) -> int:
        """Close a connection from the learner's side (its client died or hung). What it
        sent whole still counts; of the ``stepped`` env steps its client reported since the
        connection had ``received_before``, those never received are counted as lost.
        Returns them."""
        self._serve_requests()
        lost = max(0, stepped - (self.steps_received(conn_id) - received_before))
        self.store.steps_lost += lost
        conn = self.hub.connections.get(conn_id)
        if conn is not None:
            conn.server.drop(conn_id, reason)
        self.hub.forget(conn_id)
        return lost

    def ready(self) -> bool:
        pending, hub = self.store.pending_steps, self.hub
        if pending and self.off_policy:
            return True
        if pending >= self.train_batch_size or (pending > 0 and hub.all_waiting()):
            return True
        if (pending > 0 and hub.waiting_since is not None and self.batch_wait_timeout is not None
                and time.monotonic() - hub.waiting_since > self.batch_wait_timeout):
            silent = sorted(hub.sampling - set(hub.waiting))
            named = ", ".join(map(hub.name, silent[:8])) + (f" and {len(silent) - 8} more" if len(silent) > 8 else "")
            self.short_batches += 1
            log.warning("the batch waited %.1f s for %s; training on the %d env steps it has without them",
                        time.monotonic() - hub.waiting_since, named, pending)
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

    def stop(self) -> None:
        self._stop.set()
        self._wake_pipe.wake()  # the serving thread stops now, not at its next timeout
        if self._thread is not None:
            self._thread.join(5.0)
        self._selector.close()
        self._wake_pipe.close()

    # ------------------------------------------------------------ the training thread
    def next_batch(self, timeout: float) -> tuple[dict, int] | None:
        """The chunks of the next update (policy id -> its batches) and the weights version
        they were taken at, or None."""
        try:
            return self._batches.get(timeout=timeout)
        except queue.Empty:
            return None

    def taken(self) -> None:
        """The trainer took the batch handed over and publishes nothing for it (SAC's warm-up):
        the serving thread may hand over the next one."""
        self._published.put((None, None))
        self._wake_pipe.wake()

    def publish(self, weights: dict, update: int = 0, action_dists: dict | None = None) -> None:
        """Export ``weights`` (by policy id; those not given stay as they were) as the next
        version; the serving thread sends it out. A policy whose weights are not all finite
        is never published: it keeps its model. ``update``: the trainer's update that made
        them (0: none); every ``league_every``-th update's join the league. ``action_dists``:
        how clients are to sample each policy's output 0 from now on (None: as its model says)."""
        for pid, dist in (action_dists or {}).items():
            if dist:
                self.action_dists[pid] = dist
            else:
                self.action_dists.pop(pid, None)
        weights = finite_weights(weights)
        never = [pid for pid in self.templates if pid not in weights and pid not in self.model_bytes]
        if never:   # the first weights (a checkpoint's, say): nothing sound to serve instead
            raise ConfigError(f"the first weights of policy {never[0]!r} are not finite (NaN or inf)")
        self.weights_seq_no += 1
        for pid, w in weights.items():
            self.model_bytes[pid] = self.templates[pid].publish(w)
            self._files[pid] = encode_onnx_file(self.model_bytes[pid])
            self.model_seqs[pid] = self.weights_seq_no
        if self.league_size and update and update % self.league_every == 0:
            for pid in weights:
                self.league[f"{pid}@{self.weights_seq_no}"] = (self.weights_seq_no, self._files[pid])
                mine = sorted((k for k in self.league if k.split("@", 1)[0] == pid), key=lambda k: self.league[k][0])
                for old in mine[:-self.league_size]:
                    del self.league[old]
        policies = {pid: {"onnx_file": f, "weights_seq_no": self.model_seqs[pid],
                          **({"action_dist": self.action_dists[pid]} if pid in self.action_dists else {})}
                    for pid, f in self._files.items()}
        policies.update({name: {"onnx_file": f, "weights_seq_no": seq, "frozen": True}
                         for name, (seq, f) in self.league.items()})
        self._published.put((self.weights_seq_no, policies))
        self._wake_pipe.wake()

    def switch(self, config, templates: dict[str, ModelTemplate], weights: dict, chunks: dict,
               off_policy: bool = False, config_fields: dict | None = None, action_dists: dict | None = None) -> None:
        """Go on with other networks and settings (the slow profile, or SAC: ``config``):
        their ``templates`` and first ``weights`` (by policy id) published now. The batch in
        hand (``chunks``) and every chunk sampled with an older version are dropped; with
        ``off_policy`` (SAC, whose replay buffer took the batch) it counts as trained and
        every chunk is kept. ``config_fields``: SET_CONFIG's new fields for clients still to
        come; ``action_dists``: SET_STATE's, by policy id (``publish``). (Training thread;
        the serving thread takes no batch until it has sent these weights out.)"""
        if off_policy:
            self.store.trained(chunks)
        else:
            self.store.skipped(chunks, SWITCHED)
            self.min_seq = self.weights_seq_no + 1
        self.off_policy = off_policy
        self.train_batch_size = config.train_batch_size
        self.hub.on_policy = not (config.async_sampling or off_policy)
        self.hub.max_pending_steps = None if self.hub.on_policy else config.train_batch_size
        self.hub.paced = off_policy
        self.hub.client_budget = client_budget(config)
        if config_fields:   # a new dict: a transport may hold a reply not yet sent
            self.hub.config_msg = {**self.hub.config_msg, **config_fields}
        for policy in self.store.policies.values():
            if policy.reward_stats is not None and config.normalize_reward:   # the new discount (its statistics go on)
                policy.reward_gamma = config.gamma
            elif policy.reward_stats is not None:   # SAC trains on the rewards as they are
                policy.reward_stats = None
        self.templates, self.model_bytes, self._files = templates, {}, {}
        self.publish(weights, action_dists=action_dists)


def finite_weights(weights: dict) -> dict:
    """``weights`` (by policy id) without any policy that holds a NaN or an infinity."""
    poisoned = [pid for pid, w in weights.items() if not all(np.isfinite(a).all() for a in w.values())]
    for pid in poisoned:
        log.error("policy %r: its new weights are not finite; they are not published", pid)
    return {pid: w for pid, w in weights.items() if pid not in poisoned}


def open_transports(config, spec, nets: dict, launcher=None, tcp=None) -> tuple[list, list[str], object]:
    """The learner's servers, the address each local simulator connects to, and the
    shared-memory server (None if the simulators use TCP or there are none). With a remote
    ``launcher`` (Ray) the TCP server also listens, on the address this node has in the
    cluster unless --tcp-host names another: the simulators on other nodes connect there.
    ``tcp``: the TCP server already open (``shmrl.server.lobby``), given the env's limits."""
    servers, addresses, shm = [], [], None
    remote = launcher is not None and launcher.remote
    if config.sims and config.transport == "shm":
        from shmrl.transport.shm import ShmServer
        shm = ShmServer(config.sims, **ring_bytes(config, spec, nets))
        servers.append(shm)
        addresses = [f"shm:{shm.address(i)}" for i in range(config.sims)]
    if tcp is not None:
        # Its connections opened before keep the frame limits they had (--max-frame-bytes):
        # new ones get the env's.
        from shmrl.transport.tcp import BodyLimits

        frames = env_frame_limits(config, spec, nets)
        server = getattr(tcp, "server", tcp)   # the lobby's Replay wraps the server: the limits are the server's
        server.limits = message_limits(config)
        server.body_limits = BodyLimits(frames["max_json_frame_bytes"], frames["max_binary_frame_bytes"])
        server.act_limits = frames["act_limits"] and frames["act_limits"].within(server.body_limits)
        servers.append(tcp)
    elif config.tcp_port is not None or (config.sims and config.transport == "tcp") or remote:
        host = launcher.node_ip if remote and config.tcp_host == type(config).tcp_host else config.tcp_host
        try:
            tcp = open_tcp(config, host, **env_frame_limits(config, spec, nets))
        except BaseException:
            for server in servers:
                server.close()
            raise
        servers.append(tcp)
        host, port = tcp.address
        if config.tcp_port is not None or remote:
            print(f"listening for RLlink clients on {host}:{port}", flush=True)
        if remote:
            launcher.tcp_address = f"tcp:{host}:{port}"
        if config.transport == "tcp":
            addresses = [f"tcp:{host}:{port}"] * config.sims
    return servers, addresses, shm


def env_frame_limits(config, spec, nets: dict) -> dict:
    """The TCP server's frame limits that follow from the env: a frame larger than the
    largest message within the limits is refused from its first bytes, before it is read
    (JSON writes a number in up to ~8 times the bytes), and an ACT larger than the env's."""
    largest = episodes_bytes(spec, list(nets.values()), message_limits(config).max_chunks)
    return {"max_binary_frame_bytes": min(config.max_frame_bytes, largest),
            "max_json_frame_bytes": config.max_json_frame_bytes or min(config.max_frame_bytes, 8 * largest),
            "act_limits": act_limits(spec)}


def open_tcp(config, host: str, **frame_limits):
    """The learner's TCP server on ``host`` and --tcp-port (ConfigError, in the flags' words,
    where it cannot listen); ``frame_limits``: the env's (``env_frame_limits``)."""
    from shmrl.transport.tcp import TcpServer

    try:
        return TcpServer(host, config.tcp_port or 0, max_frame_bytes=config.max_frame_bytes,
                         limits=message_limits(config),
                         first_frame_max_bytes=FIRST_FRAME_MAX_BYTES if config.auth_token else None,
                         heartbeat_s=heartbeat_period(config.hang_timeout), heartbeat_timeout=config.hang_timeout,
                         **frame_limits)
    except (OSError, OverflowError) as e:
        raise ConfigError(listen_error(config, e)) from None


def client_budget(config) -> int:
    """The env steps one connection may have waiting for training (--client-budget)."""
    return config.client_budget or 4 * max(config.train_batch_size, config.env_steps_per_sample or 1)


def message_limits(config) -> rllink.MessageLimits:
    """The most chunks and env steps one EPISODES message may carry."""
    steps = config.max_message_steps or client_budget(config)
    return rllink.MessageLimits(max_chunks=config.max_message_chunks or steps + 1024, max_steps=steps)


def heartbeat_period(hang_timeout: float) -> float:
    """How often shmrl's TCP clients are asked to send a HEARTBEAT: several per
    ``--hang-timeout``, so that one late frame is not taken for a hang; at most 1 s."""
    return min(1.0, hang_timeout / 5)


# With --auth-token a connection's first frame must be its PING: a few hundred bytes.
FIRST_FRAME_MAX_BYTES = 4096


def listen_error(config, e: Exception) -> str:
    """Why the TCP port could not be opened, in the words of the flags that chose it."""
    where = f"--tcp-host {config.tcp_host} --tcp-port {config.tcp_port or 0}"
    code = getattr(e, "errno", None)
    if code == errno.EADDRINUSE:
        return f"{where}: the port is already in use (another run or program listens there; choose " \
               f"another port, or --tcp-port 0 for any free one)"
    if code == errno.EADDRNOTAVAIL:
        return f"{where}: {config.tcp_host} is not an address of this machine"
    if code == errno.EACCES:
        return f"{where}: permission denied (ports below 1024 need privileges)"
    if isinstance(e, socket.gaierror):
        return f"{where}: cannot resolve {config.tcp_host!r} ({e.strerror})"
    return f"{where}: cannot listen there: {getattr(e, 'strerror', None) or e}"



def set_state_bytes(nets: list) -> int:
    """An upper bound on a SET_STATE body carrying the models of ``nets`` (PolicyNets),
    from their shapes alone: float32 weights and the graphs around them."""
    params = sum(math.prod(shape) for n in nets for shape in n.template.shapes.values())
    return rllink.set_state_body_bytes(4 * params + 4096 * len(nets))


def check_policy_fits_a_frame(config, nets: dict, multiagent: bool) -> None:
    """ConfigError unless every SET_STATE of this run fits one RLlink frame (8 digits of
    length: 99,999,999 bytes); checked from the networks' shapes, before any weight exists."""
    every = list(nets.values()) * (1 + (config.league or 0) if multiagent else 1)
    size = set_state_bytes(every)
    if size > rllink.MAX_BODY_LEN:
        params = sum(math.prod(shape) for n in nets.values() for shape in n.template.shapes.values())
        raise ConfigError(f"the policy is too large to send: {params:,} parameters (--hidden {config.hidden}, "
                          f"--layers {config.layers}) make a SET_STATE message of up to {size:,} bytes, over "
                          f"RLlink's frame limit of {rllink.MAX_BODY_LEN:,}; use a smaller --hidden or --layers")


def episodes_bytes(spec, nets: list, steps: int) -> int:
    """An upper bound on the binary body of an EPISODES message of ``steps`` env steps of
    ``spec``'s env (each may begin a chunk of its own) for the policies ``nets``."""
    specs, extra = [spec], 0
    if spec.multiagent:
        specs, extra = list(spec.agent_specs.values()), 256   # agent and module ids
    request = 0
    for s in specs:
        request = max(request, rllink.episodes_body_bytes(steps, obs_bytes(s) + extra, s.actions.action_size,
                                                          s.policy_outputs, len(s.obs.leaves), nets[0].state_size))
    return request


def obs_bytes(spec) -> int:
    """The bytes of one observation of ``spec`` (all its leaves) in the binary codec."""
    return sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in spec.obs.leaves)


def act_limits(spec):
    """The largest ACT of ``spec``'s env, in each codec: what a TCP client granted server-side
    inference may send in one frame (a multi-agent env's: of any of its agents)."""
    from shmrl.transport.tcp import BodyLimits

    agents = [str(agent) for agent in spec.agents] if spec.multiagent else None
    sizes = [act_body_bytes(obs_bytes(s), [(leaf.name, len(leaf.shape)) for leaf in s.obs.leaves], agents)
             for s in (spec.agent_specs.values() if spec.multiagent else [spec])]
    binary, text = map(max, zip(*sizes))
    return BodyLimits(text, binary, " from a client of server-side inference (the largest ACT of the run's env)")


def ring_bytes(config, spec, nets: dict) -> dict:
    """Ring capacities that take every frame of this run: a simulator's EPISODES message
    (``env_steps_per_sample`` rounded up to whole steps of its envs) and a SET_STATE of
    its policies (``nets``: policy id -> PolicyNet)."""
    from shmrl.transport.shm import ShmServer, ring_bytes_for

    steps = -(-config.env_steps_per_sample // config.envs_per_sim) * config.envs_per_sim
    nets = list(nets.values())
    if spec.multiagent:   # each step may be any agent's; every policy and snapshot in a reply
        steps += config.envs_per_sim * len(spec.agents)   # a turn may end past the sample size
        nets = nets * (1 + (config.league or 0))
    request = episodes_bytes(spec, nets, steps)
    reply = set_state_bytes(nets)
    return {"request_ring_bytes": ring_bytes_for(8 + request, ShmServer.REQUEST_RING_BYTES),
            "reply_ring_bytes": ring_bytes_for(8 + reply, ShmServer.REPLY_RING_BYTES)}
