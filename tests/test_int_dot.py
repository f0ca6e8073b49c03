"""Integer dot products on activations quantised per block of 32 (activations.py, idot.py, isimd.py):
the quantiser against its NumPy form, every lowering of the 32-product sum against exact integers, and the
node's and the dense matrices' decode against float64 on the dequantised weights and quantised activations."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from coordinator.config import EngineConfig
from coordinator.errors import ConfigValueError
from coordinator.model.packed import PackedMatrix
from node_worker.kernels import idot
from node_worker.kernels.activations import quantize_reference, quantize_rows
from node_worker.worker import NodeWorker
from shm import formats
from shm.expert_source import ExpertSlice
from shm.expert_store import HeapExpertStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from kernel_bench import stored_rows  # noqa: E402  (random rows of a format: encoded, or a GGUF type's blocks)

INT_FORMATS = ["q8", "q4", "q4k", "q5k", "q6k", "iq4xs"]
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


def test_quantised_activations_are_the_numpy_form_and_within_half_a_step():
    x = activations(np.random.default_rng(0), 5, 256)
    got, want = quantize_rows(x), quantize_reference(x)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and np.array_equal(g, w)
    xq, xd, xs = got
    assert np.abs(xq).max() == 127 and not xq[0, :32].any() and xd[0, 0] == 0
    step = np.repeat(xd, 32, axis=1)
    assert np.all(np.abs(x - dequantised(x)) <= step / 2 * (1 + 1e-6))
    np.testing.assert_allclose(xs, xd * xq.reshape(5, 8, 32).sum(axis=2), rtol=1e-6)


@pytest.mark.parametrize("lowering", idot.LOWERINGS)
@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
def test_every_lowering_sums_the_products_exactly(lowering, signed):
    """The kernels compile only the host's lowering; each is compiled here on its own and checked on the
    extremes (q = -128 signed, 128 unsigned: the largest the AVX2 pairs take without saturating)."""
    from llvmlite import ir
    from numba import njit, types
    from numba.extending import intrinsic

    from node_worker.kernels.ir import I8, I32, LANES

    features = {n for n, on in __import__("llvmlite.binding").binding.get_host_cpu_features().items() if on}
    if lowering == "vnni" and not ({"avx512vnni", "avx512vl"} <= features or "avxvnni" in features):
        pytest.skip("no VNNI on this host")
    if lowering == "avx2" and "avx2" not in features:
        pytest.skip("no AVX2 on this host")
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


def _float64_expert(mats, name, x):
    """float64 SwiGLU on the dequantised weights, with x and h quantised as the kernels quantise them."""
    g, u, d = (formats.decoded(formats.get(name), m).astype(np.float64) for m in mats)
    xs = dequantised(x)
    a, b = xs @ g.T, xs @ u.T
    h = (a / (1 + np.exp(-a)) * b).astype(np.float32)
    return dequantised(h) @ d.T


@pytest.mark.parametrize("name", INT_FORMATS)
def test_node_decode_with_integer_dots_equals_float64_on_the_quantised_activations(name):
    """Three tokens, each routed alone to its own expert (decode's four rows at a time, integer dots):
    within float32 rounding of float64 on the dequantised weights and the quantised activations, and away
    from the float-activation result by the activations' rounding (so the integer path is the one taken)."""
    fmt = formats.get(name)
    rng = np.random.default_rng(5)
    experts = {(0, e): [stored_rows(fmt, rows, width, rng) for rows, width in ((R, H), (R, H), (H, R))]
               for e in range(3)}
    store = HeapExpertStore(0, {k: ExpertSlice(*m, name) for k, m in experts.items()}, name)
    x = activations(rng, 3, H)
    tokens, routed, weights = np.arange(3), np.array([2, 0, 1]), np.array([0.5, 1.0, 2.0], np.float32)
    got = {}
    for acts in ("q8", "f32"):
        worker = NodeWorker(0, store, H, threads=2, activations=acts)
        got[acts] = worker.compute(0, x, tokens, routed, weights).copy()
        worker.runner.close()
    store.close()
    want = np.stack([w * _float64_expert(experts[(0, e)], name, x[t:t + 1])[0]
                     for t, e, w in zip(tokens, routed, weights)])
    scale = np.abs(want).max()
    error = np.abs(got["q8"] - want).max()
    assert error <= 2e-6 * scale
    assert np.abs(got["f32"] - got["q8"]).max() > 100 * error


@pytest.mark.parametrize("name", ["q8", "q4"])
def test_dense_matrix_few_tokens_with_integer_dots_equals_float64(name):
    rng = np.random.default_rng(6)
    w = (rng.standard_normal((70, 256)) * 0.05).astype(np.float32)  # 70 rows: a short last group of four
    x = activations(rng, 3, 256)
    int_path = PackedMatrix.encode(w, formats.get(name), int_act=True)
    float_path = PackedMatrix.encode(w, formats.get(name))
    got = x @ int_path.T
    want = dequantised(x) @ int_path.decoded().astype(np.float64).T
    scale = np.abs(want).max()
    error = np.abs(got - want).max()
    assert error <= 2e-6 * scale
    assert np.abs((x @ float_path.T) - got).max() > 100 * error


def test_activations_setting_is_checked():
    assert EngineConfig().activations == "q8"
    with pytest.raises(ConfigValueError, match="activations must be one of q8, f32"):
        EngineConfig(activations="int4")
