"""The MoE router on the device: the experts of each token chosen where its logits are, bit for bit the host's.

One kernel serves every router the models have (model/ops.py's route, by a RouterSpec):

    softmax top-k     Qwen, Mixtral: n_group = topk_group = 1, softmax scores, renormalised where asked
    grouped sigmoid   DeepSeek-V3, GLM-4.5 (noaux_tc): sigmoid scores, the choice on scores + bias, groups
                      scored by their two best, normalised (+1e-20), scaled
    grouped softmax   DeepSeek-V2 (group_limited_greedy): softmax scores, groups scored by their best, scaled

    route(logits [T, E], bias [E] | None, k, n_group, topk_group, softmax, normalize, scaling) -> packed [T, 2k]
    unpack(packed [T, 2k], k)                    -> (ids [T, k] int64, weights [T, k] float32)

packed is uint32: each row's k expert ids (in the order chosen), then their weights' float32 bits. One array, so
the decoder copies the choice to the host in one download: 2k words a token where the logits are E floats. The
ids are 32-bit (E fits many times over) so that they share the weights' words.

A block a token row (E <= 1024 experts, a thread an expert or a few):
    scores   softmax: the block's max, e^(l - max) a thread an expert, the sum over the experts in order by one
             thread, each divided by it; sigmoid: 1 / (1 + e^-l), + bias where given
    choice   softmax ranks the logits themselves (the probabilities' order, exact where float32 probabilities would
             tie or underflow); sigmoid ranks score + bias
    groups   a thread a group: its best choice (softmax) or best two summed (sigmoid); one thread keeps the
             topk_group best (ties to the lower group)
    experts  k rounds of a block argmax over the kept groups' experts not yet taken (ties to the lower id)
    weights  one thread: the chosen scores summed in the order chosen, each divided by sum + 1e-20 (normalize),
             times scaling

The host's loop (host_ops.top_k) does the same float32 operations in the same order: e^x is silu.exp's, its
constants written into the source as their bits; this module is compiled with --fmad=false, as the host's loop
is compiled without fastmath, so neither side fuses a multiply into an add; NVRTC's IEEE division and
denormals (-prec-div=true, -ftz=false, its defaults) are the host's. Maxima and argmaxima are exact in any order,
and every sum is one thread's loop. So ids and weights equal the host's bit for bit (tests/test_device_router.py).
"""

from __future__ import annotations

import functools

import numpy as np

from node_worker.kernels import silu

from . import kernels
from ..model.ops import ROUTER_NORM_EPS as NORM_EPS
from ..model.ops import RouterSpec

MAX_THREADS = 256  # a block's threads at most: an expert a thread up to DeepSeek-V3's 256
MAX_EXPERTS = 1024  # a row's experts at most: four a thread


def _bits(x: np.float32) -> str:
    """A float32 as CUDA source that is exactly it: its bits."""
    return f"__int_as_float(0x{int(np.float32(x).view(np.uint32)):08x}u)"


# the host loop's constants (silu.exp's, the normalisation's guard), taken from its sources
_CONSTANTS = {"EXP_LOG2E": silu.LOG2E, "EXP_C1": silu.C1, "EXP_C2": silu.C2, "EXP_LIMIT": silu.LIMIT,
              **{f"EXP_P{i}": c for i, c in enumerate(silu.P)}, "NORM_EPS": NORM_EPS}

_BODY = kernels.source("router")


SOURCE = "".join(f"#define {name} {_bits(value)}\n" for name, value in _CONSTANTS.items()) + _BODY


@functools.lru_cache(maxsize=None)
def cuda_module():
    import cupy

    # NVRTC, no contraction: the host's loop fuses no multiply-add either (module docstring)
    return cupy.RawModule(code=SOURCE, options=("--std=c++14", "--fmad=false"))


@functools.lru_cache(maxsize=None)
def _kernel():
    return cuda_module().get_function("strata_route")


def threads(E: int) -> int:
    """A block's threads for E experts: a thread an expert, whole warps, at most MAX_THREADS."""
    return min(MAX_THREADS, max(32, -(-E // 32) * 32))


def route(logits, bias, spec: RouterSpec):
    """logits [T, E] float32 on the device, bias [E] or None (the sigmoid router's only) -> packed [T, 2k] uint32
    on the device (module docstring), one launch, by ``spec``'s rule."""
    k, n_group, topk_group, softmax = spec.k, spec.n_group, spec.topk_group, spec.softmax
    normalize, scaling = spec.normalize, spec.scaling
    T, E = logits.shape
    size = E // max(n_group, 1)
    if not (1 <= E <= MAX_EXPERTS and 1 <= n_group and E % n_group == 0 and 1 <= topk_group <= n_group
            and 1 <= k <= topk_group * size) or (softmax and bias is not None):
        raise ValueError(f"route: E {E} (at most {MAX_EXPERTS}) in {n_group} groups, {topk_group} kept, k {k}"
                         f"{', a bias with softmax scores' if softmax and bias is not None else ''}")
    import cupy

    logits = cupy.ascontiguousarray(logits, dtype=np.float32)
    out = cupy.empty((T, 2 * k), np.uint32)
    if T:
        b = cupy.ascontiguousarray(bias, dtype=np.float32) if bias is not None else logits  # any pointer: not read
        i32 = np.int32
        _kernel()((T,), (threads(E),), (
            logits, b, i32(bias is not None), i32(E), i32(k), i32(n_group), i32(topk_group), i32(softmax),
            i32(normalize), np.float32(scaling), out), shared_mem=(3 * E + 2 * n_group) * 4)
    return out


def unpack(packed, k: int):
    """packed [T, 2k] (route's, on the host or the device) -> (ids [T, k] int64, weights [T, k] float32)."""
    return packed[:, :k].astype(np.int64), packed[:, k:].view(np.float32)
