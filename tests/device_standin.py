"""A NumPy-backed stand-in for CuPy under which the whole engine takes its GPU path on the CPU, counting what a GPU
would be asked to do.

Device arrays are ``DeviceArray``, a NumPy subclass: ops.py's host paths (which take plain ndarrays only) are
skipped and its device paths taken, and every kernel (device_ops, device/format_kernels, device/experts,
device/router) runs through tests/cuda_emulator.py. Streams and events are no-ops, pinned memory is plain memory,
and the "GPU" reports 64 GB free. What it checks: that the device path's code computes what the CPU path computes
(tests/test_device_decoder.py); not CUDA's rounding, concurrency or speed (tests/test_gpu.py, on a GPU).

``COUNTS`` tallies, as CuPy would do them on a GPU (tests/test_device_counts.py):

    launches       a RawModule kernel; an elementwise, reduction or matmul call; a gather or scatter (an
                   index by an array); a copy between device arrays; concatenate, sort, where, ...
    allocations    a new device array (an output CuPy allocates; a view allocates nothing)
    uploads        host -> device copies (asarray of a host array, a host array assigned into a device one)
    downloads      device -> host copies (asnumpy, .get)
    syncs          the host waiting on the device: every blocking download, Event and Stream.synchronize
    host_functions host functions queued on a stream (xp.launch_host_func): run at once, in stream order
    graph_launches a captured graph launched (Stream.end_capture's Graph.launch)

``recording()`` lists, in order, every launch and copy the device is asked for, each with what a captured CUDA graph
would fix in it: the kernel or call, its grid, block and shared memory, its device arrays' addresses, shapes and
strides and its scalars; a copy's device side, and its host side's address where that is page-locked
(``cupyx.empty_pinned``, ``cuda.runtime.hostRegister``) or a mark never seen twice where it is pageable (a fresh
host array: a graph could not replay that copy with the next step's data); host functions' addresses and user data.
Two steps whose records are equal queue the same work on the same memory: one captured graph replays both.

Streams: ``cuda.get_current_stream()`` is the innermost ``with stream:`` or the null stream (ptr 0); every launch,
copy and host function goes to the stream it names or the current one. Between ``Stream.begin_capture`` and
``end_capture`` (one capture at a time) the capturing stream's work is kept for the graph instead of run, as CUDA
captures it: a kernel, copy, fill, in-place operation or host function is not run; an operation that makes a new
array computes it now (its shape; the values are last step's) and keeps its recomputation into that array's
memory. ``Graph.launch`` runs the kept work in order, reading the inputs as they are then. Work on another stream
runs at once (it is not part of the graph), and work on the null stream while a blocking stream captures is
refused (below).

What the stand-in refuses while a stream captures, each as CuPy or CUDA refuses it (CuPy's sources at
cupy/cupy, CuPy 13 and 14; the CUDA runtime's stream-capture rules), with the same exception and message; each
rule has a test in tests/test_device_standin.py::test_refused_inside_a_capture:

    rule              what                                          raises                               mirrors
    h2d               ndarray.set; a host array assigned into a     RuntimeError('the current stream is  memory.pyx MemoryPointer.copy_from_host_async,
                      device array; cupy.asarray/array of host      capturing, so H2D transfers are      called by core.pyx ndarray.set, __setitem__
                      data; cupy.concatenate of more than 8         disallowed')                         (_ndarray_setitem -> array), _array_default;
                      arrays (its pointer table is uploaded)                                             _routines_manipulation.pyx
                                                                                                         _concatenate_single_kernel (core.array(ptrs))
    d2h               ndarray.get (blocking or not, any out);       RuntimeError('the current stream is  memory.pyx MemoryPointer.copy_to_host_async,
                      cupy.asnumpy; int(), float(), bool(),         capturing, so D2H transfers are      called by core.pyx ndarray.get (and
                      .item(), .tolist() of a device array          disallowed')                         __int__/__float__/item/tolist through get)
    sync              Stream.synchronize of the capturing stream,   CUDARuntimeError('cudaErrorStream    stream.pyx Stream.synchronize
                      Event.synchronize of an event it recorded,    CaptureUnsupported: operation not    (cudaStreamSynchronize), Event.synchronize
                      Device.synchronize                            permitted when stream is capturing') (cudaEventSynchronize), device.pyx
                                                                                                         Device.synchronize (cudaDeviceSynchronize)
    free              the memory pool's free_all_blocks (cudaFree   CUDARuntimeError(cudaErrorStream     memory.pyx MemoryPool.free_all_blocks ->
                      synchronizes the device)                      CaptureUnsupported)                  runtime.free
    pageable          runtime.memcpyAsync with a host side that is  CUDARuntimeError(cudaErrorStream     CUDA: a copy with pageable host memory is
                      neither pinned nor host-registered            CaptureUnsupported)                  synchronous, which a capture cannot hold
    legacy            work queued on the null stream while a        CUDARuntimeError('cudaErrorStream    CUDA: the legacy stream synchronizes with
                      blocking stream captures                      CaptureImplicit: operation would     every blocking stream
                                                                    make the legacy stream depend on a
                                                                    capturing blocking stream')
    default stream    begin_capture on the null stream              RuntimeError('cannot capture on the  stream.pyx Stream.begin_capture
                                                                    default (legacy) stream')
    state             begin_capture while a capture is in progress; CUDARuntimeError('cudaErrorIllegal    cudaStreamBeginCapture, cudaStreamEndCapture
                      end_capture of a stream that is not           State: the operation cannot be
                      capturing                                     performed in the present state')
    pool              a new array from CuPy's pool (an allocation   CaptureHazard (the stand-in's own)   CuPy captures in relaxed mode
                      outside cupy.cuda.using_allocator, or the                                          (stream.pyx begin_capture), so CUDA lets
                      pool's malloc)                                                                     cudaMalloc through; but "the captured graph
                                                                                                         would be invalid" (cudaThreadExchangeStream
                                                                                                         CaptureMode): its replays write memory the
                                                                                                         pool hands out again

``cuda.runtime.memcpyAsync(dst, src, size, kind, stream)`` copies between raw addresses (all host memory here);
inside a capture it is kept for the graph, as CUDA keeps a memcpy node.

Allocations under ``cupy.cuda.using_allocator`` are the allocator's: coordinator/gpu/arena.py hands out places
in its buffer (real memory here too, so an array that outlived its step would be overwritten by the next one, as
on a GPU), each array holding its MemoryPointer as CuPy's does (so the allocator's UnownedMemory owner dies with
the last array on it), and only what it takes from the pool (``get_default_memory_pool().malloc``) counts.

    with device_standin.installed(build_dir, monkeypatch):  ... Engine.open(..., EngineConfig(device="cuda"))
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import itertools
import sys
import types
import weakref

import numpy as np

import cuda_emulator

FREE_BYTES = 64 << 30
NAME = b"CPU stand-in (tests/device_standin.py)"
COUNTS: collections.Counter = collections.Counter()
# NumPy functions that are views (no launch, no allocation) when CuPy runs them
VIEWS = {np.reshape, np.transpose, np.swapaxes, np.squeeze, np.expand_dims, np.broadcast_to, np.shape, np.ndim,
         np.size, np.result_type, np.may_share_memory, np.shares_memory}


_ALLOCATOR: list = [None]  # the allocator of cupy.cuda.using_allocator, or None: CuPy's pool
RECORD: list = [None]  # the list recording() fills, or None
CAPTURE: list = [None]  # the work of a stream capture in progress (Stream.begin_capture), or None
CAPTURING: list = [None]  # the stream whose capture is in progress, or None
_CURRENT: list = []  # the streams made current by ``with stream:``, innermost last
_PINNED: dict[int, int] = {}  # page-locked host ranges: start address -> bytes
_FRESH = itertools.count()  # the marks of pageable host memory, each used once


def _pin(start: int, size: int) -> None:
    _PINNED[start] = size


def _desc(x):
    """What a captured graph fixes of a launch's or copy's argument (module docstring)."""
    if isinstance(x, DeviceArray):
        return ("device", x.__array_interface__["data"][0], x.shape, x.strides, x.dtype.str)
    if isinstance(x, np.ndarray):
        at = x.__array_interface__["data"][0]
        if any(start <= at and at + x.nbytes <= start + size for start, size in _PINNED.items()):
            return ("pinned", at, x.shape, x.strides, x.dtype.str)
        return ("pageable", next(_FRESH))
    if isinstance(x, np.generic):
        return ("scalar", x.dtype.str, x.item())
    if isinstance(x, (tuple, list)):
        return tuple(_desc(v) for v in x)
    if isinstance(x, slice):
        return ("slice", x.start, x.stop, x.step)
    return ("value", getattr(x, "__name__", None) or repr(x))


def _record(kind: str, *items) -> None:
    if RECORD[0] is not None:
        RECORD[0].append((kind, *(_desc(i) for i in items)))


# cudaGetErrorName, cudaGetErrorString of the errors a capture meets
CUDA_ERRORS = {
    401: ("cudaErrorIllegalState", "the operation cannot be performed in the present state"),
    801: ("cudaErrorNotSupported", "operation not supported"),
    900: ("cudaErrorStreamCaptureUnsupported", "operation not permitted when stream is capturing"),
    906: ("cudaErrorStreamCaptureImplicit",
          "operation would make the legacy stream depend on a capturing blocking stream"),
}
H2D_REFUSED = "the current stream is capturing, so H2D transfers are disallowed"  # cupy/cuda/memory.pyx
D2H_REFUSED = "the current stream is capturing, so D2H transfers are disallowed"  # cupy/cuda/memory.pyx


class CUDARuntimeError(RuntimeError):
    """cupy_backends.cuda.api.runtime.CUDARuntimeError: 'name: description' of a cudaError_t, and its status."""

    def __init__(self, status: int):
        self.status = status
        super().__init__("%s: %s" % CUDA_ERRORS[status])


class CaptureHazard(RuntimeError):
    """What CUDA lets a relaxed capture do but makes its graph wrong (the module docstring's table, rule "pool")."""


def _stream_of(stream=None):
    """The stream work goes to: the one named, else the current one."""
    if stream is None:
        return _CURRENT[-1] if _CURRENT else _NULL[0]
    if isinstance(stream, int):  # a raw cudaStream_t
        return _STREAMS.get(stream, _NULL[0])
    return stream


def _capture_of(stream=None) -> bool:
    """Whether work queued on ``stream`` (default: the current one) goes into the capture in progress; raises
    where CUDA refuses to queue it at all (rule "legacy")."""
    capturing = CAPTURING[0]
    if capturing is None:
        return False
    s = _stream_of(stream)
    if s is capturing:
        return True
    if s.ptr == 0 and not capturing.non_blocking:
        raise CUDARuntimeError(906)
    return False


def _capturing() -> bool:
    return CAPTURE[0] is not None


def _deferred(work, stream=None) -> bool:
    """Work (a function of nothing) queued on ``stream``: kept for the graph and True where that stream captures;
    else False (the caller runs it now)."""
    if not _capture_of(stream):
        return False
    CAPTURE[0].append(work)
    return True


def _recomputed(out, compute) -> None:
    """Inside a capture, an op whose result is a new array ``out``: the graph computes it again into out's memory
    (its inputs are read when the graph runs, as a kernel reads them)."""
    if _capture_of() and isinstance(out, np.ndarray):
        CAPTURE[0].append(lambda: _host(out).__setitem__(Ellipsis, compute()))


def _h2d(stream=None) -> None:
    """A host -> device copy through CuPy's MemoryPointer.copy_from_host_async on ``stream``."""
    if _capture_of(stream):
        raise RuntimeError(H2D_REFUSED)


def _d2h(stream=None) -> None:
    """A device -> host copy through CuPy's MemoryPointer.copy_to_host_async on ``stream``."""
    if _capture_of(stream):
        raise RuntimeError(D2H_REFUSED)


def _no_pool_block() -> None:
    if _capture_of():
        raise CaptureHazard("a memory-pool allocation inside a stream capture: the graph's replays would write "
                            "memory the pool hands out again")


class _Graph:
    """cupy.cuda.graph.Graph: the captured work, run in order by ``launch``."""

    def __init__(self, work: list):
        self.work = work

    def launch(self, stream=None) -> None:
        COUNTS["graph_launches"] += 1
        _record("graph", id(self))
        for work in self.work:
            work()


@contextlib.contextmanager
def recording():
    """Every launch and copy inside, in order (module docstring); yields the list."""
    events: list = []
    previous, RECORD[0] = RECORD[0], events
    try:
        yield events
    finally:
        RECORD[0] = previous


class _Block:
    """A block of CuPy's pool: host memory here."""

    def __init__(self, size: int):
        self.buffer = np.empty(max(size, 1), np.uint8)
        self.ptr = self.buffer.ctypes.data


class _UnownedMemory:
    """cupy.cuda.UnownedMemory: ``size`` bytes at ``ptr`` that ``owner`` keeps alive."""

    def __init__(self, ptr: int, size: int, owner, device_id: int = -1):
        self.ptr, self.size, self.owner = ptr, size, owner


class _MemoryPointer:
    """cupy.cuda.MemoryPointer: a place in a memory (a pool block or an UnownedMemory); + an offset gives a later
    place in the same memory."""

    def __init__(self, mem, offset: int = 0):
        self.mem, self.offset = mem, offset

    @property
    def ptr(self) -> int:
        return self.mem.ptr + self.offset

    device_id = 0  # the one "device"

    def __add__(self, offset: int) -> "_MemoryPointer":
        return _MemoryPointer(self.mem, self.offset + offset)


class _Pool:
    def free_all_blocks(self, stream=None) -> None:
        if CAPTURING[0] is not None:
            raise CUDARuntimeError(900)

    def __init__(self):
        self.handed_out = 0

    def malloc(self, size: int) -> _MemoryPointer:
        _no_pool_block()
        COUNTS["allocations"] += 1
        self.handed_out += size
        return _MemoryPointer(_Block(size))

    def used_bytes(self) -> int:
        """Every block's bytes handed out (the stand-in frees none back to its pool)."""
        return self.handed_out


_POOL = _Pool()


@contextlib.contextmanager
def _using_allocator(allocator=None):
    previous, _ALLOCATOR[0] = _ALLOCATOR[0], allocator
    try:
        yield
    finally:
        _ALLOCATOR[0] = previous


def _new(result):
    """A new device array holding ``result``: counted as CuPy's pool's allocation, or placed by the allocator in
    use (its memory, as CuPy would)."""
    if not isinstance(result, np.ndarray):
        return result
    if _ALLOCATOR[0] is None:
        _no_pool_block()
        COUNTS["allocations"] += 1
        return _device(result)
    place = _ALLOCATOR[0](result.nbytes)
    raw = (ctypes.c_uint8 * max(result.nbytes, 1)).from_address(place.ptr)
    raw.place = place  # the array holds its memory pointer, as a CuPy array does: its allocator sees it freed
    view = np.frombuffer(raw, np.uint8, count=result.nbytes).view(result.dtype).reshape(result.shape)
    view[...] = result
    return _device(view)


def _host(a):
    """A DeviceArray as a plain ndarray view (what NumPy computes on)."""
    return a.view(np.ndarray) if isinstance(a, DeviceArray) else a


def _fancy(key) -> bool:
    """An index that gathers (an array or list in it), not a view."""
    keys = key if isinstance(key, tuple) else (key,)
    return any(isinstance(k, (np.ndarray, list)) for k in keys)


class DeviceArray(np.ndarray):
    """An array "on the device": NumPy memory, a type the host paths do not take; CuPy's work counted."""

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        COUNTS["launches"] += 1
        out = kwargs.get("out")
        if out is not None:
            kwargs["out"] = tuple(_host(o) for o in out)

        def compute():
            return getattr(ufunc, method)(*(_host(a) for a in inputs), **kwargs)
        if out is not None:
            _record("ufunc", ufunc, method, inputs, out)
            if not _deferred(compute):
                compute()
            return out[0] if len(out) == 1 else out
        with np.errstate(all="ignore" if _capturing() else None):  # a capture computes on last step's values
            result = compute()
        if isinstance(result, tuple):
            result = tuple(_new(r) for r in result)
            for k, r in enumerate(result):
                _recomputed(r, lambda k=k: compute()[k])
        else:
            result = _new(result)
            _recomputed(result, compute)
        _record("ufunc", ufunc, method, inputs, result)
        return result

    def __array_function__(self, func, types_, args, kwargs):
        def compute():
            return func(*(_unwrap(a) for a in args), **{k: _unwrap(v) for k, v in kwargs.items()})
        with np.errstate(all="ignore" if _capturing() and func not in VIEWS else None):
            result = compute()
        if func in VIEWS:
            return _device(result) if isinstance(result, np.ndarray) else result
        COUNTS["launches"] += 1
        result = _new(result) if isinstance(result, np.ndarray) else result
        _recomputed(result, compute)
        _record("call", func, args, tuple(sorted(kwargs.items())), result)
        return result

    def __getitem__(self, key):
        def compute():
            return _host(self)[tuple(_host(k) for k in key) if isinstance(key, tuple) else _host(key)]
        got = compute()
        if _fancy(key):
            COUNTS["launches"] += 1
            got = _new(got)
            _recomputed(got, compute)
            _record("gather", self, key, got)
            return got
        if isinstance(got, np.generic):  # CuPy's a[i] is a 0-d array on the device, not a host scalar
            got = _host(self)[(*key, Ellipsis) if isinstance(key, tuple) else (key, Ellipsis)]
        return _device(got)

    def __setitem__(self, key, value):
        if type(value) is np.ndarray:
            _h2d()
        _record("setitem", self, key, value)
        if type(value) is np.ndarray:
            COUNTS["uploads"] += 1
        elif isinstance(value, DeviceArray) or _fancy(key):
            COUNTS["launches"] += 1  # a copy or scatter kernel
        else:
            COUNTS["launches"] += 1  # a fill

        def store():
            _host(self)[tuple(_host(k) for k in key) if isinstance(key, tuple) else _host(key)] = _host(value)
        if not _deferred(store):
            store()

    def astype(self, dtype, copy=True, **kwargs):
        if not copy and self.dtype == np.dtype(dtype):
            return self
        COUNTS["launches"] += 1
        with np.errstate(all="ignore" if _capturing() else None):
            got = _new(_host(self).astype(dtype, **kwargs))
        _recomputed(got, lambda: _host(self).astype(dtype, **kwargs))
        _record("astype", self, got)
        return got

    def copy(self, order="C"):
        COUNTS["launches"] += 1
        got = _new(_host(self).copy(order))
        _recomputed(got, lambda: _host(self))
        _record("copy", self, got)
        return got

    def fill(self, value) -> None:
        COUNTS["launches"] += 1
        _record("fill", self, value)
        if not _deferred(lambda: _host(self).fill(value)):
            _host(self).fill(value)

    def get(self, stream=None, order="C", out=None, blocking=True):
        """A download; with ``blocking=False`` (into page-locked memory) queued on the stream, no wait."""
        _d2h(stream)
        COUNTS["downloads"] += 1
        COUNTS["syncs"] += bool(blocking)
        if out is None:
            got = np.array(_host(self))
            _record("download", self, got, blocking)
            return got
        _record("download", self, out, blocking)
        out[...] = _host(self)
        return out

    def set(self, arr, stream=None) -> None:
        """An upload of a host array into this one (asynchronous from page-locked memory)."""
        _h2d(stream)
        COUNTS["uploads"] += 1
        _record("upload", arr, self)
        _host(self)[...] = arr

    def _scalar(self):
        """CuPy's __int__, __float__, __bool__, item and tolist: a blocking get."""
        _d2h()
        COUNTS["downloads"] += 1
        COUNTS["syncs"] += 1
        return _host(self)

    def __int__(self):
        return int(self._scalar())

    def __float__(self):
        return float(self._scalar())

    def __bool__(self):
        return bool(self._scalar())

    def item(self, *args):
        return self._scalar().item(*args)

    def tolist(self):
        return self._scalar().tolist()


def _unwrap(a):
    if isinstance(a, (list, tuple)):
        return type(a)(_host(v) for v in a)
    return _host(a)


def _device(a):
    return a.view(DeviceArray) if isinstance(a, np.ndarray) and not isinstance(a, DeviceArray) else a


def _asarray(a, dtype=None, order=None):
    """cupy.asarray: a host array uploaded (a new device array), a device array as it is (or converted)."""
    if isinstance(a, DeviceArray):
        return a if dtype is None or a.dtype == np.dtype(dtype) else a.astype(dtype)
    _h2d()
    COUNTS["uploads"] += 1
    got = _new(np.array(a, dtype=dtype, order=order or "K"))
    _record("upload", a if isinstance(a, np.ndarray) else np.asarray(a), got)
    return got


def _ascontiguousarray(a, dtype=None):
    if isinstance(a, DeviceArray):
        if a.flags.c_contiguous and (dtype is None or a.dtype == np.dtype(dtype)):
            return a
        COUNTS["launches"] += 1
        got = _new(np.ascontiguousarray(_host(a), dtype=dtype))
        _recomputed(got, lambda: np.ascontiguousarray(_host(a), dtype=dtype))
        return got
    return _asarray(np.ascontiguousarray(a, dtype=dtype))


def _allocating(fn, launches: int = 0):
    def call(*args, **kwargs):
        COUNTS["launches"] += launches

        def compute():
            return fn(*(_unwrap(a) for a in args), **{k: _unwrap(v) for k, v in kwargs.items()})
        got = _new(compute())
        if launches:  # a fill
            _recomputed(got, compute)
            _record("fill", got, fn)
        return got
    return call


def _concatenate(arrays, axis=0, out=None, dtype=None, **kwargs):
    """cupy.concatenate: more than 8 arrays of one dtype, small enough for one kernel, upload a table of their
    addresses first (_routines_manipulation.pyx _concatenate_single_kernel: core.array(ptrs))."""
    arrays = list(arrays)
    if len(arrays) > 8 and len({a.dtype for a in arrays}) == 1 \
            and sum(a.nbytes for a in arrays) < (2 << 20) * len(arrays):
        _h2d()
        COUNTS["uploads"] += 1
    return np.concatenate(arrays, axis=axis, out=out, dtype=dtype, **kwargs)


def _asnumpy(a):
    if isinstance(a, DeviceArray):
        _d2h()
        COUNTS["downloads"] += 1
        COUNTS["syncs"] += 1
        got = np.array(_host(a))
        _record("download", a, got, True)
        return got
    return np.asarray(a)


class _Event:
    def __init__(self, captured: bool = False):
        self.captured = captured  # recorded by a capturing stream: a point inside the graph, not yet reached

    def synchronize(self) -> None:
        if self.captured and CAPTURING[0] is not None:
            raise CUDARuntimeError(900)
        COUNTS["syncs"] += 1


_STREAMS: "weakref.WeakValueDictionary[int, _Stream]" = weakref.WeakValueDictionary()  # ptr -> stream
_PTRS = itertools.count(0x5000)


class _Stream:
    """A stream: its work runs at once, in order; between begin_capture and end_capture the work queued on it is
    kept for a graph instead (one capture at a time). ``ptr`` 0 is the null (legacy) stream."""

    def __init__(self, null: bool = False, non_blocking: bool = False, ptr: int | None = None):
        self.ptr = 0 if null else next(_PTRS) if ptr is None else ptr
        self.non_blocking = non_blocking
        _STREAMS[self.ptr] = self

    def record(self, event=None) -> _Event:
        return _Event(captured=_capture_of(self))

    def wait_event(self, event: _Event) -> None:
        _capture_of(self)  # the null stream waiting while a blocking stream captures: refused

    def synchronize(self) -> None:
        if CAPTURING[0] is self or (CAPTURING[0] is not None and self.ptr == 0 and not CAPTURING[0].non_blocking):
            raise CUDARuntimeError(900)
        COUNTS["syncs"] += 1

    def begin_capture(self, mode=None) -> None:
        if self.ptr in (0, 1):
            raise RuntimeError("cannot capture on the default (legacy) stream")
        if CAPTURING[0] is not None:
            raise CUDARuntimeError(401)
        CAPTURE[0], CAPTURING[0] = [], self

    def is_capturing(self) -> bool:
        return CAPTURING[0] is self

    def end_capture(self) -> _Graph:
        if CAPTURING[0] is not self:
            raise CUDARuntimeError(401)
        work, CAPTURE[0], CAPTURING[0] = CAPTURE[0], None, None
        return _Graph(work)

    def __enter__(self):
        _CURRENT.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _CURRENT.pop()


_NULL: list = [None]  # the null stream, made with the module (module())


def _device_synchronize() -> None:
    if CAPTURING[0] is not None:
        raise CUDARuntimeError(900)
    COUNTS["syncs"] += 1


def _pinned_range(at: int, size: int) -> bool:
    return any(start <= at and at + size <= start + n for start, n in _PINNED.items())


def _memcpy_async(dst: int, src: int, size: int, kind: int, stream: int) -> None:
    """cuda.runtime.memcpyAsync between raw addresses (host memory here): kept for the graph in a capture, where
    its host side must be page-locked (rule "pageable")."""
    host = {1: src, 2: dst}.get(kind)
    capturing = _capture_of(stream)
    if capturing and host is not None and not _pinned_range(host, size):
        raise CUDARuntimeError(900)
    COUNTS["uploads" if kind == 1 else "downloads" if kind == 2 else "launches"] += 1
    if kind == 2 and not _pinned_range(dst, size):
        COUNTS["syncs"] += 1  # a pageable download: the host waits for it
    if RECORD[0] is not None:
        RECORD[0].append(("memcpy", kind, dst, src, size))

    def run():
        ctypes.memmove(dst, src, size)
    if not capturing:
        run()
    else:
        CAPTURE[0].append(run)


class OutOfMemory(MemoryError):
    """cupy.cuda.memory.OutOfMemoryError's stand-in."""


class _CountedModule:
    """cupy.RawModule on the emulator: each kernel launch counted."""

    def __init__(self, code: str, build_dir):
        COUNTS["modules_made"] += 1
        self._module = cuda_emulator.EmulatedModule(code, build_dir)

    def compile(self, log_stream=None) -> None:
        """CuPy's RawModule.compile: here the emulator built the module when it was made."""
        COUNTS["module_compiles"] += 1

    def get_function(self, name: str):
        launch = self._module.get_function(name)

        def counted(grid, block, args, shared_mem=0):
            COUNTS["launches"] += 1
            _record("kernel", name, tuple(grid), tuple(block), shared_mem, args)

            def run():
                launch(grid, block, tuple(_host(a) for a in args), shared_mem=shared_mem)
            if not _deferred(run):
                run()
        return counted


def module(build_dir) -> tuple[types.ModuleType, types.ModuleType]:
    """(the ``cupy`` stand-in, the ``cupyx`` one)."""
    cp = types.ModuleType("cupy")
    cp.EMULATED = True
    cp.__version__ = "13.6.0"  # the version whose rules the stand-in follows (the module docstring)
    cp.ndarray = DeviceArray
    cp.asarray, cp.ascontiguousarray, cp.asnumpy = _asarray, _ascontiguousarray, _asnumpy
    for name in ("empty", "empty_like"):
        setattr(cp, name, _allocating(getattr(np, name)))
    for name in ("zeros", "zeros_like", "full", "ones", "arange"):  # allocated and filled: a launch
        setattr(cp, name, _allocating(getattr(np, name), launches=1))
    cp.concatenate = _concatenate
    for name in ("where", "exp", "sort", "argsort", "take_along_axis", "repeat", "sum", "mean",
                 "sqrt", "square", "tanh", "max", "matmul"):  # NumPy's own dispatch counts them (DeviceArray)
        setattr(cp, name, getattr(np, name))
    for name in ("bool_", "float32", "int32", "int64", "uint16", "uint8", "uint64", "array_equal", "shares_memory"):
        setattr(cp, name, getattr(np, name))
    cp.get_array_module = lambda *arrays: cp
    cp.get_default_memory_pool = cp.get_default_pinned_memory_pool = lambda: _POOL
    cp.RawModule = lambda code, options=(): _CountedModule(code, build_dir)
    _NULL[0] = _Stream(null=True)
    _CURRENT.clear()
    CAPTURE[0] = CAPTURING[0] = None
    _Stream.null = _NULL[0]
    runtime = types.SimpleNamespace(getDeviceCount=lambda: 1, memGetInfo=lambda: (FREE_BYTES, FREE_BYTES),
                                    getDeviceProperties=lambda i: {"name": NAME}, memcpyAsync=_memcpy_async,
                                    memcpyHostToDevice=1, memcpyDeviceToHost=2, memcpyDeviceToDevice=3,
                                    memcpyDefault=4, deviceSynchronize=_device_synchronize,
                                    CUDARuntimeError=CUDARuntimeError)
    cuda = types.SimpleNamespace(Stream=_Stream, Event=_Event, runtime=runtime,
                                 get_current_stream=lambda: _stream_of(None),
                                 Device=lambda i=0: types.SimpleNamespace(synchronize=_device_synchronize))
    cuda.memory = types.SimpleNamespace(OutOfMemoryError=OutOfMemory)
    cuda.using_allocator = _using_allocator
    cuda.MemoryPointer, cuda.UnownedMemory = _MemoryPointer, _UnownedMemory
    cuda.alloc = _POOL.malloc
    cuda.runtime.hostRegister = lambda ptr, size, flags: _pin(ptr, size)  # host memory is the device's here
    cuda.runtime.hostUnregister = lambda ptr: _PINNED.pop(ptr, None)
    cp.cuda = cuda
    cx = types.ModuleType("cupyx")
    cx.empty_pinned = _empty_pinned
    return cp, cx


def _empty_pinned(shape, dtype=np.float32) -> np.ndarray:
    """cupyx.empty_pinned: plain memory, its range remembered as page-locked (recording())."""
    out = np.empty(shape, dtype)
    start = out.__array_interface__["data"][0]
    _pin(start, out.nbytes)
    weakref.finalize(out, _PINNED.pop, start, None)  # freed: its memory may come back as a fresh pageable array
    return out


DRIVER = types.SimpleNamespace(name="libcuda.so.1 (the stand-in's)")


def _launch_host_func(fn_address: int, user_data: int) -> None:
    """xp.launch_host_func: the stream's earlier work is done here already, so the function runs now."""
    COUNTS["host_functions"] += 1
    _record("host_function", fn_address, user_data)

    def run():
        ctypes.CFUNCTYPE(None, ctypes.c_void_p)(fn_address)(user_data)
    if not _deferred(run):
        run()


def clear_kernel_caches() -> None:
    """The modules' compiled kernels, built for whichever ``cupy`` was imported last."""
    from coordinator.gpu import compact, experts, format_kernels, router
    from coordinator.gpu import ops as device_ops

    for mod in (device_ops, format_kernels, experts, router, compact):
        for name in dir(mod):
            fn = getattr(mod, name)
            if hasattr(fn, "cache_clear"):
                fn.cache_clear()


@contextlib.contextmanager
def installed(build_dir, monkeypatch):
    """The stand-in as ``cupy`` for the engine (and gpu/transfer.py's module-level handle) inside the block; the
    array modules model/xp.py knows are restored after it."""
    from coordinator.gpu import transfer as xp
    from coordinator.model import xp as model_xp

    cp, cx = module(build_dir)
    monkeypatch.setattr(model_xp, "_MODULES", [])
    monkeypatch.setattr(xp, "launch_host_func", _launch_host_func)
    monkeypatch.setattr(xp, "_driver", lambda: DRIVER)  # libcuda: the stand-in's host functions need none
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setitem(sys.modules, "cupyx", cx)
    monkeypatch.setattr(xp, "_cupy", cp)
    clear_kernel_caches()
    try:
        yield cp
    finally:
        clear_kernel_caches()


@contextlib.contextmanager
def counting():
    """COUNTS from zero inside the block; yields the Counter (read it after the block)."""
    COUNTS.clear()
    yield COUNTS
