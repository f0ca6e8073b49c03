"""The MoE decoder: embedding, attention with a KV cache, MoE and dense MLPs, lm_head.

Routed experts go through an ExpertPool; everything else runs here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from ..device import router
from ..device.experts import DeviceExperts
from ..device.weights import DeviceMatrix, upload
from ..pool import ExpertPool, PoolRequest
from . import device_ops, linear_attention, ops
from .kv_cache import KVCache
from .model_config import ModelConfig
from .weights import LayerWeights, ModelWeights
from .xp import HostStaging, SideStream, host_functions_refused, is_device, module, to_host


def on_device(obj, xp, _uploaded: dict | None = None):
    """A weights dataclass (nested) with every array moved to ``xp``; NumPy arrays stay as they are.

    An array met twice (a tied embedding and lm_head) is uploaded once and shared.
    """
    if xp is np:
        return obj
    uploaded = {} if _uploaded is None else _uploaded  # id(host array) -> device array
    if isinstance(obj, np.ndarray):
        if id(obj) not in uploaded:
            uploaded[id(obj)] = xp.asarray(obj)
        return uploaded[id(obj)]
    if isinstance(obj, list):
        return [on_device(v, xp, uploaded) for v in obj]
    if isinstance(obj, dict):
        return {k: on_device(v, xp, uploaded) for k, v in obj.items()}
    if hasattr(obj, "__dataclass_fields__"):
        return type(obj)(**{k: on_device(getattr(obj, k), xp, uploaded) for k in obj.__dataclass_fields__})
    return obj


@dataclass(frozen=True, eq=False)
class FusedQKV:
    """A layer's q, k and v projections as one matrix: the device side's one matmul in place of three (at
    decode each call costs more than its work)."""

    weight: object  # [(nh + 2 nkv) * hd, H]: q's rows, then k's, then v's
    bias: object | None  # [(nh + 2 nkv) * hd]
    q_end: int  # q's rows end here
    k_end: int  # k's here; v's at the end


def fuse_qkv(lw: LayerWeights, xp) -> tuple[LayerWeights, FusedQKV | None]:
    """The layer with q, k and v (and their biases) as views of one new matrix, and that matrix; an MLA layer,
    or one whose q, k and v are stored in different formats (a Q4_K_M file's Q6_K v), as it is, and None."""
    if lw.q is None:
        return lw, None
    mats = (lw.q, lw.k, lw.v)
    q_end, k_end = lw.q.shape[0], lw.q.shape[0] + lw.k.shape[0]
    if all(isinstance(m, DeviceMatrix) for m in mats) and len({(m.fmt, m.shape[1]) for m in mats}) == 1:
        weight = DeviceMatrix.stack(list(mats), xp)
        views = dict(q=weight.rows(0, q_end), k=weight.rows(q_end, k_end), v=weight.rows(k_end, weight.shape[0]))
    elif not any(isinstance(m, DeviceMatrix) for m in mats):
        weight = xp.concatenate(list(mats))
        views = dict(q=weight[:q_end], k=weight[q_end:k_end], v=weight[k_end:])
    else:
        return lw, None
    bias = None
    if lw.q_bias is not None:
        bias = xp.concatenate([lw.q_bias, lw.k_bias, lw.v_bias])
        views.update(q_bias=bias[:q_end], k_bias=bias[q_end:k_end], v_bias=bias[k_end:])
    return dataclasses.replace(lw, **views), FusedQKV(weight, bias, q_end, k_end)


log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Pairs:
    """(token, expert, weight) pairs of one MoE layer, in router order."""

    tokens: np.ndarray  # [P] int64 row of the layer's x
    experts: np.ndarray  # [P] int64
    weights: np.ndarray  # [P] float32

    @property
    def size(self) -> int:
        return int(self.tokens.size)

    def __getitem__(self, mask: np.ndarray) -> Pairs:
        return Pairs(self.tokens[mask], self.experts[mask], self.weights[mask])


@dataclass(frozen=True, eq=False)
class Routing:
    """One MoE layer's routing: what the router chose, what the tail skip dropped, and the kept
    pairs split by where their expert lives."""

    layer: int
    chosen: np.ndarray  # [T*k] every expert the router chose, skipped ones included
    skipped: int  # pairs dropped by route_tail_skip
    device: Pairs  # served by device-resident experts
    cpu: Pairs  # sent to the CPU pool


@dataclass(frozen=True, eq=False)
class CpuBatch:
    """What went to the pool for one layer: the rows of x with CPU work (the request's rows, in order)."""

    rows: np.ndarray  # [T_cpu] host
    rows_dev: object  # the same on the device (xp array); None when every row of the layer is sent


@dataclass
class RoutingStats:
    routed_pairs: int = 0  # (token, expert) pairs the router chose
    skipped_pairs: int = 0  # dropped by route_tail_skip
    cpu_expert_loads: int = 0  # over all pool requests: distinct experts each one touched
    device_pairs: int = 0  # routed pairs served by device-resident experts
    cpu_pairs: int = 0  # routed pairs sent to the CPU pool
    device_expert_loads: int = 0  # distinct device experts per layer call, summed
    pool_wait_ns: int = 0  # the coordinator waiting in collect() for the pool

    @property
    def hit_rate(self) -> float | None:
        served = self.device_pairs + self.cpu_pairs
        return self.device_pairs / served if served else None
    per_layer_expert: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> [E] pair counts

    def count(self, routing: Routing, num_experts: int) -> None:
        """One layer's routing: the router's choices per expert, the skipped, and each side's pairs and experts."""
        counts = self.per_layer_expert.setdefault(routing.layer, np.zeros(num_experts, np.int64))
        counts += np.bincount(routing.chosen, minlength=num_experts)
        self.routed_pairs += routing.chosen.size
        self.skipped_pairs += routing.skipped
        self.device_pairs += routing.device.size
        self.cpu_pairs += routing.cpu.size
        if routing.cpu.size:  # distinct experts: a bincount, not a sort (np.unique), on every layer
            self.cpu_expert_loads += int(np.count_nonzero(np.bincount(routing.cpu.experts, minlength=num_experts)))
        if routing.device.size:
            self.device_expert_loads += int(np.count_nonzero(np.bincount(routing.device.experts,
                                                                         minlength=num_experts)))

    def count_pool_wait(self, ns: int) -> None:
        self.pool_wait_ns += ns


def last_row_ids(xp, bounds: np.ndarray):
    """Each sequence's last row [len(bounds) - 1] (bounds: the sequences' row ranges), an index on the device.

    With last_only the last layer carries on with these rows alone once every row's keys and values are
    cached: its attention computes only their queries, and the other rows' query projection, output
    projection, MoE, MLP and norms, which would feed no logits, are left out. llama.cpp does the same (its graphs take ``inp_out_ids``' rows in
    the last layer)."""
    return xp.asarray(bounds[1:] - 1)


class Decoder:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, pool: ExpertPool, route_tail_skip: float = 0.0,
                 device_experts: dict | DeviceExperts | None = None, backend: str = "numpy",
                 device_weights: ModelWeights | None = None, kv_dtype: str = "f32"):
        """``device_weights``: ``weights`` already on the device (coordinator/device/weights.upload, in their
        storage formats); None uploads them as float32. ``device_experts``: (layer, e) -> MLPWeights kept
        whole (the NumPy side), or a DeviceExperts (the GPU's, in their formats). ``kv_dtype``: the KV
        cache's values, "f32" or "bf16" (the device only)."""
        self.cfg = cfg
        self.backend = backend
        self.xp = module(backend)
        self.staging = HostStaging(backend)  # pinned host buffers for the pool's rows and partials
        self.side = SideStream(backend)  # the device experts' own stream
        # dense weights where the device side runs; the embedding stays on the host (a step reads T rows)
        self.w = weights if self.xp is np else device_weights or upload(weights, self.xp, dense_dtype="f32")
        self.kv_dtype = kv_dtype if self.xp is not np else "f32"
        self.qkv: list[FusedQKV | None] = [None] * len(self.w.layers)  # per layer; the host keeps three matrices
        if self.xp is not np:  # the uploaded q, k, v become views of the fused matrix: no second copy
            for i, lw in enumerate(self.w.layers):
                self.w.layers[i], self.qkv[i] = fuse_qkv(lw, self.xp)
        self.mtp, self.mtp_embed, self.mtp_head = self._mtp_weights(weights)
        self.pool = pool
        if isinstance(device_experts, DeviceExperts):
            self.device_experts = device_experts
            keys = device_experts.keys()
        else:  # (layer, e) -> MLPWeights kept whole where the device side runs
            self.device_experts = {k: on_device(v, self.xp) for k, v in (device_experts or {}).items()}
            keys = list(self.device_experts)
        self.on_device = {i: np.zeros(cfg.num_experts, bool) for i in cfg.moe_layers}  # layer -> [E]
        for layer, e in keys:
            self.on_device[layer][e] = True
        self.route_tail_skip = route_tail_skip
        self.rope_scale = 1.0  # multiplies cos and sin (YaRN's attention factor)
        if cfg.mla is not None:
            rope_dim = cfg.mla.qk_rope_head_dim
            if cfg.yarn is not None:
                y = cfg.yarn
                self.inv_freq = ops.yarn_inv_freq(rope_dim, cfg.rope_theta, y.factor, y.original_max_position_embeddings,
                                                  y.beta_fast, y.beta_slow, y.truncate)
                self.rope_scale = y.attention_factor
            else:
                self.inv_freq = ops.rope_inv_freq(rope_dim, cfg.rope_theta, cfg.rope_factor)
        else:
            self.inv_freq = ops.rope_inv_freq(cfg.rotary_dim or cfg.head_dim, cfg.rope_theta, cfg.rope_factor)
        self.mla_absorb: bool | None = None  # MLA: None picks per call (_absorbed); True/False forces a form
        self.stats = RoutingStats()
        self.graph = None  # graph_steps.GraphSteps where decode steps are graph-ready (enable_graph_steps)
        self._streaming = False  # inside a graph-ready step

    def enable_graph_steps(self, context: int | None = None, capture: bool = True, step_buffer: int = 0) -> bool:
        """Make small steps graph-ready (coordinator/model/graph_steps.py) where the device, the pool and the
        experts allow it; whether they are. ``context``: the longest sequence (None: the model's
        max_position_embeddings), what their caches are reserved to; ``capture``: each shape's steps replayed as
        a CUDA graph from its second step (else queued launch by launch); ``step_buffer``: the bytes of the
        steps' buffer made now (the VRAM plan's; 0: sized by the first step)."""
        if self.cfg.linear is not None:  # a graph-ready step has no Gated DeltaNet layer (nor the attention's gate)
            return False
        if self.xp is np or (any(d.any() for d in self.on_device.values())
                             and not isinstance(self.device_experts, DeviceExperts)):
            return False
        from .graph_steps import GraphSteps

        try:
            link = self.pool.stream_link(len(self.cfg.moe_layers), self.xp)
        except Exception as e:  # cudaHostRegister of the pool's segment refused (drivers have refused such mappings)
            link, why = None, f"the pool's segment could not be registered with the device ({type(e).__name__}: {e})"
        else:
            if link is None:  # a pool driven from Python only
                return False
            stream = self.xp.cuda.Stream()  # the steps' own: a capture needs one
            why = host_functions_refused(stream)  # libcuda loaded and a host function run now, not in a request
            if why is not None:
                self.pool.close_stream_link()
        if why is not None:
            log.warning("decode steps run eagerly, one layer at a time: %s", why)
            return False
        context = context or self.cfg.max_position_embeddings
        self.graph = GraphSteps(self.cfg, self.on_device, self.device_experts, link, self.xp, context,
                                self._rope_tables(np.arange(context)), self.w.embed.dtype, capture, step_buffer,
                                stream)
        return True

    def new_cache(self) -> KVCache:
        cfg = self.cfg
        latent = (cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim) if cfg.mla is not None else None
        cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, xp=self.xp, latent=latent,
                        dtype=self.kv_dtype, attention_layers=cfg.attention_layers)
        if cfg.linear is not None and self.xp is not np:
            cache.linear = linear_attention.DeviceLinearStates(
                cfg.linear, [i for i in range(cfg.num_layers) if cfg.is_linear(i)], self.xp)
        return cache

    def new_mtp_cache(self) -> KVCache:
        """A sequence's cache of the MTP layer alone (layer id num_layers): its positions run behind the model's."""
        cfg = self.cfg
        latent = (cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim) if cfg.mla is not None else None
        return KVCache(1, cfg.num_kv_heads, cfg.head_dim, xp=self.xp, latent=latent, dtype=self.kv_dtype,
                       first_layer=cfg.num_layers)

    def _rope_tables(self, positions: np.ndarray):
        cos, sin = ops.rope_cos_sin(positions, self.inv_freq)
        if self.rope_scale != 1.0:
            cos, sin = cos * np.float32(self.rope_scale), sin * np.float32(self.rope_scale)
        return self.xp.asarray(cos), self.xp.asarray(sin)

    def forward(self, token_ids: np.ndarray, cache: KVCache, last_only: bool = False) -> np.ndarray:
        """token_ids [T] after the cached ones -> logits [T, V] ([1, V] when last_only)."""
        return self.forward_batch([(token_ids, cache)], last_only=last_only)[0]

    def forward_batch(self, seqs: list[tuple[np.ndarray, KVCache]], last_only: bool = True,
                      all_rows: frozenset[int] = frozenset(), hidden: list | None = None,
                      hidden_rows: frozenset[int] = frozenset()) -> list[np.ndarray]:
        """Several sequences in one pass: attention per sequence, everything else on all rows at once,
        so the expert pool sees one batch per layer. Returns each sequence's logits: its last row's with
        last_only, every row's for the sequences in ``all_rows`` (a prompt's log-probabilities). ``hidden``: a
        list that gets each sequence's last-layer output after the final norm (the MTP layer's input): every
        row for the sequences in ``all_rows`` or ``hidden_rows`` (or without last_only), else the last row."""
        rows = sum(len(ids) for ids, _ in seqs)
        if self.graph is not None and self.graph.takes(rows):
            return self._graph_step(seqs, last_only, all_rows, hidden, hidden_rows, rows)
        return self._forward(seqs, last_only, all_rows, hidden, hidden_rows)

    def _graph_step(self, seqs, last_only: bool, all_rows: frozenset[int], hidden: list | None,
                    hidden_rows: frozenset[int], rows: int) -> list[np.ndarray]:
        """forward_batch on the stream (graph_steps.py): the host's part (tables, embedding rows, the pool's
        state), then the step queued, captured or replayed as a graph (GraphSteps.queue), one wait, then the
        caches advanced. A step a worker's death voided is redone eagerly."""
        from .graph_steps import StreamInterrupted

        g, link = self.graph, self.graph.link
        t0 = time.perf_counter_ns()
        asked = len(hidden) if hidden is not None else 0  # hidden's rows from before this step

        def queue_step():
            step_hidden: list | None = [] if hidden is not None else None
            self._streaming = True
            try:
                return self._forward(seqs, last_only, all_rows, step_hidden, hidden_rows), step_hidden
            finally:
                self._streaming = False

        with g.stream:  # the caches' reserve, the tables and the step, in this order on one stream
            g.begin(seqs, self._absorbed if self.cfg.mla is not None else None, all_rows)
            g.stage(self.w.embed, np.concatenate([ids for ids, _ in seqs]))
            link.begin_step(rows)
            key = g.key(seqs, last_only, all_rows, hidden is not None, hidden_rows)
            try:
                logits, step_hidden = g.queue(key, rows, queue_step)
                if hidden is not None:  # the hidden rows outlive the step: copied out of its buffer before the wait
                    hidden.extend(r.copy() for r in step_hidden)
                g.queued_at = time.perf_counter_ns()
                g.wait()
                out = [rows_.copy() for rows_ in logits]  # the page-locked rows: the next step overwrites them
            except BaseException:  # the queued work finishes before the pool is touched again; nothing is cached
                if hidden is not None:
                    del hidden[asked:]
                g.stream.synchronize()
                g.drop_counters()
                g.forget(key)  # a graph of a failed step is not replayed: its shape is queued, then captured anew
                with contextlib.suppress(Exception):  # the pool recovers from what the stream met; the first error is raised
                    link.end_step(rows)
                raise
        try:
            waited = link.end_step(rows)
        except BaseException as e:  # the pool met an error or a fault inside the step: nothing is cached
            g.forget(key)
            if hidden is not None:
                del hidden[asked:]
            if not isinstance(e, StreamInterrupted):
                raise
            log.warning("%s; the step is redone eagerly", e)
            g.redone += 1
            return self._forward(seqs, last_only, all_rows, hidden, hidden_rows)
        for ids, cache in seqs:  # the step's keys and values are in place: the caches take them
            cache.advance(len(ids))
        g.steps += 1
        g.host_ns += g.queued_at - t0
        g.wall_ns += time.perf_counter_ns() - t0
        g.fold_counters(self.stats, waited)
        return out

    def _logits(self, a):
        """lm_head's logits of the rows a [R, H] on the host: the step's synchronisation (a graph-ready step's
        routing counters copied beside them)."""
        if self._streaming:  # queued into page-locked rows with the routing counters: the caller waits
            return self.graph.logits(a @ self.w.lm_head.T)  # [R, V]
        return to_host(a @ self.w.lm_head.T)  # [R, V]

    def _forward(self, seqs: list[tuple[np.ndarray, KVCache]], last_only: bool, all_rows: frozenset[int],
                 hidden: list | None = None, hidden_rows: frozenset[int] = frozenset()) -> list[np.ndarray]:
        lengths = [len(ids) for ids, _ in seqs]
        bounds = np.cumsum([0] + lengths)  # row ranges of the sequences in the batch
        positions = [np.arange(c.length, c.length + n) for (_, c), n in zip(seqs, lengths)]
        xp, eps, layers = self.xp, self.cfg.rms_norm_eps, self.w.layers
        ids = np.concatenate([ids for ids, _ in seqs])  # [N]
        if self._streaming:  # the rows' RoPE and embedding through fixed places (graph_steps.GraphSteps.embed)
            rope, h = self.graph.rope(ids.shape[0]), self.graph.embed(ids.shape[0])
        else:
            rope = self._rope_tables(np.concatenate(positions))  # cos, sin [N, d]: every row's position
            h = xp.asarray(self.w.embed[ids])  # [N, H]: host rows, uploaded
        masks: dict = {}  # (sequence, window) -> [T_s, S_s] on the device: uploaded once, not once a layer
        a = ops.rms_norm(h, layers[0].input_norm if layers else self.w.final_norm, eps)  # [N, H]
        # the rows the last layer carries on with, where others' output nobody reads (last_row_ids)
        keep = None
        if last_only and not all_rows and not hidden_rows and layers and len(seqs) < bounds[-1]:
            keep = self.graph.tables.last_rows(len(seqs)) if self._streaming else last_row_ids(xp, bounds)
        linear = self._linear_step(seqs, lengths)  # the device's Gated DeltaNet tables, or None
        for i, lw in enumerate(layers):  # each residual add joined to the norm after it
            rows = keep if i == len(layers) - 1 else None  # every row's keys and values cached, then these rows
            attended = (self._linear_attention(i, lw, a, seqs, bounds, rows, linear) if lw.linear is not None else
                        self._attention(i, lw, a, seqs, bounds, positions, rope, masks, rows))  # [N or len(rows), H]
            if rows is not None:
                h = h[rows]  # [len(seqs), H] from here on
            h, m = ops.add_rms_norm(h, attended, lw.post_attn_norm, eps)
            y = self._moe(i, lw, m) if self.cfg.sparse_layers[i] else ops.swiglu_mlp(
                m, lw.dense_mlp.gate, lw.dense_mlp.up, lw.dense_mlp.down)
            h, a = ops.add_rms_norm(h, y, layers[i + 1].input_norm if i + 1 < len(layers) else self.w.final_norm,
                                    eps)  # a: the next layer's input, after the last the final norm's output
        if not self._streaming:  # a graph-ready step's caches advance once its work is done (_graph_step)
            for (_, cache), n in zip(seqs, lengths):
                cache.advance(n)
        if hidden is not None:  # each sequence's rows asked for, after the final norm (the MTP layer's input)
            every = all_rows | hidden_rows
            hidden.extend(a[k:k + 1] if keep is not None else a[hi - (n if k in every or not last_only else 1):hi]
                          for k, (hi, n) in enumerate(zip(bounds[1:], lengths)))
        if not last_only:
            logits = self._logits(a)  # [N, V]; a: after the final norm
            return [logits[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]
        # each sequence's rows that lm_head takes: its last, or every one for those in all_rows
        wanted = [n if k in all_rows else 1 for k, n in enumerate(lengths)]
        if keep is None and wanted != lengths:  # no layer dropped the rows: take them here
            a = (a[self.graph.tables.wanted_rows(sum(wanted))] if self._streaming else  # a gather: no host table
                 xp.concatenate([a[hi - n:hi] for hi, n in zip(bounds[1:], wanted)]))
        logits = self._logits(a)  # [sum(wanted), V]
        ends = np.cumsum([0] + wanted)
        return [logits[lo:hi] for lo, hi in zip(ends[:-1], ends[1:])]

    def _mtp_weights(self, weights: ModelWeights):
        """(the MTP layer's weights where the decoder runs, its embedding on the host, its head) or Nones: float32
        on the device, the head the model's own lm_head (as uploaded) where they are one array."""
        m = weights.mtp
        if m is None:
            return None, None, None
        self.qkv.append(None)  # the MTP layer keeps q, k and v apart
        head_is_lm_head = m.head is weights.lm_head
        on = on_device(dataclasses.replace(m, embed=None, head=None if head_is_lm_head else m.head), self.xp)
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
        cfg, xp, eps, m, L = self.cfg, self.xp, self.cfg.rms_norm_eps, self.mtp, self.cfg.num_layers
        lengths = [len(ids) for _, ids, _ in seqs]
        bounds = np.cumsum([0] + lengths)  # row ranges of the sequences in the batch
        positions = [np.arange(c.length, c.length + n) for (_, _, c), n in zip(seqs, lengths)]  # in the cache
        rope = self._rope_tables(np.concatenate([p + c.start for p, (_, _, c) in zip(positions, seqs)]))  # in text
        e = xp.asarray(self.mtp_embed[np.concatenate([ids for _, ids, _ in seqs])])  # [N, H]
        parts = [p for rows, _, _ in seqs for p in rows]
        h = parts[0] if len(parts) == 1 else xp.concatenate(parts)  # [N, H]
        if h.shape[0] != e.shape[0]:
            raise ValueError(f"MTP: {h.shape[0]} hidden rows for {e.shape[0]} tokens")
        x = xp.concatenate([ops.rms_norm(e, m.enorm, eps), ops.rms_norm(h, m.hnorm, eps)], axis=1) @ m.eh_proj.T
        lw = m.layer  # x [N, H]: the MTP layer's input, through a decoder layer as any other
        attended = self._attention(L, lw, ops.rms_norm(x, lw.input_norm, eps), [(ids, c) for _, ids, c in seqs],
                                   bounds, positions, rope, {})
        x, a = ops.add_rms_norm(x, attended, lw.post_attn_norm, eps)
        y = self._moe(L, lw, a) if cfg.sparse_layers[L] else ops.swiglu_mlp(a, lw.dense_mlp.gate, lw.dense_mlp.up,
                                                                             lw.dense_mlp.down)
        x, a = ops.add_rms_norm(x, y, m.head_norm, eps)  # x: the output, a: after shared_head.norm
        if cfg.mtp_chains_normed:  # Qwen3-Next chains the rows the head takes
            x = a
        for (_, _, cache), n in zip(seqs, lengths):
            cache.advance(n)
        if last_only:
            rows = xp.asarray(bounds[1:] - 1)
            x, a, bounds = x[rows], a[rows], np.arange(len(seqs) + 1)
        logits = to_host(a @ self.mtp_head.T)  # [rows, V]
        return ([logits[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])],
                [x[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])])

    def _mask(self, masks: dict, s: int, positions: np.ndarray, keys: int, window: int | None):
        """Sequence s's attention mask [T_s, keys] on the device, made once per forward for each window."""
        if (s, window) not in masks:
            masks[(s, window)] = self.xp.asarray(ops.attention_mask(positions, np.arange(keys), window))
        return masks[(s, window)]

    def _attention(self, i: int, lw: LayerWeights, x: np.ndarray, seqs, bounds, positions, rope,
                   masks: dict, rows=None) -> np.ndarray:
        """The attention's output [N, H], or with ``rows`` (last_row_ids: each sequence's last row) only those
        rows' queries and output [len(seqs), H]; every row's keys and values are cached either way."""
        cfg = self.cfg
        if lw.mla is not None:
            return self._mla_attention(i, lw, x, seqs, bounds, positions, rope, masks, rows)
        if self._streaming:
            return self._attention_cached(i, lw, x, rope, rows)
        q, k, v = self._project_qkv(i, lw, x, rows)  # [N or len(rows), nh, hd], [N, nkv, hd], [N, nkv, hd]
        cos, sin = rope
        q = ops.norm_rope(q, lw.q_norm, cfg.rms_norm_eps, *((cos, sin) if rows is None else (cos[rows], sin[rows])))
        k = ops.norm_rope(k, lw.k_norm, cfg.rms_norm_eps, cos, sin)  # q_norm, k_norm (Qwen3; or none), then RoPE
        parts = []  # each sequence's [T_s, nh*hd]
        for s, (_, cache) in enumerate(seqs):
            r = slice(bounds[s], bounds[s + 1])
            keys, values = cache.extend(i, k[r], v[r])  # [S, nkv, hd]
            mask = self._mask(masks, s, positions[s], keys.shape[0], cfg.sliding_windows[i])  # [T_s, S]
            if rows is not None:  # sequence s's last query alone: row s of q
                r, mask = slice(s, s + 1), mask[-1:]
            parts.append(ops.gqa_attention(q[r], keys, values, mask))
        out = parts[0] if len(parts) == 1 else self.xp.concatenate(parts)  # [N (or len(seqs)), nh*hd]
        if lw.q_gate is not None:  # Qwen3-Next: a sigmoid gate per output channel, from the queries' rows of x
            out = out * ops.sigmoid((x if rows is None else x[rows]) @ lw.q_gate.T)
        return out @ lw.o.T  # [N (or len(seqs)), H]

    def _linear_step(self, seqs, lengths: list[int]):
        """On the device with Gated DeltaNet layers: each sequence's states begun for this step and the kernel's
        tables, (states, tables) uploaded once for every such layer; else None."""
        if self.cfg.linear is None or self.xp is np:
            return None
        states = [cache.linear for _, cache in seqs]
        steps = [(n, st.begin(cache.length, n)) for (_, cache), st, n in zip(seqs, states, lengths)]
        return states, linear_attention.device_tables(self.xp, steps)

    def _linear_attention(self, i: int, lw: LayerWeights, x: np.ndarray, seqs, bounds, rows=None,
                          linear=None) -> np.ndarray:
        """A Gated DeltaNet layer (linear_attention.py) [N, H]: every row advances its sequence's state, kept in
        its cache; ``rows`` as _attention's (the output's rows taken after). ``linear``: _linear_step's (states,
        tables) on the device, where the layer is one kernel between its projections."""
        if linear is not None:
            states, tables = linear
            gated = linear_attention.device_layer(lw.linear, self.cfg.linear, x, i, states, tables, bounds,
                                                  self.cfg.rms_norm_eps)  # [N, Hv*dv]
            return (gated if rows is None else gated[rows]) @ lw.linear.out.T
        lc, parts = self.cfg.linear, []
        for s, (_, cache) in enumerate(seqs):
            if i not in cache.states:
                cache.states[i] = linear_attention.LinearState(lc)
            parts.append((slice(bounds[s], bounds[s + 1]), cache.states[i], cache.length))
        out = linear_attention.layer(lw.linear, lc, x, parts, self.cfg.rms_norm_eps)
        return out if rows is None else out[rows]

    def _attention_cached(self, i: int, lw: LayerWeights, x, rope, rows=None):
        """_attention in a graph-ready step: the new keys and values stored and every sequence's attention made in
        two launches that read the caches' places and lengths from the step's tables (graph_steps.StepTables),
        not from arguments; the same bits as _attention."""
        cfg = self.cfg
        q, k, v = self._project_qkv(i, lw, x, rows)  # [N or len(rows), nh, hd], [N, nkv, hd], [N, nkv, hd]
        cos, sin = rope
        q = ops.norm_rope(q, lw.q_norm, cfg.rms_norm_eps, *((cos, sin) if rows is None else (cos[rows], sin[rows])))
        k = ops.norm_rope(k, lw.k_norm, cfg.rms_norm_eps, cos, sin)
        k_ptrs, v_ptrs, row_seq, row_pos, q_seq, q_pos, seq_len = self.graph.tables.layer(i, rows is not None)
        bf16 = self.kv_dtype == "bf16"
        device_ops.kv_store(k, v, k_ptrs, v_ptrs, row_seq, row_pos, bf16)
        out = device_ops.gqa_attention_cached(q, (k_ptrs, v_ptrs, q_seq, q_pos, seq_len), cfg.sliding_windows[i],
                                              cfg.head_dim ** -0.5, cfg.num_kv_heads,
                                              self.graph.tables.score_stride, bf16)  # [N or len(rows), nh*hd]
        return out @ lw.o.T  # [N or len(rows), H]

    def _project_qkv(self, i: int, lw: LayerWeights, x: np.ndarray, rows=None):
        """x [N, H] -> q [N, nh, hd] (only ``rows``' queries, [len(rows), nh, hd], where given), k and v [N, nkv,
        hd]: one matmul where the layer's are fused (the device side; then views of its output), else three."""
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

    def _mla_attention(self, i: int, lw: LayerWeights, x: np.ndarray, seqs, bounds, positions, rope,
                       masks: dict, rows=None) -> np.ndarray:
        """DeepSeek's multi-head latent attention; the cache keeps each token's latent and rope key. ``rows``:
        as _attention's."""
        cfg, m, w = self.cfg, self.cfg.mla, lw.mla
        nh, dn = cfg.num_heads, m.qk_nope_head_dim
        xq = x if rows is None else x[rows]  # the rows whose queries are asked for
        if w.q is not None:
            q = xq @ w.q.T
        else:
            q = ops.rms_norm(xq @ w.q_a.T, w.q_a_norm, cfg.rms_norm_eps) @ w.q_b.T
        q = q.reshape(xq.shape[0], nh, m.qk_head_dim)  # [N or len(rows), nh, dn+dr]
        q_nope, q_rope = q[..., :dn], q[..., dn:]
        ckv = x @ w.kv_a.T  # [N, c+dr]
        latent = ops.rms_norm(self.xp.ascontiguousarray(ckv[:, : m.kv_lora_rank]), w.kv_a_norm, cfg.rms_norm_eps)
        k_rope = ckv[:, None, m.kv_lora_rank :]  # [N, 1, dr]
        rotate = ops.apply_rope_interleaved if m.rope_interleave else ops.apply_rope
        if self._streaming and self.graph.mla_cached[rows is not None]:
            return self._mla_attention_cached(i, lw, latent, rotate(k_rope, *rope)[:, 0], q_nope, q_rope, rotate,
                                              rope, rows)
        out = self.xp.empty((xq.shape[0], nh * m.v_head_dim), np.float32)  # [N or len(rows), nh*dv]
        for s, (_, cache) in enumerate(seqs):
            r = slice(bounds[s], bounds[s + 1])
            cos, sin = rope[0][r], rope[1][r]
            lat, kr = cache.extend(i, latent[r], rotate(k_rope[r], cos, sin)[:, 0])  # [S, c], [S, dr]
            mask = self._mask(masks, s, positions[s], lat.shape[0], None)  # [T_s, S]
            if rows is not None:  # sequence s's last query alone: row s of q
                r, cos, sin, mask = slice(s, s + 1), cos[-1:], sin[-1:], mask[-1:]
            qr = rotate(q_rope[r], cos, sin)
            if self._absorbed(r.stop - r.start, lat.shape[0]):
                w_uk, w_uv = (w.w_uk, w.w_uv) if w.w_uk is not None else self._kv_b_heads(w.kv_b)
                out[r] = ops.mla_attention_absorbed(q_nope[r], qr, lat, kr, w_uk, w_uv, mask, m.softmax_scale)
            else:
                lat = ops.widen(lat)  # a bf16 cache's latents as float32 for the product
                kv = (lat @ w.kv_b.T).reshape(lat.shape[0], nh, dn + m.v_head_dim)  # [S, nh, dn+dv]
                out[r] = ops.mla_attention(q_nope[r], qr, kv[..., :dn], kr, kv[..., dn:], mask, m.softmax_scale)
        return out @ lw.o.T  # [N or len(rows), H]

    def _mla_attention_cached(self, i: int, lw: LayerWeights, latent, k_rope, q_nope, q_rope, rotate, rope, rows):
        """_mla_attention (absorbed) in a graph-ready step: latent [N, c] and roped k_rope [N, dr] stored by one
        kv_store, every sequence's attention in three launches reading the caches' places, lengths and chunks from
        the step's tables (graph_steps.StepTables), not from arguments; the same bits as _mla_attention."""
        m, w, tables = self.cfg.mla, lw.mla, self.graph.tables
        cos, sin = rope
        q_rope = rotate(q_rope, *((cos, sin) if rows is None else (cos[rows], sin[rows])))  # [Nq, nh, dr]
        k_ptrs, v_ptrs, row_seq, row_pos, q_seq, q_pos, seq_len = tables.layer(i, rows is not None)
        bf16 = self.kv_dtype == "bf16"
        device_ops.kv_store(latent, k_rope, k_ptrs, v_ptrs, row_seq, row_pos, bf16)
        w_uk, w_uv = (w.w_uk, w.w_uv) if w.w_uk is not None else self._kv_b_heads(w.kv_b)
        w_uv_t = None if w_uv is None else w_uv.transpose(0, 2, 1)  # None: w_uk is the compact kv_b
        out = device_ops.mla_attention_absorbed_cached(
            q_nope, q_rope, (k_ptrs, v_ptrs, q_seq, q_pos, seq_len, tables.chunks(rows is not None)), w_uk, w_uv_t,
            m.softmax_scale, tables.score_stride, bf16)  # [Nq, nh*dv]
        return out @ lw.o.T  # [Nq, H]

    def _kv_b_heads(self, kv_b):
        """(W_uk [nh, dn, c], W_uv [nh, dv, c]): views of kv_b's rows (the device keeps kv_b alone, not a second
        copy split by head); where it is stored compact, (device_ops.CompactKvB, None): its rows read as they lie,
        never widened to float32."""
        m, nh = self.cfg.mla, self.cfg.num_heads
        if isinstance(kv_b, DeviceMatrix):
            return device_ops.CompactKvB(kv_b.fmt, kv_b.data, nh, m.qk_nope_head_dim, m.v_head_dim,
                                         m.kv_lora_rank), None
        heads = kv_b.reshape(nh, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)  # [nh, dn+dv, c]
        return heads[:, : m.qk_nope_head_dim], heads[:, m.qk_nope_head_dim :]

    def _absorbed(self, T: int, S: int) -> bool:
        """Whether T new tokens over S cached ones take the absorbed form: the one with fewer multiply-adds.
        Decode always does; a prefill of a few hundred tokens expands the latents through kv_b_proj."""
        if self.mla_absorb is not None:
            return self.mla_absorb
        m, nh = self.cfg.mla, self.cfg.num_heads
        c, dn, dr, dv = m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        absorbed = nh * T * (c * (dn + dv) + S * (2 * c + dr))
        expanded = nh * (S * c * (dn + dv) + T * S * (dn + dr + dv))
        return absorbed < expanded

    def _moe(self, i: int, lw: LayerWeights, x: np.ndarray) -> np.ndarray:
        """route -> submit the CPU pairs -> device and shared experts meanwhile -> collect -> sum."""
        if self._streaming:
            return self.graph.moe(self, i, lw, x)
        routing = self._route(i, lw, x)
        self.stats.count(routing, self.cfg.num_experts)
        sent = self._submit_cpu(routing, x)  # the CPU work first ...
        y_dev = self._device_side(routing, x)  # ... ours queued on the device's side stream meanwhile
        y_shared = self.shared_output(lw, x)  # also while the pool works
        y = self._collect_cpu(sent, x) if sent is not None else self.xp.zeros_like(x)  # [T, H]: Y_0 + Y_1 + ...
        if y_dev is not None:
            self.side.join()
            y = y + y_dev  # then the device experts' output
        if y_shared is not None:
            y = y + y_shared  # then the shared experts'
        return y

    def shared_output(self, lw: LayerWeights, x):
        """The shared experts' output [T, H] (the device side's, never the pool's), or None where the layer has none."""
        if lw.shared_expert is None:
            return None
        se = lw.shared_expert
        y_shared = ops.swiglu_mlp(x, se.gate, se.up, se.down)
        if lw.shared_expert_gate is not None:  # qwen2_moe's gate; DeepSeek's shared experts have none
            y_shared = ops.sigmoid(x @ lw.shared_expert_gate.T) * y_shared
        return y_shared

    def _route(self, i: int, lw: LayerWeights, x: np.ndarray) -> Routing:
        """The router's top-k pairs of every row, less the tail skip, split device / CPU."""
        cfg = self.cfg
        T = x.shape[0]
        ids, weights = self._choose(x @ lw.router.T, lw.router_bias)  # [T, k]
        chosen = ids.reshape(-1)  # [P]
        pairs = Pairs(np.repeat(np.arange(T, dtype=np.int64), cfg.top_k), chosen, weights.reshape(-1))
        skipped = 0
        if self.route_tail_skip > 0:
            keep = pairs.weights >= self.route_tail_skip
            skipped = int(np.count_nonzero(~keep))
            pairs = pairs[keep]
        dev = self.on_device[i][pairs.experts]  # [P] pair served on the device
        return Routing(i, chosen, skipped, device=pairs[dev], cpu=pairs[~dev])

    def _choose(self, logits, bias) -> tuple[np.ndarray, np.ndarray]:
        """The router's choice from logits [T, E] (bias [E] or None, where the logits are): (ids [T, k] int64,
        weights [T, k] float32) on the host, where the pair bookkeeping runs. Device logits are routed on the
        device and only the choice comes back, [T, 2k] words where the logits are [T, E] floats; the same bits as
        the host's (coordinator/device/router.py)."""
        cfg, g = self.cfg, self.cfg.group_router
        if is_device(logits):
            return router.unpack(to_host(self.route_packed(logits, bias)), cfg.top_k)
        if g is not None:
            return ops.route_grouped(logits, bias, cfg.top_k, g.n_group, g.topk_group, cfg.norm_topk_prob,
                                     g.routed_scaling_factor, g.scoring)
        return ops.route_top_k(logits, cfg.top_k, cfg.norm_topk_prob)

    def route_packed(self, logits, bias):
        """Device logits [T, E] -> the router's choice packed [T, 2k] on the device (router.route)."""
        cfg, g = self.cfg, self.cfg.group_router
        n_group, topk_group, scaling, softmax = (1, 1, 1.0, True) if g is None else (
            g.n_group, g.topk_group, g.routed_scaling_factor, g.scoring == "softmax")
        return router.route(logits, bias, cfg.top_k, n_group, topk_group, softmax, cfg.norm_topk_prob, scaling)

    def _submit_cpu(self, routing: Routing, x: np.ndarray) -> CpuBatch | None:
        """Send the layer's CPU pairs to the pool (only the rows with CPU work travel); None when there are none."""
        cpu = routing.cpu
        if not cpu.size:
            return None
        sends = np.bincount(cpu.tokens, minlength=x.shape[0]) > 0  # [T] rows with CPU pairs: a count, not a sort
        if sends.all():  # every row (decode, a verify's rows): the pairs' rows are the layer's
            rows, local = np.arange(x.shape[0]), cpu.tokens
        else:
            rows, local = np.flatnonzero(sends), (np.cumsum(sends) - 1)[cpu.tokens]
        rows_dev = None if rows.size == x.shape[0] else self.xp.asarray(rows)  # [T_cpu]; None: all of them
        x_cpu = self.staging.rows_to_host(x if rows_dev is None else x[rows_dev])  # [T_cpu, H] to the host
        self.pool.submit(PoolRequest(routing.layer, x_cpu, local.astype(np.int64), cpu.experts, cpu.weights))
        return CpuBatch(rows, rows_dev)

    def _device_side(self, routing: Routing, x: np.ndarray):
        """The device experts' share [T, H], queued on the side stream; None when the layer has no device pairs."""
        if not routing.device.size:
            return None
        with self.side.run():
            return self._device_experts(routing.layer, x, routing.device)

    def _collect_cpu(self, sent: CpuBatch, x: np.ndarray):
        """The pool's sum of the nodes' partials, on the device, in the layer's rows [T, H] (zero where a row
        sent nothing). With NumPy and every row sent it is the staging buffer itself, valid until the next
        layer's collect: the caller only adds it to new arrays."""
        t0 = time.perf_counter_ns()
        partials = self.pool.collect(out=self.staging.partials_buffer((sent.rows.size, x.shape[1])))  # [T_cpu, H]
        self.stats.count_pool_wait(time.perf_counter_ns() - t0)
        if sent.rows_dev is None:  # every row: the partials are the layer's rows, no zeros and no scatter
            return self.staging.to_device(partials)
        y = self.xp.zeros_like(x)
        y[sent.rows_dev] = self.staging.to_device(partials)
        return y

    def _device_experts(self, i: int, x: np.ndarray, pairs: Pairs) -> np.ndarray:
        """The device-resident experts' share of the layer [T, H], experts in ascending order: a GPU's in their
        formats through the grouped kernels, the NumPy side's float32 ones an expert at a time."""
        if isinstance(self.device_experts, DeviceExperts):
            return self.device_experts.run(i, x, pairs.tokens, pairs.experts, pairs.weights)
        xp = self.xp
        order = np.argsort(pairs.experts, kind="stable")  # pairs grouped by expert, token order kept within each
        ids, starts = np.unique(pairs.experts[order], return_index=True)
        ends = np.append(starts[1:], order.size)
        tokens_dev = xp.asarray(pairs.tokens[order])  # [P_dev] one upload per layer, not per expert
        weights_dev = xp.asarray(pairs.weights[order])[:, None]  # [P_dev, 1]
        y = xp.zeros_like(x)  # [T, H]
        for e, a, b in zip(ids.tolist(), starts.tolist(), ends.tolist()):
            t = tokens_dev[a:b]  # the tokens routed to expert e, each once
            mlp = self.device_experts[(i, e)]
            y[t] += weights_dev[a:b] * ops.swiglu_mlp(x[t], mlp.gate, mlp.up, mlp.down)
        return y
