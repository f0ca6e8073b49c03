"""The integer loop for the formats in super-blocks of 256 with integer scales (Q4_K, Q5_K, Q6_K, IQ4_XS).

llama.cpp's form (ggml-quants' q4_K x q8_K): the activations are quantised per super-block (activations.py's
quantize_rows_super: xq int8, one scale xd per 256, bs the int16 sums of every 16), and a format's ``isuper``
gives a super-block of a row as integers, w = d sc q - dmin m: (d, dmin, [group per G weights], m, signed),
each group a function that emits its (q, sc) where the loop calls it,
G = idot.group_bytes() (32, or 64 where the lowering has 512-bit registers: q4k and q6k read two
groups at once, the others join two of 32), q unsigned below 64 (or, signed, int8 levels: IQ4_XS, idot.pairs'
sign trick), sc an integer per 16 values as <G / 2 x i16>, m an integer per 16 values as <16 x i16> (None,
and dmin None: no offset; the format's OFFSETS says which). Then per row and token, with W = 16 lanes where
the lowering has 512-bit registers (two groups a call), else 8

    acc <W x i32>    = sum over the 8 groups of scaled_add(pairs(q, xq), sc)      (idot.py: exact integers)
    mins <8 x i32>   = scaled_add(0, bs, m): the pairs of m * bs added             (exact integers)
    out <8 x float>  += float(acc, its halves added) * (d * xd) - float(mins) * (dmin * xd) once per super-block
    (no offset: out <W x float> += float(acc) * (d * xd))

so a token's float work per super-block is a conversion, a multiply and an add on one vector (two with offsets),
where the float loop (simd.py's dot2r4) spends two FMAs on every 32 weights and token and widens every weight; one
vector of float sums per row and token leaves the registers to the integer groups. One row by four or eight tokens
at a time: each super-block's integers read once for the tokens. (Two rows by four, as dot2r4, keep more vectors
live than the registers hold.)

    dot1r4s(ks, fmt, data, o, row_step, hidden, xq, xd, bs, t0, out, col)      (dot1r8s, 1r3s, 1r2s: t < 8, 3, 2)
        out[t0 + t, col] = x'[t0 + t] . the row at byte o, t < 4, with x' = xd (.) xq the quantised
        activations [n, hidden] (hidden a multiple of 256); fmt a SUPER_FORMATS format's FORMATS index;
        row_step the bytes to the next row (prefetched ahead)
    dot4r1s(ks, fmt, data, o, row_step, hidden, xq, xd, bs, t0, out, col)
        decode's tile: out[t0, col + j] = x'[t0] . the row at byte o + j row_step, j < 4 (the token's
        integers loaded once for the four rows)

The groups' sums go through idot.kept after each group, so LLVM keeps the loop group by group (every
token's accumulator, then the next group's weights): left alone it makes each token's chain over the eight
groups a tree, token by token, with all eight groups' weights and scales live, and spills them. A group's
weights are emitted where the group is used (the formats' lazy groups), in the format's GROUP_ORDER: emitted
with the super-block's scales first, the scheduler kept the order and unpacked all 32 groups of a decode
tile before the first product, and spilled them (docs/benchmarks.md has the counts). Q4_K and Q5_K read
their nibbles up front all the same (q4k.int_scales says why).

Decode takes the same form as llama.cpp does for these types (its q8_K activations): it does less float
work per row than isimd.py's per-32 loop (a conversion, a scale and a float add per 32 weights and row).
Four rows at a time: tiles of two or of eight rows are no faster.
"""

from __future__ import annotations

from types import ModuleType

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from shm.formats.traits import SUPER_INT_LOOPS

from . import idot
from .ir import F32, I8, I16, I32, const, splat
from .loops import FORMATS, byte_ptr, per_format, prefetch_tile, reduce_sum, register_loop, tile
from .simd import FAST

SUPER_FORMATS: dict[str, ModuleType] = {name: FORMATS[name] for name in SUPER_INT_LOOPS}  # traits' "super"
SUPER = 256
V8I = ir.VectorType(I32, 8)
V16S = ir.VectorType(I16, 16)


def _halves_added(builder, v):
    """<8 x i32>: v itself, or v[k] + v[k + 8] of a <16 x i32>."""
    if v.type.count == 8:
        return v
    lo = builder.shuffle_vector(v, v, ir.Constant(V8I, list(range(8))))
    hi = builder.shuffle_vector(v, v, ir.Constant(V8I, list(range(8, 16))))
    return builder.add(lo, hi)


def _emit(builder, fmt, rows, row_step, x, hidden_v, tok, dests) -> None:
    xq, xd, bs = x
    NR, NT = len(rows), len(tok)
    G = idot.group_bytes()  # weights per pairs/scaled_add: one group of 32, or two side by side
    supers = builder.udiv(hidden_v, const(SUPER))

    W = G // 4  # lanes of the integer sums
    A = 8 if fmt.OFFSETS else W  # lanes of the float sums: with offsets, the integer sums' halves added
    VA = ir.VectorType(F32, A)

    def step(s, accs):  # accs [NT * NR] <A x float>, token-major
        prefetch_tile(builder, fmt, rows, s, row_step)
        blocks = [fmt.isuper(builder, row, s, G) for row in rows]  # each row's super-block once for the tokens
        firsts = [builder.add(builder.mul(t, hidden_v), builder.mul(s, const(SUPER))) for t in tok]
        ints = [ir.Constant(ir.VectorType(I32, W), [0] * W)] * (NT * NR)  # token-major, as accs
        count = len(blocks[0][2])
        for j in (fmt.GROUP_ORDER if count == len(fmt.GROUP_ORDER) else range(count)):  # group by group (of G
            # weights): only its integers live; in the order that reads each of the format's runs in adjacent groups
            xvs = [builder.load(builder.bitcast(builder.gep(xq, [builder.add(first, const(G * j))]),
                                                ir.VectorType(I8, G).as_pointer()), align=1) for first in firsts]
            groups = [b[2][j]() for b in blocks]  # per row: (q, sc), emitted here, where the group is used
            ints = idot.kept(builder, [idot.scaled_add(builder, ints[t * NR + r], idot.pairs(
                builder, groups[r][0], xvs[t], blocks[r][4]), groups[r][1])
                for t in range(NT) for r in range(NR)])  # group by group (idot.kept)
        out = []
        for t in range(NT):
            at = builder.add(builder.mul(tok[t], supers), s)  # the token's super-block s
            dx = builder.load(builder.gep(xd, [at]), align=4)
            sums = builder.load(builder.bitcast(builder.gep(bs, [builder.mul(at, const(16))]), V16S.as_pointer()),
                                align=2) if fmt.OFFSETS else None  # its 16 sums of 16
            for r, (d, dmin, _, m, _) in enumerate(blocks):
                scaled = lambda v, w: builder.fmul(builder.sitofp(v, VA), splat(  # noqa: E731
                    builder, builder.fmul(w, dx, flags=FAST), VA), flags=FAST)
                acc = builder.fadd(accs[t * NR + r], scaled(_halves_added(builder, ints[t * NR + r]) if fmt.OFFSETS
                                                            else ints[t * NR + r], d), flags=FAST)
                if fmt.OFFSETS:  # less dmin times the pairs of m * bs
                    offs = idot.scaled_add(builder, ir.Constant(V8I, [0] * 8), sums, m)
                    acc = builder.fsub(acc, scaled(offs, dmin), flags=FAST)
                out.append(acc)
        return out

    zero = ir.Constant(VA, [0.0] * A)
    flat = register_loop(builder, supers, [zero] * (len(tok) * NR), step)
    for k, dest in enumerate(d for per_t in dests for d in per_t):
        builder.store(reduce_sum(builder, flat[k]), dest, align=4)


def _make(NR: int, NT: int):
    @intrinsic
    def dotk(typingctx, kernels, fmt, data, o, row_step, hidden, xq, xd, bs, t0, out, col):
        sig = types.void(kernels, fmt, data, o, row_step, hidden, xq, xd, bs, t0, out, col)

        def codegen(context, builder, signature, args):
            fmt_v, data_v, o, row_step, hidden_v, xq_v, xd_v, bs_v, t0, out_v, col = args[1:]
            rows, tok, dests = tile(context, builder, (signature.args[2], data_v), o, row_step,
                                     (signature.args[10], out_v), t0, col, NR, NT)
            xq = byte_ptr(context, builder, signature.args[6], xq_v)
            xd = builder.bitcast(byte_ptr(context, builder, signature.args[7], xd_v), F32.as_pointer())
            bs = builder.bitcast(byte_ptr(context, builder, signature.args[8], bs_v), I16.as_pointer())
            per_format(context, builder, signature.args[0], signature.args[1], fmt_v,
                        lambda m: _emit(builder, m, rows, row_step, (xq, xd, bs), hidden_v, tok, dests), SUPER_FORMATS,
                        True)
            return context.get_dummy_value()

        return sig, codegen

    return dotk


dot1r2s, dot1r3s, dot1r4s, dot1r8s, dot4r1s = _make(1, 2), _make(1, 3), _make(1, 4), _make(1, 8), _make(4, 1)
