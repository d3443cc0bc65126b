"""Plug a transport of your own into the learner, next to the TCP adapter.

A server transport is any object with ``fileno()``, ``poll(timeout)``, ``reply(conn_id,
msg)``, ``drop(conn_id, reason)`` and ``close()``; the Hub treats every transport alike.
Here simulators run as threads of this process behind the in-process transport (write
your own the same way: a message bus, a game engine's IPC), while external RLlink
clients may attach over TCP at the same time:

    python examples/custom_transport.py --updates 20 --tcp-port 5556
"""
import argparse
import threading

import torch

from shmrl.envs import env_spec
from shmrl.net import PolicyNet
from shmrl.ppo import PPO, PPOConfig
from shmrl.serving import Serving
from shmrl.store import DEFAULT_POLICY
from shmrl.sim import run_simulator
from shmrl.trainer import update
from shmrl.transport.inproc import InProcServer
from shmrl.transport.tcp import TcpServer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--updates", type=int, default=20)
    p.add_argument("--tcp-port", type=int, default=0, help="0: any free port")
    args = p.parse_args()
    torch.set_num_threads(1)

    spec = env_spec("CartPole-v1")
    inproc, tcp = InProcServer(), TcpServer("127.0.0.1", args.tcp_port)
    print(f"RLlink clients may attach to {tcp.address[0]}:{tcp.address[1]}")
    ppo = PPO(PolicyNet(spec, hidden=64), PPOConfig())
    learner = Serving([inproc, tcp], {DEFAULT_POLICY: spec}, {DEFAULT_POLICY: ppo.net.template}, {DEFAULT_POLICY: ppo.published_weights()},
                      env_steps_per_sample=256, train_batch_size=512)
    clients = [inproc.connect() for _ in range(2)]

    def simulate(client, seed):
        try:
            run_simulator(client, seed=seed)   # the same loop shmrl.run's processes run
        except ConnectionError:
            pass                               # the learner closed the connection

    threads = [threading.Thread(target=simulate, args=(c, i), daemon=True) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    learner.start()
    try:
        while learner.updates < args.updates:
            batch = learner.next_batch(timeout=1.0)
            if batch:
                update(learner, {DEFAULT_POLICY: ppo}, *batch)   # the trainer's update: PPO, then publish
                print(f"update {learner.updates}: return {learner.store.return_mean():.1f}, "
                      f"{learner.store.steps_received} env steps", flush=True)
    finally:
        learner.stop()
        inproc.close()             # every simulator's next request fails: its thread ends
        for t in threads:
            t.join(10)
        tcp.close()


if __name__ == "__main__":
    main()
