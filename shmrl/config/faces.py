"""The settings of the command lines besides ``python -m shmrl.run``: one group per command
(``python -m shmrl.sim``, ``eval``, ``record``, ``record export``, ``conformance``,
``plot``), each setting declared once with ``setting(default, help, check, ...)`` as
``Config``'s are, its flag built by ``shmrl.config.flags.face_parser``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shmrl.config.settings import AUTH_TOKEN_VAR, PORT, above, at_least, setting

ENV_HELP = "environment, as for shmrl.run (default: %(default)s)"

# The numbers every client of this repository shares: shmrl.sim, the JavaScript client
# (clients/js: cartpole.js's flags, shmrl_client.js's runClient) and the C header
# (clients/c/shmrl_client.h's #defines). docs/RLLINK.md and docs/CLIENTS.md give them;
# each is written here once, and tests/test_client_numbers.py holds the others to it.
REPLY_TIMEOUT_S = 600.0   # how long a client waits for one reply: a strict on-policy server holds
#                           it through an update (RLLINK.md §6), RLlib's answers after its training step
GIVE_UP_S = 5.0           # how long a client whose server went away after a session keeps trying
#                           to reconnect before it exits 0 (the run is over)
EXIT_GRACE_S = GIVE_UP_S + 3.0   # how long python -m shmrl.conformance lets a client end on its own
#                                  once it stopped listening: GIVE_UP_S, the JS client's longest wait
#                                  between attempts (2 s) and a second to spare


@dataclass(kw_only=True)
class SimSettings:
    """``python -m shmrl.sim``: one simulator process against a server."""
    connect: str | None = setting(
        None, "an RLlink server to train against over TCP (shmrl's --tcp-port, or RLlib's)", kind=str,
        metavar="HOST:PORT", one_of="server")
    attach: str | None = setting(None, "shared-memory slot of a running shmrl learner", kind=str, metavar="SEGMENT",
                                 one_of="server")
    env: str = setting("CartPole-v1", "environment id (default: %(default)s)")
    seed: int = setting(0, "random seed (default: %(default)s)")
    envs_per_sim: int = setting(
        1, "environments stepped together with one batched ONNX call (default: %(default)s)", check=at_least(1))
    auth_token: str | None = setting(
        None, f"shared secret the server requires in PING (default: ${AUTH_TOKEN_VAR})", kind=str, metavar="SECRET",
        env_var=AUTH_TOKEN_VAR)
    codec: str = setting(
        "binary", "over TCP, offer the binary codec in PING (shmrl's server takes it and asks for heartbeats; "
        "RLlib's ignores it and speaks JSON); json: offer nothing, as RLlib's own client (default: %(default)s)",
        choices=("binary", "json"))
    name: str | None = setting(None, "a name for this client in the server's logs", kind=str)
    server_inference: bool = setting(
        False, "let the server run the policy: send observations (ACT), get actions (ACTIONS); needs no "
        "onnxruntime (shmrl's server; RLlib's does not serve actions)", switch=True)
    declare: bool = setting(
        False, "declare the env's spaces in GET_CONFIG (docs/RLLINK.md 3.2): a learner started without --env "
        "trains them; one whose env differs closes the connection (the reason is in its log only, so without "
        "this flag a mismatch is found here and named)", switch=True)
    timeout: float = setting(
        REPLY_TIMEOUT_S, "seconds to wait for any one reply; RLlib's server answers only after its training step "
        "(default: %(default)s)", check=above(0))
    # How long a client keeps trying a server that is not there (yet, or any more): about
    # 10 s by default; examples/external_client.py does the same.
    max_retries: int = setting(
        5, "when the server cannot be reached or the connection is lost mid-reply, try again up to N times "
        "in a row, then exit 1 (default: %(default)s)", check=at_least(0), metavar="N")
    retry_s: float = setting(2.0, "seconds between attempts (default: %(default)s)", check=at_least(0), metavar="S")


@dataclass(kw_only=True)
class EvalSettings:
    """``python -m shmrl.eval``: a policy's mean return, or its win rate in a game."""
    policy: str | None = setting(None, "an ONNX policy file (policy.onnx of a run's log folder)", kind=str,
                                 positional=True)
    env: str = setting("CartPole-v1", ENV_HELP)
    episodes: int = setting(20, "episodes to run (default: %(default)s)", check=at_least(1))
    seed: int = setting(0, "seed of the envs and of sampling (default: %(default)s)")
    stochastic: bool = setting(False, "sample actions as in training, not greedily", switch=True)
    json: bool = setting(False, "print one JSON object", switch=True)
    opponent: str = setting("random", "multi-agent envs: random, self, or an ONNX policy file (default: %(default)s)",
                            metavar="WHO")


@dataclass(kw_only=True)
class RecordSettings:
    """``python -m shmrl.record``: serve a fixed policy and record what clients send."""
    out: str | None = setting(None, "the dataset folder to write (appended to if it exists)", kind=str,
                              metavar="DIR", required=True)
    env: str = setting("CartPole-v1", "the clients' environment, as for shmrl.run (default: %(default)s)")
    policy: str | None = setting(None, "the ONNX policy clients are served (a run's policy.onnx)", kind=str,
                                 metavar="FILE")
    tcp_port: int | None = setting(None, "serve RLlink clients over TCP on PORT", kind=int, metavar="PORT",
                                   check=PORT)
    tcp_host: str = setting("127.0.0.1", "address to listen on (default: %(default)s)", metavar="HOST")
    auth_token: str | None = setting(
        None, f"clients must send it in their PING (default: ${AUTH_TOKEN_VAR})", kind=str, metavar="SECRET",
        env_var=AUTH_TOKEN_VAR)
    sims: int = setting(0, "also start N local simulators (default: %(default)s)", check=at_least(0))
    envs_per_sim: int | None = setting(None, "envs per simulator (default: the env's)", kind=int, metavar="K",
                                       check=at_least(1))
    seed: int = setting(0, "seed of the simulators (default: %(default)s)")
    episodes: int | None = setting(None, "stop after N complete episodes (default: Ctrl-C)", kind=int, metavar="N",
                                   check=at_least(1))


@dataclass(kw_only=True)
class RecordExportSettings:
    """``python -m shmrl.record export``: a recording written as a Minari dataset."""
    dataset: str | None = setting(None, "a dataset folder (--record, python -m shmrl.record --out)", kind=str,
                                  positional=True)
    minari_id: str | None = setting(None, "the Minari dataset id, e.g. shmrl/cartpole-v0", kind=str, metavar="NAME",
                                    required=True)
    minari_root: str | None = setting(
        None, "where Minari keeps its datasets (default: its own, $MINARI_DATASETS_PATH or ~/.minari/datasets)",
        kind=str, metavar="DIR")
    author: str | None = setting(None, "the dataset's author, in its Minari metadata (default: none)", kind=str,
                                 metavar="NAME")
    author_email: str | None = setting(None, "the author's email or other contact, in its metadata (default: none)",
                                       kind=str, metavar="ADDRESS")
    code_permalink: str | None = setting(
        None, "a link to the code that produced the dataset, in its metadata (default: none)", kind=str, metavar="URL")


@dataclass(kw_only=True)
class ConformanceSettings:
    """``python -m shmrl.conformance``: an RLlink client checked against docs/RLLINK.md."""
    env: str = setting("CartPole-v1", "the env the client steps (default: %(default)s)")
    algo: str = setting(
        "ppo", "the learner the checker plays: ppo (RLlib's distributions), or sac: SET_CONFIG's action_dist, "
        "version 0 served as SAC's warm-up (uniform) and version 1 as its squashed Gaussian (RLLINK.md 4.2), "
        "and a client that runs the policy itself must list both in its PING (the env's action: one bounded "
        "Box) (default: %(default)s)", choices=("ppo", "sac"))
    reconnect: bool = setting(
        True, "the client ends when its connection is closed (shmrl.sim): skip connection 2", flag="--no-reconnect",
        switch=True)
    steps: int | None = setting(
        None, "env_steps_per_sample of connection 1 (a server-inference client: its env steps in all). Default: "
        "enough for each env to reach the env's time limit, max(2000, 8 x max_episode_steps) (its three messages "
        "step up to 24 envs past it; a server-inference client gets at least max_episode_steps + 1 ACTs); 2000 for "
        "an env without one. A run that ends no episode fails", kind=int, check=at_least(4), metavar="N")
    hold_s: float = setting(2.0, "how long the reply to message 1 is held (default: %(default)s)", check=at_least(0))
    timeout: float = setting(
        60.0, "seconds to wait for the client's connection and each request (default: %(default)s)",
        check=above(0))


@dataclass(kw_only=True)
class PlotSettings:
    """``python -m shmrl.plot``: learning curves of runs."""
    runs: list[Path] | None = setting(None, "log folders of shmrl.run, or folders of them (every run under one)", kind=Path, positional=True, nargs="+",
                                      metavar="RUN_DIR")
    output: Path = setting(Path("learning_curves.png"), "PNG to write (default: %(default)s)", kind=Path, short="-o")
    title: str | None = setting(None, "a title above the plots", kind=str)

