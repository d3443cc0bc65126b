"""The simulator: environments + ONNX policy + an RLlink client over any transport.

It is written only against the client side of a transport (``request``, ``send``,
``close``), so the same loop runs over shared memory, TCP or in-process queues.
Simulator processes never import torch: they need numpy and onnxruntime only, like an
external client in a game engine would.

    python -m shmrl.sim --connect localhost:5556   # an RLlink server (shmrl's: binary codec; RLlib's: JSON)
    python -m shmrl.sim --attach shmrl_1234_s0c0   # a slot of a running learner's shared memory
    python -m shmrl.sim --connect localhost:5556 --server-inference   # the server runs the policy: no onnxruntime

Exit status: 0 when the server ends the session (it closes the connection between
replies, as a learner does when its run ends); 1 when no connection could be made, or one
was lost mid-reply, --max-retries times in a row (--retry-s apart), when
the server refuses the auth token (it closes the connection in reply to PING), or when it
breaks the protocol; 2 for a bad command line (one line ``error: ...``), including an env
whose spaces do not fit the server's policy; 10-12 when the env or the policy gives what
cannot be trained on (NaN, every action masked); 130 after Ctrl-C.
"""
from __future__ import annotations

import logging
import sys
import time

from shmrl import rllink
from shmrl.client.actor import SimulatorError, TokenRefused
from shmrl.envs.make import env_spec
from shmrl.client.simulator import SessionEnded, run_server_inference, run_simulator

__all__ = ["main", "run_simulator"]   # run_simulator: a compatibility path (docs/EXTERNAL.md)

log = logging.getLogger("shmrl.sim")


def main(argv=None) -> int:
    from shmrl.config.faces import SimSettings
    from shmrl.config.flags import face_parser, parse_settings

    p = face_parser(SimSettings, "python -m shmrl.sim", __doc__)
    args = parse_settings(p, SimSettings, argv)
    try:
        env_spec(args.env)
    except ValueError as e:
        p.error(str(e))
    if args.connect:
        from shmrl.transport.tcp_client import parse_address

        try:
            parse_address(args.connect)
        except ValueError as e:
            p.error(f"--connect: {e}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    address = f"tcp:{args.connect}" if args.connect else f"shm:{args.attach}"
    failures, ended = 0, False
    while True:
        status, error = session(address, args, after_a_session=ended)
        if status == SESSION_ENDED:
            # The server closed the connection between replies: its run ended, or (a server
            # restarted, a conformance checker) it wants us back. One immediate attempt tells.
            ended, failures = True, 0
            continue
        ended = False
        if status is not None:
            return status
        failures += 1
        if failures > args.max_retries:
            print(f"error: {error} (gave up after {failures} failed attempts in a row; --max-retries "
                  f"{args.max_retries})", file=sys.stderr)
            return 1
        log.warning("%s; trying again in %g s (%d of %d)", error, args.retry_s, failures, args.max_retries)
        try:
            time.sleep(args.retry_s)
        except KeyboardInterrupt:
            return 130


SESSION_ENDED = -1   # session()'s status when the server closed the connection between replies


def session(address: str, args, after_a_session: bool = False) -> tuple[int | None, str | None]:
    """One connection's life: (the exit status, None) when the command is done,
    (SESSION_ENDED, None) when the server ended the session, or (None, why) for a failure
    worth another attempt (no connection, or one lost mid-reply). ``after_a_session``: the
    attempt right after the server ended a session, where no connection (or one closed at
    its PING, by a server shutting down) means the server is done, and so is this client."""
    from shmrl.transport import connect

    try:
        client = connect(address, timeout=args.timeout, codec=args.codec, name=args.name)
    except (OSError, ValueError) as e:
        if after_a_session:   # the server that ended the session is gone: done
            log.info("%s: the server ended the session; done", address)
            return 0, None
        return None, f"cannot connect to {address}: {e}"
    try:
        loop = run_server_inference if args.server_inference else run_simulator
        loop(client, args.env, args.seed, args.envs_per_sim, log_every_s=10.0, auth_token=args.auth_token,
             declare=args.declare)
        return 0, None
    except SessionEnded as e:
        log.info("%s: %s", address, e)
        return SESSION_ENDED, None
    except KeyboardInterrupt:
        return 130, None
    except SimulatorError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code, None
    except TokenRefused as e:
        if after_a_session:   # it accepted the token before: a server shutting down
            log.info("%s: the server ended the session; done", address)
            return 0, None
        print(f"error: {address}: {e}", file=sys.stderr)
        return 1, None
    except rllink.ProtocolError as e:   # another attempt would end the same way
        print(f"error: {address}: {e}", file=sys.stderr)
        return 1, None
    except (ConnectionError, TimeoutError) as e:
        return None, f"{address}: {e}"
    except ValueError as e:  # the server's policy does not fit --env
        print(f"error: {address}: {e}", file=sys.stderr)
        return 2, None
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
