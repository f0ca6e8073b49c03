"""Q8_0's and Q4_0's decode loop with int8 activations: four rows against one token, in integers (the K types
and IQ4_XS take isuper.py's super-block loop, in decode too).

The activations come quantised per block of 32 (activations.py: xq int8, xd its scales). For each block b
of 32 weights a format's ``iblocks`` gives its signed integers q and float scale d_w; then per row

    s_b  = q . xq_b                                  exact, in integers (idot.dot's four by four, then the four
                                                     rows' lanes added at once: idot.totals); q4 as its nibbles
                                                     u = q + 8, unsigned: u . xq_b - 8 sum(xq_b), the same integer
    acc  = acc + float(s_b) * (d_w * xd[b])          idot.scaled_blocks, the four rows side by side

which is x' . w on the quantised activations x' = xd (.) xq, in the one order iblock.py's tiles and rows8.py's
groups take too: a row's bits are the same in decode and in a prefill group. The f32 and bf16 formats have no
integers to multiply and keep simd.py's loops.

    dot4i(ks, fmt, data, o0, o1, o2, o3, hidden, xq, xd)  -> the four rows' dot products (decode; fmt q8's or
                                                            q4's FORMATS index)

Decode only: prefill takes iblock.py's loop (the activations biased for vpdpbusd), or rows8.py's eight rows at a
time, and the K types' (isuper.py) adds a super-block's products in integers, with the formats' integer scales,
and converts once per 256.
"""

from __future__ import annotations

from types import ModuleType

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from shm.formats.traits import BLOCK_INT_LOOPS, INT_LOOPS

from . import idot
from .ir import F32, I8, I32, LANES, const, splat
from .loops import FORMATS, byte_ptr, per_format, prefetch_tile, register_loop

BLOCK_FORMATS: dict[str, ModuleType] = {name: FORMATS[name] for name in BLOCK_INT_LOOPS}  # dot4i's: q8, q4
INT_FORMATS: dict[str, ModuleType] = {name: FORMATS[name] for name in INT_LOOPS}  # integers to multiply
V32 = ir.VectorType(I8, LANES)
NIBBLE_OFFSET = 8  # a format of SPAN <= this (q4) is read as its unsigned nibbles, q + 8 (rows8.OFFSET's form)


def _emit_rows(builder, fmt, rows, xq, xd, hidden_v):
    """The loop over the rows' blocks against one token's quantised activations -> <8 x float>, lane r row r's
    dot product (module docstring)."""

    nibbles = fmt.SPAN <= NIBBLE_OFFSET  # q4: its nibbles u = q + 8 as they are, unsigned

    def step(b, carried):
        prefetch_tile(builder, fmt, rows, b)  # decode's four rows of a matrix, one after another: one run
        xv = builder.load(builder.bitcast(builder.gep(xq, [builder.mul(b, const(LANES))]), V32.as_pointer()), align=1)
        ints, scales = [], ir.Constant(idot.VF8, [0.0] * 8)
        if nibbles:  # 8 x the block's activations four by four, once for the rows: u . x - 8 sum(x) = q . x
            eights = idot.dot(builder, ir.Constant(V32, [8] * LANES), xv, False)
        for r, row in enumerate(rows):
            if nibbles:
                u, (d,) = fmt.nibbles(builder, row, b, hidden_v, LANES)
                ints.append(builder.sub(idot.dot(builder, u, xv, False), eights))
            else:
                q, (d,) = fmt.iblocks(builder, row, b, hidden_v, LANES)
                ints.append(idot.dot(builder, q, xv, True))
            scales = builder.insert_element(scales, d, ir.Constant(I32, r))
        dx = splat(builder, builder.load(builder.gep(xd, [b]), align=4), idot.VF8)
        return [idot.scaled_blocks(builder, carried[0], idot.totals(builder, ints), scales, dx)]

    zero = ir.Constant(idot.VF8, [0.0] * 8)
    return register_loop(builder, builder.udiv(hidden_v, const(LANES)), [zero], step)[0]


@intrinsic
def dot4i(typingctx, kernels, fmt, data, o0, o1, o2, o3, hidden, xq, xd):
    """The four rows' dot products for the integer format whose FORMATS index is ``fmt`` (a run-time value; the
    kernel set ``kernels`` says which formats' integer loops are compiled)."""
    sig = types.UniTuple(types.float32, 4)(kernels, fmt, data, o0, o1, o2, o3, hidden, xq, xd)

    def codegen(context, builder, signature, args):
        args = args[1:]
        base = byte_ptr(context, builder, signature.args[2], args[1])
        rows = [builder.gep(base, [o]) for o in args[2:6]]
        xq = byte_ptr(context, builder, signature.args[8], args[7])
        xd = builder.bitcast(byte_ptr(context, builder, signature.args[9], args[8]), F32.as_pointer())
        sums = [cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0)) for _ in rows]

        def emit(fmt_module):
            acc = _emit_rows(builder, fmt_module, rows, xq, xd, args[6])
            for r, dest in enumerate(sums):
                builder.store(builder.extract_element(acc, ir.Constant(I32, r)), dest)

        per_format(context, builder, signature.args[0], signature.args[1], args[0], emit, BLOCK_FORMATS, True)
        return context.make_tuple(builder, signature.return_type, [builder.load(s) for s in sums])

    return sig, codegen
