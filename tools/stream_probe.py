#!/usr/bin/env python
"""One token's rows read four at a time, side by side or as four streams: GB/s, alternating in one process.

    .venv/bin/python tools/stream_probe.py [--rounds 3] [--what lm_head,experts]

Why bf16 rows read as four streams (node_worker/kernels/rows.py, ``streamed``):
four rows side by side are four streams one row apart (bf16: 4 KiB for H 2048;
f32: 8 KiB), and on some hosts the bf16 ones read memory slower whatever the
arithmetic. This probe builds dot4 loops like simd.dot4_F (the same widening and
sums), with the software prefetch given in rows ahead (0: none), and times them
on the lm_head (151936 x 2048, one token, the rows split over numba's threads)
and on 8 random experts of 64 (gate and up 768 x 2048, down 2048 x 768) a call:

    side by side, prefetch 8 rows on (simd.dot4_F: what f32 rows take)
    four streams (the matrix's quarters), no prefetch (rows.stream_quad: bf16's)
    four streams, prefetch 2 rows on per stream

Each lm_head result is checked against the engine's own product (x @ PackedMatrix.T) bit for bit. Its
numba code is compiled apart (cache=False), in a few seconds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.model.packed import PackedMatrix  # noqa: E402
from node_worker.kernels import bf16 as kbf16, f32 as kf32  # noqa: E402
from node_worker.kernels.ir import F32, LANES, VF, const, prefetch  # noqa: E402
from node_worker.kernels.simd import FAST, _byte_ptr, _reduce, _scaled_block  # noqa: E402
from shm import formats  # noqa: E402


def make_dot4(fmt, prefetching: bool):
    """dot4(data, o0..o3, hidden, x, ahead) -> four sums; prefetches each row's block ``ahead`` bytes on."""

    @intrinsic
    def dot4(typingctx, data, o0, o1, o2, o3, hidden, x, ahead):
        sig = types.UniTuple(types.float32, 4)(data, o0, o1, o2, o3, hidden, x, ahead)

        def codegen(context, builder, signature, args):
            data_v, offsets, hidden_v, x_v, ahead_v = args[0], args[1:5], args[5], args[6], args[7]
            base = _byte_ptr(context, builder, signature.args[0], data_v)
            rows = [builder.gep(base, [o]) for o in offsets]
            xp = builder.bitcast(_byte_ptr(context, builder, signature.args[6], x_v), F32.as_pointer())
            accs = [cgutils.alloca_once_value(builder, ir.Constant(VF, [0.0] * LANES)) for _ in rows]
            with cgutils.for_range(builder, builder.udiv(hidden_v, const(LANES))) as loop:
                b = loop.index
                if prefetching:
                    at = builder.add(ahead_v, builder.mul(b, const(fmt.BLOCK_BYTES)))
                    for row in rows:
                        prefetch(builder, builder.gep(row, [at]))
                xv = builder.load(builder.bitcast(builder.gep(xp, [builder.mul(b, const(LANES))]),
                                                  VF.as_pointer()), align=4)
                for row, acc in zip(rows, accs):
                    w = _scaled_block(builder, fmt, row, b, hidden_v)
                    builder.store(builder.fadd(builder.load(acc), builder.fmul(w, xv, flags=FAST), flags=FAST),
                                  acc)
            sums = [_reduce(builder, builder.load(acc)) for acc in accs]
            return context.make_tuple(builder, signature.return_type, sums)

        return sig, codegen

    return dot4


def matrix_loops(dot4):
    """(side_by_side, streams): out [R] = x . rows of a matrix [R, H], R a multiple of 4, over the threads."""

    @njit(parallel=True, fastmath=True, nogil=True)
    def side_by_side(data, base, row_bytes, R, H, x, out, ahead_rows):
        for q in prange(R // 4):
            o = base + 4 * q * row_bytes
            a0, a1, a2, a3 = dot4(data, o, o + row_bytes, o + 2 * row_bytes, o + 3 * row_bytes, H, x,
                                  ahead_rows * row_bytes)
            out[4 * q], out[4 * q + 1], out[4 * q + 2], out[4 * q + 3] = a0, a1, a2, a3

    @njit(parallel=True, fastmath=True, nogil=True)
    def streams(data, base, row_bytes, R, H, x, out, ahead_rows):
        S = R // 4
        for q in prange(S):
            o = base + q * row_bytes
            a0, a1, a2, a3 = dot4(data, o, o + S * row_bytes, o + 2 * S * row_bytes, o + 3 * S * row_bytes, H, x,
                                  ahead_rows * row_bytes)
            out[q], out[S + q], out[2 * S + q], out[3 * S + q] = a0, a1, a2, a3

    return side_by_side, streams


def expert_loop(dot4, stream: bool):
    """8 experts a call, one token: gate, up [R, H] and down [H, R] of each, the experts over the threads."""

    @njit(parallel=True, fastmath=True, nogil=True)
    def layer(data, expert_bytes, wbytes, H, R, x, experts, out, ahead_rows):
        for g in prange(experts.size):
            base = experts[g] * expert_bytes
            for m in range(3):
                o = base + m * R * H * wbytes
                rows, width = (R, H) if m < 2 else (H, R)
                step = width * wbytes
                S = rows // 4
                for q in range(S):
                    if stream:
                        oo = o + q * step
                        a0, a1, a2, a3 = dot4(data, oo, oo + S * step, oo + 2 * S * step, oo + 3 * S * step, width,
                                              x, ahead_rows * step)
                    else:
                        oo = o + 4 * q * step
                        a0, a1, a2, a3 = dot4(data, oo, oo + step, oo + 2 * step, oo + 3 * step, width, x,
                                              ahead_rows * step)
                    out[g, m, q] = a0 + a1 + a2 + a3

    return layer


def median_gbs(run, nbytes: float, calls: int) -> float:
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return nbytes / float(np.median(times)) / 1e9


VARIANTS = (("side by side, prefetch 8", False, True, 8), ("streams, no prefetch", True, False, 0),
            ("streams, prefetch 2", True, True, 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--what", default="lm_head,experts")
    args = ap.parse_args()
    what = args.what.split(",")
    rng = np.random.default_rng(0)
    H, R, E = 2048, 768, 64
    kernels = {(name, pf): make_dot4(mod, pf) for name, mod in (("bf16", kbf16), ("f32", kf32)) for pf in (False, True)}
    if "lm_head" in what:
        V = 151936
        w = rng.standard_normal((V, H)).astype(np.float32)
        packed = {name: PackedMatrix.encode(w, formats.get(name)) for name in ("bf16", "f32")}
        del w
        x = rng.standard_normal(H).astype(np.float32)
        want = {name: (x[None] @ pm.T)[0] for name, pm in packed.items()}
        loops = {key: matrix_loops(k) for key, k in kernels.items()}
    if "experts" in what:
        stores = {"bf16": np.ones(E * 3 * R * H * 2, np.uint8), "f32": np.ones(E * 3 * R * H * 4, np.uint8)}
        xe = rng.standard_normal(H).astype(np.float32)
        eloops = {(key, s): expert_loop(k, s) for key, k in kernels.items() for s in (False, True)}
        out = np.zeros((8, 3, H // 4), np.float32)
    cols = [f"{w} {name}" for w in ("lm_head", "experts") if w in what for name in ("bf16", "f32")]
    print("GB/s a round, the variants alternating: | round | variant | " + " | ".join(cols) + " |")
    for rnd in range(args.rounds):
        for label, stream, pf, ahead in VARIANTS:
            got_gbs = {}
            for name in ("bf16", "f32"):
                if "lm_head" in what:
                    pm = packed[name]
                    got = np.empty(pm.shape[0], np.float32)
                    fn = loops[(name, pf)][1 if stream else 0]
                    fn(pm.data, 0, pm.row_bytes, pm.shape[0], H, x, got, ahead)
                    assert np.array_equal(got, want[name]), (name, label)  # the engine's bits
                    got_gbs[f"lm_head {name}"] = median_gbs(
                        lambda: fn(pm.data, 0, pm.row_bytes, pm.shape[0], H, x, got, ahead), pm.nbytes, 7)
                if "experts" in what:
                    data = stores[name]
                    eb = data.nbytes // E
                    wbytes = 2 if name == "bf16" else 4
                    efn = eloops[((name, pf), stream)]
                    efn(data, eb, wbytes, H, R, xe, rng.choice(E, 8, replace=False).astype(np.int64), out, ahead)

                    def call():
                        efn(data, eb, wbytes, H, R, xe, rng.choice(E, 8, replace=False).astype(np.int64), out, ahead)

                    got_gbs[f"experts {name}"] = median_gbs(call, 8 * eb, 40)
            print(f"| {rnd + 1} | {label} | " + " | ".join(f"{got_gbs[c]:.1f}" for c in cols) + " |", flush=True)

if __name__ == "__main__":
    main()
