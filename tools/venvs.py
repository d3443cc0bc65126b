"""The virtualenvs of the baselines, each made once and reused: stable-baselines3
(tools/sb3_baseline.py), RLlib 2.48 (tools/rllib_compat.py) and rl-zoo3 (tools/zoo.py and
tools/recurrent_baseline.py). Each lives in ~/.cache/shmrl/NAME (a tool's --venv picks
another folder) with torch pinned to 2.13.0, the same CPU build as shmrl's: an unpinned
torch pulls a CUDA build of several GB.

A tool imports this file as a sibling (python puts a script's folder on sys.path, and
tests/conftest.py's load_tool does the same). Standard library only: the baselines' own
interpreters load the tools that import it.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

CACHE = Path("~/.cache/shmrl").expanduser()


class SetupError(RuntimeError):
    """A virtualenv could not be made to work."""


@dataclass(frozen=True)
class Venv:
    name: str                   # its folder in ~/.cache/shmrl
    what: str                   # for messages: "the {what} virtualenv"
    packages: tuple[str, ...]   # pip install these; NAME==VERSION pins are checked on every use
    modules: tuple[str, ...]    # what the tools import there

    @property
    def folder(self) -> Path:
        return CACHE / self.name

    def ensure(self, folder: Path | None = None, log=None) -> Path:
        """The python of the virtualenv in ``folder`` (default: its own), made if missing
        or incomplete, reused as it is otherwise. ``log``: where progress goes (stderr)."""
        folder = folder or self.folder
        log = log or (lambda m: print(m, file=sys.stderr, flush=True))
        py = folder / "bin" / "python"
        if py.exists() and subprocess.run([str(py), "-c", self._check(load=False)],
                                          capture_output=True).returncode == 0:
            return py
        log(f"creating the {self.what} virtualenv in {folder} (takes minutes) ...")
        folder.parent.mkdir(parents=True, exist_ok=True)
        if not py.exists():
            subprocess.run([shutil.which("python3") or sys.executable, "-m", "venv", str(folder)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", *self.packages], check=True)
        r = subprocess.run([str(py), "-c", self._check(load=True)], capture_output=True, text=True)
        if r.returncode != 0:
            raise SetupError(f"the virtualenv {folder} does not work:\n{r.stderr}")
        return py

    def _check(self, *, load: bool) -> str:
        """Python that fails unless the modules are there and the pinned versions installed.
        ``load=False`` finds the modules without importing them (importing ray or torch takes
        seconds), for the check on every use; ``load=True`` imports them, once after pip."""
        lines = ["import importlib.util, importlib.metadata as md"]
        for module in self.modules:
            lines.append(f"import {module}" if load else
                         f"assert importlib.util.find_spec({module!r}), 'no module {module}'")
        for spec in self.packages:
            pin = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?==(\S+)", spec)
            if pin:  # startswith: a local build tag (2.13.0+cpu) is the same release
                dist, version = pin.group(1), pin.group(3)
                lines.append(f"assert md.version({dist!r}).startswith({version!r}), md.version({dist!r})")
        return "\n".join(lines)


TORCH = "torch==2.13.0"
SB3 = Venv("sb3-venv", "stable-baselines3", (TORCH, "stable-baselines3>=2.3", "gymnasium"),
           ("stable_baselines3", "torch", "gymnasium"))
# onnx: torch's legacy ONNX exporter (rllib_compat's _legacy_onnx_export) needs the onnx package.
RLLIB = Venv("rllib-2.48-venv", "RLlib 2.48", ("ray[rllib]==2.48.0", TORCH, "gymnasium", "onnxruntime", "onnx"),
             ("ray", "torch", "onnxruntime", "onnx", "gymnasium"))
# sb3_contrib (RecurrentPPO, for recurrent_baseline.py) comes with rl_zoo3.
ZOO = Venv("zoo-venv", "rl-zoo3", (TORCH, "rl_zoo3", "gymnasium[mujoco,atari]", "opencv-python-headless"),
           ("rl_zoo3", "sb3_contrib", "mujoco", "ale_py", "cv2", "torch"))
