"""Each decoder op against its formula, written out here element by element."""

from __future__ import annotations

import math

import numpy as np
import pytest

from coordinator.host import backend as host
from coordinator.model import ops
from coordinator.model.ops import RouterSpec
from coordinator.host import ops as host_ops
from coordinator.model.sampling import Sampler, SamplingParams, filtered_probs

rng = np.random.default_rng(0)


def test_rms_norm_formula():
    x = rng.standard_normal((3, 8)).astype(np.float32)
    w = rng.standard_normal(8).astype(np.float32)
    got = host.rms_norm(x, w, 1e-6)
    for t in range(3):
        rms = math.sqrt(sum(float(v) ** 2 for v in x[t]) / 8 + 1e-6)
        for j in range(8):
            assert got[t, j] == pytest.approx(w[j] * x[t, j] / rms, rel=1e-5, abs=1e-6)


def test_softmax_and_silu_and_sigmoid():
    x = np.array([[-1000.0, 0.0, 3.0], [5.0, 5.0, 5.0]], np.float32)
    s = ops.softmax(x)
    e = [math.exp(v - 3.0) for v in (-1000.0, 0.0, 3.0)]
    assert s[0] == pytest.approx([v / sum(e) for v in e], abs=1e-7)
    assert s[1] == pytest.approx([1 / 3] * 3)
    v = np.array([-80.0, -2.0, 0.0, 1.5, 80.0], np.float32)
    assert ops.silu(v) == pytest.approx([a / (1 + math.exp(-a)) for a in v.tolist()], abs=1e-6)
    assert ops.sigmoid(v) == pytest.approx([1 / (1 + math.exp(-a)) for a in v.tolist()], abs=1e-7)


def test_rope_rotates_half_pairs():
    hd, theta = 8, 10000.0
    x = rng.standard_normal((4, 2, hd)).astype(np.float32)  # [T, heads, hd]
    pos = np.array([0, 1, 7, 100])
    cos, sin = ops.rope_cos_sin(pos, ops.rope_inv_freq(hd, theta))
    got = host.apply_rope(x, cos, sin)
    for t, p in enumerate(pos):
        for h in range(2):
            for i in range(hd // 2):
                ang = p / theta ** (2 * i / hd)
                a, b = float(x[t, h, i]), float(x[t, h, i + hd // 2])
                assert got[t, h, i] == pytest.approx(a * math.cos(ang) - b * math.sin(ang), abs=1e-5)
                assert got[t, h, i + hd // 2] == pytest.approx(b * math.cos(ang) + a * math.sin(ang), abs=1e-5)
    assert np.allclose(got[0], x[0])  # position 0 is the identity


def test_linear_rope_scaling_divides_positions():
    a = ops.rope_cos_sin(np.array([8]), ops.rope_inv_freq(16, 1e4, factor=4.0))
    b = ops.rope_cos_sin(np.array([2]), ops.rope_inv_freq(16, 1e4))
    assert np.allclose(a[0], b[0]) and np.allclose(a[1], b[1])


def test_gqa_attention_formula():
    T, S, nh, nkv, hd = 3, 5, 4, 2, 4
    q = rng.standard_normal((T, nh, hd)).astype(np.float32)
    k = rng.standard_normal((S, nkv, hd)).astype(np.float32)
    v = rng.standard_normal((S, nkv, hd)).astype(np.float32)
    qpos = np.array([2, 3, 4])
    mask = ops.attention_mask(qpos, np.arange(S), None)
    got = host.gqa_attention(q, k, v, mask).reshape(T, nh, hd)
    for t in range(T):
        for h in range(nh):
            kv = h // (nh // nkv)
            scores = [float(q[t, h] @ k[j, kv]) / math.sqrt(hd) for j in range(qpos[t] + 1)]
            m = max(scores)
            w = [math.exp(s - m) for s in scores]
            want = sum(w[j] / sum(w) * v[j, kv] for j in range(len(w)))
            assert got[t, h] == pytest.approx(want, abs=1e-5)


def test_sliding_window_mask():
    m = ops.attention_mask(np.array([5]), np.arange(6), window=3)
    assert m.tolist() == [[False, False, False, True, True, True]]
    causal = ops.attention_mask(np.array([0, 1]), np.arange(2), None)
    assert causal.tolist() == [[True, False], [True, True]]


@pytest.mark.parametrize("normalize", [True, False])
def test_router_top_k(normalize):
    logits = rng.standard_normal((6, 8)).astype(np.float32)
    ids, w = host.route(logits, None, RouterSpec(3, normalize=normalize))
    for t in range(6):
        p = np.exp(logits[t] - logits[t].max())
        p /= p.sum()
        top = sorted(range(8), key=lambda e: -p[e])[:3]
        assert ids[t].tolist() == top
        want = p[top] / (p[top].sum() if normalize else 1.0)
        assert w[t] == pytest.approx(want, rel=1e-5)


def test_swiglu_formula():
    x = rng.standard_normal((2, 6)).astype(np.float32)
    g, u = rng.standard_normal((5, 6)).astype(np.float32), rng.standard_normal((5, 6)).astype(np.float32)
    d = rng.standard_normal((6, 5)).astype(np.float32)
    got = ops.swiglu_mlp(x, g, u, d)
    for t in range(2):
        hidden = [(g[i] @ x[t]) / (1 + math.exp(-(g[i] @ x[t]))) * (u[i] @ x[t]) for i in range(5)]
        assert got[t] == pytest.approx(d @ np.array(hidden), abs=1e-4)


def test_greedy_and_seeded_sampling():
    logits = np.array([0.1, 2.0, 1.9, -1.0], np.float32)
    assert Sampler(SamplingParams())(logits) == 1
    draws = [Sampler(SamplingParams(temperature=1.0, seed=s))(logits) for s in range(40)]
    assert draws == [Sampler(SamplingParams(temperature=1.0, seed=s))(logits) for s in range(40)]
    assert len(set(draws)) > 1


def test_top_k_and_top_p_filters():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert p == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0, 0])
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.79))
    assert p == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0, 0])
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.81))
    assert p == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.3))
    assert p == pytest.approx([1, 0, 0, 0])
    p = filtered_probs(logits, SamplingParams(temperature=0.5))
    want = np.array([0.5, 0.3, 0.15, 0.05]) ** 2
    assert p == pytest.approx(want / want.sum())


def test_sampling_params_refuse_bad_values():
    from coordinator.errors import ConfigValueError
    for bad in (dict(temperature=-1), dict(top_k=-2), dict(top_p=0), dict(top_p=1.5)):
        with pytest.raises(ConfigValueError):
            SamplingParams(**bad)


def test_rms_norm_of_a_column_slice_is_the_contiguous_rows_result():
    """host.rms_norm of the q heads as a view of the fused QKV output (not contiguous) takes the compiled loop
    on a copy: the same bits as the same values contiguous, and the float64 formula."""
    qkv = rng.standard_normal((6, 5 * 64)).astype(np.float32)
    q = qkv[:, :3 * 64].reshape(6, 3, 64)  # [T, heads, hd], rows 5 * 64 apart
    assert not q.flags.c_contiguous
    w = rng.standard_normal(64).astype(np.float32)
    got = host.rms_norm(q, w, 1e-6)
    assert np.array_equal(got, host.rms_norm(np.ascontiguousarray(q), w, 1e-6))
    q64 = q.astype(np.float64)
    np.testing.assert_allclose(got, q64 / np.sqrt((q64 ** 2).mean(-1, keepdims=True) + 1e-6) * w, rtol=2e-6,
                               atol=1e-6)


def test_host_rms_norm_and_top_k_equal_the_numpy_forms():
    """host_ops' compiled loops (NumPy float32 rows) against ops.py's NumPy forms (top_k's taken here through
    Fortran-ordered copies, which the compiled path declines; rms_norm copies those for its loop, so its NumPy
    form is written out)."""
    x = rng.standard_normal((5, 3, 64)).astype(np.float32)  # q_norm's [T, heads, hd] too
    w = rng.standard_normal(64).astype(np.float32)
    numpy_form = (x / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + np.float32(1e-6))) * w
    np.testing.assert_allclose(host.rms_norm(x, w, 1e-6), numpy_form, rtol=2e-6, atol=1e-7)
    for normalize in (True, False):
        logits = rng.standard_normal((7, 40)).astype(np.float32) * 3
        logits[0, 5] = logits[0, 9] = logits[0, 30] = 50.0  # a three-way tie: the lower ids first
        ids, weights = host.route(logits, None, RouterSpec(4, normalize=normalize))
        want_ids, want_w = host.route(np.asfortranarray(logits), None, RouterSpec(4, normalize=normalize))
        assert ids.dtype == np.int64 and weights.dtype == np.float32
        assert np.array_equal(ids, want_ids) and ids[0, :3].tolist() == [5, 9, 30]
        np.testing.assert_allclose(weights, want_w, rtol=1e-6, atol=1e-7)


def test_host_add_rms_norm_and_norm_rope_are_the_two_calls_they_join(monkeypatch):
    """host.add_rms_norm (one loop: the residual add and its norm) and host.norm_rope (one loop: each head's
    qk-norm then RoPE) give the bits of the calls they replace (NumPy's add then rms_norm; rms_norm then
    apply_rope), and the float64 formulas; a non-contiguous x (the q heads of a fused QKV output) and arrays the
    loops decline (float64) take the two calls."""
    calls = []
    for name in ("add_rms_norm", "norm_rope"):  # the one loop is what runs, not the two calls
        loop = getattr(host_ops, name)
        monkeypatch.setattr(host_ops, name, lambda *a, _loop=loop, _name=name: (calls.append(_name), _loop(*a)))
    h, delta = (rng.standard_normal((3, 64)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal(64).astype(np.float32)
    total, normed = host.add_rms_norm(h, delta, w, 1e-6)
    assert calls == ["add_rms_norm"]
    assert np.array_equal(total, h + delta) and np.array_equal(normed, host.rms_norm(h + delta, w, 1e-6))
    t64 = h.astype(np.float64) + delta
    np.testing.assert_allclose(normed, t64 / np.sqrt((t64 ** 2).mean(-1, keepdims=True) + 1e-6) * w, rtol=2e-6,
                               atol=1e-6)
    total64, normed64 = host.add_rms_norm(h.astype(np.float64), delta, w, 1e-6)  # declined: NumPy's add
    assert total64.dtype == np.float64 and np.allclose(normed64, normed, atol=1e-5)
    for hd, d in [(64, 64), (64, 32)]:  # full and partial rotary
        qkv = rng.standard_normal((4, 5 * hd)).astype(np.float32)
        q = qkv[:, :3 * hd].reshape(4, 3, hd)  # [T, heads, hd], not contiguous
        cos, sin = ops.rope_cos_sin(np.arange(7, 11), 10000.0 ** (-np.arange(0, d, 2, dtype=np.float32) / d))
        wq = rng.standard_normal(hd).astype(np.float32)
        got = host.norm_rope(q, wq, 1e-6, cos, sin)
        assert calls[-1] == "norm_rope"
        assert np.array_equal(got, host.apply_rope(host.rms_norm(np.ascontiguousarray(q), wq, 1e-6), cos, sin))
        q64 = q.astype(np.float64)
        want = ops.apply_rope(q64 / np.sqrt((q64 ** 2).mean(-1, keepdims=True) + 1e-6) * wq, cos, sin)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
        assert np.array_equal(host.norm_rope(q, None, 1e-6, cos, sin), host.apply_rope(q, cos, sin))  # no qk-norm


def test_host_rope_and_decode_attention_equal_float64():
    """host_ops' rope (full and partial rotary) and few-token GQA attention against the NumPy forms in float64
    (which the compiled path declines): groups of 1, 2 and 8 heads, causal masks with and without a window."""
    for hd, d in [(64, 64), (128, 64), (16, 8)]:
        x = rng.standard_normal((3, 4, hd)).astype(np.float32)
        cos, sin = ops.rope_cos_sin(np.array([0, 9, 300]), ops.rope_inv_freq(d, 1e6))
        got = host.apply_rope(x, cos, sin)
        want = host.apply_rope(x.astype(np.float64), cos.astype(np.float64), sin.astype(np.float64))
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert np.array_equal(got[..., d:], x[..., d:])
    for T, S, nh, nkv, hd, window in [(1, 1, 2, 2, 8, None), (1, 70, 32, 4, 128, None), (2, 70, 4, 2, 64, None),
                                      (4, 33, 8, 1, 16, 5), (3, 10, 6, 3, 8, None)]:
        q = rng.standard_normal((T, nh, hd)).astype(np.float32)
        k = rng.standard_normal((S, nkv, hd)).astype(np.float32)
        v = rng.standard_normal((S, nkv, hd)).astype(np.float32)
        mask = ops.attention_mask(np.arange(S - T, S), np.arange(S), window)
        got = host.gqa_attention(q, k, v, mask)
        want = host.gqa_attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), mask)
        assert got.dtype == np.float32 and got.shape == (T, nh * hd)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"T {T} S {S} nh {nh} nkv {nkv}")
    S = host.PARALLEL_ATTENTION_MACS // (32 * 128) + 3  # a long context: the threads share the KV heads
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in [(1, 32, 128), (S, 4, 128), (S, 4, 128)])
    mask = ops.attention_mask(np.array([S - 1]), np.arange(S), None)
    got = host.gqa_attention(q, k, v, mask)
    serial, parallel = np.empty_like(got), np.empty_like(got)
    host_ops.gqa_attention(q, k, v, mask, np.float32(128**-0.5), serial)
    host_ops.gqa_attention_parallel(q, k, v, mask, np.float32(128**-0.5), parallel)
    assert np.array_equal(parallel, serial) and np.array_equal(got, parallel)  # the same loop per pair
    np.testing.assert_allclose(got, host.gqa_attention(q.astype(np.float64), k.astype(np.float64),
                                                      v.astype(np.float64), mask), rtol=1e-5, atol=1e-6)
    T = host.HOST_ATTENTION_TOKENS + 1  # a prompt over up to HOST_ATTENTION_KEYS keys: the loop, every token
    q, k = rng.standard_normal((T, 4, 16)).astype(np.float32), rng.standard_normal((T, 2, 16)).astype(np.float32)
    mask = ops.attention_mask(np.arange(T), np.arange(T), None)
    looped = np.empty((T, 4 * 16), np.float32)
    host_ops.gqa_attention_parallel(q, k, k, mask, np.float32(16**-0.5), looped)
    assert np.array_equal(host.gqa_attention(q, k, k, mask), looped)
    S = host.HOST_ATTENTION_KEYS + 1  # over more keys: the batched matmuls, which agree with the loop
    q, k = rng.standard_normal((T, 4, 16)).astype(np.float32), rng.standard_normal((S, 2, 16)).astype(np.float32)
    mask = ops.attention_mask(np.arange(S - T, S), np.arange(S), None)
    looped = np.empty((T, 4 * 16), np.float32)
    host_ops.gqa_attention_parallel(q, k, k, mask, np.float32(16**-0.5), looped)
    assert np.array_equal(host.gqa_attention(q, k, k, mask), looped)  # batch-invariant: the loop, at any length
    batched = host.gqa_attention(q, k, k, mask, invariant=False)
    assert not np.array_equal(batched, looped)  # another order of the same sums: the matmuls did run
    np.testing.assert_allclose(batched, looped, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(batched, np.concatenate([host.gqa_attention(q[t:t + 1], k, k, mask[t:t + 1])
                                                        for t in range(T)]), rtol=1e-5, atol=1e-6)


def test_the_attention_goes_parallel_sooner_where_the_threads_spin(monkeypatch):
    """A coordinator whose threads spin after a kernel starts a parallel region in a microsecond or two: the
    attention loop shares its pairs from PARALLEL_ATTENTION_MACS_SPINNING; where they sleep, from
    PARALLEL_ATTENTION_MACS (a wake-up of tens of microseconds)."""
    monkeypatch.setenv("GOMP_SPINCOUNT", "10000")
    assert host.parallel_attention_macs() == host.PARALLEL_ATTENTION_MACS_SPINNING < host.PARALLEL_ATTENTION_MACS
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    assert host.parallel_attention_macs() == host.PARALLEL_ATTENTION_MACS


CACHED_VS_FRESH = """
import sys
import numpy as np
from numba import njit
from coordinator.host import backend as host
from coordinator.model import ops
from coordinator.host import ops as host_ops
from node_worker.kernels.common import JIT

rng = np.random.default_rng(0)
S = host.PARALLEL_ATTENTION_MACS // (32 * 128) + 3
q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in [(1, 32, 128), (S, 4, 128), (S, 4, 128)])
mask = ops.attention_mask(np.array([S - 1]), np.arange(S), None)
outs = np.empty((3, 1, 32 * 128), np.float32)
fresh = njit(**{**JIT, "cache": False, "parallel": True})(host_ops.gqa_attention_parallel.py_func)
for f, out in zip((host_ops.gqa_attention, host_ops.gqa_attention_parallel, fresh), outs):
    f(q, k, v, mask, np.float32(128**-0.5), out)
np.save(sys.argv[1], outs)
print(sum(host_ops.gqa_attention_parallel.stats.cache_hits.values()))
"""


def test_attention_loaded_from_the_disk_cache_gives_a_fresh_compiles_bits(tmp_path):
    """The serial and the parallel attention as a second process loads them from numba's disk cache (the first
    wrote it), against the parallel one compiled in that process: the same bits. Before the softmax's total
    was added up apart from its stores (host_ops' docstring), 339 of these 4096 values differed in the last
    bits on an AVX-512 host."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    hits = []
    for run in ("writes", "loads"):
        done = subprocess.run([sys.executable, "-c", CACHED_VS_FRESH, str(tmp_path / f"{run}.npy")], env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        hits.append(int(done.stdout.split()[-1]))
    assert hits == [0, 1]  # the second process ran the cached code
    for run in ("writes", "loads"):
        serial, cached, fresh = np.load(tmp_path / f"{run}.npy")
        assert np.array_equal(cached, fresh) and np.array_equal(serial, fresh), run


def test_the_engine_compiles_the_host_loops_ahead_of_the_first_prompt(tiny_model):
    """Engine.open compiles (or loads from the disk cache) host_ops' loops and, with the dense matrices kept
    packed, the dense kernels the coordinator runs itself (process pool): a first prompt whose attention takes
    the parallel loop adds no compiled version. In a fresh process, where nothing was loaded before."""
    import subprocess
    import sys
    from pathlib import Path

    script = f"""
from coordinator.config import EngineConfig
from coordinator.engine import Engine
from coordinator.host import backend as host
from coordinator.model import ops
from coordinator.host import ops as host_ops
from node_worker.kernels import dense
host.PARALLEL_ATTENTION_MACS = 0  # any prompt of more than HOST_ATTENTION_TOKENS takes the parallel loop
loops = [host_ops.rms_norm, host_ops.top_k, host_ops.rope, host_ops.gqa_attention, host_ops.gqa_attention_parallel,
         dense.matmul_tiles, dense.matmul_rows, dense.matmul_rows_serial, host_ops.attention_block]
assert [len(f.overloads) for f in loops] == [0] * len(loops)
with Engine.open({str(tiny_model())!r}, EngineConfig(device="cpu", pool="process", nodes=1, dense_dtype="bf16",
                 activations="bf16")) as eng:
    before = [len(f.overloads) for f in loops]
    eng.generate(list(range(1, 9)), max_new_tokens=2, stop_at_eos=False)
    after = [len(f.overloads) for f in loops]
print(before, after)
assert min(before) >= 1 and before == after, (before, after)
"""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("T", [7, 8])
def test_the_parallel_attention_takes_every_token_of_a_prompt_once(T):
    """gqa_attention_parallel hands the tokens out in zigzag order (0, T - 1, 1, T - 2, ...): every token's row
    equals the serial loop's bits, for an odd and an even count, causal with a window."""
    q = rng.standard_normal((T, 8, 16)).astype(np.float32)
    k, v = (rng.standard_normal((T + 3, 2, 16)).astype(np.float32) for _ in range(2))
    mask = ops.attention_mask(np.arange(3, T + 3), np.arange(T + 3), 4)
    serial, parallel = np.full((2, T, 8 * 16), np.nan, np.float32)
    host_ops.gqa_attention(q, k, v, mask, np.float32(0.25), serial)
    host_ops.gqa_attention_parallel(q, k, v, mask, np.float32(0.25), parallel)
    assert sorted(host_ops.zigzag(i, T) for i in range(T)) == list(range(T))
    assert not np.isnan(serial).any() and np.array_equal(parallel, serial)


def test_a_long_prompts_attention_in_query_blocks_equals_float64(monkeypatch):
    """Past HOST_ATTENTION_SCORES floats of scores the queries go in blocks (here 3 blocks of 16, the last short):
    the result is float64's causal attention within float32 rounding."""
    monkeypatch.setattr(ops, "HOST_ATTENTION_SCORES", 4 * 2100 * 16)
    rng = np.random.default_rng(5)
    T, S, nh, nkv, hd = 40, 2100, 4, 2, 8  # more keys than HOST_ATTENTION_KEYS: NumPy's matmuls
    q = rng.standard_normal((T, nh, hd)).astype(np.float32)
    k, v = (rng.standard_normal((S, nkv, hd)).astype(np.float32) for _ in range(2))
    mask = ops.attention_mask(np.arange(S - T, S), np.arange(S), None)
    out = host.gqa_attention(q, k, v, mask)
    scores = np.einsum("thd,shd->hts", q.astype(np.float64), np.repeat(k, nh // nkv, 1).astype(np.float64))
    scores = np.where(mask, scores / math.sqrt(hd), -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.einsum("hts,shd->thd", p, np.repeat(v, nh // nkv, 1).astype(np.float64)).reshape(T, nh * hd)
    assert np.abs(out - want).max() < 1e-5


def test_host_linear_rows_give_a_row_the_same_bits_beside_any_rows():
    """host_ops.linear_rows (the routers' and the shared expert gate's products on the host, packed.RowExactMatrix):
    each (row, column) summed in an order fixed by the matrix alone, so a row's bits do not change with the rows
    beside it, where NumPy's BLAS product changes them, serial or parallel; and within float32 rounding of
    float64. A one-column matrix (a shared expert's gate) takes the lane sums, a wider one the columns' form."""
    from coordinator.host.packed import RowExactMatrix

    x = rng.standard_normal((40, 2051)).astype(np.float32)  # 2051: a tail past the eight lanes
    for N in (64, 1):
        w = rng.standard_normal((N, 2051)).astype(np.float32)
        wt = np.ascontiguousarray(w.T)
        one = np.empty((1, N), np.float32)
        host_ops.linear_rows(x[:1], wt, one)
        for T in (2, 3, 5, 8, 9, 40):
            for loop in (host_ops.linear_rows, host_ops.linear_rows_parallel):
                out = np.empty((T, N), np.float32)
                loop(x[:T], wt, out)
                assert np.array_equal(out[0], one[0]), (N, T, loop)
        np.testing.assert_allclose(out, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=1e-3)
        m = RowExactMatrix(w)
        assert np.array_equal((x @ m.T)[0], one[0]) and np.array_equal(x[:1] @ m.T, one)


def test_host_attention_gives_a_token_the_same_bits_alone_and_in_a_longer_chunk():
    """A token's attention output is the same bits computed alone over the keys it sees and as the first rows of
    a longer chunk (whose later keys it does not see): every loop runs over its own keys, and the softmax's sum
    in a fixed order (issue 62). Serial and parallel loops alike."""
    S, nh, nkv, hd = 53, 8, 2, 64
    q = rng.standard_normal((S, nh, hd)).astype(np.float32)
    k, v = (rng.standard_normal((S, nkv, hd)).astype(np.float32) for _ in range(2))
    for window in (None, 7):
        for t in (0, 9, 30):
            mask = ops.attention_mask(np.array([t]), np.arange(t + 1), window)
            alone = np.empty((1, nh * hd), np.float32)
            host_ops.gqa_attention(q[t:t + 1], k[:t + 1], v[:t + 1], mask, np.float32(0.125), alone)
            for T in (2, 11, S - t):
                mask = ops.attention_mask(np.arange(t, t + T), np.arange(t + T), window)
                for loop in (host_ops.gqa_attention, host_ops.gqa_attention_parallel):
                    out = np.empty((T, nh * hd), np.float32)
                    loop(q[t:t + T], k[:t + T], v[:t + T], mask, np.float32(0.125), out)
                    assert np.array_equal(out[0], alone[0]), (window, t, T, loop)
