"""Recorded episodes on disk: shmrl's offline dataset format (docs/RECORDING.md).

A dataset is a folder::

    manifest.json            format and version, the env, each policy's spaces
    shard-000001.npz         whole episodes of one policy, appended by one writer
    shard-000002.npz         ...

A folder has one writer at a time: ``DatasetWriter`` holds a lock on its hidden
``.writer.lock`` (``shmrl.files.logdir.take_lock``, as a log folder's) and a second writer
is refused naming the first one's pid. A shard is written to a hidden temporary name,
fsynced and linked to the next shard name that is free, never over one that is there, so
a reader (and a writer that appends later) only ever sees whole shards, and no writer
replaces another's: a kill at any moment leaves a dataset that reads. A damaged shard
(truncated, or whose arrays do not agree with each other or with the manifest) is passed
over by the reader, named in one warning; a damaged manifest is refused (DatasetError).
Shards hold plain arrays (``np.load(allow_pickle=False)`` reads them):

| key | rows | what |
|---|---|---|
| ``policy_id`` | () | the policy whose episodes these are |
| ``lengths`` | episodes | steps of each episode |
| ``terminated``, ``truncated`` | episodes | how it ended |
| ``stopped`` | episodes | it had not ended when the recording stopped or its client went away (``truncated`` is set too) |
| ``agent_id``, ``episode_id``, ``source`` | episodes | strings ('' where none): the agent (multi-agent), the client's episode id, the connection |
| ``obs`` or ``obs/<leaf>`` | steps + episodes | observations, one more per episode than steps (``shmrl.core.spaces`` leaves: uint8 images stay uint8) |
| ``actions``, ``rewards``, ``action_logp``, ``action_dist_inputs``, ``weights_seq_no`` | steps | as the client sent them (actions in shmrl's layout: Discrete from 0, Box unclipped) |

This module is numpy and the standard library only.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shmrl.core import spaces
from shmrl.core.episode import EpisodeBatch, obs_concat
from shmrl.files.logdir import take_lock

FORMAT, VERSION = "shmrl-dataset", 1
MANIFEST = "manifest.json"
WRITER_LOCK = ".writer.lock"   # hidden: readers, and the check for a folder that holds something else, pass over it
SHARD = re.compile(r"^shard-(\d+)\.npz$")
STEP_KEYS = ("actions", "rewards", "action_logp", "action_dist_inputs", "weights_seq_no")
EPISODE_KEYS = ("lengths", "terminated", "truncated", "stopped", "agent_id", "episode_id", "source")

log = logging.getLogger("shmrl.dataset")


class DatasetError(ValueError):
    """A folder that is not a dataset, one that does not fit what is asked of it, or one
    whose values are poisoned (not finite, or beyond the bounds given)."""


class DatasetWriteError(RuntimeError):
    """A shard could not be written (a full disk, an I/O error); the message names the
    folder and the cause."""


# ------------------------------------------------------------------ spaces as JSON

def _num(x):
    x = float(x)
    return x if np.isfinite(x) else ("inf" if x > 0 else "-inf")


def space_to_json(space) -> dict:
    """A ``shmrl.core.spaces`` space as JSON (infinite bounds as "inf" and "-inf")."""
    if isinstance(space, spaces.Box):
        return {"type": "Box", "low": [_num(v) for v in space.low], "high": [_num(v) for v in space.high],
                "shape": [int(d) for d in space.shape], "dtype": str(space.dtype)}
    if isinstance(space, spaces.Discrete):
        return {"type": "Discrete", "n": int(space.n), "start": int(space.start)}
    if isinstance(space, spaces.MultiDiscrete):
        return {"type": "MultiDiscrete", "nvec": [int(n) for n in space.nvec], "start": [int(n) for n in space.start]}
    if isinstance(space, spaces.MultiBinary):
        return {"type": "MultiBinary", "n": int(space.n)}
    if isinstance(space, spaces.Dict):
        return {"type": "Dict", "spaces": [[k, space_to_json(s)] for k, s in space.spaces]}
    if isinstance(space, spaces.Tuple):
        return {"type": "Tuple", "spaces": [space_to_json(s) for s in space.spaces]}
    return {"type": "Unsupported", "what": space.what}


def space_from_json(d: dict):
    kind = d["type"]
    if kind == "Box":
        return spaces.Box(tuple(float(v) for v in d["low"]), tuple(float(v) for v in d["high"]),
                          tuple(d["shape"]), d["dtype"])
    if kind == "Discrete":
        return spaces.Discrete(d["n"], d.get("start", 0))
    if kind == "MultiDiscrete":
        return spaces.MultiDiscrete(tuple(d["nvec"]), tuple(d.get("start", ())))
    if kind == "MultiBinary":
        return spaces.MultiBinary(d["n"])
    if kind == "Dict":
        return spaces.Dict(tuple((k, space_from_json(s)) for k, s in d["spaces"]))
    if kind == "Tuple":
        return spaces.Tuple(tuple(space_from_json(s) for s in d["spaces"]))
    return spaces.Unsupported(d.get("what", "?"))


def manifest_for(env_id: str, policy_specs: dict, agents=None) -> dict:
    """The manifest of a dataset of ``policy_specs``' episodes (policy id -> EnvSpec)."""
    return {"format": FORMAT, "version": VERSION, "env": env_id,
            "agents": None if agents is None else [str(a) for a in agents],
            "policies": {pid: {"observation_space": space_to_json(s.observation_space),
                               "action_space": space_to_json(s.action_space)} for pid, s in policy_specs.items()}}


def read_manifest(path: Path) -> dict:
    """The manifest of the dataset at ``path``, checked whole (DatasetError: missing,
    not shmrl's, of a newer version, or damaged)."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
    except FileNotFoundError:
        raise DatasetError(f"{path}: not a dataset (no {MANIFEST})") from None
    except (OSError, ValueError) as e:
        raise DatasetError(f"{path}/{MANIFEST}: cannot read it: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise DatasetError(f"{path}: not a shmrl dataset ({MANIFEST} says format {found!r})")
    version = manifest.get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version > VERSION:
        raise DatasetError(f"{path}: dataset format version {version}; this shmrl reads up to {VERSION}")
    why = manifest_problem(manifest)
    if why:
        raise DatasetError(f"{path}/{MANIFEST}: damaged: {why}")
    return manifest


def manifest_problem(manifest: dict) -> str | None:
    """What is wrong with a manifest of the right format, or None."""
    version = manifest.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        return f"version {version!r} is not a version number"
    if not isinstance(manifest.get("env"), str):
        return f"env {manifest.get('env')!r} is not a name"
    agents = manifest.get("agents")
    if agents is not None and not (isinstance(agents, list) and all(isinstance(a, str) for a in agents)):
        return "agents is neither null nor a list of names"
    policies = manifest.get("policies")
    if not isinstance(policies, dict) or not policies:
        return "it names no policies"
    for pid, p in policies.items():
        try:
            obs_space, action_space = space_from_json(p["observation_space"]), space_from_json(p["action_space"])
            spaces.obs_layout(obs_space), spaces.action_layout(action_space)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            return f"policy {pid!r} has no spaces shmrl reads ({type(e).__name__}: {e})"
    return None


# ------------------------------------------------------------------ writing

def _write_whole(path: Path, write) -> None:
    """``write(file)`` into a hidden temporary file beside ``path``, fsynced, then renamed
    to ``path`` and the folder fsynced: ``path`` is whole or absent."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        _unlink(tmp)
    _sync_folder(path.parent)


def _unlink(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass   # a temporary file left is passed over by readers


def _sync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_appendable(path, manifest: dict) -> dict | None:
    """The manifest of the dataset at ``path`` (None if there is none yet), if episodes of
    ``manifest`` may be appended to it; else a DatasetError that says why not."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise DatasetError(f"{path}: not a folder")
    if not (path / MANIFEST).exists():
        if path.exists() and any(not n.startswith(".") for n in os.listdir(path)):
            raise DatasetError(f"{path}: a folder that is not empty and not a dataset (no {MANIFEST})")
        return None
    old = read_manifest(path)
    for key in ("env", "agents"):
        if old.get(key) != manifest.get(key):
            raise DatasetError(f"{path}: its episodes are of {key} {old.get(key)!r}, not {manifest.get(key)!r}")
    for pid, p in manifest["policies"].items():
        if pid in old["policies"] and old["policies"][pid] != p:
            raise DatasetError(f"{path}: policy {pid!r} was recorded with other spaces")
    return old


def last_shard(path: Path) -> int:
    """The highest shard number in the folder ``path`` (0 if none)."""
    return max((int(m.group(1)) for m in map(SHARD.match, os.listdir(path)) if m), default=0)


class DatasetWriter:
    """Appends shards of whole episodes to a dataset folder (made, with its manifest, if
    new; an existing one must hold the same env and spaces). One writer per folder at a
    time: it holds the folder's lock until ``close`` (or its process ends), and another
    writer is refused with a ConfigError naming ``flag`` and the holder's pid. Shards are
    numbered on from the highest there, and a shard never replaces one that is there."""

    def __init__(self, path, manifest: dict, flag: str = "--record"):
        self.path = Path(path)
        check_appendable(self.path, manifest)   # before the folder is made: nothing is made for a refused one
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DatasetError(f"{self.path}: cannot create it: {e.strerror or e}") from None
        self._lock = take_lock(self.path, flag, WRITER_LOCK)
        try:
            old = check_appendable(self.path, manifest)   # again, under the lock: as the last writer left it
            self._write_manifest(old, manifest)
            self.next_shard = 1 + last_shard(self.path)
        except BaseException:
            self.close()
            raise
        self.episodes = self.steps = 0

    def _write_manifest(self, old: dict | None, manifest: dict) -> None:
        if old is not None and not set(manifest["policies"]) - set(old["policies"]):
            return
        new = ({**old, "policies": {**manifest["policies"], **old["policies"]}} if old is not None
               else {**manifest, "created": time.time()})
        try:
            _write_whole(self.path / MANIFEST, lambda f: f.write(json.dumps(new, indent=1).encode()))
        except OSError as e:
            raise DatasetError(f"{self.path}: cannot write its {MANIFEST}: {e.strerror or e}") from None

    def write(self, policy_id: str, arrays: dict) -> Path:
        """One shard of ``arrays`` (the keys of the module docstring, but ``policy_id``);
        DatasetWriteError if it cannot be written (then nothing of it is left)."""
        tmp = self.path / f".shard.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                np.savez(f, policy_id=np.array(policy_id), **arrays)
                f.flush()
                os.fsync(f.fileno())
            path = self._link_new(tmp)
            _sync_folder(self.path)
        except OSError as e:
            raise DatasetWriteError(f"cannot write a shard to {self.path}: {e.strerror or e}") from None
        finally:
            _unlink(tmp)
        self.episodes += len(arrays["lengths"])
        self.steps += int(np.sum(arrays["lengths"]))
        return path

    def _link_new(self, tmp: Path) -> Path:
        """``tmp`` under the next shard name that is free: a link, unlike a rename, fails
        where the name is taken, so no shard is ever replaced."""
        while True:
            path = self.path / f"shard-{self.next_shard:06d}.npz"
            self.next_shard += 1
            try:
                os.link(tmp, path)
                return path
            except FileExistsError:
                continue
            except OSError as e:   # a file system without hard links: take a name that is free, then rename
                if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS):
                    raise
                if not path.exists():
                    os.replace(tmp, path)
                    return path

    def close(self) -> None:
        """Give the folder's lock up (also done by the end of the process)."""
        self._lock.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _strings(values) -> np.ndarray:
    return np.array(["" if v is None else str(v) for v in values], dtype=str)


def shard_arrays(episodes: list) -> dict:
    """The arrays of a shard of ``episodes``: each a list of pieces (batch, chunk index), the
    chunks of one episode in order (a continuation's first observation, the previous
    chunk's last, is kept once), with per episode (stopped, source)."""
    obs, steps = [], {k: [] for k in STEP_KEYS}
    lengths, term, trunc, stopped, agents, ids, sources = [], [], [], [], [], [], []
    for pieces, was_stopped, source in episodes:
        n = 0
        for j, (b, i) in enumerate(pieces):
            lo, hi = int(b.offsets[i]), int(b.offsets[i + 1])
            first = int(b.obs_first[i]) + (1 if j else 0)
            last = int(b.obs_last[i]) + 1
            obs.append({k: v[first:last] for k, v in b.obs.items()} if isinstance(b.obs, dict) else b.obs[first:last])
            steps["actions"].append(b.actions[lo:hi])
            steps["rewards"].append(b.rewards[lo:hi])
            steps["action_logp"].append(b.action_logp[lo:hi])
            steps["action_dist_inputs"].append(b.action_dist_inputs[lo:hi])
            steps["weights_seq_no"].append(np.full(hi - lo, b.weights_seq_no[i], np.int64))
            n += hi - lo
        b, i = pieces[-1]
        lengths.append(n)
        term.append(bool(b.is_terminated[i]) and not was_stopped)
        trunc.append(bool(b.is_truncated[i]) or was_stopped)
        stopped.append(was_stopped)
        b0, i0 = pieces[0]
        agents.append(b0.agent_ids[i0] if b0.agent_ids is not None else None)
        ids.append(b0.episode_ids[i0] if b0.episode_ids is not None else None)
        sources.append(source)
    out = {"lengths": np.array(lengths, np.int64), "terminated": np.array(term, bool),
           "truncated": np.array(trunc, bool), "stopped": np.array(stopped, bool), "agent_id": _strings(agents),
           "episode_id": _strings(ids), "source": _strings(sources)}
    stacked = obs_concat(obs)
    if isinstance(stacked, dict):
        out.update({f"obs/{k}": v for k, v in stacked.items()})
    else:
        out["obs"] = stacked
    out.update({k: np.concatenate(v) for k, v in steps.items()})
    out["rewards"] = out["rewards"].astype(np.float32, copy=False)
    return out


# ------------------------------------------------------------------ reading

@dataclass
class Episode:
    """One recorded episode: ``obs`` has one row more than the step fields (an array, or a
    dict of leaf arrays)."""
    policy_id: str
    obs: object
    actions: np.ndarray
    rewards: np.ndarray
    terminated: bool
    truncated: bool
    action_logp: np.ndarray
    action_dist_inputs: np.ndarray
    weights_seq_no: np.ndarray
    agent_id: str | None = None
    episode_id: str | None = None
    source: str = ""
    stopped: bool = False

    def __len__(self) -> int:
        return len(self.actions)


@dataclass(frozen=True)
class ValueBounds:
    """The largest magnitude a value of a dataset that is trained on or exported may have
    (what the learner refuses from a client, ``--max-obs-abs`` and ``--max-reward-abs``):
    beyond it, or not finite, a shard is poisoned and the dataset refused."""
    max_obs_abs: float      # float observation leaves and Box actions
    max_reward_abs: float


def shard_problem(arrays: dict, layouts: dict) -> str | None:
    """Why a shard's ``arrays`` are not a shard of the dataset whose policies have
    ``layouts`` (policy id -> (ObsLayout, ActionLayout)), or None: keys missing, rows that
    disagree with ``lengths``, values that do not fit the policy's spaces."""
    missing = [k for k in ("policy_id", *EPISODE_KEYS, *STEP_KEYS) if k not in arrays]
    if missing:
        return f"it has no {', '.join(missing)}"
    if arrays["policy_id"].shape != () or arrays["policy_id"].dtype.kind != "U":
        return "its policy_id is not a name"
    pid = str(arrays["policy_id"])
    if pid not in layouts:
        return f"its policy {pid!r} is not in the manifest"
    obs_layout, action_layout = layouts[pid]
    lengths = arrays["lengths"]
    if lengths.ndim != 1 or lengths.dtype.kind not in "iu" or (lengths < 0).any():
        return "its lengths are not counts of steps"
    episodes, steps = len(lengths), int(lengths.sum())
    obs = ({leaf.name: arrays.get(f"obs/{leaf.name}") for leaf in obs_layout.leaves} if obs_layout.structured
           else {"obs": arrays.get("obs")})
    if any(rows is None for rows in obs.values()):
        return f"it has no observations {[name for name, rows in obs.items() if rows is None]}"
    rows_and_kinds = {"terminated": (episodes, "b"), "truncated": (episodes, "b"), "stopped": (episodes, "b"),
                      "agent_id": (episodes, "U"), "episode_id": (episodes, "U"), "source": (episodes, "U"),
                      "actions": (steps, "iuf"), "rewards": (steps, "f"), "action_logp": (steps, "f"),
                      "action_dist_inputs": (steps, "f"), "weights_seq_no": (steps, "iu")}
    named = {**{key: arrays[key] for key in rows_and_kinds},
             **{name if name == "obs" else f"obs/{name}": rows for name, rows in obs.items()}}
    for key, value in named.items():
        rows, kinds = rows_and_kinds.get(key, (steps + episodes, "fiub"))
        if value.ndim == 0 or len(value) != rows or value.dtype.kind not in kinds:
            return f"{key} has {len(value) if value.ndim else 0} rows of {value.dtype}; lengths say {rows}"
    columns = arrays["action_dist_inputs"].shape[1:]
    if steps and columns != (action_layout.dist_size,):
        return f"action_dist_inputs have shape {columns} per step, not ({action_layout.dist_size},)"
    why, _ = obs_layout.check(obs if obs_layout.structured else obs["obs"])
    return why or action_layout.check(arrays["actions"])


def poisoned(arrays: dict, bounds: ValueBounds) -> str | None:
    """What in a (well-formed) shard's ``arrays`` is not finite or beyond ``bounds``, or None."""
    checks = [(k, v, bounds.max_obs_abs, "--max-obs-abs") for k, v in arrays.items()
              if (k == "obs" or k.startswith("obs/")) and v.dtype.kind == "f"]
    if arrays["actions"].dtype.kind == "f":
        checks.append(("actions", arrays["actions"], bounds.max_obs_abs, "--max-obs-abs"))
    checks.append(("rewards", arrays["rewards"], bounds.max_reward_abs, "--max-reward-abs"))
    for key, values, bound, flag in checks:
        bad = ~(np.abs(values) <= bound)
        if bad.any():
            return f"{key} holds {values[bad].flat[0]:g}: not finite, or beyond the learner's {flag} {bound:g}"
    return None


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


class Dataset:
    """A dataset folder, read: ``manifest``, ``env``, ``policy_spaces`` (policy id ->
    (observation space, action space) as ``shmrl.core.spaces``), ``episodes()`` and
    ``batch()``. Temporary files are passed over; so is a damaged shard (one that cannot
    be read, or whose arrays disagree with each other or with the manifest), named once in
    one warning (``damaged``: shard name -> why). With ``bounds``, a shard whose values are
    not finite or beyond them refuses the dataset (DatasetError): it is poisoned."""

    def __init__(self, path, bounds: ValueBounds | None = None):
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        self.env = self.manifest["env"]
        self.policy_spaces = {pid: (space_from_json(p["observation_space"]), space_from_json(p["action_space"]))
                              for pid, p in self.manifest["policies"].items()}
        self.layouts = {pid: (spaces.obs_layout(obs), spaces.action_layout(action))
                        for pid, (obs, action) in self.policy_spaces.items()}
        self.bounds = bounds
        self.damaged: dict[str, str] = {}

    def shards(self) -> list[Path]:
        found = sorted((int(m.group(1)), name) for name in os.listdir(self.path) if (m := SHARD.match(name)))
        return [self.path / name for _, name in found]

    def shard_arrays(self):
        """(path, arrays) of every shard that reads whole, in order; the damaged ones are
        passed over and named in one warning at the end (those not named before)."""
        found = {}
        try:
            for path in self.shards():
                try:
                    with np.load(path, allow_pickle=False) as z:
                        arrays = {k: z[k] for k in z.files}
                    why = shard_problem(arrays, self.layouts)
                except Exception as e:   # a damaged file: zipfile, zlib and numpy's header parser raise many kinds
                    why = f"cannot be read: {type(e).__name__}: {e}"
                if why:
                    found[path.name] = _one_line(why)
                    continue
                if self.bounds is not None and (why := poisoned(arrays, self.bounds)):
                    raise DatasetError(f"{path}: poisoned: {why}")
                yield path, arrays
        finally:
            new = {name: why for name, why in found.items() if name not in self.damaged}
            self.damaged.update(new)
            if new:
                log.warning("%s: passed over %d damaged shard%s: %s", self.path, len(new), "s" * (len(new) > 1),
                            "; ".join(f"{name} ({why})" for name, why in new.items()))

    def episodes(self, policy_id: str | None = None):
        """Every episode (of ``policy_id``, if given), in the order recorded."""
        for _, a in self.shard_arrays():
            pid = str(a["policy_id"])
            if policy_id is not None and pid != policy_id:
                continue
            obs = {k[4:]: v for k, v in a.items() if k.startswith("obs/")} or a["obs"]
            lengths = a["lengths"]
            steps = np.concatenate([[0], np.cumsum(lengths)])
            rows = steps + np.arange(len(steps))
            for e, n in enumerate(lengths.tolist()):
                s, r = slice(steps[e], steps[e + 1]), slice(rows[e], rows[e] + n + 1)
                yield Episode(
                    pid, {k: v[r] for k, v in obs.items()} if isinstance(obs, dict) else obs[r],
                    a["actions"][s], a["rewards"][s], bool(a["terminated"][e]), bool(a["truncated"][e]),
                    a["action_logp"][s], a["action_dist_inputs"][s], a["weights_seq_no"][s],
                    str(a["agent_id"][e]) or None, str(a["episode_id"][e]) or None, str(a["source"][e]),
                    bool(a["stopped"][e]))

    def batch(self, policy_id: str, episodes: int | None = None) -> EpisodeBatch:
        """The first ``episodes`` (default: all) of ``policy_id``'s episodes as one
        EpisodeBatch, one chunk each (what PPO's ``make_batch`` takes)."""
        eps = []
        for ep in self.episodes(policy_id):
            if episodes is not None and len(eps) >= episodes:
                break
            eps.append(ep)
        if not eps:
            raise DatasetError(f"{self.path}: no episodes of policy {policy_id!r}")
        return EpisodeBatch(
            obs=obs_concat([e.obs for e in eps]), actions=np.concatenate([e.actions for e in eps]),
            rewards=np.concatenate([e.rewards for e in eps]),
            action_dist_inputs=np.concatenate([e.action_dist_inputs for e in eps]),
            action_logp=np.concatenate([e.action_logp for e in eps]), lengths=[len(e) for e in eps],
            is_terminated=[e.terminated for e in eps], is_truncated=[e.truncated for e in eps],
            weights_seq_no=[int(e.weights_seq_no[0]) if len(e) else -1 for e in eps],
            agent_ids=None if all(e.agent_id is None for e in eps) else [e.agent_id for e in eps])
