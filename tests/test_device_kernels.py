"""device_ops' CUDA kernels against float64 NumPy: on a GPU through CuPy (`-m gpu`, tools/gpu_check.sh), and
everywhere else through tests/cuda_emulator.py (the same CUDA source built for the CPU, each block's threads
as OS threads), so CI checks their indexing and synchronisation without a GPU."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.model import ops
from coordinator.model.ops import MlaRows
from coordinator.gpu import ops as device_ops
from coordinator.gpu.backend import GpuBackend
from shm.formats import bf16


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
        routed = cupy.asnumpy(GpuBackend(cp).gqa_attention(*map(cupy.asarray, (q, k, v, mask))))  # T <= 64: here
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


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), shm/formats/bf16's rounding."""
    out = np.empty(x.shape, np.uint16)
    bf16.encode_into(out, x)
    return out


def _widened(bits: np.ndarray) -> np.ndarray:
    out = np.empty(bits.shape, np.float32)
    bf16.decode_into(out, bits)
    return out


def test_bf16_conversions_match_the_bf16_format(cp):
    """to_bf16 rounds as shm/formats/bf16.encode_into (ties to even, NaN kept NaN, overflow to infinity) bit for
    bit, into a fresh array or in place into a cache buffer's rows; from_bf16 widens every bf16 pattern exactly."""
    cupy = cp
    rng = np.random.default_rng(5)
    special = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x7F7FFFFF,
                        0xFF7FFFFF, 0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x00000001, 0x00008000,
                        0x807FFFFF, 0x7F7F8000, 0x7FFF8000], np.uint32)
    bits = np.concatenate([special, rng.integers(0, 1 << 32, 3000, dtype=np.uint32)])  # NaNs, denormals, all
    x = bits.view(np.float32).reshape(-1, 6)  # [503, 6]
    got = cupy.asnumpy(device_ops.to_bf16(cupy.asarray(x)))
    assert got.dtype == np.uint16 and got.shape == x.shape
    assert np.array_equal(got, _bf16(x))

    cache = cupy.asarray(np.full((9, 2, 6), 0xABCD, np.uint16))  # [capacity, ...] a cache buffer
    rows = x[:6].reshape(3, 2, 6)
    dest = cache[4:7]
    assert device_ops.to_bf16(cupy.asarray(rows), out=dest) is dest
    after = cupy.asnumpy(cache)
    assert np.array_equal(after[4:7], _bf16(rows))
    assert np.all(after[:4] == 0xABCD) and np.all(after[7:] == 0xABCD)
    kv_column = cupy.asarray(x)[:, None, 2:]  # [R, 1, 4], its rows apart and an axis of one
    assert np.array_equal(cupy.asnumpy(device_ops.to_bf16(kv_column)), _bf16(x[:, None, 2:]))
    fused = x.reshape(-1)[:60].reshape(3, 20)
    qkv = cupy.asarray(fused)  # the fused QKV output, V its last 12 columns: rows apart
    v = qkv[:, 8:].reshape(3, 2, 6)
    assert not v.flags.c_contiguous
    device_ops.to_bf16(v, out=cache[1:4])
    assert np.array_equal(cupy.asnumpy(cache[1:4]), _bf16(fused[:, 8:].reshape(3, 2, 6)))
    assert np.array_equal(cupy.asnumpy(cache[4:7]), _bf16(rows))
    with pytest.raises(ValueError):
        device_ops.to_bf16(cupy.asarray(rows[..., :3]), out=cache[4:7, :, :3])  # out's rows apart: not in place

    every = np.arange(1 << 16, dtype=np.uint16)
    got = cupy.asnumpy(device_ops.from_bf16(cupy.asarray(every.reshape(256, 256))))
    assert got.dtype == np.float32 and got.shape == (256, 256)
    assert np.array_equal(got.view(np.uint32).reshape(-1), _widened(every).view(np.uint32))


def test_device_attention_reads_a_bf16_cache(cp):
    """gqa_attention over bf16 K/V bits: equal bit for bit to the float32 kernel over the widened values (a lone
    bf16 one is widened first), and to float64 as that one is."""
    cupy = cp
    rng = np.random.default_rng(13)
    for T, S, nh, nkv, hd, window in [(1, 37, 8, 2, 64, None), (3, 20, 4, 4, 32, 6), (2, 9, 2, 1, 160, None)]:
        q = rng.standard_normal((T, nh, hd)).astype(np.float32)
        k, v = (_bf16((rng.standard_normal((S, nkv, hd)) * 2).astype(np.float32)) for _ in range(2))
        mask = ops.attention_mask(np.arange(S - T, S), np.arange(S), window)  # [T, S]
        qd, md = cupy.asarray(q), cupy.asarray(mask)
        got = cupy.asnumpy(device_ops.gqa_attention(qd, cupy.asarray(k), cupy.asarray(v), md, hd**-0.5))
        wide = cupy.asnumpy(device_ops.gqa_attention(qd, cupy.asarray(_widened(k)), cupy.asarray(_widened(v)), md,
                                                     hd**-0.5))
        assert np.array_equal(got, wide), (T, S, nh, nkv, hd)
        np.testing.assert_allclose(got, _attention64(q, _widened(k), _widened(v), mask), rtol=2e-5, atol=2e-6)
        mixed = device_ops.gqa_attention(qd, cupy.asarray(k), cupy.asarray(_widened(v)), md, hd**-0.5)
        assert np.array_equal(cupy.asnumpy(mixed), wide)


def _rope_interleaved64(x, cos, sin):
    """x [T, heads, d] -> DeepSeek's interleaved rotation, de-interleaved, in float64 from the pairs' angles."""
    half = x.shape[-1] // 2
    x = x.astype(np.float64)
    c, s = cos[:, None, :half].astype(np.float64), sin[:, None, :half].astype(np.float64)
    even, odd = x[..., 0::2], x[..., 1::2]
    return np.concatenate([even * c - odd * s, odd * c + even * s], axis=-1)


def test_device_interleaved_rope_matches_float64(cp):
    """apply_rope_interleaved in one launch, reading q's rope columns and kv_a's rope key where they lie (rows
    and heads apart), against float64, and equal to it on a contiguous copy."""
    cupy = cp
    rng = np.random.default_rng(17)
    for T, nh, dn, dr, c in [(1, 4, 16, 8, 32), (5, 3, 16, 64, 32), (2, 16, 128, 64, 512)]:
        q = rng.standard_normal((T, nh, dn + dr)).astype(np.float32)  # a q projection's output
        ckv = rng.standard_normal((T, c + dr)).astype(np.float32)  # kv_a's output: latent, rope key
        cos, sin = ops.rope_cos_sin(np.arange(30, 30 + T), ops.yarn_inv_freq(dr, 1e4, 40, 4096, 32, 1))  # [T, dr]
        cd, sd = cupy.asarray(cos), cupy.asarray(sin)
        q_rope = cupy.asarray(q)[..., dn:]  # [T, nh, dr], rows and heads apart
        k_rope = cupy.asarray(ckv)[:, None, c:]  # [T, 1, dr], rows apart
        for x, want in [(q_rope, _rope_interleaved64(q[..., dn:], cos, sin)),
                        (k_rope, _rope_interleaved64(ckv[:, None, c:], cos, sin))]:
            got = device_ops.apply_rope_interleaved(x, cd, sd)
            assert got.shape == want.shape
            np.testing.assert_allclose(cupy.asnumpy(got), want, rtol=1e-5, atol=1e-6, err_msg=f"T {T} dr {dr}")
            assert cupy.array_equal(got, device_ops.apply_rope_interleaved(cupy.ascontiguousarray(x), cd, sd))


def _mla64(q_nope, q_rope, latent, k_rope, w_uk, w_uv_t, mask, scale):
    """The attention of T tokens' nh heads over S cached latents, from its definition in float64: keys
    (W_uk latent, k_rope), values W_uv latent (W_uv = w_uv_t's transpose). -> [T, nh*dv]."""
    f = np.float64
    lat_t = latent.astype(f).T  # [c, S]
    k_nope = w_uk.astype(f) @ lat_t  # [nh, dn, S]
    v = w_uv_t.astype(f).transpose(0, 2, 1) @ lat_t  # [nh, dv, S]
    scores = q_nope.astype(f).transpose(1, 0, 2) @ k_nope + q_rope.astype(f).transpose(1, 0, 2) @ k_rope.astype(f).T
    out = _softmax64(scores, mask, scale) @ v.transpose(0, 2, 1)  # [nh, T, dv]
    return out.transpose(1, 0, 2).reshape(out.shape[1], -1)


def test_device_mla_attention_matches_float64(cp):
    """mla_attention_absorbed (three launches) against the attention's float64 definition: query rows of several
    tokens in one block (nh 3), more tokens than a block's, latent widths below and above a block, v dims that
    split a block unevenly and exceed it, windows that mask whole chunks and tiles, the keys split in chunks and
    not, chunks longer than a block's tile (the online softmax across tiles); q's
    parts read where they lie in q. A bf16 cache gives the float32 kernel's result on the widened values."""
    cupy = cp
    assert f"#define MLA_ROWS {device_ops.MLA_ROWS}\n" in device_ops._SOURCE
    rng = np.random.default_rng(19)
    #        T,   S,  nh, dn, dr,   c,  dv, window, splits
    cases = [(1, 1, 4, 16, 8, 32, 16, None, None), (1, 37, 4, 16, 8, 64, 16, None, 3),
             (4, 37, 4, 16, 8, 32, 16, 5, 4), (3, 40, 3, 16, 8, 32, 24, None, None), (10, 12, 2, 8, 8, 32, 16, 4, 2),
             (2, 24, 2, 16, 8, 160, 16, None, 2), (1, 10, 2, 16, 8, 32, 144, None, 1),
             (1, 3000, 4, 16, 8, 64, 16, None, 1), (2, 3000, 2, 16, 8, 32, 16, 700, 3)]  # chunks of several tiles
    if not getattr(cp, "EMULATED", False):  # DeepSeek-V3's shapes, long contexts, prefill: a GPU's work
        cases += [(1, 1000, 128, 128, 64, 512, 128, None, None), (1, 5000, 16, 128, 64, 512, 128, None, None),
                  (4, 300, 128, 128, 64, 512, 128, None, None), (64, 700, 16, 128, 64, 512, 128, None, None),
                  (3, 2000, 16, 128, 64, 512, 128, 1000, 5)]
    for T, S, nh, dn, dr, c, dv, window, splits in cases:
        q = rng.standard_normal((T, nh, dn + dr)).astype(np.float32)  # [T, nh, dn+dr] q's heads
        latent = rng.standard_normal((S, c)).astype(np.float32)
        k_rope = rng.standard_normal((S, dr)).astype(np.float32)
        kv_b = (rng.standard_normal((nh, dn + dv, c)) / np.sqrt(c)).astype(np.float32)  # kv_b_proj's heads
        w_uk = np.ascontiguousarray(kv_b[:, :dn])  # [nh, dn, c]
        w_uv_t = np.ascontiguousarray(kv_b[:, dn:].transpose(0, 2, 1))  # [nh, c, dv]
        mask = ops.attention_mask(np.arange(S - T, S), np.arange(S), window)  # [T, S]
        scale = (dn + dr) ** -0.5
        qd, kv_b_dev = cupy.asarray(q), cupy.asarray(kv_b)
        weights = cupy.asarray(w_uk), cupy.asarray(w_uv_t), cupy.asarray(mask), scale
        rows = MlaRows(qd[..., :dn], qd[..., dn:], cupy.asarray(latent), cupy.asarray(k_rope))
        got = device_ops.mla_attention_absorbed(rows, *weights, splits=splits)
        what = f"T {T} S {S} nh {nh} c {c} dv {dv} window {window} splits {splits}"
        want = _mla64(q[..., :dn], q[..., dn:], latent, k_rope, w_uk, w_uv_t, mask, scale)
        np.testing.assert_allclose(cupy.asnumpy(got), want, rtol=5e-5, atol=5e-6, err_msg=what)
        views = device_ops.mla_attention_absorbed(  # the weights read in kv_b's rows, nothing copied
            rows, kv_b_dev[:, :dn], kv_b_dev[:, dn:].transpose(0, 2, 1), *weights[2:], splits=splits)
        assert cupy.array_equal(views, got), what
        lat16, kr16 = _bf16(latent), _bf16(k_rope)
        from16 = device_ops.mla_attention_absorbed(
            MlaRows(qd[..., :dn], qd[..., dn:], cupy.asarray(lat16), cupy.asarray(kr16)), *weights, splits=splits)
        widened = device_ops.mla_attention_absorbed(
            MlaRows(qd[..., :dn], qd[..., dn:], cupy.asarray(_widened(lat16)), cupy.asarray(_widened(kr16))),
            *weights, splits=splits)
        assert cupy.array_equal(from16, widened), what


@pytest.mark.slow  # 262,144 keys through the emulator
def test_split_k_attention_matches_float64_at_long_contexts(cp):
    """gqa_attention split over the keys (a block a split of up to GQA_TILE-key tiles, online softmax, the splits
    merged in order) against float64 for one decode token over 1,024, 32,768 and 262,144 keys (4, 32 and 32
    splits; a sliding window at 32K), and the cached form over two sequences' caches of 1,000 and 33,000 keys
    (read through the tables, the mask made in the kernel) equal to the eager form bit for bit."""
    cupy = cp
    rng = np.random.default_rng(23)
    nh, nkv, hd = 4, 1, 64
    for S, window in [(1024, None), (32768, None), (32768, 4000), (262144, None)]:
        q = rng.standard_normal((1, nh, hd)).astype(np.float32)
        k, v = (rng.standard_normal((2, S, nkv, hd)) * 2).astype(np.float32)
        mask = ops.attention_mask(np.array([S - 1]), np.arange(S), window)  # [1, S]
        got = cupy.asnumpy(device_ops.gqa_attention(*map(cupy.asarray, (q, k, v, mask)), hd**-0.5))
        np.testing.assert_allclose(got, _attention64(q, k, v, mask), rtol=2e-5, atol=2e-6,
                                   err_msg=f"S {S} window {window} ({device_ops.gqa_splits(S)[0]} splits)")
    from coordinator.gpu.format_kernels import address

    lengths = [1000, 33000]
    caches = [(rng.standard_normal((2, S, nkv, hd)) * 2).astype(np.float32) for S in lengths]
    kd = [(cupy.asarray(c[0]), cupy.asarray(c[1])) for c in caches]
    q = rng.standard_normal((2, nh, hd)).astype(np.float32)
    tables = [np.array([address(k) for k, _ in kd]), np.array([address(v) for _, v in kd]), np.arange(2),
              np.array(lengths) - 1, np.array(lengths)]
    got = cupy.asnumpy(device_ops.gqa_attention_cached(cupy.asarray(q), [cupy.asarray(t.astype(np.int64))
                                                                         for t in tables], None, hd**-0.5, nkv,
                                                       40000, False))
    for s, ((k, v), S) in enumerate(zip(kd, lengths)):
        mask = cupy.asarray(ops.attention_mask(np.array([S - 1]), np.arange(S), None))
        want = cupy.asnumpy(device_ops.gqa_attention(cupy.asarray(q[s:s + 1]), k, v, mask, hd**-0.5))
        assert np.array_equal(got[s:s + 1], want), S


def test_a_rows_device_attention_is_the_same_bits_alone_and_among_a_chunks_rows(cp):
    """Each query row splits its own keys (its position + 1: gqa_splits of that), never the step's: a chunk of 6
    rows over 700 keys (3 splits for the last row, 2 for a row at 300) gives every row the bits it gets alone over
    the keys it sees, eager (the mask made by the caller) and cached (made in the kernel)."""
    cupy = cp
    from coordinator.gpu.format_kernels import address

    rng = np.random.default_rng(31)
    nh, nkv, hd, S = 4, 2, 32, 700
    positions = np.array([0, 255, 256, 300, 512, S - 1])  # across the split boundaries of every count
    q = rng.standard_normal((len(positions), nh, hd)).astype(np.float32)
    k, v = (rng.standard_normal((2, S, nkv, hd)) * 2).astype(np.float32)
    kd, vd = cupy.asarray(k), cupy.asarray(v)
    mask = ops.attention_mask(positions, np.arange(S), None)  # [6, S]
    chunk = cupy.asnumpy(device_ops.gqa_attention(cupy.asarray(q), kd, vd, cupy.asarray(mask), hd**-0.5))
    tables = [cupy.asarray(np.array(t, np.int64)) for t in
              ([address(kd)], [address(vd)], np.zeros(len(positions)), positions, [S])]
    cached = cupy.asnumpy(device_ops.gqa_attention_cached(cupy.asarray(q), tables, None, hd**-0.5, nkv, S, False))
    for t, pos in enumerate(positions):
        n = int(pos) + 1
        alone = cupy.asnumpy(device_ops.gqa_attention(cupy.asarray(q[t:t + 1]), kd[:n], vd[:n],
                                                      cupy.asarray(np.ones((1, n), bool)), hd**-0.5))
        assert np.array_equal(chunk[t:t + 1], alone) and np.array_equal(cached[t:t + 1], alone), pos
    assert device_ops.gqa_splits(S)[0] != device_ops.gqa_splits(301)[0]  # the step's count would split otherwise
