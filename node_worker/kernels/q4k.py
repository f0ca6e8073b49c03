"""q4k rows for simd.py's loops (the layout: shm/formats/q4k.py, a GGUF file's Q4_K super-blocks).

One loop step reads a super-block as 8 groups of 32, the group j a constant of the unrolled loop: d, dmin,
group j's 6-bit (sc, m) and its nibbles; weights = (d * sc) * float(q) - (dmin * m), each operation as
gguf.quants does it (no contraction: the weights are the file's bit for bit), returned whole, no scale apart.

For the integer loop (isuper.py, int8 activations) a super-block is d, dmin, and per group q with the
integer sc, and the integer m of every 16 values: w = d sc q - dmin m.
"""

from __future__ import annotations

from llvmlite import ir

from shm.formats.traits import BY_NAME

from . import idot
from .ir import EXACT, F32, I8, I16, I32, LANES, VF, const, half_at, k_scale_min, splat, super_block, vec_load

TRAITS = BY_NAME["q4k"]  # its block and bytes
SCALED = TRAITS.block > 1  # whole blocks with their scales (f32, bf16: a partial last block read value by value)
OFFSETS = True  # w = d sc q - dmin m: the integer loop adds the mins apart (isuper.py)
GROUPS = TRAITS.block // LANES  # 32-groups a loop step reads: one super-block
GROUP_ORDER = tuple(range(GROUPS))  # the integer loop's order of the groups (q6k's differs)
BLOCK_BYTES = TRAITS.block_bytes * max(1, LANES // TRAITS.block)  # the row's bytes a loop step: the prefetch's stride
V32 = ir.VectorType(I8, LANES)
V64 = ir.VectorType(I8, 2 * LANES)


def nibbles(builder, run, j: int):
    """The 32 nibbles of group j from its run of 32 bytes: low ones for even j, high ones for odd j."""
    values = vec_load(builder, run, V32)
    if j % 2:
        values = builder.lshr(values, ir.Constant(V32, [4] * LANES))
    return builder.and_(values, ir.Constant(V32, [15] * LANES))


def scale_and_offset(builder, base, j: int):
    """(d * sc[j], dmin * m[j]) of a Q4_K or Q5_K super-block, float32 as gguf.quants computes them."""
    sc, m = k_scale_min(builder, builder.gep(base, [const(4)]), j)
    scale = builder.fmul(half_at(builder, base), builder.uitofp(sc, F32), flags=EXACT)
    offset = builder.fmul(half_at(builder, builder.gep(base, [const(2)])), builder.uitofp(m, F32), flags=EXACT)
    return scale, offset


def group(builder, row, s, j: int):
    base = super_block(builder, row, s, BLOCK_BYTES)
    scale, offset = scale_and_offset(builder, base, j)
    q = nibbles(builder, builder.gep(base, [const(16 + 32 * (j // 2))]), j)
    w = builder.fmul(builder.uitofp(q, VF), splat(builder, scale), flags=EXACT)
    return builder.fsub(w, splat(builder, offset), flags=EXACT)


def _scales_and_mins(builder, packed):
    """<16 x i8>: the 8 six-bit scales then the 8 mins of the 12 bytes at ``packed`` (ggml-quants' utmp
    unpacking, on three 32-bit words)."""
    word = lambda k: builder.load(builder.bitcast(builder.gep(packed, [const(4 * k)]), I32.as_pointer()),  # noqa: E731
                                  align=1)
    mask = lambda v: ir.Constant(I32, v)  # noqa: E731
    u0, u1, u2 = word(0), word(1), word(2)
    six, low4, top2 = mask(0x3F3F3F3F), mask(0x0F0F0F0F), mask(0x03030303)
    scales_hi = builder.or_(builder.and_(u2, low4), builder.shl(builder.and_(builder.lshr(u0, mask(6)), top2), mask(4)))
    mins_hi = builder.or_(builder.and_(builder.lshr(u2, mask(4)), low4),
                          builder.shl(builder.and_(builder.lshr(u1, mask(6)), top2), mask(4)))
    words = ir.Constant(ir.VectorType(I32, 4), ir.Undefined)
    for k, w in enumerate((builder.and_(u0, six), scales_hi, builder.and_(u1, six), mins_hi)):
        words = builder.insert_element(words, w, ir.Constant(I32, k))
    return builder.bitcast(words, ir.VectorType(I8, 16))


def int_scales(builder, base, quants, width: int = LANES, pair_quants=None):
    """(d, dmin, [(q, sc) for each group of ``width`` weights], m <16 x i16> per 16 values) of a Q4_K or Q5_K
    super-block at ``base``: q <width x i8>, sc <width / 2 x i16>, each group a function that emits its
    (q, sc); its values given by quants(builder, base, j) for group j of 32, or, where
    width is 64, pair_quants(builder, base, j) for groups j and j + 1 at once (else two groups of 32 joined)."""
    both = _scales_and_mins(builder, builder.gep(base, [const(4)]))  # [16] u8: sc[0..8), m[0..8)
    wide = builder.zext(both, ir.VectorType(I16, 16))
    lanes = lambda idx: ir.Constant(ir.VectorType(I32, len(idx)), idx)  # noqa: E731
    m16 = builder.shuffle_vector(wide, wide, lanes([8 + k // 2 for k in range(16)]))
    if width == 2 * LANES and pair_quants is not None:
        groups = [lambda j=j: (pair_quants(builder, base, j), builder.shuffle_vector(
            wide, wide, lanes([j] * 16 + [j + 1] * 16))) for j in range(0, GROUPS, 2)]
    else:
        scales = idot.halves_alike(builder, wide)  # [sc | sc]: a group's scale one in-lane shuffle away
        # The nibbles read up front, two groups a run: emitted where each group is used (isuper's lazy groups),
        # the loop's speed hung on what else its function compiled (docs/benchmarks.md, "isuper: groups emitted
        # where they are used").
        eager = [quants(builder, base, j) for j in range(GROUPS)]
        groups = idot.side_by_side(builder, [lambda j=j: (eager[j], idot.in_lane_words(
            builder, scales, [j] * 8 + [8 + j] * 8)) for j in range(GROUPS)], width)
    return half_at(builder, base), half_at(builder, builder.gep(base, [const(2)])), groups, m16, False


def both_nibbles(builder, run):
    """<64 x i8>: the 32 bytes at ``run`` as their low nibbles, then their high ones (two groups of 32 that
    share a run: one load, one shift of each half by its own count, one mask)."""
    values = vec_load(builder, run, V32)
    twice = builder.shuffle_vector(values, values, ir.Constant(ir.VectorType(I32, 2 * LANES), list(range(LANES)) * 2))
    return builder.and_(shift_halves(builder, twice, 0, 4), ir.Constant(V64, [15] * 2 * LANES))


def shift_halves(builder, v, low: int, high: int):
    """<64 x i8> v with its first 32 bytes shifted right by ``low`` bits and the next 32 by ``high``, as 16-bit
    lanes (one vpsrlvw): each byte's own bits from ``low`` or ``high`` on stay in its lowest bits, with higher
    bits from the next byte, which the caller masks off."""
    v16 = ir.VectorType(I16, LANES)
    counts = ir.Constant(v16, [low] * (LANES // 2) + [high] * (LANES // 2))
    return builder.bitcast(builder.lshr(builder.bitcast(v, v16), counts), V64)


def _quants(builder, base, j: int):
    return nibbles(builder, builder.gep(base, [const(16 + 32 * (j // 2))]), j)


def _pair_quants(builder, base, j: int):
    """Groups j and j + 1 (j even): the low and the high nibbles of one run."""
    return both_nibbles(builder, builder.gep(base, [const(16 + 32 * (j // 2))]))


def isuper(builder, row, s, width: int = LANES):
    """Super-block s for the integer loop (isuper.py): int_scales, in groups of ``width`` weights."""
    return int_scales(builder, super_block(builder, row, s, BLOCK_BYTES), _quants, width, _pair_quants)
