"""The coordinator <-> node worker wire format. No pickle.

Every message is a ZeroMQ multipart message::

    frame 0: struct "<BB"  (protocol version, MsgType)
    frame 1: the type's fixed header (a struct, below) or, for HELLO, a JSON object
    frame 2+: raw little-endian arrays; their dtypes are fixed per type and their
              shapes come from the header

COMPUTE  coordinator -> worker   header <QIIII: request id, layer, T, P, H
                                 frames X [T, H] f32, tokens [P] i32, experts [P] i32, weights [P] f32
RESULT   worker -> coordinator   header <QIIQQqq: request id, T, H, compute ns, expert bytes read,
                                 received and sent at (CLOCK_MONOTONIC ns, shared by the processes);  frame Y [T, H] f32
ERROR    worker -> coordinator   header <QB:    request id (0 = none), fatal flag;  frame utf-8 message
HELLO    worker -> coordinator   JSON: version, pid, node, model/plan digests, slice rows, threads, placement,
                                 the functions it compiled itself (none where the cache held them)
PING     coordinator -> worker   header <Q: request id      (an empty round trip, the benchmark's floor)
PONG     worker -> coordinator   header <Q: request id
MEMBW    coordinator -> worker   header <QQI: request id, bytes to read, repeats  (a STREAM-style read)
MEMBW_RESULT worker -> coordinator header <Qdd: request id, seconds, GB/s (by the worker's own pinned threads)
SHUTDOWN coordinator -> worker   no header

Every decode validates sizes, dtypes, shapes and ranges, and raises
ProtocolError naming the problem; the worker answers that with an ERROR and
keeps serving.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass

import numpy as np

PROTOCOL_VERSION = 1
MAX_HELLO_BYTES = 1 << 20


class ProtocolError(ValueError):
    """A frame or message does not follow the protocol; the message says how."""


class MsgType(enum.IntEnum):
    HELLO = ord("H")
    COMPUTE = ord("C")
    RESULT = ord("R")
    ERROR = ord("E")
    PING = ord("P")
    PONG = ord("Q")
    SHUTDOWN = ord("S")
    MEMBW = ord("B")
    MEMBW_RESULT = ord("b")


PREAMBLE = struct.Struct("<BB")
COMPUTE_HDR = struct.Struct("<QIIII")
RESULT_HDR = struct.Struct("<QIIQQqq")
MEMBW_HDR = struct.Struct("<QQI")
MEMBW_RESULT_HDR = struct.Struct("<Qdd")
MAX_MEMBW_BYTES = 64 << 30
ERROR_HDR = struct.Struct("<QB")
PING_HDR = struct.Struct("<Q")


@dataclass(frozen=True)
class Compute:
    request_id: int
    layer: int
    x: np.ndarray  # [T, H] float32
    tokens: np.ndarray  # [P] int32 row of x per pair
    experts: np.ndarray  # [P] int32
    weights: np.ndarray  # [P] float32


@dataclass(frozen=True)
class Result:
    request_id: int
    y: np.ndarray  # [T, H] float32
    compute_ns: int
    bytes_read: int = 0  # expert weight bytes this request touched on the node
    received_ns: int = 0  # time.monotonic_ns() when the worker had the request
    sent_ns: int = 0  # time.monotonic_ns() just before the reply went out


@dataclass(frozen=True)
class MemBw:
    request_id: int
    nbytes: int
    repeats: int


@dataclass(frozen=True)
class MemBwResult:
    request_id: int
    seconds: float
    gb_per_s: float


@dataclass(frozen=True)
class Error:
    request_id: int
    fatal: bool
    message: str


@dataclass(frozen=True)
class Hello:
    info: dict


@dataclass(frozen=True)
class Ping:
    request_id: int


@dataclass(frozen=True)
class Pong:
    request_id: int


@dataclass(frozen=True)
class Shutdown:
    pass


def _preamble(kind: MsgType) -> bytes:
    return PREAMBLE.pack(PROTOCOL_VERSION, kind)


def encode_compute(m: Compute) -> list:
    T, H = m.x.shape
    return [
        _preamble(MsgType.COMPUTE),
        COMPUTE_HDR.pack(m.request_id, m.layer, T, m.tokens.shape[0], H),
        np.ascontiguousarray(m.x, dtype="<f4"),
        np.ascontiguousarray(m.tokens, dtype="<i4"),
        np.ascontiguousarray(m.experts, dtype="<i4"),
        np.ascontiguousarray(m.weights, dtype="<f4"),
    ]


def encode_result(m: Result) -> list:
    T, H = m.y.shape
    return [_preamble(MsgType.RESULT), RESULT_HDR.pack(m.request_id, T, H, m.compute_ns, m.bytes_read,
                                                                 m.received_ns, m.sent_ns),
            np.ascontiguousarray(m.y, dtype="<f4")]


def encode_error(m: Error) -> list:
    return [_preamble(MsgType.ERROR), ERROR_HDR.pack(m.request_id, int(m.fatal)), m.message.encode("utf-8", "replace")]


def encode_hello(m: Hello) -> list:
    return [_preamble(MsgType.HELLO), json.dumps(m.info).encode()]


def encode_ping(m: Ping) -> list:
    return [_preamble(MsgType.PING), PING_HDR.pack(m.request_id)]


def encode_pong(m: Pong) -> list:
    return [_preamble(MsgType.PONG), PING_HDR.pack(m.request_id)]


def encode_membw(m: MemBw) -> list:
    return [_preamble(MsgType.MEMBW), MEMBW_HDR.pack(m.request_id, m.nbytes, m.repeats)]


def encode_membw_result(m: MemBwResult) -> list:
    return [_preamble(MsgType.MEMBW_RESULT), MEMBW_RESULT_HDR.pack(m.request_id, m.seconds, m.gb_per_s)]


def encode_shutdown() -> list:
    return [_preamble(MsgType.SHUTDOWN)]


def _array(frame, dtype: str, shape: tuple[int, ...], what: str) -> np.ndarray:
    buf = memoryview(frame)
    expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if buf.nbytes != expected:
        raise ProtocolError(f"{what} frame has {buf.nbytes} bytes; expected {expected} for {dtype} {list(shape)}")
    return np.frombuffer(buf, dtype=dtype).reshape(shape)


def _struct(frame, st: struct.Struct, what: str) -> tuple:
    buf = memoryview(frame)
    if buf.nbytes != st.size:
        raise ProtocolError(f"{what} header has {buf.nbytes} bytes; expected {st.size}")
    return st.unpack(buf)


def _count(frames: list, n: int, what: str) -> None:
    if len(frames) != n:
        raise ProtocolError(f"{what} message has {len(frames)} frames; expected {n}")


def message_type(frames: list) -> MsgType:
    if not frames:
        raise ProtocolError("empty message")
    version, kind = _struct(frames[0], PREAMBLE, "preamble")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version}; this side speaks version {PROTOCOL_VERSION}")
    try:
        return MsgType(kind)
    except ValueError:
        raise ProtocolError(f"unknown message type {kind!r}") from None


def decode(frames: list):
    """Frames -> a typed message (without range checks that need the model: see check_compute)."""
    kind = message_type(frames)
    if kind == MsgType.COMPUTE:
        _count(frames, 6, "COMPUTE")
        rid, layer, T, P, H = _struct(frames[1], COMPUTE_HDR, "COMPUTE")
        return Compute(rid, layer, _array(frames[2], "<f4", (T, H), "X"), _array(frames[3], "<i4", (P,), "tokens"),
                       _array(frames[4], "<i4", (P,), "experts"), _array(frames[5], "<f4", (P,), "weights"))
    if kind == MsgType.RESULT:
        _count(frames, 3, "RESULT")
        rid, T, H, ns, nbytes, received, sent = _struct(frames[1], RESULT_HDR, "RESULT")
        return Result(rid, _array(frames[2], "<f4", (T, H), "Y"), ns, nbytes, received, sent)
    if kind == MsgType.ERROR:
        _count(frames, 3, "ERROR")
        rid, fatal = _struct(frames[1], ERROR_HDR, "ERROR")
        return Error(rid, bool(fatal), bytes(memoryview(frames[2])).decode("utf-8", "replace"))
    if kind == MsgType.HELLO:
        _count(frames, 2, "HELLO")
        raw = bytes(memoryview(frames[1]))
        if len(raw) > MAX_HELLO_BYTES:
            raise ProtocolError(f"HELLO of {len(raw)} bytes exceeds {MAX_HELLO_BYTES}")
        try:
            info = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ProtocolError(f"HELLO is not JSON: {exc}") from None
        if not isinstance(info, dict):
            raise ProtocolError("HELLO must be a JSON object")
        return Hello(info)
    if kind in (MsgType.PING, MsgType.PONG):
        _count(frames, 2, kind.name)
        (rid,) = _struct(frames[1], PING_HDR, kind.name)
        return Ping(rid) if kind == MsgType.PING else Pong(rid)
    if kind == MsgType.MEMBW:
        _count(frames, 2, "MEMBW")
        rid, nbytes, repeats = _struct(frames[1], MEMBW_HDR, "MEMBW")
        if not 0 < nbytes <= MAX_MEMBW_BYTES or not 0 < repeats <= 100:
            raise ProtocolError(f"MEMBW of {nbytes} bytes x {repeats} is out of range")
        return MemBw(rid, nbytes, repeats)
    if kind == MsgType.MEMBW_RESULT:
        _count(frames, 2, "MEMBW_RESULT")
        return MemBwResult(*_struct(frames[1], MEMBW_RESULT_HDR, "MEMBW_RESULT"))
    _count(frames, 1, "SHUTDOWN")
    return Shutdown()


def check_compute(m: Compute, num_layers: int, num_experts: int, hidden: int, max_tokens: int) -> None:
    """Range checks that need the model's geometry."""
    T, H = m.x.shape
    if H != hidden:
        raise ProtocolError(f"X has hidden size {H}; this model's is {hidden}")
    if not 0 <= m.layer < num_layers:
        raise ProtocolError(f"layer {m.layer} out of range [0, {num_layers})")
    if T > max_tokens:
        raise ProtocolError(f"{T} tokens exceed the worker's limit of {max_tokens}")
    if m.tokens.size:
        if m.tokens.min() < 0 or m.tokens.max() >= T:
            raise ProtocolError(f"token index out of range [0, {T})")
        if m.experts.min() < 0 or m.experts.max() >= num_experts:
            raise ProtocolError(f"expert id out of range [0, {num_experts})")
        if not np.all(np.isfinite(m.weights)):
            raise ProtocolError("routing weights must be finite")
        pairs = m.tokens.astype(np.int64) * num_experts + m.experts
        if np.unique(pairs).size != pairs.size:
            raise ProtocolError("a (token, expert) pair appears twice")
