#!/usr/bin/env python3
"""Prove that shmrl and Ray RLlib 2.48 speak the same RLlink bytes (JSON variant), both ways.

    python tools/rllib_compat.py client   --port 5600   # shmrl learner  <- RLlib's own _dummy_client
    python tools/rllib_compat.py server   --port 5600   # RLlib's PPO TCP server <- shmrl.sim --connect
    python tools/rllib_compat.py baseline --port 5600   # RLlib's PPO TCP server <- RLlib's _dummy_client
    python tools/rllib_compat.py server --port 5600 --json --capture /tmp/cap   # also record the bytes
    python tools/rllib_compat.py client --port 5600 --quick --json   # seconds: to a mean return of 100
    python tools/rllib_compat.py --setup                              # only create the venv (.ci/run does)

Every subcommand trains CartPole-v1 until a mean return of the last 100 episodes of
--stop-return (default 450), prints one table line (or, with --json, one JSON object) with
the time and the env steps it took, and exits 0 when solved, 1 when not, 2 on a setup error.
``--quick`` checks that the path works with low targets (flags given still win): ``client``
to a mean return of 100 within 100,000 env steps (shmrl.run --max-env-steps); ``server``
and ``baseline`` to 30 within 5 iterations (RLlib's own start-up takes most of their time).

``--port P`` is always the TCP port that the client connects to. RLlib's
``TcpClientInferenceEnvRunner`` binds ``localhost:(env_config["port"] + worker_index)``
and the example config has one remote env runner (worker index 1), so RLlib is given
``env_config={"port": P - 1}``; its local env runner (worker 0) also listens, unused, on P - 1.

RLlib's side runs in its own virtualenv (``--venv``, created on first use with
``ray[rllib]==2.48.0 torch==2.13.0 gymnasium onnxruntime onnx``) by running this very file
with the venv's python and a hidden subcommand (``_rllib-server``, ``_rllib-client``);
the top level of this file imports the standard library only, so both interpreters can
load it. shmrl's side runs with the interpreter that runs this script, from the repo root.

The RLlib server configuration is the one of RLlib 2.48's example
``rllib/examples/envs/env_connecting_to_rllib_w_tcp_client.py`` (PPO, one
``TcpClientInferenceEnvRunner``, num_epochs=10, vf_loss_coeff=0.01, shared value layers;
everything else PPO's defaults: train batch 4000, hence env_steps_per_sample 4000,
minibatch 128, lr 5e-5, lambda 1.0, KL loss), driven with ``algo.train()`` in a loop as
the example's ``--no-tune`` mode does. The only change to RLlib is the ONNX exporter,
see ``_legacy_onnx_export``.

Every child starts in its own session; at the end (success, failure, timeout or Ctrl-C)
each session is sent SIGTERM, then SIGKILL, together with every descendant still alive
(Ray starts raylet, GCS and worker processes under the driver).
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/rllib_compat.py`: run as tools.rllib_compat
    import run_as_module
    run_as_module.run(__file__)

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tools import shared
from tools.shared import REPO, SetupError, quick_asked, read_logdir

MARK = "RLLIB_COMPAT "          # prefix of the machine-readable lines of the ray-side driver
CAPTURE_PORT_OFFSET = 100       # with --capture, the server listens on P + 100 behind a proxy on P
QUICK = {"client": {"stop_return": 100.0, "timeout": 180.0},
         "server": {"stop_return": 30.0, "max_iters": 5, "max_env_steps": 20_000, "timeout": 300.0},
         "baseline": {"stop_return": 30.0, "max_iters": 5, "max_env_steps": 20_000, "timeout": 300.0}}
QUICK_CLIENT_EXTRA = ["--max-env-steps", "100000"]   # for shmrl.run: a quick client run always ends


# --------------------------------------------------------------------------- processes
# psutil is imported where it is used: this file also runs in the RLlib virtualenv, which lacks it.

def _family(leaders: list[int]) -> list:
    """Every live process (psutil.Process) in the sessions of ``leaders`` or descended from
    them: Ray's raylet, GCS and workers move to sessions of their own."""
    import psutil

    roots = []
    for proc in psutil.process_iter():
        try:
            if proc.pid in leaders or os.getsid(proc.pid) in leaders:
                roots.append(proc)
        except (ProcessLookupError, PermissionError):
            continue
    family = {}
    for proc in roots:
        family[proc.pid] = proc
        try:
            family.update((child.pid, child) for child in proc.children(recursive=True))
        except psutil.NoSuchProcess:
            continue
    family.pop(os.getpid(), None)
    return list(family.values())


def _busy_cpu_s() -> float:
    """CPU seconds spent busy on the whole machine (all cores) since boot."""
    import psutil

    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + t.steal


class Children:
    """Starts children in their own sessions, samples their summed RSS and CPU time (and the
    CPU time of everything else on the machine: this machine is shared and noisy), kills them all."""

    def __init__(self, logdir: Path):
        self.logdir = logdir
        self.procs: dict[str, subprocess.Popen] = {}
        self.peak_rss_mb = 0.0
        self._cpu_s: dict[int, float] = {}  # pid -> CPU seconds last seen (approximate: sampled each second)
        self._busy0, self._t0 = _busy_cpu_s(), time.monotonic()
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample_rss, daemon=True)
        self._sampler.start()

    def start(self, name: str, cmd: list[str], cwd: Path, pipe: bool = False) -> subprocess.Popen:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        out = subprocess.PIPE if pipe else open(self.logdir / f"{name}.log", "wb")
        p = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                             stderr=subprocess.STDOUT, start_new_session=True)
        if not pipe:
            out.close()
        self.procs[name] = p
        return p

    def log_tail(self, name: str, lines: int = 25) -> str:
        path = self.logdir / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def _sample_rss(self):
        import psutil

        while not self._stop.wait(1.0):
            total = 0
            for proc in _family([p.pid for p in self.procs.values()]):
                try:
                    with proc.oneshot():
                        total += proc.memory_info().rss
                        cpu = proc.cpu_times()
                    self._cpu_s[proc.pid] = cpu.user + cpu.system
                except psutil.Error:
                    continue
            self.peak_rss_mb = max(self.peak_rss_mb, total / 2**20)

    def cpu_report(self) -> dict:
        """CPU seconds used by our processes and by everything else since the start."""
        ours = sum(self._cpu_s.values())
        busy = _busy_cpu_s() - self._busy0
        span = time.monotonic() - self._t0
        return {"own_cpu_s": round(ours, 1), "other_cpu_s": round(max(0.0, busy - ours), 1),
                "span_s": round(span, 1), "cores": os.cpu_count(), "loadavg_end": os.getloadavg()[0]}

    def stop_all(self, grace: float = 5.0) -> list[int]:
        """SIGTERM every session, then SIGKILL whatever is left; returns pids that survived."""
        import psutil

        self._stop.set()
        leaders = [p.pid for p in self.procs.values()]
        family = _family(leaders)
        for p in self.procs.values():
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        for proc in family:  # descendants that moved to a session of their own
            try:
                proc.terminate()
            except psutil.Error:
                pass
        self._reap(grace, family)
        family = {proc.pid: proc for proc in [*family, *_family(leaders)]}
        for proc in family.values():
            try:
                proc.kill()
            except psutil.Error:
                pass
        self._reap(2.0, family.values())
        return sorted(pid for pid, proc in family.items() if _running(proc))

    def _reap(self, timeout: float, family) -> None:
        """Wait up to ``timeout`` s for our children (through Popen, which keeps their exit
        codes) and for the rest of ``family`` to end."""
        import psutil

        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        ours = {p.pid for p in self.procs.values()}
        psutil.wait_procs([proc for proc in family if proc.pid not in ours],
                          timeout=max(0.0, deadline - time.monotonic()))


def _running(proc) -> bool:
    """Alive and not a zombie (a zombie is gone for our purpose)."""
    import psutil

    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def is_listening(port: int) -> bool:
    """Whether anything listens on TCP ``port``, read from /proc/net (never connects: RLlib's
    server accepts exactly one client, and a probe would use it up). Not psutil: RLlib's
    client, in its own virtualenv, waits with this too."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 3 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                return True
    return False


def wait_listening(port: int, timeout: float, alive=lambda: True) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if is_listening(port):
            return True
        if not alive():
            return False
        time.sleep(0.05)
    return False


# --------------------------------------------------------------------------- byte capture

class CaptureProxy:
    """A TCP proxy that records every RLlink frame in both directions (frames.jsonl: one line
    per frame with its header, length, type and keys, and its first bytes) and the first
    bytes of each direction raw (c2s.bin, s2c.bin). Used with --capture, to show exactly
    what one side sent when the other side rejects it."""

    RAW_LIMIT = 1 << 20
    PREVIEW = 400

    def __init__(self, listen_port: int, target_port: int, outdir: Path):
        self.target_port, self.outdir = target_port, outdir
        outdir.mkdir(parents=True, exist_ok=True)
        self.frames = open(outdir / "frames.jsonl", "w")
        self.lock = threading.Lock()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", listen_port))
        self.sock.listen(8)
        self.t0 = time.time()
        self.n_conn = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            self.n_conn += 1
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError as e:
                self._record({"conn": self.n_conn, "event": f"upstream connect failed: {e}"})
                client.close()
                continue
            for src, dst, d in ((client, upstream, "c2s"), (upstream, client, "s2c")):
                threading.Thread(target=self._pump, args=(src, dst, d, self.n_conn), daemon=True).start()

    def _record(self, row: dict):
        with self.lock:
            self.frames.write(json.dumps({"t": round(time.time() - self.t0, 4), **row}) + "\n")
            self.frames.flush()

    def _pump(self, src, dst, direction, conn):
        raw = open(self.outdir / f"{direction}.{conn}.bin", "wb")
        raw_left, buf, n_frames = self.RAW_LIMIT, b"", 0
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    self._record({"conn": conn, "dir": direction, "event": "EOF",
                                  "pending_bytes": len(buf), "pending": buf[:self.PREVIEW].decode("latin-1")})
                    break
                dst.sendall(data)
                if raw_left > 0:
                    raw.write(data[:raw_left])
                    raw_left -= len(data[:raw_left])
                buf += data
                while len(buf) >= 8:
                    header = buf[:8]
                    if not header.isdigit():
                        self._record({"conn": conn, "dir": direction, "event": "bad header",
                                      "header": header.decode("latin-1"), "next": buf[:64].decode("latin-1")})
                        buf = b""
                        break
                    n = int(header)
                    if len(buf) < 8 + n:
                        break
                    body, buf = buf[8:8 + n], buf[8 + n:]
                    n_frames += 1
                    row = {"conn": conn, "dir": direction, "frame": n_frames, "header": header.decode(),
                           "body_len": n, "preview": body[:self.PREVIEW].decode("utf-8", "replace")}
                    try:
                        msg = json.loads(body)
                        row["type"] = msg.get("type")
                        row["keys"] = sorted(msg)
                        if isinstance(msg.get("episodes"), list) and msg["episodes"]:
                            ep = msg["episodes"][0]
                            row["episode0"] = {k: (f"list[{len(v)}]" if isinstance(v, list) else v)
                                               for k, v in ep.items()} if isinstance(ep, dict) else repr(ep)[:200]
                            row["n_episodes"] = len(msg["episodes"])
                    except ValueError as e:
                        row["json_error"] = str(e)
                    self._record(row)
        except OSError as e:
            self._record({"conn": conn, "dir": direction, "event": f"socket error: {e}"})
        finally:
            raw.close()
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.sock.close()


# --------------------------------------------------------------------------- ray side (venv)

def _legacy_onnx_export():
    """Make ``torch.onnx.export`` default to torch's legacy (TorchScript) exporter.

    RLlib 2.48's TcpClientInferenceEnvRunner calls ``torch.onnx.export`` on every SET_STATE.
    In torch 2.13 that call defaults to the dynamo exporter, which fails on RLlib's module or
    takes about 0.75 s per export; RLlib 2.48 was written against the legacy exporter (which
    also names the input ``onnx::Gemm_0``, the name RLlib's own client feeds). So we pass
    ``dynamo=False`` unless the caller chose. This is the only change made to RLlib, and it
    is needed on the server side only. It runs in the driver and, through Ray's
    ``worker_process_setup_hook``, in every Ray worker process (the env runner is an actor).
    """
    import functools

    import torch

    original = torch.onnx.export
    if getattr(original, "_rllib_compat_legacy", False):
        return

    @functools.wraps(original)
    def export(*args, **kwargs):
        kwargs.setdefault("dynamo", False)
        return original(*args, **kwargs)

    export._rllib_compat_legacy = True
    torch.onnx.export = export


def _emit(kind: str, obj: dict):
    print(MARK + json.dumps({"kind": kind, **obj}), flush=True)


def rllib_server_main(a) -> int:
    """RLlib 2.48's own TCP server: the PPO config of RLlib's example
    env_connecting_to_rllib_w_tcp_client.py, trained with algo.train() until
    env_runners/episode_return_mean >= stop_return."""
    t_proc = time.time()
    import gymnasium as gym
    import numpy as np
    import ray
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig
    from ray.rllib.env.tcp_client_inference_env_runner import TcpClientInferenceEnvRunner

    _legacy_onnx_export()
    ray.init(ignore_reinit_error=True, runtime_env={"worker_process_setup_hook": _legacy_onnx_export})
    base_port = a.port - 1  # the one remote env runner has worker_index 1 and binds base + 1
    config = (
        PPOConfig()
        .environment(
            observation_space=gym.spaces.Box(-1.0, 1.0, (4,), np.float32),
            action_space=gym.spaces.Discrete(2),
            env_config={"port": base_port},
        )
        .env_runners(env_runner_cls=TcpClientInferenceEnvRunner, num_env_runners=1)
        .training(num_epochs=10, vf_loss_coeff=0.01)
        .rl_module(model_config=DefaultModelConfig(vf_share_layers=True))
        .learners(num_gpus_per_learner=0)
    )
    if a.seed is not None:
        config.debugging(seed=a.seed)
    described = {
        "algo": "PPO", "env_runner_cls": "TcpClientInferenceEnvRunner", "num_env_runners": 1,
        "env_config": {"port": base_port}, "client_port": a.port,
        "train_batch_size_per_learner": config.train_batch_size_per_learner,
        "rollout_fragment_length": config.rollout_fragment_length,
        "env_steps_per_sample": config.get_rollout_fragment_length(worker_index=1),
        "minibatch_size": config.minibatch_size, "num_epochs": config.num_epochs, "lr": config.lr,
        "gamma": config.gamma, "lambda": config.lambda_, "clip_param": config.clip_param,
        "use_kl_loss": config.use_kl_loss, "kl_coeff": config.kl_coeff,
        "vf_loss_coeff": config.vf_loss_coeff, "entropy_coeff": config.entropy_coeff,
        "vf_share_layers": True, "fcnet_hiddens": list(DefaultModelConfig().fcnet_hiddens),
        "fcnet_activation": DefaultModelConfig().fcnet_activation,
        "metrics_num_episodes_for_smoothing": config.metrics_num_episodes_for_smoothing,
        "torch_onnx_export": "dynamo=False (legacy exporter, patched)", "seed": a.seed,
    }
    _emit("config", {"config": described})
    algo = config.build()
    _emit("ready", {"startup_s": time.time() - t_proc})
    solved, result, it, stalled, last_steps = False, {}, 0, 0, 0
    t_train0 = time.time()
    while it < a.max_iters:
        result = algo.train()
        it += 1
        er = result.get("env_runners", {})
        ret = er.get("episode_return_mean", float("nan"))
        steps = er.get("num_env_steps_sampled_lifetime", result.get("num_env_steps_sampled_lifetime", 0))
        row = {"iter": it, "return_mean": ret, "env_steps": steps,
               "episodes": er.get("num_episodes_lifetime"),
               "time_total_s": result.get("time_total_s"), "time_this_iter_s": result.get("time_this_iter_s"),
               "wall_s": time.time() - t_proc}
        _emit("iter", row)
        if ret == ret and ret >= a.stop_return:
            solved = True
            break
        if steps >= a.max_env_steps:
            break
        # RLlib's listener thread dies for good on anything but a ConnectionError (a bad
        # episode, a failed ONNX export), after which every iteration returns nothing after
        # its 60 s sample timeout: give up instead of waiting for the outer timeout.
        stalled = stalled + 1 if steps == last_steps else 0
        last_steps = steps
        if stalled >= a.stall_iters:
            _emit("stalled", {"iterations_without_steps": stalled})
            break
    _emit("result", {"solved": solved, "iterations": it, "config": described,
                     "return_mean": result.get("env_runners", {}).get("episode_return_mean"),
                     "env_steps": row["env_steps"] if it else 0,
                     "train_s": result.get("time_total_s"), "train_wall_s": time.time() - t_train0,
                     "wall_s": time.time() - t_proc})
    try:
        algo.stop()
    finally:
        ray.shutdown()
    return 0 if solved else 1


def rllib_client_main(a) -> int:
    """RLlib 2.48's own JSON client, unmodified: ``_dummy_client(port)``.

    Imports first, then waits until the port listens (read from /proc, so the server's
    single accept is not used up), so that the client does not lose 5 s in its retry loop.
    The client writes ``_temp_onnx`` into its working directory: run it in a scratch one.
    """
    from ray.rllib.env.tcp_client_inference_env_runner import _dummy_client

    if not wait_listening(a.port, a.wait):
        print(f"nothing listens on port {a.port} after {a.wait} s", flush=True)
        return 2
    print(f"port {a.port} listens; starting RLlib's _dummy_client", flush=True)
    _dummy_client(port=a.port)
    return 0


# --------------------------------------------------------------------------- our side

def run_client(a, kids: Children, work: Path) -> dict:
    """shmrl's learner (TCP, no local simulators) <- RLlib's own _dummy_client."""
    py = shared.RLLIB.ensure(a.venv)
    port = a.port
    server_port = port + CAPTURE_PORT_OFFSET if a.capture else port
    for p in {port, server_port}:
        if is_listening(p):
            raise SetupError(f"port {p} is already in use")
    logdir = Path(a.logdir) if a.logdir else work / "shmrl-run"
    cmd = [sys.executable, "-m", "shmrl.run", "--env", "CartPole-v1", "--sims", "0", "--tcp-port", str(server_port),
           "--stop-return", str(a.stop_return), "--logdir", str(logdir), *a.extra]
    t0 = time.time()
    learner = kids.start("shmrl-run", cmd, REPO)
    proxy = None
    if a.capture:
        if not wait_listening(server_port, a.timeout, lambda: learner.poll() is None):
            raise SetupError("shmrl.run did not listen:\n" + kids.log_tail("shmrl-run"))
        proxy = CaptureProxy(port, server_port, Path(a.capture))
    client_dir = work / "client-cwd"
    client_dir.mkdir()
    client = kids.start("rllib-client", [str(py), str(Path(__file__).resolve()), "_rllib-client",
                                         "--port", str(port), "--wait", str(a.timeout)], client_dir)
    failure, deadline = None, t0 + a.timeout
    while learner.poll() is None:
        if time.time() > deadline:
            failure = f"timeout after {a.timeout} s"
            break
        if client.poll() is not None:
            failure = f"RLlib's _dummy_client exited with code {client.returncode} while shmrl was running"
            # give the learner a moment to log why it closed the connection
            time.sleep(1.0)
            break
        time.sleep(0.2)
    wall = time.time() - t0
    rc = learner.poll()
    if proxy:
        proxy.close()
    summary, _ = read_logdir(logdir)
    if failure is None and rc != 0:
        failure = f"shmrl.run exited with code {rc}"
    out = {"mode": "client", "server": "shmrl.run --sims 0 --tcp-port", "client": "RLlib 2.48 _dummy_client",
           "port": port, "command": cmd, "solved": failure is None and bool(summary.get("solved")),
           "exit_status": rc, "wall_s": wall, "shmrl_wall_s": summary.get("wall_s"),
           "env_steps": summary.get("env_steps"), "env_steps_trained": summary.get("env_steps_trained"),
           "return_mean": summary.get("return_mean"), "episodes": summary.get("episodes"),
           "updates": summary.get("updates"), "env_steps_per_s": summary.get("env_steps_per_s"),
           "logdir": str(logdir)}
    if failure:
        out["failure"] = failure
        out["shmrl_log_tail"] = kids.log_tail("shmrl-run")
        out["client_log_tail"] = kids.log_tail("rllib-client")
    return out


class DriverLog:
    """What RLlib's driver prints, read by a thread: its machine-readable events (MARK lines:
    ready, config, iter, stalled, result), RLlib's first traceback and its connection errors."""

    def __init__(self):
        self.events: dict[str, dict] = {}
        self.iters: list[dict] = []
        self.errors: dict[str, list[str]] = {"traceback": [], "connection_errors": []}
        self.listener_died = threading.Event()

    def read(self, driver: subprocess.Popen, path: Path, t0: float, show_iters: bool) -> None:
        """Copy the driver's output to ``path`` and note what it says (the thread's target)."""
        with open(path, "wb") as log:
            for line in driver.stdout:
                log.write(line)
                log.flush()
                text = line.decode("utf-8", "replace")
                self.note_error(text)
                if not text.startswith(MARK):
                    continue
                ev = json.loads(text[len(MARK):])
                self.events[ev["kind"]] = ev
                if ev["kind"] == "iter":
                    self.iters.append(ev)
                    if show_iters:
                        print(f"  iter {ev['iter']:3d} | steps {ev['env_steps']:8d} | return "
                              f"{ev['return_mean']:7.1f} | train {ev['time_total_s']:7.1f} s | "
                              f"wall {time.time() - t0:7.1f} s", flush=True)

    def note_error(self, text: str) -> None:
        """Keep RLlib's first traceback and its 'Messaging/connection error' lines (what
        RLlib said when it rejected a client's bytes), without Ray's colour codes."""
        clean = re.sub(r"\x1b\[[0-9;]*m", "", text).rstrip()
        if "Messaging/connection error" in clean and len(self.errors["connection_errors"]) < 10:
            self.errors["connection_errors"].append(clean)
        tb = self.errors["traceback"]
        bare = re.sub(r"^\(\S+ pid=\d+\) ", "", clean)  # without Ray's "(Actor pid=N) " prefix
        if "Exception in thread" in bare and "_client_message_listener" in bare and not self.listener_died.is_set():
            tb.clear()  # the traceback that follows is the one that matters
            self.listener_died.set()
        if not tb:
            if bare.startswith("Traceback (most recent call last)"):
                tb.append(clean)
        elif len(tb) < 80 and tb[-1] != "":
            tb.append(clean)
            if bare and not bare[0].isspace() and not bare.startswith(("Traceback", "During handling",
                                                                       "The above exception")):
                tb.append("")  # the exception line ends the traceback

    def listener_dead(self) -> bool:
        """RLlib's TCP listener thread died, and its whole traceback has been read."""
        tb = self.errors["traceback"]
        return self.listener_died.is_set() and bool(tb) and tb[-1] == ""


def run_rllib_server(a, kids: Children, work: Path, client_kind: str) -> dict:
    """RLlib 2.48's PPO TCP server <- shmrl.sim (``server``) or RLlib's _dummy_client (``baseline``)."""
    py = shared.RLLIB.ensure(a.venv)
    port = a.port
    server_port = port + CAPTURE_PORT_OFFSET if a.capture else port
    for p in {port, server_port, server_port - 1}:
        if is_listening(p):
            raise SetupError(f"port {p} is already in use")
    driver_cmd = [str(py), str(Path(__file__).resolve()), "_rllib-server", "--port", str(server_port),
                  "--stop-return", str(a.stop_return), "--max-env-steps", str(a.max_env_steps),
                  "--max-iters", str(a.max_iters)]
    if a.seed is not None:
        driver_cmd += ["--seed", str(a.seed)]
    driver_dir = work / "driver-cwd"
    driver_dir.mkdir()
    t0 = time.time()
    driver = kids.start("rllib-server", driver_cmd, driver_dir, pipe=True)
    log = DriverLog()
    reader = threading.Thread(target=log.read, args=(driver, kids.logdir / "rllib-server.log", t0, not a.json),
                              daemon=True)
    reader.start()
    deadline = t0 + a.timeout
    if client_kind == "shmrl":
        client_cmd = [sys.executable, "-m", "shmrl.sim", "--connect", f"localhost:{port}", *a.extra]
        client_cwd = REPO
        # shmrl.sim is started once RLlib listens (it may not retry connecting).
        if not wait_listening(server_port, a.timeout, lambda: driver.poll() is None):
            reader.join(2.0)
            raise SetupError("RLlib's server never listened on port "
                             f"{server_port}:\n" + kids.log_tail("rllib-server", 40))
    else:
        client_cmd = [str(py), str(Path(__file__).resolve()), "_rllib-client", "--port", str(port),
                      "--wait", str(a.timeout)]
        client_cwd = work / "client-cwd"
        client_cwd.mkdir()
    proxy = None
    if a.capture:
        wait_listening(server_port, a.timeout, lambda: driver.poll() is None)
        proxy = CaptureProxy(port, server_port, Path(a.capture))
    t_client = time.time()
    client = kids.start("client", client_cmd, client_cwd)
    failure = None
    while "result" not in log.events:
        if driver.poll() is not None:
            reader.join(5.0)
            if "result" not in log.events:
                failure = f"RLlib's driver exited with code {driver.returncode}"
            break
        if time.time() > deadline:
            failure = f"timeout after {a.timeout} s"
            break
        if client.poll() is not None:
            failure = f"the client ({client_kind}) exited with code {client.returncode} while RLlib was training"
            break
        if log.listener_dead():
            # RLlib's listener thread is dead for good: that port never answers again.
            failure = f"RLlib's TCP listener thread died: {log.errors['traceback'][-2]}"
            break
        time.sleep(0.2)
    wall = time.time() - t0
    if "result" in log.events:
        try:
            driver.wait(max(1.0, min(30.0, deadline - time.time())))  # let it shut Ray down
        except subprocess.TimeoutExpired:
            pass  # stop_all() ends it
    if proxy:
        proxy.close()
    res = log.events.get("result", {})
    last = log.iters[-1] if log.iters else {}
    out = {"mode": "server" if client_kind == "shmrl" else "baseline",
           "server": "RLlib 2.48 PPO + TcpClientInferenceEnvRunner",
           "client": "shmrl.sim --connect" if client_kind == "shmrl" else "RLlib 2.48 _dummy_client",
           "port": port, "command": client_cmd, "driver_command": driver_cmd,
           "solved": failure is None and bool(res.get("solved")),
           "wall_s": wall, "client_started_after_s": t_client - t0,
           "train_s": res.get("train_s", last.get("time_total_s")),
           "driver_wall_s": res.get("wall_s", last.get("wall_s")),
           "startup_s": log.events.get("ready", {}).get("startup_s"),
           "env_steps": res.get("env_steps", last.get("env_steps")),
           "return_mean": res.get("return_mean", last.get("return_mean")),
           "iterations": res.get("iterations", last.get("iter")),
           "rllib_config": log.events.get("config", {}).get("config")}
    if not res.get("solved") and failure is None:
        failure = ("RLlib received no env steps for several iterations (its listener thread died?)"
                   if "stalled" in log.events else "RLlib stopped before the stop return (iteration or env-step budget)")
    if log.errors["connection_errors"]:
        out["rllib_connection_errors"] = log.errors["connection_errors"]
    if log.errors["traceback"]:
        out["rllib_first_traceback"] = "\n".join(log.errors["traceback"]).rstrip()
    if failure:
        out["failure"] = failure
        out["driver_log_tail"] = kids.log_tail("rllib-server", 40)
        out["client_log_tail"] = kids.log_tail("client")
    return out


# --------------------------------------------------------------------------- command line

def fmt_line(r: dict) -> str:
    f = lambda v, spec: format(v, spec) if isinstance(v, (int, float)) else "-"
    cpu = r.get("cpu") or {}
    return _fmt_main(r, f) + (f" | CPU: ours {f(cpu.get('own_cpu_s'), '.0f')} s, other processes "
                              f"{f(cpu.get('other_cpu_s'), '.0f')} s over {f(cpu.get('span_s'), '.0f')} s")


def _fmt_main(r: dict, f) -> str:
    verdict = "solved" if r["solved"] else "NOT solved"
    if r["mode"] == "client":
        return (f"{r['mode']:8s} | {r['server']} <- {r['client']} | {verdict} | wall {f(r['wall_s'], '.1f')} s "
                f"(shmrl's own {f(r.get('shmrl_wall_s'), '.1f')} s) | {r.get('env_steps')} env steps | "
                f"return {f(r.get('return_mean'), '.1f')} | peak RSS {f(r.get('peak_rss_mb'), '.0f')} MB")
    return (f"{r['mode']:8s} | {r['server']} <- {r['client']} | {verdict} | wall {f(r['wall_s'], '.1f')} s, "
            f"training {f(r.get('train_s'), '.1f')} s | {r.get('env_steps')} env steps in "
            f"{r.get('iterations')} iterations | return {f(r.get('return_mean'), '.1f')} | "
            f"peak RSS {f(r.get('peak_rss_mb'), '.0f')} MB")


def build_parser():
    """The command line (client, server and baseline, and the hidden subcommands that run
    in the RLlib virtualenv) and its subcommands' parsers (--quick sets their defaults)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setup", action="store_true",
                   help="only create the RLlib 2.48 virtualenv (--venv after it, or the default), then exit")
    sub = p.add_subparsers(dest="cmd", metavar="{client,server,baseline}")
    helps = {"client": "shmrl's learner (TCP) <- RLlib 2.48's _dummy_client",
             "server": "RLlib 2.48's PPO TCP server <- shmrl.sim --connect",
             "baseline": "RLlib 2.48's PPO TCP server <- RLlib 2.48's _dummy_client"}
    for name, text in helps.items():
        s = sub.add_parser(name, help=text, description=text)
        s.add_argument("--quick", action="store_true",
                       help="seconds, not minutes: low targets and budgets (see above); flags given still win")
        s.add_argument("--port", type=int, default=5600, help="TCP port the client connects to (default: %(default)s)")
        s.add_argument("--venv", type=Path, default=shared.RLLIB.folder, help="RLlib 2.48 virtualenv (default: %(default)s)")
        s.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run (default: %(default)s)")
        s.add_argument("--stop-return", type=float, default=450.0, help="target mean return (default: %(default)s)")
        s.add_argument("--json", action="store_true", help="print one JSON object instead of a table line")
        s.add_argument("--capture", metavar="DIR", help="put a recording proxy between client and server "
                       f"(server on port + {CAPTURE_PORT_OFFSET}); frames.jsonl and raw bytes go to DIR")
        s.add_argument("--keep", action="store_true", help="keep the scratch directory with all logs")
        if name == "client":
            s.add_argument("--logdir", help="shmrl.run --logdir (default: in the scratch directory)")
        else:
            s.add_argument("--max-env-steps", type=int, default=2_000_000, help="RLlib budget (as the example)")
            s.add_argument("--max-iters", type=int, default=200, help="RLlib budget (as the example)")
            s.add_argument("--seed", type=int, default=None, help="RLlib seed (default: none, as the example)")
        s.add_argument("extra", nargs="*", help="after --: extra arguments for shmrl.run (client) or shmrl.sim (server)")
    h = sub.add_parser("_rllib-server")  # hidden: runs inside the venv
    h.add_argument("--port", type=int, required=True)
    h.add_argument("--stop-return", type=float, default=450.0)
    h.add_argument("--max-env-steps", type=int, default=2_000_000)
    h.add_argument("--max-iters", type=int, default=200)
    h.add_argument("--seed", type=int, default=None)
    h.add_argument("--stall-iters", type=int, default=2)
    h = sub.add_parser("_rllib-client")  # hidden: runs inside the venv
    h.add_argument("--port", type=int, required=True)
    h.add_argument("--wait", type=float, default=600.0)
    return p, sub


def main(argv=None) -> int:
    p, sub = build_parser()
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--setup"]:  # python tools/rllib_compat.py --setup [--venv DIR]
        s = argparse.ArgumentParser(prog="python tools/rllib_compat.py --setup")
        s.add_argument("--setup", action="store_true")
        s.add_argument("--venv", type=Path, default=shared.RLLIB.folder, help="RLlib 2.48 virtualenv (default: %(default)s)")
        v = s.parse_args(argv).venv
        try:
            print(f"RLlib 2.48 virtualenv ready: {shared.RLLIB.ensure(v)}")
        except (SetupError, subprocess.CalledProcessError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    if quick_asked(argv):
        for name, defaults in QUICK.items():
            sub.choices[name].set_defaults(**defaults)
    a = p.parse_args(argv)
    if a.cmd is None:
        p.error("a subcommand (client, server, baseline) or --setup is required")
    if getattr(a, "quick", False) and a.cmd == "client" and not any(
            x == "--max-env-steps" or x.startswith("--max-env-steps=") for x in a.extra):
        a.extra = [*QUICK_CLIENT_EXTRA, *a.extra]

    if a.cmd == "_rllib-server":
        return rllib_server_main(a)
    if a.cmd == "_rllib-client":
        return rllib_client_main(a)

    work = Path(tempfile.mkdtemp(prefix=f"rllib_compat_{a.cmd}_"))
    kids = Children(work)
    result: dict = {}
    status = 1

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        if a.cmd == "client":
            result = run_client(a, kids, work)
        else:
            result = run_rllib_server(a, kids, work, "shmrl" if a.cmd == "server" else "rllib")
        status = 0 if result["solved"] else 1
    except SetupError as e:
        result, status = {"mode": a.cmd, "solved": False, "failure": f"setup: {e}"}, 2
    except KeyboardInterrupt:
        result, status = {"mode": a.cmd, "solved": False, "failure": "interrupted"}, 130
    finally:
        cpu = kids.cpu_report()
        survivors = kids.stop_all()
        result["peak_rss_mb"] = round(kids.peak_rss_mb, 1)
        result["cpu"] = cpu
        if survivors:
            result["survivors"] = survivors
        result["scratch"] = str(work)
        if not a.keep and status == 0:
            shutil.rmtree(work, ignore_errors=True)
            result["scratch"] = None
    if a.json:
        print(json.dumps(result))
    elif "wall_s" in result:
        print(fmt_line(result))
        if result.get("failure"):
            print(f"failure: {result['failure']} (logs in {result['scratch']})")
            for k in ("rllib_first_traceback", "shmrl_log_tail", "driver_log_tail", "client_log_tail"):
                if result.get(k):
                    print(f"--- {k}:\n{result[k]}")
        for line in result.get("rllib_connection_errors", []):
            print(f"RLlib: {line}")
    else:
        print(f"{a.cmd}: {result.get('failure')}")
    return status


if __name__ == "__main__":
    sys.exit(main())
