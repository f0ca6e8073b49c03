"""iq4xs rows for simd.py's loops (the layout: shm/formats/iq4xs.py, a GGUF file's IQ4_XS super-blocks).

One loop step reads a super-block as 8 groups of 32, the group j a constant of the unrolled loop: its signed
6-bit scale, d, and 32 level indices; weights = (d * scale) * float(KVALUES[index]), as gguf.quants does
it, returned whole. For the integer loop (isuper.py, int8 activations): the levels signed (int8), the scale
an integer per group, d.

The 16-level lookup is a byte shuffle where the host has one (SSSE3's pshufb
on x86: two per group), else a tree of vector selects on the index bits that
LLVM lowers to byte blends at whatever width the host has.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils

from shm.formats.iq4xs import KVALUES

from shm.formats.traits import BY_NAME

from . import idot
from .common import target_features
from .ir import EXACT, F32, I8, I16, I32, LANES, VF, byte_at, const, half_at, splat, super_block, vec_load

TRAITS = BY_NAME["iq4xs"]  # its block and bytes
SCALED = TRAITS.block > 1  # whole blocks with their scales (f32, bf16: a partial last block read value by value)
OFFSETS = False  # levels and a scale, no offset
GROUPS = TRAITS.block // LANES  # 32-groups a loop step reads: one super-block
GROUP_ORDER = tuple(range(GROUPS))  # the integer loop's order of the groups (q6k's differs)
BLOCK_BYTES = TRAITS.block_bytes * max(1, LANES // TRAITS.block)  # the row's bytes a loop step: the prefetch's stride
HALF = LANES // 2
V16 = ir.VectorType(I8, HALF)
V32 = ir.VectorType(I8, LANES)


def levels(builder, index, shuffle: bool | None = None):
    """KVALUES[index] for a <32 x i8> of indices in [0, 16): a byte shuffle of the 16 levels where the host has
    one (x86's SSSE3 pshufb, chosen when the kernels compile, so the disk cache holds it per CPU), else a tree
    of vector selects on the index bits (15 selects of <32 x i8>, one bit a level). ``shuffle``: force one."""
    if shuffle if shuffle is not None else "ssse3" in target_features():
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V16, [V16, V16]),
                                            "llvm.x86.ssse3.pshuf.b.128")
        halves = [builder.call(fn, [ir.Constant(V16, list(KVALUES)),
                                    builder.shuffle_vector(index, index, ir.Constant(ir.VectorType(I32, HALF),
                                                                                     list(range(k, k + HALF))))])
                  for k in (0, HALF)]
        return builder.shuffle_vector(halves[0], halves[1], ir.Constant(ir.VectorType(I32, LANES), list(range(LANES))))
    choices = [ir.Constant(V32, [v] * LANES) for v in KVALUES]
    for bit in range(4):
        chosen = builder.icmp_unsigned("!=", builder.and_(index, ir.Constant(V32, [1 << bit] * LANES)),
                                       ir.Constant(V32, [0] * LANES))
        choices = [builder.select(chosen, hi, lo) for lo, hi in zip(choices[0::2], choices[1::2])]
    return choices[0]


def _int_scale_and_indices(builder, base, j: int):
    """(scale as i32, the <32 x i8> level indices) of group j of the super-block at ``base``."""
    low = byte_at(builder, base, const(4 + j // 2))
    if j % 2:
        low = builder.lshr(low, ir.Constant(I32, 4))
    high_bits = builder.zext(builder.load(builder.bitcast(builder.gep(base, [const(2)]), I16.as_pointer()), align=1),
                             I32)
    high = builder.and_(builder.lshr(high_bits, ir.Constant(I32, 2 * j)), ir.Constant(I32, 3))
    scale = builder.sub(builder.or_(builder.and_(low, ir.Constant(I32, 15)), builder.shl(high, ir.Constant(I32, 4))),
                        ir.Constant(I32, 32))
    return scale, _indices(builder, base, j)


def _indices(builder, base, j: int):
    """The <32 x i8> level indices of group j of the super-block at ``base``: its 16 bytes' low nibbles, then
    their high ones."""
    packed = vec_load(builder, builder.gep(base, [const(8 + 16 * j)]), V16)
    return builder.shuffle_vector(builder.and_(packed, ir.Constant(V16, [15] * HALF)),
                                  builder.lshr(packed, ir.Constant(V16, [4] * HALF)),
                                  ir.Constant(ir.VectorType(I32, LANES), list(range(LANES))))


def _int_scales(builder, base):
    """<16 x i16>: the 8 groups' scales ls - 32 of the super-block at ``base``, in both 128-bit halves (for
    idot.in_lane_words), taken in one vector: each lane shifts the packed low nibbles (4 bytes) and high
    pairs (16 bits) by its own count, where one group at a time costs some ten scalar operations a group."""
    v8 = ir.VectorType(I32, 8)
    word = lambda ptr, ty: builder.zext(builder.load(builder.bitcast(ptr, ty.as_pointer()), align=1), I32)  # noqa: E731
    lanes = lambda values: ir.Constant(v8, list(values))  # noqa: E731
    low = builder.lshr(splat(builder, word(builder.gep(base, [const(4)]), I32), v8), lanes(4 * j for j in range(8)))
    high = builder.lshr(splat(builder, word(builder.gep(base, [const(2)]), I16), v8), lanes(2 * j for j in range(8)))
    scales = builder.sub(builder.or_(builder.and_(low, lanes([15] * 8)),
                                     builder.shl(builder.and_(high, lanes([3] * 8)), lanes([4] * 8))), lanes([32] * 8))
    narrow = builder.trunc(scales, ir.VectorType(I16, 8))
    return builder.shuffle_vector(narrow, narrow, ir.Constant(ir.VectorType(I32, 16), list(range(8)) * 2))


def _scale_and_indices(builder, base, j: int):
    """(d * scale as float32, the <32 x i8> level indices) of group j of the super-block at ``base``."""
    scale, index = _int_scale_and_indices(builder, base, j)
    return builder.fmul(half_at(builder, base), builder.sitofp(scale, F32), flags=EXACT), index


def group(builder, row, s, j: int):
    base = super_block(builder, row, s, BLOCK_BYTES)
    dl, index = _scale_and_indices(builder, base, j)
    return builder.fmul(builder.sitofp(levels(builder, index), VF), splat(builder, dl), flags=EXACT)


def isuper(builder, row, s, width: int = LANES):
    """Super-block s for the integer loop (isuper.py): (d, no offset, [(levels, ls - 32 as <16 x i16>)] in
    groups of ``width`` weights, each a function that emits them, signed
    levels)."""
    base = super_block(builder, row, s, BLOCK_BYTES)
    scales = _int_scales(builder, base)

    def group_at(j: int):
        def emit():
            return levels(builder, _indices(builder, base, j)), idot.in_lane_words(builder, scales, [j] * 8 + [8 + j] * 8)
        return emit

    groups = [group_at(j) for j in range(GROUPS)]
    return half_at(builder, base), None, idot.side_by_side(builder, groups, width), None, True
