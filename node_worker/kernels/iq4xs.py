"""iq4xs rows (shm/formats/iq4xs.py: a GGUF file's IQ4_XS super-blocks of 256, 136 bytes) for simd.py's loops.

    32-group b of the row: super-block b // 8 at byte 136 (b // 8), group j = b % 8 in it
      scale     (scales_l nibble j | scales_h bits 2j..2j+1 << 4) - 32, an int8; d float16 at byte 0
      indices   the 16 bytes at 8 + 16 j: low nibbles the first 16 weights, high nibbles the next 16 (as q4.py)
    weights = (d * scale) * float(KVALUES[index]), as gguf.quants does it; returned whole.

The 16-level lookup is a tree of vector selects on the index bits (15 selects
of <32 x i8>, one bit a level): no gather, no instruction set named, so LLVM
lowers it to byte blends at whatever width the host has.
"""

from __future__ import annotations

from fractions import Fraction

from llvmlite import ir

from shm.formats.iq4xs import KVALUES

from .ir import EXACT, F32, I8, I16, I32, LANES, VF, byte_at, const, half_at, splat, super_block, vec_load

SCALED = True
BLOCK_BYTES = Fraction(136, 8)
HALF = LANES // 2
V16 = ir.VectorType(I8, HALF)
V32 = ir.VectorType(I8, LANES)


def _levels(builder, index):
    """KVALUES[index] for a <32 x i8> of indices in [0, 16)."""
    choices = [ir.Constant(V32, [v] * LANES) for v in KVALUES]
    for bit in range(4):
        chosen = builder.icmp_unsigned("!=", builder.and_(index, ir.Constant(V32, [1 << bit] * LANES)),
                                       ir.Constant(V32, [0] * LANES))
        choices = [builder.select(chosen, hi, lo) for lo, hi in zip(choices[0::2], choices[1::2])]
    return choices[0]


def block(builder, row, b, hidden):
    base, j = super_block(builder, row, b, 136)
    low = builder.lshr(byte_at(builder, base, builder.add(const(4), builder.udiv(j, const(2)))),
                       builder.trunc(builder.mul(builder.and_(j, const(1)), const(4)), I32))
    high_bits = builder.zext(builder.load(builder.bitcast(builder.gep(base, [const(2)]), I16.as_pointer()), align=1),
                             I32)
    high = builder.and_(builder.lshr(high_bits, builder.trunc(builder.mul(j, const(2)), I32)), ir.Constant(I32, 3))
    scale = builder.sub(builder.or_(builder.and_(low, ir.Constant(I32, 15)), builder.shl(high, ir.Constant(I32, 4))),
                        ir.Constant(I32, 32))
    dl = builder.fmul(half_at(builder, base), builder.sitofp(scale, F32), flags=EXACT)
    packed = vec_load(builder, builder.gep(base, [builder.add(const(8), builder.mul(j, const(16)))]), V16)
    nibbles = builder.shuffle_vector(builder.and_(packed, ir.Constant(V16, [15] * HALF)),
                                     builder.lshr(packed, ir.Constant(V16, [4] * HALF)),
                                     ir.Constant(ir.VectorType(I32, LANES), list(range(LANES))))
    return builder.fmul(builder.sitofp(_levels(builder, nibbles), VF), splat(builder, dl), flags=EXACT), None
