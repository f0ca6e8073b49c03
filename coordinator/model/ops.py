"""The network's numeric building blocks in their reference forms, each a small pure function of arrays.

Each function takes float32 arrays of one module, NumPy or a GPU's (``xp_of``), and returns arrays of the same
module. These are what a backend falls back to and what its own forms are tested against (vLLM's
``forward_native``): coordinator/host/backend.py runs compiled loops where the shapes allow, coordinator/gpu/
backend.py CUDA kernels; model/backend.py is the protocol the decoder calls. RoPE tables and masks are computed
on the host (small) and moved by the caller.
"""

from __future__ import annotations

import numpy as np

from dataclasses import dataclass

from .xp import xp_of

ROUTER_NORM_EPS = np.float32(1e-20)  # the router's normalisation guard (transformers' DeepseekV3TopkRouter)


@dataclass(frozen=True)
class RouterSpec:
    """A MoE router's choice rule: the k best experts, of the topk_group best of n_group groups (1, 1: no groups),
    scored by a softmax (DeepSeek-V2's, Qwen's, Mixtral's) or a sigmoid (DeepSeek-V3's, GLM-4.5's: a correction
    bias for the choice only), the weights renormalised when ``normalize``, then multiplied by ``scaling``."""

    k: int
    n_group: int = 1
    topk_group: int = 1
    softmax: bool = True
    normalize: bool = False
    scaling: float = 1.0
    grouped: bool = False  # DeepSeek's and GLM's rule (transformers' grouped routers), not a plain softmax top-k

    @classmethod
    def of(cls, cfg) -> "RouterSpec":
        """A model's (ModelConfig): its group router's, else a softmax top-k."""
        g = cfg.group_router
        if g is None:
            return cls(cfg.top_k, normalize=cfg.norm_topk_prob)
        return cls(cfg.top_k, g.n_group, g.topk_group, g.scoring == "softmax", cfg.norm_topk_prob,
                   g.routed_scaling_factor, grouped=True)


@dataclass(frozen=True, eq=False)
class MlaRows:
    """Multi-head latent attention's operands: the queries' two parts and the keys' (a layer's new rows, before
    RoPE on q_rope, before they are cached; or one sequence's queries, roped, over its cached latents)."""

    q_nope: np.ndarray  # [T, nh, dn]
    q_rope: np.ndarray  # [T, nh, dr]
    latent: np.ndarray  # [S, c] after kv_a_layernorm (a bf16 cache's bits too)
    k_rope: np.ndarray  # [S, dr] roped: one rope key shared by every head


def route(logits: np.ndarray, bias, spec: RouterSpec) -> tuple[np.ndarray, np.ndarray]:
    """logits [T, E] -> (ids [T, k] int64, weights [T, k] float32) by ``spec`` (route_top_k or route_grouped)."""
    if not spec.grouped:
        return route_top_k(logits, spec.k, spec.normalize)
    return route_grouped(logits, bias, spec)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x [..., D] -> x / sqrt(mean(x²) + eps) * weight."""
    xp = xp_of(x)
    variance = xp.mean(xp.square(x), axis=-1, keepdims=True)
    return (x / xp.sqrt(variance + np.float32(eps))) * weight


def add_rms_norm(h: np.ndarray, delta: np.ndarray, weight: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """The residual add and the next norm: (h + delta, rms_norm(h + delta)), h and delta [..., D]."""
    total = h + delta
    return total, rms_norm(total, weight, eps)


def norm_rope(x: np.ndarray, weight: np.ndarray | None, eps: float, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [T, heads, hd] -> apply_rope(rms_norm(x, weight) per head, cos, sin) (weight None: no norm)."""
    return apply_rope(rms_norm(x, weight, eps) if weight is not None else x, cos, sin)


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
    """x [T, heads, hd] rotated by position: x·cos + rotate_half(x)·sin. cos, sin [T, d] with d < hd (partial
    rotary, GLM-4.5): the first d dims rotated, the rest passed through."""
    if cos.shape[-1] < x.shape[-1]:
        d = cos.shape[-1]
        return xp_of(x).concatenate([apply_rope(x[..., :d], cos, sin), x[..., d:]], axis=-1)
    half = x.shape[-1] // 2
    rotated = xp_of(x).concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def attention_mask(q_pos: np.ndarray, k_pos: np.ndarray, window: int | None) -> np.ndarray:
    """[T, S] True where query at q_pos may see the key at k_pos (causal, optional sliding window)."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= (q_pos[:, None] - k_pos[None, :]) < window
    return allowed


# The reference attention takes a host query's rows in blocks whose scores [heads, block, S] stay under this many
# floats: a long prompt's softmax and its temporaries are several copies of the scores, which grow as T x S.
HOST_ATTENTION_SCORES = 1 << 26


def widen(a: np.ndarray) -> np.ndarray:
    """A bf16 cache's values (uint16 bits, kv_cache.py) as float32; float32 as it is."""
    if a.dtype != np.uint16:
        return a
    return (a.astype(np.uint32) << 16).view(np.float32)


def gqa_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, widen=None,
                  masked_softmax=None) -> np.ndarray:
    """q [T, nh, hd], k/v [S, nkv, hd] (float32, or a bf16 cache's uint16 bits), mask [T, S] -> [T, nh*hd].
    Heads share KV in groups of nh/nkv; a host query of many rows in blocks (HOST_ATTENTION_SCORES). ``widen``
    and ``masked_softmax``: a backend's forms of those two ops (None: this module's)."""
    widen, masked_softmax = widen or globals()["widen"], masked_softmax or globals()["masked_softmax"]
    T, nh, hd = q.shape
    nkv = k.shape[1]
    k, v = widen(k), widen(v)
    block = max(1, HOST_ATTENTION_SCORES // (nh * k.shape[0]))  # query rows per block of scores
    if T > block and xp_of(q) is np:
        return np.concatenate([gqa_attention(q[lo:lo + block], k, v, mask[lo:lo + block], widen, masked_softmax)
                               for lo in range(0, T, block)])
    group = nh // nkv
    qg = q.reshape(T, nkv, group, hd).transpose(1, 2, 0, 3)  # [nkv, g, T, hd]
    kt = k.transpose(1, 2, 0)  # [nkv, hd, S]
    probs = masked_softmax(qg @ kt[:, None], mask, hd**-0.5)  # [nkv, g, T, S]
    out = probs @ v.transpose(1, 0, 2)[:, None]  # [nkv, g, T, hd]
    return out.transpose(2, 0, 1, 3).reshape(T, nh * hd)


def route_top_k(router_logits: np.ndarray, k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """router_logits [T, E] -> (expert ids [T, k] int64, weights [T, k] float32).

    Softmax over all experts, the k largest probabilities (ties to the lower id),
    renormalised to sum to one when ``normalize``.
    """
    xp = xp_of(router_logits)
    probs = softmax(router_logits.astype(np.float32), axis=-1)  # [T, E]
    ids = xp.argsort(-probs, axis=-1, kind="stable")[:, :k] if xp is np else xp.argsort(-probs, axis=-1)[:, :k]
    weights = xp.take_along_axis(probs, ids, axis=-1)  # [T, k]
    if normalize:
        weights = weights / xp.sum(weights, axis=-1, keepdims=True)
    return ids.astype(np.int64), weights.astype(np.float32)


def yarn_inv_freq(dim: int, theta: float, factor: float, original_max: int, beta_fast: float, beta_slow: float,
                  truncate: bool = True) -> np.ndarray:
    """[dim / 2] YaRN inverse frequencies (transformers' _compute_yarn_parameters): the high frequencies kept,
    the low ones divided by ``factor``, a linear ramp between the correction range's ends."""
    def correction_dim(rotations: float) -> float:
        return dim * np.log(original_max / (rotations * 2 * np.pi)) / (2 * np.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = np.floor(low), np.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    keep = 1 - ramp  # the share of the unscaled frequency
    return extrapolation / factor * (1 - keep) + extrapolation * keep


def apply_rope_interleaved(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [T, heads, d] rotated in (x0, x1), (x2, x3), ... pairs, the output de-interleaved as transformers'
    apply_rotary_pos_emb_interleave writes it: [even·cos - odd·sin, odd·cos + even·sin] (q and k alike, so
    their dot products are those of the interleaved rotation). cos, sin [T, d] in the half-split layout."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return xp_of(x).concatenate([even * c - odd * s, odd * c + even * s], axis=-1)


def route_grouped(router_logits: np.ndarray, bias: np.ndarray | None,
                  spec: RouterSpec) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-V3's router (transformers' DeepseekV3TopkRouter, the noaux_tc method).

    router_logits [T, E] -> (ids [T, k] int64, weights [T, k] float32). Scores are sigmoid(logits); the choice
    is made on scores + bias (e_score_correction_bias), the weights are the unbiased scores. Each of the
    ``n_group`` groups of E / n_group experts is scored by the sum of its two best biased scores; the
    ``topk_group`` best groups stay and the k best experts among theirs are chosen (ties to the lower id). The
    weights are divided by their sum (+1e-20) when ``normalize``, then multiplied by ``scaling``.

    ``spec.softmax``: DeepSeek-V2's router (DeepseekV2TopkRouter, group_limited_greedy; n_group 1 is its
    plain greedy): scores are softmax(logits), each group is scored by its best expert, there is no bias.
    """
    k, n_group, topk_group = spec.k, spec.n_group, spec.topk_group
    scoring = "softmax" if spec.softmax else "sigmoid"
    if scoring == "softmax" and bias is not None:
        raise ValueError("route_grouped: the softmax router (DeepSeek-V2) takes no bias")
    xp = xp_of(router_logits)
    T, E = router_logits.shape
    logits = router_logits.astype(np.float32)
    scores = softmax(logits, axis=-1) if scoring == "softmax" else sigmoid(logits)  # [T, E]
    choice = scores + bias.astype(np.float32) if bias is not None else scores
    grouped = choice.reshape(T, n_group, E // n_group)
    best = -xp.sort(-grouped, axis=-1)[..., : 1 if scoring == "softmax" else min(2, E // n_group)]  # [T, G, 1|2]
    group_scores = best.sum(axis=-1)  # [T, G]
    group_order = xp.argsort(-group_scores, axis=-1, kind="stable") if xp is np else xp.argsort(-group_scores, axis=-1)
    keep = xp.zeros((T, n_group), bool)
    keep[xp.arange(T)[:, None], group_order[:, :topk_group]] = True  # [T, G] the groups kept
    masked = xp.where(xp.repeat(keep, E // n_group, axis=-1), choice, np.float32(-np.inf))  # [T, E]
    ids = xp.argsort(-masked, axis=-1, kind="stable")[:, :k] if xp is np else xp.argsort(-masked, axis=-1)[:, :k]
    weights = xp.take_along_axis(scores, ids, axis=-1)  # [T, k]
    if spec.normalize:
        weights = weights / (xp.sum(weights, axis=-1, keepdims=True) + ROUTER_NORM_EPS)
    weights = weights * np.float32(spec.scaling)
    return ids.astype(np.int64), weights.astype(np.float32)


def masked_softmax(scores: np.ndarray, mask: np.ndarray, scale: float) -> np.ndarray:
    """scores [..., T, S], mask [T, S] -> softmax over S of where(mask, scores * scale, -inf)."""
    return softmax(np.where(mask, scores * np.float32(scale), np.float32(-np.inf)), axis=-1)


def mla_attention(rows: MlaRows, k_nope: np.ndarray, v: np.ndarray, mask: np.ndarray, scale: float, widen=None,
                  masked_softmax=None) -> np.ndarray:
    """Multi-head latent attention with the latent expanded: rows' q_nope [T, nh, dn], q_rope [T, nh, dr] and
    k_rope [S, dr] (one rope key shared by every head; a bf16 cache's bits too), k_nope [S, nh, dn], v [S, nh, dv]
    (the latent through kv_b), mask [T, S] -> [T, nh*dv]. Scores (q_nope·k_nope + q_rope·k_rope) * scale.
    ``widen``, ``masked_softmax``: as gqa_attention's."""
    widen, masked_softmax = widen or globals()["widen"], masked_softmax or globals()["masked_softmax"]
    q_nope, q_rope = rows.q_nope, rows.q_rope
    T, nh, _ = q_nope.shape
    k_rope = widen(rows.k_rope)
    scores = q_nope.transpose(1, 0, 2) @ k_nope.transpose(1, 2, 0)  # [nh, T, S]
    scores = scores + (q_rope.transpose(1, 0, 2) @ k_rope.T)  # [nh, T, S]
    out = masked_softmax(scores, mask, scale) @ v.transpose(1, 0, 2)  # [nh, T, dv]
    return out.transpose(1, 0, 2).reshape(T, -1)


def mla_attention_absorbed(rows: MlaRows, w_uk: np.ndarray, w_uv: np.ndarray, mask: np.ndarray,
                           scale: float) -> np.ndarray:
    """The same attention on the cached latent [S, c] without expanding it: W_uk [nh, dn, c] folds into q
    (q_nope·(W_uk·l) = (q_nope·W_uk)·l) and W_uv [nh, dv, c] applies after the weighted sum of latents.
    Work per cached token: nh*(c + dr) instead of the expansion's nh*c*(dn + dv). latent and k_rope may be a
    bf16 cache's bits; W_uk and W_uv may be views of kv_b's rows (Backend.kv_b_heads)."""
    q_nope, q_rope, latent, k_rope = rows.q_nope, rows.q_rope, widen(rows.latent), widen(rows.k_rope)
    T, nh, _ = q_nope.shape
    q_lat = q_nope.transpose(1, 0, 2) @ w_uk  # [nh, T, c]
    scores = q_lat @ latent.T + q_rope.transpose(1, 0, 2) @ k_rope.T  # [nh, T, S]
    out_lat = masked_softmax(scores, mask, scale) @ latent  # [nh, T, c]
    out = out_lat @ w_uv.transpose(0, 2, 1)  # [nh, T, dv]
    return out.transpose(1, 0, 2).reshape(T, -1)
