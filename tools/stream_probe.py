#!/usr/bin/env python
"""One token's rows read four at a time, side by side or as four streams: GB/s, alternating in one process.

    .venv/bin/python tools/stream_probe.py [--rounds 3] [--what lm_head,experts]

Why bf16 rows read as four streams (node_worker/kernels/rows.py, ``streamed``):
four rows side by side are four streams one row apart (bf16: 4 KiB for H 2048;
f32: 8 KiB), and on some hosts the bf16 ones read memory slower whatever the
arithmetic. This probe takes the engine's own one-token loop, simd.make_dot4,
both ways, and times it on the lm_head (151936 x 2048, one token, the rows
split over numba's threads) and on 8 random experts of 64 (gate and up 768 x
2048, down 2048 x 768) a call:

    side by side, the prefetch 8 rows on (simd.dot4: what f32 rows take)
    four streams (the matrix's quarters), no prefetch (simd.dot4s, rows.stream_quad: what bf16's take)

Each lm_head result is checked against the engine's own product (x @ PackedMatrix.T) bit for bit. Its
numba code is compiled apart (not cached), in a few seconds.
"""

from __future__ import annotations

from shm import threads_env

threads_env.apply()  # the thread settings strata's commands run with, before NumPy loads

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from numba import njit, prange

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.host.packed import PackedMatrix  # noqa: E402
from node_worker.kernels import simd  # noqa: E402
from node_worker.kernels.kernel_set import KernelSet  # noqa: E402
from node_worker.kernels.rows import FORMAT_IDS  # noqa: E402
from shm import formats  # noqa: E402


def matrix_loop(dot4, stream: bool):
    """out [R] = x . the rows of a matrix [R, H] (R a multiple of 4), four at a time over the threads."""

    @njit(parallel=True, fastmath=True, nogil=True)
    def matrix(ks, fmt, data, row_bytes, R, H, x, out):
        S = R // 4
        for q in prange(S):
            first, apart = (q, S) if stream else (4 * q, 1)  # rows first + k apart, k < 4
            o = first * row_bytes
            d = apart * row_bytes
            a0, a1, a2, a3 = dot4(ks, fmt, data, o, o + d, o + 2 * d, o + 3 * d, H, x)
            out[first], out[first + apart], out[first + 2 * apart], out[first + 3 * apart] = a0, a1, a2, a3

    return matrix


def expert_loop(dot4, stream: bool):
    """8 experts a call, one token: gate, up [R, H] and down [H, R] of each, the experts over the threads."""

    @njit(parallel=True, fastmath=True, nogil=True)
    def layer(ks, fmt, data, expert_bytes, wbytes, H, R, x, experts, out):
        for g in prange(experts.size):
            base = experts[g] * expert_bytes
            for m in range(3):
                rows, width = (R, H) if m < 2 else (H, R)
                step = width * wbytes
                o = base + m * R * H * wbytes
                S = rows // 4
                for q in range(S):
                    first, apart = (q, S) if stream else (4 * q, 1)
                    oo = o + first * step
                    d = apart * step
                    a0, a1, a2, a3 = dot4(ks, fmt, data, oo, oo + d, oo + 2 * d, oo + 3 * d, width, x)
                    out[g, m, q] = a0 + a1 + a2 + a3

    return layer


def median_gbs(run, nbytes: float, calls: int) -> float:
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return nbytes / float(np.median(times)) / 1e9


VARIANTS = (("side by side, prefetch 8 rows on", False), ("four streams, no prefetch", True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--what", default="lm_head,experts")
    args = ap.parse_args()
    what = args.what.split(",")
    rng = np.random.default_rng(0)
    H, R, E = 2048, 768, 64
    # the engine's one-token loop: with the prefetch (simd.dot4) or without (simd.dot4s)
    dots = {(name, stream): simd.make_dot4((name,), ahead=not stream)
            for name in ("bf16", "f32") for stream in (False, True)}
    loop_args = {name: (KernelSet.of([name], False), FORMAT_IDS[name]) for name in ("bf16", "f32")}
    if "lm_head" in what:
        V = 151936
        w = rng.standard_normal((V, H)).astype(np.float32)
        packed = {name: PackedMatrix.encode(w, formats.get(name)) for name in ("bf16", "f32")}
        del w
        x = rng.standard_normal(H).astype(np.float32)
        want = {name: (x[None] @ pm.T)[0] for name, pm in packed.items()}
        loops = {key: matrix_loop(dot, key[1]) for key, dot in dots.items()}
    if "experts" in what:
        stores = {"bf16": np.ones(E * 3 * R * H * 2, np.uint8), "f32": np.ones(E * 3 * R * H * 4, np.uint8)}
        xe = rng.standard_normal(H).astype(np.float32)
        eloops = {key: expert_loop(dot, key[1]) for key, dot in dots.items()}
        out = np.zeros((8, 3, H // 4), np.float32)
    cols = [f"{w} {name}" for w in ("lm_head", "experts") if w in what for name in ("bf16", "f32")]
    print("GB/s a round, the variants alternating: | round | variant | " + " | ".join(cols) + " |")
    for rnd in range(args.rounds):
        for label, stream in VARIANTS:
            got_gbs = {}
            for name in ("bf16", "f32"):
                if "lm_head" in what:
                    pm = packed[name]
                    got = np.empty(pm.shape[0], np.float32)
                    fn = loops[(name, stream)]
                    fn(*loop_args[name], pm.data, pm.row_bytes, pm.shape[0], H, x, got)
                    assert np.array_equal(got, want[name]), (name, label)  # the engine's bits
                    got_gbs[f"lm_head {name}"] = median_gbs(
                        lambda: fn(*loop_args[name], pm.data, pm.row_bytes, pm.shape[0], H, x, got), pm.nbytes, 7)
                if "experts" in what:
                    data = stores[name]
                    eb = data.nbytes // E
                    wbytes = 2 if name == "bf16" else 4
                    efn = eloops[(name, stream)]

                    def call():
                        efn(*loop_args[name], data, eb, wbytes, H, R, xe, rng.choice(E, 8, replace=False).astype(np.int64),
                            out)

                    call()
                    got_gbs[f"experts {name}"] = median_gbs(call, 8 * eb, 40)
            print(f"| {rnd + 1} | {label} | " + " | ".join(f"{got_gbs[c]:.1f}" for c in cols) + " |", flush=True)

if __name__ == "__main__":
    main()
