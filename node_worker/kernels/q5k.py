"""q5k rows (shm/formats/q5k.py: a GGUF file's Q5_K super-blocks of 256, 176 bytes) for simd.py's loops.

    32-group b of the row: super-block b // 8 at byte 176 (b // 8), group j = b % 8 in it
      d, dmin   float16 at bytes 0 and 2;  (sc, m) = the 6-bit pair j of bytes [4, 16)
      q         low 4 bits: the nibbles of the 32 bytes at 48 + 32 (j // 2) (low ones for even j);
                fifth bit: bit j of the 32 bytes at 16
    weights = (d * sc) * float(q) - (dmin * m), as gguf.quants does it; returned whole.
"""

from __future__ import annotations

from fractions import Fraction

from llvmlite import ir

from .ir import EXACT, F32, I8, LANES, VF, const, half_at, k_scale_min, splat, super_block, vec_load
from .q4k import V32, nibbles

SCALED = True
BLOCK_BYTES = Fraction(176, 8)


def block(builder, row, b, hidden):
    base, j = super_block(builder, row, b, 176)
    sc, m = k_scale_min(builder, builder.gep(base, [const(4)]), j)
    scale = builder.fmul(half_at(builder, base), builder.uitofp(sc, F32), flags=EXACT)
    offset = builder.fmul(half_at(builder, builder.gep(base, [const(2)])), builder.uitofp(m, F32), flags=EXACT)
    low = nibbles(builder, builder.gep(base, [builder.add(const(48), builder.mul(builder.udiv(j, const(2)),
                                                                                 const(32)))]), j)
    high = builder.lshr(vec_load(builder, builder.gep(base, [const(16)]), V32),
                        splat(builder, builder.trunc(j, I8), V32))
    q = builder.or_(low, builder.shl(builder.and_(high, ir.Constant(V32, [1] * LANES)), ir.Constant(V32, [4] * LANES)))
    w = builder.fmul(builder.uitofp(q, VF), splat(builder, scale), flags=EXACT)
    return builder.fsub(w, splat(builder, offset), flags=EXACT), None
