"""torch's import in a thread of its own (``start_torch_import``), beside what a training
run does without torch; the PPOs (``shmrl.trainer.setup.make_ppos``) wait for it
(``import_torch``). ``TorchImport`` says when it ran and how long the run waited for it
(summary.json, ``bench.py memory``).

Where it starts: where the learner would otherwise wait on something that holds no GIL.
The import is Python and the loading of libtorch, nearly all of it under the GIL, so
beside the set-up (Python too) it only shares one core's worth of the interpreter with it:
started at the process's start it ended no sooner, and the set-up, and so the simulators'
first env steps, came later (``bench.py memory`` on a 2-core machine: the first update
about 0.5 s later). So it starts once the simulators are launched (``Training.prepare``),
where they sample on other cores while it loads, and with ``--ray`` before joining the
cluster (``shmrl.run.train``), a wait on the network.

Why this is safe:

- Imports in two threads at once: Python (3.3 and later) locks each module, not the whole
  import system, so the main thread imports shmrl's modules while torch loads (as the
  launcher thread already imports the simulators' modules). A module both want (numpy,
  dill) is loaded by one while the other waits for it, and a thread that needs torch before
  it is loaded (``import_torch``, or ``--pretrain``'s import of PPO) waits for it the same
  way. A deadlock would need each thread to wait for a module the other is loading, in a
  circle: torch's modules never import shmrl's, nor multiprocess's or onnxruntime's.
- Simulators never load torch: the fork server that forks them is a fresh interpreter
  (``multiprocess.forkserver``: fork and exec in C, no Python between them) that preloads
  only the simulator's modules, so torch in the learner, loaded or half loaded, never
  reaches it; torch's import changes no environment variable it could inherit.
- A failed import (no torch installed) is raised in the thread that waits for it, as a
  plain ``import torch`` would be.
"""
from __future__ import annotations

import threading
import time

__all__ = ["TorchImport", "import_torch", "load_torch", "start_torch_import", "started_since"]


def load_torch() -> None:
    """What the thread does (tests patch it to be slow)."""
    import torch  # noqa: F401


class TorchImport:
    """One import of torch in a thread of its own, and when it ran (``time.time()``)."""

    def __init__(self):
        self.started_at = time.time()
        self.ended_at: float | None = None
        self.waited_s = 0.0    # how long ``module`` callers were held up by the thread
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="shmrl-torch-import", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            load_torch()
        except BaseException as e:   # raised again where the module is asked for
            self.error = e
        finally:
            self.ended_at = time.time()

    def module(self):
        """torch, once the thread has imported it (raises what the import raised)."""
        t0 = time.perf_counter()
        self.thread.join()
        self.waited_s += time.perf_counter() - t0
        if self.error is not None:
            raise self.error
        import torch

        return torch

    def times(self, t0: float) -> dict:
        """When the import began and ended, seconds after ``t0``, and how long the run waited for it."""
        return {"torch_import_started_s": self.started_at - t0,
                "torch_import_ended_s": None if self.ended_at is None else self.ended_at - t0,
                "torch_import_waited_s": self.waited_s}


_started: TorchImport | None = None   # the process's latest; torch, once loaded, stays loaded


def start_torch_import() -> TorchImport:
    """Begin importing torch in a thread (the one running already, if there is one)."""
    global _started
    if _started is None or not _started.thread.is_alive():
        _started = TorchImport()
    return _started


def started_since(t0: float) -> TorchImport | None:
    """The import ``start_torch_import`` began, unless it had ended before ``t0`` (``time.time()``)."""
    if _started is None or (_started.ended_at is not None and _started.ended_at < t0):
        return None
    return _started


def import_torch():
    """torch: waits for the import ``start_torch_import`` began, else imports it here."""
    if _started is not None:
        return _started.module()
    import torch

    return torch

