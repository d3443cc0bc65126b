"""python -m shmrl.conformance: check an RLlink client against docs/RLLINK.md.

The checker plays a scripted server on a free TCP port of this host, starts the client
under test from a command template (``{port}`` is replaced), and leads it through:

  connection 1   PING -> PONG (the binary codec and heartbeats when the client offers
                 them), GET_CONFIG -> SET_CONFIG, GET_STATE -> SET_STATE version 0;
                 message 1: its reply held for a while (the client must wait), then
                 SET_STATE version 1 (new weights); message 2: SET_STATE version 1 again;
                 message 3: the connection is closed instead of a reply
  connection 2   the client reconnects with PING; SET_CONFIG now asks for a quarter of
                 the env steps; message 4; then the checker stops listening

(a client whose PING asks for server-side inference gets ACTIONS for its ACTs instead:
one per step of its K envs, one reply held, a new version, the last ACT refused, then a
reconnect and 10 ACTs; the client of a multi-agent env, ``--env pz:NAME``, is checked with
server-side inference only, its ACTs in the form of §11.3) and checks every frame on the way: framing, the handshake's order,
every field's type and shape (shmrl's own validation, ``rllink.validate`` and ``hub.check_episodes``: what shmrl's
server would refuse), the message sizes SET_CONFIG asks for, chunk continuity (a running
episode continues from its last observation; obs = actions + 1), output 0 and log-probs
recomputed from the models it sent (so a client still sampling with version 0 is caught),
each chunk's weights_seq_no, heartbeats when binary was agreed, no request while a reply
is held, and the ACT rules (K fixed, a step's outcome in every ACT but a connection's
first, observations that fit the env). The client's reply timeout must outlast the held
reply (``--hold-s``). Each violation is printed with the section of RLLINK.md it breaks.
With --algo sac the checker plays a SAC learner (RLLINK.md §4.2): SET_CONFIG's action_dist,
version 0 served as the warm-up's "uniform" and version 1 as the squashed Gaussian; the
actions must lie within the bounds, their log-probabilities be those of the distribution
said, and a client that runs the policy itself must list both in its PING's action_dists.
A run in which no episode ended fails too (episode ends went unchecked); by default
--steps is long enough for the env's time limit. --env names the env as shmrl.run does:
a built-in id, gym:ID (any gymnasium env), pz:NAME or package.module:make_env.

    python -m shmrl.conformance --env CartPole-v1 -- node clients/js/cartpole.js --port {port}
    python -m shmrl.conformance --env gym:Acrobot-v1 --no-reconnect -- python -m shmrl.sim \
        --env gym:Acrobot-v1 --connect 127.0.0.1:{port}
    python -m shmrl.conformance -- python -m shmrl.sim --connect 127.0.0.1:{port}   # exits when closed:
        --no-reconnect
    python -m shmrl.conformance --env Pendulum-v1 --algo sac -- node clients/js/pendulum.js --port {port}

Exit status: 0 when the client broke no rule, 1 when it broke any, 2 for a bad command line.
"""
from __future__ import annotations

import sys

from shmrl.checker.session import check_client


def main(argv=None) -> int:
    from shmrl.config.faces import ConformanceSettings
    from shmrl.config.flags import face_parser, parse_settings

    argv = sys.argv[1:] if argv is None else argv
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    p = face_parser(ConformanceSettings, "python -m shmrl.conformance", __doc__,
                    usage="%(prog)s [--env ID] [--algo ppo|sac] [--no-reconnect] [--steps N] [--hold-s S] "
                          "[--timeout S] -- COMMAND ...")
    args = parse_settings(p, ConformanceSettings, argv[:argv.index("--")] if "--" in argv else argv)
    if not command or not any("{port}" in part for part in command):
        p.error("give the client's command after --, with {port} where the checker's port goes")
    try:
        violations = check_client(command, args.env, args.reconnect, args.steps, args.timeout, args.hold_s,
                                  algo=args.algo)
    except (ValueError, OSError) as e:
        p.error(str(e))
    print(f"{len(violations)} violation(s)" if violations else "the client conforms: no violation", flush=True)
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
