"""Explicit vector loops over rows of any format, written in LLVM IR through numba intrinsics.

Numba's auto-vectorizer turns a block-scaled row (a float16 scale every 32
values) into nested loops that reduce every block horizontally: measured 1.3–5.4
G weights/s, a fraction of what the memory gives. Here each block of 32 values
is one LLVM vector ``<32 x float>``: the format's module (f32.py, bf16.py,
q8.py, q4.py) widens the block in registers and returns its scale apart, the
loop multiplies the scale in once per block and accumulates into a vector per
row, which is reduced once at the end of the row. The IR names no instruction
set: LLVM lowers ``<32 x float>`` to four AVX2 registers, two AVX-512 ones, or
whatever the host has, so nothing assumes a vector width.

Two intrinsics per format, each on four rows at byte offsets o0..o3 of ``data``:

    dot4_F(data, o0, o1, o2, o3, hidden, x)             -> (x·w0, x·w1, x·w2, x·w3)    x [H] float32
    axpy4_F(data, o0, o1, o2, o3, hidden, c0..c3, out)  out [H] float32 += Σ c_r w_r

and two on one row with n token rows at once (2 <= n <= MAX_TOKENS; prefill's groups), the
block widened once and used for every token:

    dotn_F(data, o, hidden, xg, out)                    out [n] float32 = xg [n, H] · w
    axpyn_F(data, o, hidden, c, out)                    out [n, H] += c [n] ⊗ w

and one that writes a row out as float32 (for BLAS on many tokens):

    decode_F(data, o, hidden, out)                      out [H] float32 = w

f32 and bf16 rows may end in a partial block (H not a multiple of 32): those
values are taken one by one after the vector loop. The order of the float
operations is fixed by the code, so a call gives the same bits wherever it runs:
the in-process pool, the node workers and the dense matrices share these loops.
"""

from __future__ import annotations

from types import ModuleType

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import bf16, f32, q4, q8
from .ir import F32, I8, I32, LANES, VF, const

FAST = ("fast",)
FORMATS: dict[str, ModuleType] = {"f32": f32, "bf16": bf16, "q8": q8, "q4": q4}


def _byte_ptr(context, builder, aryty, ary):
    return builder.bitcast(context.make_array(aryty)(context, builder, ary).data, I8.as_pointer())


def _splat(builder, value):
    one = builder.insert_element(ir.Constant(VF, ir.Undefined), value, ir.Constant(I32, 0))
    return builder.shuffle_vector(one, ir.Constant(VF, ir.Undefined),
                                  ir.Constant(ir.VectorType(I32, LANES), [0] * LANES))


def _reduce(builder, vec):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(F32, [F32, VF]),
                                        f"llvm.vector.reduce.fadd.v{LANES}f32")
    return builder.call(fn, [ir.Constant(F32, 0.0), vec])  # numba's fastmath pass lets LLVM add as a tree


def _scaled_block(builder, fmt, row, b, hidden):
    """Block b of a row as <32 x float> weights (the scale multiplied in)."""
    w, d = fmt.block(builder, row, b, hidden)
    return w if d is None else builder.fmul(w, _splat(builder, d), flags=FAST)


def _tail(builder, hidden, nb):
    """Loop over the values of a partial last block (none for the scaled formats)."""
    return cgutils.for_range_slice(builder, builder.mul(nb, const(LANES)), hidden, const(1))


def _make_dot4(fmt: ModuleType):
    @intrinsic
    def dot4(typingctx, data, o0, o1, o2, o3, hidden, x):
        sig = types.UniTuple(types.float32, 4)(data, o0, o1, o2, o3, hidden, x)

        def codegen(context, builder, signature, args):
            data_v, offsets, hidden_v, x_v = args[0], args[1:5], args[5], args[6]
            base = _byte_ptr(context, builder, signature.args[0], data_v)
            rows = [builder.gep(base, [o]) for o in offsets]
            xp = builder.bitcast(_byte_ptr(context, builder, signature.args[6], x_v), F32.as_pointer())
            nb = builder.udiv(hidden_v, const(LANES))
            accs = [cgutils.alloca_once_value(builder, ir.Constant(VF, [0.0] * LANES)) for _ in rows]
            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                xv = builder.load(builder.bitcast(builder.gep(xp, [builder.mul(b, const(LANES))]), VF.as_pointer()),
                                  align=4)  # [32] of x, shared by the four rows
                for row, acc in zip(rows, accs):
                    w = _scaled_block(builder, fmt, row, b, hidden_v)
                    builder.store(builder.fadd(builder.load(acc), builder.fmul(w, xv, flags=FAST), flags=FAST), acc)
            sums = [cgutils.alloca_once_value(builder, _reduce(builder, builder.load(acc))) for acc in accs]
            if not fmt.SCALED:
                with _tail(builder, hidden_v, nb) as (i, _):
                    xi = builder.load(builder.gep(xp, [i]), align=4)
                    for row, acc in zip(rows, sums):
                        w = fmt.value(builder, row, i)
                        builder.store(builder.fadd(builder.load(acc), builder.fmul(w, xi, flags=FAST), flags=FAST), acc)
            return context.make_tuple(builder, signature.return_type, [builder.load(s) for s in sums])

        return sig, codegen

    return dot4


def _make_axpy4(fmt: ModuleType):
    @intrinsic
    def axpy4(typingctx, data, o0, o1, o2, o3, hidden, c0, c1, c2, c3, out):
        sig = types.void(data, o0, o1, o2, o3, hidden, c0, c1, c2, c3, out)

        def codegen(context, builder, signature, args):
            data_v, offsets, hidden_v, coefs, out_v = args[0], args[1:5], args[5], args[6:10], args[10]
            base = _byte_ptr(context, builder, signature.args[0], data_v)
            rows = [builder.gep(base, [o]) for o in offsets]
            outp = builder.bitcast(_byte_ptr(context, builder, signature.args[10], out_v), F32.as_pointer())
            coefs = [context.cast(builder, c, t, types.float32) for c, t in zip(coefs, signature.args[6:10])]
            nb = builder.udiv(hidden_v, const(LANES))
            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                optr = builder.bitcast(builder.gep(outp, [builder.mul(b, const(LANES))]), VF.as_pointer())
                total = builder.load(optr, align=4)
                for row, c in zip(rows, coefs):
                    w, d = fmt.block(builder, row, b, hidden_v)
                    scale = c if d is None else builder.fmul(c, d, flags=FAST)
                    total = builder.fadd(total, builder.fmul(w, _splat(builder, scale), flags=FAST), flags=FAST)
                builder.store(total, optr, align=4)
            if not fmt.SCALED:
                with _tail(builder, hidden_v, nb) as (i, _):
                    optr = builder.gep(outp, [i])
                    total = builder.load(optr, align=4)
                    for row, c in zip(rows, coefs):
                        total = builder.fadd(total, builder.fmul(fmt.value(builder, row, i), c, flags=FAST),
                                             flags=FAST)
                    builder.store(total, optr, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return axpy4


MAX_TOKENS = 8  # token rows of dotn/axpyn: their accumulators live in one [8 x <32 x float>] array


def _row_major(builder, ptr, t, width, i):
    """&ptr[t * width + i] for a float pointer."""
    return builder.gep(ptr, [builder.add(builder.mul(t, width), i)])


def _make_dotn(fmt: ModuleType):
    @intrinsic
    def dotn(typingctx, data, o, hidden, xg, out):
        sig = types.void(data, o, hidden, xg, out)

        def codegen(context, builder, signature, args):
            data_v, o, hidden_v, xg_v, out_v = args
            row = builder.gep(_byte_ptr(context, builder, signature.args[0], data_v), [o])
            xp = builder.bitcast(_byte_ptr(context, builder, signature.args[3], xg_v), F32.as_pointer())
            outp = builder.bitcast(_byte_ptr(context, builder, signature.args[4], out_v), F32.as_pointer())
            n = context.make_array(signature.args[4])(context, builder, out_v).nitems
            accs = cgutils.alloca_once(builder, VF, size=MAX_TOKENS)  # [n] <32 x float>
            with cgutils.for_range(builder, n) as t:
                builder.store(ir.Constant(VF, [0.0] * LANES), builder.gep(accs, [t.index]))
            nb = builder.udiv(hidden_v, const(LANES))
            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                w = _scaled_block(builder, fmt, row, b, hidden_v)  # widened once for the n tokens
                with cgutils.for_range(builder, n) as t:
                    xptr = _row_major(builder, xp, t.index, hidden_v, builder.mul(b, const(LANES)))
                    xv = builder.load(builder.bitcast(xptr, VF.as_pointer()), align=4)
                    acc = builder.gep(accs, [t.index])
                    builder.store(builder.fadd(builder.load(acc), builder.fmul(w, xv, flags=FAST), flags=FAST), acc)
            with cgutils.for_range(builder, n) as t:
                builder.store(_reduce(builder, builder.load(builder.gep(accs, [t.index]))),
                              builder.gep(outp, [t.index]), align=4)
            if not fmt.SCALED:
                with _tail(builder, hidden_v, nb) as (i, _):
                    w = fmt.value(builder, row, i)
                    with cgutils.for_range(builder, n) as t:
                        optr = builder.gep(outp, [t.index])
                        xi = builder.load(_row_major(builder, xp, t.index, hidden_v, i), align=4)
                        builder.store(builder.fadd(builder.load(optr), builder.fmul(w, xi, flags=FAST), flags=FAST),
                                      optr, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return dotn


def _make_axpyn(fmt: ModuleType):
    @intrinsic
    def axpyn(typingctx, data, o, hidden, c, out):
        sig = types.void(data, o, hidden, c, out)

        def codegen(context, builder, signature, args):
            data_v, o, hidden_v, c_v, out_v = args
            row = builder.gep(_byte_ptr(context, builder, signature.args[0], data_v), [o])
            cp = builder.bitcast(_byte_ptr(context, builder, signature.args[3], c_v), F32.as_pointer())
            outp = builder.bitcast(_byte_ptr(context, builder, signature.args[4], out_v), F32.as_pointer())
            n = context.make_array(signature.args[3])(context, builder, c_v).nitems
            nb = builder.udiv(hidden_v, const(LANES))
            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                w, d = fmt.block(builder, row, b, hidden_v)
                with cgutils.for_range(builder, n) as t:
                    c = builder.load(builder.gep(cp, [t.index]), align=4)
                    scale = c if d is None else builder.fmul(c, d, flags=FAST)
                    optr = builder.bitcast(_row_major(builder, outp, t.index, hidden_v, builder.mul(b, const(LANES))),
                                           VF.as_pointer())
                    total = builder.fadd(builder.load(optr, align=4),
                                         builder.fmul(w, _splat(builder, scale), flags=FAST), flags=FAST)
                    builder.store(total, optr, align=4)
            if not fmt.SCALED:
                with _tail(builder, hidden_v, nb) as (i, _):
                    w = fmt.value(builder, row, i)
                    with cgutils.for_range(builder, n) as t:
                        c = builder.load(builder.gep(cp, [t.index]), align=4)
                        optr = _row_major(builder, outp, t.index, hidden_v, i)
                        builder.store(builder.fadd(builder.load(optr), builder.fmul(w, c, flags=FAST), flags=FAST),
                                      optr, align=4)
            return context.get_dummy_value()

        return sig, codegen

    return axpyn


def _make_decode(fmt: ModuleType):
    @intrinsic
    def decode(typingctx, data, o, hidden, out):
        sig = types.void(data, o, hidden, out)

        def codegen(context, builder, signature, args):
            data_v, o, hidden_v, out_v = args
            row = builder.gep(_byte_ptr(context, builder, signature.args[0], data_v), [o])
            outp = builder.bitcast(_byte_ptr(context, builder, signature.args[3], out_v), F32.as_pointer())
            nb = builder.udiv(hidden_v, const(LANES))
            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                optr = builder.bitcast(builder.gep(outp, [builder.mul(b, const(LANES))]), VF.as_pointer())
                builder.store(_scaled_block(builder, fmt, row, b, hidden_v), optr, align=4)
            if not fmt.SCALED:
                with _tail(builder, hidden_v, nb) as (i, _):
                    builder.store(fmt.value(builder, row, i), builder.gep(outp, [i]), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return decode


dot4_f32, dot4_bf16, dot4_q8, dot4_q4 = (_make_dot4(FORMATS[f]) for f in ("f32", "bf16", "q8", "q4"))
axpy4_f32, axpy4_bf16, axpy4_q8, axpy4_q4 = (_make_axpy4(FORMATS[f]) for f in ("f32", "bf16", "q8", "q4"))
decode_f32, decode_bf16, decode_q8, decode_q4 = (_make_decode(FORMATS[f]) for f in ("f32", "bf16", "q8", "q4"))
dotn_f32, dotn_bf16, dotn_q8, dotn_q4 = (_make_dotn(FORMATS[f]) for f in ("f32", "bf16", "q8", "q4"))
axpyn_f32, axpyn_bf16, axpyn_q8, axpyn_q4 = (_make_axpyn(FORMATS[f]) for f in ("f32", "bf16", "q8", "q4"))
