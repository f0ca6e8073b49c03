"""bf16 rows for simd.py's loops (the layout: shm/formats/bf16.py): widened in the registers (the bits shifted
into a float32's top half: exact), never copied. A partial last block is read value by value.
"""

from __future__ import annotations

from llvmlite import ir

from shm.formats.traits import BY_NAME

from .ir import F32, I16, I32, LANES, const, vec_load

TRAITS = BY_NAME["bf16"]  # its block and bytes
SCALED = TRAITS.block > 1  # whole blocks with their scales (f32, bf16: a partial last block read value by value)
BLOCK_BYTES = TRAITS.block_bytes * max(1, LANES // TRAITS.block)  # the row's bytes a loop step: the prefetch's stride


def block(builder, row, b, hidden):
    return lanes(builder, row, b, 0, LANES), None


def lanes(builder, row, b, first, count):
    """<count x float> values first .. first + count - 1 of block b (simd._emit_dotk_parts: a register's share)."""
    vi = ir.VectorType(I32, count)
    bits = vec_load(builder, builder.gep(row, [builder.add(builder.mul(b, const(2 * LANES)), const(2 * first))]),
                    ir.VectorType(I16, count))
    widened = builder.shl(builder.zext(bits, vi), ir.Constant(vi, [16] * count))
    return builder.bitcast(widened, ir.VectorType(F32, count))


def value(builder, row, i):
    bits = builder.load(builder.gep(builder.bitcast(row, I16.as_pointer()), [i]), align=1)
    return builder.bitcast(builder.shl(builder.zext(bits, I32), ir.Constant(I32, 16)), F32)
