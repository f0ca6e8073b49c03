"""bf16 rows (shm/formats/bf16.py) for simd.py's loops: widened in the registers, never copied.

    row of H weights: bytes [0, 2H) uint16 bits[i], the top half of float32 w[i]
    w[i] = float32 with bits (bits[i] << 16): exact. A partial last block is read value by value.
"""

from __future__ import annotations

from llvmlite import ir

from .ir import F32, I16, I32, LANES, const, vec_load

SCALED = False
BLOCK_BYTES = 64  # bytes of the row per block of 32 values, its scale included: the prefetch's stride


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
