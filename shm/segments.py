"""POSIX shared-memory segments that hold one node's expert slices.

One segment per (model digest, plan digest, node), named
``/strata.<model>.<plan>.n<node>``, mode 0600. It starts with a versioned
header::

    magic "STRATASG" | layout version | header bytes | state (0 writing, 1 complete)
    | owner pid | owner start time | node | data bytes | model digest | plan digest
    | layout table (JSON)

``state`` turns complete only after the last data byte is written, so a
half-written segment is never mistaken for a loaded one. The owner (the process
that created it, or that adopted it after its owner died) is the only one that
unlinks it; attachers never do. Every refusal says which segment, why, and the
command that clears it.
"""

from __future__ import annotations

import errno
import json
import logging
import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import posix_ipc
import psutil

log = logging.getLogger(__name__)

PREFIX = "strata."
SHM_DIR = Path("/dev/shm")
MAGIC = b"STRATASG"
LAYOUT_VERSION = 2  # 2: W_down stored as [H, R] rows (blocks along the intermediate axis), no longer transposed
PAGE = 4096
HEADER_STRUCT = struct.Struct("<8sIIIIdiQ32s32sI")  # see the module docstring
STATE_OFFSET = 16  # byte offset of ``state`` inside the header
STATE_WRITING, STATE_COMPLETE = 0, 1


class SegmentError(RuntimeError):
    """A segment is missing, foreign, stale, half-written or cannot be made; the message says how to clear it."""


class SegmentNoSpace(SegmentError):
    """No room for a segment's bytes (in the node, the machine or /dev/shm); nothing of it was left behind.

    ``needed`` and ``free`` are in bytes (``free`` None where unknown); ``errno`` is the
    error the kernel gave when reserving the bytes failed (ENOSPC, ENOMEM, EFBIG), else None.
    """

    def __init__(self, message: str, needed: int, free: int | None, code: int | None = None):
        super().__init__(message)
        self.needed, self.free, self.errno = needed, free, code


_BYTE_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: float) -> str:
    """A size in the largest binary unit it reaches: '512 B', '512.0 KiB', '3.2 MiB', '1.50 GiB'."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    value = float(n)
    for i, unit in enumerate(_BYTE_UNITS):
        value /= 1024
        digits = 1 if i < 2 else 2  # KiB, MiB: one decimal; GiB and up: two
        if abs(round(value, digits)) < 1024 or i == len(_BYTE_UNITS) - 1:
            return f"{value:.{digits}f} {unit}"
    raise AssertionError("unreachable")


def segment_name(model_digest: str, plan_digest: str, node: int) -> str:
    return f"/{PREFIX}{model_digest[:16]}.{plan_digest[:16]}.n{node}"


def clear_hint(name: str) -> str:
    return f"remove it with `strata shm clean {name.lstrip('/')}` (add --force if its owner is alive)"


@dataclass(frozen=True)
class SegmentHeader:
    version: int
    header_bytes: int
    state: int
    owner_pid: int
    owner_start: float
    node: int
    data_bytes: int
    model_digest: str
    plan_digest: str
    layout: dict

    @property
    def complete(self) -> bool:
        return self.state == STATE_COMPLETE

    @property
    def total_bytes(self) -> int:
        return self.header_bytes + self.data_bytes


def process_start_time(pid: int) -> float | None:
    """When a running process started; None if there is none (a zombie counts as gone)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return None


def owner_alive(header: SegmentHeader) -> bool:
    """True while the process that owns the segment still runs (pid reuse is ruled out by start time)."""
    start = process_start_time(header.owner_pid)
    return start is not None and abs(start - header.owner_start) < 1.0


def pack_header(h: SegmentHeader) -> bytes:
    table = json.dumps(h.layout, separators=(",", ":")).encode()
    fixed = HEADER_STRUCT.pack(MAGIC, h.version, h.header_bytes, h.state, h.owner_pid, h.owner_start, h.node,
                               h.data_bytes, h.model_digest.encode(), h.plan_digest.encode(), len(table))
    blob = fixed + table
    if len(blob) > h.header_bytes:
        raise SegmentError(f"header of {len(blob)} bytes does not fit its {h.header_bytes}-byte region")
    return blob


def header_bytes_for(layout: dict) -> int:
    table = len(json.dumps(layout, separators=(",", ":")).encode())
    return -(-(HEADER_STRUCT.size + table) // PAGE) * PAGE


def unpack_header(buf, name: str) -> SegmentHeader:
    if len(buf) < HEADER_STRUCT.size:
        raise SegmentError(f"segment {name} is {len(buf)} bytes, too small for a strata header; {clear_hint(name)}")
    magic, version, hbytes, state, pid, start, node, dbytes, model, plan, tlen = HEADER_STRUCT.unpack_from(buf, 0)
    if magic != MAGIC:
        raise SegmentError(f"segment {name} is not a strata segment (bad magic {magic!r}); {clear_hint(name)}")
    if version != LAYOUT_VERSION:
        raise SegmentError(
            f"segment {name} has layout version {version}, this build reads version {LAYOUT_VERSION}; {clear_hint(name)}"
        )
    if HEADER_STRUCT.size + tlen > min(hbytes, len(buf)):
        raise SegmentError(f"segment {name} has a damaged header (layout table overruns it); {clear_hint(name)}")
    try:
        layout = json.loads(bytes(buf[HEADER_STRUCT.size : HEADER_STRUCT.size + tlen]))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise SegmentError(f"segment {name} has a damaged layout table; {clear_hint(name)}") from None
    return SegmentHeader(version, hbytes, state, pid, start, node, dbytes,
                         model.rstrip(b"\0").decode(), plan.rstrip(b"\0").decode(), layout)


class Segment:
    """A mapped segment. ``owner`` segments unlink on close unless ``keep``."""

    def __init__(self, name: str, mapping: mmap.mmap, header: SegmentHeader, owner: bool):
        self.name = name
        self.map = mapping
        self.header = header
        self.owner = owner
        self.keep = False
        self.closed = False

    @property
    def data(self) -> np.ndarray:
        """The data region as bytes (uint8 view, writable while the map is)."""
        return np.frombuffer(self.map, dtype=np.uint8, count=self.header.data_bytes, offset=self.header.header_bytes)

    def mark_complete(self) -> None:
        struct.pack_into("<I", self.map, STATE_OFFSET, STATE_COMPLETE)
        self.header = unpack_header(self.map, self.name)

    def adopt(self) -> None:
        """Become the owner (the previous owner is gone)."""
        pid, start = os.getpid(), process_start_time(os.getpid()) or time.time()
        struct.pack_into("<Id", self.map, STATE_OFFSET + 4, pid, start)
        self.header = unpack_header(self.map, self.name)
        self.owner = True

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.map.close()
        except BufferError:
            log.debug("segment %s: views still alive; the mapping goes with them", self.name)
        if self.owner and not self.keep:
            unlink(self.name)

    def __enter__(self) -> "Segment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def unlink(name: str) -> bool:
    try:
        posix_ipc.unlink_shared_memory(name)
        return True
    except posix_ipc.ExistentialError:
        return False


def _map(name: str) -> mmap.mmap:
    mem = posix_ipc.SharedMemory(name)
    try:
        return mmap.mmap(mem.fd, mem.size)
    finally:
        mem.close_fd()


def shm_free() -> int | None:
    """Bytes free to us on the filesystem that holds the segments (None if there is none)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _no_room(name: str, size: int, exc: OSError) -> SegmentNoSpace:
    free = shm_free()
    have = f"{SHM_DIR} has {human_bytes(free)} ({free} bytes) free" if free is not None else f"{SHM_DIR} is gone"
    why = {errno.ENOSPC: "no space left on device",
           errno.ENOMEM: "out of memory to back it",
           errno.EFBIG: "file too large for the filesystem"}[exc.errno]
    return SegmentNoSpace(
        f"cannot reserve segment {name}: it needs {human_bytes(size)} ({size} bytes) but {have} "
        f"({errno.errorcode[exc.errno]}: {why}; another segment may have taken the room since it was checked); "
        f"nothing was left behind. Free room in {SHM_DIR} (`strata shm list`; `strata shm clean --all` removes "
        "leftovers), use more nodes, or place more experts on the GPU",
        size, free, exc.errno)


def _create_map(name: str, size: int) -> mmap.mmap:
    """Make segment ``name`` (O_CREX: never someone else's), reserve all ``size`` bytes and map it.

    The bytes are reserved with posix_fallocate before the map exists: tmpfs files are
    sparse, so without it a full /dev/shm shows up later as SIGBUS on a write. On any
    failure the segment this call made is unlinked again.
    """
    mem = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=0)  # raises before making anything
    try:
        try:
            os.posix_fallocate(mem.fd, 0, size)  # also sets the size
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                unlink(name)
                raise _no_room(name, size, exc) from exc
            raise
        return mmap.mmap(mem.fd, size)
    except BaseException:
        unlink(name)  # idempotent: already gone after a no-room refusal
        raise
    finally:
        mem.close_fd()


def read_header(name: str) -> SegmentHeader:
    """The header of an existing segment (raises SegmentError if absent or foreign)."""
    try:
        m = _map(name)
    except posix_ipc.ExistentialError:
        raise SegmentError(f"segment {name} does not exist") from None
    except posix_ipc.PermissionsError:
        raise SegmentError(f"segment {name}: permission denied (another user's?); {clear_hint(name)}") from None
    except ValueError:  # zero-length segment
        raise SegmentError(f"segment {name} is empty; {clear_hint(name)}") from None
    try:
        return unpack_header(m, name)
    finally:
        m.close()


def check_room(nbytes: int, node_free: int | None, what: str) -> None:
    """Refuse, with the numbers, a segment that the node, the machine or /dev/shm cannot hold."""
    avail = psutil.virtual_memory().available
    for label, free in (("the node", node_free), ("the machine", avail), (str(SHM_DIR), shm_free())):
        if free is not None and nbytes > free:
            raise SegmentNoSpace(
                f"{what} needs {human_bytes(nbytes)} ({nbytes} bytes) but {label} has {human_bytes(free)} "
                f"({free} bytes) free; free memory, use more nodes, or place more experts on the GPU",
                nbytes, free)


def create(name: str, node: int, model_digest: str, plan_digest: str, layout: dict, data_bytes: int,
           node_free: int | None = None) -> Segment:
    """A new segment in state 'writing', owned by this process."""
    hbytes = header_bytes_for(layout)
    check_room(hbytes + data_bytes, node_free, f"segment {name}")
    pid = os.getpid()
    header = SegmentHeader(LAYOUT_VERSION, hbytes, STATE_WRITING, pid, process_start_time(pid) or time.time(),
                           node, data_bytes, model_digest, plan_digest, layout)
    blob = pack_header(header)
    size = hbytes + data_bytes
    try:
        m = _create_map(name, size)  # removes what it made if it fails
    except posix_ipc.ExistentialError:
        raise SegmentError(f"segment {name} already exists; {clear_hint(name)}") from None
    except (OSError, posix_ipc.Error) as exc:
        raise SegmentError(f"cannot create segment {name} ({human_bytes(size)}): {exc}") from exc
    try:
        m[: len(blob)] = blob
        return Segment(name, m, header, owner=True)
    except BaseException:
        m.close()
        unlink(name)
        raise


def attach(name: str, model_digest: str, plan_digest: str) -> Segment:
    """Map a complete segment of this model and plan, without owning it."""
    header = read_header(name)
    validate(name, header, model_digest, plan_digest)
    if not header.complete:
        who = f"its owner pid {header.owner_pid} is still writing it" if owner_alive(header) else \
            f"its owner pid {header.owner_pid} died while writing it"
        raise SegmentError(f"segment {name} is half-written ({who}); {clear_hint(name)}")
    return Segment(name, _map(name), header, owner=False)


def validate(name: str, header: SegmentHeader, model_digest: str, plan_digest: str) -> None:
    if header.model_digest != model_digest:
        raise SegmentError(
            f"segment {name} holds model {header.model_digest}, not {model_digest} (stale or foreign); {clear_hint(name)}"
        )
    if header.plan_digest != plan_digest:
        raise SegmentError(
            f"segment {name} holds plan {header.plan_digest}, not {plan_digest} (stale or foreign); {clear_hint(name)}"
        )


def open_or_create(name: str, node: int, model_digest: str, plan_digest: str, layout: dict, data_bytes: int,
                   node_free: int | None = None) -> tuple[Segment, bool]:
    """(segment, needs_fill). Reuses a complete matching segment: adopting it when its
    owner is gone, sharing it (without owning) while its owner lives; rebuilds a
    half-written one whose owner died; refuses the rest."""
    try:
        header = read_header(name)
    except SegmentError as exc:
        if "does not exist" not in str(exc):
            raise
        return create(name, node, model_digest, plan_digest, layout, data_bytes, node_free), True
    validate(name, header, model_digest, plan_digest)
    alive = owner_alive(header)
    if header.complete and header.layout == layout and header.data_bytes == data_bytes:
        seg = Segment(name, _map(name), header, owner=False)
        if alive and header.owner_pid != os.getpid():
            # another live engine of the same model and plan: share its pages, never unlink them
            log.info("segment %s: shared with its owner pid %s, no reload", name, header.owner_pid)
            return seg, False
        seg.adopt()
        log.info("segment %s: reattached (complete, %d bytes), no reload", name, header.data_bytes)
        return seg, False
    if not header.complete and not alive:
        log.warning("segment %s: half-written by dead pid %s; removing and rebuilding", name, header.owner_pid)
        unlink(name)
        return create(name, node, model_digest, plan_digest, layout, data_bytes, node_free), True
    if not header.complete:
        raise SegmentError(f"segment {name} is half-written and its owner pid {header.owner_pid} is still writing "
                           f"it; {clear_hint(name)}")
    raise SegmentError(f"segment {name} has a different layout than this plan expects; {clear_hint(name)}")


@dataclass(frozen=True)
class SegmentInfo:
    name: str
    size: int
    header: SegmentHeader | None
    error: str | None

    @property
    def owner_alive(self) -> bool:
        return self.header is not None and owner_alive(self.header)


def list_segments() -> list[SegmentInfo]:
    """Every segment with the strata prefix, readable or not."""
    out = []
    if not SHM_DIR.is_dir():
        return out
    for entry in sorted(SHM_DIR.iterdir()):
        if not entry.name.startswith(PREFIX):
            continue
        name = "/" + entry.name
        try:
            size = entry.stat().st_size
            out.append(SegmentInfo(name, size, read_header(name), None))
        except (SegmentError, OSError) as exc:
            out.append(SegmentInfo(name, entry.stat().st_size if entry.exists() else 0, None, str(exc)))
    return out


def clean(names: list[str] | None = None, force: bool = False) -> list[tuple[str, str]]:
    """Remove segments (all strata ones when ``names`` is None); returns (name, what happened)."""
    wanted = {("/" + n.lstrip("/")) for n in names} if names else None
    results = []
    for info in list_segments():
        if wanted is not None and info.name not in wanted:
            continue
        if info.owner_alive and not force:
            results.append((info.name, f"kept: owner pid {info.header.owner_pid} is alive (use --force)"))
            continue
        results.append((info.name, "removed" if unlink(info.name) else "already gone"))
    if wanted:
        found = {n for n, _ in results}
        results.extend((n, "no such segment") for n in sorted(wanted - found))
    return results
