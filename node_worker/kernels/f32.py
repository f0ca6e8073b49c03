"""f32 rows (shm/formats/f32.py) for simd.py's loops: read in place.

    row of H weights: bytes [0, 4H) float32 w[i]; block b = w[32 b : 32 b + 32]; a partial last block
    (H not a multiple of 32) is read value by value
"""

from __future__ import annotations

from llvmlite import ir

from .ir import F32, LANES, const, vec_load

SCALED = False  # no per-block scale
BLOCK_BYTES = 128  # bytes of the row per block of 32 values, its scale included: the prefetch's stride


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
