"""The coordinator <-> node worker control plane over ZeroMQ. No pickle.

The layers do not cross here: their rows, routing and partial outputs go through the pool's shared-memory
segment and its doorbells, whose layout shm/pool_io.py draws (that layout is the hot path's protocol: a
request's fixed fields, then X, the pairs, one answer line and one partial per node). The socket carries the
rest, each message a ZeroMQ multipart message::

    frame 0: struct "<BB"  (protocol version, MsgType)
    frame 1: the type's fixed header (a struct, below) or, for HELLO, a JSON object

HELLO    worker -> coordinator   JSON: version, pid, node, model/plan digests, slice rows, threads, placement,
                                 the functions it compiled itself (none where the cache held them)
ERROR    worker -> coordinator   header <QB:    request id (0 = none), fatal flag;  frame utf-8 message
                                 (a fatal one is a worker's last words)
MEMBW    coordinator -> worker   header <QQI: request id, bytes to read, repeats  (a STREAM-style read)
MEMBW_RESULT worker -> coordinator header <Qdd: request id, seconds, GB/s (by the worker's own threads)
SHUTDOWN coordinator -> worker   no header

Every decode validates sizes and ranges, and raises ProtocolError naming the problem; the worker answers
that with an ERROR and keeps serving.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass


PROTOCOL_VERSION = 2  # 2: COMPUTE, RESULT, PING and PONG gone (the layers go through shm/pool_io.py)
MAX_HELLO_BYTES = 1 << 20


class ProtocolError(ValueError):
    """A frame or message does not follow the protocol; the message says how."""


class MsgType(enum.IntEnum):
    HELLO = ord("H")
    ERROR = ord("E")
    SHUTDOWN = ord("S")
    MEMBW = ord("B")
    MEMBW_RESULT = ord("b")


PREAMBLE = struct.Struct("<BB")
MEMBW_HDR = struct.Struct("<QQI")
MEMBW_RESULT_HDR = struct.Struct("<Qdd")
MAX_MEMBW_BYTES = 64 << 30
ERROR_HDR = struct.Struct("<QB")


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
class Shutdown:
    pass


def _preamble(kind: MsgType) -> bytes:
    return PREAMBLE.pack(PROTOCOL_VERSION, kind)


def encode_error(m: Error) -> list:
    return [_preamble(MsgType.ERROR), ERROR_HDR.pack(m.request_id, int(m.fatal)), m.message.encode("utf-8", "replace")]


def encode_hello(m: Hello) -> list:
    return [_preamble(MsgType.HELLO), json.dumps(m.info).encode()]


def encode_membw(m: MemBw) -> list:
    return [_preamble(MsgType.MEMBW), MEMBW_HDR.pack(m.request_id, m.nbytes, m.repeats)]


def encode_membw_result(m: MemBwResult) -> list:
    return [_preamble(MsgType.MEMBW_RESULT), MEMBW_RESULT_HDR.pack(m.request_id, m.seconds, m.gb_per_s)]


def encode_shutdown() -> list:
    return [_preamble(MsgType.SHUTDOWN)]


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
    """Frames -> a typed message (the decoders, one per type: DECODERS)."""
    return DECODERS[message_type(frames)](frames)


def _decode_error(frames: list) -> Error:
    _count(frames, 3, "ERROR")
    rid, fatal = _struct(frames[1], ERROR_HDR, "ERROR")
    return Error(rid, bool(fatal), bytes(memoryview(frames[2])).decode("utf-8", "replace"))


def _decode_hello(frames: list) -> Hello:
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


def _decode_membw(frames: list) -> MemBw:
    _count(frames, 2, "MEMBW")
    rid, nbytes, repeats = _struct(frames[1], MEMBW_HDR, "MEMBW")
    if not 0 < nbytes <= MAX_MEMBW_BYTES or not 0 < repeats <= 100:
        raise ProtocolError(f"MEMBW of {nbytes} bytes x {repeats} is out of range")
    return MemBw(rid, nbytes, repeats)


def _decode_membw_result(frames: list) -> MemBwResult:
    _count(frames, 2, "MEMBW_RESULT")
    return MemBwResult(*_struct(frames[1], MEMBW_RESULT_HDR, "MEMBW_RESULT"))


def _decode_shutdown(frames: list) -> Shutdown:
    _count(frames, 1, "SHUTDOWN")
    return Shutdown()


DECODERS = {MsgType.HELLO: _decode_hello, MsgType.ERROR: _decode_error, MsgType.MEMBW: _decode_membw,
            MsgType.MEMBW_RESULT: _decode_membw_result, MsgType.SHUTDOWN: _decode_shutdown}  # the wire table
