"""The device stand-in (tests/device_standin.py) refuses inside a stream capture what CuPy and CUDA refuse, with
their exceptions and messages (the table in its docstring), runs the same calls outside one, and keeps for the
graph what a capture may hold."""

from __future__ import annotations

import numpy as np
import pytest

import device_standin
from device_standin import D2H_REFUSED, H2D_REFUSED, CaptureHazard, CUDARuntimeError


@pytest.fixture
def cp(tmp_path):
    cp, cx = device_standin.module(tmp_path)
    cp.cx = cx
    yield cp
    device_standin.CAPTURE[0] = device_standin.CAPTURING[0] = None


def _address(a) -> int:
    """A device array's address: real CuPy's (tools/capture_probe.py runs CASES there) or the stand-in's."""
    ptr = getattr(a.data, "ptr", None)
    return ptr if ptr is not None else a.__array_interface__["data"][0]


def _buffer_allocator(nbytes: int = 1 << 16):
    """An allocator over one buffer (as coordinator/gpu/arena.py's): a capture's arrays come from it."""
    buffer, used = np.empty(nbytes, np.uint8), [0]
    memory = device_standin._UnownedMemory(buffer.ctypes.data, nbytes, buffer)

    def malloc(size):
        at, used[0] = used[0], used[0] + -(-size // 256) * 256
        return device_standin._MemoryPointer(memory, at)
    return malloc


# rule -> (the call, given the module, a device array [16] float32 and a pinned host array [16]; what it raises);
# tools/capture_probe.py runs the same calls on a GPU's CuPy and says where CuPy's exception and message differ
CASES = {
    "h2d: ndarray.set": (lambda cp, d, h: d.set(np.ones(16, np.float32)), RuntimeError, H2D_REFUSED),
    "h2d: ndarray.set from pinned": (lambda cp, d, h: d.set(h), RuntimeError, H2D_REFUSED),
    "h2d: a host array assigned": (lambda cp, d, h: d.__setitem__(slice(0, 4), np.ones(4, np.float32)),
                                   RuntimeError, H2D_REFUSED),
    "h2d: asarray of host data": (lambda cp, d, h: cp.asarray(np.arange(3)), RuntimeError, H2D_REFUSED),
    "h2d: concatenate of 9 arrays": (lambda cp, d, h: cp.concatenate([d[i:i + 1] for i in range(9)]),
                                     RuntimeError, H2D_REFUSED),
    "d2h: ndarray.get": (lambda cp, d, h: d.get(), RuntimeError, D2H_REFUSED),
    "d2h: ndarray.get into pinned, not blocking": (lambda cp, d, h: d.get(out=h, blocking=False),
                                                   RuntimeError, D2H_REFUSED),
    "d2h: asnumpy": (lambda cp, d, h: cp.asnumpy(d), RuntimeError, D2H_REFUSED),
    "d2h: int()": (lambda cp, d, h: int(d[0]), RuntimeError, D2H_REFUSED),
    "d2h: float()": (lambda cp, d, h: float(d[0]), RuntimeError, D2H_REFUSED),
    "d2h: bool()": (lambda cp, d, h: bool(d[0]), RuntimeError, D2H_REFUSED),
    "d2h: item()": (lambda cp, d, h: d[0].item(), RuntimeError, D2H_REFUSED),
    "d2h: tolist()": (lambda cp, d, h: d.tolist(), RuntimeError, D2H_REFUSED),
    "sync: the capturing stream": (lambda cp, d, h: cp.cuda.get_current_stream().synchronize(), CUDARuntimeError,
                                   "cudaErrorStreamCaptureUnsupported: operation not permitted when stream is "
                                   "capturing"),
    "sync: an event it recorded": (lambda cp, d, h: cp.cuda.get_current_stream().record().synchronize(),
                                   CUDARuntimeError, "cudaErrorStreamCaptureUnsupported"),
    "sync: the device": (lambda cp, d, h: cp.cuda.Device(0).synchronize(), CUDARuntimeError,
                         "cudaErrorStreamCaptureUnsupported"),
    "free: free_all_blocks": (lambda cp, d, h: cp.get_default_memory_pool().free_all_blocks(), CUDARuntimeError,
                              "cudaErrorStreamCaptureUnsupported"),
    "pageable: memcpyAsync from pageable memory": (
        lambda cp, d, h: cp.cuda.runtime.memcpyAsync(_address(d), np.ones(16, np.float32).ctypes.data, 64,
                                                     cp.cuda.runtime.memcpyHostToDevice,
                                                     cp.cuda.get_current_stream().ptr),
        CUDARuntimeError, "cudaErrorStreamCaptureUnsupported"),
    "pool: a new array outside the allocator": (lambda cp, d, h: cp.empty(16, np.float32), CaptureHazard,
                                                "memory-pool allocation"),
    "pool: the pool's malloc": (lambda cp, d, h: cp.get_default_memory_pool().malloc(64), CaptureHazard,
                                "memory-pool allocation"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_refused_inside_a_capture(cp, case):
    """Each rule: the call raises CuPy's (or CUDA's) exception and message while the current stream captures, and
    runs outside a capture."""
    call, error, message = CASES[case]
    d, h = cp.arange(16, dtype=np.float32), cp.cx.empty_pinned(16, np.float32)
    call(cp, d, h)  # no capture: it runs
    stream = cp.cuda.Stream()
    with stream:
        stream.begin_capture()
        try:
            with pytest.raises(error) as raised:
                call(cp, d, h)
        finally:
            stream.end_capture()
    assert message in str(raised.value)
    if error is CUDARuntimeError:
        assert raised.value.status == 900


def test_concatenate_of_eight_arrays_needs_no_upload_and_is_captured(cp):
    """Up to 8 arrays CuPy copies each by itself (no pointer table): the capture keeps it."""
    d = cp.arange(16, dtype=np.float32)
    stream = cp.cuda.Stream()
    with stream, cp.cuda.using_allocator(_buffer_allocator()):
        stream.begin_capture()
        out = cp.concatenate([d[i:i + 1] for i in range(8)])
        graph = stream.end_capture()
    d[:8] = cp.arange(8, dtype=np.float32) + 100
    graph.launch(stream)
    assert np.array_equal(np.asarray(out.view(np.ndarray)), np.arange(8) + 100)


def test_the_null_stream_while_a_blocking_stream_captures(cp):
    """Rule "legacy": work on the null stream is refused while a blocking stream captures; a non-blocking stream's
    capture leaves the null stream's work running at once (not in the graph)."""
    d = cp.arange(4, dtype=np.float32)
    blocking = cp.cuda.Stream()
    blocking.begin_capture()  # captured, but not current: the work below goes to the null stream
    try:
        with pytest.raises(CUDARuntimeError, match="cudaErrorStreamCaptureImplicit: operation would make the "
                                                   "legacy stream depend on a capturing blocking stream"):
            d.fill(2)
    finally:
        blocking.end_capture()
    free = cp.cuda.Stream(non_blocking=True)
    free.begin_capture()
    d.fill(3)  # on the null stream, run now
    graph = free.end_capture()
    assert np.all(d.view(np.ndarray) == 3) and graph.work == []


def test_capture_states(cp):
    """Rule "default stream" and rule "state": CuPy's and CUDA's refusals of a capture that cannot begin or end."""
    with pytest.raises(RuntimeError, match=r"cannot capture on the default \(legacy\) stream"):
        cp.cuda.get_current_stream().begin_capture()
    s, t = cp.cuda.Stream(), cp.cuda.Stream()
    with pytest.raises(CUDARuntimeError, match="cudaErrorIllegalState") as raised:
        s.end_capture()
    assert raised.value.status == 401
    s.begin_capture()
    with pytest.raises(CUDARuntimeError, match="cudaErrorIllegalState"):
        t.begin_capture()
    s.end_capture()


def test_a_capture_keeps_kernels_and_pinned_copies_for_its_replays(cp):
    """What a capture may hold: memcpyAsync from and to page-locked memory and kernels on arrays from the
    allocator, not run until the graph is launched, then run on the data of each launch."""
    rt = cp.cuda.runtime
    src, dst = cp.cx.empty_pinned(4, np.float32), cp.cx.empty_pinned(4, np.float32)
    d = cp.zeros(4, np.float32)
    stream = cp.cuda.Stream()
    with stream, cp.cuda.using_allocator(_buffer_allocator()):
        stream.begin_capture()
        rt.memcpyAsync(_address(d), src.ctypes.data, src.nbytes, rt.memcpyHostToDevice, stream.ptr)
        doubled = d * 2
        rt.memcpyAsync(dst.ctypes.data, _address(doubled), dst.nbytes, rt.memcpyDeviceToHost, stream.ptr)
        graph = stream.end_capture()
    for values in ([1, 2, 3, 4], [5, 6, 7, 8]):
        src[...], dst[...] = values, 0
        graph.launch(stream)
        assert dst.tolist() == [2 * v for v in values]


def test_the_gpu_checks_capture_probe_runs_on_the_stand_in(gpu):
    """tools/capture_probe.py, which gpu_check.sh runs on a GPU's CuPy, through the stand-in: every rule's call
    refused as the table says, and its captured copy, kernel and host function replayed with new inputs."""
    import sys
    from pathlib import Path

    import cupyx

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import capture_probe  # noqa: E402  (tools/capture_probe.py)

    found = capture_probe.refusals(gpu, cupyx)  # here "cupy" is the stand-in, which also refuses its own rules
    assert [r["rule"] for r in found] == list(CASES)
    assert all(r["matches"] for r in found if not r["standin_only"]), found
    own = [r for r in found if r["standin_only"]]
    assert own and all(r["cupy"].startswith("CaptureHazard") for r in own), own
    replay = capture_probe.replay(gpu, cupyx)
    assert replay["ok"] and replay["replays_right"] == [True] * 3 and replay["host_function_calls"] == 3, replay
