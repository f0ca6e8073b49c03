"""Integer dot products of a block of 32 weights with 32 int8 activations, in LLVM IR.

The quantised formats' decode kernel (isimd.py's ``dot4i``) takes the
activations quantised per block of 32 (activations.py) and multiplies the
weights' small integers by them in integers, as llama.cpp does: a block's 32
products summed four by four into <8 x i32>, converted to float once and
scaled by (weight scale × activation scale). The float path widens every
weight to float32 and spends an FMA on each; this one spends one
instruction on 32 (VNNI) or two (AVX2).

    dot(builder, q, x, signed) -> <8 x i32>    lane k = sum over i < 4 of q[4k + i] * x[4k + i]
        q  <32 x i8>  the weights' integers: unsigned (0..255) when signed is False, else signed
        x  <32 x i8>  the activations, in [-127, 127] (never -128: the quantiser clamps)

Signed weights take the sign trick: |q| (unsigned, <= 128) times x with q's sign, so every path multiplies
unsigned bytes by signed ones; no pair of products can reach the 16-bit saturation of AVX2's vpmaddubsw
(2 x 128 x 127 = 32512). The sums are integers, exact in every lowering, so every host gives the same bits.

Prefill's super-block loop (isuper.py) multiplies each 16 products by an integer scale before it adds them:

    pairs(builder, q, x, signed) -> <16 x i16>    lane k = q[2k] x[2k] + q[2k+1] x[2k+1]   (q unsigned, < 64;
                                                   or signed, |q| <= 127)
    scaled_add(builder, acc, p, sc) -> <8 x i32>  acc[k] + p[2k] sc[2k] + p[2k+1] sc[2k+1]  (sc <16 x i16>)

q below 64 keeps every pair under 2 x 63 x 127 = 16002 (signed q above -128, 32258): vpmaddubsw never
saturates, and the sums are exact.

pairs and scaled_add take one group of 32 weights (q <32 x i8>, sc <16 x i16>, acc <8 x i32>), or two groups
side by side (<64 x i8>, <32 x i16>, <16 x i32>) where the lowering has 512-bit registers: ``group_bytes()``
says which, ``joined`` puts two groups side by side. The products and sums are the same integers either way.

Q8_0's and Q4_0's loops (isimd.py's decode rows, iblock.py's prefill tiles, rows8.py's interleaved groups) add
a (row, token)'s blocks in one order, so its bits do not depend on the loop that computes it:

    totals(builder, vecs) -> <8 x i32>             lane i = the sum of vecs[i]'s lanes (len(vecs) <= 8): each
                                                   item's exact integer block sum, items side by side
    scaled_blocks(builder, acc, s, dw, dx)         acc + float(s) * (dw * dx) lane by lane, each operation
                                                   rounded (no contraction, no reassociation)

starting from 0 and taking the blocks in order: the integers are exact in any grouping, and the float chain
is the same three roundings a block whichever loop, tile or lowering runs it.

How the products are taken is chosen when the kernels compile, for the host (the disk cache is per CPU,
as for iq4xs.py's byte shuffle):
    vnni512  AVX512-VNNI with BW: as vnni, on two groups at once (vpmaddubsw and vpdpwssd on 512 bits): the
             same instruction rate as 256 bits on AVX-512 cores, so twice the products; decode's per-32 dot
             stays on 256 bits (its scales are per block of 32)
    vnni     AVX512-VNNI with VL, or AVX-VNNI: vpdpbusd, 32 products an instruction (scaled_add: vpdpwssd)
    avx2     vpmaddubsw (pairs into int16) then vpmaddwd with ones (pairs into int32) (scaled_add: vpmaddwd
             with the scales, then an add)
    generic  widened to <32 x i32>, multiplied, and the four strided quarters added (any host)
    generic512  the generic products on vnni512's layout, two groups a call (any host; never chosen by
             itself: tests/test_int_dot.py checks vnni512's data layout with it on a host without AVX-512)
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils

from .common import target_features
from .ir import EXACT, F32, I8, I16, I32, LANES

V32 = ir.VectorType(I8, LANES)
VI8 = ir.VectorType(I32, LANES // 4)  # <8 x i32>: one lane per four products
VI16 = ir.VectorType(I16, LANES // 2)
VF8 = ir.VectorType(F32, LANES // 4)  # <8 x float>: a lane per item of totals
LOWERINGS = ("vnni512", "vnni", "avx2", "generic", "generic512")
FEATURES = {"vnni512": {"avx512vnni", "avx512bw", "avx512vl"}, "avx2": {"avx2"}}  # and vnni: see host_lowering


def host_lowering() -> str:
    """The lowering the kernels' target CPU takes (common.target_features: the host's, or numba's
    NUMBA_CPU_NAME / NUMBA_CPU_FEATURES, which choose another target for every kernel alike)."""
    features = target_features()
    return next(how for how in LOWERINGS if host_has(how, features))


def host_has(lowering: str, features: set[str] | None = None) -> bool:
    """Whether the kernels' target CPU (or ``features``) can run ``lowering``."""
    if features is None:
        features = target_features()
    if lowering == "vnni":
        return {"avx512vnni", "avx512vl"} <= features or "avxvnni" in features
    return FEATURES.get(lowering, set()) <= features


def group_bytes(lowering: str | None = None) -> int:
    """The weights one pairs/scaled_add call takes: 64 (two groups) where the lowering has 512-bit registers."""
    return 2 * LANES if (lowering or host_lowering()) in ("vnni512", "generic512") else LANES


def kept(builder, values: list, lowering: str | None = None) -> list:
    """The values, through one empty inline asm on x86 lowerings (any other: the values themselves): LLVM
    cannot see through it, so it neither reassociates an accumulator's sums across the groups before and
    after it nor computes one accumulator's later groups before the others' earlier ones. Without it, LLVM
    turns the integer loop's per-token chain over a super-block's groups into a tree, token by token, which
    keeps every group's unpacked weights and scales live at once: more than AVX2's 16 registers hold, so they
    are spilled and reloaded for every token."""
    if (lowering or host_lowering()) not in ("avx2", "vnni", "vnni512") or not values:
        return values
    n = len(values)
    types_ = [v.type for v in values]
    constraints = ",".join(["=x"] * n + [str(k) for k in range(n)])
    if n == 1:  # one output: the value itself, not a struct of one
        return [builder.asm(ir.FunctionType(types_[0], types_), "", constraints, values, side_effect=False)]
    out = builder.asm(ir.FunctionType(ir.LiteralStructType(types_), types_), "", constraints, values,
                      side_effect=False)
    return [builder.extract_value(out, k) for k in range(n)]


def joined(builder, a, b):
    """a and b side by side: <2n x T> from two <n x T>."""
    n = a.type.count
    return builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(I32, 2 * n), list(range(2 * n))))


def side_by_side(builder, groups, width: int):
    """Groups of 32 as groups of ``width`` weights (group_bytes: 32, or 64 joined two by two); each group a
    function that emits its (q, sc) where it is called (isuper.py)."""
    if width == LANES:
        return groups

    def pair(g0, g1):
        def emit():
            (q0, sc0), (q1, sc1) = g0(), g1()
            return joined(builder, q0, q1), joined(builder, sc0, sc1)
        return emit

    return [pair(g0, g1) for g0, g1 in zip(groups[::2], groups[1::2])]


def in_lane_words(builder, v, picks, lowering: str | None = None):
    """<16 x i16>: lane k = v[picks[k]] of a <16 x i16> v, each pick within its own 128-bit half (lanes 0-7 from
    0-7, lanes 8-15 from 8-15): one vpshufb on x86 (LLVM lowers a broadcast of one word to a vpshufd or a shift
    and then a vpbroadcastw), a shufflevector elsewhere. The super-block loops' per-group scales."""
    assert all((k < 8) == (p < 8) for k, p in enumerate(picks)), "each pick within its own half"
    if (lowering or host_lowering()) not in ("avx2", "vnni", "vnni512"):
        return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, 16), list(picks)))
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V32, [V32, V32]), "llvm.x86.avx2.pshuf.b")
    # The index through kept's empty asm (LLVM turns a pshufb of a constant index back into the shuffle it lowers
    # to the broadcast), once a basic block for the rows of a tile alike.
    made = builder.block.__dict__.setdefault("_word_picks", {})
    if tuple(picks) not in made:
        made[tuple(picks)] = kept(builder, [ir.Constant(V32, [2 * (p % 8) + b for p in picks for b in (0, 1)])],
                                  lowering)[0]
    return builder.bitcast(builder.call(fn, [builder.bitcast(v, V32), made[tuple(picks)]]), VI16)


def halves_alike(builder, v, half: int = 0):
    """<16 x i16>: v's 128-bit half ``half`` (its words 8 half .. 8 half + 7) in both halves, for in_lane_words."""
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, 16), [8 * half + k for k in range(8)] * 2))


def unsigned_and_signed(builder, q, x, signed: bool, lowering: str | None = None):
    """(a, b) with a unsigned and a_i * b_i == q_i * x_i: q and x themselves when q is unsigned. x is never
    -128 (the activations' int8 levels are symmetric, -127..127), so negating it never wraps. On avx2, 32
    lanes: vpabsb and vpsignb (x negated where q < 0, zeroed where q is 0, whose magnitude is 0 anyway),
    where the generic select form becomes a compare, two xors and a subtraction per token."""
    if not signed:
        return q, x
    zero = ir.Constant(q.type, [0] * q.type.count)
    negative = builder.icmp_signed("<", q, zero)
    magnitude = builder.select(negative, builder.sub(zero, q), q)  # -(-128) wraps to 0x80 = 128 unsigned
    if (lowering or host_lowering()) == "avx2" and q.type == V32:
        sign = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V32, [V32, V32]),
                                              "llvm.x86.avx2.psign.b")
        return magnitude, builder.call(sign, [x, q])
    return magnitude, builder.select(negative, builder.sub(zero, x), x)


def dot(builder, q, x, signed: bool, lowering: str | None = None):
    """<8 x i32>: the 32 products q_i * x_i summed four by four (module docstring)."""
    a, b = unsigned_and_signed(builder, q, x, signed, lowering)
    how = lowering or host_lowering()
    if how in ("vnni", "vnni512"):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(VI8, [VI8, VI8, VI8]),
                                            "llvm.x86.avx512.vpdpbusd.256")
        return builder.call(fn, [ir.Constant(VI8, [0] * 8), builder.bitcast(a, VI8), builder.bitcast(b, VI8)])
    if how == "avx2":  # pairs into int16, then pairs of those into int32 (times ones)
        return scaled_add(builder, ir.Constant(VI8, [0] * 8), pairs(builder, a, b, False, how),
                          ir.Constant(VI16, [1] * (LANES // 2)), how)
    wide = ir.VectorType(I32, LANES)
    products = builder.mul(builder.zext(a, wide), builder.sext(b, wide))
    total = None
    for k in range(4):
        quarter = builder.shuffle_vector(products, products, ir.Constant(VI8, list(range(k, LANES, 4))))
        total = quarter if total is None else builder.add(total, quarter)
    return total


def _strided_pairs(builder, wide, count: int):
    """lane k = wide[2k] + wide[2k + 1] of a vector of 2 count lanes."""
    vty = ir.VectorType(I32, count)
    even = builder.shuffle_vector(wide, wide, ir.Constant(vty, list(range(0, 2 * count, 2))))
    odd = builder.shuffle_vector(wide, wide, ir.Constant(vty, list(range(1, 2 * count, 2))))
    return builder.add(even, odd)


def pairs(builder, q, x, signed: bool = False, lowering: str | None = None):
    """<n/2 x i16>: lane k = q[2k] x[2k] + q[2k+1] x[2k+1], q <n x i8> (n = 32, or 64 on vnni512) unsigned below
    64, or signed (the sign trick: |q| <= 127 then, so a pair stays under 2 x 127 x 127 = 32258), x <n x i8> in
    [-127, 127]."""
    q, x = unsigned_and_signed(builder, q, x, signed, lowering)
    n = q.type.count
    how = lowering or host_lowering()
    half = ir.VectorType(I16, n // 2)
    if how == "vnni512" and n == 2 * LANES:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(half, [q.type, q.type]),
                                            "llvm.x86.avx512.pmaddubs.w.512")
        return builder.call(fn, [q, x])
    if how in ("vnni512", "vnni", "avx2") and n == LANES:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(VI16, [V32, V32]),
                                            "llvm.x86.avx2.pmadd.ub.sw")
        return builder.call(fn, [q, x])
    wide = ir.VectorType(I32, n)
    return builder.trunc(_strided_pairs(builder, builder.mul(builder.zext(q, wide), builder.sext(x, wide)),
                                        n // 2), half)


def scaled_add(builder, acc, p, sc, lowering: str | None = None):
    """<n/4 x i32>: acc[k] + p[2k] sc[2k] + p[2k+1] sc[2k+1] (p, sc <n/2 x i16>: n = 32, or 64 on vnni512)."""
    how = lowering or host_lowering()
    lanes = acc.type.count
    if how in ("vnni", "vnni512") and lanes in (8, 16) and (lanes == 8 or how == "vnni512"):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(acc.type, [acc.type] * 3),
                                            f"llvm.x86.avx512.vpdpwssd.{32 * lanes}")
        return builder.call(fn, [acc, builder.bitcast(p, acc.type), builder.bitcast(sc, acc.type)])
    if how == "avx2" and lanes == 8:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(VI8, [VI16, VI16]),
                                            "llvm.x86.avx2.pmadd.wd")
        return builder.add(acc, builder.call(fn, [p, sc]))
    wide = ir.VectorType(I32, 2 * lanes)
    products = builder.mul(builder.sext(p, wide), builder.sext(sc, wide))
    return builder.add(acc, _strided_pairs(builder, products, lanes))


def biased(builder, acc, u, s, lowering: str | None = None):
    """<n/4 x i32>: acc[k] + the sum over i < 4 of u[4k + i] s[4k + i], u <n x i8> unsigned (0..255), s signed
    (n = 32, or 64 on vnni512): vpdpbusd, which adds the four products in int32 without saturating. On avx2
    (vpmaddubsw's int16 pairs) only for |s| <= 63, where a pair stays under 2 x 255 x 63 = 32130."""
    how = lowering or host_lowering()
    lanes = acc.type.count
    if how in ("vnni", "vnni512") and (lanes == 8 or how == "vnni512"):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(acc.type, [acc.type] * 3),
                                            f"llvm.x86.avx512.vpdpbusd.{32 * lanes}")
        return builder.call(fn, [acc, builder.bitcast(u, acc.type), builder.bitcast(s, acc.type)])
    if how == "avx2" and lanes == 8:
        return scaled_add(builder, acc, pairs(builder, u, s, False, how), ir.Constant(VI16, [1] * (LANES // 2)), how)
    wide = ir.VectorType(I32, 4 * lanes)
    products = builder.mul(builder.zext(u, wide), builder.sext(s, wide))
    return builder.add(acc, _strided_pairs(builder, _strided_pairs(builder, products, 2 * lanes), lanes))


EVENS = ir.Constant(VI8, list(range(0, 16, 2)))
ODDS = ir.Constant(VI8, list(range(1, 16, 2)))


def totals(builder, vecs, lowering: str | None = None):
    """<8 x i32>: lane i the sum of vecs[i]'s eight lanes, for up to 8 vectors <8 x i32> (lanes past them 0): a
    tree of pairs of lanes added, two vectors into one a level (each level halves every item's lanes), three
    levels down to one lane an item. On x86, vphaddd (pairs within each 128-bit half: [a01 a23 b01 b23 | a45 a67
    b45 b67]) for the first two levels, then the halves added: where LLVM lowers the generic even and odd
    shuffles across the halves to permutes, several a level."""
    zero = ir.Constant(VI8, [0] * 8)
    level = list(vecs) + [zero] * (-len(vecs) % 4)
    if (lowering or host_lowering()) in ("avx2", "vnni", "vnni512"):
        hadd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(VI8, [VI8, VI8]),
                                              "llvm.x86.avx2.phadd.d")
        for _ in range(2):  # [v0 v1 v2 v3 | v0 v1 v2 v3] sums of halves: item k's half-sums at lanes k, k + 4
            level = [zero if a is zero and b is zero else builder.call(hadd, [a, b])
                     for a, b in zip(level[::2], level[1::2])]
        halves = [builder.add(builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, 4), [0, 1, 2, 3])),
                              builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, 4), [4, 5, 6, 7])))
                  for v in level]  # [<4 x i32>] items 4 g .. 4 g + 3
        if len(halves) == 1:
            return builder.shuffle_vector(halves[0], ir.Constant(halves[0].type, [0] * 4),
                                          ir.Constant(VI8, list(range(8))))
        return builder.shuffle_vector(halves[0], halves[1], ir.Constant(VI8, list(range(8))))
    level = level + [zero] * (8 - len(level))
    while len(level) > 1:
        level = [zero if a is zero and b is zero else
                 builder.add(builder.shuffle_vector(a, b, EVENS), builder.shuffle_vector(a, b, ODDS))
                 for a, b in zip(level[::2], level[1::2])]
    return level[0]


def scaled_blocks(builder, acc, sums, dw, dx):
    """acc + float(sums) * (dw * dx), <8 x float> lane by lane, each operation rounded as written (EXACT): one
    block's step in the one order every Q8_0 / Q4_0 integer loop takes (module docstring)."""
    scale = builder.fmul(dw, dx, flags=EXACT)
    return builder.fadd(acc, builder.fmul(builder.sitofp(sums, VF8), scale, flags=EXACT), flags=EXACT)
