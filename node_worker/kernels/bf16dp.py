"""bf16 rows by activations rounded to bf16 (EngineConfig.activations "bf16"): llama.cpp's BF16 arithmetic.

The rows are shm/formats/bf16.py's, unchanged (bf16.py reads them as float32 for every other loop):

    row of H weights: bytes [0, 2H) uint16 bits[i], the top half of float32 w[i]

What changes is the product. A block of 32 weights is one 512-bit vector of bf16 pairs, and so is the
token's block, rounded from float32 to the nearest bf16 (ties to even) in the registers:

    lane k of <16 x float> acc, k < 16:     acc[k] = fma(w[2k+1], x[2k+1], acc[k])    (the odd value first)
                                            acc[k] = fma(w[2k],   x[2k],   acc[k])
    a row's dot product:                    the 16 lanes added at the end (a tree: fastmath)

A bf16 by bf16 product has at most 16 significant bits, so each fma is the exact product added and rounded
once. On a host with AVX-512 BF16 that pair of steps is one vdpbf16ps (32 products per instruction against
16 for a float32 FMA, and half the activation bytes); elsewhere it is two FMAs on the pairs split by shifts,
in the same order: the same bits as vdpbf16ps over random blocks at three scales (tests/test_formats.py
checks it wherever the host has the instruction). Only denormals differ:
vdpbf16ps treats them as zero.

A partial last block (H not a multiple of 32) is taken value by value: fma(w[i], bf16(x[i]), sum).

Decode (one token, simd.dot4 of bf16dp) rounds the token's blocks in the registers; the tiles of several tokens
(simd.pairs4r4, pairs2r4) take them rounded once for all the matrix's rows (round_rows): the conversion in
the registers for every four rows would cost as much as the products.
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import bf16
from .common import JIT, target_features
from .ir import F32, I16, I32, LANES

SCALED = False
BLOCK_BYTES = bf16.BLOCK_BYTES
DOT_PAIRS = True  # simd.py takes these rows in dot_pairs, on <16 x float> accumulators
block, value = bf16.block, bf16.value  # the float32 loops' readers (decoding a row: exact)
PAIRS = LANES // 2
VP = ir.VectorType(F32, PAIRS)  # <16 x float>: an accumulator, a lane per pair of values
VI = ir.VectorType(I32, PAIRS)


class _BFloat(ir.types._BaseFloatType):
    """LLVM's bfloat, which llvmlite's IR builder does not name."""

    null = "0.0"
    intrinsic_name = "bf16"

    def __str__(self):
        return "bfloat"


_BFloat._create_instance()
BF16 = _BFloat()
VB = ir.VectorType(BF16, LANES)  # <32 x bfloat>


def host_has_dpbf16() -> bool:
    return "avx512bf16" in target_features()


NATIVE = host_has_dpbf16()  # a constant of the compiled kernels (numba's cache is per CPU)


def pairs(builder, row, b):
    """Block b of the row: its 32 bf16 values as <16 x i32> pairs."""
    ptr = builder.gep(row, [builder.mul(b, ir.Constant(ir.IntType(64), 2 * LANES))])
    return builder.load(builder.bitcast(ptr, VI.as_pointer()), align=1)


def bf16_bits(builder, x, native=None):
    """The bits (i16, or <n x i16>) of float x (or <n x float>) rounded to the nearest bf16, ties to even.

    Where the kernels' CPU has AVX-512 BF16, LLVM's fptrunc to bfloat (vcvtneps2bf16). Elsewhere LLVM makes
    that fptrunc a call to __truncsfbf2, which numba's linker does not have (the process stopped: "LLVM
    ERROR: Symbol not found: __truncsfbf2", on every AVX2 host), so it is written out in integers as ggml
    writes it (ggml_compute_fp32_to_bf16): u + 0x7fff + (bit 16 of u), the top half; a NaN keeps its top half,
    made quiet. The same bits as the instruction for every value but denormals, which it takes as zero
    (tests/test_formats.py)."""
    if NATIVE if native is None else native:
        bf = BF16 if isinstance(x.type, ir.FloatType) else ir.VectorType(BF16, x.type.count)
        return builder.bitcast(builder.fptrunc(x, bf), ir.IntType(16) if bf is BF16 else ir.VectorType(I16, bf.count))

    n = None if isinstance(x.type, ir.FloatType) else x.type.count
    u = builder.bitcast(x, I32 if n is None else ir.VectorType(I32, n))

    def each(value):
        return ir.Constant(u.type, value if n is None else [value] * n)

    top = builder.lshr(u, each(16))
    nearest = builder.lshr(builder.add(u, builder.add(each(0x7FFF), builder.and_(top, each(1)))), each(16))
    nan = builder.icmp_unsigned(">", builder.and_(u, each(0x7FFFFFFF)), each(0x7F800000))
    bits = builder.select(nan, builder.or_(top, each(64)), nearest)
    return builder.trunc(bits, I16 if n is None else ir.VectorType(I16, n))


def activations(builder, xv):
    """<32 x float> of a token -> its bf16 pairs <16 x i32>, each value rounded to the nearest bf16."""
    return builder.bitcast(bf16_bits(builder, xv), VI)


def dot_pairs(builder, acc, w, x, native=None):
    """acc <16 x float> + the pairs' products of w and x (<16 x i32> of bf16 pairs), the odd one first."""
    if NATIVE if native is None else native:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(VP, [VP, VB, VB]),
                                            "llvm.x86.avx512bf16.dpbf16ps.512")
        return builder.call(fn, [acc, builder.bitcast(w, VB), builder.bitcast(x, VB)])
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(VP, [VP, VP, VP]), f"llvm.fma.v{PAIRS}f32")
    high = ir.Constant(VI, [-65536] * PAIRS)
    shift = ir.Constant(VI, [16] * PAIRS)

    def odd(v):
        return builder.bitcast(builder.and_(v, high), VP)

    def even(v):
        return builder.bitcast(builder.shl(v, shift), VP)

    return builder.call(fma, [even(w), even(x), builder.call(fma, [odd(w), odd(x), acc])])


def rounded(builder, x):
    """float x rounded to the nearest bf16, as a float."""
    return widened(builder, bf16_bits(builder, x))


def widened(builder, bits):
    """The i16 bits of a bf16 as a float (exact: the top half of the float's bits)."""
    return builder.bitcast(builder.shl(builder.zext(bits, I32), ir.Constant(I32, 16)), F32)


@intrinsic
def _bf16_bits(typingctx, x):
    """The bits of float32 x rounded to the nearest bf16 (the conversion rounded() and activations() make)."""
    sig = types.uint16(x)

    def codegen(context, builder, signature, args):
        return bf16_bits(builder, args[0])

    return sig, codegen


@njit(**JIT)
def round_rows(x, out) -> None:
    """out [n, H] uint16 <- x [n, H] float32 rounded to bf16 (the tokens once for all of a matrix's rows)."""
    for t in range(x.shape[0]):
        for i in range(x.shape[1]):
            out[t, i] = _bf16_bits(x[t, i])


def reduce(builder, acc):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(F32, [F32, VP]),
                                        f"llvm.vector.reduce.fadd.v{PAIRS}f32")
    return builder.call(fn, [ir.Constant(F32, 0.0), acc])  # numba's fastmath pass lets LLVM add as a tree
