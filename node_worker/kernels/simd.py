"""Explicit vector loops over rows of any format, written in LLVM IR through numba intrinsics.

Numba's auto-vectorizer turns a block-scaled row (a float16 scale every 32
values) into nested loops that reduce every block horizontally, a fraction of
what the memory gives. Here each block of 32 values
is one LLVM vector ``<32 x float>``: the format's module (f32.py, bf16.py,
q8.py, q4.py; q4k.py, q5k.py, q6k.py, iq4xs.py for a GGUF file's blocks, a group of 32
of their super-blocks of 256 at a time) widens the block in registers and
returns its scale apart (or the weights whole, the K types), the
loop multiplies the scale in once per block and accumulates into a vector per
row, which is reduced once at the end of the row. The IR names no instruction
set: LLVM lowers ``<32 x float>`` to four AVX2 registers, two AVX-512 ones, or
whatever the host has, so nothing assumes a vector width.

Every intrinsic takes the kernel set first (kernel_set.py: a compile-time value naming the formats whose loops
are generated) and the format as a run-time argument, its FORMATS index, switched on in the code.

One on four rows at byte offsets o0..o3 of ``data`` (decode: every matrix of an expert, and the dense
matrices, is read as rows taken in dot products; the rows two calls ahead are prefetched, as dot2r4 prefetches
the rows four pairs ahead):

    dot4(ks, fmt, data, o0, o1, o2, o3, hidden, x)      -> (x·w0, x·w1, x·w2, x·w3)    x [H] float32

and, for bf16 rows (and bf16dp's), the same without the prefetch, for four rows that are four streams far
apart (rows.stream_quad: a matrix's four quarters; the hardware prefetcher follows them):

    dot4s(ks, fmt, data, o0, o1, o2, o3, hidden, x)     as dot4, fmt one of STREAM_FORMATS

one for groups of several tokens (prefill), the format a run-time argument (its FORMATS index), its
accumulators unrolled into registers (on AVX2, f32's and bf16's four-token tiles as parts of one register
each, taken in turn over a few blocks: _emit_dotk_parts, PARTED, the same bits):

    dot2r4(ks, fmt, data, o, row_step, hidden, xg, t0, out, col)
                                                        out[t0 + t, col + j] = xg[t0 + t] · the row at
                                                        o + j row_step, t < 4, j < 2 (each block widened
                                                        once for the four tokens, x read once for both rows)
    dot4r4(ks, fmt, data, o, row_step, hidden, xg, t0, out, col)
                                                        the same, j < 4, for f32 and bf16 (WIDE_FORMATS) on
                                                        hosts with 512-bit vectors (WIDE_TILES): its 16
                                                        accumulators fill AVX-512's 32 registers, and each x
                                                        block loaded serves four rows. Every (row, token) is
                                                        summed in the same order as dot2r4's: the same bits
                                                        (rows of whole blocks; a partial last block's few
                                                        values may be added in another order)
    dot6r4, dot6r4n(ks, fmt, data, o, row_step, hidden, xg, t0, out, col)
                                                        the same, j < 6, f32 and bf16 on WIDE_TILES hosts
                                                        (rows.six_rows: a matrix by 12 tokens or more, or
                                                        rows of up to 1024 weights), each accumulator as two
                                                        registers taken in turn over the whole row
                                                        (_emit_dotk_parts); dot6r4n without the prefetch

and the same tiles of one to three tokens for f32 and bf16 rows (a group's last tokens, rows.short_tiles):

    dot2rK, dot4rK, dot6rK(ks, fmt, data, o, row_step, hidden, xg, t0, out, col)
                                                        t < K, K = 1, 2, 3: each (row, token) summed as in
                                                        the four-token tiles, the same bits

and for bf16 rows by bf16 activations (bf16dp.py; dot4 of bf16dp rounds the token in the registers):

    pairs2r4(ks, data, o, row_step, hidden, xb, t0, out, col)   as dot2r4, xb [n, H] uint16 the tokens rounded
    pairs4r4(...)                                           to bf16 (bf16dp.round_rows); four rows (WIDE_TILES)
    pairs2rK, pairs4rK(...)                                 K = 1, 2, 3 tokens

and one that writes a row out as float32 (for BLAS on many tokens):

    decode(ks, fmt, data, o, hidden, out)               out [H] float32 = w

f32 and bf16 rows may end in a partial block (H not a multiple of 32): those
values are taken one by one after the vector loop. The order of the float
operations is fixed by the code, so a call gives the same bits wherever it runs:
the in-process pool, the node workers and the dense matrices share these loops.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import bf16, bf16dp, f32
from .common import target_features
from shm.formats.traits import STREAM_LOOPS, WIDE_LOOPS

from .loops import FORMATS, byte_ptr, per_format, prefetch_ahead, register_loop, row_major, step_groups, tile
from .ir import EXACT, F32, I16, I32, LANES, VF, const, splat

FAST = ("fast",)


def _lanes_of(builder, a, b, picks):
    """<len(picks) x float> of a's and b's lanes (a's 0..n-1, then b's n..2n-1)."""
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(I32, len(picks)), picks))


def tree_sums(builder, vecs) -> list:
    """The sums of the lanes of each <n x float> of vecs, each as a tree of halves: the first half's lanes plus
    the second half's, lane by lane, again on the n/2 sums, down to one (EXACT: LLVM keeps the order). The
    vectors are reduced together, two at a time: at each step a pair's halves are gathered into two vectors
    of the pair's width (shuffles) and added in one operation, so the steps' additions are each sum's own, in
    the order a lone tree adds them (the same bits for a vector alone or among others). Decode's rows
    (make_dot4) and the tiles (_finish_tile) both sum this way, so a token gives the same bits in either.

    Not llvm.vector.reduce.fadd on each accumulator (numba's fastmath lets LLVM choose the tree): LLVM lowers
    it to dozens of instructions an accumulator in the tiles, many of them stack loads and stores, which
    weighs on short rows (an expert's down rows)."""
    parts = [(v, [k]) for k, v in enumerate(vecs)]  # (vector, its sums in order); each sum size lanes in a row
    size = vecs[0].type.count
    while size > 1:
        half = size // 2
        if len(parts) % 2 and len(parts) > 1:
            parts.append((ir.Constant(parts[0][0].type, [0.0] * parts[0][0].type.count), []))
        if len(parts) == 1:  # one vector left: its sums' halves within it
            v, ids = parts[0]
            n = v.type.count
            lo = [g * size + i for g in range(n // size) for i in range(half)]
            parts = [(builder.fadd(_lanes_of(builder, v, v, lo), _lanes_of(builder, v, v, [i + half for i in lo]),
                                   flags=EXACT), ids)]
        else:
            paired = []
            for (a, ia), (b, ib) in zip(parts[0::2], parts[1::2]):
                n = a.type.count
                lo = [g * size + i for g in range(n // size) for i in range(half)]
                lo = lo + [n + i for i in lo]  # a's sums' first halves, then b's
                hi = [i + half for i in lo]
                paired.append((builder.fadd(_lanes_of(builder, a, b, lo), _lanes_of(builder, a, b, hi), flags=EXACT),
                               ia + ib))
            parts = paired
        size = half
    sums = [None] * len(vecs)
    for v, ids in parts:
        for lane, k in enumerate(ids):
            sums[k] = builder.extract_element(v, ir.Constant(I32, lane))
    return sums


def _scaled_block(builder, fmt, row, b, hidden):
    """Block b of a row as <32 x float> weights (the scale multiplied in)."""
    w, d = fmt.block(builder, row, b, hidden)
    return w if d is None else builder.fmul(w, splat(builder, d), flags=EXACT)


def _weights(builder, fmt, row, i, j, hidden):
    """<32 x float> weights of group j (a Python int < step_groups(fmt)) of loop step i of a row."""
    return _scaled_block(builder, fmt, row, i, hidden) if step_groups(fmt) == 1 else fmt.group(builder, row, i, j)


def _tail(builder, hidden, nb):
    """Loop over the values of a partial last block (none for the scaled formats)."""
    return cgutils.for_range_slice(builder, builder.mul(nb, const(LANES)), hidden, const(1))


def _tail_add(builder, acc, w, x):
    """acc + w x for a value of the partial last block, each operation rounded (EXACT): with fastmath LLVM fuses
    it into an FMA in some loops and not in others, and a row's sum would depend on the loop (the tile) taking
    it."""
    return builder.fadd(acc, builder.fmul(w, x, flags=EXACT), flags=EXACT)


def _emit_dot4(builder, fmt, rows, xp, hidden_v, ahead: bool) -> list:
    """The four rows' dot products with the float32 row at xp, in format ``fmt``: four float values. ``ahead``:
    prefetch the rows PREFETCH_ROWS rows further on (rows side by side), else nothing (the four rows are four
    streams apart: dot4s)."""
    if getattr(fmt, "DOT_PAIRS", False):
        return [builder.load(s) for s in _dot_pairs(builder, fmt, rows, [xp], hidden_v, ahead=ahead)[0]]
    nb = builder.udiv(hidden_v, const(LANES))
    G = step_groups(fmt)
    accs = [cgutils.alloca_once_value(builder, ir.Constant(VF, [0.0] * LANES)) for _ in rows]
    with cgutils.for_range(builder, builder.udiv(nb, const(G))) as loop:
        i = loop.index
        if ahead:
            prefetch_ahead(builder, fmt, rows, i)
        for j in range(G):
            b = builder.add(builder.mul(i, const(G)), const(j))
            xv = builder.load(builder.bitcast(builder.gep(xp, [builder.mul(b, const(LANES))]),
                                              VF.as_pointer()), align=4)  # [32] of x, shared by the rows
            for row, acc in zip(rows, accs):
                w = _weights(builder, fmt, row, i, j, hidden_v)
                builder.store(builder.fadd(builder.load(acc), builder.fmul(w, xv, flags=FAST), flags=FAST), acc)
    sums = [cgutils.alloca_once_value(builder, total)  # the four trees together, each its own bits
            for total in tree_sums(builder, [builder.load(acc) for acc in accs])]
    if not fmt.SCALED:
        with _tail(builder, hidden_v, nb) as (i, _):
            xi = builder.load(builder.gep(xp, [i]), align=4)
            for row, acc in zip(rows, sums):
                w = fmt.value(builder, row, i)
                builder.store(_tail_add(builder, builder.load(acc), w, xi), acc)
    return [builder.load(s) for s in sums]


def make_dot4(names, ahead: bool = True):
    """dot4 (every format) or dot4s (``names``: STREAM_FORMATS, ``ahead`` False)."""

    @intrinsic
    def dot4(typingctx, kernels, fmt, data, o0, o1, o2, o3, hidden, x):
        """(x·w0, x·w1, x·w2, x·w3) of the four rows at byte offsets o0..o3 of data, in the format whose
        FORMATS index is fmt (a run-time value; the kernels' set says which formats are compiled)."""
        sig = types.UniTuple(types.float32, 4)(kernels, fmt, data, o0, o1, o2, o3, hidden, x)

        def codegen(context, builder, signature, args):
            fmt_v, data_v, offsets, hidden_v, x_v = args[1], args[2], args[3:7], args[7], args[8]
            base = byte_ptr(context, builder, signature.args[2], data_v)
            rows = [builder.gep(base, [o]) for o in offsets]
            xp = builder.bitcast(byte_ptr(context, builder, signature.args[8], x_v), F32.as_pointer())
            sums = [cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0)) for _ in rows]

            def emit(fmt_module):
                for total, dest in zip(_emit_dot4(builder, fmt_module, rows, xp, hidden_v, ahead), sums):
                    builder.store(total, dest)

            per_format(context, builder, signature.args[0], signature.args[1], fmt_v, emit, names)
            return context.make_tuple(builder, signature.return_type, [builder.load(s) for s in sums])

        return sig, codegen

    return dot4


def _zero():
    return ir.Constant(VF, [0.0] * LANES)


def _fma(builder, acc, w, xv):
    return builder.fadd(acc, builder.fmul(w, xv, flags=FAST), flags=FAST)


def make_dotk(NR: int, K: int, names=FORMATS, parted=None, chunk=None, ahead=True):
    """The tile intrinsic of NR rows by K tokens for the formats ``names``; ``parted``: the formats that take
    _emit_dotk_parts (None: PARTED for a tile of four tokens, none for the short tiles; tests and
    tools/tile_probe.py set it to compare the loops); ``chunk``: its blocks a chunk (None: PART_BLOCKS, 0:
    the whole row)."""
    parted = (PARTED if K == 4 else ()) if parted is None else parted
    chunk = PART_BLOCKS if chunk is None else chunk

    @intrinsic
    def dotk(typingctx, kernels, fmt, data, o, row_step, hidden, xg, t0, out, col):
        """out[t0 + t, col + j] = xg[t0 + t] · the row at byte offset o + j row_step, t < K, j < NR (any format
        of the kernel set: fmt = its FORMATS index; out [n, >= col + NR] float32)."""
        sig = types.void(kernels, fmt, data, o, row_step, hidden, xg, t0, out, col)

        def codegen(context, builder, signature, args):
            fmt_v, data_v, o, row_step, hidden_v, xg_v, t0, out_v, col = args[1:]
            rows, tok, dests = tile(context, builder, (signature.args[2], data_v), o, row_step,
                                     (signature.args[8], out_v), t0, col, NR, K)
            xp = builder.bitcast(byte_ptr(context, builder, signature.args[6], xg_v), F32.as_pointer())
            per_format(context, builder, signature.args[0], signature.args[1], fmt_v,
                        lambda fmt: _emit_dotk_parts(builder, fmt, rows, xp, dests, hidden_v, tok, chunk, ahead)
                        if fmt in parted else _emit_dotk(builder, fmt, rows, xp, dests, hidden_v, tok, ahead), names)
            return context.get_dummy_value()

        return sig, codegen

    return dotk


def _dot_pairs(builder, fmt, rows, xrows, hidden_v, rounded=False, ahead=True) -> list:
    """bf16dp.py's loop: [len(xrows)][len(rows)] float sums (allocas) of each row with each token's row, an
    accumulator of 16 pair sums per (token, row) in a register. ``xrows``: float pointers to float32 rows, each
    block rounded to bf16 in the registers once for all the rows; or (rounded) i16 pointers to rows rounded
    already (bf16dp.round_rows)."""
    nb = builder.udiv(hidden_v, const(LANES))
    NR = len(rows)

    def step(i, accs):  # accs [tokens * NR], token-major
        if ahead:
            prefetch_ahead(builder, fmt, rows, i)
        ws = [fmt.pairs(builder, row, i) for row in rows]
        out = []
        for xr, k in zip(xrows, range(0, len(accs), NR)):
            block = builder.gep(xr, [builder.mul(i, const(LANES))])
            if rounded:
                xb = builder.load(builder.bitcast(block, fmt.VI.as_pointer()), align=2)
            else:
                xb = fmt.activations(builder, builder.load(builder.bitcast(block, VF.as_pointer()), align=4))
            out += [fmt.dot_pairs(builder, acc, w, xb) for w, acc in zip(ws, accs[k:k + NR])]
        return out

    zero = ir.Constant(fmt.VP, [0.0] * fmt.PAIRS)
    flat = register_loop(builder, nb, [zero] * (len(xrows) * NR), step)
    sums = [[cgutils.alloca_once_value(builder, fmt.reduce(builder, acc)) for acc in flat[k:k + NR]]
            for k in range(0, len(flat), NR)]
    with _tail(builder, hidden_v, nb) as (i, _):
        wis = [fmt.value(builder, row, i) for row in rows]
        for xr, per_t in zip(xrows, sums):
            xi = builder.load(builder.gep(xr, [i]), align=2 if rounded else 4)
            xi = fmt.widened(builder, xi) if rounded else fmt.rounded(builder, xi)
            for wi, acc in zip(wis, per_t):
                builder.store(_tail_add(builder, builder.load(acc), wi, xi), acc)
    return sums


def _make_pairsk(NR: int, K: int):
    @intrinsic
    def pairsk(typingctx, kernels, data, o, row_step, hidden, xb, t0, out, col):
        """out[t0 + t, col + j] = xb[t0 + t] · the bf16 row at byte offset o + j row_step, t < K, j < NR: xb [n, H]
        uint16, the tokens rounded to bf16 (bf16dp.round_rows); bf16dp.py's products (nothing where the kernel
        set lacks bf16dp)."""
        sig = types.void(kernels, data, o, row_step, hidden, xb, t0, out, col)

        def codegen(context, builder, signature, args):
            data_v, o, row_step, hidden_v, xb_v, t0, out_v, col = args[1:]
            if not kernels.emits("bf16dp"):
                return context.get_dummy_value()
            rows, tok, dests = tile(context, builder, (signature.args[1], data_v), o, row_step,
                                     (signature.args[7], out_v), t0, col, NR, K)
            xp = builder.bitcast(byte_ptr(context, builder, signature.args[5], xb_v), I16.as_pointer())
            sums = _dot_pairs(builder, bf16dp, rows, [row_major(builder, xp, t, hidden_v, const(0)) for t in tok],
                              hidden_v, rounded=True)
            for per_t, per_dest in zip(sums, dests):
                for acc, dest in zip(per_t, per_dest):
                    builder.store(builder.load(acc), dest, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return pairsk


def _emit_dotk(builder, fmt, rows, xp, dests, hidden_v, tok, ahead=True) -> None:
    nb = builder.udiv(hidden_v, const(LANES))
    NR = len(rows)

    G = step_groups(fmt)

    def step(i, accs):  # accs [K * NR], token-major
        if ahead:
            prefetch_ahead(builder, fmt, rows, i)  # the rows four pairs on (the first chunk of tokens brings them)
        for j in range(G):
            ws = [_weights(builder, fmt, row, i, j, hidden_v) for row in rows]  # each widened once for K tokens
            col = builder.mul(builder.add(builder.mul(i, const(G)), const(j)), const(LANES))
            out = []
            for t, k in zip(tok, range(0, len(accs), NR)):
                xv = builder.load(builder.bitcast(row_major(builder, xp, t, hidden_v, col), VF.as_pointer()),
                                  align=4)
                out += [_fma(builder, acc, w, xv) for w, acc in zip(ws, accs[k:k + NR])]  # one load of x, NR rows
            accs = out
        return accs

    flat = register_loop(builder, builder.udiv(nb, const(G)), [_zero()] * (len(tok) * NR), step)
    _finish_tile(builder, fmt, rows, xp, dests, hidden_v, tok, nb, flat)


def _finish_tile(builder, fmt, rows, xp, dests, hidden_v, tok, nb, flat) -> None:
    """Reduce a tile's accumulators flat [K * NR] (token-major, <32 x float> each), add a partial last block's
    values one by one, store the sums at dests."""
    NR = len(rows)
    totals = tree_sums(builder, flat)
    sums = [[cgutils.alloca_once_value(builder, total) for total in totals[k:k + NR]] for k in range(0, len(flat), NR)]
    if not fmt.SCALED:
        with _tail(builder, hidden_v, nb) as (i, _):
            wis = [fmt.value(builder, row, i) for row in rows]
            for t, per_t in zip(tok, sums):
                xi = builder.load(row_major(builder, xp, t, hidden_v, i), align=4)
                for wi, acc in zip(wis, per_t):
                    builder.store(_tail_add(builder, builder.load(acc), wi, xi), acc)
    for per_t, per_dest in zip(sums, dests):
        for acc, dest in zip(per_t, per_dest):
            builder.store(builder.load(acc), dest, align=4)


PART_BLOCKS = 4  # blocks a chunk of _emit_dotk_parts: its rows' and tokens' share stays in L1 for every part


def _emit_dotk_parts(builder, fmt, rows, xp, dests, hidden_v, tok, chunk=PART_BLOCKS, ahead=True) -> None:
    """_emit_dotk's tile for f32 or bf16 rows (PARTED) with each <32 x float> accumulator kept as PART_LANES
    parts: the block's lanes 0-15 and 16-31 (AVX-512), or four parts of 8 (AVX2), each part a register, taken
    in turn over a chunk of PART_BLOCKS blocks. A 4 x 4 tile's 16 accumulators of <32 x float> take 32
    registers of 16 floats, all of AVX-512's (and dot2r4's 8 take twice AVX2's 16): LLVM keeps some on the stack
    and reloads them each block. A part's 16 (8)
    accumulators, its rows' and tokens' lanes leave registers free, and the chunk's bytes are read again for the
    next part from L1. Each lane adds its products in the same order over the blocks as _emit_dotk's, and the
    parts are joined into the same <32 x float> before the same reduction: the same bits.

    The four-token tiles take it on AVX2 only (PARTED): on AVX-512 f32 runs slower in parts, and bf16's gain
    in cache reaches neither a whole MoE layer nor the dense matrices' prefill. The short tiles (one to three
    tokens) keep _emit_dotk: their few accumulators leave registers free already, and a part's four FMA
    chains (four rows by one token) wait on the FMA's latency. Larger chunks than PART_BLOCKS are no faster,
    smaller ones slower.

    ``chunk`` 0: each part over the whole row, the six-row tiles' (dot6rK, AVX-512): 24 accumulators of 16
    lanes, six rows' and a token's lanes take 31 of the 32 registers, and the second part reads the row's
    bytes again from L1 or L2, which beats chunks of PART_BLOCKS there. Short rows (an expert's down rows)
    gain from six rows; long ones (gate, up) keep four rows in a group of fewer than 12 tokens
    (rows.six_rows)."""
    nb = builder.udiv(hidden_v, const(LANES))
    NR, K, W = len(rows), len(tok), PART_LANES
    S = LANES // W  # parts
    VW = ir.VectorType(F32, W)

    per_chunk = const(chunk) if chunk else nb  # 0: the whole row a chunk

    def chunk_step(c, accs):  # accs [S][K * NR], part-major then token-major
        start = builder.mul(c, per_chunk)
        stop = builder.add(start, per_chunk)
        count = builder.sub(builder.select(builder.icmp_unsigned("<", stop, nb), stop, nb), start)
        out = []
        for s in range(S):
            def step(i, part, s=s):
                b = builder.add(start, i)
                if s == 0:
                    if ahead:
                        prefetch_ahead(builder, fmt, rows, b)  # as _emit_dotk's, once a block
                ws = [fmt.lanes(builder, row, b, W * s, W) for row in rows]
                col = builder.add(builder.mul(b, const(LANES)), const(W * s))
                new = []
                for t, k in zip(tok, range(0, len(part), NR)):
                    xv = builder.load(builder.bitcast(row_major(builder, xp, t, hidden_v, col), VW.as_pointer()),
                                      align=4)
                    new += [_fma(builder, acc, w, xv) for w, acc in zip(ws, part[k:k + NR])]
                return new
            out += register_loop(builder, count, accs[s * K * NR:(s + 1) * K * NR], step)
        return out

    chunks = builder.udiv(builder.add(nb, const(chunk - 1)), const(chunk)) if chunk else const(1)
    flat = register_loop(builder, chunks, [ir.Constant(VW, [0.0] * W)] * (S * K * NR), chunk_step)
    _finish_tile(builder, fmt, rows, xp, dests, hidden_v, tok, nb,
                 [_joined(builder, [flat[s * K * NR + j] for s in range(S)]) for j in range(K * NR)])


def _joined(builder, parts):
    """One vector of the parts' lanes in order (<W x float> each, a power of two of them)."""
    while len(parts) > 1:
        n = parts[0].type.count
        order = ir.Constant(ir.VectorType(I32, 2 * n), list(range(2 * n)))
        parts = [builder.shuffle_vector(parts[i], parts[i + 1], order) for i in range(0, len(parts), 2)]
    return parts[0]


def _emit_decode(builder, fmt, row, outp, hidden_v) -> None:
    """outp[:hidden] <- the row at ``row`` in format ``fmt`` as float32 (exactly shm.formats' decode)."""
    nb = builder.udiv(hidden_v, const(LANES))
    G = step_groups(fmt)
    with cgutils.for_range(builder, builder.udiv(nb, const(G))) as loop:
        i = loop.index
        for j in range(G):
            b = builder.add(builder.mul(i, const(G)), const(j))
            optr = builder.bitcast(builder.gep(outp, [builder.mul(b, const(LANES))]), VF.as_pointer())
            builder.store(_weights(builder, fmt, row, i, j, hidden_v), optr, align=4)
    if not fmt.SCALED:
        with _tail(builder, hidden_v, nb) as (i, _):
            builder.store(fmt.value(builder, row, i), builder.gep(outp, [i]), align=4)


@intrinsic
def decode(typingctx, kernels, fmt, data, o, hidden, out):
    """out [H] float32 <- the row at byte offset o of data, in the format whose FORMATS index is fmt, dequantised
    (exactly shm.formats' decode; bf16dp's rows are bf16's)."""
    sig = types.void(kernels, fmt, data, o, hidden, out)

    def codegen(context, builder, signature, args):
        fmt_v, data_v, o, hidden_v, out_v = args[1:]
        row = builder.gep(byte_ptr(context, builder, signature.args[2], data_v), [o])
        outp = builder.bitcast(byte_ptr(context, builder, signature.args[5], out_v), F32.as_pointer())
        per_format(context, builder, signature.args[0], signature.args[1], fmt_v,
                    lambda m: _emit_decode(builder, bf16 if m is bf16dp else m, row, outp, hidden_v))
        return context.get_dummy_value()

    return sig, codegen


def host_has_512_bit_vectors() -> bool:
    """AVX-512 (32 registers of 16 floats): dot4r4's 16 accumulators of <32 x float> fit in them (as parts of
    16: _emit_dotk_parts). On AVX2 (16 registers of 8 floats) dot2r4's eight already take twice the register
    file (as parts of 8 they take half)."""
    return "avx512f" in target_features()


WIDE_TILES = host_has_512_bit_vectors()  # a constant of the compiled kernels (numba's cache is per CPU and features)
PART_LANES = 16 if WIDE_TILES else 8  # floats a register holds: an accumulator part of _emit_dotk_parts
# the four-token tiles' formats that take _emit_dotk_parts: on AVX2 only. AVX-512's bf16 tile gains in cache
# but not in a whole MoE layer or dense prefill (_emit_dotk_parts' docstring)
PARTED = () if WIDE_TILES else (f32, bf16)


dot4 = make_dot4(FORMATS)
STREAM_FORMATS = STREAM_LOOPS  # one token's rows read as four streams (rows.stream_quad): dot4s
dot4s = make_dot4(STREAM_FORMATS, ahead=False)
dot2r4 = make_dotk(2, 4, tuple(name for name in FORMATS if name != "bf16dp"))
dot4r4 = make_dotk(4, 4, ("f32", "bf16"))  # only where the host's registers hold its 16 accumulators: WIDE_TILES
pairs2r4, pairs4r4 = _make_pairsk(2, 4), _make_pairsk(4, 4)  # bf16dp's rows (the tokens rounded to bf16 first)
# a group's last one to three tokens, in place of a tile padded with zero tokens (rows.short_tiles): f32, bf16, bf16dp
dot2r1, dot2r2, dot2r3 = (make_dotk(2, K, ("f32", "bf16")) for K in (1, 2, 3))
dot4r1, dot4r2, dot4r3 = (make_dotk(4, K, ("f32", "bf16")) for K in (1, 2, 3))
pairs2r1, pairs2r2, pairs2r3 = (_make_pairsk(2, K) for K in (1, 2, 3))
pairs4r1, pairs4r2, pairs4r3 = (_make_pairsk(4, K) for K in (1, 2, 3))
dot6r4, dot6r3, dot6r2 = (make_dotk(6, K, ("f32", "bf16"), parted=(f32, bf16), chunk=0) for K in (4, 3, 2))
dot6r1 = make_dotk(6, 1, ("f32", "bf16"), parted=())
dot6r4n = make_dotk(6, 4, ("f32", "bf16"), parted=(f32, bf16), chunk=0, ahead=False)
WIDE_FORMATS = WIDE_LOOPS  # four rows at a time on WIDE_TILES hosts: dot4r4's formats, pairs4r4's



