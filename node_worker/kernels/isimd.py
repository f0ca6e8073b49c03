"""Q8_0's and Q4_0's decode loop with int8 activations: simd.py's dot4, integer inside (the K types and
IQ4_XS take isuper.py's super-block loop, in decode too).

The activations come quantised per block of 32 (activations.py: xq int8, xd its scales, xs its scaled
sums). For each block of 32 weights a format's ``igroup`` gives its integers q, whether they are signed,
its scale (a float) and its offset (or None), with w = scale * q - offset; then per row

    acc <8 x float> += float(idot(q, xq_b)) * (scale * xd[b])       (idot.py: 32 products, 8 lanes)
    off float       += offset * xs[b]                                (only formats with an offset)
    x · w = reduce(acc) - off

which is x' · w on the quantised activations x' = xd ⊙ xq, exactly up to the float32 rounding of the
scales and the sum. The f32 and bf16 formats have no integers to multiply and keep simd.py's loops.

    dot4i(ks, fmt, data, o0, o1, o2, o3, hidden, xq, xd, xs)  -> the four rows' dot products (decode; fmt
                                                            q8's or q4's FORMATS index)

Decode only. For several tokens the per-block conversion and scaling per token is as much float work
as simd.py's dot2r4 spends (two FMAs a token per 32 weights, AVX-512), so an integer dot2r4 in this form
gains nothing on the float one. Prefill takes iblock.py's loop instead (the activations biased for vpdpbusd, a
conversion per 64 weights), and the K types' (isuper.py) adds a super-block's products in integers, with the
formats' integer scales, and converts once per 256.
"""

from __future__ import annotations

from types import ModuleType

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from shm.formats.traits import BLOCK_INT_LOOPS, INT_LOOPS

from . import idot
from .ir import F32, I8, LANES, const, splat
from .loops import FORMATS, byte_ptr, per_format, prefetch_tile, reduce_sum, register_loop, step_groups
from .simd import FAST

BLOCK_FORMATS: dict[str, ModuleType] = {name: FORMATS[name] for name in BLOCK_INT_LOOPS}  # dot4i's: q8, q4
INT_FORMATS: dict[str, ModuleType] = {name: FORMATS[name] for name in INT_LOOPS}  # integers to multiply
V8F = ir.VectorType(F32, LANES // 4)
V32 = ir.VectorType(I8, LANES)


def _pointers(context, builder, sig_args, args):
    """(int8 pointer of xq, float pointers of xd and xs)."""
    xq, xd, xs = (byte_ptr(context, builder, t, v) for t, v in zip(sig_args, args))
    return xq, builder.bitcast(xd, F32.as_pointer()), builder.bitcast(xs, F32.as_pointer())


def _block_scales(builder, scale, dx):
    """<8 x float> scale * dx in every lane."""
    return splat(builder, builder.fmul(scale, dx, flags=FAST), V8F)


class _Acc:
    """One row's accumulators against one token: the <8 x float> of the scaled block sums, and the offsets."""

    def __init__(self, vec, off):
        self.vec, self.off = vec, off

    def add(self, builder, q, signed, scale, offset, xv, dx, xsum) -> _Acc:
        s = builder.sitofp(idot.dot(builder, q, xv, signed), V8F)
        vec = builder.fadd(self.vec, builder.fmul(s, _block_scales(builder, scale, dx), flags=FAST), flags=FAST)
        off = self.off if offset is None else builder.fadd(self.off, builder.fmul(offset, xsum, flags=FAST),
                                                           flags=FAST)
        return _Acc(vec, off)

    def total(self, builder):
        return builder.fsub(reduce_sum(builder, self.vec), self.off, flags=FAST)


def _zero_acc() -> _Acc:
    return _Acc(ir.Constant(V8F, [0.0] * 8), ir.Constant(F32, 0.0))


def _emit_rows(builder, fmt, rows, x, hidden_v):
    """The loop over the rows' loop steps against one token's quantised activations -> the rows' totals."""
    xq, xd, xs = x

    def step(i, flat):
        accs = [_Acc(flat[2 * k], flat[2 * k + 1]) for k in range(len(rows))]
        prefetch_tile(builder, fmt, rows, i)  # decode's four rows of a matrix, one after another: one run
        for j in range(step_groups(fmt)):
            b = builder.add(builder.mul(i, const(step_groups(fmt))), const(j))  # block b of the row (32 values)
            xv = builder.load(builder.bitcast(builder.gep(xq, [builder.mul(b, const(LANES))]), V32.as_pointer()),
                              align=1)
            dx, xsum = (builder.load(builder.gep(p, [b]), align=4) for p in (xd, xs))
            for r, row in enumerate(rows):
                q, signed, scale, offset = fmt.igroup(builder, row, i, j, hidden_v)
                accs[r] = accs[r].add(builder, q, signed, scale, offset, xv, dx, xsum)
        return [v for a in accs for v in (a.vec, a.off)]

    init = [v for _ in rows for v in (_zero_acc().vec, _zero_acc().off)]
    flat = register_loop(builder, builder.udiv(builder.udiv(hidden_v, const(LANES)), const(step_groups(fmt))), init,
                          step)
    return [_Acc(flat[2 * k], flat[2 * k + 1]).total(builder) for k in range(len(rows))]


@intrinsic
def dot4i(typingctx, kernels, fmt, data, o0, o1, o2, o3, hidden, xq, xd, xs):
    """The four rows' dot products for the integer format whose FORMATS index is ``fmt`` (a run-time value; the
    kernel set ``kernels`` says which formats' integer loops are compiled)."""
    sig = types.UniTuple(types.float32, 4)(kernels, fmt, data, o0, o1, o2, o3, hidden, xq, xd, xs)

    def codegen(context, builder, signature, args):
        args = args[1:]
        base = byte_ptr(context, builder, signature.args[2], args[1])
        rows = [builder.gep(base, [o]) for o in args[2:6]]
        x = _pointers(context, builder, signature.args[8:11], args[7:10])
        sums = [cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0)) for _ in rows]

        def emit(fmt_module):
            for total, dest in zip(_emit_rows(builder, fmt_module, rows, x, args[6]), sums):
                builder.store(total, dest)

        per_format(context, builder, signature.args[0], signature.args[1], args[0], emit, BLOCK_FORMATS, True)
        return context.make_tuple(builder, signature.return_type, [builder.load(s) for s in sums])

    return sig, codegen
