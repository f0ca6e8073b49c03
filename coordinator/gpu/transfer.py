"""Moving arrays between the host and the GPU: page-locked staging for the pool's traffic (HostStaging), the device
experts' side stream (SideStream), cudaMemcpyAsync copies a stream capture keeps (copy_to_host, copy_to_device),
host memory registered with the device, and host functions queued on a stream through the driver
(launch_host_func, host_functions_refused)."""

from __future__ import annotations

import contextlib

import numpy as np

try:  # CuPy is an optional extra
    import cupy as _cupy
except Exception:  # not installed, or a CUDA install that does not load
    _cupy = None


def module(backend: str):
    """'numpy' | 'cupy' -> the module."""
    if backend == "cupy":
        if _cupy is None:
            raise RuntimeError("CuPy is not importable")
        return _cupy
    return np


class HostBuffer:
    """One reusable host buffer, flat, grown as needed: page-locked with CuPy, plain with NumPy.

    ``view`` hands out its first ``prod(shape)`` elements. A copy that still reads
    the buffer on the device's queue is remembered as an event (``busy_until``),
    and the next ``view`` waits for that event alone, so the buffer is never
    overwritten under a transfer and the rest of the device keeps running.
    """

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self._buf: np.ndarray | None = None
        self._busy = None  # cupy.cuda.Event of the last transfer reading the buffer

    def view(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        if self._busy is not None:
            self._busy.synchronize()
            self._busy = None
        n, dtype = int(np.prod(shape)), np.dtype(dtype)
        if self._buf is None or self._buf.size < n or self._buf.dtype != dtype:
            self._buf = self._allocate(max(n, 1 << 16), dtype)
        return self._buf[:n].reshape(shape)

    def _allocate(self, n: int, dtype: np.dtype) -> np.ndarray:
        if not self.pinned:
            return np.empty(n, dtype)
        import cupyx

        return cupyx.empty_pinned((n,), dtype=dtype)

    def busy_until(self, event) -> None:
        self._busy = event


class HostStaging:
    """The host side of the pool's traffic: rows out, partial sums back.

    With CuPy both directions go through page-locked buffers that are reused by
    every layer: the rows of the tokens with CPU work are copied from the device
    into one (``rows_to_host``), and the pool sums the nodes' partials straight
    into the other (``partials_buffer``), which ``to_device`` uploads on the
    current stream without waiting. With NumPy everything is already on the host:
    rows come back as they are and the partials buffer is a plain reused array.
    """

    def __init__(self, backend: str):
        self.backend = backend
        self._rows = HostBuffer(pinned=True)  # CuPy only
        self._partials = HostBuffer(pinned=backend == "cupy")

    def rows_to_host(self, a) -> np.ndarray:
        """Device rows [T, H] -> a host array (a pinned view with CuPy), complete on return."""
        if self.backend != "cupy":
            return np.ascontiguousarray(a)
        out = self._rows.view(a.shape, a.dtype)
        a.get(out=out)  # blocking: the frames are sent from this buffer right after
        return out

    def partials_buffer(self, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        """A host array [T, H] for the pool to sum into; with CuPy pinned, and free of any upload."""
        return self._partials.view(shape, dtype)

    def to_device(self, host: np.ndarray):
        """The partials buffer onto the device: an asynchronous copy on the current stream (CuPy)."""
        if self.backend != "cupy":
            return host
        xp = module("cupy")
        dev = xp.asarray(host)  # pinned source: CuPy enqueues the copy and returns
        self._partials.busy_until(xp.cuda.get_current_stream().record())
        return dev


class SideStream:
    """The stream the device experts run on while the pool computes.

    With CuPy: a non-blocking CUDA stream of its own. ``run()`` makes it wait for
    what the current stream has queued so far (an event, not a synchronisation)
    and makes it current inside the block; ``join()`` makes the current stream
    wait for what was queued on it. The host never waits on the device here.
    With NumPy both are no-ops: the work simply runs in order.
    """

    def __init__(self, backend: str):
        self.stream = module("cupy").cuda.Stream(non_blocking=True) if backend == "cupy" else None
        self._done = None  # event recorded at the end of the last run()

    @contextlib.contextmanager
    def run(self):
        if self.stream is None:
            yield
            return
        cuda = module("cupy").cuda
        self.stream.wait_event(cuda.get_current_stream().record())
        with self.stream:
            yield
        self._done = self.stream.record()

    def join(self) -> None:
        if self._done is not None:
            module("cupy").cuda.get_current_stream().wait_event(self._done)
            self._done = None


def launch_host_func(fn_address: int, user_data: int) -> None:
    """Queue the C function at ``fn_address`` (CUDA's ``void f(void *)``) on the current stream: the driver calls
    it with ``user_data`` once the stream's earlier work is done, and the stream's later work waits for it. Through
    the driver's cuLaunchHostFunc, as CuPy's own launch_host_func takes Python callables only (they need the GIL)."""
    import ctypes

    stream = ctypes.c_void_p(_cupy.cuda.get_current_stream().ptr)
    status = _driver().cuLaunchHostFunc(stream, ctypes.c_void_p(fn_address), ctypes.c_void_p(user_data))
    if status != 0:
        raise RuntimeError(f"cuLaunchHostFunc failed: CUDA driver error {status}")


MIN_CUPY = (13, 0)  # the oldest CuPy the graph-ready steps are written for (stream capture, UnownedMemory, runtime)


def host_functions_refused(stream) -> str | None:
    """Why host functions cannot drive the pool from a stream here, or None: CuPy's version, libcuda loaded, and
    one host function queued on ``stream`` and seen to run (checked at open, so no request meets it)."""
    import ctypes

    version = getattr(_cupy, "__version__", "0")
    found = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    if found < MIN_CUPY:
        return f"CuPy {version} is older than {'.'.join(map(str, MIN_CUPY))}"
    try:
        _driver()
    except OSError as e:
        return f"the CUDA driver library could not be loaded ({e})"
    ran: list[int] = []
    probe = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda data: ran.append(data or 0))
    try:
        with stream:
            launch_host_func(ctypes.cast(probe, ctypes.c_void_p).value, 7)
        stream.synchronize()
    except Exception as e:  # the driver's or CuPy's refusal, named
        return f"a host function could not be queued ({type(e).__name__}: {e})"
    if ran != [7]:
        return "a host function queued on a stream did not run"
    return None


def _driver():
    """libcuda, the CUDA driver (present wherever CuPy runs on a GPU)."""
    import ctypes

    global _LIBCUDA
    if _LIBCUDA is None:
        _LIBCUDA = ctypes.CDLL("libcuda.so.1")
        _LIBCUDA.cuLaunchHostFunc.restype = ctypes.c_int
    return _LIBCUDA


_LIBCUDA = None


def device_address(a) -> int:
    """A device array's address (the CPU stand-in's arrays are NumPy's: their memory's)."""
    import cupy  # the module in use now: the stand-in's tests install it after this module was imported

    return a.ctypes.data if getattr(cupy, "EMULATED", False) else a.data.ptr


def _memcpy(dst: int, src: int, nbytes: int, kind: int, stream) -> None:
    if nbytes:
        _cupy.cuda.runtime.memcpyAsync(dst, src, nbytes, kind, stream.ptr)


def _contiguous_pair(device, host: np.ndarray) -> None:
    if device.shape != host.shape or device.dtype != host.dtype or not (device.flags.c_contiguous
                                                                        and host.flags.c_contiguous):
        raise ValueError(f"a copy between {device.dtype}{device.shape} on the device and {host.dtype}{host.shape} on "
                         "the host needs equal, C-contiguous arrays")


def copy_to_host(host: np.ndarray, device, stream) -> None:
    """device -> host (page-locked or host-registered) queued on ``stream``, no wait: cudaMemcpyAsync, which a
    stream capture keeps as a copy node (CuPy's ndarray.get raises inside a capture, cupy/cuda/memory.pyx
    copy_to_host_async)."""
    _contiguous_pair(device, host)
    _memcpy(host.ctypes.data, device_address(device), host.nbytes, _cupy.cuda.runtime.memcpyDeviceToHost, stream)


def copy_to_device(device, host: np.ndarray, stream) -> None:
    """host (page-locked or host-registered) -> device queued on ``stream``: cudaMemcpyAsync, which a capture
    keeps (CuPy's ndarray.set raises inside one, copy_from_host_async)."""
    _contiguous_pair(device, host)
    _memcpy(device_address(device), host.ctypes.data, host.nbytes, _cupy.cuda.runtime.memcpyHostToDevice, stream)


def register_host(array: np.ndarray) -> None:
    """Page-lock host memory the device copies to and from (a shared-memory segment): its copies are then
    asynchronous, as a pinned buffer's (cudaHostRegister, portable)."""
    _cupy.cuda.runtime.hostRegister(array.ctypes.data, array.nbytes, 1)


def unregister_host(array: np.ndarray) -> None:
    _cupy.cuda.runtime.hostUnregister(array.ctypes.data)


def pinned(shape, dtype) -> np.ndarray:
    """A page-locked host array (zeroed)."""
    import cupyx

    out = cupyx.empty_pinned(shape, dtype=dtype)
    out[...] = 0
    return out
