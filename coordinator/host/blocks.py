"""A decode token's layer in two compiled calls: the host backend's attention block and MoE block.

At decode each op of a layer is a call from Python that costs microseconds of dispatch, checks and allocation
beside arithmetic that takes well under one on a small model, and some ten of them make a layer's attention
(docs/benchmarks.md, "Per-layer cost"). Where a pass is one sequence's one token, the decoder hands the layer to
this block instead (Decoder.forward, EagerStep.attention_block), one call of host/ops.py's attention_block: the
q, k and v projections (each matrix's one-row loop, PackedMatrix.one_row_kind), the qk-norm and RoPE
(ops.norm_rope, or ops.rope without norms), the new key and value written into the cache's slot, the attention
over the cache (ops.gqa_attention, in parallel from the backend's parallel_attention_macs()), the output
projection, the residual add with the post-attention norm (ops.add_rms_norm), and where the layer routes, the
router's product and top-k (ops.linear_rows, ops.top_k). The same loops on arrays of the same types as the
separate calls, so the same bits (tests/test_blocks.py), in one entry-point call (shm/jit_entry.py) into buffers
made once.

    HostAttentionBlock.of(cfg, layer, lw, parallel_macs, spec) -> block or None   None: the layer takes the separate
                                      calls (MLA, a Gated DeltaNet, a q gate, biases, a sliding window, a matrix
                                      not packed)
    block(h, a, keys, values, cos, sin) -> (h + attention, its post-attention norm [1, H] each, the router's
                                      (ids, weights) [1, k] for it or None), or None where the arrays are not
                                      float32 rows; keys, values [S, nkv, hd]: the cache's rows, the new token's
                                      slot last (KVCache.open_row)

Its MoE half likewise, where the pool is in-process with one node, which holds every expert whole
(ExpertPool.row_experts) and the router's pairs came from the attention block: one call of host/ops.py's
moe_block, the node's own layer kernel on the pairs, the shared experts' output added where the layer has them
(made apart, by the backend's calls), the residual add with the next layer's input norm, and the chosen experts
counted into the decoder's counters, instead of the pool's request (route, submit, collect, sum: some ten calls
from Python) and the backend's add_rms_norm.

    HostMoeBlock.of(cfg, experts, norm, stats, fresh) -> block or None   None: the pool takes the layer
    block(h, m, routed, shared) -> (h + the experts' output (+ shared), its norm by ``norm``) [1, H] each, or None
                                      where ``shared`` is not a float32 row; h, m, routed: an attention block's
"""

from __future__ import annotations

import time

import numpy as np

from node_worker import kernel_threads

from .ops import NO_BIAS, attention_block, moe_block, rows, top_k_fits
from .packed import PARALLEL_ROWS_MACS, PackedMatrix, RowExactMatrix

NO_NORM = np.empty(0, np.float32)  # a layer without qk-norm: RoPE alone
NO_SHARED = np.empty((0, 0), np.float32)  # a layer without shared experts


def _rows(a, shape) -> bool:
    """A float32 C-contiguous NumPy array of this shape: what the entry point's types were bound to."""
    return rows(a) and a.shape == shape


class HostAttentionBlock:
    """One layer's attention half for one token (module docstring): its matrices' loops and arguments, its norms
    and its buffers, taken at open, and the kernel's entry point (bind)."""

    def __init__(self, matrices: tuple, q_norm, k_norm, post_norm, eps: float, heads: tuple[int, int, int],
                 parallel_macs: int, router: tuple | None = None):
        """``matrices``: q, k, v, o (PackedMatrix); ``heads``: (nh, nkv, hd); ``parallel_macs``: the multiply-adds
        from which the attention runs in parallel (the backend's); ``router``: (RowExactMatrix, its bias or None,
        model/ops.RouterSpec) where the layer's router runs in the block, else None."""
        nh, nkv, hd = heads
        H = matrices[3].shape[0]
        self.kinds = tuple(m.one_row_kind for m in matrices)
        self.matrices = tuple(m.one_row_args for m in matrices)
        self.norms = (NO_NORM if q_norm is None else q_norm, NO_NORM if k_norm is None else k_norm)
        self.post_norm, self.eps, self.scale = post_norm, np.float32(eps), np.float32(hd**-0.5)
        self.parallel_keys = -(-parallel_macs // (nh * hd))  # keys from which the attention runs in parallel
        self.H = H
        self.matrix_bytes = sum(m.nbytes for m in matrices)
        self.kv_row_bytes = 2 * nkv * hd * 4  # a cached token's key and value (float32)
        f32 = np.float32
        self.bufs = (np.empty((1, nh * hd), f32), np.empty((1, nh, hd), f32), np.empty((1, nkv * hd), f32),
                     np.empty((1, nkv, hd), f32), np.empty((1, nkv * hd), f32), np.empty((1, nh * hd), f32),
                     np.empty((1, H), f32))
        self.h_out, self.m_out = np.empty((1, H), f32), np.empty((1, H), f32)  # what a call returns: reused
        self.mask = np.ones((1, 256), np.bool_)  # decode's row sees every cached key; grown as the cache grows
        self.router, self.routed = self._router(router)
        self._call = None

    @staticmethod
    def _router(router: tuple | None) -> tuple[tuple, tuple | None]:
        """The kernel's router argument (ops.attention_block) and the (ids [1, k], weights [1, k]) it fills, or a
        router that does not run and None."""
        if router is None:
            none, no_ids = np.zeros((1, 1), np.float32), np.zeros((1, 1), np.int64)
            return (False, none, False, NO_BIAS, 1, 1, 1, True, False, np.float32(1.0), none, no_ids, none), None
        matrix, bias, spec = router
        E, K = matrix.shape
        ids, weights = np.empty((1, spec.k), np.int64), np.empty((1, spec.k), np.float32)
        bias = NO_BIAS if bias is None else np.ascontiguousarray(bias, np.float32)
        return (True, matrix.wt, E * K >= PARALLEL_ROWS_MACS, bias, spec.k, spec.n_group, spec.topk_group,
                spec.softmax, spec.normalize, np.float32(spec.scaling), np.empty((1, E), np.float32), ids,
                weights), (ids, weights)

    @classmethod
    def of(cls, cfg, layer: int, lw, parallel_macs: int, spec) -> HostAttentionBlock | None:
        """Layer ``layer``'s block, or None where it takes the separate calls; its router in it where the layer
        routes by ``spec`` (model/ops.RouterSpec) with a router the host's loops take (RowExactMatrix, top_k)."""
        if (lw.mla is not None or lw.linear is not None or lw.q_gate is not None or lw.q_bias is not None
                or cfg.sliding_windows[layer] is not None):
            return None
        matrices = (lw.q, lw.k, lw.v, lw.o)
        if not all(isinstance(m, PackedMatrix) for m in matrices):
            return None
        norms = (lw.q_norm, lw.k_norm, lw.post_attn_norm)
        if not all(n is None or _rows(n, (cfg.head_dim,)) for n in norms[:2]) or not _rows(norms[2],
                                                                                        (cfg.hidden_size,)):
            return None
        router = None
        routes = cfg.sparse_layers[layer] and isinstance(lw.router, RowExactMatrix)
        if routes and top_k_fits(lw.router.shape[0], spec) and not (spec.softmax and lw.router_bias is not None):
            router = (lw.router, lw.router_bias, spec)
        return cls(matrices, *norms, cfg.rms_norm_eps, (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
                   parallel_macs, router).bind()

    def bind(self) -> HostAttentionBlock:
        """The kernel's entry point for this block's argument types, compiled or loaded from the disk cache now
        (at open) rather than inside the first request, on arrays of the types a step passes."""
        from shm.jit_entry import entry_point

        nkv, hd = self.bufs[3].shape[1:]
        row, kv = np.zeros((1, self.H), np.float32), np.zeros((1, nkv, hd), np.float32)
        rope = np.zeros((1, hd), np.float32)
        self._call = entry_point(attention_block, self._args(row, row, kv, kv, rope, rope), literal=(0, 1, 2, 3))
        return self

    def _args(self, h, a, keys, values, cos, sin) -> tuple:
        """The kernel's arguments for one call (ops.attention_block's order), the mask grown to the keys."""
        S = keys.shape[0]
        if S > self.mask.shape[1]:
            self.mask = np.ones((1, 2 * S), np.bool_)
        return (*self.kinds, *self.matrices, h, a, *self.norms, self.eps, cos, sin, keys, values, self.mask[:, :S],
                self.scale, S >= self.parallel_keys, self.post_norm, self.bufs, self.h_out, self.m_out, self.router)

    def __call__(self, h, a, keys, values, cos, sin):
        if not (_rows(h, (1, self.H)) and _rows(a, (1, self.H)) and _rows(cos, (1, cos.shape[-1]))
                and _rows(sin, cos.shape)):
            return None
        self._call(*self._args(h, a, keys, values, cos, sin))
        return self.h_out, self.m_out, self.routed


class HostMoeBlock:
    """One MoE layer's half for one token on an in-process node (module docstring): the node's kernel arguments,
    the norm after the layer, its buffers, and the kernel's entry point (bind)."""

    def __init__(self, experts, norm, eps: float, shape: tuple[int, int, int], stats, fresh: bool):
        """``experts``: the pool's RowExperts for the layer; ``shape``: (H, top-k, routed experts E); ``norm``: the
        next layer's input norm (the final norm after the last); ``stats``: the decoder's RoutingStats, which count
        each call's pairs and wait (and the kernel its chosen experts, into the layer's [E] counter); ``fresh``: new
        output arrays each call (the last layer's: the step's final rows outlive the call), else one pair of
        buffers reused."""
        f32 = np.float32
        H, k, E = shape
        self.experts, self.norm, self.eps, self.H, self.k = experts, norm, f32(eps), H, k
        self.stats, self.fresh = stats, fresh
        self.counts = stats.expert_counter(experts.layer, E)  # [E] int64, the kernel adds to it
        self.tokens = np.zeros(k, np.int64)  # every pair's row: the one row
        self.y, self.h_out, self.a_out = np.empty((1, H), f32), np.empty((1, H), f32), np.empty((1, H), f32)
        self._call = None

    @classmethod
    def of(cls, cfg, experts, norm, stats, fresh: bool) -> HostMoeBlock | None:
        """The layer's block where the pool gives its experts for one row (ExpertPool.row_experts) and ``norm`` is
        a float32 row, else None."""
        if experts is None or not _rows(norm, (cfg.hidden_size,)):
            return None
        return cls(experts, norm, cfg.rms_norm_eps, (cfg.hidden_size, cfg.top_k, cfg.num_experts), stats,
                   fresh).bind()

    def bind(self) -> HostMoeBlock:
        """The kernel's entry point for this block's argument types, compiled or loaded now (at open)."""
        from shm.jit_entry import entry_point

        row = np.zeros((1, self.H), np.float32)
        ids, weights = np.zeros((1, self.k), np.int64), np.zeros((1, self.k), np.float32)
        self._call = entry_point(moe_block, self._args(row, row, ids, weights, NO_SHARED, row, row))
        return self

    def _args(self, h, m, ids, weights, shared, h_out, a_out) -> tuple:
        """The kernel's arguments for one call (ops.moe_block's order)."""
        e = self.experts
        return (e.kernels, e.node, m, self.tokens, ids, weights, shared, h, self.norm, self.eps, self.y,
                h_out, a_out, self.counts)

    def __call__(self, h, m, routed, shared=None):
        """h, m, routed: an attention block's outputs (its own float32 rows, checked there); ``shared``: the shared
        experts' output [1, H] or None."""
        ids, weights = routed
        if shared is None:
            shared = NO_SHARED
        elif not _rows(shared, (1, self.H)):
            return None
        h_out, a_out = (np.empty((1, self.H), np.float32), np.empty((1, self.H), np.float32)) if self.fresh else (
            self.h_out, self.a_out)
        kernel_threads.use(self.experts.threads)  # the node's team, as its layer arguments set it
        t = time.perf_counter_ns()
        answer = self._call(*self._args(h, m, ids, weights, shared, h_out, a_out))
        ns = time.perf_counter_ns() - t
        self.experts.done(answer, ns)  # a negative answer raises here, naming the routing error
        self.stats.count_pool_row(self.k, ns)
        return h_out, a_out
