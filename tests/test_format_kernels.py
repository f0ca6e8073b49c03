"""coordinator/gpu/format_kernels' CUDA kernels on weights in every storage format: dequantising equals the
format's decode_into bit for bit, matvec equals float64 products within float32 accumulation, grouped_matvec
equals matvec. On a GPU through CuPy (`-m gpu`), everywhere else through tests/cuda_emulator.py."""

from __future__ import annotations


import numpy as np
import pytest

from coordinator.gpu import format_kernels as fk
from shm import formats
from shm.formats import traits

NAMES = [t.name for t in traits.TRAITS]
# the float16 fields of a file format's super-block, at these byte offsets (the drawings in shm/formats/<name>.py)
HALVES = {"q4k": (0, 2), "q5k": (0, 2), "q6k": (208,), "iq4xs": (0,)}
# (R, K as an index into the format's widths, T): R off the 4 rows a block, K one block and several, T to 8 and past
CASES = [(1, 0, 1), (3, 1, 2), (37, 2, 5), (130, 1, 8), (130, 0, 1), (5, 2, 11)]


def widths(name: str) -> tuple[int, ...]:
    block = traits.BY_NAME[name].block
    return (256, 512, 768) if block == 256 else (32, 96, 4096) if block == 32 else (37, 96, 4096)


def finite_halves(rng, n: int) -> np.ndarray:
    """n random float16 bit patterns over the whole finite range (subnormals, zeros of both signs included)."""
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    bits[(bits & 0x7C00) == 0x7C00] &= np.uint16(0xBFFF)  # an exponent of all ones (inf, NaN) loses a bit
    return bits


def stored_rows(name: str, R: int, K: int, rng) -> np.ndarray:
    """Random stored rows [R, width] of a format: float weights encoded, or a file format's random super-blocks."""
    fmt = formats.get(name)
    record = traits.BY_NAME[name]
    if record.from_floats:
        stored = np.zeros((R, fmt.row_bytes(K) // np.dtype(fmt.STORED_DTYPE).itemsize), fmt.STORED_DTYPE)
        fmt.encode_into(stored, (rng.standard_normal((R, K)) * rng.uniform(0.01, 3, (R, 1))).astype(np.float32))
        return stored
    stored = rng.integers(0, 256, (R, fmt.row_bytes(K)), dtype=np.uint8)
    blocks = stored.reshape(-1, record.block_bytes)
    for at in HALVES[name]:
        blocks[:, at : at + 2] = finite_halves(rng, blocks.shape[0]).view(np.uint8).reshape(-1, 2)
    return stored


def upload(cp, name: str, stored: np.ndarray):
    return cp.asarray(fk.to_device_rows(name, stored)).reshape(-1)  # [R * row_stride] uint8


def within_float32_sums(got: np.ndarray, W: np.ndarray, x: np.ndarray, what: str) -> None:
    """got [T, R] against x [T, K] . W [R, K]^T in float64, to float32 accumulation's error of sum |w| |x|."""
    want = x.astype(np.float64) @ W.T.astype(np.float64)
    bound = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(W).T.astype(np.float64)) + 1e-6
    bad = np.abs(got - want) > bound
    assert not bad.any(), f"{what}: {bad.sum()} of {bad.size} off, worst {np.max(np.abs(got - want) - bound)}"


def test_every_format_has_device_kernels():
    """A format added to traits.TRAITS without a device reader fails here (and in every test below)."""
    assert sorted(fk.FORMATS) == sorted(NAMES)
    for name in NAMES:
        assert f"struct Reader_{name} {{" in fk.SOURCE
        for kernel in ("matvec", "grouped_matvec", "dequantize"):
            assert f'extern "C" __global__ void strata_{kernel}_{name}(' in fk.SOURCE


@pytest.mark.parametrize("name", NAMES)
def test_device_rows_are_padded_to_16_bytes(name):
    rng = np.random.default_rng(3)
    for K in widths(name):
        stored = stored_rows(name, 3, K, rng)
        rows = fk.to_device_rows(name, stored)
        row_bytes = formats.get(name).row_bytes(K)
        stride = fk.row_stride(name, K)
        assert stride % 16 == 0 and row_bytes <= stride < row_bytes + 16
        assert rows.dtype == np.uint8 and rows.shape == (3, stride)
        assert np.array_equal(rows[:, :row_bytes], np.ascontiguousarray(stored).view(np.uint8))
        assert not rows[:, row_bytes:].any()


def test_misaligned_or_short_matrices_are_refused(cp):
    rng = np.random.default_rng(4)
    w = upload(cp, "q8", stored_rows("q8", 4, 64, rng))
    x = cp.asarray(np.ones((1, 64), np.float32))
    with pytest.raises(ValueError):
        fk.matvec("q8", w[16:], 4, 64, x)  # three rows' bytes
    with pytest.raises(ValueError):
        fk.matvec("q8", w[1:], 3, 64, x)  # rows not 16-byte aligned
    with pytest.raises(ValueError):
        fk.matvec("q8", w, 4, 48, x)  # not whole blocks
    with pytest.raises(ValueError):
        fk.pointer_table([w[8:]])


@pytest.mark.parametrize("name", NAMES)
def test_dequantize_equals_decode_into(cp, name):
    """Whole matrices and row ranges, bit for bit."""
    rng = np.random.default_rng(5)
    fmt = formats.get(name)
    for K in widths(name)[:2]:
        R = 37
        stored = stored_rows(name, R, K, rng)
        want = formats.decoded(fmt, stored)
        w = upload(cp, name, stored)
        for row0, rows in [(0, None), (5, 7), (36, 1), (12, 0)]:
            got = cp.asnumpy(fk.dequantize(name, w, R, K, row0, rows))
            n = R - row0 if rows is None else rows
            assert got.shape == (n, K)
            assert np.array_equal(got.view(np.uint32), want[row0 : row0 + n].view(np.uint32)), (K, row0, rows)


def test_every_finite_half_scale_converts_exactly(cp):
    """q8 rows whose scales are each finite float16 once (subnormals, signed zeros, the largest): the device's
    float16 -> float32 conversion is NumPy's."""
    R, K = 62, 32 * 1024  # R K / 32 = 63488 scales, the finite float16 values
    rng = np.random.default_rng(6)
    bits = np.arange(1 << 16, dtype=np.uint16)
    bits = bits[(bits & 0x7C00) != 0x7C00]
    stored = np.empty((R, formats.get("q8").row_bytes(K)), np.uint8)
    stored[:, :K] = rng.integers(0, 256, (R, K), dtype=np.uint8)
    stored[:, K:] = rng.permutation(bits).view(np.uint8).reshape(R, -1)
    got = cp.asnumpy(fk.dequantize("q8", upload(cp, "q8", stored), R, K))
    assert np.array_equal(got.view(np.uint32), formats.decoded(formats.get("q8"), stored).view(np.uint32))


@pytest.mark.parametrize("name", NAMES)
def test_matvec_matches_float64_and_fuses_bias_and_residual(cp, name):
    """R off the block's rows, K from one block to many, T from 1 to 8 (and 11: two launches); the fused bias
    and residual equal (product + bias) + residual in float32, residual may be out; a token's row is the same
    sum alone."""
    rng = np.random.default_rng(8)
    fmt = formats.get(name)
    for R, k, T in CASES:
        K = widths(name)[k]
        stored = stored_rows(name, R, K, rng)
        W = formats.decoded(fmt, stored)
        w = upload(cp, name, stored)
        x = (rng.standard_normal((T, K)) * 2).astype(np.float32)
        what = f"{name} R {R} K {K} T {T}"
        got = cp.asnumpy(fk.matvec(name, w, R, K, cp.asarray(x)))
        assert got.shape == (T, R) and got.dtype == np.float32
        within_float32_sums(got, W, x, what)

        bias = rng.standard_normal(R).astype(np.float32)
        residual = rng.standard_normal((T, R)).astype(np.float32)
        fused = cp.asnumpy(fk.matvec(name, w, R, K, cp.asarray(x), cp.asarray(bias), cp.asarray(residual)))
        assert np.array_equal(fused, (got + bias) + residual), what
        if T not in (5, 11):
            continue
        in_place = cp.asarray(residual.copy())  # the emulator's asarray would not copy
        fk.matvec(name, w, R, K, cp.asarray(x), residual=in_place, out=in_place)
        assert np.array_equal(cp.asnumpy(in_place), got + residual), what
        alone = cp.asnumpy(fk.matvec(name, w, R, K, cp.asarray(x[T - 1 :])))
        assert np.array_equal(alone[0], got[T - 1]), what


@pytest.mark.parametrize("name", NAMES)
def test_grouped_matvec_equals_matvec_per_slot(cp, name):
    """5 matrices, 7 slots with repeated matrices and x rows out of order, one launch: each slot bit for bit the
    matvec of its row and matrix."""
    rng = np.random.default_rng(9)
    fmt = formats.get(name)
    R, K = 37, widths(name)[1]
    stored = [stored_rows(name, R, K, rng) for _ in range(5)]
    experts = [upload(cp, name, s) for s in stored]
    table = fk.pointer_table(experts)
    x = (rng.standard_normal((4, K)) * 2).astype(np.float32)
    slot_rows = np.array([3, 0, 0, 2, 1, 3, 0], np.int32)
    slot_matrix = np.array([4, 1, 4, 0, 2, 2, 3], np.int32)
    dx = cp.asarray(x)
    got = cp.asnumpy(fk.grouped_matvec(name, table, K, R, dx, cp.asarray(slot_rows), cp.asarray(slot_matrix)))
    assert got.shape == (7, R)
    for p, (row, e) in enumerate(zip(slot_rows, slot_matrix)):
        alone = cp.asnumpy(fk.matvec(name, experts[e], R, K, dx[row : row + 1]))
        assert np.array_equal(got[p], alone[0]), f"{name} slot {p}"
        within_float32_sums(got[p : p + 1], formats.decoded(fmt, stored[e]), x[row : row + 1], f"{name} slot {p}")


@pytest.mark.parametrize("rows", [9, 24, 64, 100])
def test_a_graph_steps_rows_read_the_compact_matrix_in_blocks(cp, rows, monkeypatch):
    """DeviceMatrix x Wᵀ for 9 to 64 rows (a graph-ready step's), and batch-invariant for any count (a prompt's
    100), runs the format's matvec a block of MAX_TOKENS rows at a time: nothing dequantised, each row the bits it
    has alone, the bias and residual fused."""
    from coordinator.gpu.weights import BLOCKED_ROWS, DeviceMatrix

    rng = np.random.default_rng(rows)
    R, K = 40, widths("q4k")[0]
    stored = stored_rows("q4k", R, K, rng)
    m = DeviceMatrix("q4k", upload(cp, "q4k", stored), (R, K))
    x = (rng.standard_normal((rows, K)) * 2).astype(np.float32)
    bias, residual = rng.standard_normal(R).astype(np.float32), rng.standard_normal((rows, R)).astype(np.float32)

    def refused(*args, **kwargs):
        raise AssertionError("a step's product dequantised the matrix")
    monkeypatch.setattr(fk, "dequantize", refused)
    got = cp.asnumpy(m.matmul_t(cp.asarray(x), cp.asarray(bias), cp.asarray(residual)))
    alone = np.concatenate([cp.asnumpy(fk.matvec("q4k", m.data, R, K, cp.asarray(x[t:t + 1]), cp.asarray(bias),
                                                 cp.asarray(residual[t:t + 1]))) for t in range(rows)])
    assert np.array_equal(got, alone)
    within_float32_sums(got - bias - residual, formats.decoded(formats.get("q4k"), stored), x, f"{rows} rows")
    if rows > BLOCKED_ROWS:  # without batch invariance a prompt's rows take cuBLAS on the dequantised tiles
        m.invariant = False
        with pytest.raises(AssertionError, match="dequantised the matrix"):
            m.matmul_t(cp.asarray(x))


@pytest.mark.parametrize("name", ["q8", "q4k", "bf16"])
def test_mla_reads_a_compact_kv_b_as_it_lies(cp, name):
    """The absorbed MLA attention given kv_b in a storage format (device_ops.CompactKvB): q_nope · W_uk through the
    format's reader (absorb_rows) and out_lat · W_uvᵀ through head_rows_matvec, against the float path over the
    same rows decoded (within float32 sums of the output's largest terms; only W_uv's sums run in another
    order)."""
    from coordinator.model import ops
    from coordinator.model.ops import MlaRows
    from coordinator.gpu import ops as device_ops

    rng = np.random.default_rng(29)
    T, S, nh, dn, dv, dr = 3, 40, 4, 16, 24, 8
    c = widths(name)[0]
    stored = stored_rows(name, nh * (dn + dv), c, rng)
    heads = formats.decoded(formats.get(name), stored).reshape(nh, dn + dv, c)  # [nh, dn+dv, c]
    compact = device_ops.CompactKvB(name, upload(cp, name, stored), nh, dn, dv, c)
    q = cp.asarray(rng.standard_normal((T, nh, dn + dr)).astype(np.float32))
    latent, k_rope = (cp.asarray(rng.standard_normal((S, n)).astype(np.float32)) for n in (c, dr))
    mask = cp.asarray(ops.attention_mask(np.arange(S - T, S), np.arange(S), None))
    rows = MlaRows(q[..., :dn], q[..., dn:], latent, k_rope)
    want = device_ops.mla_attention_absorbed(rows, cp.asarray(heads[:, :dn]),
                                             cp.asarray(np.ascontiguousarray(heads[:, dn:].transpose(0, 2, 1))),
                                             mask, (dn + dr) ** -0.5)
    got = device_ops.mla_attention_absorbed(rows, compact, None, mask, (dn + dr) ** -0.5)
    assert got.shape == (T, nh * dv)
    got, want = cp.asnumpy(got), cp.asnumpy(want)  # a file format's random blocks span many magnitudes:
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), name  # float32 sums of its largest terms
