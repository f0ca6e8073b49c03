"""A NumPy-backed stand-in for CuPy under which the whole engine takes its GPU path on the CPU.

Device arrays are ``DeviceArray``, a NumPy subclass: ops.py's host paths (which take plain ndarrays only) are
skipped and its device paths taken, and every kernel (device_ops, device/format_kernels, device/experts)
runs through tests/cuda_emulator.py. Streams and events are no-ops, pinned memory is plain memory, and the
"GPU" reports 64 GB free. What it checks: that the device path's code computes what the CPU path computes
(tests/test_device_decoder.py); not CUDA's rounding, concurrency or speed (tests/test_gpu.py, on a GPU).

    with device_standin.installed(build_dir, monkeypatch):  ... Engine.open(..., EngineConfig(device="cuda"))
"""

from __future__ import annotations

import contextlib
import sys
import types

import numpy as np

import cuda_emulator

FREE_BYTES = 64 << 30
NAME = b"CPU stand-in (tests/device_standin.py)"


class DeviceArray(np.ndarray):
    """An array "on the device": NumPy memory, a type the host paths do not take."""

    def get(self, out=None):
        if out is None:
            return np.array(self)
        out[...] = self
        return out


def _device(a):
    return a.view(DeviceArray) if isinstance(a, np.ndarray) else a


def _wrap(fn):
    def call(*args, **kwargs):
        return _device(fn(*args, **kwargs))
    return call


class _Event:
    def synchronize(self) -> None:
        pass


class _Stream:
    def __init__(self, non_blocking: bool = False):
        pass

    def record(self) -> _Event:
        return _Event()

    def wait_event(self, event: _Event) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class _Pool:
    def free_all_blocks(self) -> None:
        pass


def module(build_dir) -> tuple[types.ModuleType, types.ModuleType]:
    """(the ``cupy`` stand-in, the ``cupyx`` one)."""
    cp = types.ModuleType("cupy")
    cp.EMULATED = True
    cp.ndarray = DeviceArray
    for name in ("asarray", "ascontiguousarray", "empty", "empty_like", "zeros", "zeros_like", "concatenate",
                 "arange", "where", "exp", "sort", "argsort", "take_along_axis", "repeat", "sum", "mean", "sqrt",
                 "square", "tanh", "max", "matmul", "full", "ones"):
        setattr(cp, name, _wrap(getattr(np, name)))
    for name in ("bool_", "float32", "int32", "int64", "uint16", "uint8", "uint64", "array_equal", "shares_memory"):
        setattr(cp, name, getattr(np, name))
    cp.asnumpy = lambda a: np.array(a).view(np.ndarray)
    cp.get_array_module = lambda *arrays: cp
    cp.get_default_memory_pool = cp.get_default_pinned_memory_pool = _Pool
    cp.RawModule = lambda code, options=(): cuda_emulator.EmulatedModule(code, build_dir)
    cuda = types.SimpleNamespace(Stream=_Stream, Event=_Event, get_current_stream=lambda: _Stream(),
                                 runtime=types.SimpleNamespace(getDeviceCount=lambda: 1,
                                                               memGetInfo=lambda: (FREE_BYTES, FREE_BYTES),
                                                               getDeviceProperties=lambda i: {"name": NAME}))
    cp.cuda = cuda
    cx = types.ModuleType("cupyx")
    cx.empty_pinned = lambda shape, dtype=np.float32: np.empty(shape, dtype)
    return cp, cx


def clear_kernel_caches() -> None:
    """The modules' compiled kernels, built for whichever ``cupy`` was imported last."""
    from coordinator.device import experts, format_kernels
    from coordinator.model import device_ops

    for mod in (device_ops, format_kernels, experts):
        for name in dir(mod):
            fn = getattr(mod, name)
            if hasattr(fn, "cache_clear"):
                fn.cache_clear()


@contextlib.contextmanager
def installed(build_dir, monkeypatch):
    """The stand-in as ``cupy`` for the engine (and xp.py's module-level handle) inside the block."""
    from coordinator.model import xp

    cp, cx = module(build_dir)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setitem(sys.modules, "cupyx", cx)
    monkeypatch.setattr(xp, "_cupy", cp)
    clear_kernel_caches()
    try:
        yield cp
    finally:
        clear_kernel_caches()
