"""The decoder's numeric building blocks, each a small pure function of arrays.

Each function takes float32 arrays of one module, NumPy or CuPy (``xp_of``),
and returns arrays of the same module. RoPE tables and masks are computed on
the host (small) and moved by the caller.
"""

from __future__ import annotations

import numpy as np

from . import host_ops
from .xp import xp_of


def _host_rows(*arrays: np.ndarray) -> bool:
    """NumPy float32 C-contiguous arrays: host_ops' compiled loops take them."""
    return all(type(a) is np.ndarray and a.dtype == np.float32 and a.flags.c_contiguous for a in arrays)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x [..., D] -> x / sqrt(mean(x²) + eps) * weight."""
    if _host_rows(x, weight) and x.ndim >= 1 and x.size:
        out = np.empty_like(x)
        host_ops.rms_norm(x.reshape(-1, x.shape[-1]), weight, np.float32(eps), out.reshape(-1, x.shape[-1]))
        return out
    xp = xp_of(x)
    variance = xp.mean(xp.square(x), axis=-1, keepdims=True)
    return (x / xp.sqrt(variance + np.float32(eps))) * weight


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    xp = xp_of(x)
    shifted = x - xp.max(x, axis=axis, keepdims=True)
    e = xp.exp(shifted)
    return e / xp.sum(e, axis=axis, keepdims=True)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + xp_of(x).tanh(0.5 * x))


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def swiglu_mlp(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    """x [T, H]; gate, up [I, H]; down [H, I] -> down · (silu(gate·x) ⊙ up·x), [T, H]."""
    return (silu(x @ gate.T) * (x @ up.T)) @ down.T


def rope_inv_freq(head_dim: int, theta: float, factor: float = 1.0) -> np.ndarray:
    """[head_dim / 2] inverse frequencies; ``factor`` > 1 is linear position scaling."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    return (1.0 / (theta**exponents)) / factor


def rope_cos_sin(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """positions [T] -> cos, sin [T, head_dim] in the half-split (rotate_half) layout."""
    freqs = positions.astype(np.float64)[:, None] * inv_freq[None, :]  # [T, hd/2]
    angles = np.concatenate([freqs, freqs], axis=-1)  # [T, hd]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [T, heads, hd] rotated by position: x·cos + rotate_half(x)·sin."""
    half = x.shape[-1] // 2
    rotated = xp_of(x).concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def attention_mask(q_pos: np.ndarray, k_pos: np.ndarray, window: int | None) -> np.ndarray:
    """[T, S] True where query at q_pos may see the key at k_pos (causal, optional sliding window)."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= (q_pos[:, None] - k_pos[None, :]) < window
    return allowed


def gqa_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """q [T, nh, hd], k/v [S, nkv, hd], mask [T, S] -> [T, nh*hd]. Heads share KV in groups of nh/nkv."""
    T, nh, hd = q.shape
    nkv = k.shape[1]
    group = nh // nkv
    qg = q.reshape(T, nkv, group, hd).transpose(1, 2, 0, 3)  # [nkv, g, T, hd]
    kt = k.transpose(1, 2, 0)  # [nkv, hd, S]
    xp = xp_of(q)
    scores = (qg @ kt[:, None]) * np.float32(hd**-0.5)  # [nkv, g, T, S]
    scores = xp.where(mask, scores, np.float32(-np.inf))
    probs = softmax(scores, axis=-1)
    out = probs @ v.transpose(1, 0, 2)[:, None]  # [nkv, g, T, hd]
    return out.transpose(2, 0, 1, 3).reshape(T, nh * hd)


def route_top_k(router_logits: np.ndarray, k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """router_logits [T, E] -> (expert ids [T, k] int64, weights [T, k] float32).

    Softmax over all experts, the k largest probabilities (ties to the lower id),
    renormalised to sum to one when ``normalize``.
    """
    if _host_rows(router_logits) and router_logits.ndim == 2 and 1 <= k <= router_logits.shape[1]:
        T = router_logits.shape[0]
        ids, weights = np.empty((T, k), np.int64), np.empty((T, k), np.float32)
        host_ops.top_k(router_logits, k, normalize, ids, weights)
        return ids, weights
    xp = xp_of(router_logits)
    probs = softmax(router_logits.astype(np.float32), axis=-1)  # [T, E]
    ids = xp.argsort(-probs, axis=-1, kind="stable")[:, :k] if xp is np else xp.argsort(-probs, axis=-1)[:, :k]
    weights = xp.take_along_axis(probs, ids, axis=-1)  # [T, k]
    if normalize:
        weights = weights / xp.sum(weights, axis=-1, keepdims=True)
    return ids.astype(np.int64), weights.astype(np.float32)
