"""ONNX model files written directly as protobuf bytes, with slots for weights.

A policy's graph never changes shape between versions, only its weights do. ``Graph``
collects nodes, inputs, outputs and initializers; ``Graph.template()`` serializes it once
into fixed byte pieces with a slot where each weight's raw bytes go, and
``ModelTemplate.publish(weights)`` fills the slots (one ``bytes.join``, a few µs). The bytes
are those ``onnx.helper`` writes for the same graph (tests compare them): ONNX's schema
is proto2, so every message is written with its fields in number order and repeated
scalars unpacked, as protobuf's serializer does.

This module imports neither torch nor the onnx package (importing onnx would cost the
learner about 0.3 s of start-up; simulators never need either).
"""
from __future__ import annotations

import math
import struct

import numpy as np

IR_VERSION, OPSET = 8, 17   # old enough for every onnxruntime RLlib 2.48 ships with

# TensorProto.DataType
FLOAT, UINT8, INT32, INT64, BOOL = 1, 2, 6, 7, 9
ELEM_TYPES = {np.dtype(np.float32): FLOAT, np.dtype(np.uint8): UINT8, np.dtype(np.int32): INT32,
              np.dtype(np.int64): INT64, np.dtype(np.bool_): BOOL}
# What the policy's graph calls its output 0 (RLlib's name: its client reads output 0).
OUTPUT_NAME = "action_dist_inputs"
# The model metadata key that names output 0's distribution where it is not a plain Gaussian
# or categorical: "squashed_gaussian" for SAC (docs/RLLINK.md §4.2); absent: PPO's.
ACTION_DIST_KEY = "action_dist"
SQUASHED_GAUSSIAN = "squashed_gaussian"
# torch.nn.functional activation -> ONNX operator
ONNX_ACTIVATIONS = {"ReLU": "Relu", "Tanh": "Tanh", "Sigmoid": "Sigmoid", "ELU": "Elu"}
# AttributeProto.AttributeType
_ATTR_FLOAT, _ATTR_INT, _ATTR_STRING, _ATTR_FLOATS, _ATTR_INTS = 1, 2, 3, 6, 7


class _Slot:
    """Where the raw bytes of the weight ``name`` go in the serialized model."""

    def __init__(self, name: str, nbytes: int):
        self.name, self.nbytes = name, nbytes


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1   # negative int64 values: two's complement, ten bytes
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _int(field: int, value: int) -> list:
    return [_varint(field << 3) + _varint(value)]


def _float(field: int, value: float) -> list:
    return [_varint(field << 3 | 5) + struct.pack("<f", value)]


def _str(field: int, value: str | bytes) -> list:
    raw = value.encode() if isinstance(value, str) else value
    return [_varint(field << 3 | 2) + _varint(len(raw)) + raw]


def _msg(field: int, *pieces: list) -> list:
    """A length-delimited sub-message made of ``pieces`` (lists of bytes and _Slots)."""
    flat = [p for piece in pieces for p in piece]
    n = sum(p.nbytes if isinstance(p, _Slot) else len(p) for p in flat)
    return [_varint(field << 3 | 2) + _varint(n), *flat]


def _attribute(name: str, value) -> list:
    """An AttributeProto: fields name(1), f(2), i(3), s(4), floats(7), ints(8), type(20)."""
    if isinstance(value, bool) or isinstance(value, (int, np.integer)):
        return _msg(5, _str(1, name), _int(3, int(value)), _int(20, _ATTR_INT))
    if isinstance(value, float):
        return _msg(5, _str(1, name), _float(2, value), _int(20, _ATTR_FLOAT))
    if isinstance(value, str):
        return _msg(5, _str(1, name), _str(4, value), _int(20, _ATTR_STRING))
    values = list(value)
    if values and all(isinstance(v, float) for v in values):
        return _msg(5, _str(1, name), *(_float(7, v) for v in values), _int(20, _ATTR_FLOATS))
    return _msg(5, _str(1, name), *(_int(8, int(v)) for v in values), _int(20, _ATTR_INTS))


def _value_info(field: int, name: str, elem_type: int, dims: list) -> list:
    shape = [_msg(1, _str(2, d) if isinstance(d, str) else _int(1, d)) for d in dims]
    tensor_type = _msg(1, _int(1, elem_type), _msg(2, *shape))
    return _msg(field, _str(1, name), _msg(2, tensor_type))


def _tensor(name: str, shape: tuple, elem_type: int, raw) -> list:
    """A TensorProto: dims(1), data_type(2), name(8), raw_data(9); ``raw`` bytes or a _Slot."""
    nbytes = raw.nbytes if isinstance(raw, _Slot) else len(raw)
    data = [_varint(9 << 3 | 2) + _varint(nbytes), raw]
    return _msg(5, *(_int(1, d) for d in shape), _int(2, elem_type), _str(8, name), data)


class Graph:
    """A graph under construction. Names are the caller's; a weight (``param``) is a float32
    initializer whose bytes each version supplies, a ``const`` one whose bytes are fixed."""

    def __init__(self, name: str = "shmrl_policy"):
        self.name = name
        self._nodes: list = []
        self._initializers: list = []
        self._inputs: list = []
        self._outputs: list = []
        self.shapes: dict[str, tuple] = {}   # weight name -> shape, in the order declared
        self._names: set = set()
        self._counter = 0
        self.metadata: dict[str, str] = {}   # the model's metadata_props (ACTION_DIST_KEY: how to sample output 0)

    def _fresh(self, name: str) -> str:
        if name in self._names:
            raise ValueError(f"the graph already has a value named {name!r}")
        self._names.add(name)
        return name

    def temp(self, prefix: str = "t") -> str:
        """A new name for an intermediate value."""
        self._counter += 1
        return self._fresh(f"{prefix}{self._counter}")

    def input(self, name: str, dims: list, elem_type: int = FLOAT) -> str:
        self._inputs.append(_value_info(11, self._fresh(name), elem_type, dims))
        return name

    def output(self, name: str, dims: list, elem_type: int = FLOAT) -> str:
        self._outputs.append(_value_info(12, name, elem_type, dims))
        return name

    def param(self, name: str, shape: tuple) -> str:
        shape = tuple(int(d) for d in shape)
        self.shapes[self._fresh(name)] = shape
        self._initializers.append(_tensor(name, shape, FLOAT, _Slot(name, 4 * math.prod(shape))))
        return name

    def const(self, name: str, value) -> str:
        arr = np.asarray(value)
        arr = arr.astype("<f4" if arr.dtype.kind == "f" else "<i8", copy=False)
        self._initializers.append(_tensor(self._fresh(name), arr.shape, ELEM_TYPES[np.dtype(arr.dtype.type)],
                                          np.ascontiguousarray(arr).tobytes()))
        return name

    def node(self, op: str, inputs: list[str], output: str | None = None, *, outputs: list[str] | None = None,
             **attributes) -> str:
        """Add ``op``; returns its (first) output's name, a new one unless given."""
        outs = outputs if outputs is not None else [self._fresh(output) if output else self.temp()]
        if outputs is not None:
            for o in outs:
                self._fresh(o)
        self._nodes.append(_msg(1, *(_str(1, i) for i in inputs), *(_str(2, o) for o in outs), _str(4, op),
                                *(_attribute(k, v) for k, v in attributes.items())))
        return outs[0]

    def template(self) -> "ModelTemplate":
        graph = _msg(7, *self._nodes, _str(2, self.name), *self._initializers, *self._inputs, *self._outputs)
        opset = _msg(8, _str(1, ""), _int(2, OPSET))
        meta = [p for k, v in self.metadata.items() for p in _msg(14, _str(1, k), _str(2, v))]
        return ModelTemplate([*_int(1, IR_VERSION), *_str(2, "shmrl"), *graph, *opset, *meta], dict(self.shapes))


class ModelTemplate:
    """The serialized model as fixed pieces; ``publish`` puts the weights' bytes between them."""

    def __init__(self, pieces: list, shapes: dict[str, tuple]):
        merged = []  # runs of fixed bytes joined into one piece
        for p in pieces:
            if isinstance(p, bytes) and merged and isinstance(merged[-1], bytes):
                merged[-1] += p
            else:
                merged.append(p)
        self._pieces = merged
        self.shapes = shapes

    def publish(self, weights: dict[str, np.ndarray]) -> bytes:
        """The model file with ``weights`` (name -> float32-able array) in its slots."""
        missing = self.shapes.keys() - weights.keys()
        if missing:
            raise ValueError(f"no values for the weights {sorted(missing)}")
        raw = {}
        for name, shape in self.shapes.items():
            w = np.ascontiguousarray(weights[name], dtype="<f4")
            if w.shape != shape:
                raise ValueError(f"{name}: shape {w.shape} != {shape}")
            raw[name] = w.tobytes()
        return b"".join(raw[p.name] if isinstance(p, _Slot) else p for p in self._pieces)


def orthogonal(shape: tuple, gain: float, rng: np.random.Generator) -> np.ndarray:
    """An orthogonal matrix (rows or columns, whichever are fewer) of ``shape`` (a conv's
    [out, in, k, k] as [out, in * k * k]) times ``gain``, as torch.nn.init.orthogonal_.
    Here, below both the learner's networks and the client's hand-built MLP, which share it."""
    n_out, n_in = shape[0], math.prod(shape[1:])
    a = rng.standard_normal((max(n_out, n_in), min(n_out, n_in)))
    q, r = np.linalg.qr(a)
    q *= np.sign(np.diag(r))        # a uniformly distributed orthogonal matrix
    w = q if n_out >= n_in else q.T
    return (gain * w).reshape(shape).astype(np.float32)
