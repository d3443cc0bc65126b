"""Checkpoints of a run: arrays in an .npz file, everything else in JSON, no pickle.

    LOGDIR/checkpoints/000042/weights.npz   flat parameters and Adam moments (PPO.get_state)
    LOGDIR/checkpoints/000042/state.json    configuration, counters, return window, versions

The number is the update the checkpoint was taken after. Each checkpoint is written into
a temporary folder and renamed into place, so a run killed while writing one keeps the
one before; the last ``keep`` are kept. A save that fails (a full disk) removes what it
wrote and keeps the older ones. Weights holding a NaN or an infinity are never written,
and a checkpoint holding them, or a state.json whose fields are not what shmrl writes,
is damaged: ``load_latest`` passes it over for the newest intact one.
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


class CheckpointError(ValueError):
    """A checkpoint that cannot be used or written: none there, every one damaged, weights
    that are not finite, a disk that refuses it; the message says which and why."""


def save(logdir: Path, update: int, arrays: dict[str, np.ndarray], state: dict, keep: int = 3) -> Path:
    """Write checkpoint ``update`` and delete all but the newest ``keep``; returns its folder.
    Raises CheckpointError, having written nothing, for arrays with a NaN or an infinity,
    and, having removed what it wrote, when the disk refuses the checkpoint."""
    root = checkpoints_dir(logdir)
    final = root / f"{update:06d}"
    bad = non_finite(arrays)
    if bad:
        raise CheckpointError(f"checkpoint {final} not written: {bad}")
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".writing-", dir=root))
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoint {final}: {e.strerror or e}") from None
    try:
        np.savez(tmp / "weights.npz", **arrays)
        (tmp / "state.json").write_text(json.dumps({"format": FORMAT, "update": update, **state}, indent=1))
        if final.is_dir() and not final.is_symlink():   # the same update again (an exit right after
            shutil.rmtree(final)                         # a periodic checkpoint)
        elif final.exists() or final.is_symlink():      # a file where the folder belongs
            final.unlink()
        os.rename(tmp, final)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):   # ENOSPC, EIO: one clear line, not numpy's chain of tracebacks
            raise CheckpointError(f"cannot write checkpoint {final}: {e.strerror or e} (the ones "
                                  f"before it are kept)") from None
        raise
    for old in sorted(p for p in root.iterdir() if p.name.isdigit())[:-max(keep, 1)]:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
    return final


def non_finite(arrays: dict[str, np.ndarray]) -> str | None:
    """Which float arrays hold a NaN or an infinity, in words; None if none does."""
    bad = [name for name, a in arrays.items()
           if np.issubdtype(np.asarray(a).dtype, np.floating) and not np.isfinite(a).all()]
    return f"{', '.join(sorted(bad))} hold{'s' if len(bad) == 1 else ''} NaN or infinity" if bad else None


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
    a truncated or corrupted file fails here (zip's CRC), not later. A checkpoint that is
    not a folder, whose state.json has a field of the wrong type or out of range, or whose
    arrays hold a NaN or an infinity raises CheckpointError saying which."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a folder")
    state = json.loads((path / "state.json").read_text())
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint format {state.get('format') if isinstance(state, dict) else state!r}, "
                              f"this shmrl reads {FORMAT}")
    check_state(state)
    with np.load(path / "weights.npz", allow_pickle=False) as f:
        arrays = {k: f[k] for k in f.files}
    bad = non_finite(arrays)
    if bad:
        raise CheckpointError(f"weights.npz: {bad}")
    return arrays, state


MAX_COUNT = 2**62   # far above any real count; its successor still fits an int64
COUNTERS = ("steps_received", "steps_trained", "steps_refused", "steps_lost", "episodes_completed")


def check_state(state: dict) -> None:
    """Raise CheckpointError naming the first field of ``state`` (state.json) that is not
    of the type and range shmrl writes (a field it leaves out, the trainer does not need)."""
    def count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT

    fields = [(key, state.get(key)) for key in ("update", "weights_seq_no") if key in state or key == "update"]
    counters = state.get("counters", {})
    if isinstance(counters, dict):
        fields += [(f"counters.{key}", counters[key]) for key in COUNTERS if key in counters]
    for name, value in fields:
        if not count(value):
            raise CheckpointError(f"state.json: {name} is {value!r}, not a count (0 to 2^62)")
    for key in ("counters", "ppo", "config"):
        if key in state and not isinstance(state[key], dict):
            raise CheckpointError(f"state.json: {key} is {type(state[key]).__name__}, not an object")


def load_latest(logdir: Path, misfit=None) -> tuple[Path, dict[str, np.ndarray], dict, list[str]]:
    """(path, arrays, state, damaged) of the newest intact checkpoint under ``logdir``;
    ``damaged`` says, for each newer one that could not be read, which and why. A run
    killed at the wrong moment, or a full disk, can leave the newest one unreadable; the
    ones before it are kept for exactly that (``--keep-checkpoints``). ``misfit(path,
    arrays, state)``, if given, says why a readable checkpoint does not fit the run (arrays
    of the wrong shape), or None: one that does not fit is passed over as a damaged one is."""
    found = all_checkpoints(logdir)
    if not found:
        raise CheckpointError(f"no checkpoint in {checkpoints_dir(Path(logdir))}")
    damaged = []
    for path in reversed(found):
        try:
            arrays, state = load(path)
        except CheckpointError as e:
            damaged.append(f"{path} is damaged ({e})")
            continue
        except Exception as e:  # BadZipFile, EOFError, OSError, JSON errors
            damaged.append(f"{path} is damaged ({type(e).__name__}: {e})")
            continue
        why = misfit(path, arrays, state) if misfit is not None else None
        if why:
            damaged.append(f"{path} is damaged ({why})")
            continue
        return path, arrays, state, damaged
    raise CheckpointError(f"every checkpoint in {checkpoints_dir(Path(logdir))} is damaged: "
                          + "; ".join(damaged))


# What makes the network (and the set of policies) a checkpoint holds: a run may resume
# only with the same, or it would overwrite the run's checkpoints with another network.
NETWORK_SETTINGS = ("hidden", "layers", "activation", "cnn", "memory", "memory_size", "normalize_obs",
                    "log_std_init", "policy_map")


def network_difference(saved: dict, config: dict, keys=NETWORK_SETTINGS) -> str | None:
    """The first network setting (of ``keys``) in which ``config`` (this run's, as
    saved_config writes it) differs from ``saved`` (a checkpoint's), in words naming the
    flag; None if none does. A setting an older checkpoint did not write is not compared."""
    for key in keys:
        if saved.get(key) is not None and config.get(key) != saved[key]:
            flag = "--" + key.replace("_", "-")
            return f"{flag} {config.get(key)} differs from the checkpoint's {flag} {saved[key]}"
    return None
