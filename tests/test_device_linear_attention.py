"""Qwen3-Next on the device: device_ops.gated_delta (the Gated DeltaNet between its projections, one launch a step)
against a float64 recurrence written here, on a GPU through CuPy and everywhere else through tests/cuda_emulator.py;
then the engine's GPU path (tests/device_standin.py) against its CPU path on the transformers fixture, its
rollback after rejected drafts, and its steps kept eager (no graph-ready steps)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from coordinator.device.format_kernels import address
from coordinator.model import device_ops
from coordinator.model.model_config import LinearAttnConfig

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
        got = cupy.asnumpy(device_ops.gated_delta(cupy.asarray(qkvz), cupy.asarray(ba), *map(cupy.asarray, params),
                                                  EPS, tables, slot, DIMS))
        for s, (lo, hi) in enumerate(zip(starts[:-1], starts[1:])):
            ref_out, ref_conv, ref_rec = reference(qkvz[lo:hi], ba[lo:hi], params, *want[s])
            want[s] = (ref_conv, ref_rec)
            conv, rec = cupy.asnumpy(bufs[s][0]), cupy.asnumpy(bufs[s][1])
            assert rel(got[lo:hi], ref_out) < 2e-5, (step, s)
            assert np.array_equal(conv[dst, slot], ref_conv.astype(np.float32)), (step, s)
            assert rel(rec[dst, slot], ref_rec) < 2e-5, (step, s)
            assert np.array_equal(conv[src], before[s][0]) and np.array_equal(rec[src], before[s][1])
            assert not rec[dst, 0].any()  # the other slot is not touched
