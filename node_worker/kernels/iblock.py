"""Prefill's integer loop for the formats in blocks of 32 with a float scale each (Q8_0 and Q4_0: q8, q4).

The tokens come quantised per block of 32 (activations.py's quantize_rows_biased), as decode's (isimd.py),
in the form this loop reads without further work per row:

    xu  [n, K]      uint8    q + 128, q the int8 activation in [-127, 127]
    xd  [n, K / 32] float32  each block's scale d

and a row's blocks come as signed integers s (q8: its int8 values; q4: its nibbles - 8) with their float16
scales d_w (the format's ``iblocks``). Per row, token and G weights (G = 64, two blocks, where the lowering
has 512-bit registers, else 32), with W = G / 4 lanes:

    init <W x i32>   = -(128 s, four by four)         per row, once for the tokens (the bias's 128 sum s)
    ints <W x i32>   = vpdpbusd(init, xu, s)           exactly q . s four by four: (q + 128) s - 128 s
    then per block, the tile's (token, row) items side by side (idot.totals, idot.scaled_blocks):
    acc <8 x float> = acc + float(the items' block sums) * (d_w * d)

so that a (row, token)'s blocks are added in the one order isimd.py's decode rows and rows8.py's groups take.
vpdpbusd multiplies unsigned bytes by signed ones, so the bias puts the activations' sign into the product without the sign trick's two operations per row and
token (idot.dot); the row's correction is the accumulator's starting value, free. AVX2's
vpmaddubsw would saturate on q8's (q + 128) s pairs: there q8 takes the sign trick on q itself (idot.dot),
q4 (|s| <= 8) the same biased form. Per block, a tile of eight tokens takes seven lane additions to its
block sums, then one conversion, two multiplies and an add for the eight, where the float loop (simd.py's
dot2r4) widens every weight and spends two FMAs per 32 weights and token. The 512-bit layout (two blocks a
step, an odd last block alone on 256 bits, last) is taken on hosts whose lowering is vnni512 (idot.py).

    dot1r8b(ks, fmt, data, o, row_step, hidden, xu, xd, t0, out, col)  (dot1r4b .. dot1r1b: t < 4 .. 1)
        out[t0 + t, col] = x'[t0 + t] . the row at byte o, t < 8, x' = xd (.) q the quantised activations;
        fmt a BLOCK_FORMATS format's FORMATS index; row_step the bytes to the next row (prefetched ahead)
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import idot
from .ir import F32, I8, I32, LANES, const
from .isimd import BLOCK_FORMATS
from .loops import byte_ptr, per_format, prefetch_ahead, register_loop, tile

SAFE_ON_AVX2 = 63  # |s| up to this: vpmaddubsw's pairs of (q + 128) s stay below 2^15 (idot.biased)


def _sign_trick(fmt, how) -> bool:
    """q8 on avx2: the sign trick on q itself, where vpmaddubsw's pairs of (q + 128) s would saturate."""
    return how == "avx2" and fmt.SPAN > SAFE_ON_AVX2


def _block_sums(builder, fmt, how, init, u, s):
    """<W x i32>: q . s four by four, q = u - 128 (module docstring)."""
    if _sign_trick(fmt, how):
        n = u.type.count
        q = builder.xor(u, ir.Constant(ir.VectorType(I8, n), [-128] * n))
        return idot.dot(builder, s, q, True, how)
    return idot.biased(builder, init, u, s, how)


def _half(builder, v, k: int):
    """<8 x i32>: block k's lanes of a group's sums (a 512-bit group holds two blocks side by side)."""
    if v.type.count == 8:
        return v
    return builder.shuffle_vector(v, v, ir.Constant(idot.VI8, list(range(8 * k, 8 * k + 8))))


def _lanes(builder, values):
    """<8 x float> of up to 8 float values (lanes past them 0)."""
    vec = ir.Constant(idot.VF8, [0.0] * 8)
    for j, v in enumerate(values):
        vec = builder.insert_element(vec, v, ir.Constant(I32, j))
    return vec


def _accumulate(builder, fmt, how, rows, x, hidden_v, tok, i, G, acc):
    """acc <8 x float> (lane t NR + r: token t, row r) plus the G weights from weight G i of each row, a block at a
    time in the blocks' order (idot.scaled_blocks)."""
    xu, xd = x
    W = G // 4
    VI = ir.VectorType(I32, W)
    bias = ir.Constant(ir.VectorType(I8, G), [-128] * G)  # 128 as the unsigned operand
    rowwise = []
    for row in rows:  # each row's blocks once for the tokens
        s, scales = fmt.iblocks(builder, row, i, hidden_v, G)
        init = None if _sign_trick(fmt, how) else builder.sub(
            ir.Constant(VI, [0] * W), idot.biased(builder, ir.Constant(VI, [0] * W), bias, s, how))
        rowwise.append((s, scales, init))
    ints, dxs = [], []  # [item] <W x i32>; [token] [the tokens' block scales]
    for token in tok:
        first = builder.add(builder.mul(token, hidden_v), builder.mul(i, const(G)))
        u = builder.load(builder.bitcast(builder.gep(xu, [first]), ir.VectorType(I8, G).as_pointer()), align=1)
        at = builder.add(builder.mul(token, builder.udiv(hidden_v, const(LANES))), builder.mul(i, const(G // LANES)))
        dxs.append([builder.load(builder.gep(xd, [builder.add(at, const(k))]), align=4) for k in range(G // LANES)])
        ints.extend(_block_sums(builder, fmt, how, init, u, s) for s, _, init in rowwise)
    for k in range(G // LANES):
        dw = _lanes(builder, [scales[k] for _ in tok for _, scales, _ in rowwise])
        dx = _lanes(builder, [d[k] for d in dxs for _ in rowwise])
        acc = idot.scaled_blocks(builder, acc, idot.totals(builder, [_half(builder, v, k) for v in ints]), dw, dx)
    return acc


def _emit(builder, fmt, rows, row_step, x, hidden_v, tok, dests) -> None:
    how = idot.host_lowering()
    G = idot.group_bytes(how)

    def step(i, carried):
        for k in range(G // LANES):  # each block's share of the row PREFETCH_ROWS rows on
            prefetch_ahead(builder, fmt, rows, builder.add(builder.mul(i, const(G // LANES)), const(k)), row_step)
        return [_accumulate(builder, fmt, how, rows, x, hidden_v, tok, i, G, carried[0])]

    acc = register_loop(builder, builder.udiv(hidden_v, const(G)), [ir.Constant(idot.VF8, [0.0] * 8)], step)[0]
    if G > LANES:  # hidden an odd number of blocks: the last one by itself, on 32 weights, after the others
        last = builder.udiv(hidden_v, const(LANES))
        slot = cgutils.alloca_once_value(builder, acc)
        with builder.if_then(builder.icmp_unsigned("!=", builder.urem(last, const(2)), const(0))):
            builder.store(_accumulate(builder, fmt, how, rows, x, hidden_v, tok, builder.sub(last, const(1)), LANES,
                                      builder.load(slot)), slot)
        acc = builder.load(slot)
    for j, dest in enumerate(d for per_t in dests for d in per_t):
        builder.store(builder.extract_element(acc, ir.Constant(I32, j)), dest, align=4)


def _make(NR: int, NT: int):
    @intrinsic
    def dotk(typingctx, kernels, fmt, data, o, row_step, hidden, xu, xd, t0, out, col):
        sig = types.void(kernels, fmt, data, o, row_step, hidden, xu, xd, t0, out, col)

        def codegen(context, builder, signature, args):
            fmt_v, data_v, o, row_step, hidden_v, xu_v, xd_v, t0, out_v, col = args[1:]
            rows, tok, dests = tile(context, builder, (signature.args[2], data_v), o, row_step,
                                     (signature.args[9], out_v), t0, col, NR, NT)
            xu = byte_ptr(context, builder, signature.args[6], xu_v)
            xd = builder.bitcast(byte_ptr(context, builder, signature.args[7], xd_v), F32.as_pointer())
            per_format(context, builder, signature.args[0], signature.args[1], fmt_v,
                        lambda m: _emit(builder, m, rows, row_step, (xu, xd), hidden_v, tok, dests), BLOCK_FORMATS,
                        True)
            return context.get_dummy_value()

        return sig, codegen

    return dotk


dot1r1b, dot1r2b, dot1r3b, dot1r4b, dot1r8b = (_make(1, n) for n in (1, 2, 3, 4, 8))
