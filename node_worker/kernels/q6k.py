"""q6k rows (shm/formats/q6k.py: a GGUF file's Q6_K super-blocks of 256, 210 bytes) for simd.py's loops.

    32-group b of the row: super-block b // 8 at byte 210 (b // 8), group g = b % 8 in it, h = g // 4
      low 4 bits    the 32 bytes at 64 h + 32 (g % 2), low nibbles for g // 2 even, high for odd
      high 2 bits   bits 2 (g % 4) .. + 1 of the 32 bytes at 128 + 32 h
      scales        int8 at 192 + 2 g (the first 16 values) and 192 + 2 g + 1 (the next 16); d float16 at 208
    weights = (d * scale) * float(q - 32), as gguf.quants does it; returned whole.
"""

from __future__ import annotations

from fractions import Fraction

from llvmlite import ir

from .ir import EXACT, F32, I8, I32, LANES, VF, const, half_at, splat, super_block, vec_load
from .q4k import V32

SCALED = True
BLOCK_BYTES = Fraction(210, 8)


def block(builder, row, b, hidden):
    base, g = super_block(builder, row, b, 210)
    h = builder.udiv(g, const(4))
    low_at = builder.add(builder.mul(h, const(64)), builder.mul(builder.and_(g, const(1)), const(32)))
    low_shift = builder.trunc(builder.mul(builder.and_(builder.udiv(g, const(2)), const(1)), const(4)), I8)
    low = builder.and_(builder.lshr(vec_load(builder, builder.gep(base, [low_at]), V32),
                                    splat(builder, low_shift, V32)), ir.Constant(V32, [15] * LANES))
    high_at = builder.add(const(128), builder.mul(h, const(32)))
    high_shift = builder.trunc(builder.mul(builder.and_(g, const(3)), const(2)), I8)
    high = builder.and_(builder.lshr(vec_load(builder, builder.gep(base, [high_at]), V32),
                                     splat(builder, high_shift, V32)), ir.Constant(V32, [3] * LANES))
    q = builder.sub(builder.or_(low, builder.shl(high, ir.Constant(V32, [4] * LANES))), ir.Constant(V32, [32] * LANES))
    d = half_at(builder, builder.gep(base, [const(208)]))
    scales = [builder.fmul(d, builder.sitofp(builder.load(builder.gep(base, [builder.add(const(192 + k),
                                                                                         builder.mul(g, const(2)))]),
                                                          align=1), F32), flags=EXACT) for k in (0, 1)]
    pair = builder.insert_element(builder.insert_element(ir.Constant(ir.VectorType(F32, 2), ir.Undefined), scales[0],
                                                         ir.Constant(I32, 0)), scales[1], ir.Constant(I32, 1))
    halves = builder.shuffle_vector(pair, pair, ir.Constant(ir.VectorType(I32, LANES), [0] * 16 + [1] * 16))
    return builder.fmul(builder.sitofp(q, VF), halves, flags=EXACT), None
