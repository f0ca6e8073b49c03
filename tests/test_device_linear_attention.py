"""Qwen3-Next on the device: device_ops.gated_delta (the Gated DeltaNet between its projections, one launch a step)
against a float64 recurrence written here, on a GPU through CuPy and everywhere else through tests/cuda_emulator.py;
then the engine's GPU path (tests/device_standin.py) against its CPU path on the transformers fixture, its
rollback after rejected drafts, and its steps kept eager (no graph-ready steps)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from coordinator.gpu.format_kernels import address
from coordinator.gpu import ops as device_ops
from coordinator.model.model_config import LinearAttnConfig
from coordinator.model.step import StepBatch

LC = LinearAttnConfig(key_heads=2, value_heads=4, key_head_dim=16, value_head_dim=8, conv_kernel=4)
DIMS = (LC.key_heads, LC.value_heads, LC.key_head_dim, LC.value_head_dim, LC.conv_kernel)
EPS = 1e-6
FIXTURE = Path(__file__).parent / "fixtures" / "hf" / "qwen3_next_basic"


def layer_params(rng):
    """(taps [C, K], a_neg [Hv], dt_bias [Hv], norm [dv]) float32."""
    C, Hv, K, dv = LC.conv_dim, LC.value_heads, LC.conv_kernel, LC.value_head_dim
    return ((0.5 * rng.standard_normal((C, K))).astype(np.float32), -np.exp(rng.standard_normal(Hv)).astype(np.float32),
            rng.standard_normal(Hv).astype(np.float32), (1 + 0.1 * rng.standard_normal(dv)).astype(np.float32))


def reference(qkvz, ba, params, conv, S):
    """float64, one sequence: qkvz [T, C + Hv dv], ba [T, 2 Hv], conv [K-1, C], S [Hv, dk, dv] -> (gated output
    [T, Hv dv], conv state, S): the conv with SiLU, q and k L2-normalised (q / sqrt(dk)), the gated delta rule a
    token at a time, then rms_norm(o) * norm * silu(z) per head."""
    Hk, Hv, dk, dv, K = DIMS
    C = LC.conv_dim
    taps, a_neg, dt_bias, norm = (np.asarray(p, np.float64) for p in params)
    x, ba = np.asarray(qkvz, np.float64), np.asarray(ba, np.float64)
    T = x.shape[0]
    full = np.concatenate([np.asarray(conv, np.float64), x[:, :C]])  # [K-1+T, C]
    S = np.asarray(S, np.float64).copy()
    out = np.zeros((T, Hv, dv))
    for t in range(T):
        y = sum(full[t + j] * taps[:, j] for j in range(K))
        y = y / (1 + np.exp(-y))
        q, k = y[:Hk * dk].reshape(Hk, dk), y[Hk * dk:2 * Hk * dk].reshape(Hk, dk)
        v = y[2 * Hk * dk:].reshape(Hv, dv)
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(dk)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
        beta = 1 / (1 + np.exp(-ba[t, :Hv]))
        g = a_neg * np.log1p(np.exp(ba[t, Hv:] + dt_bias))
        z = x[t, C:].reshape(Hv, dv)
        for h in range(Hv):
            kh = h // (Hv // Hk)
            S[h] *= np.exp(g[h])
            delta = (v[h] - S[h].T @ k[kh]) * beta[h]
            S[h] += np.outer(k[kh], delta)
            o = S[h].T @ q[kh]
            out[t, h] = o / np.sqrt(np.mean(o * o) + EPS) * norm * (z[h] / (1 + np.exp(-z[h])))
    return out.reshape(T, Hv * dv), full[T:], S


def rel(x, ref) -> float:
    return float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))


def test_gated_delta_matches_float64_over_sequences_and_steps(cp):
    """Three sequences of 1, 5 and 17 tokens in one launch, each from a non-zero state in its own double buffer and
    a layer slot other than the first, then a second step reading what the first wrote: outputs, conv states and
    recurrent states within float32 rounding of float64; the buffers a step read are left as they were."""
    cupy = cp
    rng = np.random.default_rng(3)
    Hk, Hv, dk, dv, K = DIMS
    C, slots, slot = LC.conv_dim, 2, 1
    params = layer_params(rng)
    lengths = [(1, 5, 17), (3, 1, 2)]  # the two steps' tokens per sequence
    bufs = []  # per sequence: conv [2, slots, K-1, C] and recurrent [2, slots, Hv, dk, dv], buffer 0 the start
    for _ in range(3):
        conv = np.zeros((2, slots, K - 1, C), np.float32)
        rec = np.zeros((2, slots, Hv, dk, dv), np.float32)
        conv[0, slot] = rng.standard_normal((K - 1, C))
        rec[0, slot] = 0.3 * rng.standard_normal((Hv, dk, dv))
        bufs.append((cupy.asarray(conv), cupy.asarray(rec)))
    want = [(cupy.asnumpy(c)[0, slot].astype(np.float64), cupy.asnumpy(r)[0, slot].astype(np.float64))
            for c, r in bufs]
    for step, lens in enumerate(lengths):
        src, dst = step % 2, 1 - step % 2
        N = sum(lens)
        qkvz = rng.standard_normal((N, C + Hv * dv)).astype(np.float32)
        ba = rng.standard_normal((N, 2 * Hv)).astype(np.float32)
        starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        tables = [cupy.asarray(starts)] + [cupy.asarray(np.array([address(b[i][side]) for b in bufs], np.int64))
                                           for i, side in ((0, src), (0, dst), (1, src), (1, dst))]
        before = [(cupy.asnumpy(c)[src].copy(), cupy.asnumpy(r)[src].copy()) for c, r in bufs]
        whole = cupy.asarray(qkvz)  # q, k, v and z as column slices of one array: rows apart, as a view reads them
        got = cupy.asnumpy(device_ops.gated_delta(whole[:, :C], whole[:, C:], cupy.asarray(ba),
                                                  *map(cupy.asarray, params), EPS, tables, slot, DIMS))
        for s, (lo, hi) in enumerate(zip(starts[:-1], starts[1:])):
            ref_out, ref_conv, ref_rec = reference(qkvz[lo:hi], ba[lo:hi], params, *want[s])
            want[s] = (ref_conv, ref_rec)
            conv, rec = cupy.asnumpy(bufs[s][0]), cupy.asnumpy(bufs[s][1])
            assert rel(got[lo:hi], ref_out) < 2e-5, (step, s)
            assert np.array_equal(conv[dst, slot], ref_conv.astype(np.float32)), (step, s)
            assert rel(rec[dst, slot], ref_rec) < 2e-5, (step, s)
            assert np.array_equal(conv[src], before[s][0]) and np.array_equal(rec[src], before[s][1])
            assert not rec[dst, 0].any()  # the other slot is not touched


def relative(x: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))


def prefill_then_decode(eng, prompt: np.ndarray, decode: list[int], cut: int) -> np.ndarray:
    """Every position's logits [len(prompt) + len(decode), V], one cache: the prompt fed ``cut`` tokens a step (a
    chunked prefill), then the decode tokens one a step."""
    cache = eng.new_cache()
    parts = [eng.step(StepBatch.of(prompt[lo:lo + cut], cache, every_row=True)).logits[0]
             for lo in range(0, prompt.size, cut)]
    parts += [eng.step(StepBatch.of(np.array([t], np.int64), cache, every_row=True)).logits[0] for t in decode]
    return np.concatenate(parts)


def test_the_device_path_matches_the_host_path_on_qwen3_next(gpu):
    """transformers' Qwen3-Next fixture (150-token prompt: longer than two of the host's 64-token chunks) on the
    device path (float32 weights and KV cache): the prompt at once, and the prompt in 48-token pieces followed by
    its 8 greedy tokens a step each, give the host path's logits within 1e-4 of their largest with the same top
    token everywhere (and transformers' own within 1e-4); served greedy generation, the prompt prefilled 48 tokens
    a step, is transformers' greedy. The states sit on the device, double-buffered, and the plan counts them."""
    from coordinator import Engine, EngineConfig

    from test_hf_parity import served_greedy

    ref = np.load(FIXTURE / "reference.npz")
    prompt, greedy = ref["input_ids"].astype(np.int64), ref["greedy_ids"].tolist()
    with Engine.open(FIXTURE, EngineConfig(device="cpu", pool="inproc")) as eng:
        want, want_run = eng.logits(prompt), prefill_then_decode(eng, prompt, greedy, 48)
    with Engine.open(FIXTURE, EngineConfig(device="cuda", pool="inproc", dense_dtype="f32", kv_dtype="f32")) as eng:
        assert eng.decoder.backend.name == "cupy" and eng.graph is None
        got, got_run = eng.logits(prompt), prefill_then_decode(eng, prompt, greedy, 48)
        served, _ = served_greedy(eng, prompt.tolist(), len(greedy), prefill_chunk=48)
        cache, cfg = eng.new_cache(), eng.model_config
        assert type(cache.linear.recurrent) is gpu.ndarray and cache.linear.nbytes == 2 * cfg.state_bytes_per_sequence
        assert eng.gpu_memory.kv == eng.gpu_memory.kv_tokens * cfg.kv_bytes_per_token \
            + 2 * cfg.state_bytes_per_sequence
    for g, w in ((got, want), (got_run, want_run)):
        assert relative(g, w) < 1e-4
        assert np.array_equal(g.argmax(-1), w.argmax(-1))
    assert relative(got, ref["logits"]) < 1e-4 and relative(got_run, ref["full_logits"]) < 1e-4
    assert served == greedy and got_run[prompt.size - 1:-1].argmax(-1).tolist() == greedy


def test_rollback_on_the_device_is_a_fresh_pass_and_steps_stay_eager(gpu, tmp_path, monkeypatch):
    """The process pool on the device, where other models' decode steps are graph-ready: Qwen3-Next's are eager (no
    GraphSteps). A step over 5 drafts truncated to keep 2 leaves the cache as a step over those 2 did: its states
    within float32 rounding (the rows were projected in a batch of 5) and the next token's logits too, far from the
    untruncated cache's; truncating to the step's start restores the state before it bit for bit, and a position
    before the last step is refused. Greedy decoding with prompt-lookup drafts, some taken and some refused, gives
    the tokens without drafts."""
    from coordinator import Engine, EngineConfig
    from coordinator import scheduler as scheduler_module
    from coordinator.cli.make_model import make_model

    from test_speculative import repetitive_requests, run

    model = make_model(tmp_path / "m", arch="qwen3_next", seed=2)
    prompt, drafts, nxt = np.arange(40, 110), np.array([7, 9, 11, 13, 15]), np.array([21])
    with Engine.open(model, EngineConfig(device="cuda", pool="process", dense_dtype="f32", kv_dtype="f32")) as eng:
        assert eng.decoder.backend.name == "cupy" and eng.config.graph and eng.graph is None
        layer = next(i for i in range(eng.model_config.num_layers) if eng.model_config.is_linear(i))
        rolled, kept, whole, back = (eng.new_cache() for _ in range(4))
        for cache, step in ((rolled, drafts), (kept, drafts[:2]), (whole, drafts), (back, drafts)):
            eng.step(StepBatch([(prompt, cache)])).logits
            if cache is back:
                before = cache.linear.state(layer)
            eng.step(StepBatch([(step, cache)], all_rows=frozenset({0}))).logits
        rolled.truncate(prompt.size + 2)
        back.truncate(prompt.size)
        for got, want in zip(rolled.linear.state(layer), kept.linear.state(layer)):
            assert relative(got, want) < 1e-5
        assert all(np.array_equal(g, w) for g, w in zip(back.linear.state(layer), before))
        with pytest.raises(ValueError, match="last step"):
            rolled.truncate(prompt.size - 1)
        after = [eng.step(StepBatch([(nxt, cache)])).logits[0] for cache in (rolled, kept, whole)]
        reqs = repetitive_requests(eng, n=1, max_new=12)
        plain, _ = run(eng, reqs)
        given = len(reqs[0].prompt_ids)

        def draft(_index, ids, k):  # the greedy continuation, its last token changed
            out = list(plain["r0"][len(ids) - given:len(ids) - given + k])
            return out[:-1] + [(out[-1] + 1) % eng.model_config.vocab_size] if out else out

        monkeypatch.setattr(scheduler_module.NgramIndex, "draft", draft)
        drafted, stats = run(eng, reqs, speculative="ngram", draft_max=4)
    scale = np.abs(after[1]).max()
    assert np.abs(after[0] - after[1]).max() < 1e-5 * scale
    assert np.abs(after[2] - after[1]).max() > 1e-2 * scale
    assert drafted == plain
    assert 0 < stats["accepted_drafts"] < stats["drafted_tokens"], stats
