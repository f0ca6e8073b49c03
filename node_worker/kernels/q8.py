"""q8 rows for simd.py's loops (the layout: shm/formats/q8.py). A block's int8 values are widened to
<32 x float> and its scale returned apart, so the loop multiplies it in once per block; the integer loops
(isimd.py, iblock.py) take the int8 values as they are.
"""

from __future__ import annotations

from llvmlite import ir

from shm.formats.traits import BY_NAME

from .ir import I8, LANES, VF, const, half_scale, vec_load

TRAITS = BY_NAME["q8"]  # its block and bytes
SCALED = TRAITS.block > 1  # whole blocks with their scales (f32, bf16: a partial last block read value by value)
SPAN = 128  # the largest |value| a block can hold (a file's int8: -128; ours stay within 127)
BLOCK_BYTES = TRAITS.block_bytes * max(1, LANES // TRAITS.block)  # the row's bytes a loop step: the prefetch's stride


def block(builder, row, b, hidden):
    q, (d,) = iblocks(builder, row, b, hidden, LANES)
    return builder.sitofp(q, VF), d


def iblocks(builder, row, i, hidden, n: int):
    """The n / 32 blocks from block i n / 32 for prefill's integer loop (iblock.py): (<n x i8> their values,
    signed; [the blocks' scales d as float32])."""
    q = vec_load(builder, builder.gep(row, [builder.mul(i, const(n))]), ir.VectorType(I8, n))
    first = builder.mul(i, const(n // LANES))
    return q, [half_scale(builder, row, hidden, builder.add(first, const(k))) for k in range(n // LANES)]
