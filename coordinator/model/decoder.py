"""The MoE network, written once: embedding, attention with a KV cache, MoE and dense MLPs, lm_head.

Every op goes through the backend chosen when the engine opened (model/backend.py: the host's compiled loops or a
GPU's kernels); routed experts go through an ExpertPool, and the experts kept beside the network through the
backend's own. ``Decoder.forward(StepBatch, step)`` is the one forward: the step (model/step.py) says where its
inputs come from and where keys, values, the pool's pairs and the logits go; a GPU's graph runner
(coordinator/gpu/graph_steps.py) wraps this unchanged forward with a step of its own.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from dataclasses import dataclass

import numpy as np

from ..pool import ExpertPool, PoolRequest
from . import linear_attention, ops
from .backend import Backend, Loaded
from .kv_cache import CacheLayout, KVCache
from .model_config import ModelConfig
from .ops import MlaRows
from .routing import CpuBatch, Pairs, Routing, RoutingStats
from .step import EagerStep, StepBatch, StepOutput
from .weights import LayerWeights, ModelWeights

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class FusedQKV:
    """A layer's q, k and v projections as one matrix: the device side's one matmul in place of three (at
    decode each call costs more than its work)."""

    weight: object  # [(nh + 2 nkv) * hd, H]: q's rows, then k's, then v's
    bias: object | None  # [(nh + 2 nkv) * hd]
    q_end: int  # q's rows end here
    k_end: int  # k's here; v's at the end


@dataclass(frozen=True)
class DecoderOptions:
    route_tail_skip: float = 0.0  # routed pairs of a smaller weight are dropped (EngineConfig.route_tail_skip)
    kv_dtype: str = "f32"  # the KV cache's values, "f32" or "bf16" (a GPU's; the host keeps float32)
    # a row's result fixed by the row alone (EngineConfig.batch_invariant): MLA in the absorbed form a row at a time
    # over the keys it sees, the Gated DeltaNet a token at a time
    batch_invariant: bool = True


class Decoder:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, pool: ExpertPool, backend: Backend,
                 loaded: Loaded | None = None, options: DecoderOptions = DecoderOptions()):
        """``backend``: the side the network runs on (model/backend.py), chosen once; ``loaded``: what it put there
        at open (Backend.load: the routed experts kept beside the network, the dense weights in their storage
        formats); None: no experts kept, the weights placed by Backend.place_weights."""
        loaded = loaded or Loaded({})
        self.cfg, self.backend, self.pool = cfg, backend, pool
        self.xp = backend.xp
        self.w = backend.place_weights(weights, loaded.weights)  # the embedding stays on the host (a step reads T rows)
        self.kv_dtype = options.kv_dtype if backend.gpu else "f32"
        self.qkv: list[FusedQKV | None] = [None] * len(self.w.layers)  # per layer, where the backend fuses them
        for i, lw in enumerate(self.w.layers):  # a fused layer's q, k, v become views of its matrix: no second copy
            self.w.layers[i], self.qkv[i] = backend.fuse_qkv(lw)
        # per layer, the backend's one call for the attention half at one token, where it has one
        self.blocks = [backend.attention_block(cfg, i, lw) for i, lw in enumerate(self.w.layers)]
        self.mtp, self.mtp_embed, self.mtp_head = self._mtp_weights(weights)
        self.device_experts = backend.device_experts(loaded.experts)
        self.on_device = {i: np.zeros(cfg.num_experts, bool) for i in cfg.moe_layers}  # layer -> [E]
        for layer, e in self.device_experts.keys():
            self.on_device[layer][e] = True
        self.has_device = {i: bool(d.any()) for i, d in self.on_device.items()}  # a layer with none skips the split
        self.route_tail_skip = options.route_tail_skip
        self.invariant = options.batch_invariant
        self.router = ops.RouterSpec.of(cfg)  # the router's rule, once: every MoE layer's call takes it
        self.inv_freq, self.rope_scale = rope_frequencies(cfg)
        self.mla_absorb: bool | None = None  # MLA: None picks per call (absorbed); True/False forces a form
        self.stats = RoutingStats()
        # per layer, the backend's one call for the MoE half, its add and the next norm at one token, where it has one
        self.moe_blocks = [self._moe_block_of(i) for i in range(len(self.w.layers))]

    def new_cache(self) -> KVCache:
        cfg = self.cfg
        latent = (cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim) if cfg.mla is not None else None
        layout = CacheLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, latent, self.kv_dtype,
                             tuple(cfg.attention_layers))
        cache = KVCache(layout, xp=self.xp, to_bf16=self.backend.to_bf16)
        if cfg.linear is not None:
            cache.linear = self.backend.linear_states(cfg.linear,
                                                      [i for i in range(cfg.num_layers) if cfg.is_linear(i)])
        return cache

    def new_mtp_cache(self) -> KVCache:
        """A sequence's cache of the MTP layer alone (layer id num_layers): its positions run behind the model's."""
        cfg = self.cfg
        latent = (cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim) if cfg.mla is not None else None
        layout = CacheLayout(1, cfg.num_kv_heads, cfg.head_dim, latent, self.kv_dtype, first_layer=cfg.num_layers)
        return KVCache(layout, xp=self.xp, to_bf16=self.backend.to_bf16)

    def rope_tables(self, positions: np.ndarray):
        """cos, sin [len(positions), d] where the network runs (YaRN's attention factor applied)."""
        cos, sin = ops.rope_cos_sin(positions, self.inv_freq)
        if self.rope_scale != 1.0:
            cos, sin = cos * np.float32(self.rope_scale), sin * np.float32(self.rope_scale)
        return self.xp.asarray(cos), self.xp.asarray(sin)

    def forward(self, batch: StepBatch, step: EagerStep | None = None) -> StepOutput:
        """Several sequences in one pass: attention per sequence, everything else on all rows at once, so the
        expert pool sees one batch per layer. Returns each sequence's logits (StepBatch.wanted's rows) and, where
        asked, its rows after the final norm (the MTP layer's input: every row for the sequences in all_rows or
        hidden_rows, else the last). ``step``: how the pass meets its inputs, caches, pool and logits
        (model/step.py; None: an EagerStep)."""
        step = step or EagerStep(self, batch)
        b, eps, layers = self.backend, self.cfg.rms_norm_eps, self.w.layers
        h, rope = step.inputs()  # [N, H], cos and sin [N, d]
        a = b.rms_norm(h, layers[0].input_norm if layers else self.w.final_norm, eps)  # [N, H]
        keep = step.last_rows() if batch.last_rows_only and layers else None  # the last layer's rows (StepBatch)
        linear = b.linear_step(batch.seqs, batch.lengths) if self.cfg.linear is not None else None
        for i, lw in enumerate(layers):  # each residual add joined to the norm after it
            rows = keep if i == len(layers) - 1 else None  # every row's keys and values cached, then these rows
            joined = None if self.blocks[i] is None else step.attention_block(i, self.blocks[i], h, a, rope)
            routed = None  # the router's (ids, weights) where the block made them
            if joined is not None:  # one token: the attention half, its add and norm, the router in one call
                h, m, routed = joined
            else:
                attended = (self._linear_attention(i, lw, a, batch, rows, linear) if lw.linear is not None else
                            self._attention(i, lw, a, step, rope, rows))  # [N or len(rows), H]
                if rows is not None:
                    h = h[rows]  # [B, H] from here on
                h, m = b.add_rms_norm(h, attended, lw.post_attn_norm, eps)
            # one token routed by the block: its experts, the add and the next norm in one call where the pool allows
            after = None if routed is None else self.moe_block(i, lw, h, m, routed)
            if after is None:
                y = step.moe(i, lw, m, routed) if self.cfg.sparse_layers[i] else b.swiglu_mlp(
                    m, lw.dense_mlp.gate, lw.dense_mlp.up, lw.dense_mlp.down)
                after = b.add_rms_norm(h, y, self._norm_after(i), eps)
            h, a = after  # a: the next layer's input, after the last the final norm's output
        hidden = self._hidden_rows(batch, a, keep is not None) if batch.hidden else None
        if keep is None and batch.wanted != batch.lengths:  # no layer dropped the rows: take them here
            a = step.wanted_rows(a)
        logits = step.logits(a)  # [sum(wanted), V] on the host
        step.finish()
        ends = np.cumsum([0] + batch.wanted)
        return StepOutput([logits[lo:hi] for lo, hi in zip(ends[:-1], ends[1:])], hidden)

    @staticmethod
    def _hidden_rows(batch: StepBatch, a, kept: bool) -> list:
        """Each sequence's rows of a (after the final norm) asked for: every row for those in all_rows or
        hidden_rows, else the last (a's row s where the last layer kept those alone)."""
        every = batch.all_rows | batch.hidden_rows
        if kept:
            return [a[k:k + 1] for k in range(len(batch.seqs))]
        return [a[hi - (n if k in every else 1):hi] for k, (hi, n) in enumerate(zip(batch.bounds[1:], batch.lengths))]

    def _mtp_weights(self, weights: ModelWeights):
        """(the MTP layer's weights where the network runs, its embedding on the host, its head) or Nones: float32
        where the network runs, the head the model's own lm_head (as placed) where they are one array."""
        m = weights.mtp
        if m is None:
            return None, None, None
        self.qkv.append(None)  # the MTP layer keeps q, k and v apart
        head_is_lm_head = m.head is weights.lm_head
        on = self.backend.upload(dataclasses.replace(m, embed=None, head=None if head_is_lm_head else m.head))
        return on, m.embed, self.w.lm_head if head_is_lm_head else on.head

    def forward_mtp(self, seqs: list[tuple[list, np.ndarray, KVCache]], last_only: bool = True
                    ) -> tuple[list[np.ndarray], list]:
        """The MTP layer over several sequences, each (hidden rows: a list of [T_i, H] the model's output at
        positions p..p+T-1 after its final norm, the token ids [T] that followed them, its MTP cache, whose
        next position is p (cache.start + cache.length)):
        row j joins hidden state h_(p+j) with token t_(p+j+1) and predicts t_(p+j+2) (DeepSeek-V3's MTP module:
        eh_proj of [enorm(embedding) ; hnorm(hidden)], one decoder layer, shared_head's norm and head). Returns
        each sequence's logits (host) and its output rows before the head's norm, or with mtp_chains_normed after
        it (the next draft's hidden state): its last row's with last_only, else every row's."""
        cfg, xp, b, eps, m, L = self.cfg, self.xp, self.backend, self.cfg.rms_norm_eps, self.mtp, self.cfg.num_layers
        batch = StepBatch([(ids, cache) for _, ids, cache in seqs])
        step = EagerStep(self, batch)  # the MTP caches' positions; RoPE at the text's (cache.start on)
        rope = self.rope_tables(np.concatenate([p + c.start for p, (_, _, c) in zip(batch.positions, seqs)]))
        e = xp.asarray(self.mtp_embed[batch.ids])  # [N, H]
        parts = [p for rows, _, _ in seqs for p in rows]
        h = parts[0] if len(parts) == 1 else xp.concatenate(parts)  # [N, H]
        if h.shape[0] != e.shape[0]:
            raise ValueError(f"MTP: {h.shape[0]} hidden rows for {e.shape[0]} tokens")
        x = xp.concatenate([b.rms_norm(e, m.enorm, eps), b.rms_norm(h, m.hnorm, eps)], axis=1) @ m.eh_proj.T
        lw = m.layer  # x [N, H]: the MTP layer's input, through a decoder layer as any other
        attended = self._attention(L, lw, b.rms_norm(x, lw.input_norm, eps), step, rope)
        x, a = b.add_rms_norm(x, attended, lw.post_attn_norm, eps)
        y = self.moe(L, lw, a) if cfg.sparse_layers[L] else b.swiglu_mlp(a, lw.dense_mlp.gate, lw.dense_mlp.up,
                                                                         lw.dense_mlp.down)
        x, a = b.add_rms_norm(x, y, m.head_norm, eps)  # x: the output, a: after shared_head.norm
        if cfg.mtp_chains_normed:  # Qwen3-Next chains the rows the head takes
            x = a
        step.finish()
        bounds = batch.bounds
        if last_only:
            rows = step.last_rows()
            x, a, bounds = x[rows], a[rows], np.arange(len(seqs) + 1)
        logits = b.to_host(a @ self.mtp_head.T)  # [rows, V]
        return ([logits[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])],
                [x[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])])

    def _attention(self, i: int, lw: LayerWeights, x, step: EagerStep, rope, rows=None):
        """The attention's output [N, H], or with ``rows`` (each sequence's last row) only those rows' queries and
        output [B, H]; every row's keys and values are cached either way (the step's attend)."""
        cfg, b = self.cfg, self.backend
        if lw.mla is not None:
            return self._mla_attention(i, lw, x, step, rope, rows)
        q, k, v = self._project_qkv(i, lw, x, rows)  # [N or B, nh, hd], [N, nkv, hd], [N, nkv, hd]
        cos, sin = rope
        q = b.norm_rope(q, lw.q_norm, cfg.rms_norm_eps, *((cos, sin) if rows is None else (cos[rows], sin[rows])))
        k = b.norm_rope(k, lw.k_norm, cfg.rms_norm_eps, cos, sin)  # q_norm, k_norm (Qwen3; or none), then RoPE
        out = step.attend(i, q, k, v, cfg.sliding_windows[i], rows)  # [N or B, nh*hd]
        if lw.q_gate is not None:  # Qwen3-Next: a sigmoid gate per output channel, from the queries' rows of x
            out = out * b.sigmoid((x if rows is None else x[rows]) @ lw.q_gate.T)
        return out @ lw.o.T  # [N or B, H]

    def _project_qkv(self, i: int, lw: LayerWeights, x, rows=None):
        """x [N, H] -> q [N, nh, hd] (only ``rows``' queries, [len(rows), nh, hd], where given), k and v [N, nkv,
        hd]: one matmul where the layer's are fused (then views of its output), else three."""
        cfg, N, fused = self.cfg, x.shape[0], self.qkv[i]
        if fused is not None:
            qkv = x @ fused.weight.T  # [N, (nh + 2 nkv) * hd]
            if fused.bias is not None:
                qkv = qkv + fused.bias
            q, k, v = qkv[:, : fused.q_end], qkv[:, fused.q_end : fused.k_end], qkv[:, fused.k_end :]
            q = q if rows is None else q[rows]
        else:
            q = (x if rows is None else x[rows]) @ lw.q.T  # [N or len(rows), nh*hd]
            k, v = x @ lw.k.T, x @ lw.v.T  # [N, nkv*hd]
            if lw.q_bias is not None:
                q, k, v = q + lw.q_bias, k + lw.k_bias, v + lw.v_bias
        return (q.reshape(q.shape[0], cfg.num_heads, cfg.head_dim), k.reshape(N, cfg.num_kv_heads, cfg.head_dim),
                v.reshape(N, cfg.num_kv_heads, cfg.head_dim))

    def _linear_attention(self, i: int, lw: LayerWeights, x, batch: StepBatch, rows=None, linear=None):
        """A Gated DeltaNet layer (linear_attention.py) [N, H]: every row advances its sequence's state, kept in
        its cache; ``rows`` as _attention's (the output's rows taken after). ``linear``: the backend's step tables
        where it runs the layer itself (a GPU's one kernel between the projections)."""
        if linear is not None:
            gated = self.backend.linear_layer(lw.linear, self.cfg, x, i, linear, batch.bounds)  # [N, Hv*dv]
            return (gated if rows is None else gated[rows]) @ lw.linear.out.T
        lc, parts = self.cfg.linear, []
        for s, (_, cache) in enumerate(batch.seqs):
            if i not in cache.states:
                cache.states[i] = linear_attention.LinearState(lc, chunked=not self.invariant)
            parts.append((slice(batch.bounds[s], batch.bounds[s + 1]), cache.states[i], cache.length))
        out = linear_attention.layer(lw.linear, lc, x, parts, self.cfg.rms_norm_eps)
        return out if rows is None else out[rows]

    def _mla_attention(self, i: int, lw: LayerWeights, x, step: EagerStep, rope, rows=None):
        """DeepSeek's multi-head latent attention; the cache keeps each token's latent and rope key. ``rows``:
        as _attention's."""
        cfg, m, w, b = self.cfg, self.cfg.mla, lw.mla, self.backend
        nh, dn = cfg.num_heads, m.qk_nope_head_dim
        xq = x if rows is None else x[rows]  # the rows whose queries are asked for
        if w.q is not None:
            q = xq @ w.q.T
        else:
            q = b.rms_norm(xq @ w.q_a.T, w.q_a_norm, cfg.rms_norm_eps) @ w.q_b.T
        q = q.reshape(xq.shape[0], nh, m.qk_head_dim)  # [N or B, nh, dn+dr]
        ckv = x @ w.kv_a.T  # [N, c+dr]
        latent = b.rms_norm(self.xp.ascontiguousarray(ckv[:, : m.kv_lora_rank]), w.kv_a_norm, cfg.rms_norm_eps)
        k_rope = self.mla_rotate(ckv[:, None, m.kv_lora_rank :], *rope)[:, 0]  # [N, dr]
        out = step.attend_mla(i, lw, MlaRows(q[..., :dn], q[..., dn:], latent, k_rope), rope, rows)  # [N or B, nh*dv]
        return out @ lw.o.T  # [N or B, H]

    def mla_rotate(self, x, cos, sin):
        """MLA's RoPE: interleaved pairs where the model's rope_interleave says so, else the half-split form."""
        b = self.backend
        return b.apply_rope_interleaved(x, cos, sin) if self.cfg.mla.rope_interleave else b.apply_rope(x, cos, sin)

    def mla_core(self, lw: LayerWeights, rows: MlaRows, mask):
        """One sequence's MLA: its queries (q_rope roped) over its cached latents [S, c] and rope keys [S, dr], in
        the absorbed form or with the latents expanded through kv_b, whichever takes fewer multiply-adds."""
        m, w, b = self.cfg.mla, lw.mla, self.backend
        if self.absorbed(rows.q_nope.shape[0], rows.latent.shape[0]):
            w_uk, w_uv = (w.w_uk, w.w_uv) if w.w_uk is not None else self.kv_b_heads(w.kv_b)
            if self.invariant and rows.q_nope.shape[0] > 1:
                return self._mla_rows_alone(rows, (w_uk, w_uv), mask)
            return b.mla_attention_absorbed(rows, w_uk, w_uv, mask, m.softmax_scale)
        lat = b.widen(rows.latent)  # a bf16 cache's latents as float32 for the product
        kv = (lat @ w.kv_b.T).reshape(lat.shape[0], self.cfg.num_heads, m.qk_nope_head_dim + m.v_head_dim)
        dn = m.qk_nope_head_dim
        return b.mla_attention(rows, kv[..., :dn], kv[..., dn:], mask, m.softmax_scale)

    def _mla_rows_alone(self, rows: MlaRows, heads: tuple, mask):
        """The absorbed MLA a query row at a time over the keys it sees (its mask's prefix), as each row computes
        alone in decode: its bits do not depend on the rows prefilled or verified beside it."""
        scale, xp = self.cfg.mla.softmax_scale, self.xp
        seen = self.backend.to_host(mask).sum(axis=1)  # [T] keys each row sees, a prefix of the cache
        out = []
        for t, n in enumerate(seen.tolist()):
            alone = MlaRows(rows.q_nope[t:t + 1], rows.q_rope[t:t + 1], rows.latent[:n], rows.k_rope[:n])
            out.append(self.backend.mla_attention_absorbed(alone, *heads, mask[t:t + 1, :n], scale))
        return xp.concatenate(out, axis=0)  # [T, nh*dv]

    def kv_b_heads(self, kv_b):
        """(W_uk [nh, dn, c], W_uv [nh, dv, c]) of MLA's kv_b, as the backend keeps them (Backend.kv_b_heads)."""
        m = self.cfg.mla
        return self.backend.kv_b_heads(kv_b, self.cfg.num_heads, m.qk_nope_head_dim, m.v_head_dim, m.kv_lora_rank)

    def absorbed(self, T: int, S: int) -> bool:
        """Whether T new tokens over S cached ones take the absorbed form: the one with fewer multiply-adds.
        Decode always does; a prefill of a few hundred tokens expands the latents through kv_b_proj."""
        if self.mla_absorb is not None:
            return self.mla_absorb
        if self.invariant:  # the form a row takes alone, whatever rows are beside it
            return True
        m, nh = self.cfg.mla, self.cfg.num_heads
        c, dn, dr, dv = m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        absorbed = nh * T * (c * (dn + dv) + S * (2 * c + dr))
        expanded = nh * (S * c * (dn + dv) + T * S * (dn + dr + dv))
        return absorbed < expanded

    def moe(self, i: int, lw: LayerWeights, x, routed=None):
        """route -> submit the CPU pairs -> device and shared experts meanwhile -> collect -> sum. ``routed``: the
        router's (ids, weights) [T, k] for x where the backend's attention block made them."""
        routing = self._route(i, lw, x, routed)
        self.stats.count(routing, self.cfg.num_experts)
        sent = self._submit_cpu(routing, x)  # the CPU work first ...
        y_dev = self._device_side(routing, x)  # ... ours queued on the device's side stream meanwhile
        y_shared = self.shared_output(lw, x)  # also while the pool works
        y = self._collect_cpu(sent, x) if sent is not None else self.xp.zeros_like(x)  # [T, H]: Y_0 + Y_1 + ...
        if y_dev is not None:
            self.backend.join_side()
            y = y + y_dev  # then the device experts' output
        if y_shared is not None:
            y = y + y_shared  # then the shared experts'
        return y

    def moe_block(self, i: int, lw: LayerWeights, h, m, routed):
        """Layer i's MoE half, the residual add and the norm after it in the backend's one call
        (Backend.moe_block), where the router's ``routed`` pairs for the one row m go to the pool whole (none on
        the device, none skipped): (h + the layer's output, its norm) [1, H]; else None (the separate calls)."""
        block = self.moe_blocks[i]
        if block is None or self.has_device[i] or self.route_tail_skip > 0:
            return None
        return block(h, m, routed, self.shared_output(lw, m))

    def _moe_block_of(self, i: int):
        """Layer i's MoE block (Backend.moe_block) where it routes and the pool gives its experts for one row."""
        if not self.cfg.sparse_layers[i]:
            return None
        return self.backend.moe_block(self.cfg, self.pool.row_experts(i), self._norm_after(i), self.stats,
                                      last=i == len(self.w.layers) - 1)

    def _norm_after(self, i: int):
        """The norm that takes layer i's output: the next layer's input norm, the final norm after the last."""
        layers = self.w.layers
        return layers[i + 1].input_norm if i + 1 < len(layers) else self.w.final_norm

    def shared_output(self, lw: LayerWeights, x):
        """The shared experts' output [T, H] (the network's side, never the pool's), or None where the layer has
        none."""
        if lw.shared_expert is None:
            return None
        se, b = lw.shared_expert, self.backend
        y_shared = b.swiglu_mlp(x, se.gate, se.up, se.down)
        if lw.shared_expert_gate is not None:  # qwen2_moe's gate; DeepSeek's shared experts have none
            y_shared = b.sigmoid(x @ lw.shared_expert_gate.T) * y_shared
        return y_shared

    def _route(self, i: int, lw: LayerWeights, x, routed=None) -> Routing:
        """The router's top-k pairs of every row (``routed`` where made already), less the tail skip, split
        device / CPU."""
        cfg = self.cfg
        T = x.shape[0]
        ids, weights = routed or self.backend.route(x @ lw.router.T, lw.router_bias, self.router)  # [T, k], host
        chosen = ids.reshape(-1)  # [P]
        pairs = Pairs(pair_rows(T, cfg.top_k), chosen, weights.reshape(-1))
        skipped = 0
        if self.route_tail_skip > 0:
            keep = pairs.weights >= self.route_tail_skip
            skipped = int(np.count_nonzero(~keep))
            pairs = pairs[keep]
        if not self.has_device[i]:  # every pair to the pool, no masks taken
            return Routing(i, chosen, skipped, device=pairs[:0], cpu=pairs)
        dev = self.on_device[i][pairs.experts]  # [P] pair served on the device
        return Routing(i, chosen, skipped, device=pairs[dev], cpu=pairs[~dev])

    def _submit_cpu(self, routing: Routing, x) -> CpuBatch | None:
        """Send the layer's CPU pairs to the pool (only the rows with CPU work travel); None when there are none."""
        cpu = routing.cpu
        if not cpu.size:
            return None
        sends = np.bincount(cpu.tokens, minlength=x.shape[0]) > 0 if x.shape[0] > 1 else None  # [T] rows with pairs
        if sends is None or sends.all():  # every row (decode, a verify's rows): the pairs' rows are the layer's
            rows, local = np.arange(x.shape[0]), cpu.tokens
        else:
            rows, local = np.flatnonzero(sends), (np.cumsum(sends) - 1)[cpu.tokens]
        rows_dev = None if rows.size == x.shape[0] else self.xp.asarray(rows)  # [T_cpu]; None: all of them
        x_cpu = self.backend.rows_to_host(x if rows_dev is None else x[rows_dev])  # [T_cpu, H] to the host
        self.pool.submit(PoolRequest(routing.layer, x_cpu, local.astype(np.int64), cpu.experts, cpu.weights))
        return CpuBatch(rows, rows_dev)

    def _device_side(self, routing: Routing, x):
        """The device experts' share [T, H], queued on the side stream; None when the layer has no device pairs."""
        if not routing.device.size:
            return None
        d = routing.device
        with self.backend.side_stream():
            return self.device_experts.run(routing.layer, x, d.tokens, d.experts, d.weights)

    def _collect_cpu(self, sent: CpuBatch, x):
        """The pool's sum of the nodes' partials where the network runs, in the layer's rows [T, H] (zero where a
        row sent nothing). With NumPy and every row sent it is the reused host buffer itself, valid until the next
        layer's collect: the caller only adds it to new arrays."""
        t0 = time.perf_counter_ns()
        partials = self.pool.collect(out=self.backend.partials_buffer((sent.rows.size, x.shape[1])))  # [T_cpu, H]
        self.stats.count_pool_wait(time.perf_counter_ns() - t0)
        if sent.rows_dev is None:  # every row: the partials are the layer's rows, no zeros and no scatter
            return self.backend.to_device(partials)
        y = self.xp.zeros_like(x)
        y[sent.rows_dev] = self.backend.to_device(partials)
        return y


@functools.lru_cache(maxsize=64)
def pair_rows(T: int, k: int) -> np.ndarray:
    """[T * k] each row's index k times (a router's pairs' rows), made once per row count, read-only."""
    rows = np.repeat(np.arange(T, dtype=np.int64), k)
    rows.flags.writeable = False
    return rows


def rope_frequencies(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """(RoPE's inverse frequencies, the factor on cos and sin: YaRN's attention factor, else 1)."""
    if cfg.mla is not None:
        rope_dim = cfg.mla.qk_rope_head_dim
        if cfg.yarn is not None:
            y = cfg.yarn
            return (ops.yarn_inv_freq(rope_dim, cfg.rope_theta, y.factor, y.original_max_position_embeddings,
                                      y.beta_fast, y.beta_slow, y.truncate), y.attention_factor)
        return ops.rope_inv_freq(rope_dim, cfg.rope_theta, cfg.rope_factor), 1.0
    return ops.rope_inv_freq(cfg.rotary_dim or cfg.head_dim, cfg.rope_theta, cfg.rope_factor), 1.0
