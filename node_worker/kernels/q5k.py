"""q5k rows for simd.py's loops (the layout: shm/formats/q5k.py, a GGUF file's Q5_K super-blocks).

One loop step reads a super-block as 8 groups of 32, the group a constant of the unrolled loop: its low
four bits from q4k's nibble runs (q4k.nibbles), its fifth bit from the high-bit bytes; weights =
(d * sc) * float(q) - (dmin * m), as gguf.quants does it, returned whole.
"""

from __future__ import annotations

from llvmlite import ir

from shm.formats.traits import BY_NAME

from .ir import EXACT, LANES, VF, const, splat, super_block, vec_load
from .q4k import V32, int_scales, nibbles, scale_and_offset

TRAITS = BY_NAME["q5k"]  # its block and bytes
SCALED = TRAITS.block > 1  # whole blocks with their scales (f32, bf16: a partial last block read value by value)
OFFSETS = True  # w = d sc q - dmin m
GROUPS = TRAITS.block // LANES  # 32-groups a loop step reads: one super-block
GROUP_ORDER = tuple(range(GROUPS))  # the integer loop's order of the groups (q6k's differs)
BLOCK_BYTES = TRAITS.block_bytes * max(1, LANES // TRAITS.block)  # the row's bytes a loop step: the prefetch's stride


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
