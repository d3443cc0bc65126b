"""The space layer: every observation and action space shmrl trains, described once.

An observation space becomes a list of **leaves**, each an array of one shape and dtype
per step, named by its path (``image``, ``state.0``; ``obs`` for a space that is not a
Dict or Tuple). A leaf says how it is stored (column-wise in ``EpisodeBatch`` and in the
binary codec: one array per leaf), how a client's value is checked, which ONNX input it
is fed to, and how the policy encodes it (``shmrl.onnxio.policy``). An observation Dict
key named ``action_mask`` (PettingZoo's and gymnasium's convention) is the mask of the
Discrete action parts, not an input to encode. A leaf shmrl cannot encode (a Text, such
as MiniGrid's ``mission``) is left out, and said so once.

| space | stored per step | encoded by the policy |
|---|---|---|
| Box, float (any shape) | float32, its shape | flattened, normalized if asked |
| Box, integer or bool, 3-D (an image) | uint8, its shape | scaled to [0, 1] by its high bound, a CNN |
| Box, integer or bool, other shapes | uint8 (or float32 if beyond 0..255) | scaled, flattened |
| Discrete(n) | int64, () | one-hot |
| MultiDiscrete(nvec) | int64, (k,) | one-hot per part |
| MultiBinary(n) | uint8, (n,) | as 0/1 floats |

Images are channels-last (H, W, C) unless their first dimension is the smallest
(C, H, W: gymnasium's frame stack), documented in docs/ENVIRONMENTS.md.

An action space becomes **parts**: a categorical per Discrete (and per MultiDiscrete
dimension, and per MultiBinary bit, with 2 values), a diagonal Gaussian per Box. The
policy's output 0, ``action_dist_inputs``, is the parts' inputs side by side: logits for
a categorical, then for a Gaussian all its means and then all its log-stds (RLlib's
layout). A step's action is stored as one int64 (a single Discrete: RLlib's form), one
float32 row (a single Box), or one row of all parts' values (int64 if all are
categorical, else float32).

This module never imports torch or gymnasium.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

# ------------------------------------------------------------------ spaces


@dataclass(frozen=True)
class Discrete:
    n: int
    start: int = 0  # the env's values are start .. start + n - 1; shmrl's are 0 .. n - 1


@dataclass(frozen=True)
class Box:
    low: tuple     # one value per element, or a single value for all
    high: tuple
    shape: tuple
    dtype: str = "float32"

    @property
    def integer(self) -> bool:
        return np.dtype(self.dtype).kind in "iub"


@dataclass(frozen=True)
class MultiDiscrete:
    nvec: tuple
    start: tuple = ()


@dataclass(frozen=True)
class MultiBinary:
    n: int


@dataclass(frozen=True)
class Dict:
    spaces: tuple   # ((key, space), ...)


@dataclass(frozen=True)
class Tuple:
    spaces: tuple


@dataclass(frozen=True)
class Unsupported:
    """A space shmrl cannot encode (Text, Graph, Sequence, ...): left out of observations."""
    what: str


def from_gym(space):
    """One of the spaces above for a gymnasium space (duck-typed: no gymnasium import)."""
    if isinstance(space, (Discrete, Box, MultiDiscrete, MultiBinary, Dict, Tuple, Unsupported)):
        return space
    kind = type(space).__name__
    if kind == "Discrete":
        return Discrete(int(space.n), int(getattr(space, "start", 0)))
    if kind == "Box":
        low, high = np.broadcast_to(space.low, space.shape), np.broadcast_to(space.high, space.shape)
        uniform = low.size and (low == low.flat[0]).all() and (high == high.flat[0]).all()
        return Box(tuple((low.flat[:1] if uniform else low.reshape(-1)).tolist()),
                   tuple((high.flat[:1] if uniform else high.reshape(-1)).tolist()),
                   tuple(int(d) for d in space.shape), np.dtype(space.dtype).name)
    if kind == "MultiDiscrete":
        if np.ndim(space.nvec) != 1:
            return Unsupported(f"MultiDiscrete of shape {np.shape(space.nvec)}")
        start = getattr(space, "start", None)
        return MultiDiscrete(tuple(int(n) for n in space.nvec),
                             tuple(int(s) for s in start) if start is not None and np.any(start) else ())
    if kind == "MultiBinary":
        n = space.n if np.ndim(space.n) == 0 else math.prod(space.n)
        return MultiBinary(int(n)) if np.ndim(space.n) <= 1 else Unsupported(f"MultiBinary{tuple(space.n)}")
    if kind == "Dict":
        return Dict(tuple((str(k), from_gym(s)) for k, s in space.spaces.items()))
    if kind == "Tuple":
        return Tuple(tuple(from_gym(s) for s in space.spaces))
    return Unsupported(kind)


# ------------------------------------------------------------------ observations

FLAT_INPUT = "onnx::Gemm_0"   # the input name of a flat Box observation (what RLlib's client feeds)
MASK_KEY = "action_mask"


@dataclass(frozen=True)
class Leaf:
    name: str            # its path: "obs", "image", "state.0"
    shape: tuple         # of one step's value
    dtype: str           # stored: float32, uint8 or int64
    encoding: str        # "vector", "image", "onehot", "multi_onehot", "mask"
    sizes: tuple = ()    # onehot: (n,); multi_onehot: nvec
    scale: float = 1.0   # uint8 values are multiplied by this (1 / the space's high bound)
    input_name: str = ""  # the ONNX input it is fed to

    @property
    def features(self) -> int:
        """Numbers it contributes before a CNN (an image) or as is (anything else)."""
        if self.encoding in ("onehot", "multi_onehot"):
            return sum(self.sizes)
        return math.prod(self.shape)

    def check(self, values: np.ndarray) -> str | None:
        """Why a client's values (one row per step) do not fit this leaf, or None."""
        if values.shape[1:] != self.shape:
            return f"obs {self.name!r} has shape {values.shape[1:]}, the environment's is {self.shape}"
        if self.dtype == "float32":
            return None if values.dtype.kind in "fiu" else f"obs {self.name!r} must be numbers"
        if values.dtype.kind not in "iub":
            return f"obs {self.name!r} must be integers, got {values.dtype}"
        if values.size:
            lo, hi = int(values.min()), int(values.max())
            top = {"onehot": lambda: self.sizes[0] - 1, "mask": lambda: 1, "vector": lambda: 255,
                   "image": lambda: 255, "multi_onehot": lambda: max(self.sizes) - 1}[self.encoding]()
            if lo < 0 or hi > top:
                return f"obs {self.name!r} holds {lo if lo < 0 else hi}, outside 0..{top}"
            if self.encoding == "multi_onehot" and (values >= np.asarray(self.sizes)).any():
                return f"obs {self.name!r} holds a value beyond its part's count {self.sizes}"
        return None


@dataclass(frozen=True)
class ObsLayout:
    """How an observation space's values are stored and fed: its leaves (the mask among
    them, encoding "mask"), and what was left out."""
    leaves: tuple
    skipped: tuple = ()        # (path, why) of leaves left out
    structured: bool = False   # a Dict or Tuple: batches hold a dict of arrays, not one array

    @property
    def inputs(self) -> tuple:
        """The leaves the policy encodes (not the mask)."""
        return tuple(leaf for leaf in self.leaves if leaf.encoding != "mask")

    @property
    def mask(self) -> Leaf | None:
        return next((leaf for leaf in self.leaves if leaf.encoding == "mask"), None)

    @property
    def flat(self) -> bool:
        """A single 1-D float Box: today's RLlink observation, fed as ``onnx::Gemm_0``."""
        return not self.structured and self.leaves[0].encoding == "vector" and len(self.leaves[0].shape) == 1

    def split(self, obs) -> dict | np.ndarray:
        """One env's observation in the stored form: an array, or {leaf name: array}."""
        if not self.structured:
            return np.asarray(obs, self.leaves[0].dtype)
        out = {}
        for leaf in self.leaves:
            value = obs
            for key in leaf.name.split("."):
                value = value[int(key)] if isinstance(value, (tuple, list)) else value[key]
            out[leaf.name] = np.asarray(value, leaf.dtype)
        return out

    def stack(self, observations: list) -> dict | np.ndarray:
        """Several envs' observations (as ``split`` gives them) as one batch."""
        if not self.structured:
            return np.stack(observations)
        return {leaf.name: np.stack([o[leaf.name] for o in observations]) for leaf in self.leaves}

    def empty(self, rows: int) -> dict | np.ndarray:
        """``rows`` zero rows of every leaf."""
        if not self.structured:
            return np.zeros((rows, *self.leaves[0].shape), self.leaves[0].dtype)
        return {leaf.name: np.zeros((rows, *leaf.shape), leaf.dtype) for leaf in self.leaves}

    def check(self, obs) -> tuple[str | None, object]:
        """(why a client's observations do not fit, None) or (None, the observations in the
        stored dtypes)."""
        if not self.structured:
            if isinstance(obs, dict):
                return "obs must be an array for this environment, not an object", None
            obs = {self.leaves[0].name: obs}
        elif not isinstance(obs, dict):
            return f"obs must be an object with the keys {[leaf.name for leaf in self.leaves]}", None
        names = {leaf.name for leaf in self.leaves}
        extra = sorted(set(obs) - names - {path for path, _ in self.skipped})
        if extra:
            return f"obs has unknown keys {extra}; the environment's are {sorted(names)}", None
        out = {}
        for leaf in self.leaves:
            if leaf.name not in obs:
                return f"obs has no {leaf.name!r}", None
            why = leaf.check(obs[leaf.name])
            if why:
                return why, None
            out[leaf.name] = obs[leaf.name].astype(leaf.dtype, copy=False)
        return None, (out if self.structured else out[self.leaves[0].name])


def image_layout(shape: tuple) -> str:
    """"HWC" or "CHW": channels are the last dimension unless the first is the smallest."""
    return "CHW" if shape[0] < shape[-1] and shape[0] <= 4 else "HWC"


def obs_layout(space) -> ObsLayout:
    space = from_gym(space)
    leaves, skipped = [], []
    structured = isinstance(space, (Dict, Tuple))

    def walk(s, path: str) -> None:
        if isinstance(s, Dict):
            for key, sub in s.spaces:
                walk(sub, f"{path}.{key}" if path else key)
        elif isinstance(s, Tuple):
            for i, sub in enumerate(s.spaces):
                walk(sub, f"{path}.{i}" if path else str(i))
        elif isinstance(s, Unsupported):
            skipped.append((path or "obs", f"a {s.what} space, which shmrl cannot encode"))
        else:
            leaves.append(_leaf(s, path or "obs"))

    walk(space, "")
    masks = [leaf for leaf in leaves if leaf.name == MASK_KEY]
    if masks:
        mask = masks[0]
        leaves = [leaf for leaf in leaves if leaf.name != MASK_KEY]
        leaves.append(Leaf(MASK_KEY, mask.shape, "uint8", "mask", input_name=MASK_KEY))
    if not [leaf for leaf in leaves if leaf.encoding != "mask"]:
        raise ValueError(f"no observation shmrl can encode in {space!r}")
    if not structured and leaves[0].encoding == "vector" and len(leaves[0].shape) == 1:
        leaves = [Leaf(**{**leaves[0].__dict__, "input_name": FLAT_INPUT})]
    return ObsLayout(tuple(leaves), tuple(skipped), structured)


def _leaf(space, name: str) -> Leaf:
    input_name = "obs" if name == "obs" else f"obs.{name}"
    if isinstance(space, Discrete):
        return Leaf(name, (), "int64", "onehot", (space.n,), input_name=input_name)
    if isinstance(space, MultiDiscrete):
        return Leaf(name, (len(space.nvec),), "int64", "multi_onehot", space.nvec, input_name=input_name)
    if isinstance(space, MultiBinary):
        return Leaf(name, (space.n,), "uint8", "vector", input_name=input_name)
    if not isinstance(space, Box):
        raise ValueError(f"{name}: unsupported observation space {space!r}")
    shape = tuple(space.shape)
    if not space.integer:
        return Leaf(name, shape, "float32", "vector", input_name=input_name)
    low, high = min(space.low), max(space.high)
    if np.dtype(space.dtype).kind == "b":
        high = 1
    if low < 0 or high > 255:  # integers that do not fit a byte travel as floats
        return Leaf(name, shape, "float32", "vector", input_name=input_name)
    image = len(shape) == 3 or (len(shape) == 2 and min(shape) >= 8)
    return Leaf(name, shape, "uint8", "image" if image else "vector", scale=1.0 / max(high, 1),
                input_name=input_name)


# ------------------------------------------------------------------ actions

@dataclass(frozen=True)
class ActionPart:
    kind: str             # "categorical" or "gaussian"
    size: int             # categorical: values; gaussian: dimensions
    start: int = 0        # categorical: the env's first value
    low: tuple = ()       # gaussian: the env's bounds (actions are clipped to them)
    high: tuple = ()

    @property
    def dist_size(self) -> int:
        return self.size if self.kind == "categorical" else 2 * self.size

    @property
    def action_size(self) -> int:
        return 1 if self.kind == "categorical" else self.size


@dataclass(frozen=True)
class ActionLayout:
    parts: tuple
    space: object = field(repr=False)   # the action space, to rebuild the env's action

    @property
    def dist_size(self) -> int:
        return sum(p.dist_size for p in self.parts)

    @property
    def action_size(self) -> int:
        return sum(p.action_size for p in self.parts)

    @property
    def single_discrete(self) -> bool:
        return len(self.parts) == 1 and self.parts[0].kind == "categorical" and isinstance(self.space, Discrete)

    @property
    def single_box(self) -> bool:
        return len(self.parts) == 1 and self.parts[0].kind == "gaussian"

    @property
    def discrete(self) -> bool:
        """All parts categorical: actions are integers."""
        return all(p.kind == "categorical" for p in self.parts)

    @property
    def action_shape(self) -> tuple:
        """The shape of one step's stored action."""
        return () if self.single_discrete else (self.action_size,)

    @property
    def action_dtype(self):
        return np.int64 if self.discrete else np.float32

    @property
    def mask_columns(self) -> np.ndarray:
        """The columns of ``action_dist_inputs`` an action mask covers: every value of
        every categorical part, in order (a Box part is never masked)."""
        return np.array([d for part, dist, _ in self.slices() if part.kind == "categorical"
                         for d in range(dist.start, dist.stop)], np.int64)

    def slices(self):
        """(part, its columns of action_dist_inputs, its columns of a stored action row)."""
        d = a = 0
        for part in self.parts:
            yield part, slice(d, d + part.dist_size), slice(a, a + part.action_size)
            d, a = d + part.dist_size, a + part.action_size

    def check(self, actions: np.ndarray, mask: np.ndarray | None = None) -> str | None:
        """Why a client's actions (one per step) do not fit, or None."""
        if actions.shape[1:] != self.action_shape:
            if not (self.single_box and self.parts[0].size == 1 and actions.ndim == 1):
                return f"actions have shape {actions.shape[1:]}, the action space's {self.action_shape}"
        if self.discrete and actions.dtype.kind != "i":
            return f"actions must be integers for the action space, got {actions.dtype}"
        if not self.discrete and actions.dtype.kind != "f":
            return f"actions of dtype {actions.dtype} do not fit the action space (floats)"
        if not len(actions):
            return None
        rows = actions.reshape(len(actions), -1)
        for part, _, cols in self.slices():
            if part.kind == "categorical":
                values = rows[:, cols.start]
                if values.dtype.kind == "f" and (values != np.round(values)).any():
                    return "a categorical action part holds a non-integer"
                if values.min() < 0 or values.max() >= part.size:
                    return f"action out of range for a Discrete({part.size})"
        if mask is not None:  # one entry per value of every categorical part
            steps, offset = np.arange(len(rows)), 0
            for part, _, cols in self.slices():
                if part.kind != "categorical":
                    continue
                if not mask[steps, offset + rows[:, cols.start].astype(np.int64)].all():
                    return "an action was taken that its observation's action_mask forbids"
                offset += part.size
        return None

    def to_env(self, actions: np.ndarray) -> list:
        """Each env's action as the env takes it: offsets added, Box parts clipped to their
        bounds, Tuple and Dict rebuilt."""
        if self.single_discrete:
            start = self.parts[0].start
            return (np.asarray(actions) + start).tolist() if start else np.asarray(actions).tolist()
        rows = np.asarray(actions).reshape(len(actions), -1)
        if self.single_box:
            return list(np.clip(rows.astype(np.float32), self._low(self.parts[0]), self._high(self.parts[0])))
        values = []
        for part, _, cols in self.slices():
            col = rows[:, cols]
            if part.kind == "categorical":
                values.append(col[:, 0].astype(np.int64) + part.start)
            else:
                values.append(np.clip(col.astype(np.float32), self._low(part), self._high(part)))
        return [_rebuild(self.space, iter([v[k] for v in values])) for k in range(len(rows))]

    @staticmethod
    def _low(part):
        return np.asarray(part.low, np.float32)

    @staticmethod
    def _high(part):
        return np.asarray(part.high, np.float32)


def _rebuild(space, values):
    """The env's action for ``space`` from the parts' values, in order."""
    if isinstance(space, Discrete):
        return int(next(values))
    if isinstance(space, Box):
        return next(values)
    if isinstance(space, MultiDiscrete):
        return np.array([int(next(values)) for _ in space.nvec], np.int64)
    if isinstance(space, MultiBinary):
        return np.array([int(next(values)) for _ in range(space.n)], np.int8)
    if isinstance(space, Tuple):
        return tuple(_rebuild(s, values) for s in space.spaces)
    return {key: _rebuild(s, values) for key, s in space.spaces}


def action_layout(space) -> ActionLayout:
    space = from_gym(space)
    parts = []

    def walk(s) -> None:
        if isinstance(s, Discrete):
            parts.append(ActionPart("categorical", s.n, s.start))
        elif isinstance(s, MultiDiscrete):
            starts = s.start or (0,) * len(s.nvec)
            parts.extend(ActionPart("categorical", n, st) for n, st in zip(s.nvec, starts))
        elif isinstance(s, MultiBinary):
            parts.extend(ActionPart("categorical", 2) for _ in range(s.n))
        elif isinstance(s, Box) and not s.integer:
            d = math.prod(s.shape)
            low, high = (np.broadcast_to(np.asarray(b, np.float64), (d,)) if len(b) == 1 else np.asarray(b)
                         for b in (s.low, s.high))
            parts.append(ActionPart("gaussian", d, low=tuple(low.tolist()), high=tuple(high.tolist())))
        elif isinstance(s, Dict):
            for _, sub in s.spaces:
                walk(sub)
        elif isinstance(s, Tuple):
            for sub in s.spaces:
                walk(sub)
        else:
            raise ValueError(f"unsupported action space {s!r}: shmrl trains Discrete, MultiDiscrete, "
                             f"MultiBinary, Box (floats) and Tuples and Dicts of them")

    walk(space)
    return ActionLayout(tuple(parts), space)
