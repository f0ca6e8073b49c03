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

How the 32 products are taken is chosen when the kernels compile, for the host (the disk cache is per CPU,
as for iq4xs.py's byte shuffle):
    vnni     AVX512-VNNI with VL, or AVX-VNNI: vpdpbusd, 32 products an instruction (scaled_add: vpdpwssd)
    avx2     vpmaddubsw (pairs into int16) then vpmaddwd with ones (pairs into int32) (scaled_add: vpmaddwd
             with the scales, then an add)
    generic  widened to <32 x i32>, multiplied, and the four strided quarters added (any host)
"""

from __future__ import annotations

import os

import llvmlite.binding as llvm
from llvmlite import ir
from numba.core import cgutils

from .ir import I8, I16, I32, LANES

V32 = ir.VectorType(I8, LANES)
VI8 = ir.VectorType(I32, LANES // 4)  # <8 x i32>: one lane per four products
VI16 = ir.VectorType(I16, LANES // 2)
LOWERINGS = ("vnni", "avx2", "generic")


def host_lowering() -> str:
    """The lowering the host's CPU takes (STRATA_IDOT_LOWERING, one of LOWERINGS, forces one; tests)."""
    forced = os.environ.get("STRATA_IDOT_LOWERING", "")
    if forced:
        if forced not in LOWERINGS:
            raise ValueError(f"STRATA_IDOT_LOWERING={forced!r}: expected one of {', '.join(LOWERINGS)}")
        return forced
    features = {name for name, on in llvm.get_host_cpu_features().items() if on}
    if {"avx512vnni", "avx512vl"} <= features or "avxvnni" in features:
        return "vnni"
    if "avx2" in features:
        return "avx2"
    return "generic"


def unsigned_and_signed(builder, q, x, signed: bool):
    """(a, b) with a unsigned and a_i * b_i == q_i * x_i: q and x themselves when q is unsigned."""
    if not signed:
        return q, x
    zero = ir.Constant(V32, [0] * LANES)
    negative = builder.icmp_signed("<", q, zero)
    magnitude = builder.select(negative, builder.sub(zero, q), q)  # -(-128) wraps to 0x80 = 128 unsigned
    return magnitude, builder.select(negative, builder.sub(zero, x), x)


def dot(builder, q, x, signed: bool, lowering: str | None = None):
    """<8 x i32>: the 32 products q_i * x_i summed four by four (module docstring)."""
    a, b = unsigned_and_signed(builder, q, x, signed)
    how = lowering or host_lowering()
    if how == "vnni":
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
    """<16 x i16>: lane k = q[2k] x[2k] + q[2k+1] x[2k+1], q <32 x i8> unsigned below 64, or signed (the sign
    trick: |q| <= 127 then, so a pair stays under 2 x 127 x 127 = 32258), x <32 x i8> in [-127, 127]."""
    q, x = unsigned_and_signed(builder, q, x, signed)
    if (lowering or host_lowering()) in ("vnni", "avx2"):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(VI16, [V32, V32]),
                                            "llvm.x86.avx2.pmadd.ub.sw")
        return builder.call(fn, [q, x])
    wide = ir.VectorType(I32, LANES)
    return builder.trunc(_strided_pairs(builder, builder.mul(builder.zext(q, wide), builder.sext(x, wide)),
                                        LANES // 2), VI16)


def scaled_add(builder, acc, p, sc, lowering: str | None = None):
    """<8 x i32>: acc[k] + p[2k] sc[2k] + p[2k+1] sc[2k+1] (p, sc <16 x i16>)."""
    how = lowering or host_lowering()
    if how == "vnni":
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(VI8, [VI8, VI8, VI8]),
                                            "llvm.x86.avx512.vpdpwssd.256")
        return builder.call(fn, [acc, builder.bitcast(p, VI8), builder.bitcast(sc, VI8)])
    if how == "avx2":
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(VI8, [VI16, VI16]),
                                            "llvm.x86.avx2.pmadd.wd")
        return builder.add(acc, builder.call(fn, [p, sc]))
    wide = ir.VectorType(I32, LANES // 2)
    products = builder.mul(builder.sext(p, wide), builder.sext(sc, wide))
    return builder.add(acc, _strided_pairs(builder, products, LANES // 4))
