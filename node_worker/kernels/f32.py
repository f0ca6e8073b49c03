"""f32 rows for simd.py's loops, read in place (the layout: shm/formats/f32.py). A block is 32 consecutive
weights; a partial last block (H not a multiple of 32) is read value by value.
"""

from __future__ import annotations

from llvmlite import ir

from shm.formats.traits import BY_NAME

from .ir import F32, LANES, const, vec_load

TRAITS = BY_NAME["f32"]  # its block and bytes
SCALED = TRAITS.block > 1  # whole blocks with their scales (f32, bf16: a partial last block read value by value)
BLOCK_BYTES = TRAITS.block_bytes * max(1, LANES // TRAITS.block)  # the row's bytes a loop step: the prefetch's stride


def block(builder, row, b, hidden):
    """<32 x float> block b of the row at byte pointer ``row``."""
    return lanes(builder, row, b, 0, LANES), None


def lanes(builder, row, b, first, count):
    """<count x float> values first .. first + count - 1 of block b (simd._emit_dotk_parts: a register's share)."""
    return vec_load(builder, builder.gep(row, [builder.add(builder.mul(b, const(4 * LANES)), const(4 * first))]),
                    ir.VectorType(F32, count))


def value(builder, row, i):
    """float w[i] (the partial last block)."""
    return builder.load(builder.gep(builder.bitcast(row, F32.as_pointer()), [i]), align=1)
