#!/usr/bin/env python
"""The prefill tiles' two loops side by side: each accumulator one <32 x float> (simd._emit_dotk) or kept as
parts of one register each (simd._emit_dotk_parts), f32 and bf16 rows, GFLOP/s on one thread, alternating.

    .venv/bin/python tools/tile_probe.py [--rows 64] [--hidden 2048] [--tokens 12] [--tile-tokens 4] [--rounds 9]

The engine's own tile intrinsics (simd._make_dotk with parted=() for the plain loop, and with each format
parted): four rows by --tile-tokens tokens where the host has 512-bit vectors (dot4rK), else two (dot2rK), over a
matrix small enough to stay in cache, so the figure is the loop's arithmetic, not the memory's. Both give the
same bits; the probe checks it. NUMBA_CPU_NAME=haswell (and NUMBA_CPU_FEATURES) times the AVX2 code.
simd.PARTED is what the engine parts on this host, in its four-token tiles only.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # as coordinator/__init__.py, before NumPy loads

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from numba import njit  # noqa: E402

from node_worker.kernels import simd  # noqa: E402

ROWS_A_TILE = 4 if simd.WIDE_TILES else 2


def runner(tile, K):
    @njit(nogil=True, fastmath=True)
    def run(fmt, data, row_bytes, rows, hidden, x, out, reps):
        for _ in range(reps):
            for r in range(0, rows, ROWS_A_TILE):
                for t0 in range(0, x.shape[0] - K + 1, K):
                    tile(fmt, data, r * row_bytes, row_bytes, hidden, x, t0, out, r)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=12, help="a multiple of the tile's")
    ap.add_argument("--tile-tokens", type=int, default=4, choices=(1, 2, 3, 4),
                    help="tokens a tile (1-3: short_tile's)")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    R, K, T = args.rows, args.hidden, args.tokens
    rng = np.random.default_rng(0)
    w = rng.standard_normal((R, K)).astype(np.float32)
    bits = (w.view(np.uint32) >> 16).astype(np.uint16)  # bf16 rows; as f32 the same values
    x = rng.standard_normal((T, K)).astype(np.float32)
    tile_tokens = args.tile_tokens
    loops = {name: runner(simd._make_dotk(ROWS_A_TILE, tile_tokens, ("f32", "bf16"), parted=parted), tile_tokens)
             for name, parted in (("plain", ()), ("parts", (simd.f32, simd.bf16)))}
    print(f"tiles of {ROWS_A_TILE} rows x {tile_tokens} tokens, {R} rows x {K}, {T} tokens, one thread; the engine "
          f"parts {[m.__name__.rsplit('.', 1)[1] for m in simd.PARTED]} in {simd.PART_LANES}-lane registers")
    for name, fmt, data in (("bf16", 1, bits.view(np.uint8).ravel()),
                            ("f32", 0, (bits.astype(np.uint32) << 16).view(np.uint8).ravel())):
        row_bytes = data.size // R
        outs = {k: np.zeros((T, R + 1), np.float32) for k in loops}
        for k, run in loops.items():
            run(fmt, data, row_bytes, R, K, x, outs[k], 1)
        assert np.array_equal(outs["plain"], outs["parts"]), "the two loops gave other bits"
        reps = max(1, int(1e9 / (2 * R * K * T)))
        rates: dict[str, list[float]] = {k: [] for k in loops}
        for _ in range(args.rounds):
            for k, run in loops.items():
                t = time.perf_counter()
                run(fmt, data, row_bytes, R, K, x, outs[k], reps)
                rates[k].append(2 * R * K * T * reps / (time.perf_counter() - t) / 1e9)
        print(f"{name}: GFLOP/s median (min-max) " + ", ".join(
            f"{k} {statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" for k, v in rates.items()))


if __name__ == "__main__":
    main()
