"""A learner without an env waits for a client to declare its spaces (docs/RLLINK.md §3.2).

``python -m shmrl.run --sims 0 --tcp-port P`` without --env (``--env declared``) opens its
TCP port before it has an env. ``wait_for_spaces`` serves the port until the first
GET_CONFIG, and returns the env it decides with the port: the spaces that GET_CONFIG
declares, or, when it declares none (RLlib's client, any client written before
declarations), the default env, CartPole-v1, as such a learner trained before. Until then
it answers PING (with --auth-token exactly as the Hub does), holds every connection's
requests, and refuses in one line a client that asks for what needs an env before any
GET_CONFIG (GET_STATE, episodes, ACT). The run is then set up with that spec,
and ``Replay`` hands the held requests to its Hub first, in order: each client gets its
replies as if the Hub had been there all along (the Hub's PONGs to PINGs answered here are
not sent twice), and a later client whose declared spaces differ is refused by the Hub.
"""
from __future__ import annotations

import collections
import logging
import time

from shmrl import rllink
from shmrl.config.settings import DECLARED_ENV, Config, resolve_config
from shmrl.envs.spec import EnvSpec, declared_spec, space_config
from shmrl.server.hub import auth_refusal
from shmrl.server.inference.base import Inference
from shmrl.server.serving import open_tcp

log = logging.getLogger("shmrl.learner")
T = rllink.MessageType
NO_ENV_YET = ("the learner has no --env and no client has sent GET_CONFIG yet, which decides it "
              "(docs/CLIENTS.md, 'Declaring the spaces')")


class Lobby:
    """The requests of a TCP server's clients before the run has an env: PINGs answered,
    everything held (``held``, in order) until a GET_CONFIG declares the spaces (``spec``)."""

    def __init__(self, tcp, auth_token: str | None):
        self.tcp, self.auth_token = tcp, auth_token
        self.spec: EnvSpec | None = None
        self.env = DECLARED_ENV   # or the default env, for a first GET_CONFIG that declares nothing
        self.held: list[tuple[str, dict]] = []
        self.answered: collections.Counter = collections.Counter()   # conn_id -> PINGs answered here
        self.authenticated: set[str] = set()

    def serve(self, requests: list) -> None:
        for conn_id, msg in requests:
            if msg is None:   # closed: nothing of it to hand on
                self._forget(conn_id)
            elif self.auth_token is not None and conn_id not in self.authenticated:
                why = auth_refusal(msg, self.auth_token)
                if why:
                    self._refuse(conn_id, why)
                    continue
                self.authenticated.add(conn_id)
                self._take(conn_id, msg)
            else:
                self._take(conn_id, msg)

    def _take(self, conn_id: str, msg: dict) -> None:
        kind = msg["type"]
        if self.spec is None and kind == T.PING.value:
            asked = msg.get("inference") == "server"   # a declared env is single-agent: actions are served
            self.tcp.reply(conn_id, {"type": T.PONG.value, **(Inference.pong_fields if asked else {})})
            self.answered[conn_id] += 1
        elif self.spec is None and kind == T.GET_CONFIG.value:
            if any(key in msg for key in rllink.DECLARED_FIELDS):
                self.spec = declared_spec(msg)
                config = space_config(self.spec)
                print(f"training the spaces {conn_id} declared: observation {config['observation_dtype']} "
                      f"{config['observation_shape']}, action {config['action_space']} (the house presets; no "
                      f"target return unless --stop-return: --env ID trains a known env with its own)", flush=True)
            else:
                from shmrl.envs.make import env_spec

                self.env, self.spec = Config.env, env_spec(Config.env)
                print(f"{conn_id} declared no spaces: training the default env, {Config.env} (--env chooses "
                      f"another; a client may declare its spaces in GET_CONFIG)", flush=True)
        elif self.spec is None and kind != T.HEARTBEAT.value:
            self._refuse(conn_id, f"{kind} before the learner has an env: {NO_ENV_YET}")
            return
        self.held.append((conn_id, msg))

    def _refuse(self, conn_id: str, why: str) -> None:
        self.tcp.drop(conn_id, why)
        self._forget(conn_id)

    def _forget(self, conn_id: str) -> None:
        self.held = [(c, m) for c, m in self.held if c != conn_id]
        self.answered.pop(conn_id, None)
        self.authenticated.discard(conn_id)


class Replay:
    """``server`` (a transport) whose first poll returns the lobby's ``held`` requests before
    its own, and which does not send again the PONGs the lobby already sent (``answered``);
    everything else is the server's."""

    def __init__(self, server, held: list, answered: collections.Counter):
        self.server, self._held, self._answered = server, held, answered

    def poll(self, timeout: float = 0.0) -> list:
        if self._held:
            held, self._held = self._held, []
            return held + self.server.poll(0.0)
        return self.server.poll(timeout)

    def reply(self, conn_id: str, msg: dict) -> None:
        if msg["type"] == T.PONG.value and self._answered[conn_id]:
            self._answered[conn_id] -= 1
            return
        self.server.reply(conn_id, msg)

    def __getattr__(self, name):
        return getattr(self.server, name)


def wait_for_spaces(config, t_start: float) -> tuple[str, EnvSpec, Replay] | None:
    """The env the first GET_CONFIG decides (``DECLARED_ENV`` or the default env's id), its
    spec, and the TCP server it came through (opened on --tcp-host and --tcp-port); None
    when --max-seconds passed first (the server closed)."""
    # Until the env is known, its preset settings are the house defaults, and its frames are
    # bound by --max-frame-bytes alone: the env's limits are set once it is (``open_transports``).
    tcp = open_tcp(resolve_config(config), config.tcp_host)
    try:
        host, port = tcp.address
        print(f"listening for RLlink clients on {host}:{port}", flush=True)
        print(f"waiting for a client to declare its spaces on {host}:{port} (no --env)", flush=True)
        lobby = Lobby(tcp, config.auth_token)
        while lobby.spec is None:
            if config.max_seconds is not None and time.time() - t_start >= config.max_seconds:
                tcp.close()
                return None
            lobby.serve(tcp.poll(0.2))
        return lobby.env, lobby.spec, Replay(tcp, lobby.held, lobby.answered)
    except BaseException:
        tcp.close()
        raise
