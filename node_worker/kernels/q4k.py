"""q4k rows (shm/formats/q4k.py: a GGUF file's Q4_K super-blocks of 256, 144 bytes) for simd.py's loops.

One loop step reads a super-block s (at byte 144 s) as 8 groups of 32, j a constant of the unrolled loop:
      d, dmin   float16 at bytes 0 and 2;  (sc, m) = the 6-bit pair j of bytes [4, 16)
      q         the nibbles of the 32 bytes at 16 + 32 (j // 2): low ones for even j, high for odd
    weights = (d * sc) * float(q) - (dmin * m), each operation as gguf.quants does it (no contraction: the
    weights are the file's bit for bit); returned whole, no scale apart.
"""

from __future__ import annotations

from llvmlite import ir

from .ir import EXACT, F32, I8, LANES, VF, const, half_at, k_scale_min, splat, super_block, vec_load

SCALED = True  # whole blocks only (no partial last block to read value by value)
GROUPS = 8  # 32-groups a loop step reads: one super-block
BLOCK_BYTES = 144  # bytes of the row per loop step: the prefetch's stride
V32 = ir.VectorType(I8, LANES)


def nibbles(builder, run, j: int):
    """The 32 nibbles of group j from its run of 32 bytes: low ones for even j, high ones for odd j."""
    values = vec_load(builder, run, V32)
    if j % 2:
        values = builder.lshr(values, ir.Constant(V32, [4] * LANES))
    return builder.and_(values, ir.Constant(V32, [15] * LANES))


def scale_and_offset(builder, base, j: int):
    """(d * sc[j], dmin * m[j]) of a Q4_K or Q5_K super-block, float32 as gguf.quants computes them."""
    sc, m = k_scale_min(builder, builder.gep(base, [const(4)]), j)
    scale = builder.fmul(half_at(builder, base), builder.uitofp(sc, F32), flags=EXACT)
    offset = builder.fmul(half_at(builder, builder.gep(base, [const(2)])), builder.uitofp(m, F32), flags=EXACT)
    return scale, offset


def group(builder, row, s, j: int):
    base = super_block(builder, row, s, BLOCK_BYTES)
    scale, offset = scale_and_offset(builder, base, j)
    q = nibbles(builder, builder.gep(base, [const(16 + 32 * (j // 2))]), j)
    w = builder.fmul(builder.uitofp(q, VF), splat(builder, scale), flags=EXACT)
    return builder.fsub(w, splat(builder, offset), flags=EXACT)


def igroup(builder, row, s, j: int, hidden):
    """Group j for the integer path (idot.py): the nibbles unsigned, scale d sc, offset dmin m."""
    base = super_block(builder, row, s, BLOCK_BYTES)
    scale, offset = scale_and_offset(builder, base, j)
    return nibbles(builder, builder.gep(base, [const(16 + 32 * (j // 2))]), j), False, scale, offset
