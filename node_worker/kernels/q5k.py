"""q5k rows (shm/formats/q5k.py: a GGUF file's Q5_K super-blocks of 256, 176 bytes) for simd.py's loops.

One loop step reads a super-block s (at byte 176 s) as 8 groups of 32, j a constant of the unrolled loop:
      d, dmin   float16 at bytes 0 and 2;  (sc, m) = the 6-bit pair j of bytes [4, 16)
      q         low 4 bits: the nibbles of the 32 bytes at 48 + 32 (j // 2) (low ones for even j);
                fifth bit: bit j of the 32 bytes at 16
    weights = (d * sc) * float(q) - (dmin * m), as gguf.quants does it; returned whole.
"""

from __future__ import annotations

from llvmlite import ir

from .ir import EXACT, LANES, VF, const, splat, super_block, vec_load
from .q4k import V32, int_scales, nibbles, scale_and_offset

SCALED = True
OFFSETS = True  # w = d sc q - dmin m
GROUPS = 8
BLOCK_BYTES = 176


def group(builder, row, s, j: int):
    base = super_block(builder, row, s, BLOCK_BYTES)
    scale, offset = scale_and_offset(builder, base, j)
    w = builder.fmul(builder.uitofp(_quants(builder, base, j), VF), splat(builder, scale), flags=EXACT)
    return builder.fsub(w, splat(builder, offset), flags=EXACT)


def _quants(builder, base, j: int):
    """The 32 5-bit values (0..31) of group j."""
    low = nibbles(builder, builder.gep(base, [const(48 + 32 * (j // 2))]), j)
    bits = builder.and_(vec_load(builder, builder.gep(base, [const(16)]), V32), ir.Constant(V32, [1 << j] * LANES))
    high = builder.shl(bits, ir.Constant(V32, [4 - j] * LANES)) if j <= 4 else \
        builder.lshr(bits, ir.Constant(V32, [j - 4] * LANES))  # the bit moved to 16's place
    return builder.or_(low, high)


def isuper(builder, row, s, width: int = LANES):
    """Super-block s for the integer loop (isuper.py): q4k.int_scales with the 5-bit values, in groups of
    ``width`` weights."""
    return int_scales(builder, super_block(builder, row, s, BLOCK_BYTES), _quants, width)
