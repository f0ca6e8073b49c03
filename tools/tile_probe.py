#!/usr/bin/env python
"""The prefill tiles side by side (simd.make_dotk: rows by tokens, the loop, the prefetch), alternating, GFLOP/s.

    .venv/bin/python tools/tile_probe.py [--variants 4x4plain,6x4whole] [--rows 96] [--hidden 2048]
        [--tokens 24] [--format bf16] [--x-offset 0] [--rounds 5]
    .venv/bin/python tools/tile_probe.py --experts 64 [--rows 1536] [--hidden 2048]
        [--tokens-per-expert 1,3,5,6,7,8,9,10,11,13,14,17] [--variants ...]

A variant is ROWSxTOKENS and its loop: ``plain`` (simd._emit_dotk: each accumulator one <32 x float>),
``partsN`` (simd._emit_dotk_parts over chunks of N blocks) or ``whole`` (the same over the whole row);
``nopf`` at the end leaves the prefetch out. All give the same bits; the probe checks it.

In cache (default): one thread, the tile run over --rows rows of --hidden weights by --tokens tokens (a multiple
of the tile's), small enough for L2, so the figure is the loop's arithmetic. The tokens' rows start on a 64-byte
boundary, plus --x-offset bytes (16: where NumPy's allocator may put them; each 64-byte load then spans two
cache lines).

Out of cache (--experts E): numba's threads take E experts of --rows rows each (a MoE layer's gate and up rows:
1536 x 2048; its down rows: 2048 x 768), each by its own tokens, their counts cycled from --tokens-per-expert,
as rows.dot_chunks does: tiles of the variant's tokens, the last one to three tokens in tiles of as many of the
variant's loop (one token: plain), rows past the last whole tile left out.
NUMBA_CPU_NAME=haswell (and NUMBA_CPU_FEATURES) times the AVX2 code.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # as shm/threads_env.py sets it, before NumPy loads

import argparse  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from numba import njit, prange  # noqa: E402
from numba.typed import List  # noqa: E402

from node_worker.kernels import simd  # noqa: E402
from node_worker.kernels.kernel_set import KernelSet  # noqa: E402
from node_worker.kernels.schedule import take  # noqa: E402

FORMAT_IDS = {"f32": 0, "bf16": 1}  # rows.FORMAT_IDS


def tile(rows: int, tokens: int, loop: str, ahead: bool):
    """The engine's tile intrinsic of ``rows`` x ``tokens`` with ``loop``: plain, partsN or whole."""
    if loop == "plain":
        return simd.make_dotk(rows, tokens, ("f32", "bf16"), parted=(), ahead=ahead)
    chunk = 0 if loop == "whole" else int(loop[len("parts"):])
    return simd.make_dotk(rows, tokens, ("f32", "bf16"), parted=(simd.f32, simd.bf16), chunk=chunk, ahead=ahead)


def parse(variant: str) -> tuple[int, int, str, bool]:
    m = re.fullmatch(r"(\d+)x(\d+)(plain|parts\d+|whole)(nopf)?", variant)
    if not m:
        raise SystemExit(f"variant {variant!r}: ROWSxTOKENS then plain, partsN or whole, then nopf or nothing")
    return int(m[1]), int(m[2]), m[3], not m[4]


def in_cache(variant: str):
    NR, K, loop, ahead = parse(variant)
    dot = tile(NR, K, loop, ahead)

    @njit(nogil=True, fastmath=True)
    def run(ks, fmt, data, row_bytes, rows, hidden, x, out, reps):
        for _ in range(reps):
            for r in range(0, rows - NR + 1, NR):
                for t0 in range(0, x.shape[0] - K + 1, K):
                    dot(ks, fmt, data, r * row_bytes, row_bytes, hidden, x, t0, out, r)
    return run


def out_of_cache(variant: str):
    NR, K, loop, ahead = parse(variant)
    full = tile(NR, K, loop, ahead)
    short = [tile(NR, k, loop if k > 1 else "plain", ahead) for k in range(1, K)]
    one, two, three = (short + [full, full, full])[:3]  # only those below K are called

    @njit(parallel=True, nogil=True, fastmath=True)
    def run(ks, fmt, data, row_bytes, experts, rows, hidden, xs, out, reps):
        for _ in range(reps):
            counter = np.zeros(1, np.int64)
            for _ in prange(experts):  # a thread's first iteration takes experts until none is left
                e = take(counter, 0)
                while e < experts:
                    x = xs[e]
                    n = x.shape[0]
                    for r in range(0, rows - NR + 1, NR):
                        o = (e * rows + r) * row_bytes
                        t0 = 0
                        while t0 + K <= n:
                            full(ks, fmt, data, o, row_bytes, hidden, x, t0, out[e], r)
                            t0 += K
                        if n - t0 == 3:
                            three(ks, fmt, data, o, row_bytes, hidden, x, t0, out[e], r)
                        elif n - t0 == 2:
                            two(ks, fmt, data, o, row_bytes, hidden, x, t0, out[e], r)
                        elif n - t0 == 1:
                            one(ks, fmt, data, o, row_bytes, hidden, x, t0, out[e], r)
                    e = take(counter, 0)
    return run


def aligned_rows(values: np.ndarray, offset: int) -> np.ndarray:
    """A copy of float32 values [n, H] starting ``offset`` bytes past a 64-byte boundary."""
    buf = np.empty(values.nbytes + 128, np.uint8)
    start = -buf.ctypes.data % 64 + offset
    out = buf[start:start + values.nbytes].view(np.float32).reshape(values.shape)
    out[:] = values
    return out


def stored(rng, n: int, hidden: int, name: str) -> np.ndarray:
    """n rows of random bf16 values, stored as bf16 or (the same values) f32, as bytes."""
    bits = (rng.standard_normal((n, hidden)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return (bits if name == "bf16" else bits.astype(np.uint32) << 16).view(np.uint8).ravel()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="4x4plain,4x4parts4,6x4whole,6x4wholenopf")
    ap.add_argument("--format", choices=FORMAT_IDS, default="bf16")
    ap.add_argument("--rows", type=int, default=None, help="rows (an expert's, with --experts); default 96, 1536")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=24, help="in cache: a multiple of every variant's tokens")
    ap.add_argument("--x-offset", type=int, default=0, help="in cache: bytes past a 64-byte boundary")
    ap.add_argument("--experts", type=int, default=0, help="out of cache: this many experts of --rows rows")
    ap.add_argument("--tokens-per-expert", default="1,3,5,6,7,8,9,10,11,13,14,17")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    variants = args.variants.split(",")
    fmt, H = FORMAT_IDS[args.format], args.hidden
    loops = KernelSet.of([args.format], False)
    rng = np.random.default_rng(0)
    if args.experts:
        E, R = args.experts, args.rows or 1536
        counts = [int(n) for n in args.tokens_per_expert.split(",")]
        data = stored(rng, E * R, H, args.format)
        xs = List()
        for e in range(E):
            xs.append(aligned_rows(rng.standard_normal((counts[e % len(counts)], H)).astype(np.float32), 0))
        runs = {v: out_of_cache(v) for v in variants}
        outs = {v: np.zeros((E, max(counts), R + 1), np.float32) for v in variants}
        args_of = {v: (loops, fmt, data, data.size // (E * R), E, R, H, xs, outs[v]) for v in variants}
        flops = 2 * R * H * sum(counts[e % len(counts)] for e in range(E))
        print(f"out of cache: {E} experts x {R} rows x {H} {args.format}, {args.tokens_per_expert} tokens an "
              f"expert, {data.nbytes / 1e6:.0f} MB, numba's threads")
    else:
        R, T = args.rows or 96, args.tokens
        data = stored(rng, R, H, args.format)
        x = aligned_rows(rng.standard_normal((T, H)).astype(np.float32), args.x_offset)
        runs = {v: in_cache(v) for v in variants}
        outs = {v: np.zeros((T, R + 1), np.float32) for v in variants}
        args_of = {v: (loops, fmt, data, data.size // R, R, H, x, outs[v]) for v in variants}
        flops = 2 * R * H * T
        print(f"in cache: {R} rows x {H} {args.format} by {T} tokens (x at +{args.x_offset} bytes), one thread")
    for v in variants:
        runs[v](*args_of[v], 1)
    covered = {v: parse(v)[0] for v in variants}  # rows past the last whole tile are left out
    first = variants[0]
    for v in variants[1:]:
        rows = min(R // covered[v] * covered[v], R // covered[first] * covered[first])
        assert np.array_equal(outs[v][..., :rows], outs[first][..., :rows]), f"{v} gave other bits than {first}"
    reps = max(1, int(2e9 / flops))
    rates: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            t = time.perf_counter()
            runs[v](*args_of[v], reps)
            rates[v].append(flops * R // covered[v] * covered[v] / R * reps / (time.perf_counter() - t) / 1e9)
    for v, r in rates.items():
        print(f"{v}: GFLOP/s median {statistics.median(r):.1f} ({min(r):.1f}-{max(r):.1f})")


if __name__ == "__main__":
    main()
