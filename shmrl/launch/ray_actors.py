"""Simulators as Ray actors across a cluster (``python -m shmrl.run --ray ADDRESS``).

The learner runs in this process; ``RayLauncher`` has ``ForkLauncher``'s interface, so the
Supervisor's restart policy and accounting apply unchanged. Each simulator is an actor,
spread over the nodes (``SPREAD``, ``num_cpus=sim_cpus``), whose ``run`` method is the
simulator loop: on the learner's own node it attaches to its shared-memory slot, on any
other it connects back over TCP (binary codec, HEARTBEATs, the run's auth token).

Ray restarts an actor whose process or node dies (``max_restarts=-1``: the Supervisor's
budget decides when to give up, not Ray's); the Supervisor sees its ``run`` call fail,
counts the steps lost, resets its slot, and calls ``run`` again, which Ray delivers once
the actor is back (on a node that is alive). A hung actor is killed with ``ray.kill``
and so restarted the same way.

Ray is imported only here, and only when a run asks for it: without Ray installed
nothing else changes.
"""
from __future__ import annotations

import logging
import os
import socket

from shmrl.config.settings import ConfigError

log = logging.getLogger("shmrl.ray")


def import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError("--ray needs Ray: pip install -e '.[ray]' in shmrl's clone") from None
    return ray


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """ConnectionError unless something listens at ``address`` (HOST:PORT; "auto", "local" and
    ray:// addresses are Ray's to resolve)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise ConnectionError(f"nothing answers at {address} ({e.strerror or e})") from None


class SimActor:
    """One simulator slot on some node (made a Ray actor by ``RayLauncher``)."""

    def where(self) -> dict:
        """Where this actor runs: its node and process (answered while ``run`` runs)."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                "address": getattr(self, "address", None)}

    def run(self, shm_address: str | None, tcp_address: str, learner_node: str, env: str, seed: int,
            envs_per_sim: int, name: str, auth_token: str | None) -> str:
        """The simulator loop until the learner ends the session; returns why it ended."""
        import ray

        from shmrl.client.simulator import run_simulator, set_process_name
        from shmrl.transport import connect

        set_process_name(name)
        local = shm_address is not None and ray.get_runtime_context().get_node_id() == learner_node
        self.address = shm_address if local else tcp_address
        client = connect(self.address, name=name)
        try:
            run_simulator(client, env, seed, envs_per_sim, auth_token=auth_token)
        except ConnectionError as e:
            return f"its connection ended: {e}"
        finally:
            client.close()
        return "the learner ended its session"


class _RayProc:
    """One actor and its current ``run`` call: what the Supervisor keeps as ``sim.proc``."""

    def __init__(self, actor, name: str, args: tuple):
        self.actor, self.name, self.args, self.pid = actor, name, args, None
        self.ready = None  # a restarted actor: where() retried until Ray has it back
        self.ref = None    # the run() call


class RayLauncher:
    """Places simulators as Ray actors; see the module's docstring."""

    remote = True  # its actors may be on other machines: TCP there, shared memory here

    def __init__(self, address: str, *, sim_cpus: float = 1.0, init_kwargs: dict | None = None):
        self.ray = ray = import_ray()
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            check_reachable(address)   # ray.init retries an address where nothing listens for minutes
            ray.init(address=address, include_dashboard=False, log_to_driver=False,
                     **(init_kwargs or {}))
        most = max((node["Resources"].get("CPU", 0.0) for node in ray.nodes() if node["Alive"]), default=0.0)
        if sim_cpus > most:   # such an actor could never be placed: its simulator would "hang" forever
            if self.owns_ray:
                ray.shutdown()
            raise ConfigError(f"--sim-cpus {sim_cpus:g}: no node of the Ray cluster at {address} has that many "
                              f"CPUs (the most one has: {most:g}); each simulator actor reserves --sim-cpus")
        self.node_id = ray.get_runtime_context().get_node_id()
        self.node_ip = ray.util.get_node_ip_address()
        self.tcp_address: str | None = None  # set by the run once its TCP server listens
        self.sim_cpus = sim_cpus
        self._actor_class = ray.remote(SimActor).options(
            num_cpus=sim_cpus, max_restarts=-1, max_task_retries=0, max_concurrency=2,
            scheduling_strategy="SPREAD")
        self._actors: dict[str, object] = {}  # by simulator name: reused across restarts

    def start(self, sim, args: tuple) -> _RayProc:
        address, env, seed, envs_per_sim, name, auth_token, _nice = args
        if self.tcp_address is None:
            raise RuntimeError("RayLauncher.tcp_address must be set before simulators start")
        shm_address = address if address.startswith("shm:") else None
        run_args = (shm_address, self.tcp_address, self.node_id, env, seed, envs_per_sim, name, auth_token)
        actor = self._actors.get(name)
        if actor is None:
            actor = self._actors[name] = self._actor_class.remote()
        # run() goes once the actor answers where(): until then Ray is still making its
        # process (a worker's start took 15-30 s on a loaded 2-core node), which is Ray's
        # start, not the simulator's, and not timed by the startup grace. A restarted actor
        # (on a node that is alive) would fail a call made now as "unavailable": this one
        # is retried until it is back.
        proc = _RayProc(actor, name, run_args)
        proc.ready = actor.where.options(max_task_retries=-1).remote()
        return proc

    def exit_reason(self, proc: _RayProc) -> str | None:
        if proc.ref is None:  # waiting for Ray to bring the actor back
            done, _ = self.ray.wait([proc.ready], timeout=0)
            if not done:
                return None
            try:
                self.ray.get(proc.ready)
            except Exception as e:  # it will not come back (its restarts ran out, or Ray is going)
                return f"could not be started by Ray ({_first_line(e)})"
            proc.ref = proc.actor.run.remote(*proc.args)
            return None
        done, _ = self.ray.wait([proc.ref], timeout=0)
        if not done:
            return None
        try:
            return f"ended: {self.ray.get(proc.ref)}"
        except self.ray.exceptions.RayActorError as e:
            return f"died with its Ray actor ({_first_line(e)})"
        except Exception as e:  # the simulator raised: its env, or a policy that does not fit
            return f"failed: {_first_line(e)}"

    def starting(self, proc: _RayProc) -> bool:
        """Ray is still making or bringing back the actor's process (seconds on a busy node)."""
        return proc.ref is None

    def describe(self, proc: _RayProc) -> str:
        return f"simulator {proc.name} (Ray actor)"

    def kill(self, proc: _RayProc) -> None:
        """A hung actor: Ray kills its process and restarts it; a finished one is left be."""
        if proc.ref is not None and self.exit_reason(proc) is None:
            self.ray.kill(proc.actor, no_restart=False)

    def stop(self, procs: list, timeout: float) -> None:
        for actor in self._actors.values():
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception as e:  # the cluster may be gone already
                log.warning("could not kill a simulator actor: %s", e)
        self._actors.clear()  # Ray itself is shut down by whoever started it (shmrl.run.train)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]
