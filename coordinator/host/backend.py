"""The host backend: the network on NumPy arrays, with the coordinator's compiled loops (host/ops.py) where an op's
arrays are float32 C-contiguous rows, and model/ops.py's reference forms elsewhere."""

from __future__ import annotations

import numpy as np

import logging

from shm import formats
from shm.segments import shm_free

from ..context import available_memory, check_context
from ..model import ops
from ..model.backend import Backend, Loaded, Placement
from ..pool.hot_experts import device_expert_set, expert_bytes, whole_expert
from ..warmup import Unit
from . import ops as loops
from .packed import pack_dense

log = logging.getLogger(__name__)

HOST_ATTENTION_TOKENS = 4  # decode and small batches: the loop over any number of keys
# A prompt's tokens (more than HOST_ATTENTION_TOKENS) take the loop up to this many keys, NumPy's batched matmuls
# (BLAS) beyond. The loop skips the masked keys' products and reads each KV row once for the heads that share it;
# the matmuls compute every score and copy transposes. Past this many keys the matmuls win.
HOST_ATTENTION_KEYS = 2048
# From this many multiply-adds (Qwen3-30B-A3B's heads over 512 cached keys) the (token, KV head) pairs are shared
# among the threads; below it a parallel region's wake-up (where the coordinator's threads sleep,
# kernel_threads.py) would cost more than it saves.
PARALLEL_ATTENTION_MACS = 1 << 21


def rows(*arrays) -> bool:
    """NumPy float32 C-contiguous arrays: the compiled loops take them."""
    return all(type(a) is np.ndarray and a.dtype == np.float32 and a.flags.c_contiguous for a in arrays)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """ops.rms_norm through the loop. A host x that is not contiguous (the q and k heads, a column slice of the
    fused QKV output) is copied for it: the copy and the loop cost less than NumPy's ufuncs on the strided slice."""
    if type(x) is np.ndarray and x.dtype == np.float32 and not x.flags.c_contiguous:
        x = np.ascontiguousarray(x)
    if rows(x, weight) and x.ndim >= 1 and x.size:
        out = np.empty_like(x)
        loops.rms_norm(x.reshape(-1, x.shape[-1]), weight, np.float32(eps), out.reshape(-1, x.shape[-1]))
        return out
    return ops.rms_norm(x, weight, eps)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """ops.apply_rope through the loop (partial rotary too)."""
    if rows(x, cos, sin) and x.ndim == 3 and cos.shape[-1] <= x.shape[-1]:
        out = np.empty_like(x)
        loops.rope(x, cos, sin, out)
        return out
    return ops.apply_rope(x, cos, sin)


def gqa_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """ops.gqa_attention: the loop for decode and for prompts over up to HOST_ATTENTION_KEYS keys (in parallel
    from PARALLEL_ATTENTION_MACS), NumPy's matmuls beyond."""
    T, nh, hd = q.shape
    k, v = ops.widen(k), ops.widen(v)
    if (T <= HOST_ATTENTION_TOKENS or k.shape[0] <= HOST_ATTENTION_KEYS) and rows(q, k, v) \
            and mask.dtype == np.bool_ and mask.flags.c_contiguous:
        out = np.empty((T, nh * hd), np.float32)
        loop = loops.gqa_attention_parallel if T * k.shape[0] * nh * hd >= PARALLEL_ATTENTION_MACS \
            else loops.gqa_attention
        loop(q, k, v, mask, np.float32(hd**-0.5), out)
        return out
    return ops.gqa_attention(q, k, v, mask)


def _route_rows(logits: np.ndarray, bias: np.ndarray, k: int, n_group: int, topk_group: int, softmax: bool,
                normalize: bool, scaling: float) -> tuple[np.ndarray, np.ndarray]:
    """The top_k loop on host float32 rows [T, E] -> (ids [T, k] int64, weights [T, k] float32)."""
    T = logits.shape[0]
    ids, weights = np.empty((T, k), np.int64), np.empty((T, k), np.float32)
    loops.top_k(logits, bias, k, n_group, topk_group, softmax, normalize, np.float32(scaling), ids, weights)
    return ids, weights


def route_top_k(logits: np.ndarray, k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """ops.route_top_k through the top_k loop (the GPU router's twin: the same bits, coordinator/gpu/router.py)."""
    if rows(logits) and logits.ndim == 2 and 1 <= k <= logits.shape[1]:
        return _route_rows(logits, loops.NO_BIAS, k, 1, 1, True, normalize, 1.0)
    return ops.route_top_k(logits, k, normalize)


def route_grouped(logits: np.ndarray, bias, k: int, n_group: int, topk_group: int, normalize: bool, scaling: float,
                  scoring: str = "sigmoid") -> tuple[np.ndarray, np.ndarray]:
    """ops.route_grouped through the top_k loop."""
    E = logits.shape[-1]
    if scoring == "softmax" and bias is not None:
        raise ValueError("route_grouped: the softmax router (DeepSeek-V2) takes no bias")
    if rows(logits) and logits.ndim == 2 and E % n_group == 0 and 1 <= topk_group <= n_group \
            and 1 <= k <= topk_group * (E // n_group):
        host_bias = loops.NO_BIAS if bias is None else np.ascontiguousarray(bias, np.float32)
        return _route_rows(logits, host_bias, k, n_group, topk_group, scoring == "softmax", normalize, scaling)
    return ops.route_grouped(logits, bias, k, n_group, topk_group, normalize, scaling, scoring)


class HostBackend(Backend):
    """The network on the coordinator's CPU (the module docstring)."""

    def check_memory(self, mcfg, config, nodes: list) -> None:
        """The KV cache, the states and the pool's segment for the context within the host's memory and /dev/shm."""
        check_context(mcfg, config.max_seq_len or mcfg.max_position_embeddings, len(nodes),
                      config.pool == "process", available_memory(), shm_free() or 0, config.prefill_chunk)

    def place(self, mcfg, ckpt, config) -> Placement:
        """The experts kept whole in float32 (--gpu-experts on the NumPy side); a count the model cannot give is
        refused now."""
        experts, chosen = device_expert_set(mcfg, ckpt, config)
        return Placement(experts, chosen, expert_bytes(mcfg))

    def load(self, weights, placement: Placement, ckpt, mcfg, config, compile_missing) -> Loaded:
        """The dense matrices packed in --dense-dtype's format (their kernels compiled where this build lacks
        them), the placed experts read whole in float32."""
        dense_format, kernels = "f32", []
        if config.dense_dtype != "f32":
            fmt = None if config.dense_dtype == formats.AUTO else formats.get(config.dense_dtype)
            nbytes, dense_format, kernels = pack_dense(weights, fmt, config.activations != "f32", ckpt,
                                                       config.activations == "bf16")
            log.info("dense matrices (%s) stored as %s: %.2f GB", config.dense_dtype, dense_format, nbytes / 1e9)
            compile_missing([Unit.dense(k) for k in kernels])
        experts = {key: whole_expert(ckpt, weights.experts[key], mcfg) for key in sorted(placement.experts)}
        return Loaded(experts, dense_format=dense_format, dense_kernels=kernels)

    def rms_norm(self, x, weight, eps: float):
        return rms_norm(x, weight, eps)

    def apply_rope(self, x, cos, sin):
        return apply_rope(x, cos, sin)

    def gqa_attention(self, q, k, v, mask):
        return gqa_attention(q, k, v, mask)

    def route(self, logits, bias, cfg) -> tuple[np.ndarray, np.ndarray]:
        g = cfg.group_router
        if g is not None:
            return route_grouped(logits, bias, cfg.top_k, g.n_group, g.topk_group, cfg.norm_topk_prob,
                                 g.routed_scaling_factor, g.scoring)
        return route_top_k(logits, cfg.top_k, cfg.norm_topk_prob)
