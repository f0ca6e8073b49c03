"""The MoE decoder: embedding, attention with a KV cache, MoE and dense MLPs, lm_head.

Routed experts go through an ExpertPool; everything else runs here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from . import ops
from .kv_cache import KVCache
from .model_config import ModelConfig
from .pools import ExpertPool, PoolRequest
from .weights import LayerWeights, ModelWeights

log = logging.getLogger(__name__)


@dataclass
class RoutingStats:
    routed_pairs: int = 0  # (token, expert) pairs the router chose
    skipped_pairs: int = 0  # dropped by route_tail_skip
    per_layer_expert: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> [E] pair counts


class Decoder:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, pool: ExpertPool, route_tail_skip: float = 0.0):
        self.cfg = cfg
        self.w = weights
        self.pool = pool
        self.route_tail_skip = route_tail_skip
        self.inv_freq = ops.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_factor)  # [hd/2]
        self.stats = RoutingStats()

    def new_cache(self) -> KVCache:
        return KVCache(self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim)

    def forward(self, token_ids: np.ndarray, cache: KVCache, last_only: bool = False) -> np.ndarray:
        """token_ids [T] after the cached ones -> logits [T, V] ([1, V] when last_only)."""
        positions = np.arange(cache.length, cache.length + len(token_ids))  # [T]
        cos, sin = ops.rope_cos_sin(positions, self.inv_freq)  # [T, hd]
        h = self.w.embed[token_ids]  # [T, H]
        for i, lw in enumerate(self.w.layers):
            a = ops.rms_norm(h, lw.input_norm, self.cfg.rms_norm_eps)
            h = h + self._attention(i, lw, a, positions, cos, sin, cache)
            m = ops.rms_norm(h, lw.post_attn_norm, self.cfg.rms_norm_eps)
            h = h + (self._moe(i, lw, m) if self.cfg.sparse_layers[i] else ops.swiglu_mlp(
                m, lw.dense_mlp.gate, lw.dense_mlp.up, lw.dense_mlp.down))
        cache.advance(len(token_ids))
        if last_only:
            h = h[-1:]
        h = ops.rms_norm(h, self.w.final_norm, self.cfg.rms_norm_eps)
        return h @ self.w.lm_head.T  # [T, V]

    def _attention(self, i: int, lw: LayerWeights, x: np.ndarray, positions: np.ndarray,
                   cos: np.ndarray, sin: np.ndarray, cache: KVCache) -> np.ndarray:
        cfg = self.cfg
        T = x.shape[0]
        q = x @ lw.q.T  # [T, nh*hd]
        k = x @ lw.k.T  # [T, nkv*hd]
        v = x @ lw.v.T
        if lw.q_bias is not None:
            q, k, v = q + lw.q_bias, k + lw.k_bias, v + lw.v_bias
        q = q.reshape(T, cfg.num_heads, cfg.head_dim)  # [T, nh, hd]
        k = k.reshape(T, cfg.num_kv_heads, cfg.head_dim)  # [T, nkv, hd]
        v = v.reshape(T, cfg.num_kv_heads, cfg.head_dim)
        if lw.q_norm is not None:
            q = ops.rms_norm(q, lw.q_norm, cfg.rms_norm_eps)
            k = ops.rms_norm(k, lw.k_norm, cfg.rms_norm_eps)
        q = ops.apply_rope(q, cos, sin)
        k = ops.apply_rope(k, cos, sin)
        keys, values = cache.extend(i, k, v)  # [S, nkv, hd]
        mask = ops.attention_mask(positions, np.arange(keys.shape[0]), cfg.sliding_windows[i])  # [T, S]
        out = ops.gqa_attention(q, keys, values, mask)  # [T, nh*hd]
        return out @ lw.o.T  # [T, H]

    def _moe(self, i: int, lw: LayerWeights, x: np.ndarray) -> np.ndarray:
        cfg = self.cfg
        T = x.shape[0]
        ids, weights = ops.route_top_k(x @ lw.router.T, cfg.top_k, cfg.norm_topk_prob)  # [T, k]
        tokens = np.repeat(np.arange(T, dtype=np.int64), cfg.top_k)  # [P]
        experts, pair_w = ids.reshape(-1), weights.reshape(-1)  # [P]
        self._count(i, experts)
        if self.route_tail_skip > 0:
            keep = pair_w >= self.route_tail_skip
            self.stats.skipped_pairs += int(np.count_nonzero(~keep))
            tokens, experts, pair_w = tokens[keep], experts[keep], pair_w[keep]
        y = np.zeros_like(x)  # [T, H]
        if tokens.size:
            rows, cpu_tokens = np.unique(tokens, return_inverse=True)  # only tokens with CPU work travel
            self.pool.submit(PoolRequest(i, np.ascontiguousarray(x[rows]), cpu_tokens.astype(np.int64),
                                         experts, pair_w))
            y[rows] = self.pool.collect()  # [T_cpu, H]
        if lw.shared_expert is not None:
            se = lw.shared_expert
            y = y + ops.sigmoid(x @ lw.shared_expert_gate.T) * ops.swiglu_mlp(x, se.gate, se.up, se.down)
        return y

    def _count(self, layer: int, experts: np.ndarray) -> None:
        counts = self.stats.per_layer_expert.setdefault(layer, np.zeros(self.cfg.num_experts, np.int64))
        counts += np.bincount(experts, minlength=self.cfg.num_experts)
        self.stats.routed_pairs += experts.size
