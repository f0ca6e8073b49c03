"""q8 rows interleaved eight at a time (llama.cpp's repacked Q8_0, ggml-cpu/repack.cpp): the dense matrices' loop.

Row-major q8 rows (q8.py) give each (row, token) pair of a tile its own integer sums, converted, scaled and
added in float once per block of 32: three float operations per 32 products, a large share of iblock.py's
prefill loop. Interleaved, a vector's eight 32-bit lanes are
eight rows: one conversion, one multiply and one FMA serve eight rows' block, and the eight rows' results
come out as one vector, stored whole.

    a group of 8 rows (R a multiple of 8) of K weights, nb = K / 32 blocks, GROUP_BYTES = 272 a block:
      group g, block b at byte (g nb + b) 272:
        bytes [32 k, 32 k + 32), k < 8   the block's values [4 k, 4 k + 4) of rows 0..7, row r at 32 k + 4 r
        bytes [256, 272)                 the 8 rows' float16 scales d[b], row r at 256 + 2 r
      row r's block b = d * int8 values: the same numbers as q8.py's row (the same bytes, reordered)

Per group, block b and token t (x' = xd (.) xq, quantised per block of 32: activations.quantize_rows):

    ints <8 x i32>   = sum over k < 8 of idot.dot(values k, xq[t, 32 b + 4 k .. + 4] in every lane)
    acc <8 x float>  = acc + float(ints) * (d <8 x float> * xd[t, b])        (idot.scaled_blocks)

which is eight rows' x' . w, each row's blocks added in the one order isimd.py's decode rows and iblock.py's
tiles take: a row's bits are the same in any of the three loops. Two tokens at a time: by four the accumulators no longer fit AVX2's registers.

The dense matrices (coordinator/host/packed.py) are stored this way. The experts stay row-major in the
store (its views, the device experts and the GGUF copies read them so): rows.py interleaves each eight rows of
a prefill group's matrices on the fly into a scratch that stays in L1 (interleave8: eight 32-byte loads, an
8 x 8 transpose of 32-bit lanes, the next eight rows prefetched), then runs the same loop over the group's
tokens, which still beats iblock's loop for a group of rows.GROUPED_FROM tokens or more.

    interleave(rows [R, row_bytes] uint8, K) -> [R / 8 nb 272] uint8    q8.py's rows as groups (numpy)
    rows_of(groups, R, K) -> [R, row_bytes] uint8                       the inverse
    matmul_groups(ks, data, R, K, x, out)
                                         out [T, R] = x [T, K] . W^T: the groups split over numba's threads,
                                         two tokens at a time (one for an odd last)
    dot8r2 / dot8r1(ks, data, o, hidden, xq, xd, t0, out, col)
                                         out[t0 + t, col:col + 8] <- the group at byte o . token t0 + t
    interleave8(ks, fmt, data, o, row_step, hidden, groups)
                                         groups <- the eight rows at byte o, row_step apart, of q8 or q4 (fmt
                                         its FORMATS index), interleaved: q4's values as unsigned bytes
    dot8u2 / dot8u1(ks, data, o, hidden, xq, xd, xsum, t0, out, col)
                                         the same for a group of unsigned values u = q + OFFSET (q4's)
    rows_by_eight(ks, fmt, data, o, row_bytes, rows, hidden, xq, xd, xsum, out, n)
                                         out[:n, :rows] <- the tokens . row-major q8 or q4 rows (an expert's
                                         matrix in a prefill group): each eight rows interleaved on the fly
    matmul_rows_by_eight(ks, fmt, data, row_bytes, R, K, x, out)
                                         out [T, R] = x . W^T for row-major q8 or q4 rows (a dense q4 matrix),
                                         the groups split over numba's threads

q4's values (a format of SPAN <= OFFSET: q in [-8, 7]) go in unsigned, u = q + 8 in [0, 15], and the loop
takes them without the sign trick (idot.unsigned_and_signed's two instructions per four bytes and token):

    pairs <16 x i16> = sum over k < 8 of idot.pairs(values k, xq[t, 32 b + 4 k .. + 4] in every lane)
                       (no saturation: 8 x 2 x 15 x 127 = 30480 < 32767)
    ints <8 x i32>   = pairs' lanes added two by two (vpmaddwd by ones) - 8 xsum[t, b]

xsum [n, nb] int32 the sums of each block's quantised activations (activations.quantize_rows_summed, which
counts them as it quantises): ints are the same integers
as the signed values give, so the same bits come out. Per four bytes and token that is a broadcast, one
vpmaddubsw and an add in place of the signed values' five instructions (vpabsb, vpsignb, vpmaddubsw, vpmaddwd,
an add), and one vpmaddwd a block. A dense q4 matrix (rows of a safetensors
checkpoint stored as --dense-dtype q4, a Q4_0 file's) takes the same way from rows.GROUPED_FROM tokens on,
interleaved on the fly (matmul_rows_by_eight), in place of iblock's loop and of BLAS from 48 tokens on.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from . import idot
from .activations import quantize_rows_summed
from .common import JIT, serial_twin
from .ir import F32, I8, I16, I32, const, prefetch, splat
from .isimd import BLOCK_FORMATS
from .loops import FORMATS, byte_ptr, per_format, register_loop

GROUP_ROWS = 8
GROUP_BYTES = 272  # a block of 8 rows: 8 x 32 values, 8 float16 scales
PREFETCH_BLOCKS = 8  # the group's stream this many blocks ahead (2176 bytes)
VW, VI, V32 = ir.VectorType(F32, 8), ir.VectorType(I32, 8), ir.VectorType(I8, 32)
OFFSET = 8  # a format of SPAN <= OFFSET (q4) goes in as u = q + OFFSET, unsigned (the module docstring)


def unsigned(fmt) -> bool:
    """Whether a BLOCK_FORMATS format's values go into the groups unsigned (q + OFFSET, below 16)."""
    return fmt.SPAN <= OFFSET


UNSIGNED = np.array([name in BLOCK_FORMATS and unsigned(m) for name, m in FORMATS.items()])  # by FORMATS index


def interleave(rows: np.ndarray, K: int, out: np.ndarray | None = None) -> np.ndarray:
    """q8 rows [R, row_bytes] (K int8 values, then K / 32 float16 scales) -> the groups' bytes [R / 8 nb 272],
    written into ``out`` (as many bytes, uint8) when given."""
    R, nb = rows.shape[0], K // 32
    values = rows[:, :K].reshape(R // 8, 8, nb, 8, 4).transpose(0, 2, 3, 1, 4).reshape(R // 8, nb, 256)  # [g, b, k r 4]
    scales = rows[:, K:K + 2 * nb].reshape(R // 8, 8, nb, 2).transpose(0, 2, 1, 3).reshape(R // 8, nb, 16)
    if out is None:
        out = np.empty(R * nb * GROUP_BYTES // 8, np.uint8)
    np.concatenate([values, scales], axis=2, out=out.reshape(R // 8, nb, GROUP_BYTES))
    return out


def rows_of(groups: np.ndarray, R: int, K: int) -> np.ndarray:
    """The inverse of interleave: q8 rows [R, K + K / 16] uint8."""
    nb = K // 32
    g = groups.reshape(R // 8, nb, GROUP_BYTES)
    values = g[:, :, :256].reshape(R // 8, nb, 8, 8, 4).transpose(0, 3, 1, 2, 4).reshape(R, K)
    scales = g[:, :, 256:].reshape(R // 8, nb, 8, 2).transpose(0, 2, 1, 3).reshape(R, 2 * nb)
    return np.ascontiguousarray(np.concatenate([values, scales], axis=1))


def _emit(builder, group, xq, xd, xsum, hidden_v, tok, accs_out) -> None:
    """accs_out [NT] <- <8 x float> the group's eight rows . token tok[t]'s quantised row; xsum (an i32 pointer
    to the activations' block sums) None for signed values, else the values are unsigned, q + OFFSET."""
    how = idot.host_lowering()
    nb = builder.udiv(hidden_v, const(32))
    rows_x = [builder.mul(t, hidden_v) for t in tok]  # each token's first value in xq
    rows_d = [builder.mul(t, nb) for t in tok]

    def step(b, accs):
        block = builder.gep(group, [builder.mul(b, const(GROUP_BYTES))])
        for line in range(-(-GROUP_BYTES // 64)):
            prefetch(builder, builder.gep(block, [const(PREFETCH_BLOCKS * GROUP_BYTES + 64 * line)]))
        halves = builder.load(builder.bitcast(builder.gep(block, [const(256)]), ir.VectorType(I16, 8).as_pointer()),
                              align=2)
        d = builder.fpext(builder.bitcast(halves, ir.VectorType(ir.HalfType(), 8)), VW)  # [8 rows]
        ints = [ir.Constant(VI, [0] * 8)] * len(tok)
        pairs = [None] * len(tok)  # unsigned values: <16 x i16> sums of the block's pairs
        first = builder.mul(b, const(32))
        for k in range(8):
            w = builder.load(builder.bitcast(builder.gep(block, [const(32 * k)]), V32.as_pointer()), align=1)
            for t, at in enumerate(rows_x):
                four = builder.gep(xq, [builder.add(at, builder.add(first, const(4 * k)))])
                xb = builder.bitcast(splat(builder, builder.load(builder.bitcast(four, I32.as_pointer()), align=1),
                                           VI), V32)
                if xsum is None:
                    ints[t] = builder.add(ints[t], idot.dot(builder, w, xb, True, how))
                else:
                    p = idot.pairs(builder, w, xb, False, how)
                    pairs[t] = p if pairs[t] is None else builder.add(pairs[t], p)
        if xsum is not None:  # the pairs added two by two, less OFFSET times the block's activations' sum
            ones = ir.Constant(ir.VectorType(I16, 16), [1] * 16)
            for t, at in enumerate(rows_d):
                total = builder.load(builder.gep(xsum, [builder.add(at, b)]), align=4)
                ints[t] = builder.sub(idot.scaled_add(builder, ints[t], pairs[t], ones, how),
                                      splat(builder, builder.mul(total, ir.Constant(I32, OFFSET)), VI))
        out = []
        for t, at in enumerate(rows_d):
            dx = builder.load(builder.gep(xd, [builder.add(at, b)]), align=4)
            out.append(idot.scaled_blocks(builder, accs[t], ints[t], d, splat(builder, dx, VW)))
        return out

    zero = ir.Constant(VW, [0.0] * 8)
    for dest, total in zip(accs_out, register_loop(builder, nb, [zero] * len(tok), step)):
        builder.store(total, builder.bitcast(dest, VW.as_pointer()), align=4)


def compiled(kernels) -> bool:
    """Whether a kernel set (a KernelSetType) holds this loop: q8's or q4's integer loop."""
    return any(kernels.emits(name, integer=True) for name in BLOCK_FORMATS)


def _codegen(NT: int, with_sums: bool):
    def codegen(context, builder, signature, args):
        if not compiled(signature.args[0]):
            return context.get_dummy_value()
        types_, args = signature.args[1:], args[1:]
        data_v, o, hidden_v, xq_v, xd_v = args[:5]
        t0, out_v, col = args[-3:]
        group = builder.gep(byte_ptr(context, builder, types_[0], data_v), [o])
        xq = byte_ptr(context, builder, types_[3], xq_v)
        xd = builder.bitcast(byte_ptr(context, builder, types_[4], xd_v), F32.as_pointer())
        xsum = builder.bitcast(byte_ptr(context, builder, types_[5], args[5]), I32.as_pointer()) \
            if with_sums else None
        outa = context.make_array(types_[-2])(context, builder, out_v)
        outp = builder.bitcast(outa.data, F32.as_pointer())
        width = builder.extract_value(outa.shape, 1)
        tok = [builder.add(t0, const(t)) for t in range(NT)]
        dests = [builder.gep(outp, [builder.add(builder.mul(t, width), col)]) for t in tok]
        _emit(builder, group, xq, xd, xsum, hidden_v, tok, dests)
        return context.get_dummy_value()

    return codegen


def _make(NT: int):
    @intrinsic
    def dot8(typingctx, kernels, data, o, hidden, xq, xd, t0, out, col):
        """out[t0 + t, col:col + 8] <- the group at byte o . token t0 + t's quantised row, t < NT (nothing where the
        kernel set has neither q8's nor q4's integer loop)."""
        return types.void(kernels, data, o, hidden, xq, xd, t0, out, col), _codegen(NT, False)

    return dot8


def _make_unsigned(NT: int):
    @intrinsic
    def dot8u(typingctx, kernels, data, o, hidden, xq, xd, xsum, t0, out, col):
        """The same for a group of unsigned values (q + OFFSET), xsum [n, nb] int32 the activations' block sums."""
        return types.void(kernels, data, o, hidden, xq, xd, xsum, t0, out, col), _codegen(NT, True)

    return dot8u


dot8r1, dot8r2 = _make(1), _make(2)
dot8u1, dot8u2 = _make_unsigned(1), _make_unsigned(2)


def _transpose8(builder, vecs):
    """The 8 x 8 matrix of 32-bit lanes [vecs[r] lane k] transposed: out[k] lane r = vecs[r] lane k."""
    m = list(vecs)
    for width in (1, 2, 4):  # swap the off-diagonal blocks of width x width lanes, pairs of vectors width apart
        out = list(m)
        for r in range(8):
            if r & width:
                continue
            a, b = m[r], m[r + width]
            lo = [k if not k & width else k - width + 8 for k in range(8)]  # a's lanes with k & width clear
            hi = [k + width if not k & width else k + 8 for k in range(8)]
            out[r] = builder.shuffle_vector(a, b, ir.Constant(VI, lo))
            out[r + width] = builder.shuffle_vector(a, b, ir.Constant(VI, hi))
        m = out
    return m


def _interleave_rows(builder, fmt, rows, row_step, hidden_v, dest) -> None:
    """dest <- the eight rows of a BLOCK_FORMATS format (its ``iblocks``: a block's 32 signed values and float
    scale) as a group of the layout above: q8's bytes as they are, q4's nibbles as bytes (q + OFFSET)."""
    ahead = builder.mul(row_step, const(GROUP_ROWS))

    def step(b, carried):
        block = builder.gep(dest, [builder.mul(b, const(GROUP_BYTES))])
        at = builder.add(ahead, builder.mul(b, const(fmt.BLOCK_BYTES)))  # the next group's rows, values and scales
        for row in rows:
            prefetch(builder, builder.gep(row, [at]))
        values, scales = zip(*(fmt.iblocks(builder, row, b, hidden_v, 32) for row in rows))
        if unsigned(fmt):
            values = [builder.add(v, ir.Constant(V32, [OFFSET] * 32)) for v in values]
        for k, vec in enumerate(_transpose8(builder, [builder.bitcast(v, VI) for v in values])):
            builder.store(vec, builder.bitcast(builder.gep(block, [const(32 * k)]), VI.as_pointer()), align=1)
        halves = builder.bitcast(builder.gep(block, [const(256)]), ir.HalfType().as_pointer())
        for r, (d,) in enumerate(scales):  # float16 scales widened by iblocks: narrowed back exactly
            builder.store(builder.fptrunc(d, ir.HalfType()), builder.gep(halves, [const(r)]), align=1)
        return carried

    register_loop(builder, builder.udiv(hidden_v, const(32)), [], step)


@intrinsic
def interleave8(typingctx, kernels, fmt, data, o, row_step, hidden, groups):
    """groups [nb 272] uint8 <- the 8 rows at byte o of data, row_step apart, in a BLOCK_FORMATS format (q8, q4:
    fmt its FORMATS index), interleaved as the layout above (q4's values unsigned, q + OFFSET)."""
    sig = types.void(kernels, fmt, data, o, row_step, hidden, groups)

    def codegen(context, builder, signature, args):
        fmt_v, data_v, o, row_step, hidden_v, groups_v = args[1:]
        base = byte_ptr(context, builder, signature.args[2], data_v)
        rows = [builder.gep(base, [builder.add(o, builder.mul(row_step, const(r)))]) for r in range(8)]
        dest = byte_ptr(context, builder, signature.args[6], groups_v)
        per_format(context, builder, signature.args[0], signature.args[1], fmt_v,
                    lambda m: _interleave_rows(builder, m, rows, row_step, hidden_v, dest), BLOCK_FORMATS)
        return context.get_dummy_value()

    return sig, codegen


@njit(inline="always", **JIT)
def group_tokens(ks, data, o, hidden, xq, xd, n, out, col) -> None:
    """out[:n, col:col + 8] <- the group at byte o . the n tokens of xq, xd: two at a time, one for an odd last."""
    for t0 in range(0, n - 1, 2):
        dot8r2(ks, data, o, hidden, xq, xd, t0, out, col)
    if n % 2 == 1:
        dot8r1(ks, data, o, hidden, xq, xd, n - 1, out, col)


@njit(inline="always", **JIT)
def group_tokens_unsigned(ks, data, o, hidden, xq, xd, xsum, n, out, col) -> None:
    """group_tokens for a group of unsigned values (q + OFFSET), xsum the activations' block sums."""
    for t0 in range(0, n - 1, 2):
        dot8u2(ks, data, o, hidden, xq, xd, xsum, t0, out, col)
    if n % 2 == 1:
        dot8u1(ks, data, o, hidden, xq, xd, xsum, n - 1, out, col)


@njit(inline="always", **JIT)
def rows_by_eight(ks, fmt, data, o, row_bytes, rows, hidden, xq, xd, xsum, out, n) -> None:
    """out[:n, :rows] <- the n tokens of xq, xd, xsum (quantize_rows_summed) . the q8 or q4 rows from byte o (rows
    a multiple of 8): each eight rows interleaved into a scratch in L1 (interleave8), then two tokens at a time
    (one for an odd last)."""
    scratch = np.empty((hidden // 32) * GROUP_BYTES, np.uint8)
    for g in range(rows // GROUP_ROWS):
        interleave8(ks, fmt, data, o + g * GROUP_ROWS * row_bytes, row_bytes, hidden, scratch)
        if UNSIGNED[fmt]:
            group_tokens_unsigned(ks, scratch, 0, hidden, xq, xd, xsum, n, out, g * GROUP_ROWS)
        else:
            group_tokens(ks, scratch, 0, hidden, xq, xd, n, out, g * GROUP_ROWS)


@njit(parallel=True, **JIT)
def matmul_rows_by_eight(ks, fmt, data, row_bytes, R, K, x, out):
    """out [T, R] = x [T, K] . W^T, W's R rows (a multiple of 8) row-major q8 or q4 rows: the groups of eight rows
    split over numba's threads, each interleaved on the fly."""
    xq, xd, xsum = quantize_rows_summed(x)
    for g in prange(R // GROUP_ROWS):
        scratch = np.empty((K // 32) * GROUP_BYTES, np.uint8)
        interleave8(ks, fmt, data, g * GROUP_ROWS * row_bytes, row_bytes, K, scratch)
        if UNSIGNED[fmt]:
            group_tokens_unsigned(ks, scratch, 0, K, xq, xd, xsum, x.shape[0], out, g * GROUP_ROWS)
        else:
            group_tokens(ks, scratch, 0, K, xq, xd, x.shape[0], out, g * GROUP_ROWS)


@njit(parallel=True, **JIT)
def matmul_groups(ks, data, R, K, x, out):
    xq, xd, _ = quantize_rows_summed(x)  # [T, K] once for every group
    group_bytes = (K // 32) * GROUP_BYTES
    for g in prange(R // GROUP_ROWS):
        group_tokens(ks, data, g * group_bytes, K, xq, xd, x.shape[0], out, g * GROUP_ROWS)


matmul_groups_serial = serial_twin(matmul_groups, "matmul_groups_serial")  # on the calling thread (dense.SERIAL)


def warm_up(ks) -> None:
    """Compile (or load from the disk cache) the loops a kernel set ``ks`` (kernel_set.KernelSet) takes here,
    before the first request: q8 matrices interleaved (matmul_groups), q8 or q4 ones interleaved on the fly."""
    if not any(name in ks for name in BLOCK_FORMATS) or not ks.int_act:
        return
    for loop in (matmul_groups, matmul_groups_serial):
        loop(ks, np.zeros(GROUP_BYTES, np.uint8), 8, 32, np.zeros((3, 32), np.float32), np.zeros((3, 8), np.float32))
    fmt = next(name for name in BLOCK_FORMATS if name in ks)
    matmul_rows_by_eight(ks, list(FORMATS).index(fmt), np.zeros(8 * FORMATS[fmt].BLOCK_BYTES, np.uint8),
                         FORMATS[fmt].BLOCK_BYTES, 8, 32, np.zeros((3, 32), np.float32), np.zeros((3, 8), np.float32))
