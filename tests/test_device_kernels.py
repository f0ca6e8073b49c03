"""device_ops' CUDA kernels against float64 NumPy: on a GPU through CuPy (`-m gpu`, tools/gpu_check.sh), and
everywhere else through tests/cuda_emulator.py (the same CUDA source built for the CPU, each block's threads
as OS threads), so CI checks their indexing and synchronisation without a GPU."""

from __future__ import annotations

import contextlib
import sys
from unittest import mock

import numpy as np
import pytest

import cuda_emulator
from coordinator.model import device_ops, ops
from coordinator.model.backend import probe_cuda


@pytest.fixture(params=[pytest.param("cuda", marks=pytest.mark.gpu), "emulated"])
def cp(request, tmp_path_factory, monkeypatch):
    """CuPy on a GPU, or the emulator's stand-in for it (device_ops imports ``cupy`` when called)."""
    if request.param == "cuda":
        usable, why = probe_cuda()
        if not usable:
            pytest.skip(f"no usable GPU: {why}")
        import cupy

        yield cupy
        return
    ok, why = cuda_emulator.available()
    if not ok:
        pytest.skip(why)
    monkeypatch.setitem(sys.modules, "cupy", cuda_emulator.cupy_shim(tmp_path_factory.getbasetemp()))
    device_ops._module.cache_clear()
    device_ops._kernel.cache_clear()
    yield sys.modules["cupy"]
    device_ops._module.cache_clear()  # the next user gets the real module's kernels
    device_ops._kernel.cache_clear()


def _device(cp):
    """ops treats cp's arrays as device arrays: CuPy's are; the emulator's NumPy arrays only inside this."""
    return mock.patch.object(ops, "is_device", lambda a: True) if getattr(cp, "EMULATED", False) \
        else contextlib.nullcontext()


def _softmax64(scores: np.ndarray, mask: np.ndarray, scale: float) -> np.ndarray:
    s = np.where(mask, scores.astype(np.float64) * scale, -np.inf)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_fused_device_kernels_match_float64(cp):
    """device_ops' one-launch kernels against float64 NumPy: rows shorter and longer than a block, several
    leading dimensions, partial rotary, sliding windows, silu's tails."""
    cupy = cp
    rng = np.random.default_rng(7)
    for shape in [(1, 1), (3, 5), (2, 127), (2, 128), (3, 129), (4, 2048), (2, 4, 128), (1, 7168)]:
        x = (rng.standard_normal(shape) * 3).astype(np.float32)
        w = rng.standard_normal(shape[-1]).astype(np.float32)
        got = cupy.asnumpy(device_ops.rms_norm(cupy.asarray(x), cupy.asarray(w), 1e-6))
        x64 = x.astype(np.float64)
        want = x64 / np.sqrt(np.mean(x64**2, axis=-1, keepdims=True) + 1e-6) * w
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6, err_msg=str(shape))

    for hd, d in [(64, 64), (128, 64), (64, 32)]:  # full and partial rotary (GLM-4.5)
        T, heads = 3, 4
        x = rng.standard_normal((T, heads, hd)).astype(np.float32)
        cos, sin = ops.rope_cos_sin(np.arange(40, 40 + T), ops.rope_inv_freq(d, 1e6))  # [T, d]
        got = cupy.asnumpy(device_ops.apply_rope(cupy.asarray(x), cupy.asarray(cos), cupy.asarray(sin)))
        want = ops.apply_rope(x.astype(np.float64), cos.astype(np.float64), sin.astype(np.float64))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"hd {hd} d {d}")
        assert np.array_equal(got[..., d:], x[..., d:])

    for T, S, window in [(1, 1, None), (1, 37, None), (4, 37, None), (4, 37, 5), (3, 300, None), (2, 300, 128)]:
        q_pos = np.arange(S - T, S)
        mask = ops.attention_mask(q_pos, np.arange(S), window)  # [T, S]
        scores = (rng.standard_normal((2, 3, T, S)) * 5).astype(np.float32)
        got = cupy.asnumpy(device_ops.masked_softmax(cupy.asarray(scores), cupy.asarray(mask), 0.125))
        np.testing.assert_allclose(got, _softmax64(scores, mask, 0.125), rtol=1e-5, atol=1e-7,
                                   err_msg=f"T {T} S {S} window {window}")
        assert np.all(got[..., ~mask] == 0)

    g = np.concatenate([np.linspace(-100, 100, 4001), [0.0, -1e-30, 1e-30, 88.0, -88.0]]).astype(np.float32)
    u = rng.standard_normal(g.size).astype(np.float32)
    got = cupy.asnumpy(device_ops.silu_mul(cupy.asarray(g), cupy.asarray(u)))
    g64 = g.astype(np.float64)
    np.testing.assert_allclose(got, g64 / (1 + np.exp(-g64)) * u, rtol=1e-5, atol=1e-30)


def _attention64(q, k, v, mask):
    """q [T, nh, hd], k/v [S, nkv, hd], mask [T, S] -> [T, nh*hd] in float64."""
    T, nh, hd = q.shape
    group = nh // k.shape[1]
    kh = np.repeat(k.astype(np.float64), group, axis=1)  # [S, nh, hd]
    vh = np.repeat(v.astype(np.float64), group, axis=1)
    scores = np.einsum("thd,shd->hts", q.astype(np.float64), kh)  # [nh, T, S]
    return np.einsum("hts,shd->thd", _softmax64(scores, mask, hd**-0.5), vh).reshape(T, nh * hd)


def test_device_attention_norm_rope_and_residual_norm_match_float64(cp):
    """The decode step's remaining one-launch kernels: the attention of a few tokens over the cache (groups of
    1, 4 and 8 heads, head dims below, at and above the block, windows, long contexts), q/k norm + RoPE read
    from the fused QKV output's column slices, and the residual add joined to the next norm. Against float64,
    and bitwise against the separate kernels they join."""
    cupy = cp
    rng = np.random.default_rng(11)
    cases = [(1, 1, 4, 4, 64, None), (1, 37, 32, 4, 128, None), (4, 37, 8, 1, 64, 5), (2, 150, 2, 1, 256, 100),
             (9, 20, 4, 2, 32, None)]
    if not getattr(cp, "EMULATED", False):  # longer contexts, many tokens: a GPU's work, minutes in the emulator
        cases += [(3, 300, 16, 2, 128, None), (2, 1030, 8, 2, 256, 700), (64, 70, 4, 2, 32, None)]
    for T, S, nh, nkv, hd, window in cases:
        q = rng.standard_normal((T, nh, hd)).astype(np.float32)
        k, v = (rng.standard_normal((2, S, nkv, hd)) * 2).astype(np.float32)
        mask = ops.attention_mask(np.arange(S - T, S), np.arange(S), window)  # [T, S]
        got = cupy.asnumpy(device_ops.gqa_attention(*map(cupy.asarray, (q, k, v, mask)), hd**-0.5))
        np.testing.assert_allclose(got, _attention64(q, k, v, mask), rtol=2e-5, atol=2e-6,
                                   err_msg=f"T {T} S {S} heads {nh}/{nkv} hd {hd} window {window}")
        with _device(cp):
            routed = cupy.asnumpy(ops.gqa_attention(*map(cupy.asarray, (q, k, v, mask))))  # ops sends T <= 64 here
        assert np.array_equal(routed, got)

    for T, heads, kv, hd, d in [(1, 32, 4, 128, 128), (5, 8, 2, 64, 32), (2, 4, 1, 256, 256)]:
        fused = (rng.standard_normal((T, (heads + 2 * kv) * hd)) * 3).astype(np.float32)  # the QKV output
        w = rng.standard_normal(hd).astype(np.float32)
        cos, sin = ops.rope_cos_sin(np.arange(9, 9 + T), ops.rope_inv_freq(d, 1e6))  # [T, d]
        dev = cupy.asarray(fused)
        k_dev = dev[:, heads * hd : (heads + kv) * hd].reshape(T, kv, hd)  # a column slice, rows apart
        assert T == 1 or not k_dev.flags.c_contiguous
        cd, sd = cupy.asarray(cos), cupy.asarray(sin)
        for weight in (w, None):
            got = device_ops.norm_rope(k_dev, None if weight is None else cupy.asarray(weight), 1e-6, cd, sd)
            k64 = fused[:, heads * hd : (heads + kv) * hd].reshape(T, kv, hd).astype(np.float64)
            if weight is not None:
                k64 = k64 / np.sqrt(np.mean(k64**2, axis=-1, keepdims=True) + 1e-6) * weight
            want = ops.apply_rope(k64, cos.astype(np.float64), sin.astype(np.float64))
            np.testing.assert_allclose(cupy.asnumpy(got), want, rtol=1e-5, atol=1e-5, err_msg=f"hd {hd} d {d}")
            apart = cupy.ascontiguousarray(k_dev)
            if weight is not None:
                apart = device_ops.rms_norm(apart, cupy.asarray(weight), 1e-6)
            assert cupy.array_equal(got, device_ops.apply_rope(apart, cd, sd))  # rms_norm's, then the rope

    for shape in [(1, 512), (3, 129), (2, 7168)]:
        h, delta = rng.standard_normal((2, *shape)).astype(np.float32)
        w = rng.standard_normal(shape[-1]).astype(np.float32)
        total, normed = device_ops.add_rms_norm(cupy.asarray(h), cupy.asarray(delta), cupy.asarray(w), 1e-6)
        assert cupy.array_equal(total, cupy.asarray(h) + cupy.asarray(delta))
        assert cupy.array_equal(normed, device_ops.rms_norm(total, cupy.asarray(w), 1e-6))
        s64 = h.astype(np.float64) + delta
        want = s64 / np.sqrt(np.mean(s64**2, axis=-1, keepdims=True) + 1e-6) * w
        np.testing.assert_allclose(cupy.asnumpy(normed), want, rtol=2e-6, atol=1e-6, err_msg=str(shape))


