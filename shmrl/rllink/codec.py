"""RLlink's bytes: framing, the JSON and binary codecs, and decoding a body into a message
(no schema check: that is ``shmrl.rllink.messages``'s ``validate``).

A frame is 8 ASCII digits (the body length) + body. The JSON body is byte-identical to
what RLlib 2.48 writes. The binary body carries the same schema with numpy arrays as raw
little-endian blocks, for the shared-memory rings:

    b"\\x93RLB" | u32 LE head length | UTF-8 JSON head | zero padding to 8 | data blocks

The head is the message with each ndarray replaced by {"__nd__": [dtype, shape, offset,
nbytes]} and each bytes value by {"__b__": [offset, nbytes]}; offsets count from the start
of the data section (itself 8-aligned in the body) and are multiples of 8. An
``EpisodeBatch`` (the episodes of a message, column-wise) is written as {"__cols__":
{"lengths": ..., "obs": ..., ...}}: a handful of arrays however many chunks it holds,
where the list form costs a descriptor per field per chunk. Keys "__nd__", "__b__" and
"__cols__" are therefore reserved in binary messages. JSON writes an EpisodeBatch in the
list form RLlib reads.

This module knows nothing of sockets, shared memory or torch.
"""
from __future__ import annotations

import json
import math
import reprlib

import numpy as np

from shmrl.core.episode import EpisodeBatch, MultiAgentBatch


class ProtocolError(ValueError):
    """Input that breaks the RLlink protocol; the message says what was wrong."""


HEADER_LEN = 8
MAX_BODY_LEN = 99_999_999

# What a PING may offer in "codecs" (shmrl's extension); the PONG names the one chosen.
CODECS = ("binary", "json")

_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 60


def show(value) -> str:
    """A bounded repr: hostile input can be megabytes."""
    return _repr.repr(value)


# ---------------------------------------------------------------- framing

def frame(body) -> bytes:
    """Header + body: the bytes that go on the wire."""
    n = memoryview(body).nbytes
    if n > MAX_BODY_LEN:
        raise ValueError(f"body of {n} bytes exceeds the RLlink maximum of {MAX_BODY_LEN}")
    return b"".join((b"%08d" % n, body))


def parse_header(header, max_body_len: int = MAX_BODY_LEN) -> int:
    """The body length announced by an 8-byte header."""
    if not isinstance(header, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"frame header must be bytes, got {type(header).__name__}")
    header = bytes(header)
    # bytes.isdigit() is ASCII-only: it refuses spaces, signs and Unicode digits, unlike int().
    if len(header) != HEADER_LEN or not header.isdigit():
        raise ProtocolError(f"frame header {header[:16]!r} is not {HEADER_LEN} ASCII digits")
    n = int(header)
    if n > max_body_len:
        raise ProtocolError(f"frame of {n} bytes exceeds the maximum of {max_body_len}")
    return n


# ---------------------------------------------------------------- JSON codec

def _json_default(obj):
    # Called only for what json cannot write itself, so plain dicts cost nothing extra.
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (EpisodeBatch, MultiAgentBatch)):
        return obj.to_dicts()  # RLlib's list of episode objects
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, (bytes, bytearray, memoryview)):
        raise TypeError("bytes cannot be sent as JSON (only the binary codec carries bytes)")
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def encode_json(msg: dict) -> bytes:
    """The JSON body, with json.dumps' default separators exactly as RLlib writes it."""
    return json.dumps(msg, default=_json_default).encode("utf-8")


# ---------------------------------------------------------------- binary codec

MAGIC = b"\x93RLB"
_ALIGN = 8
_MAX_DIMS = 32
_DTYPES = {s: np.dtype(s) for s in ("<f4", "<f8", "<i8", "<i4", "|u1", "|b1")}
# (kind, itemsize) -> the allowed dtype an array is converted to at encode.
_ENCODE_AS = {("f", 2): "<f4", ("f", 4): "<f4", ("f", 8): "<f8", ("i", 1): "<i4", ("i", 2): "<i4",
              ("i", 4): "<i4", ("i", 8): "<i8", ("u", 1): "|u1", ("u", 2): "<i4", ("u", 4): "<i8",
              ("b", 1): "|b1"}
_PAD = bytes(_ALIGN)


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def encode_binary(msg: dict) -> bytes:
    """The binary body: JSON head with descriptors, then the raw array and bytes blocks."""
    blocks = []
    size = 0  # bytes in the data section so far, always a multiple of 8

    def add_block(buf, n: int) -> int:
        nonlocal size
        offset = size
        blocks.append(buf)
        if n % _ALIGN:
            blocks.append(_PAD[: -n % _ALIGN])
        size += _align(n)
        return offset

    def default(obj):
        if isinstance(obj, np.ndarray):
            dtype = _ENCODE_AS.get((obj.dtype.kind, obj.dtype.itemsize))
            if dtype is None:
                raise ValueError(f"the binary codec cannot carry arrays of dtype {obj.dtype}")
            arr = np.asarray(obj, dtype=dtype, order="C")  # no copy when already fit
            return {"__nd__": [dtype, list(arr.shape), add_block(arr, arr.nbytes), arr.nbytes]}
        if isinstance(obj, (bytes, bytearray, memoryview)):
            n = memoryview(obj).nbytes
            return {"__b__": [add_block(obj, n), n]}
        if isinstance(obj, EpisodeBatch):
            return {"__cols__": obj.columns()}
        if isinstance(obj, MultiAgentBatch):
            return {"__multi__": obj.policies}
        if isinstance(obj, np.generic):
            return obj.item()
        raise TypeError(f"{type(obj).__name__} is not serializable by the binary codec")

    head = json.dumps(msg, default=default, separators=(",", ":")).encode("utf-8")
    if len(head) >= 1 << 32:
        raise ValueError(f"binary head of {len(head)} bytes is too long")
    pad = _PAD[: _align(8 + len(head)) - 8 - len(head)]
    return b"".join((MAGIC, len(head).to_bytes(4, "little"), head, pad, *blocks))


def encode(msg: dict, codec: str) -> bytes:
    """The body of ``msg`` in ``codec`` ("binary" or "json"): the one encoder every
    transport calls."""
    if codec == "binary":
        return encode_binary(msg)
    if codec == "json":
        return encode_json(msg)
    raise ValueError(f"codec must be one of {CODECS}, not {codec!r}")


def _decode_binary(mv: memoryview) -> dict:
    n = len(mv)
    if n < 8:
        raise ProtocolError(f"binary body of {n} bytes is shorter than its 8-byte preamble")
    head_len = int.from_bytes(mv[4:8], "little")
    data_start = _align(8 + head_len)
    if data_start > n:
        raise ProtocolError(f"binary head of {head_len} bytes (data from byte {data_start}) "
                            f"overruns the {n}-byte body")
    data_len = n - data_start

    def block(what, spec, offset, nbytes):
        if type(offset) is not int or type(nbytes) is not int or offset < 0 or nbytes < 0:
            raise ProtocolError(f"{what} descriptor {show(spec)}: offset and nbytes must be ints >= 0")
        if offset % _ALIGN:
            raise ProtocolError(f"{what} descriptor {show(spec)}: offset {offset} is not {_ALIGN}-aligned")
        if offset + nbytes > data_len:
            raise ProtocolError(f"{what} descriptor {show(spec)}: bytes {offset}..{offset + nbytes} "
                                f"lie outside the {data_len}-byte data section")
        return data_start + offset

    def hook(d: dict):
        if "__nd__" in d:
            spec = d["__nd__"]
            if len(d) != 1 or type(spec) is not list or len(spec) != 4:
                raise ProtocolError(f"malformed array descriptor {show(d)}")
            dtype_str, shape, offset, nbytes = spec
            dtype = _DTYPES.get(dtype_str) if type(dtype_str) is str else None
            if dtype is None:
                raise ProtocolError(f"array descriptor: dtype {show(dtype_str)} is not one of {sorted(_DTYPES)}")
            if (type(shape) is not list or len(shape) > _MAX_DIMS
                    or not all(type(s) is int and s >= 0 for s in shape)):
                raise ProtocolError(f"array descriptor: shape {show(shape)} is not a list of at most "
                                    f"{_MAX_DIMS} ints >= 0")
            start = block("array", spec, offset, nbytes)
            if math.prod(shape) * dtype.itemsize != nbytes:
                raise ProtocolError(f"array descriptor {show(spec)}: shape and dtype make "
                                    f"{math.prod(shape) * dtype.itemsize} bytes, not {nbytes}")
            # bytes.translate deletes the 0s and 1s in C: ten times cheaper than numpy's max()
            # for the few flags of an ACT, and linear for a long column.
            if dtype_str == "|b1" and bytes(mv[start:start + nbytes]).translate(None, b"\x00\x01"):
                raise ProtocolError("bool array holds bytes other than 0 and 1")
            return np.frombuffer(mv, dtype, nbytes // dtype.itemsize, start).reshape(shape)
        if "__b__" in d:
            spec = d["__b__"]
            if len(d) != 1 or type(spec) is not list or len(spec) != 2:
                raise ProtocolError(f"malformed bytes descriptor {show(d)}")
            start = block("bytes", spec, *spec)
            return bytes(mv[start:start + spec[1]])
        if "__cols__" in d:
            if len(d) != 1 or type(d["__cols__"]) is not dict:
                raise ProtocolError(f"malformed columnar episodes {show(d)}")
            return Columns(d["__cols__"])
        if "__multi__" in d:
            if len(d) != 1 or type(d["__multi__"]) is not dict:
                raise ProtocolError(f"malformed multi-agent episodes {show(d)}")
            return MultiColumns(d["__multi__"])
        return d

    try:
        msg = json.loads(str(mv[8:8 + head_len], "utf-8"), object_hook=hook)
    except ProtocolError:
        raise
    except Exception as e:  # invalid UTF-8 or JSON, recursion bombs, absurd shapes
        raise ProtocolError(f"binary head is not valid: {e}"[:300]) from None
    if not isinstance(msg, dict):
        raise ProtocolError(f"binary head is a JSON {type(msg).__name__}, not an object")
    return msg


class Columns(dict):
    """The columnar episodes of a binary head, as decoded and not yet validated (a type of
    its own, so that no JSON object can pass for one)."""


class MultiColumns(dict):
    """Multi-agent columnar episodes of a binary head: module_id -> columns, not yet validated."""


def episodes_body_bytes(steps: int, obs_bytes: int, action_size: int, dist_size: int, leaves: int = 1,
                        state_size: int = 0) -> int:
    """An upper bound on the binary body of an EPISODES message of ``steps`` env steps
    (what a request ring must take): ``obs_bytes`` per observation row (all its leaves),
    actions as int64 or float32, and as if every step began a chunk of its own (an
    observation row, flags, version, id and recurrent state more); a descriptor per
    observation leaf."""
    per_step = obs_bytes + 8 * action_size + 4 * (2 + dist_size)
    per_chunk = obs_bytes + 8 + 2 + 8 + 64 + 4 * state_size
    return 4096 + 128 * leaves + steps * (per_step + per_chunk)


def set_state_body_bytes(model_bytes: int) -> int:
    """An upper bound on the body of a SET_STATE for a model file of ``model_bytes``
    (gzip can grow incompressible data a little; base64 takes 4 bytes per 3)."""
    return 1024 + 4 * ((model_bytes + model_bytes // 1000 + 64) // 3 + 1)


# ---------------------------------------------------------------- decoding

def decode(body) -> dict:
    """A message from a JSON or binary body (raises only ProtocolError; no schema check)."""
    if isinstance(body, (bytes, bytearray)):
        mv = memoryview(body)
    elif isinstance(body, memoryview):
        try:  # a flat view of unsigned bytes, whatever shape or format it came in
            mv = body if body.format == "B" and body.ndim == 1 and body.c_contiguous else body.cast("B")
        except (TypeError, ValueError) as e:
            raise ProtocolError(f"body memoryview is unusable: {e}") from None
    else:
        raise ProtocolError(f"body must be bytes, got {type(body).__name__}")
    if not mv:
        raise ProtocolError("empty body")
    if mv[:4] == MAGIC:
        return _decode_binary(mv)
    if mv[:1] != b"{":
        raise ProtocolError(f"body starts with {bytes(mv[:8])!r}: neither a JSON object nor binary")
    try:
        msg = json.loads(str(mv, "utf-8"))
    except Exception as e:  # invalid UTF-8 or JSON, recursion bombs, huge int literals
        raise ProtocolError(f"body is not valid JSON: {e}"[:300]) from None
    if not isinstance(msg, dict):
        raise ProtocolError(f"body is a JSON {type(msg).__name__}, not an object")
    return msg
