"""Plug a transport of your own into the learner, next to the TCP adapter.

A server transport is any object with the methods of ``shmrl.transport.ServerTransport``
(``fileno()``, ``poll(timeout)``, ``reply(conn_id, msg)``, ``drop(conn_id, reason)``,
``timed_out(conn_id)``, ``close()`` and the counters ``frames_rejected`` and
``clients_timed_out``; shmrl/transport/base.py has each one's contract); the Hub treats
every transport alike.
Here simulators run as threads of this process behind the in-process transport (write
your own the same way: a message bus, a game engine's IPC), while external RLlink
clients may attach over TCP at the same time; shmrl's own training loop trains on both:

    python examples/custom_transport.py --updates 20 --tcp-port 5556
"""
import argparse
import math
import tempfile
import threading

import shmrl
from shmrl.sim import run_simulator
from shmrl.trainer.loop import train_with_servers
from shmrl.transport.inproc import InProcServer
from shmrl.transport.tcp import TcpServer

BATCH = 512


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--updates", type=int, default=20)
    p.add_argument("--tcp-port", type=int, default=0, help="0: any free port")
    p.add_argument("--logdir", default=None, help="metrics.jsonl, summary.json, policy.onnx (default: a temporary folder)")
    args = p.parse_args()

    inproc, tcp = InProcServer(), TcpServer("127.0.0.1", args.tcp_port)
    print(f"RLlink clients may attach to {tcp.address[0]}:{tcp.address[1]}")
    clients = [inproc.connect() for _ in range(2)]

    def simulate(client, seed):
        try:
            run_simulator(client, seed=seed)   # the same loop shmrl.run's processes run
        except ConnectionError:
            pass                               # the learner closed the connection

    threads = [threading.Thread(target=simulate, args=(c, i), daemon=True) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    with tempfile.TemporaryDirectory() as tmp:
        # One step past the last batch: the loop trains --updates batches, then stops at the budget.
        config = shmrl.Config(env="CartPole-v1", sims=0, train_batch_size=BATCH, env_steps_per_sample=BATCH // 2,
                              max_env_steps=args.updates * BATCH + 1, stop_return=math.inf, torch_threads=1,
                              tensorboard=False, logdir=args.logdir or tmp, log_every=0)
        _, summary = train_with_servers(config, [inproc, tcp])   # closes both servers when done
    for t in threads:
        t.join(10)   # each simulator's next request failed: its thread has ended
    print(f"update {summary['updates']}: return {summary['return_mean']:.1f}, {summary['env_steps']} env steps")


if __name__ == "__main__":
    main()
