"""q8 rows (shm/formats/q8.py) for simd.py's loops.

    row of H weights, nb = H / 32 blocks:
      bytes [0, H)          int8 q[i]
      bytes [H, H + 2 nb)   float16 d[b]
    block b = d[b] * float(q[32 b : 32 b + 32]): the int8 values widened to <32 x float>, the scale
    returned apart so that the loop multiplies it in once per block
"""

from __future__ import annotations

from llvmlite import ir

from .ir import I8, LANES, VF, const, half_scale, vec_load

SCALED = True
SPAN = 128  # the largest |value| a block can hold (a file's int8: -128; ours stay within 127)
BLOCK_BYTES = 34  # bytes of the row per block of 32 values, its scale included: the prefetch's stride


def block(builder, row, b, hidden):
    q, (d,) = iblocks(builder, row, b, hidden, LANES)
    return builder.sitofp(q, VF), d


def igroup(builder, row, b, j, hidden):
    """Block b as the integer path takes it (idot.py): (q, signed, scale, offset) with w = scale * q - offset;
    here the int8 values themselves, signed, scaled by d[b], no offset."""
    q, (d,) = iblocks(builder, row, b, hidden, LANES)
    return q, True, d, None


def iblocks(builder, row, i, hidden, n: int):
    """The n / 32 blocks from block i n / 32 for prefill's integer loop (iblock.py): (<n x i8> their values,
    signed; [the blocks' scales d as float32])."""
    q = vec_load(builder, builder.gep(row, [builder.mul(i, const(n))]), ir.VectorType(I8, n))
    first = builder.mul(i, const(n // LANES))
    return q, [half_scale(builder, row, hidden, builder.add(first, const(k))) for k in range(n // LANES)]
