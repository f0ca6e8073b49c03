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

Between ``Stream.begin_capture`` and ``end_capture`` (one capture at a time, whichever stream object) the work is
kept for the graph instead of run, as CUDA captures it: a kernel, copy, fill, in-place operation or host function
is not run; an operation that makes a new array computes it now (its shape; the values are last step's) and keeps
its recomputation into that array's memory. ``Graph.launch`` runs the kept work in order, reading the inputs as
they are then; a wait on the device inside a capture raises, as CUDA refuses it.

Allocations under ``cupy.cuda.using_allocator`` are the allocator's: coordinator/device/arena.py's bump allocator
hands out views of its buffer (real memory here too, so an array that outlived its step would be overwritten by
the next one, as on a GPU) and only what it takes from the pool (``get_default_memory_pool().malloc``) counts.

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


def _capturing() -> bool:
    return CAPTURE[0] is not None


def _deferred(work) -> bool:
    """Inside a capture: ``work`` (a function of nothing) kept for the graph, not run, and True; else False."""
    if CAPTURE[0] is None:
        return False
    CAPTURE[0].append(work)
    return True


def _recomputed(out, compute) -> None:
    """Inside a capture, an op whose result is a new array ``out``: the graph computes it again into out's memory
    (its inputs are read when the graph runs, as a kernel reads them)."""
    if CAPTURE[0] is not None and isinstance(out, np.ndarray):
        CAPTURE[0].append(lambda: _host(out).__setitem__(Ellipsis, compute()))


def _no_sync() -> None:
    if CAPTURE[0] is not None:
        raise RuntimeError("the host waited on the device inside a stream capture (CUDA refuses it)")


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


class _MemoryPointer:
    """cupy.cuda.MemoryPointer: a place in a buffer of host memory; + an offset gives a later place."""

    def __init__(self, buffer: np.ndarray, offset: int = 0):
        self.buffer, self.offset = buffer, offset

    def __add__(self, offset: int) -> "_MemoryPointer":
        return _MemoryPointer(self.buffer, self.offset + offset)


class _Pool:
    def free_all_blocks(self) -> None:
        pass

    def malloc(self, size: int) -> _MemoryPointer:
        COUNTS["allocations"] += 1
        return _MemoryPointer(np.empty(max(size, 1), np.uint8))


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
        COUNTS["allocations"] += 1
        return _device(result)
    place = _ALLOCATOR[0](result.nbytes)
    view = place.buffer[place.offset:place.offset + result.nbytes].view(result.dtype).reshape(result.shape)
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
        return _device(got)

    def __setitem__(self, key, value):
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
        COUNTS["downloads"] += 1
        COUNTS["syncs"] += bool(blocking)
        if blocking:
            _no_sync()
        if out is None:
            got = np.array(_host(self))
            _record("download", self, got, blocking)
            return got
        _record("download", self, out, blocking)
        if not _deferred(lambda: out.__setitem__(Ellipsis, _host(self))):
            out[...] = _host(self)
        return out

    def set(self, arr, stream=None) -> None:
        """An upload of a host array into this one (asynchronous from page-locked memory)."""
        COUNTS["uploads"] += 1
        _record("upload", arr, self)
        if not _deferred(lambda: _host(self).__setitem__(Ellipsis, arr)):
            _host(self)[...] = arr


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
    COUNTS["uploads"] += 1
    got = _new(np.array(a, dtype=dtype, order=order or "K"))
    _recomputed(got, lambda: np.array(a, dtype=dtype))
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


def _asnumpy(a):
    if isinstance(a, DeviceArray):
        COUNTS["downloads"] += 1
        COUNTS["syncs"] += 1
        _no_sync()
        got = np.array(_host(a))
        _record("download", a, got, True)
        return got
    return np.asarray(a)


class _Event:
    def synchronize(self) -> None:
        _no_sync()
        COUNTS["syncs"] += 1


class _Stream:
    """A stream: its work runs at once, in order; between begin_capture and end_capture it is kept for a graph
    instead (one capture at a time, whichever stream object asks: the host runs one stream's work here)."""

    ptr = 1

    def __init__(self, non_blocking: bool = False):
        pass

    def record(self) -> _Event:
        return _Event()

    def wait_event(self, event: _Event) -> None:
        pass

    def synchronize(self) -> None:
        _no_sync()
        COUNTS["syncs"] += 1

    def begin_capture(self, mode=None) -> None:
        if CAPTURE[0] is not None:
            raise RuntimeError("a stream capture is in progress already")
        CAPTURE[0] = []

    def is_capturing(self) -> bool:
        return CAPTURE[0] is not None

    def end_capture(self) -> _Graph:
        work, CAPTURE[0] = CAPTURE[0], None
        if work is None:
            raise RuntimeError("end_capture without begin_capture")
        return _Graph(work)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class OutOfMemory(MemoryError):
    """cupy.cuda.memory.OutOfMemoryError's stand-in."""


class _CountedModule:
    """cupy.RawModule on the emulator: each kernel launch counted."""

    def __init__(self, code: str, build_dir):
        self._module = cuda_emulator.EmulatedModule(code, build_dir)

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
    cp.ndarray = DeviceArray
    cp.asarray, cp.ascontiguousarray, cp.asnumpy = _asarray, _ascontiguousarray, _asnumpy
    for name in ("empty", "empty_like"):
        setattr(cp, name, _allocating(getattr(np, name)))
    for name in ("zeros", "zeros_like", "full", "ones", "arange"):  # allocated and filled: a launch
        setattr(cp, name, _allocating(getattr(np, name), launches=1))
    for name in ("concatenate", "where", "exp", "sort", "argsort", "take_along_axis", "repeat", "sum", "mean",
                 "sqrt", "square", "tanh", "max", "matmul"):  # NumPy's own dispatch counts them (DeviceArray)
        setattr(cp, name, getattr(np, name))
    for name in ("bool_", "float32", "int32", "int64", "uint16", "uint8", "uint64", "array_equal", "shares_memory"):
        setattr(cp, name, getattr(np, name))
    cp.get_array_module = lambda *arrays: cp
    cp.get_default_memory_pool = cp.get_default_pinned_memory_pool = lambda: _POOL
    cp.RawModule = lambda code, options=(): _CountedModule(code, build_dir)
    cuda = types.SimpleNamespace(Stream=_Stream, Event=_Event, get_current_stream=lambda: _Stream(),
                                 runtime=types.SimpleNamespace(getDeviceCount=lambda: 1,
                                                               memGetInfo=lambda: (FREE_BYTES, FREE_BYTES),
                                                               getDeviceProperties=lambda i: {"name": NAME}))
    cuda.memory = types.SimpleNamespace(OutOfMemoryError=OutOfMemory)
    cuda.using_allocator = _using_allocator
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
    from coordinator.device import compact, experts, format_kernels, router
    from coordinator.model import device_ops

    for mod in (device_ops, format_kernels, experts, router, compact):
        for name in dir(mod):
            fn = getattr(mod, name)
            if hasattr(fn, "cache_clear"):
                fn.cache_clear()


@contextlib.contextmanager
def installed(build_dir, monkeypatch):
    """The stand-in as ``cupy`` for the engine (and xp.py's module-level handle) inside the block."""
    from coordinator.model import xp

    cp, cx = module(build_dir)
    monkeypatch.setattr(xp, "launch_host_func", _launch_host_func)
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
