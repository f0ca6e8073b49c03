"""Integer dot products on quantised activations: per block of 32 for Q8_0 and Q4_0 in decode (activations.py,
idot.py, isimd.py), per super-block of 256 for the K types and IQ4_XS (isuper.py). The quantisers against their NumPy
forms, every lowering of the integer sums against exact integers, and the node's and the dense matrices'
results against float64 on the dequantised weights and the quantised activations."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from coordinator.config import EngineConfig
from coordinator.errors import ConfigValueError
from coordinator.host.packed import BLOCK_INT_TOKENS, PackedMatrix
from node_worker.kernels import idot
from node_worker.kernels.activations import (quantize_reference, quantize_rows_summed,
                                             quantize_rows_super, quantize_super_reference)
from node_worker.worker import NodeWorker
from shm import formats
from shm.expert_source import ExpertSlice
from shm.expert_store import HeapExpertStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from kernel_bench import stored_rows  # noqa: E402  (random rows of a format: encoded, or a GGUF type's blocks)

INT_FORMATS = ["q8", "q4", "q4k", "q5k", "q6k", "iq4xs"]
SUPER_FORMATS = ["q4k", "q5k", "q6k", "iq4xs"]  # the super-block integer loop (isuper.py)
H, R = 512, 256  # two super-blocks of 256 along a row; down's rows [H, R] one


def activations(rng, n: int, K: int) -> np.ndarray:
    x = rng.standard_normal((n, K)).astype(np.float32)
    x[0, :32] = 0.0  # a block of zeros: scale 0
    x[0, 40] = 50.0  # an outlier sets its block's scale
    x[-1, 64:96] = np.linspace(-1, 1, 32)  # values on the rounding steps' halves
    return x


def dequantised(x: np.ndarray) -> np.ndarray:
    """float64 of xd * xq, the activations as the integer kernels see them."""
    xq, xd, _ = quantize_reference(np.asarray(x, np.float32))
    n, K = x.shape
    return (xq.reshape(n, K // 32, 32) * xd[..., None].astype(np.float64)).reshape(n, K)


def dequantised_super(x: np.ndarray) -> np.ndarray:
    """float64 of xd * xq quantised per super-block, the activations as the super-block loop sees them."""
    xq, xd, _ = quantize_super_reference(np.asarray(x, np.float32))
    n, K = x.shape
    return (xq.reshape(n, K // 256, 256) * xd[..., None].astype(np.float64)).reshape(n, K)


def test_super_block_activations_are_the_numpy_form_and_within_half_a_step():
    x = activations(np.random.default_rng(2), 5, 512)
    x[1, 256:] = 0.0  # a super-block of zeros: scale 0
    got, want = quantize_rows_super(x), quantize_super_reference(x)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and np.array_equal(g, w)
    xq, xd, bs = got
    assert np.abs(xq).max() == 127 and not xq[1, 256:].any() and xd[1, 1] == 0
    assert np.all(np.abs(x - dequantised_super(x)) <= np.repeat(xd, 256, axis=1) / 2 * (1 + 1e-6))
    assert bs.dtype == np.int16 and np.array_equal(bs, xq.reshape(5, 32, 16).astype(np.int64).sum(axis=2))


def test_quantised_activations_are_the_numpy_form_and_within_half_a_step():
    x = activations(np.random.default_rng(0), 5, 256)
    got, want = quantize_rows_summed(x), quantize_reference(x)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and np.array_equal(g, w)
    xq, xd, sums = got
    assert np.abs(xq).max() == 127 and not xq[0, :32].any() and xd[0, 0] == 0
    step = np.repeat(xd, 32, axis=1)
    assert np.all(np.abs(x - dequantised(x)) <= step / 2 * (1 + 1e-6))
    assert sums.dtype == np.int32 and np.array_equal(sums, xq.reshape(5, 8, 32).astype(np.int64).sum(axis=2))


@pytest.mark.parametrize("lowering", idot.LOWERINGS)
@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
def test_every_lowering_sums_the_products_exactly(lowering, signed):
    """The kernels compile only the host's lowering; each is compiled here on its own and checked on the
    extremes (q = -128 signed, 128 unsigned: the largest the AVX2 pairs take without saturating)."""
    from llvmlite import ir
    from numba import njit, types
    from numba.extending import intrinsic

    from node_worker.kernels.ir import I8, I32, LANES

    if not idot.host_has(lowering):
        pytest.skip(f"no {lowering} on this host")
    V32 = ir.VectorType(I8, LANES)

    @intrinsic
    def dot(typingctx, q, x, out):
        def codegen(context, builder, sig, args):
            q_p, x_p, o_p = (context.make_array(t)(context, builder, a).data for t, a in zip(sig.args, args))
            load = lambda p: builder.load(builder.bitcast(p, V32.as_pointer()), align=1)  # noqa: E731
            got = idot.dot(builder, load(q_p), load(x_p), signed, lowering)
            builder.store(got, builder.bitcast(o_p, ir.VectorType(I32, 8).as_pointer()), align=1)
            return context.get_dummy_value()

        return types.void(q, x, out), codegen

    @njit
    def run(q, x, out):
        dot(q, x, out)

    rng = np.random.default_rng(1)
    for trial in range(20):
        q = rng.integers(-128, 128, 32) if signed else rng.integers(0, 129, 32)
        x = rng.integers(-127, 128, 32)
        if trial == 0:  # the extremes
            q[:] = -128 if signed else 128
            x[::2], x[1::2] = 127, -127
        if trial == 1:
            q[:], x[:] = (-128 if signed else 128), -127
        out = np.zeros(8, np.int32)
        run(q.astype(np.int8 if signed else np.uint8).view(np.int8), x.astype(np.int8), out)
        assert out.tolist() == (q * x).reshape(8, 4).sum(axis=1).tolist()


@pytest.mark.parametrize("lowering", idot.LOWERINGS)
def test_every_lowering_of_the_biased_sums_is_exact(lowering):
    """idot.biased (iblock.py's prefill: unsigned activations q + 128 times signed weights, four by four into
    int32, added to a start) at the lowering's width, against exact integers: the extremes u = 255 with s = -128
    and 127 (|s| <= 63 on avx2, whose int16 pairs would saturate beyond: iblock takes the sign trick there)."""
    from llvmlite import ir
    from numba import njit, types
    from numba.extending import intrinsic

    from node_worker.kernels.ir import I8, I32

    if not idot.host_has(lowering):
        pytest.skip(f"no {lowering} on this host")
    n = idot.group_bytes(lowering)
    VB, VA = ir.VectorType(I8, n), ir.VectorType(I32, n // 4)

    @intrinsic
    def biased(typingctx, u, s, acc, out):
        def codegen(context, builder, sig, args):
            u_p, s_p, a_p, o_p = (context.make_array(t)(context, builder, a).data for t, a in zip(sig.args, args))
            load = lambda p, t: builder.load(builder.bitcast(p, t.as_pointer()), align=1)  # noqa: E731
            got = idot.biased(builder, load(a_p, VA), load(u_p, VB), load(s_p, VB), lowering)
            builder.store(got, builder.bitcast(o_p, VA.as_pointer()), align=1)
            return context.get_dummy_value()

        return types.void(u, s, acc, out), codegen

    @njit
    def run(u, s, acc, out):
        biased(u, s, acc, out)

    rng = np.random.default_rng(4)
    top = 63 if lowering == "avx2" else 127
    for trial in range(20):
        u, s = rng.integers(0, 256, n), rng.integers(-top - (lowering != "avx2"), top + 1, n)
        acc = rng.integers(-2**28, 2**28, n // 4)
        if trial == 0:
            u[:], s[::2], s[1::2] = 255, -top - (lowering != "avx2"), top
        if trial == 1:
            u[:], s[:] = 255, -top - (lowering != "avx2")
        out = np.zeros(n // 4, np.int32)
        run(u.astype(np.uint8), s.astype(np.int8), acc.astype(np.int32), out)
        assert out.tolist() == (acc + (u * s).reshape(n // 4, 4).sum(axis=1)).tolist()


@pytest.mark.parametrize("lowering", idot.LOWERINGS)
@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
def test_every_lowering_of_the_scaled_pair_sums_is_exact(lowering, signed):
    """pairs (q unsigned below 64, or signed int8, times int8) and scaled_add (times int16 scales, into
    int32), each lowering compiled on its own at its width (two groups side by side on vnni512, built with
    idot.joined), against exact integers, the extremes included."""
    from llvmlite import ir
    from numba import njit, types
    from numba.extending import intrinsic

    from node_worker.kernels.ir import I8, I16, I32, LANES

    if not idot.host_has(lowering):
        pytest.skip(f"no {lowering} on this host")
    n = idot.group_bytes(lowering)
    V32, V16, V8 = ir.VectorType(I8, LANES), ir.VectorType(I16, 16), ir.VectorType(I32, n // 4)

    @intrinsic
    def scaled(typingctx, q, x, sc, acc, out):
        def codegen(context, builder, sig, args):
            q_p, x_p, s_p, a_p, o_p = (context.make_array(t)(context, builder, a).data for t, a in zip(sig.args, args))

            def load(p, t, k: int = 0):  # group k of a vector array
                return builder.load(builder.bitcast(builder.gep(p, [ir.Constant(I32, k * t.count)]),
                                                    t.as_pointer()), align=1)

            def side_by_side(p, t):
                return load(p, t) if n == LANES else idot.joined(builder, load(p, t), load(p, t, 1))

            pairs = idot.pairs(builder, side_by_side(q_p, V32), side_by_side(x_p, V32), signed, lowering)
            got = idot.scaled_add(builder, load(a_p, V8), pairs, side_by_side(s_p, V16), lowering)
            builder.store(got, builder.bitcast(o_p, V8.as_pointer()), align=1)
            return context.get_dummy_value()

        return types.void(q, x, sc, acc, out), codegen

    @njit
    def run(q, x, sc, acc, out):
        scaled(q, x, sc, acc, out)

    rng = np.random.default_rng(3)
    for trial in range(20):
        q = rng.integers(-128, 128, n) if signed else rng.integers(0, 64, n)
        x = rng.integers(-127, 128, n)
        sc, acc = rng.integers(-128, 128, n // 2), rng.integers(-2**28, 2**28, n // 4)
        if trial == 0:  # the largest pairs, both signs, times the largest scales
            q[:], x[::4], x[1::4], x[2::4], x[3::4] = (-128 if signed else 63), 127, 127, -127, -127
            sc[::2], sc[1::2] = -128, 127
        out = np.zeros(n // 4, np.int32)
        run(q.astype(np.int8 if signed else np.uint8).view(np.int8), x.astype(np.int8), sc.astype(np.int16),
            acc.astype(np.int32), out)
        pair_sums = (q * x).reshape(n // 2, 2).sum(axis=1)
        assert out.tolist() == (acc + (pair_sums * sc).reshape(n // 4, 2).sum(axis=1)).tolist()


def _float64_expert(mats, name, x, quantised=dequantised):
    """float64 SwiGLU on the dequantised weights, with x and h quantised as the kernels quantise them
    (``quantised``: decode's grain, or dequantised_super for prefill's)."""
    g, u, d = (formats.decoded(formats.get(name), m).astype(np.float64) for m in mats)
    xs = quantised(x)
    a, b = xs @ g.T, xs @ u.T
    h = (a / (1 + np.exp(-a)) * b).astype(np.float32)
    return quantised(h) @ d.T


def _node_output(store, activations, x, tokens, routed, weights) -> np.ndarray:
    worker = NodeWorker(0, store, H, threads=2, activations=activations)  # the store is the caller's, kept open
    return worker.compute(0, x, tokens, routed, weights).copy()


def _assert_integer_path_taken(got: dict, want: np.ndarray) -> None:
    """got["q8"] within float32 rounding of the float64 ``want``, and got["f32"] away from it by the
    activations' rounding (so the integer path is the one taken)."""
    scale = np.abs(want).max()
    error = np.abs(got["q8"] - want).max()
    assert error <= 2e-6 * scale
    assert np.abs(got["f32"] - got["q8"]).max() > 100 * error


@pytest.mark.parametrize("name", INT_FORMATS)
def test_node_decode_with_integer_dots_equals_float64_on_the_quantised_activations(name):
    """Three tokens, each routed alone to its own expert (decode's four rows at a time, integer dots):
    within float32 rounding of float64 on the dequantised weights and the quantised activations (per block
    of 32, or per super-block for a K type or IQ4_XS), and away from the float-activation result by the
    activations' rounding (so the integer path is the one taken)."""
    fmt = formats.get(name)
    rng = np.random.default_rng(5)
    experts = {(0, e): [stored_rows(fmt, rows, width, rng) for rows, width in ((R, H), (R, H), (H, R))]
               for e in range(3)}
    store = HeapExpertStore(0, {k: ExpertSlice(*m, name) for k, m in experts.items()}, name)
    x = activations(rng, 3, H)
    tokens, routed, weights = np.arange(3), np.array([2, 0, 1]), np.array([0.5, 1.0, 2.0], np.float32)
    got = {acts: _node_output(store, acts, x, tokens, routed, weights) for acts in ("q8", "f32")}
    store.close()
    grain = dequantised_super if name in SUPER_FORMATS else dequantised
    want = np.stack([w * _float64_expert(experts[(0, e)], name, x[t:t + 1], grain)[0]
                     for t, e, w in zip(tokens, routed, weights)])
    _assert_integer_path_taken(got, want)


@pytest.mark.parametrize("per_expert", [3, 5, 7, 9, 10],
                         ids=["three", "four-and-one", "padded-to-eight", "eight-and-one", "eight-and-two"])
@pytest.mark.parametrize("name", INT_FORMATS)
def test_node_prefill_with_integer_dots_equals_float64(name, per_expert):
    """Several tokens routed to each of two experts (prefill: 3 a tile of three, 5 as 4 and 1 alone, 7 padded
    to 8, 9 as 8 and 1 alone, 10 as 8 and 2: the tiles by eight, four, three and two, and rows.tiled_tokens'
    leftover; q8 and q4 pad nothing, 5, 9 taking their tile of one, 7 its tile of three; their matrices, whole groups of
    eight rows, take rows8.py's loop instead, eight rows interleaved on the fly, two tokens at a time): within float32 rounding of float64 on the dequantised weights and the activations quantised
    per super-block (per block of 32 for q8 and q4), and away from the float-activation result (so the integer
    loop is the one taken). q8 and q4's down rows are R = 8 blocks wide, and a third expert's R - 32 = 7
    (iblock.py's last block alone on 512 bits)."""
    fmt = formats.get(name)
    rng = np.random.default_rng(7)
    experts = {(0, e): [stored_rows(fmt, rows, width, rng) for rows, width in ((R, H), (R, H), (H, R))]
               for e in range(2)}
    grain = dequantised_super if name in SUPER_FORMATS else dequantised
    if name not in SUPER_FORMATS:  # an odd number of blocks along down's rows
        experts[(0, 2)] = [stored_rows(fmt, rows, width, rng) for rows, width in ((R - 32, H), (R - 32, H),
                                                                                 (H, R - 32))]
    store = HeapExpertStore(0, {k: ExpertSlice(*m, name) for k, m in experts.items()}, name)
    order = [1, 0, 2] if len(experts) == 3 else [1, 0]
    T = len(order) * per_expert
    x = activations(rng, T, H)
    tokens, routed = np.arange(T), np.repeat(order, per_expert)  # tokens [0, n) to expert 1, then 0 (then 2)
    weights = rng.uniform(0.5, 2.0, T).astype(np.float32)
    got = {acts: _node_output(store, acts, x, tokens, routed, weights) for acts in ("q8", "f32")}
    store.close()
    want = np.concatenate([_float64_expert(experts[(0, e)], name, x[k * per_expert:(k + 1) * per_expert], grain)
                           * weights[k * per_expert:(k + 1) * per_expert, None] for k, e in enumerate(order)])
    _assert_integer_path_taken(got, want)


@pytest.mark.parametrize("tokens", [1, 3, 6, 13], ids=["decode", "three", "four-and-two", "eight-four-one"])
@pytest.mark.parametrize("name", INT_FORMATS)
def test_dense_matrix_few_tokens_in_integers_equals_float64(name, tokens):
    """1, 3 (a tile of three), 6 (four and two) and 13 tokens (eight, four and one; a K type: padded to 16)
    against 70 rows (decode: a short last group of four): within float32 rounding of float64 on the
    activations quantised per super-block (q8, q4: per block of 32, rows of 544 weights, 17 blocks: the last
    alone on 512 bits), away from the float path."""
    rng = np.random.default_rng(8)
    fmt = formats.get(name)
    K = 512 if name in SUPER_FORMATS else 544
    stored = stored_rows(fmt, 70, K, rng)
    if name == "q8":  # a file's Q8_0 may hold -128, which our encoder never writes
        stored[3, 32:64] = np.int8(-128).view(np.uint8)
    matrix = PackedMatrix(fmt, stored, (70, K), int_act=True)
    x = activations(rng, tokens, K)
    got = x @ matrix.T
    want = (dequantised_super if name in SUPER_FORMATS else dequantised)(x) @ matrix.decoded().astype(np.float64).T
    scale = np.abs(want).max()
    error = np.abs(got - want).max()
    assert got.shape == (tokens, 70) and error <= 2e-6 * scale
    float_path = PackedMatrix(fmt, matrix.data, (70, K))
    assert np.abs((x @ float_path.T) - got).max() > 100 * error


@pytest.mark.parametrize("name, limit", [("q4k", "INT_TOKENS"), ("q8", "BLOCK_INT_TOKENS")])
def test_dense_matrix_of_many_tokens_takes_blas_on_decoded_rows(name, limit):
    """Without batch invariance, from INT_TOKENS rows of x on (a K type; BLOCK_INT_TOKENS for q8 and q4), BLAS on
    the decoded rows is faster than the integer loop (packed.py's measurement): the same bits as with float
    activations. Batch-invariant (the default), the integer loop at any row count: a row's bits as alone."""
    from coordinator.host import packed

    rng = np.random.default_rng(9)
    fmt = formats.get(name)
    stored = stored_rows(fmt, 70, 512, rng)
    x = activations(rng, getattr(packed, limit), 512)
    int_act, float_act = (PackedMatrix(fmt, stored, (70, 512), int_act=flag, invariant=False) for flag in (True, False))
    assert np.array_equal(x @ int_act.T, x @ float_act.T)
    assert not np.array_equal(x[:-1] @ int_act.T, x[:-1] @ float_act.T)  # one row fewer: the integer loop
    invariant = PackedMatrix(fmt, stored, (70, 512), int_act=True)
    every = x @ invariant.T
    assert np.array_equal(every[:-1], x[:-1] @ int_act.T) and np.array_equal(every[-1:], x[-1:] @ invariant.T)


@pytest.mark.parametrize("tokens", [1, 2, 3, 64])
def test_q8_dense_matrix_in_groups_of_eight_rows_equals_float64(tokens):
    """q8 rows in whole groups of eight are stored interleaved (rows8.py: a block's values four by four, row by
    row, then the eight scales) and taken eight rows a vector for every T: the same bytes reordered, decoded
    to the row-major decode's bits, the products within float32 rounding of float64 on the quantised
    activations (a file's -128 included), away from the float path."""
    from node_worker.kernels import rows8

    rng = np.random.default_rng(10)
    fmt = formats.get("q8")
    R, K = 48, 544
    stored = stored_rows(fmt, R, K, rng)
    stored[3, 32:64] = np.int8(-128).view(np.uint8)
    matrix = PackedMatrix(fmt, stored, (R, K), int_act=True)
    assert matrix.grouped and not PackedMatrix(fmt, stored[:44], (44, K), int_act=True).grouped
    groups = np.asarray(matrix.data).reshape(R // 8, K // 32, rows8.GROUP_BYTES)
    r, b, i = 13, 5, 22  # row 13 is row 5 of group 1; its block 5's value 22 lies at 32 (22 // 4) + 4 5 + 22 % 4
    assert groups[1, b, 32 * (i // 4) + 4 * 5 + i % 4] == stored[r, 32 * b + i]
    assert groups[1, b, 256 + 2 * 5:256 + 2 * 5 + 2].tobytes() == stored[r, K + 2 * b:K + 2 * b + 2].tobytes()
    assert np.array_equal(rows8.rows_of(matrix.data, R, K), stored)
    decoded = matrix.decoded()
    assert np.array_equal(decoded, PackedMatrix(fmt, stored, (R, K)).decoded())
    x = activations(rng, tokens, K)
    got = x @ matrix.T
    want = dequantised(x) @ decoded.astype(np.float64).T
    error = np.abs(got - want).max()
    assert got.shape == (tokens, R) and error <= 2e-6 * np.abs(want).max()
    assert np.abs((x @ PackedMatrix(fmt, stored, (R, K)).T) - got).max() > 100 * error


@pytest.mark.parametrize("tokens", [3, 64])
def test_q4_dense_matrix_eight_rows_at_a_time_equals_float64(tokens):
    """A q4 matrix of whole groups of eight rows stays row-major and, from rows.GROUPED_FROM tokens on, is taken
    eight rows a vector, interleaved on the fly with its values unsigned (rows8.matmul_rows_by_eight: q + 8,
    less 8 times the activations' block sums): within float32 rounding of float64 on the quantised
    activations, away from the float path; a matrix of 44 rows keeps the row loops (iblock's integers below
    packed.BLOCK_INT_TOKENS, BLAS on the float activations from it on), to the same figures."""
    rng = np.random.default_rng(12)
    fmt = formats.get("q4")
    R, K = 48, 544
    stored = stored_rows(fmt, R, K, rng)
    matrix = PackedMatrix(fmt, stored, (R, K), int_act=True)
    x = activations(rng, tokens, K)
    got = x @ matrix.T
    want = dequantised(x) @ matrix.decoded().astype(np.float64).T
    error = np.abs(got - want).max()
    assert got.shape == (tokens, R) and error <= 2e-6 * np.abs(want).max()
    assert np.abs((x @ PackedMatrix(fmt, stored, (R, K)).T) - got).max() > 100 * error
    rest = x @ PackedMatrix(fmt, stored[:44], (44, K), int_act=True, invariant=False).T
    if tokens >= BLOCK_INT_TOKENS:
        want = x.astype(np.float64) @ matrix.decoded().astype(np.float64).T
    assert np.abs(rest - want[:, :44]).max() <= 2e-6 * np.abs(want).max()


def test_rows_interleaved_on_the_fly_are_the_stored_groups():
    """rows8.interleave8 (the experts' prefill: eight row-major rows of the store, interleaved into a scratch)
    writes for q8 rows the bytes rows8.interleave stores for the dense matrices, at any row offset and width;
    for q4 rows the same layout with the values as unsigned bytes (q + 8), which less 8 decodes to the q4 rows'
    weights."""
    from numba import njit

    from node_worker.kernels import rows8
    from node_worker.kernels.kernel_set import KernelSet
    from node_worker.kernels.rows import FORMAT_IDS

    @njit
    def interleave8(ks, fmt, data, o, row_bytes, hidden, groups):
        rows8.interleave8(ks, fmt, data, o, row_bytes, hidden, groups)

    rng = np.random.default_rng(11)
    q8 = formats.get("q8")
    for name in ("q8", "q4"):
        fmt = formats.get(name)
        for K in (32, 544):
            stored = stored_rows(fmt, 16, K, rng)
            row_bytes = fmt.row_bytes(K)
            for g in range(2):
                groups = np.zeros(K // 32 * rows8.GROUP_BYTES, np.uint8)
                interleave8(KernelSet.of([name], True), FORMAT_IDS[name], stored.reshape(-1), g * 8 * row_bytes,
                            row_bytes, K, groups)
                rows = stored[8 * g:8 * g + 8]
                if name == "q8":
                    assert np.array_equal(groups, rows8.interleave(rows, K))
                back = rows8.rows_of(groups, 8, K)
                if name == "q4":
                    assert back[:, :K].max() <= 15
                    back[:, :K] = back[:, :K] - 8  # uint8: the signed values' bytes
                assert np.array_equal(formats.decoded(q8, back), formats.decoded(fmt, rows))

def test_activations_setting_is_checked():
    assert EngineConfig().activations == "q8"
    with pytest.raises(ConfigValueError, match="activations must be one of q8, bf16, f32"):
        EngineConfig(activations="int4")
