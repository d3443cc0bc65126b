"""Checkpoints of a run: arrays in an .npz file, everything else in JSON, no pickle.

    LOGDIR/checkpoints/000042/weights.npz   flat parameters and Adam moments (PPO.get_state)
    LOGDIR/checkpoints/000042/state.json    configuration, counters, return window, versions

The number is the update the checkpoint was taken after. Each checkpoint is written into
a temporary folder and renamed into place, so a run killed while writing one keeps the
one before; the last ``keep`` are kept.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

FORMAT = 1


def checkpoints_dir(logdir: Path) -> Path:
    return Path(logdir) / "checkpoints"


def save(logdir: Path, update: int, arrays: dict[str, np.ndarray], state: dict, keep: int = 3) -> Path:
    """Write checkpoint ``update`` and delete all but the newest ``keep``; returns its folder."""
    root = checkpoints_dir(logdir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{update:06d}"
    tmp = Path(tempfile.mkdtemp(prefix=".writing-", dir=root))
    try:
        np.savez(tmp / "weights.npz", **arrays)
        (tmp / "state.json").write_text(json.dumps({"format": FORMAT, "update": update, **state}, indent=1))
        if final.exists():  # the same update again (an exit right after a periodic checkpoint)
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in sorted(p for p in root.iterdir() if p.name.isdigit())[:-max(keep, 1)]:
        shutil.rmtree(old, ignore_errors=True)
    return final


class CheckpointError(ValueError):
    """No usable checkpoint: none there, or every one damaged; the message says which and why."""


def all_checkpoints(logdir: Path) -> list[Path]:
    """The checkpoint folders under ``logdir``, oldest first."""
    root = checkpoints_dir(logdir)
    return sorted(p for p in root.iterdir() if p.name.isdigit()) if root.is_dir() else []


def latest(logdir: Path) -> Path | None:
    """The newest checkpoint folder under ``logdir``, or None (it may still be damaged:
    ``load_latest`` checks)."""
    found = all_checkpoints(logdir)
    return found[-1] if found else None


def load(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    """(arrays, state) of the checkpoint folder ``path``; every array is read in full, so
    a truncated or corrupted file fails here (zip's CRC), not later."""
    state = json.loads((path / "state.json").read_text())
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"checkpoint format {state.get('format') if isinstance(state, dict) else state!r}, "
                         f"this shmrl reads {FORMAT}")
    with np.load(path / "weights.npz", allow_pickle=False) as f:
        arrays = {k: f[k] for k in f.files}
    return arrays, state


def load_latest(logdir: Path) -> tuple[Path, dict[str, np.ndarray], dict, list[str]]:
    """(path, arrays, state, damaged) of the newest intact checkpoint under ``logdir``;
    ``damaged`` says, for each newer one that could not be read, which and why. A run
    killed at the wrong moment, or a full disk, can leave the newest one unreadable; the
    ones before it are kept for exactly that (``--keep-checkpoints``)."""
    found = all_checkpoints(logdir)
    if not found:
        raise CheckpointError(f"no checkpoint in {checkpoints_dir(Path(logdir))}")
    damaged = []
    for path in reversed(found):
        try:
            arrays, state = load(path)
        except Exception as e:  # BadZipFile, EOFError, OSError, JSON and format errors
            damaged.append(f"{path} is damaged ({type(e).__name__}: {e})")
            continue
        return path, arrays, state, damaged
    raise CheckpointError(f"every checkpoint in {checkpoints_dir(Path(logdir))} is damaged: "
                          + "; ".join(damaged))
