"""One compiled call per node per layer: every routed expert's rows, decode and prefill.

Every task is one group g: an expert the node holds rows R of, and the tokens
routed to it. Every matrix is read as rows of the store's format and taken in
dot products (simd.py: each block widened and scaled in registers): the gate
and up rows [R, H] against the tokens' rows of x, then W_down's rows [H, R]
against silu(gate) * up, giving the group's contribution [n, H]. One token
(decode): four rows at a time (bf16's from the matrix's four quarters:
streamed). n >= 2 tokens (prefill, padded to a multiple of 4; f32's and
bf16's last one to three in a short tile: short_tiles): two rows (four for
f32 and bf16 on hosts with 512-bit vectors: wide_tiles; six for short rows or
many tokens: six_rows) by four tokens at a time, each block widened once for
the four, their accumulators in registers; bf16 rows by bf16 activations
(bf16dp.py, EngineConfig.activations bf16) on the tokens rounded to bf16 once per matrix. With integer
activations (the kernel set's int_act), a K type's or IQ4_XS's matrix is taken in integers instead, on the tokens
quantised per super-block (isuper.py), in decode too; q8's and q4's on the tokens quantised per block
(isimd.py in decode, iblock.py in prefill; their matrices of whole groups of eight rows in a group of
GROUPED_FROM tokens or more: eight rows a vector, interleaved on the fly, rows8.py). Tasks run in parallel
(numba's threads, the node's CPUs, each thread taking the next group when done: schedule.py); each writes
only its own contribution, and the caller adds them in group order, so the result does not depend on the
thread count or timing.

Inputs (C-contiguous):
    ks              KernelSet       the formats whose loops are compiled in (kernel_set.py), a compile-time value
    data            [bytes] uint8   the store's buffer (shm/expert_store.py's layout)
    x               [T, H] float32  the layer's rows
    tokens          [P] int64       rows of x, grouped: group g owns tokens[tok_start[g]:tok_stop[g]]
    offsets         [G, 3] int64    byte offsets of group g's expert's gate [R, H], up [R, H] and down [H, R]
    shapes          [G, 8] int64    group g's expert: its rows R; gate's format (FORMAT_IDS) and bytes of a
                                    stored row; up's; down's format, the weights in a stored row (R in whole
                                    blocks: shm.formats.down_width) and that row's bytes (SHAPE names them)
    contrib_start   [G] int64       where group g's [n, H] contribution starts in ``contrib`` (float32)
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from shm.formats.traits import (BF16_PRODUCTS, BLOCK_INT_LOOPS, LOOP_IDS, STREAM_LOOPS, SUPER_INT_LOOPS,
                                 WIDE_LOOPS)

from . import bf16dp, iblock, isimd, isuper, rows8, simd
from .activations import quantize_rows_biased, quantize_rows_summed, quantize_rows_super
from .common import JIT
from .kernel_set import int_products, loop_name
from .schedule import take
from .silu import silu_times

# The large steps (a group's task, a matrix by a group's tokens, decode's rows, the float tiles) are compiled apart,
# each once, and called: inlined, every call site would copy its whole tree into its caller, and the parallel
# loop's passes would copy that again, so the layer kernel would take minutes and gigabytes to compile. A call
# costs nanoseconds beside the microseconds of rows each one computes.
APART = JIT

FORMAT_IDS = LOOP_IDS  # every loop's id: the storage formats' (shm/formats/traits.py), then bf16dp's
BF16DP = FORMAT_IDS[BF16_PRODUCTS]


def loops_with(names) -> tuple[int, ...]:
    """The ids of the loops ``names`` (the kernels test a loop's capability as ``fmt in`` such a tuple)."""
    return tuple(i for name, i in FORMAT_IDS.items() if name in names)


BLOCK_INT = loops_with(BLOCK_INT_LOOPS)  # the per-32 integer loops (q8, q4: isimd.dot4i, iblock)
SUPER_INT = loops_with(SUPER_INT_LOOPS)  # the super-block integer loop (the K types, iq4xs: isuper)
STREAMS = loops_with(STREAM_LOOPS)  # bf16, bf16dp: stream_quad
WIDE = loops_with(WIDE_LOOPS)  # f32, bf16, bf16dp: four-row tiles on WIDE_TILES hosts, short tiles
SIX_ROWS = loops_with([name for name in WIDE_LOOPS if name != BF16_PRODUCTS])  # f32, bf16: six-row tiles
WIDE_IDS = tuple(FORMAT_IDS[name] for name in WIDE_LOOPS)
SUPER_IDS = tuple(FORMAT_IDS[name] for name in SUPER_INT_LOOPS)
SHAPE = ("rows", "gate format", "gate row bytes", "up format", "up row bytes", "down format", "down row weights",
         "down row bytes")  # the columns of an expert's shapes row, numbered below
ROWS, GATE_FMT, GATE_BYTES, UP_FMT, UP_BYTES, DOWN_FMT, DOWN_WIDTH, DOWN_BYTES = range(len(SHAPE))


@njit(inline="always", **JIT)
def quantised_if(use_int, x):
    """x [n, K] quantised per block (activations.py: the values and their scales) when use_int, else the same two
    arrays empty ([n, 0])."""
    xq, xd, _ = quantize_rows_summed(x[:, :x.shape[1] if use_int else 0])
    return xq, xd


@njit(inline="always", **JIT)
def block_int(ks, fmt) -> bool:
    """The per-32 integer loops for this format (Q8_0 or Q4_0, EngineConfig.activations q8: the kernel set's
    int_act): decode's (isimd.py) and prefill's (iblock.py)."""
    return int_products(ks) and fmt in BLOCK_INT


@njit(inline="always", **JIT)
def dot4(ks, fmt, use_int, data, o0, o1, o2, o3, hidden, x, xq, xd):
    """The four rows' dot products with one token: integer ones against its quantised row (xq, xd) when
    use_int (block_int), else float ones against x."""
    if use_int:
        return isimd.dot4i(ks, fmt, data, o0, o1, o2, o3, hidden, xq, xd)
    return simd.dot4(ks, fmt, data, o0, o1, o2, o3, hidden, x)


@njit(inline="always", **JIT)
def quad_super(ks, fmt, data, o, row_bytes, rows, hidden, xq, xd, bs, out, first) -> None:
    """out[0, c] = x' · row c for the four rows c from ``first`` (fewer at the end: each of the last rows alone,
    repeated four times into a scratch tile), rows row_bytes apart from byte o; x' = xd (.) xq [1, hidden]
    quantised per super-block (isuper.dot4r1s, decode's integer loop for a K type or IQ4_XS)."""
    if first + 4 <= rows:
        isuper.dot4r1s(ks, fmt, data, o + first * row_bytes, row_bytes, hidden, xq, xd, bs, 0, out, first)
        return
    tile = np.empty((1, 4), np.float32)
    for c in range(first, rows):
        isuper.dot4r1s(ks, fmt, data, o + c * row_bytes, 0, hidden, xq, xd, bs, 0, tile, 0)
        out[0, c] = tile[0, 0]


@njit(inline="always", **JIT)
def streamed(fmt, use_int) -> bool:
    """One token's bf16 rows (bf16dp's too) four streams at a time (stream_quad), not four rows side by side.

    Four bf16 rows side by side are four streams 4 KiB apart (H 2048), and they read memory slower than
    f32's 8 KiB apart, whatever the arithmetic. The matrix's four quarters as the four rows, with no software
    prefetch (the hardware prefetcher follows four long streams; a prefetch ahead per stream only costs),
    read at f32's speed. f32 rows gain nothing from it, so they stay side by side. Each row is summed
    by the same code either way: the same bits."""
    return not use_int and fmt in STREAMS


@njit(inline="always", **JIT)
def stream_quad(ks, fmt, data, o, row_bytes, rows, hidden, x, out, q) -> None:
    """out[q + k S] = x · row q + k S, k < 4, of the bf16 (or bf16dp's) rows row_bytes apart from byte o, S =
    ceil(rows / 4): the four quarters of the matrix read as four streams (streamed); a row past the end
    repeats the last row (computed, not stored)."""
    S = (rows + 3) // 4
    last = rows - 1
    o0 = o + q * row_bytes
    o1 = o + min(q + S, last) * row_bytes
    o2 = o + min(q + 2 * S, last) * row_bytes
    o3 = o + min(q + 3 * S, last) * row_bytes
    a0, a1, a2, a3 = simd.dot4s(ks, fmt, data, o0, o1, o2, o3, hidden, x)
    out[q] = a0
    if q + S < rows:
        out[q + S] = a1
    if q + 2 * S < rows:
        out[q + 2 * S] = a2
    if q + 3 * S < rows:
        out[q + 3 * S] = a3


@njit(**APART)
def rows_dot(ks, fmt, data, o, row_bytes, rows, hidden, x, out) -> None:
    """out[r] = x · row r, r < rows (rows row_bytes apart from byte o, ``hidden`` weights each): four rows at a
    time (bf16's four streams: stream_quad), a short last group repeating its last row (computed, not
    stored); integer dot products on x quantised per block when the kernel set takes them and the format has
    integers (per super-block for a K type or IQ4_XS: quad_super)."""
    if super_int(ks, fmt):
        xq, xd, bs = quantize_rows_super(x[:hidden].reshape((1, hidden)))
        out2 = out[:rows].reshape((1, rows))
        for r in range(0, rows, 4):
            quad_super(ks, fmt, data, o, row_bytes, rows, hidden, xq, xd, bs, out2, r)
        return
    use_int = block_int(ks, fmt)
    if streamed(fmt, use_int):
        for q in range((rows + 3) // 4):
            stream_quad(ks, fmt, data, o, row_bytes, rows, hidden, x, out, q)
        return
    xq, xd = quantised_if(use_int, x[:hidden].reshape((1, hidden)))
    for r in range(0, rows, 4):
        m = min(4, rows - r)
        o0 = o + r * row_bytes
        a0, a1, a2, a3 = dot4(ks, fmt, use_int, data, o0, o0 + min(1, m - 1) * row_bytes,
                              o0 + min(2, m - 1) * row_bytes, o0 + min(3, m - 1) * row_bytes, hidden, x, xq[0], xd[0])
        out[r] = a0
        if m > 1:
            out[r + 1] = a1
        if m > 2:
            out[r + 2] = a2
        if m > 3:
            out[r + 3] = a3


@njit(**APART)
def dot_chunks(ks, fmt, data, o, row_bytes, rows, hidden, xg, xb, out, col, n) -> None:
    """out[:n, col:col + R] (+ column col + R) <- xg [>= n, H] · the R rows from byte offset o (xg's rows a
    multiple of 4, zeros past n): four rows (wide_tiles) or two and four tokens at a time (x read once for the
    rows, four tokens' x in L1), the last one to three of n in a tile of their own (short_tiles; else the
    tile padded with zero tokens); an odd last row fills column col + R. bf16dp's rows take xb instead: xg
    rounded to bf16 (rounded_if)."""
    r = 0
    while six_rows(fmt, hidden, n) and r + 6 <= rows:
        six_row_tiles(ks, fmt, data, o + r * row_bytes, row_bytes, hidden, xg, out, col + r, n)
        r += 6
    while wide_tiles(fmt) and r + 4 <= rows:
        tile_tokens(ks, fmt, True, data, o + r * row_bytes, row_bytes, hidden, xg, xb, out, col + r, n)
        r += 4
    while r < rows:
        step = row_bytes if r + 1 < rows else 0
        tile_tokens(ks, fmt, False, data, o + r * row_bytes, step, hidden, xg, xb, out, col + r, n)
        r += 2


# f32 and bf16 rows on WIDE_TILES hosts, six at a time (simd.dot6rK) where the rows are at most this long (an
# expert's down rows: its R weights; four tokens' x and six rows of bf16 stay in L1) ...
SIX_ROWS_WIDTH = 1024
# ... or the tokens this many or more (a larger group's gate and up rows, the dense matrices' prefill) ...
SIX_ROWS_TOKENS = 12
# ... and from this many tokens on each row's bytes are read for so many tiles that the four-token tiles leave the
# prefetch out (simd.dot6r4n; the hardware's prefetcher follows the rows)
UNFETCHED_TOKENS = 32


@njit(inline="always", **JIT)
def six_rows(fmt, hidden, n) -> bool:
    """Six rows at a time (six_row_tiles) for this format, rows of ``hidden`` weights and n tokens.

    Short rows and many tokens gain from six rows; long rows by few tokens read each row's bytes from memory
    for too few tiles to hide it behind two passes: they keep four rows."""
    return simd.WIDE_TILES and fmt in SIX_ROWS and (
        hidden <= SIX_ROWS_WIDTH or n >= SIX_ROWS_TOKENS)


@njit(inline="always", **JIT)
def six_row_tiles(ks, fmt, data, o, step, hidden, xg, out, col, n) -> None:
    """out[:n, col:col + 6] <- xg [>= n, H] · the six rows from byte offset o, ``step`` bytes apart: four
    tokens at a time, the last n mod 4 in a tile of their own (tile_tokens' order: the same bits)."""
    t0 = 0
    while t0 + 4 <= n:
        if n < UNFETCHED_TOKENS:
            simd.dot6r4(ks, fmt, data, o, step, hidden, xg, t0, out, col)
        else:
            simd.dot6r4n(ks, fmt, data, o, step, hidden, xg, t0, out, col)
        t0 += 4
    if n - t0 == 3:
        simd.dot6r3(ks, fmt, data, o, step, hidden, xg, t0, out, col)
    elif n - t0 == 2:
        simd.dot6r2(ks, fmt, data, o, step, hidden, xg, t0, out, col)
    elif n - t0 == 1:
        simd.dot6r1(ks, fmt, data, o, step, hidden, xg, t0, out, col)


@njit(inline="always", **JIT)
def aligned_zeros(rows, cols):
    """float32 zeros [rows, cols] from a 64-byte boundary: the tiles' 64-byte loads of a token's row then each
    read one cache line, where NumPy's allocator starts an array 16 bytes past one as often as not and every
    load spans two."""
    buf = np.zeros(rows * cols + 16, np.float32)
    skip = (64 - buf.ctypes.data % 64) % 64 // 4
    return buf[skip:skip + rows * cols].reshape((rows, cols))


@njit(inline="always", **JIT)
def tile_tokens(ks, fmt, four, data, o, step, hidden, xg, xb, out, col, n) -> None:
    """out[:n, col:col + 4 (four) or 2] <- every four tokens of xg (of xb for bf16dp's rows) · the rows from
    byte offset o, ``step`` bytes apart; the last n mod 4 in a short tile (short_tiles), else padded."""
    whole = n // 4 * 4 if short_tiles(fmt) else xg.shape[0]
    for t0 in range(0, whole, 4):
        if fmt == BF16DP and four:
            simd.pairs4r4(ks, data, o, step, hidden, xb, t0, out, col)
        elif fmt == BF16DP:
            simd.pairs2r4(ks, data, o, step, hidden, xb, t0, out, col)
        elif four:
            simd.dot4r4(ks, fmt, data, o, step, hidden, xg, t0, out, col)
        else:
            simd.dot2r4(ks, fmt, data, o, step, hidden, xg, t0, out, col)
    if whole < n:
        short_tile(ks, fmt, four, data, o, step, hidden, xg, xb, out, col, whole, n - whole)


@njit(inline="always", **JIT)
def short_tiles(fmt) -> bool:
    """A group's last n mod 4 tokens in a tile of one, two or three tokens (short_tile) for f32 and bf16 rows
    and bf16dp's, not a tile of four padded with zero tokens: a prefill's groups are small (about 8 tokens
    each at 64 tokens, top-8 of 64 experts), so the padding would be a sizeable share of the work."""
    return fmt in WIDE


@njit(inline="always", **JIT)
def short_tile(ks, fmt, four, data, o, step, hidden, xg, xb, out, col, t0, k) -> None:
    """out[t0:t0 + k, col:col + 4 (four) or 2] <- tokens t0..t0 + k - 1 (k < 4) · the rows (tile_tokens)."""
    if fmt == BF16DP:
        if four:
            if k == 1:
                simd.pairs4r1(ks, data, o, step, hidden, xb, t0, out, col)
            elif k == 2:
                simd.pairs4r2(ks, data, o, step, hidden, xb, t0, out, col)
            else:
                simd.pairs4r3(ks, data, o, step, hidden, xb, t0, out, col)
        elif k == 1:
            simd.pairs2r1(ks, data, o, step, hidden, xb, t0, out, col)
        elif k == 2:
            simd.pairs2r2(ks, data, o, step, hidden, xb, t0, out, col)
        else:
            simd.pairs2r3(ks, data, o, step, hidden, xb, t0, out, col)
    elif four:
        if k == 1:
            simd.dot4r1(ks, fmt, data, o, step, hidden, xg, t0, out, col)
        elif k == 2:
            simd.dot4r2(ks, fmt, data, o, step, hidden, xg, t0, out, col)
        else:
            simd.dot4r3(ks, fmt, data, o, step, hidden, xg, t0, out, col)
    elif k == 1:
        simd.dot2r1(ks, fmt, data, o, step, hidden, xg, t0, out, col)
    elif k == 2:
        simd.dot2r2(ks, fmt, data, o, step, hidden, xg, t0, out, col)
    else:
        simd.dot2r3(ks, fmt, data, o, step, hidden, xg, t0, out, col)


@njit(inline="always", **JIT)
def rounded_if(use, x):
    """x [n, K] rounded to bf16 ([n, K] uint16: bf16dp.round_rows) when use (bf16dp's rows), else [n, 0]: the
    tokens rounded once for all of a matrix's rows (for gate's and up's together)."""
    xb = np.empty((x.shape[0], x.shape[1] if use else 0), np.uint16)
    if use:
        bf16dp.round_rows(x, xb)
    return xb


def loop_id(name: str, bf16_products: bool) -> int:
    """The kernels' id (FORMAT_IDS) of the loop that takes a matrix stored in shm format ``name`` (kernel_set.loop_name)."""
    return FORMAT_IDS[loop_name(name, bf16_products)]


@njit(inline="always", **JIT)
def wide_tiles(fmt) -> bool:
    """Four rows by four tokens (simd.dot4r4, pairs4r4) for f32 and bf16 rows on a host with 512-bit vectors,
    whose 32 registers hold the sixteen accumulators: each token's block is loaded once for four rows."""
    return simd.WIDE_TILES and fmt in WIDE


@njit(inline="always", **JIT)
def super_int(ks, fmt) -> bool:
    """The super-block integer loop for this format (a K type or IQ4_XS, EngineConfig.activations q8: the kernel
    set's int_act)."""
    return int_products(ks) and fmt in SUPER_INT


@njit(inline="always", **JIT)
def row_tokens_int(ks, fmt, data, o, row_bytes, hidden, xq, xd, bs, out, col, n) -> None:
    """out[:n, col] <- the first n tokens of the quantised xq, xd, bs (quantize_rows_super of [>= n, H]) · the
    row at byte offset o (rows row_bytes apart): eight tokens at a time, then four, then the last two or
    three (n mod 4 is not 1: tiled_tokens) (isuper.py)."""
    t0 = 0
    while t0 + 8 <= n:
        isuper.dot1r8s(ks, fmt, data, o, row_bytes, hidden, xq, xd, bs, t0, out, col)
        t0 += 8
    if t0 + 4 <= n:
        isuper.dot1r4s(ks, fmt, data, o, row_bytes, hidden, xq, xd, bs, t0, out, col)
        t0 += 4
    if n - t0 == 3:
        isuper.dot1r3s(ks, fmt, data, o, row_bytes, hidden, xq, xd, bs, t0, out, col)
    elif n - t0 == 2:
        isuper.dot1r2s(ks, fmt, data, o, row_bytes, hidden, xq, xd, bs, t0, out, col)


@njit(inline="always", **JIT)
def row_tokens_block(ks, fmt, data, o, row_bytes, hidden, xu, xd, out, col, n) -> None:
    """out[:n, col] <- the first n tokens of xu, xd (quantize_rows_biased of [>= n, H]) . the q8 or q4 row at
    byte offset o: eight tokens at a time, then four, then the last one to three (iblock.py). No padding: the
    tiles of fewer tokens run slower a token, but a prefill's small groups padded to four would spend more
    on zero rows."""
    t0 = 0
    while t0 + 8 <= n:
        iblock.dot1r8b(ks, fmt, data, o, row_bytes, hidden, xu, xd, t0, out, col)
        t0 += 8
    if t0 + 4 <= n:
        iblock.dot1r4b(ks, fmt, data, o, row_bytes, hidden, xu, xd, t0, out, col)
        t0 += 4
    if n - t0 == 3:
        iblock.dot1r3b(ks, fmt, data, o, row_bytes, hidden, xu, xd, t0, out, col)
    elif n - t0 == 2:
        iblock.dot1r2b(ks, fmt, data, o, row_bytes, hidden, xu, xd, t0, out, col)
    elif n - t0 == 1:
        iblock.dot1r1b(ks, fmt, data, o, row_bytes, hidden, xu, xd, t0, out, col)


GROUPED_FROM = 3  # a q8 or q4 group of this many tokens or more: its matrices' rows eight at a time (grouped8)


@njit(inline="always", **JIT)
def grouped8(ks, fmt, rows, n) -> bool:
    """q8 or q4 rows taken eight at a time, interleaved on the fly (rows8.py), for a group of n tokens: whole
    groups of eight rows, and enough tokens to pay for the interleaving (GROUPED_FROM). q4's rows go the same
    way, as unsigned bytes (q + 8, rows8.UNSIGNED)."""
    return block_int(ks, fmt) and rows % rows8.GROUP_ROWS == 0 and n >= GROUPED_FROM


@njit(inline="always", **JIT)
def quantised_block_if(use, signed, x):
    """x [n, K] quantised per block, (xu, xd, xq, xsum): for rows8.py when signed (quantize_rows_summed: xq, xd,
    xsum; xu empty), else for iblock.py when use (quantize_rows_biased: xu, xd; xq, xsum empty), else all empty."""
    xq, xd_signed, xsum = quantize_rows_summed(x[:, :x.shape[1] if signed else 0])
    xu, xd_biased = quantize_rows_biased(x[:, :x.shape[1] if use and not signed else 0])
    return xu, (xd_signed if signed else xd_biased), xq, xsum


@njit(inline="always", **JIT)
def quantised_super_if(use, x):
    """x [n, K] quantised per super-block (quantize_rows_super) when use, else the same three arrays empty."""
    return quantize_rows_super(x[:, :x.shape[1] if use else 0])


@njit(inline="always", **JIT)
def tiled_tokens(n):
    """Of a group's n tokens, how many the integer loop's tiles (eight, four, three, two: row_tokens_int) take:
    more than n where padding with zero rows is the cheaper, n - 1 where the one left over is cheaper alone
    against four rows at a time (quad_super). By n mod 8: 1 or 5, one alone; 2 or 3, a tile of two or three;
    6 or 7, padded to an eight. Per token the tiles of more tokens are the faster, down to one row by one
    token, which is no faster than four rows by one: two or three left cost less as a tile than padded to
    four, six or seven about as much as padded to eight."""
    r = n % 8
    if r == 1 or r == 5:
        return n - 1
    if r == 6 or r == 7:
        return n - r + 8
    return n


@njit(**APART)
def matrix_tokens(ks, fmt, data, o, row_bytes, rows, hidden, xg, quantised, blocks, rounded, out, n) -> None:
    """out [n, R (+1)] <- xg [n, H] · the R rows from byte offset o (xg padded with zero rows to a multiple
    of 4, or of 8: tiled_tokens): the integer loop on ``quantised`` (quantised_super_if of xg) for a K type or
    IQ4_XS when the kernel set takes integers, on the tiled_tokens(n) first tokens then the rest one by one; on ``blocks``
    (quantised_block_if of xg) for q8 or q4, the n tokens (in whole groups of eight rows: grouped8, on the
    signed values, computed once for gate and up); else the float one on every row of xg (bf16dp's on
    ``rounded``, rounded_if of xg)."""
    if grouped8(ks, fmt, rows, n):
        _, xd, xq, xsum = blocks
        rows8.rows_by_eight(ks, fmt, data, o, row_bytes, rows, hidden, xq, xd, xsum, out, n)
    elif block_int(ks, fmt):
        xu, xd, _, _ = blocks
        for r in range(rows):
            row_tokens_block(ks, fmt, data, o + r * row_bytes, row_bytes, hidden, xu, xd, out, r, n)
    elif super_int(ks, fmt):
        xq, xd, bs = quantised
        tiled = tiled_tokens(n)
        for r in range(rows):
            row_tokens_int(ks, fmt, data, o + r * row_bytes, row_bytes, hidden, xq, xd, bs, out, r, tiled)
        for t in range(tiled, n):
            for c in range(0, rows, 4):
                quad_super(ks, fmt, data, o, row_bytes, rows, hidden, xq[t:t + 1], xd[t:t + 1], bs[t:t + 1],
                           out[t:t + 1], c)
    else:
        dot_chunks(ks, fmt, data, o, row_bytes, rows, hidden, xg, rounded, out, 0, n)


@njit(inline="always", **JIT)
def task_tokens(ks, data, hidden, xg, og, ou, od, shape, out, n) -> None:
    """A group of n tokens (xg [padded, H], gathered, zero rows past n to a multiple of 4): gate and up against
    the tokens, then W_down's H rows (R weights each) the same way against silu(gate) * up [n, R] into out
    [padded, H] (rows past n: not the group's); a K type's or IQ4_XS's rows in integers when the kernel set
    takes them (matrix_tokens)."""
    R, width, fmt_d, down_bytes = shape[ROWS], shape[DOWN_WIDTH], shape[DOWN_FMT], shape[DOWN_BYTES]
    padded = xg.shape[0]
    gate = np.zeros((padded, R + 1), np.float32)  # [n, R] (+ a column for an odd R's repeated last row)
    up = np.zeros((padded, R + 1), np.float32)
    xs = quantised_super_if(super_int(ks, shape[GATE_FMT]) or super_int(ks, shape[UP_FMT]), xg)  # once for both
    xb = quantised_block_if(block_int(ks, shape[GATE_FMT]) or block_int(ks, shape[UP_FMT]),  # no padding
                            grouped8(ks, shape[GATE_FMT], R, n) or grouped8(ks, shape[UP_FMT], R, n), xg[:n])
    xr = rounded_if(shape[GATE_FMT] == BF16DP or shape[UP_FMT] == BF16DP, xg)  # once for both
    matrix_tokens(ks, shape[GATE_FMT], data, og, shape[GATE_BYTES], R, hidden, xg, xs, xb, xr, gate, n)
    matrix_tokens(ks, shape[UP_FMT], data, ou, shape[UP_BYTES], R, hidden, xg, xs, xb, xr, up, n)
    h = aligned_zeros(padded, width)  # silu(gate) * up, per token and row (zeros past R and n)
    silu_times(gate, up, h, n, R)
    hs = quantised_super_if(super_int(ks, fmt_d), h)
    hb = quantised_block_if(block_int(ks, fmt_d), grouped8(ks, fmt_d, hidden, n), h[:n])
    hr = rounded_if(fmt_d == BF16DP, h)
    if hidden % 2 == 0:
        matrix_tokens(ks, fmt_d, data, od, down_bytes, hidden, width, h, hs, hb, hr, out, n)
    else:
        wide = np.empty((padded, hidden + 1), np.float32)  # the odd last row's repeat lands in the extra column
        matrix_tokens(ks, fmt_d, data, od, down_bytes, hidden, width, h, hs, hb, hr, wide, n)
        out[:, :] = wide[:, :hidden]


@njit(**APART)
def group_task(ks, data, hidden, x, tokens, tok_start, tok_stop, offsets, shapes, contrib, contrib_start, g):
    """Group g's contribution [n, H] into contrib (layer_rows' task)."""
    R, width, down_bytes = shapes[g, ROWS], shapes[g, DOWN_WIDTH], shapes[g, DOWN_BYTES]
    t0, t1 = tok_start[g], tok_stop[g]
    n = t1 - t0
    out = contrib[contrib_start[g]:contrib_start[g] + n * hidden].reshape((n, hidden))
    og, ou, od = offsets[g, 0], offsets[g, 1], offsets[g, 2]
    if n > 1:  # prefill's groups, padded with rows of zeros to a multiple of 4 tokens (8: tiled_tokens)
        padded = max(tiled_tokens(n), (n + 3) // 4 * 4)
        xg = aligned_zeros(padded, hidden)
        for j in range(n):
            xg[j] = x[tokens[t0 + j]]
        yg = out if padded == n else np.empty((padded, hidden), np.float32)
        task_tokens(ks, data, hidden, xg, og, ou, od, shapes[g], yg, n)
        if padded != n:
            out[:, :] = yg[:n]
        return
    xj = x[tokens[t0]]
    gate = np.empty(R, np.float32)  # [R]
    up = np.empty(R, np.float32)
    h = np.zeros(width, np.float32)  # silu(gate) * up (zeros past R)
    rows_dot(ks, shapes[g, GATE_FMT], data, og, shapes[g, GATE_BYTES], R, hidden, xj, gate)
    rows_dot(ks, shapes[g, UP_FMT], data, ou, shapes[g, UP_BYTES], R, hidden, xj, up)
    # into a buffer of its own, as task_tokens' h: written in place over gate, the loop would take its scalar
    # form (LLVM's run-time check finds the arrays overlap), whose division rounds otherwise than the vector one
    silu_times(gate.reshape((1, R)), up.reshape((1, R)), h.reshape((1, width)), 1, R)
    rows_dot(ks, shapes[g, DOWN_FMT], data, od, down_bytes, hidden, width, h, out[0])


# The groups are handed out one at a time in their order (schedule.take), not split by prange into one run
# of consecutive groups a thread: a prefill's groups differ (a 64-token prefill routes 1 to 20 or 30 tokens to an
# expert, 8 on average), so one thread's run would hold more than the other's, which would wait at the loop's
# end. The order stays the experts' (their weights' order in the store): handed out largest first, the groups
# would read the weights out of order, slower than static runs. Each group still writes only its own contribution,
# added in group order after the loop (layer.py): the same bits.
@njit(parallel=True, **JIT)
def layer_rows(ks, data, hidden, x, tokens, tok_start, tok_stop, offsets, shapes, contrib, contrib_start):
    G = tok_start.size
    counter = np.zeros(1, np.int64)
    for _ in prange(G):  # a thread's first iteration takes groups until none is left; the rest find none
        g = take(counter, 0)
        while g < G:
            group_task(ks, data, hidden, x, tokens, tok_start, tok_stop, offsets, shapes, contrib, contrib_start, g)
            g = take(counter, 0)
