"""The stand-in's capture rules against a real GPU's CuPy, and a captured step's shape replayed: run by
tools/gpu_check.sh first, JSON on stdout (or --out FILE).

    python tools/capture_probe.py [--out capture_probe.json]

1. Every call of tests/test_device_standin.py's CASES inside a capture of a real stream: the exception CuPy raises
   and its message, beside the stand-in's (rules the stand-in adds itself, CaptureHazard, are expected to pass
   on CuPy and are reported so).
2. What a graph-ready step does: cudaMemcpyAsync from page-locked memory, a kernel into memory of a private
   allocator, a host function through the driver (coordinator/model/xp.launch_host_func), cudaMemcpyAsync back,
   captured once and launched with new inputs; the outputs must follow the inputs.
Exit status 0 when every refusal matches and the replays are right.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import json_report  # noqa: E402  (tools/json_report.py, beside this file)


def refusals(cp, cx) -> list[dict]:
    import numpy as np

    from test_device_standin import CASES, CaptureHazard

    out = []
    cp.cx = cx
    for rule, (call, error, message) in CASES.items():
        d, h = cp.arange(16, dtype=np.float32), cx.empty_pinned(16, np.float32)
        cp.empty(1 << 20, np.uint8)  # dropped at once: a free block, which free_all_blocks would cudaFree
        stream = cp.cuda.Stream(non_blocking=True)
        raised = None
        with stream:
            stream.begin_capture()
            try:
                call(cp, d, h)
            except Exception as e:  # what CuPy (or the driver) refused, to compare with the stand-in's
                raised = e
            finally:
                try:
                    stream.end_capture()
                except Exception as e:  # a capture CUDA invalidated: the refusal came from the driver
                    raised = raised or e
        got = f"{type(raised).__name__}: {raised}" if raised else None
        own_rule = error is CaptureHazard
        matches = (raised is None) if own_rule else (raised is not None and message in str(raised)
                                                     and isinstance(raised, RuntimeError))
        out.append({"rule": rule, "standin": f"{error.__name__}: {message}", "cupy": got, "matches": matches,
                    "standin_only": own_rule})
    return out


def replay(cp, cx) -> dict:
    import numpy as np

    from coordinator.gpu import transfer as xp

    rt = cp.cuda.runtime
    src, dst = cx.empty_pinned(1024, np.float32), cx.empty_pinned(1024, np.float32)
    buffer = cp.cuda.alloc(1 << 20)
    used = [0]

    def malloc(size):
        at, used[0] = used[0], used[0] + -(-size // 256) * 256
        return buffer + at

    calls = ctypes.c_long(0)
    bump = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda data: setattr(calls, "value", calls.value + 1))
    d = cp.zeros(1024, np.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream, cp.cuda.using_allocator(malloc):
        stream.begin_capture()
        rt.memcpyAsync(xp.device_address(d), src.ctypes.data, src.nbytes, rt.memcpyHostToDevice, stream.ptr)
        doubled = d * 2
        xp.launch_host_func(ctypes.cast(bump, ctypes.c_void_p).value, 0)
        rt.memcpyAsync(dst.ctypes.data, xp.device_address(doubled), dst.nbytes, rt.memcpyDeviceToHost, stream.ptr)
        graph = stream.end_capture()
    right, start = [], time.perf_counter()
    for k in range(1, 4):
        src[...] = np.arange(1024, dtype=np.float32) * k
        graph.launch(stream)
        stream.synchronize()
        right.append(bool(np.array_equal(dst, src * 2)))
    return {"replays_right": right, "host_function_calls": calls.value, "seconds": time.perf_counter() - start,
            "ok": all(right) and calls.value == 3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    import cupy
    import cupyx

    report = {"cupy": cupy.__version__, "device": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
              "refusals": refusals(cupy, cupyx), "replay": replay(cupy, cupyx)}
    report["ok"] = all(r["matches"] for r in report["refusals"]) and report["replay"]["ok"]
    return json_report.emit(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
