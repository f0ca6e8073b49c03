"""q6k rows for simd.py's loops (the layout: shm/formats/q6k.py, a GGUF file's Q6_K super-blocks).

One loop step reads a super-block as 8 groups of 32, the group a constant of the unrolled loop: four low
bits from the nibble runs, two high bits from the high-bit runs, an int8 scale per 16 values;
weights = (d * scale) * float(q - 32), as gguf.quants does it, returned whole.

For the integer loop (isuper.py, int8 activations): w = d sc q - d (32 sc), q unsigned, sc the 16 int8 scales.
"""

from __future__ import annotations

from llvmlite import ir

from shm.formats.traits import BY_NAME

from . import idot
from .ir import EXACT, F32, I8, I16, I32, LANES, VF, const, half_at, super_block, vec_load
from .q4k import V32, V64, shift_halves

TRAITS = BY_NAME["q6k"]  # its block and bytes
SCALED = TRAITS.block > 1  # whole blocks with their scales (f32, bf16: a partial last block read value by value)
OFFSETS = True  # w = d sc q - d (32 sc): an offset per 16 values
GROUPS = TRAITS.block // LANES  # 32-groups a loop step reads: one super-block
GROUP_ORDER = (0, 2, 1, 3, 4, 6, 5, 7)  # the integer loop's: groups 0 and 2 share a low run, 1 and 3 the next
BLOCK_BYTES = TRAITS.block_bytes * max(1, LANES // TRAITS.block)  # the row's bytes a loop step: the prefetch's stride


def _unsigned(builder, base, g: int):
    """q of group g: <32 x i8> in [0, 63]."""
    h = g // 4
    low = vec_load(builder, builder.gep(base, [const(64 * h + 32 * (g % 2))]), V32)
    if (g // 2) % 2:
        low = builder.lshr(low, ir.Constant(V32, [4] * LANES))
    low = builder.and_(low, ir.Constant(V32, [15] * LANES))
    high = vec_load(builder, builder.gep(base, [const(128 + 32 * h)]), V32)
    high = builder.and_(builder.lshr(high, ir.Constant(V32, [2 * (g % 4)] * LANES)), ir.Constant(V32, [3] * LANES))
    return builder.or_(low, builder.shl(high, ir.Constant(V32, [4] * LANES)))


def _quants(builder, base, g: int):
    """q - 32 of group g: <32 x i8> in [-32, 31]."""
    return builder.sub(_unsigned(builder, base, g), ir.Constant(V32, [32] * LANES))


def _scales(builder, base, g: int):
    """(d * scale) of group g's first 16 values and of its next 16, float32 as gguf.quants computes them."""
    d = half_at(builder, builder.gep(base, [const(208)]))
    return [builder.fmul(d, builder.sitofp(builder.load(builder.gep(base, [const(192 + 2 * g + k)]), align=1), F32),
                         flags=EXACT) for k in (0, 1)]


def _pair(builder, a, b):
    """<2 x float> (a, b)."""
    pair = ir.Constant(ir.VectorType(F32, 2), ir.Undefined)
    return builder.insert_element(builder.insert_element(pair, a, ir.Constant(I32, 0)), b, ir.Constant(I32, 1))


def group(builder, row, s, g: int):
    base = super_block(builder, row, s, BLOCK_BYTES)
    pair = _pair(builder, *_scales(builder, base, g))
    halves = builder.shuffle_vector(pair, pair, ir.Constant(ir.VectorType(I32, LANES), [0] * 16 + [1] * 16))
    return builder.fmul(builder.sitofp(_quants(builder, base, g), VF), halves, flags=EXACT)


def _pair_unsigned(builder, base, g: int):
    """q of groups g and g + 1 (g even) as <64 x i8>: their low 4 bits are one run of 64 bytes, their high 2
    bits the same 32 bytes shifted by two counts (q4k.shift_halves)."""
    h = g // 4
    low = vec_load(builder, builder.gep(base, [const(64 * h)]), V64)
    if (g // 2) % 2:
        low = builder.lshr(low, ir.Constant(V64, [4] * 2 * LANES))
    low = builder.and_(low, ir.Constant(V64, [15] * 2 * LANES))
    high = vec_load(builder, builder.gep(base, [const(128 + 32 * h)]), V32)
    high = builder.shuffle_vector(high, high, ir.Constant(ir.VectorType(I32, 2 * LANES), list(range(LANES)) * 2))
    high = builder.and_(shift_halves(builder, high, 2 * (g % 4), 2 * (g % 4) + 2), ir.Constant(V64, [3] * 2 * LANES))
    return builder.or_(low, builder.shl(high, ir.Constant(V64, [4] * 2 * LANES)))


def isuper(builder, row, s, width: int = LANES):
    """Super-block s for the integer loop (isuper.py): (d, d, [(q, sc)] in groups of ``width`` weights (sc: a
    16-bit scale per 16 values; each group a function that emits them),
    32 sc <16 x i16>, unsigned)."""
    base = super_block(builder, row, s, BLOCK_BYTES)
    scales = vec_load(builder, builder.gep(base, [const(192)]), ir.VectorType(I8, 16))  # [16] int8
    wide = builder.sext(scales, ir.VectorType(I16, 16))
    lanes = lambda idx: ir.Constant(ir.VectorType(I32, len(idx)), idx)  # noqa: E731
    if width == 2 * LANES:
        groups = [lambda g=g: (_pair_unsigned(builder, base, g), builder.shuffle_vector(wide, wide, lanes(
            [k for k in range(2 * g, 2 * g + 4) for _ in range(8)]))) for g in range(0, GROUPS, 2)]
    else:
        halves = [idot.halves_alike(builder, wide, h) for h in (0, 1)]  # scales 0-7, 8-15 in both halves
        groups = [lambda g=g: (_unsigned(builder, base, g), idot.in_lane_words(
            builder, halves[g // 4], [2 * g % 8] * 8 + [8 + (2 * g + 1) % 8] * 8)) for g in range(GROUPS)]
    offsets = builder.shl(wide, ir.Constant(ir.VectorType(I16, 16), [5] * 16))  # |32 sc| <= 4096
    d = half_at(builder, builder.gep(base, [const(208)]))
    return d, d, groups, offsets, False
