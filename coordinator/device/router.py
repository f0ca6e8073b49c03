"""The MoE router on the device: the experts of each token chosen where its logits are, bit for bit the host's.

One kernel serves every router the models have (ops.route_top_k, ops.route_grouped):

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

from ..model.host_ops import NORM_EPS

MAX_THREADS = 256  # a block's threads at most: an expert a thread up to DeepSeek-V3's 256
MAX_EXPERTS = 1024  # a row's experts at most: four a thread


def _bits(x: np.float32) -> str:
    """A float32 as CUDA source that is exactly it: its bits."""
    return f"__int_as_float(0x{int(np.float32(x).view(np.uint32)):08x}u)"


# the host loop's constants (silu.exp's, the normalisation's guard), taken from its sources
_CONSTANTS = {"EXP_LOG2E": silu.LOG2E, "EXP_C1": silu.C1, "EXP_C2": silu.C2, "EXP_LIMIT": silu.LIMIT,
              **{f"EXP_P{i}": c for i, c in enumerate(silu.P)}, "NORM_EPS": NORM_EPS}

_BODY = r"""
#define NO_EXPERT 0x7fffffff

// e^x in float32: node_worker/kernels/silu.exp's operations one for one (--fmad=false: none fused)
__device__ __forceinline__ float router_exp(float x) {
    x = fminf(fmaxf(x, -EXP_LIMIT), EXP_LIMIT);
    float n = floorf(x * EXP_LOG2E + 0.5f);
    float r = x - n * EXP_C1 - n * EXP_C2;
    float p = ((((EXP_P0 * r + EXP_P1) * r + EXP_P2) * r + EXP_P3) * r + EXP_P4) * r + EXP_P5;
    return (p * r * r + r + 1.0f) * __int_as_float((unsigned)(((int)n + 127) << 23));
}
// candidate (v, i) before (bv, bi): a larger value, or the same value and a lower id; NO_EXPERT is none
__device__ __forceinline__ bool router_before(float v, int i, float bv, int bi) {
    return i != NO_EXPERT && (bi == NO_EXPERT || v > bv || (v == bv && i < bi));
}
__device__ __forceinline__ void router_warp_argmax(float& v, int& i) {
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (router_before(ov, oi, v, i)) { v = ov; i = oi; }
    }
}

// logits [T, E]; bias [E], read where has_bias; out [T, 2k]: the k ids, then their weights' float32 bits.
// A block a row, blockDim a multiple of 32. Dynamic shared memory: 3 E + 2 n_group words.
extern "C" __global__ void strata_route(const float* logits, const float* bias, int has_bias, int E, int k,
                                        int n_group, int topk_group, int softmax, int normalize, float scaling,
                                        unsigned int* out) {
    extern __shared__ float router_shared[];
    float* score = router_shared;                       // [E] the weights' values
    float* choice = router_shared + E;                  // [E] what the choice ranks
    int* left = (int*)(router_shared + 2 * E);          // [E] 1 where the expert may still be chosen
    float* group = router_shared + 3 * E;               // [n_group] the groups' scores
    int* kept = (int*)(router_shared + 3 * E + n_group);  // [n_group] 1 where the group stays
    __shared__ float part_v[32];
    __shared__ int part_i[32];
    __shared__ float total;
    const float* l = logits + (long long)blockIdx.x * E;
    unsigned int* o = out + (long long)blockIdx.x * 2 * k;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5, size = E / n_group;
    if (softmax) {
        float m = __int_as_float(0xff800000u);
        for (int e = threadIdx.x; e < E; e += blockDim.x) m = fmaxf(m, l[e]);
        for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
        if (lane == 0) part_v[w] = m;
        __syncthreads();
        for (int j = 0; j < nw; j++) m = fmaxf(m, part_v[j]);
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            score[e] = router_exp(l[e] - m);
            choice[e] = l[e];
        }
        __syncthreads();
        if (threadIdx.x == 0) {  // in expert order, as the host adds them
            float s = 0.0f;
            for (int e = 0; e < E; e++) s += score[e];
            total = s;
        }
        __syncthreads();
        for (int e = threadIdx.x; e < E; e += blockDim.x) score[e] = score[e] / total;
    } else {
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            float s = 1.0f / (1.0f + router_exp(-l[e]));
            score[e] = s;
            choice[e] = has_bias ? s + bias[e] : s;
        }
    }
    __syncthreads();
    if (topk_group < n_group) {
        for (int g = threadIdx.x; g < n_group; g += blockDim.x) {
            float b1 = __int_as_float(0xff800000u), b2 = b1;
            for (int e = g * size; e < (g + 1) * size; e++) {
                float v = choice[e];
                if (v > b1) { b2 = b1; b1 = v; }
                else if (v > b2) b2 = v;
            }
            group[g] = softmax || size < 2 ? b1 : b1 + b2;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int g = 0; g < n_group; g++) kept[g] = 0;
            for (int r = 0; r < topk_group; r++) {
                int best = -1;
                for (int g = 0; g < n_group; g++)
                    if (!kept[g] && (best < 0 || group[g] > group[best])) best = g;
                kept[best] = 1;
            }
        }
        __syncthreads();
    }
    for (int e = threadIdx.x; e < E; e += blockDim.x) left[e] = topk_group < n_group ? kept[e / size] : 1;
    __syncthreads();
    for (int j = 0; j < k; j++) {
        float v = 0.0f;
        int i = NO_EXPERT;
        for (int e = threadIdx.x; e < E; e += blockDim.x)
            if (left[e] && router_before(choice[e], e, v, i)) { v = choice[e]; i = e; }
        router_warp_argmax(v, i);
        if (lane == 0) { part_v[w] = v; part_i[w] = i; }
        __syncthreads();
        if (w == 0) {
            v = lane < nw ? part_v[lane] : 0.0f;
            i = lane < nw ? part_i[lane] : NO_EXPERT;
            router_warp_argmax(v, i);
            if (lane == 0) {
                left[i] = 0;
                o[j] = (unsigned int)i;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {  // the ids it wrote above
        float s = 0.0f;
        for (int j = 0; j < k; j++) s += score[o[j]];
        for (int j = 0; j < k; j++) {
            float v = score[o[j]];
            if (normalize) v = v / (s + NORM_EPS);
            o[k + j] = __float_as_uint(v * scaling);
        }
    }
}
"""

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


def route(logits, bias, k: int, n_group: int, topk_group: int, softmax: bool, normalize: bool, scaling: float):
    """logits [T, E] float32 on the device, bias [E] or None (the sigmoid router's only) -> packed [T, 2k] uint32
    on the device (module docstring), one launch."""
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
