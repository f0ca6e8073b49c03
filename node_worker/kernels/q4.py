"""q4 rows for simd.py's loops (the layout: shm/formats/q4.py). A block's 16 bytes give its values in order
as (low nibbles, high nibbles) without any interleaving, minus 8; its scale is returned apart, so the loop
multiplies it in once per block; the integer loops (isimd.py, iblock.py) take the nibbles as integers.
"""

from __future__ import annotations

from llvmlite import ir

from shm.formats.traits import BY_NAME

from .ir import F32, I8, I32, LANES, VF, const, half_scale, vec_load

TRAITS = BY_NAME["q4"]  # its block and bytes
SCALED = TRAITS.block > 1  # whole blocks with their scales (f32, bf16: a partial last block read value by value)
SPAN = 8  # the largest |value|: q in [-8, 7]
BLOCK_BYTES = TRAITS.block_bytes * max(1, LANES // TRAITS.block)  # the row's bytes a loop step: the prefetch's stride
HALF = LANES // 2
V32 = ir.VectorType(I8, LANES)


def block(builder, row, b, hidden):
    q, (d,) = iblocks(builder, row, b, hidden, LANES)
    return builder.sitofp(q, VF), d


def iblocks(builder, row, i, hidden, n: int):
    """The n / 32 blocks from block i n / 32 for prefill's integer loop (iblock.py): (<n x i8> their values
    q in [-8, 7], signed, in order (each block's 16 low nibbles, then its 16 high ones); [their scales])."""
    u, scales = nibbles(builder, row, i, hidden, n)
    return builder.sub(u, ir.Constant(ir.VectorType(I8, n), [8] * n)), scales


def nibbles(builder, row, i, hidden, n: int):
    """iblocks' blocks as the nibbles themselves, q + 8 in [0, 15] (unsigned: decode's rows, isimd.py)."""
    k = n // LANES
    vbytes = ir.VectorType(I8, n // 2)
    packed = vec_load(builder, builder.gep(row, [builder.mul(i, const(n // 2))]), vbytes)
    low = builder.and_(packed, ir.Constant(vbytes, [15] * (n // 2)))
    high = builder.lshr(packed, ir.Constant(vbytes, [4] * (n // 2)))
    order = [j for b in range(k) for j in [*range(HALF * b, HALF * b + HALF),
                                           *range(n // 2 + HALF * b, n // 2 + HALF * b + HALF)]]
    u = builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(I32, n), order))
    first = builder.mul(i, const(k))
    values_bytes = builder.udiv(hidden, const(2))
    return u, [half_scale(builder, row, values_bytes, builder.add(first, const(j))) for j in range(k)]
