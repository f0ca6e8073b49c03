"""q4 rows (shm/formats/q4.py) for simd.py's loops.

    row of H weights, nb = H / 32 blocks:
      bytes [0, H/2)            16 bytes per block b: byte j = (q[32 b + j] + 8) | (q[32 b + j + 16] + 8) << 4
      bytes [H/2, H/2 + 2 nb)   float16 d[b]
    block b = d[b] * float(q[32 b : 32 b + 32]): low nibbles are values 0..15, high nibbles 16..31, so the
    16 bytes give the block in order as (low, high) without any interleaving
"""

from __future__ import annotations

from llvmlite import ir

from .ir import F32, I8, I32, LANES, VF, const, half_scale, vec_load

SCALED = True
SPAN = 8  # the largest |value|: q in [-8, 7]
BLOCK_BYTES = 18  # bytes of the row per block of 32 values, its scale included: the prefetch's stride
HALF = LANES // 2
V32 = ir.VectorType(I8, LANES)


def block(builder, row, b, hidden):
    q, (d,) = iblocks(builder, row, b, hidden, LANES)
    return builder.sitofp(q, VF), d


def igroup(builder, row, b, j, hidden):
    """Block b for the integer path (idot.py): the nibbles unsigned (q + 8, in [0, 15]), scale d[b], offset
    8 d[b]: w = d q' - 8 d."""
    q, (d,) = iblocks(builder, row, b, hidden, LANES)
    return builder.add(q, ir.Constant(V32, [8] * LANES)), False, d, builder.fmul(d, ir.Constant(F32, 8.0))


def iblocks(builder, row, i, hidden, n: int):
    """The n / 32 blocks from block i n / 32 for prefill's integer loop (iblock.py): (<n x i8> their values
    q in [-8, 7], signed, in order (each block's 16 low nibbles, then its 16 high ones); [their scales])."""
    k = n // LANES
    vbytes = ir.VectorType(I8, n // 2)
    packed = vec_load(builder, builder.gep(row, [builder.mul(i, const(n // 2))]), vbytes)
    low = builder.and_(packed, ir.Constant(vbytes, [15] * (n // 2)))
    high = builder.lshr(packed, ir.Constant(vbytes, [4] * (n // 2)))
    order = [j for b in range(k) for j in [*range(HALF * b, HALF * b + HALF),
                                           *range(n // 2 + HALF * b, n // 2 + HALF * b + HALF)]]
    q = builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(I32, n), order))
    q = builder.sub(q, ir.Constant(ir.VectorType(I8, n), [8] * n))
    first = builder.mul(i, const(k))
    values_bytes = builder.udiv(hidden, const(2))
    return q, [half_scale(builder, row, values_bytes, builder.add(first, const(j))) for j in range(k)]
