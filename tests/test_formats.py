"""Expert storage formats (shm/formats): layouts read back by float64 references written from their
descriptions, rounding bounds, bytes per weight, and the node's compute on each format's weights."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.config import EngineConfig
from coordinator.engine import Engine
from coordinator.errors import ConfigValueError
from node_worker.kernels.kernel_set import KernelSet
from node_worker.worker import NodeWorker
from shm import formats
from shm.expert_source import ExpertSlice
from shm.expert_store import HeapExpertStore

from invariance import first_token_alone_and_beside

H = 256
ROWS = 64  # an expert's rows: whole 32-blocks, as W_down's rows [H, R] need in q8 and q4
LIMITS = {"f32": 4.0, "bf16": 2.0, "q8": 1.07, "q4": 0.57}  # bytes per weight, issue 13


def weights(seed: int = 0, rows: int = ROWS) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, H)).astype(np.float32) * 0.05
    w[0, :32] = 0.0  # an all-zero block
    w[1, 5] = 3.0  # an outlier sets its block's scale
    w[2, 40] = -2.5
    return w


def encoded(fmt, w: np.ndarray) -> np.ndarray:
    out = np.empty((w.shape[0], fmt.row_bytes(w.shape[1]) // np.dtype(fmt.STORED_DTYPE).itemsize), fmt.STORED_DTYPE)
    fmt.encode_into(out, w)
    return out


def expert(fmt, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stored gate [ROWS, H], up [ROWS, H] and down [H, ROWS] of a random expert."""
    return (encoded(fmt, weights(seed)), encoded(fmt, weights(seed + 1)),
            encoded(fmt, np.ascontiguousarray(weights(seed + 2).T)))


# -- float64 readers written from the layouts drawn at the top of each module ----------------------------


def ref_bf16(stored: np.ndarray) -> np.ndarray:
    return (stored.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def ref_q8(stored: np.ndarray) -> np.ndarray:
    n = stored.shape[1] * 32 // 34  # weights a row
    out = np.empty((stored.shape[0], n))
    for r, row in enumerate(stored):
        q = row[:n].view(np.int8).astype(np.float64)
        d = row[n:].view("<f2").astype(np.float64)
        for i in range(n):
            out[r, i] = d[i // 32] * q[i]
    return out


def ref_q4(stored: np.ndarray) -> np.ndarray:
    n = stored.shape[1] * 32 // 18
    out = np.empty((stored.shape[0], n))
    for r, row in enumerate(stored):
        d = row[n // 2:].view("<f2").astype(np.float64)
        for b in range(n // 32):
            for j in range(16):
                byte = int(row[16 * b + j])
                out[r, 32 * b + j] = d[b] * ((byte & 15) - 8)
                out[r, 32 * b + j + 16] = d[b] * ((byte >> 4) - 8)
    return out


REFS = {"bf16": ref_bf16, "q8": ref_q8, "q4": ref_q4, "f32": lambda s: s.astype(np.float64)}


@pytest.mark.parametrize("name", list(formats.FORMATS))
def test_decode_is_the_layout_read_in_float64(name):
    fmt = formats.get(name)
    stored = encoded(fmt, weights())
    np.testing.assert_array_equal(formats.decoded(fmt, stored), REFS[name](stored).astype(np.float32))


@pytest.mark.parametrize("name", list(formats.FORMATS))
def test_bytes_per_weight(name):
    fmt = formats.get(name)
    assert fmt.row_bytes(H) / H == fmt.BYTES_PER_WEIGHT <= LIMITS[name]
    assert fmt.hidden_of(fmt.row_bytes(H) // np.dtype(fmt.STORED_DTYPE).itemsize) == H


# q8: half a step of max|w|/127. q4: half a step of max|w|/8, but a value of the sign opposite to the largest
# one can reach +8 steps, where only +7 exist: up to one step there (as ggml's Q4_0)
@pytest.mark.parametrize("name, bound", [("q8", 0.5 / 127), ("q4", 1 / 8)])
def test_rounding_error_is_within_the_block_scales_steps(name, bound):
    w = weights(1)
    dq = REFS[name](encoded(formats.get(name), w))
    blocks = w.reshape(ROWS, H // 32, 32).astype(np.float64)
    amax = np.abs(blocks).max(axis=2, keepdims=True)
    err = np.abs(dq.reshape(blocks.shape) - blocks)
    assert np.all(err <= amax * bound * 1.01 + 1e-12)  # f16 scales add well under 1 %
    assert np.all(dq[0, :32] == 0)  # the all-zero block stays zero
    assert dq[1, 5] == pytest.approx(3.0, rel=2e-3) and dq[2, 40] == pytest.approx(-2.5, rel=2e-3)


def test_bf16_keeps_bf16_values_exactly_and_rounds_others_to_nearest_even():
    largest = float(np.array([0x7F7F0000], np.uint32).view(np.float32)[0])  # the largest finite bfloat16
    exact = np.array([[1.0, -2.5, 0.15625, largest] + [0.0] * (H - 4)], np.float32)
    assert np.array_equal(formats.decoded(formats.bf16, encoded(formats.bf16, exact)), exact)
    halfway = np.array([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-9], np.float32)  # ties to even, then below
    padded = np.zeros((1, H), np.float32)
    padded[0, :3] = halfway
    got = formats.decoded(formats.bf16, encoded(formats.bf16, padded))[0, :3]
    assert got.tolist() == [1.0, 1.0 + 4 * 2.0**-8, 1.0]
    nan = np.full((1, H), np.nan, np.float32)
    assert np.isnan(formats.decoded(formats.bf16, encoded(formats.bf16, nan))).all()


@pytest.mark.parametrize("name", list(formats.FORMATS))
# T = 4 tokens: groups of 2-3 (padded to 4), 8: 5-6 (to 8), 16: 10-11 (8 + 4), 48: 32 (8s); one token: test below
@pytest.mark.parametrize("tokens_per_expert", [1, 2, 4, 12])
def test_node_compute_equals_float64_swiglu_on_the_dequantised_weights(name, tokens_per_expert):
    fmt = formats.get(name)
    rng = np.random.default_rng(3)
    slices = {}
    for e in range(3):
        slices[(0, e)] = ExpertSlice(*expert(fmt, 10 * e), name)
    worker = NodeWorker(0, HeapExpertStore(0, dict(slices), name), H, threads=2, activations="f32")  # the reference
    try:
        T = 4 * tokens_per_expert
        x = rng.standard_normal((T, H)).astype(np.float32)
        tokens = np.repeat(np.arange(T), 2)  # each token to two of the three experts
        experts = np.array([(t % 3, (t + 1) % 3) for t in range(T)]).reshape(-1)
        w = rng.random(2 * T).astype(np.float32)
        y = worker.compute(0, x, tokens, experts, w)
    finally:
        worker.close()
    want = np.zeros((T, H))
    for t, e, wt in zip(tokens, experts, w):
        s = slices[(0, e)]
        g, u, d = (REFS[name](m) for m in (s.gate, s.up, s.down))  # [R, H], [R, H], [H, R]
        a, b = g @ x[t].astype(np.float64), u @ x[t].astype(np.float64)
        want[t] += wt * (d @ (a / (1 + np.exp(-a)) * b))
    np.testing.assert_allclose(y, want, rtol=2e-5, atol=2e-6)


# Every (format, activations) pair sums each (row, token) in one order, whatever the tokens beside it (issue 62):
# the float loops of every format, bf16's products by bf16 activations, and q8's and q4's integer loops (decode's
# isimd.py, a group's iblock.py and rows8.py: idot.totals and idot.scaled_blocks).
ROW_INVARIANT = [("f32", "f32"), ("f32", "q8"), ("bf16", "f32"), ("bf16", "q8"), ("bf16", "bf16"), ("q8", "f32"),
                 ("q4", "f32"), ("q8", "q8"), ("q4", "q8")]


@pytest.mark.parametrize("name, activations", ROW_INVARIANT)
def test_a_tokens_partial_output_does_not_depend_on_the_tokens_beside_it(name, activations):
    """Token 0's partial output is the same bits alone (decode's four-row loops) and beside 1 to 15 other tokens
    (the prefill tiles of two or four rows by four tokens, the short tiles, the padding), some routed to its
    experts and some elsewhere, on two threads: what a sequence decodes does not depend on the batch it is in."""
    fmt = formats.get(name)
    slices = {(0, e): ExpertSlice(*expert(fmt, 10 * e), name) for e in range(3)}
    worker = NodeWorker(0, HeapExpertStore(0, dict(slices), name), H, threads=2, activations=activations)
    alone, beside = first_token_alone_and_beside(worker, H, (2, 3, 4, 5, 8, 9, 13, 16))
    assert np.abs(alone).max() > 0
    assert [T for T, y in beside.items() if not np.array_equal(y, alone)] == []


# -- the engine with each format ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    from coordinator.cli.make_model import make_model

    return make_model(tmp_path_factory.mktemp("fmt") / "m", seed=4, dtype="BF16", hidden_size=64)


PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]


def test_bf16_store_of_a_bf16_checkpoint_is_bitwise_the_f32_store(bf16_model):
    with Engine.open(bf16_model, EngineConfig(expert_dtype="f32")) as eng:
        f32 = eng.logits(PROMPT)
        f32_bytes = eng.pool.workers[0].store.nbytes
    with Engine.open(bf16_model, EngineConfig()) as eng:  # auto: bf16 for a BF16 checkpoint
        assert eng.expert_format == "bf16"
        assert np.array_equal(eng.logits(PROMPT), f32)
        assert eng.pool.workers[0].store.nbytes * 2 == f32_bytes


@pytest.mark.parametrize("name, top1", [("q8", 1.0), ("q4", 0.5)])
def test_quantised_stores_stay_close_to_f32(bf16_model, name, top1):
    with Engine.open(bf16_model, EngineConfig(expert_dtype="f32")) as eng:
        ref = eng.logits(PROMPT)
    with Engine.open(bf16_model, EngineConfig(expert_dtype=name)) as eng:
        got = eng.logits(PROMPT)
        assert eng.expert_format == name and eng.pool.workers[0].store.fmt == name
    agree = np.mean(got.argmax(-1) == ref.argmax(-1))
    assert agree >= top1
    assert not np.array_equal(got, ref)  # the experts really were quantised


def test_unknown_format_and_a_hidden_size_off_the_block_are_named(tiny_model):
    with pytest.raises(ConfigValueError,
                       match="expert_dtype must be one of auto, f32, bf16, q8, q4, q4k, q5k, q6k, iq4xs"):
        EngineConfig(expert_dtype="q3")
    odd = tiny_model("odd", hidden_size=48, num_heads=3, num_kv_heads=1)
    with pytest.raises(ConfigValueError, match="hidden size 48 is not a multiple of 32"):
        Engine.open(odd, EngineConfig(expert_dtype="q8"))
    with Engine.open(odd, EngineConfig(expert_dtype="bf16")) as eng:  # bf16 has no blocks
        assert eng.expert_format == "bf16"


def test_segment_bytes_per_format_and_a_leftover_of_another_format(bf16_model):
    """bf16 segments take half the bytes of f32, q4 under a third of bf16; a kept f32 segment is another
    segment (the format is part of its name), so starting in bf16 beside it neither reuses nor refuses it."""
    from shm import segments

    found = {}
    try:
        for name in ("f32", "bf16", "q4"):
            cfg = EngineConfig(pool="process", expert_dtype=name, keep_shm=name == "f32")
            with Engine.open(bf16_model, cfg) as eng:
                node = eng.pool.health()[0]
                found[name] = (node["segment"], node["segment_bytes"], node["reloaded"])
                assert eng.pool.workers[0].hello["expert_format"] == name
        assert segments.read_header(found["f32"][0]).layout["kind"] == "expert-slices/float32"  # kept, intact
    finally:
        segments.unlink(found["f32"][0])
    (f32_seg, f32_bytes, _), (bf16_seg, bf16_bytes, bf16_loaded), (_, q4_bytes, _) = (found[n] for n in found)
    assert bf16_seg != f32_seg and bf16_loaded  # filled anew, not the f32 segment reattached
    assert bf16_bytes * 2 == f32_bytes and q4_bytes * 3 < bf16_bytes


# -- dense matrices of the CPU device side (dense_dtype) ---------------------------------------------------


@pytest.mark.parametrize("name", list(formats.FORMATS))
def test_packed_dense_matrix_times_few_and_many_tokens_equals_float64(name, monkeypatch):
    """The row loops (every token count, batch-invariant) on 37 rows (the last group of four cut short); f32 and
    bf16 rows of 50 values end in a partial block of 18. f32 and bf16 take dense.matmul_tiles from 3 tokens on (37 rows: tasks of 24 and 13, each in six-row tiles
    (rows.six_rows: rows of up to 1024 weights, or 12 tokens and more) then four and two, the last an odd
    row)."""
    from coordinator.host.packed import PackedMatrix
    from node_worker.kernels import dense, simd

    tiled, real = [], dense.matmul_tiles

    def spy(*args):
        tiled.append(args[-2].shape[0])  # the tokens, padded to a multiple of 4
        real(*args)

    monkeypatch.setattr(dense, "matmul_tiles", spy)

    fmt = formats.get(name)
    R, K = 37, (H if fmt.BLOCK > 1 else 50)
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((R, K)) * 0.05).astype(np.float32)
    packed = PackedMatrix.encode(w, fmt)
    ref_w = REFS[name](np.frombuffer(packed.data, fmt.STORED_DTYPE).reshape(R, -1))  # [R, K] float64
    assert np.array_equal(packed.decoded(), ref_w.astype(np.float32))
    assert packed.nbytes == R * fmt.row_bytes(K)
    for T in (1, 3, 9, 20, 33):  # 33: from rows.UNFETCHED_TOKENS on, the six-row tiles without the prefetch
        x = rng.standard_normal((T, K)).astype(np.float32)
        y = x @ packed.T
        assert y.shape == (T, R) and y.dtype == np.float32
        np.testing.assert_allclose(y, x.astype(np.float64) @ ref_w.T, rtol=1e-5, atol=1e-5)
    x3 = rng.standard_normal((2, 3, K)).astype(np.float32)  # leading axes kept
    np.testing.assert_allclose(x3 @ packed.T, x3.astype(np.float64) @ ref_w.T, rtol=1e-5, atol=1e-5)
    assert tiled == ([4, 12, 20, 36, 8] if name in simd.WIDE_FORMATS else [])  # batch-invariant: on every host


def test_the_dense_warm_up_compiles_the_prefill_tiles_ahead_of_the_first_prompt():
    """dense.warm_up (the engine's and the workers' start) compiles dense.matmul_tiles for the types a
    PackedMatrix passes, so a prompt of three tokens or more (here bf16 rows by bf16 activations, which take
    the tiles on every host) adds no compiled version inside the request."""
    from coordinator.host.packed import PackedMatrix
    from node_worker.kernels import dense

    rng = np.random.default_rng(2)
    packed = PackedMatrix.encode(rng.standard_normal((8, 64)).astype(np.float32), formats.get("bf16"),
                                 bf16_products=True)
    dense.warm_up(packed.kernels)
    compiled = len(dense.matmul_tiles.overloads)
    assert compiled >= 1
    x = rng.standard_normal((5, 64)).astype(np.float32)
    assert (x @ packed.T).shape == (5, 8)
    assert len(dense.matmul_tiles.overloads) == compiled


@pytest.mark.parametrize("T", [1, 2, 3, 9])
def test_packed_bf16_matrix_by_bf16_activations_equals_float64_of_the_rounded_activations(T):
    """A dense bf16 matrix with bf16_products (activations "bf16"): one and two tokens through the row loop,
    three and more through the tiles, on every host; 37 rows of 50 (an odd last row, a partial last block)."""
    from coordinator.host.packed import PackedMatrix

    fmt = formats.get("bf16")
    rng = np.random.default_rng(14)
    w = rng.standard_normal((37, 50)).astype(np.float32)
    exact, rounded = PackedMatrix.encode(w, fmt), PackedMatrix.encode(w, fmt, bf16_products=True)
    ref_w = formats.decoded(fmt, np.frombuffer(exact.data, np.uint16).reshape(37, -1)).astype(np.float64)
    x = rng.standard_normal((T, 50)).astype(np.float32)
    got = x @ rounded.T
    np.testing.assert_allclose(got, bf16_rounded(x) @ ref_w.T, rtol=1e-5, atol=1e-5)
    assert np.abs(got - x @ exact.T).max() > 1e-4
    assert np.array_equal(rounded.decoded(), exact.decoded())  # the same rows


@pytest.mark.parametrize("name, top1", [("bf16", 1.0), ("q8", 1.0), ("q4", 0.5)])
def test_dense_dtype_stores_the_dense_matrices_and_stays_close_to_f32(bf16_model, name, top1):
    from coordinator.host.packed import PackedMatrix

    with Engine.open(bf16_model, EngineConfig(device="cpu")) as eng:  # auto: a safetensors model's stay float32
        assert eng.decoder.w.lm_head.fmt.NAME == "f32" and eng.decoder.w.layers[0].q.fmt.NAME == "f32"
        ref = eng.logits(PROMPT)
    with Engine.open(bf16_model, EngineConfig(device="cpu", dense_dtype=name)) as eng:
        w = eng.decoder.w
        assert isinstance(w.lm_head, PackedMatrix) and w.lm_head.fmt.NAME == name
        assert all(isinstance(getattr(layer, m), PackedMatrix) for layer in w.layers for m in "qkvo")
        assert w.layers[0].router.wt.dtype == np.float32  # the router stays float32 (RowExactMatrix)
        got = eng.logits(PROMPT)
    assert np.mean(got.argmax(-1) == ref.argmax(-1)) >= top1
    # a BF16 checkpoint's weights exactly, as bf16 rows or as f32 rows: the invariant loops sum both in one order
    assert np.array_equal(got, ref) == (name == "bf16")
    with pytest.raises(ConfigValueError, match="dense_dtype must be one of auto, f32, bf16, q8, q4"):
        EngineConfig(dense_dtype="q3")


@pytest.mark.parametrize("name", ["q8", "q4"])
def test_compiled_encoder_writes_the_numpy_encoders_bytes(name):
    """The fill's compiled quantiser (shm/formats/encode.py) against the format's NumPy definition,
    on blocks with zeros, outliers, ties of magnitude and values at the float16 scale's limits."""
    from shm.formats.encode import encode_into

    fmt = formats.get(name)
    w = weights(7, rows=64)
    w[3, :32] = 0.5
    w[3, 7] = -0.5  # equal magnitudes: the first one sets q4's sign
    w[4, 64:96] = 1e-9  # a scale that rounds to a float16 subnormal or zero
    w[5, 96:128] = 6e4  # near float16's largest
    w[6, 128:160] = np.linspace(-1, 1, 32)  # values on the half steps
    got = np.empty_like(encoded(fmt, w))
    encode_into(fmt, got, w)
    assert np.array_equal(got, encoded(fmt, w))


@pytest.mark.parametrize("name", ["f32", "bf16"])
@pytest.mark.parametrize("tokens_per_expert", [1, 3])  # one token: four rows at a time; 3: padded to 4 tokens
@pytest.mark.parametrize("hidden", [50, 51])
def test_row_kernel_on_rows_ending_in_a_partial_block(name, tokens_per_expert, hidden):
    """f32 and bf16 have no blocks: a hidden size of 50 leaves 18 values after the vector loop, W_down's rows
    of 9 weights are all tail, and 51 rows of W_down leave an odd last row (and a short group of 4)."""
    fmt = formats.get(name)
    rng = np.random.default_rng(8)
    mats = []
    for rows, width in ((9, hidden), (9, hidden), (hidden, 9)):  # gate, up [R, H]; down [H, R]
        stored = np.empty((rows, fmt.row_bytes(width) // np.dtype(fmt.STORED_DTYPE).itemsize), fmt.STORED_DTYPE)
        fmt.encode_into(stored, (rng.standard_normal((rows, width)) * 0.1).astype(np.float32))
        mats.append(stored)
    worker = NodeWorker(0, HeapExpertStore(0, {(0, 0): ExpertSlice(*mats, name)}, name), hidden, threads=1)
    try:
        x = rng.standard_normal((tokens_per_expert, hidden)).astype(np.float32)
        tokens = np.arange(tokens_per_expert)
        y = worker.compute(0, x, tokens, np.zeros_like(tokens), np.ones(tokens_per_expert, np.float32))
    finally:
        worker.close()
    g, u, d = (formats.decoded(fmt, m).astype(np.float64) for m in mats)
    a, b = x.astype(np.float64) @ g.T, x.astype(np.float64) @ u.T
    np.testing.assert_allclose(y, (a / (1 + np.exp(-a)) * b) @ d.T, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name", ["f32", "bf16"])
@pytest.mark.parametrize("hidden", [64, 50])
def test_four_row_tiles_give_the_two_row_tiles_and_the_one_token_loops_bits(name, hidden):
    """simd.dot4r4 and the six-row tiles dot6r4, dot6r4n (f32 and bf16 prefill and dense tiles on hosts with
    512-bit vectors) sum every (row, token) in dot2r4's order, and dot4's (one token): the same bits on any
    host, whichever tile a host takes, for rows of whole blocks. hidden 50 (a partial last block of 18
    values, taken value by value): LLVM may reorder those few sums differently in each tile, so there only
    the float64 reference binds."""
    from numba import njit

    from node_worker.kernels import simd
    from node_worker.kernels.common import JIT
    from node_worker.kernels.rows import FORMAT_IDS

    @njit(**{**JIT, "cache": False})  # the kernels' flags
    def tiles(ks, fmt, data, row_bytes, R, K, x, four, two, six, six_n):
        for r in range(0, R, 4):
            for t0 in range(0, x.shape[0], 4):
                simd.dot4r4(ks, fmt, data, r * row_bytes, row_bytes, K, x, t0, four, r)
                simd.dot2r4(ks, fmt, data, r * row_bytes, row_bytes, K, x, t0, two, r)
                simd.dot2r4(ks, fmt, data, (r + 2) * row_bytes, row_bytes, K, x, t0, two, r + 2)
        for r in range(0, R, 6):
            for t0 in range(0, x.shape[0], 4):
                simd.dot6r4(ks, fmt, data, r * row_bytes, row_bytes, K, x, t0, six, r)
                simd.dot6r4n(ks, fmt, data, r * row_bytes, row_bytes, K, x, t0, six_n, r)

    fmt = formats.get(name)
    rng = np.random.default_rng(11)
    R, T = 12, 8
    stored = np.empty((R, fmt.row_bytes(hidden) // np.dtype(fmt.STORED_DTYPE).itemsize), fmt.STORED_DTYPE)
    fmt.encode_into(stored, rng.standard_normal((R, hidden)).astype(np.float32))
    data = stored.reshape(-1).view(np.uint8)
    x = rng.standard_normal((T, hidden)).astype(np.float32)
    four, two, six, six_n = (np.full((T, R), np.nan, np.float32) for _ in range(4))
    tiles(KernelSet.of([name], False), FORMAT_IDS[name], data, fmt.row_bytes(hidden), R, hidden, x, four, two, six,
          six_n)
    w = formats.decoded(fmt, stored).astype(np.float64)
    for got in (four, two, six, six_n):
        np.testing.assert_allclose(got, x.astype(np.float64) @ w.T, rtol=1e-5, atol=1e-5)
    from coordinator.host.packed import PackedMatrix

    packed = PackedMatrix(fmt, stored, (R, hidden))
    one_by_one = np.concatenate([x[t:t + 1] @ packed.T for t in range(T)])  # the row loops, a token each
    np.testing.assert_allclose(x @ packed.T, x.astype(np.float64) @ w.T, rtol=1e-5, atol=1e-5)
    if hidden % 32 == 0:
        assert np.array_equal(four, two) and np.array_equal(six, four) and np.array_equal(six_n, four)
        assert np.array_equal(x @ packed.T, four) and np.array_equal(one_by_one, four)


def bf16_rounded(x: np.ndarray) -> np.ndarray:
    """float32 x rounded to the nearest bf16 (ties to even), as float64: bf16dp.py's activations."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


@pytest.mark.parametrize("tokens_per_expert", [1, 3, 12])  # one token: dot4's loop; more: the tiles
@pytest.mark.parametrize("hidden", [H, 50])  # 50: a partial last block of 18, taken value by value
def test_bf16_rows_by_bf16_activations_equal_float64_of_the_rounded_activations(tokens_per_expert, hidden):
    """activations "bf16": every product of a bf16 row takes the token's values rounded to bf16 (gate and up
    on x, down on silu(gate) * up), the sums in float32; against float64 on the same rounded values, and
    apart from the exact float32 activations ("q8", which leaves bf16 rows exact)."""
    fmt = formats.get("bf16")
    rng = np.random.default_rng(12)
    mats = []
    for rows, width in ((ROWS, hidden), (ROWS, hidden), (hidden, ROWS)):  # gate, up [R, H]; down [H, R]
        stored = np.empty((rows, fmt.row_bytes(width) // 2), np.uint16)
        fmt.encode_into(stored, (rng.standard_normal((rows, width)) * 0.1).astype(np.float32))
        mats.append(stored)
    x = rng.standard_normal((2 * tokens_per_expert, hidden)).astype(np.float32)
    tokens = np.arange(x.shape[0])
    experts = np.zeros_like(tokens)
    weights_ = rng.random(x.shape[0]).astype(np.float32)
    got = {}
    for activations in ("bf16", "q8"):
        worker = NodeWorker(0, HeapExpertStore(0, {(0, 0): ExpertSlice(*mats, "bf16")}, "bf16"), hidden,
                            threads=2, activations=activations)
        try:
            got[activations] = worker.compute(0, x, tokens, experts, weights_)
        finally:
            worker.close()
    g, u, d = (formats.decoded(fmt, m).astype(np.float64) for m in mats)
    a, b = bf16_rounded(x) @ g.T, bf16_rounded(x) @ u.T
    h = bf16_rounded((a / (1 + np.exp(-a)) * b).astype(np.float32))
    want = weights_[:, None] * (h @ d.T)
    np.testing.assert_allclose(got["bf16"], want, rtol=2e-5, atol=2e-6)
    assert np.abs(got["bf16"] - got["q8"]).max() > 1e-4 * np.abs(want).max()  # the activations were rounded


def test_bf16_products_without_the_instruction_are_its_bits():
    """bf16dp.dot_pairs' two FMAs (hosts without AVX-512 BF16) against vdpbf16ps on random blocks and sums at
    three scales: the same bits (where the host has the instruction; elsewhere there is nothing to compare)."""
    from llvmlite import ir
    from numba import njit, types
    from numba.extending import intrinsic

    from node_worker.kernels import bf16dp
    from node_worker.kernels.common import JIT
    from node_worker.kernels.simd import byte_ptr

    if not bf16dp.host_has_dpbf16():
        pytest.skip("no AVX-512 BF16 on this host")

    def step(native):
        @intrinsic
        def one(typingctx, w, x, acc):
            def codegen(context, builder, signature, args):
                wp, xp, ap = (builder.bitcast(byte_ptr(context, builder, t, v), ty.as_pointer())
                              for t, v, ty in zip(signature.args, args, (bf16dp.VI, ir.VectorType(ir.FloatType(), 32),
                                                                           bf16dp.VP)))
                xb = bf16dp.activations(builder, builder.load(xp, align=4))
                builder.store(bf16dp.dot_pairs(builder, builder.load(ap, align=4), builder.load(wp, align=1), xb,
                                               native), ap, align=4)
                return context.get_dummy_value()

            return types.void(w, x, acc), codegen

        @njit(**{**JIT, "cache": False})
        def run(w, x, acc):
            for i in range(w.shape[0]):
                one(w[i], x[i], acc[i])

        return run

    rng = np.random.default_rng(13)
    n = 4000
    for scale in (1.0, 1e-20, 1e18):
        w = (rng.standard_normal((n, 32)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        x = (rng.standard_normal((n, 32)) * scale).astype(np.float32)
        acc = (rng.standard_normal((n, 16)) * 3 * scale).astype(np.float32)
        native, generic = acc.copy(), acc.copy()
        step(True)(w, x, native)
        step(False)(w, x, generic)
        assert np.array_equal(native, generic) and not np.array_equal(native, acc)


def _bf16_round_reference(x: np.ndarray) -> np.ndarray:
    """ggml_compute_fp32_to_bf16 in NumPy: the top half of u + 0x7fff + (bit 16 of u); a NaN's top half, quiet."""
    u = x.view(np.uint32).astype(np.uint64)
    nearest = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where((u & 0x7FFFFFFF) > 0x7F800000, ((u >> 16) | 64).astype(np.uint16), nearest)


def test_rounding_to_bf16_without_the_instruction_is_ggmls_and_the_instructions_bits():
    """bf16dp.bf16_bits written in integers (a CPU without AVX-512 BF16, where LLVM's fptrunc to bfloat is a call
    numba cannot link) against ggml's rounding on ties, carries into the exponent, the largest floats, the
    infinities, NaNs and denormals; and, where the host has the instruction, against it: every value but the
    denormals, which it takes as zero."""
    from llvmlite import ir
    from numba import njit, types
    from numba.extending import intrinsic

    from node_worker.kernels import bf16dp
    from node_worker.kernels.common import JIT
    from node_worker.kernels.simd import byte_ptr

    def rounding(native):
        @intrinsic
        def one(typingctx, x, out):
            def codegen(context, builder, signature, args):
                xp, op = (builder.bitcast(byte_ptr(context, builder, t, v), ty.as_pointer())
                          for t, v, ty in zip(signature.args, args, (ir.VectorType(ir.FloatType(), 32),
                                                                     ir.VectorType(ir.IntType(16), 32))))
                builder.store(bf16dp.bf16_bits(builder, builder.load(xp, align=4), native), op, align=2)
                return context.get_dummy_value()

            return types.void(x, out), codegen

        @njit(**{**JIT, "cache": False})
        def run(x, out):
            for i in range(x.shape[0]):
                one(x[i], out[i])

        return run

    rng = np.random.default_rng(17)
    bits = rng.integers(0, 2**32, 32 * 2000, dtype=np.uint64).astype(np.uint32)
    special = np.array([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3FFFFFFF, 0x7F7FFFFF, 0x7F800000, 0xFF800000,
                        0x7FC00001, 0x7F800001, 0xFFFFFFFF, 0x00000001, 0x807FFFFF, 0x00008000, 0, 0x80000000],
                       np.uint32)  # ties below and above, carries, max, +-inf, NaNs (one signalling), denormals
    bits[:special.size] = special
    x = bits.view(np.float32).reshape(-1, 32)
    portable = np.zeros(x.shape, np.uint16)
    rounding(False)(x, portable)
    assert np.array_equal(portable, _bf16_round_reference(x))
    if not bf16dp.host_has_dpbf16():
        pytest.skip("no AVX-512 BF16 on this host to compare with")
    native = np.zeros(x.shape, np.uint16)
    rounding(True)(x, native)
    normal = (x.view(np.uint32) & 0x7F800000) != 0  # denormals: the instruction gives a signed zero
    assert np.array_equal(native[normal], portable[normal]) and not np.array_equal(native, portable)


def test_node_compute_refuses_routing_outside_the_model_and_skips_experts_it_lacks():
    """The compiled layer call checks the routing before it indexes anything: an expert id outside the
    model's experts (negative, or past them), a token outside x, a weight that is not finite."""
    fmt = formats.get("q8")
    slices = {(0, 0): ExpertSlice(*expert(fmt, 0), "q8")}
    worker = NodeWorker(0, HeapExpertStore(0, slices, "q8"), H, threads=1, num_experts=8)
    try:
        x = np.ones((2, H), np.float32)
        one = np.ones(1, np.float32)
        for bad in (-1, 8):
            with pytest.raises(ValueError, match=r"expert id out of range \[0, 8\)"):
                worker.compute(0, x, np.array([0]), np.array([bad]), one)
        with pytest.raises(ValueError, match=r"token index out of range \[0, 2\)"):
            worker.compute(0, x, np.array([2]), np.array([0]), one)
        with pytest.raises(ValueError, match="routing weights must be finite"):
            worker.compute(0, x, np.array([0]), np.array([0]), np.array([np.inf], np.float32))
        y = worker.compute(0, x, np.array([0, 1]), np.array([7, 0]), np.ones(2, np.float32))  # no rows of 7
        assert not y[0].any() and y[1].any()
    finally:
        worker.close()


def test_kernel_silu_is_within_a_few_float32_steps_of_float64_everywhere():
    """node_worker/kernels/silu.py (the experts' gate activation, vectorised e^x): relative error against
    float64 within 8 float32 steps (2^-24) wherever |s| <= 87 (measured: 5.6, at s = -86), the tails finite and of silu's sign, and the gate
    times up product applied row by row up to R only."""
    from node_worker.kernels.silu import silu_times

    s = np.concatenate([np.linspace(-120, 120, 480_001), np.geomspace(1e-30, 1, 1001),
                        -np.geomspace(1e-30, 1, 1001), [0.0]]).astype(np.float32).reshape(1, -1)
    n = s.shape[1]
    up = np.full((1, n + 3), 2.0, np.float32)
    out = np.full((1, n + 3), 7.0, np.float32)
    silu_times(s, up, out, 1, n)
    exact = 2.0 * s.astype(np.float64) / (1.0 + np.exp(-s.astype(np.float64)))
    core = (np.abs(s) <= 87) & (s != 0)
    assert np.all(np.abs(out[:, :n][core] - exact[core]) <= 8 * 2.0 ** -24 * np.abs(exact[core]))
    big = s > 87
    assert np.all(np.isfinite(out)) and out[0, n - 1] == 0
    assert np.all(np.abs(out[:, :n][big] - 2 * s[big]) <= 2 * 2.0 ** -24 * 2 * s[big])
    assert np.all((out[:, :n][s < -87] <= 0) & (out[:, :n][s < -87] > -1e-30))
    assert np.all(out[:, n:] == 7.0)


@pytest.mark.parametrize("R", [1, 2, 3, 5, 6, 7, 37])  # four streams of ceil(R / 4) rows, the last ones short
@pytest.mark.parametrize("hidden", [H, 50])
def test_one_tokens_bf16_rows_read_as_four_streams_give_f32s_bits(R, hidden):
    """One token's bf16 rows go four at a time from the matrix's four quarters (rows.stream_quad), without
    the prefetch, where f32's go four rows side by side: every row is still summed by the same code, so
    bf16 rows give the bits of f32 rows holding the same values, at every R (the quarters' ends repeat
    the last row, computed and not stored), in the dense matrices and in an expert's gate, up and down."""
    from coordinator.host.packed import PackedMatrix

    rng = np.random.default_rng(R)
    w = rng.standard_normal((R, hidden)).astype(np.float32)
    bf = PackedMatrix.encode(w, formats.get("bf16"))
    f32 = PackedMatrix.encode(bf.decoded(), formats.get("f32"))
    for T in (1, 2):
        x = rng.standard_normal((T, hidden)).astype(np.float32)
        y = x @ bf.T
        assert np.array_equal(y, x @ f32.T)
        np.testing.assert_allclose(y, x.astype(np.float64) @ bf.decoded().astype(np.float64).T, rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("name", ["f32", "bf16", "bf16dp"])
def test_a_groups_last_one_to_three_tokens_in_a_short_tile_give_the_padded_tiles_bits(name):
    """rows.short_tile: a group's last n mod 4 tokens (f32 and bf16 rows, bf16dp's) go in a tile of one, two
    or three tokens (simd.dot2rK, dot4rK, pairs2rK, pairs4rK) where they took a four-token tile padded with
    zero tokens; each (row, token) is summed as in that tile, so every n gives its bits, and the padding
    rows of the output are not written."""
    from numba import njit

    from node_worker.kernels import rows as krows
    from node_worker.kernels.common import JIT

    @njit(**{**JIT, "cache": False})
    def chunks(ks, fmt, data, row_bytes, R, K, xg, xb, out, n):
        krows.dot_chunks(ks, fmt, data, 0, row_bytes, R, K, xg, xb, out, 0, n)

    fmt = formats.get("bf16" if name == "bf16dp" else name)
    fmt_id = krows.FORMAT_IDS[name]
    ks = KernelSet.of([name], False)
    rng = np.random.default_rng(21)
    R, hidden = 11, 2 * H  # rows: two four-row tiles, a two-row one and an odd last row (AVX-512: a six-row
    # tile, a four-row one and the odd last row: rows.six_rows)
    stored = np.empty((R, fmt.row_bytes(hidden) // np.dtype(fmt.STORED_DTYPE).itemsize), fmt.STORED_DTYPE)
    fmt.encode_into(stored, rng.standard_normal((R, hidden)).astype(np.float32))
    data = stored.reshape(-1).view(np.uint8)
    w = formats.decoded(fmt, stored).astype(np.float64)
    for n in range(2, 12):
        padded = -(-n // 4) * 4
        xg = np.zeros((padded, hidden), np.float32)
        xg[:n] = rng.standard_normal((n, hidden))
        xb = krows.rounded_if(name == "bf16dp", xg)
        short, whole = np.full((padded, R + 1), np.nan, np.float32), np.full((padded, R + 1), np.nan, np.float32)
        chunks(ks, fmt_id, data, fmt.row_bytes(hidden), R, hidden, xg, xb, short, n)
        chunks(ks, fmt_id, data, fmt.row_bytes(hidden), R, hidden, xg, xb, whole, padded)
        assert np.array_equal(short[:n, :R], whole[:n, :R]), n
        assert np.isnan(short[n:]).all() and not np.isnan(whole[n:, :R]).any()  # the padding: not computed
        x = bf16_rounded(xg[:n]) if name == "bf16dp" else xg[:n].astype(np.float64)
        np.testing.assert_allclose(short[:n, :R], x @ w.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["f32", "bf16"])
def test_tiles_with_accumulators_in_register_parts_give_the_plain_loops_bits(name):
    """simd._emit_dotk_parts (f32 and bf16 four-token tiles on AVX2: simd.PARTED; the six-row tiles over the
    whole row on AVX-512: chunk 0) keeps each <32 x float> accumulator as parts of one register, taken in turn
    over chunks of PART_BLOCKS blocks or the whole row; every lane adds its products in the plain loop's order
    and the parts are joined before the same reduction, so each tile shape (two, four and six rows by one to
    four tokens, parted here whatever the host takes) gives the plain loop's bits, at a hidden size of whole
    chunks, one that ends within a chunk, and one that ends within a block (its last values one by one)."""
    from numba import njit

    from node_worker.kernels import rows as krows
    from node_worker.kernels import simd

    shapes = [(NR, K) for NR in (2, 4, 6) for K in (1, 2, 3, 4)]
    names = ("f32", "bf16")
    parted = [(simd.make_dotk(NR, K, names, parted=(simd.f32, simd.bf16)),
               simd.make_dotk(NR, K, names, parted=(simd.f32, simd.bf16), chunk=0)) for NR, K in shapes]
    plain = [simd.make_dotk(NR, K, names, parted=()) for NR, K in shapes]
    R = 12

    def trio(a, b, c, NR, K):
        @njit(cache=False)
        def run(ks, fmt, data, row_bytes, hidden, x, out_a, out_b, out_c):
            for r in range(0, R, NR):
                a(ks, fmt, data, r * row_bytes, row_bytes, hidden, x, 0, out_a, r)
                b(ks, fmt, data, r * row_bytes, row_bytes, hidden, x, 0, out_b, r)
                c(ks, fmt, data, r * row_bytes, row_bytes, hidden, x, 0, out_c, r)
        return run

    fmt = formats.get(name)
    rng = np.random.default_rng(5)
    for hidden in (8 * 32 * simd.PART_BLOCKS, 32 * (simd.PART_BLOCKS + 1) + 32, 32 * 3 + 7):
        stored = np.empty((R, fmt.row_bytes(hidden) // np.dtype(fmt.STORED_DTYPE).itemsize), fmt.STORED_DTYPE)
        fmt.encode_into(stored, rng.standard_normal((R, hidden)).astype(np.float32))
        data = stored.reshape(-1).view(np.uint8)
        w = formats.decoded(fmt, stored).astype(np.float64)
        x = rng.standard_normal((4, hidden)).astype(np.float32)
        for (NR, K), (a, whole), b in zip(shapes, parted, plain):
            got, got_whole, want = (np.full((4, R + 1), np.nan, np.float32) for _ in range(3))
            trio(a, whole, b, NR, K)(KernelSet.of([name], False), krows.FORMAT_IDS[name], data, fmt.row_bytes(hidden),
                                     hidden, x, got, got_whole, want)
            assert np.array_equal(got, want, equal_nan=True), (hidden, NR, K)
            assert np.array_equal(got_whole, want, equal_nan=True), (hidden, NR, K)
            assert np.isnan(got[K:]).all()
            np.testing.assert_allclose(got[:K, :R], x[:K].astype(np.float64) @ w.T, rtol=1e-4, atol=1e-4)


def test_tile_sums_and_decode_sums_are_the_tree_of_halves():
    """simd.tree_sums: each accumulator's lanes summed as a tree of halves (lanes i and i + n/2, then again on
    the n/2 sums), the tile's accumulators reduced together with shuffles; rows of one block (32 weights) make
    each lane one product w·x (its rounding alone), so the sums are the float32 tree's exactly, computed here
    with NumPy: every tile shape (two, four and six rows by one to four tokens) and decode's four-row loop."""
    from numba import njit

    from node_worker.kernels import simd

    def tree(products):  # [..., 32] float32 -> the sums, halves first
        while products.shape[-1] > 1:
            half = products.shape[-1] // 2
            products = products[..., :half] + products[..., half:]
        return products[..., 0]

    rng = np.random.default_rng(9)
    f32_loops = KernelSet.of(["f32"], False)
    R, K, hidden = 12, 4, 32
    w = rng.standard_normal((R, hidden)).astype(np.float32)
    x = rng.standard_normal((K, hidden)).astype(np.float32)
    want = tree(x[:, None, :] * w[None, :, :])  # [K, R]
    for NR in (2, 4, 6):
        for k in (1, 2, 3, 4):
            dot = simd.make_dotk(NR, k, ("f32",), parted=())

            @njit(cache=False)
            def run(ks, data, row_bytes, x, out):
                for r in range(0, R, NR):
                    dot(ks, 0, data, r * row_bytes, row_bytes, hidden, x, 0, out, r)

            out = np.full((K, R + 1), np.nan, np.float32)
            run(f32_loops, w.reshape(-1).view(np.uint8), 4 * hidden, x, out)
            assert np.array_equal(out[:k, :R], want[:k]), (NR, k)

    @njit(cache=False)
    def decode(ks, data, x, out):
        for r in range(0, R, 4):
            out[r], out[r + 1], out[r + 2], out[r + 3] = simd.dot4(
                ks, 0, data, 4 * hidden * r, 4 * hidden * (r + 1), 4 * hidden * (r + 2), 4 * hidden * (r + 3), hidden,
                x)

    one = np.empty(R, np.float32)
    decode(f32_loops, w.reshape(-1).view(np.uint8), x[0], one)
    assert np.array_equal(one, want[0])


def test_a_groups_gathered_rows_start_on_a_cache_line():
    """rows.aligned_zeros (a prefill group's gathered tokens and silu(gate) * up): zeros [rows, cols] from a
    64-byte boundary, contiguous, whatever the allocator gives, so each tile's 64-byte load of a token's row
    reads one cache line."""
    from numba import njit

    from node_worker.kernels.rows import aligned_zeros

    @njit(cache=False)
    def make(rows, cols):
        return aligned_zeros(rows, cols)

    for rows, cols in ((1, 32), (3, 2048), (5, 768), (17, 48), (4, 1)):
        for _ in range(4):  # several allocations: the allocator's offsets vary
            got = make(rows, cols)
            assert got.shape == (rows, cols) and got.dtype == np.float32 and got.flags.c_contiguous
            assert got.ctypes.data % 64 == 0 and not got.any()


@pytest.mark.parametrize("name", ["f32", "bf16", "bf16dp"])
def test_dense_tiles_over_token_blocks_give_each_tokens_own_bits(name):
    """dense.matmul_tiles takes the tokens in blocks that fit L2 (dense.token_block: 32 tokens of 4096 values);
    68 tokens (blocks of 32, 32, 4) give each token's row the bits of its own one-token product (matmul_rows),
    bf16 rows by bf16 activations (bf16dp: the tokens rounded once, then cut in blocks) too."""
    from coordinator.host.packed import PackedMatrix
    from node_worker.kernels import dense, rows

    R, K, T = 14, 4096, 68
    assert dense.token_block(K, T) == 32
    rng = np.random.default_rng(21)
    packed = PackedMatrix.encode(rng.standard_normal((R, K)).astype(np.float32), formats.get(name[:4]))
    x = rng.standard_normal((T, K)).astype(np.float32)
    fid = rows.FORMAT_IDS[name]
    tiled = np.zeros((T, R + 1), np.float32)
    ks = KernelSet.of([name], False)
    dense.matmul_tiles(ks, fid, packed.data, 0, packed.row_bytes, R, K, x, tiled)
    alone = np.zeros((T, R), np.float32)
    for t in range(T):
        dense.matmul_rows(ks, fid, packed.data, 0, packed.row_bytes, R, K, x[t:t + 1], alone[t:t + 1])
    assert np.array_equal(tiled[:, :R], alone)
