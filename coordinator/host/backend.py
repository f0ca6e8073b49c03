"""The host backend: the network on NumPy arrays, with the coordinator's compiled loops (host/ops.py) where an op's
arrays are float32 C-contiguous rows, and model/ops.py's reference forms elsewhere."""

from __future__ import annotations

import numpy as np

import logging

from node_worker import kernel_threads
from shm import formats
from shm.segments import shm_free

from ..context import available_memory, check_context
from ..model import ops
from ..model.backend import Backend, Loaded, Placement
from ..pool.hot_experts import device_expert_set, expert_bytes, whole_expert
from ..warmup import Unit
from . import ops as loops
from .blocks import HostAttentionBlock, HostMoeBlock
from .ops import rows
from .packed import Packing, pack_dense, pack_experts, rows_exact

log = logging.getLogger(__name__)

HOST_ATTENTION_TOKENS = 4  # decode and small batches: the loop over any number of keys
# A prompt's tokens (more than HOST_ATTENTION_TOKENS) take the loop up to this many keys, NumPy's batched matmuls
# (BLAS) beyond. The loop skips the masked keys' products and reads each KV row once for the heads that share it;
# the matmuls compute every score and copy transposes. Past this many keys the matmuls win.
HOST_ATTENTION_KEYS = 2048
# From this many multiply-adds (Qwen3-30B-A3B's heads over 512 cached keys) the (token, KV head) pairs are shared
# among the threads where the coordinator's threads sleep after a kernel (kernel_threads.py): below it a parallel
# region's wake-up would cost more than it saves ...
PARALLEL_ATTENTION_MACS = 1 << 21
# ... and from this many where they spin (a coordinator that runs kernels on the decode path), whose region starts
# in a microsecond or two: the pairs pay from some 16K multiply-adds (docs/benchmarks.md)
PARALLEL_ATTENTION_MACS_SPINNING = 1 << 14


def parallel_attention_macs() -> int:
    """The multiply-adds from which the attention loop runs in parallel, by how this process's threads wait."""
    if kernel_threads.spinning():
        return min(PARALLEL_ATTENTION_MACS, PARALLEL_ATTENTION_MACS_SPINNING)
    return PARALLEL_ATTENTION_MACS


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """ops.rms_norm through the loop. A host x that is not contiguous (the q and k heads, a column slice of the
    fused QKV output) is copied for it: the copy and the loop cost less than NumPy's ufuncs on the strided slice."""
    if type(x) is np.ndarray and x.dtype == np.float32 and x.ndim >= 1 and x.size and rows(weight):
        if not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)
        out = np.empty_like(x)
        D = x.shape[-1]
        loops.rms_norm(x.reshape(-1, D), weight, np.float32(eps), out.reshape(-1, D))
        return out
    return ops.rms_norm(x, weight, eps)


def add_rms_norm(h: np.ndarray, delta: np.ndarray, weight: np.ndarray, eps: float):
    """(h + delta, its rms_norm) in one loop where h and delta are float32 rows of one shape."""
    if rows(h, delta, weight) and h.ndim == 2 and h.shape == delta.shape and h.size:
        total, out = np.empty_like(h), np.empty_like(h)
        loops.add_rms_norm(h, delta, weight, np.float32(eps), total, out)
        return total, out
    total = h + delta
    return total, rms_norm(total, weight, eps)


def norm_rope(x: np.ndarray, weight, eps: float, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """rms_norm of each head by weight, then apply_rope, in one loop where the arrays are float32 rows (x's
    heads copied contiguous first, as rms_norm does)."""
    if weight is not None and type(x) is np.ndarray and x.dtype == np.float32 and x.ndim == 3 and x.size \
            and rows(weight, cos, sin) and cos.shape[-1] <= x.shape[-1]:
        if not x.flags.c_contiguous:
            x = np.ascontiguousarray(x)
        out = np.empty_like(x)
        loops.norm_rope(x, weight, np.float32(eps), cos, sin, out)
        return out
    return apply_rope(rms_norm(x, weight, eps) if weight is not None else x, cos, sin)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """ops.apply_rope through the loop (partial rotary too)."""
    if rows(x, cos, sin) and x.ndim == 3 and cos.shape[-1] <= x.shape[-1]:
        out = np.empty_like(x)
        loops.rope(x, cos, sin, out)
        return out
    return ops.apply_rope(x, cos, sin)


def gqa_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, invariant: bool = True) -> np.ndarray:
    """ops.gqa_attention: the loop for decode and for prompts over up to HOST_ATTENTION_KEYS keys (in parallel
    from parallel_attention_macs()), NumPy's matmuls beyond; ``invariant``: the loop for every step (a row's sums over
    its own keys alone, whatever the rows beside it)."""
    T, nh, hd = q.shape
    k, v = ops.widen(k), ops.widen(v)
    if (T <= HOST_ATTENTION_TOKENS or k.shape[0] <= HOST_ATTENTION_KEYS or invariant) and rows(q, k, v) \
            and mask.dtype == np.bool_ and mask.flags.c_contiguous:
        out = np.empty((T, nh * hd), np.float32)
        loop = loops.gqa_attention_parallel if T * k.shape[0] * nh * hd >= parallel_attention_macs() \
            else loops.gqa_attention
        loop(q, k, v, mask, np.float32(hd**-0.5), out)
        return out
    return ops.gqa_attention(q, k, v, mask)


def route(logits: np.ndarray, bias, spec: ops.RouterSpec) -> tuple[np.ndarray, np.ndarray]:
    """ops.route through the top_k loop where the logits are host float32 rows the rule fits (the GPU router's
    twin: the same bits, coordinator/gpu/router.py)."""
    E = logits.shape[-1]
    if spec.softmax and bias is not None:
        raise ValueError("route: the softmax router (DeepSeek-V2's, Qwen's) takes no bias")
    if rows(logits) and logits.ndim == 2 and loops.top_k_fits(E, spec):
        T = logits.shape[0]
        ids, weights = np.empty((T, spec.k), np.int64), np.empty((T, spec.k), np.float32)
        host_bias = loops.NO_BIAS if bias is None else np.ascontiguousarray(bias, np.float32)
        loops.top_k(logits, host_bias, spec.k, spec.n_group, spec.topk_group, spec.softmax, spec.normalize,
                    np.float32(spec.scaling), ids, weights)
        return ids, weights
    return ops.route(logits, bias, spec)


class HostBackend(Backend):
    """The network on the coordinator's CPU (the module docstring)."""

    invariant = True  # EngineConfig.batch_invariant, set at load: attention's loop for every step

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
        self.invariant = config.batch_invariant
        dense_format, kernels = "f32", []
        if config.dense_dtype != "f32" or self.invariant:  # float32 matrices too go through the loops: never BLAS
            fmt = None if config.dense_dtype == formats.AUTO else formats.get(config.dense_dtype)
            how = Packing(config.activations != "f32", config.activations == "bf16", self.invariant)
            nbytes, dense_format, kernels = pack_dense(weights, fmt, how, ckpt)
            log.info("dense matrices (%s) stored as %s: %.2f GB", config.dense_dtype, dense_format, nbytes / 1e9)
        rows_exact(weights)  # the routers' products the same bits for a row in any batch
        experts = {key: whole_expert(ckpt, weights.experts[key], mcfg) for key in sorted(placement.experts)}
        if self.invariant and experts:  # the hot experts' float32 matrices through the same loops
            experts, expert_kernels = pack_experts(experts, config.activations != "f32")
            kernels = list(dict.fromkeys(kernels + expert_kernels))
        compile_missing([Unit.dense(k) for k in kernels])
        return Loaded(experts, dense_format=dense_format, dense_kernels=kernels)

    def rms_norm(self, x, weight, eps: float):
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, h, delta, weight, eps: float):
        return add_rms_norm(h, delta, weight, eps)

    def norm_rope(self, x, weight, eps: float, cos, sin):
        return norm_rope(x, weight, eps, cos, sin)

    def apply_rope(self, x, cos, sin):
        return apply_rope(x, cos, sin)

    def gqa_attention(self, q, k, v, mask):
        return gqa_attention(q, k, v, mask, self.invariant)

    def route(self, logits, bias, spec: ops.RouterSpec) -> tuple[np.ndarray, np.ndarray]:
        return route(logits, bias, spec)

    def attention_block(self, cfg, layer: int, lw):
        return HostAttentionBlock.of(cfg, layer, lw, parallel_attention_macs(), ops.RouterSpec.of(cfg))

    def moe_block(self, cfg, experts, norm, stats, last: bool):
        return HostMoeBlock.of(cfg, experts, norm, stats, fresh=last)
