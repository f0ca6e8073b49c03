"""A decode token's attention half of a layer in one compiled call: the host backend's attention block.

At decode each op of a layer is a call from Python that costs microseconds of dispatch, checks and allocation
beside arithmetic that takes well under one on a small model, and some ten of them make a layer's attention
(docs/benchmarks.md, "Per-layer cost"). Where a pass is one sequence's one token, the decoder hands the layer to
this block instead (Decoder.forward, EagerStep.attention_block), one call of host/ops.py's attention_block: the
q, k and v projections (each matrix's one-row loop, PackedMatrix.one_row_kind), the qk-norm and RoPE (ops.norm_rope, or ops.rope without norms), the
new key and value written into the cache's slot, the attention over the cache (ops.gqa_attention, in parallel
from the backend's PARALLEL_ATTENTION_MACS), the output projection, and the residual add with the
post-attention norm (ops.add_rms_norm). The same loops on arrays of the same types as the separate calls, so
the same bits (tests/test_blocks.py), in one entry-point call (shm/jit_entry.py) into buffers made once.

    HostAttentionBlock.of(cfg, layer, lw, parallel_macs) -> block or None   None: the layer takes the separate
                                      calls (MLA, a Gated DeltaNet, a q gate, biases, a sliding window, a matrix
                                      not packed)
    block(h, a, keys, values, cos, sin) -> (h + attention, its post-attention norm) [1, H] each, or None where
                                      the arrays are not float32 rows; keys, values [S, nkv, hd]: the cache's
                                      rows, the new token's slot last (KVCache.open_row)
"""

from __future__ import annotations

import numpy as np

from .ops import attention_block
from .packed import PackedMatrix

NO_NORM = np.empty(0, np.float32)  # a layer without qk-norm: RoPE alone


def _rows(a, shape) -> bool:
    return type(a) is np.ndarray and a.dtype == np.float32 and a.flags.c_contiguous and a.shape == shape


class HostAttentionBlock:
    """One layer's attention half for one token (module docstring): its matrices' loops and arguments, its norms
    and its buffers, taken at open; the entry point bound at the first call."""

    def __init__(self, matrices: tuple, q_norm, k_norm, post_norm, eps: float, heads: tuple[int, int, int],
                 parallel_macs: int):
        """``matrices``: q, k, v, o (PackedMatrix); ``heads``: (nh, nkv, hd); ``parallel_macs``: the multiply-adds
        from which the attention runs in parallel (the backend's)."""
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
        self._call = None

    @classmethod
    def of(cls, cfg, layer: int, lw, parallel_macs: int) -> HostAttentionBlock | None:
        """Layer ``layer``'s block, or None where it takes the separate calls."""
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
        return cls(matrices, *norms, cfg.rms_norm_eps, (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
                   parallel_macs)

    def __call__(self, h, a, keys, values, cos, sin):
        S = keys.shape[0]
        if not (_rows(h, (1, self.H)) and _rows(a, (1, self.H)) and _rows(cos, cos.shape) and _rows(sin, sin.shape)
                and cos.shape[0] == 1):
            return None
        if S > self.mask.shape[1]:
            self.mask = np.ones((1, 2 * S), np.bool_)
        args = (*self.kinds, *self.matrices, h, a, *self.norms, self.eps, cos, sin, keys, values, self.mask[:, :S],
                self.scale, S >= self.parallel_keys, self.post_norm, self.bufs, self.h_out, self.m_out)
        if self._call is None:
            from shm.jit_entry import entry_point

            self._call = entry_point(attention_block, args, literal=(0, 1, 2, 3))
        self._call(*args)
        return self.h_out, self.m_out
