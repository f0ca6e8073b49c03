"""A MoE layer's bookkeeping on the device, for the stream-driven decode step: the router's choice split into the
pool's request and the device experts' pairs, and the pool's partials summed back, with no host in between.

    split_pairs(packed [T, 2k], on_device [E] uint8, skip, counts [E] int64, totals [TOTALS] int64)
        -> SplitPairs: cpu (tokens, experts int32, weights float32 [T*k] each, count int64 [1]),
                       device (the same), one launch
    sum_partials(parts [N, T, H], extra [T, H] | None, more [T, H] | None) -> [T, H]   one launch

split_pairs keeps the host's order and arithmetic exactly (decoder.Decoder._route): the pairs in router order
(token, then the router's rank), those whose weight is below ``skip`` dropped, each sent to the device where its
expert is kept there, else to the CPU; a pair's token is its row of the layer (the stream sends every row, so
no row index is compacted). It runs as one block, a thread a pair: each pair's place is the count of earlier
pairs of its side, so the router order holds without a sequential pass. It also adds the layer's routing to running counters on the device, what the
host's RoutingStats counts, read back once per step without a wait::

    counts  [E]       pairs the router chose, per expert (skipped ones included)
    totals  [TOTALS]  routed | skipped | cpu pairs | cpu experts (distinct) | device pairs | device experts

sum_partials is the host's ``sum_in_node_order`` then the decoder's two adds: Y_0 + Y_1 + ... left to right,
then ``extra`` (the device experts' output), then ``more`` (the shared experts'), each a float32 add in that
order, so its bits equal the eager path's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

TOTALS = 6
SPLIT_THREADS = 256  # strata_split_pairs' one block: a thread a pair (and an expert), in turns past 256
ROUTED, SKIPPED, CPU_PAIRS, CPU_EXPERTS, DEVICE_PAIRS, DEVICE_EXPERTS = range(TOTALS)

SOURCE = r"""
// pair i (token i / k, the router's rank i % k): its expert and weight, and its side: 0 skipped (below the tail
// skip: the host's weights >= skip, where on), 1 the CPU, 2 the device
__device__ __forceinline__ int pair_side(const unsigned int* packed, int k, const unsigned char* on_device,
                                         float skip, int i, int* e, float* w) {
    long long row = (long long)(i / k) * 2 * k;
    *e = (int)packed[row + i % k];
    *w = __int_as_float((int)packed[row + k + i % k]);
    if (skip > 0.0f && !(*w >= skip)) return 0;
    return on_device[*e] ? 2 : 1;
}
__device__ int block_sum_int(int v, int* part) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) part[w] = v;
    __syncthreads();
    v = lane < nw ? part[lane] : 0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    return v;
}
// One block: a thread a pair places it at its side's count of earlier pairs (the router order, as the host's
// pass keeps it), a thread an expert counts its pairs and whether each side met it; the totals block-summed.
extern "C" __global__ void strata_split_pairs(const unsigned int* packed, int T, int k, const unsigned char* on_device,
                                              int E, float skip, int* cpu_tokens, int* cpu_experts,
                                              float* cpu_weights, long long* cpu_count, int* dev_tokens,
                                              int* dev_experts, float* dev_weights, long long* dev_count,
                                              long long* counts, long long* totals) {
    __shared__ int part[32];
    int P = T * k, nc = 0, nd = 0, skipped = 0, ce = 0, de = 0;
    for (int i = threadIdx.x; i < P; i += blockDim.x) {
        int e, eq;
        float w, wq;
        int side = pair_side(packed, k, on_device, skip, i, &e, &w);
        if (side == 0) { skipped += 1; continue; }
        int at = 0;
        for (int q = 0; q < i; ++q) at += pair_side(packed, k, on_device, skip, q, &eq, &wq) == side;
        if (side == 2) { dev_tokens[at] = i / k; dev_experts[at] = e; dev_weights[at] = w; nd += 1; }
        else { cpu_tokens[at] = i / k; cpu_experts[at] = e; cpu_weights[at] = w; nc += 1; }
    }
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int chosen = 0, on_cpu = 0, on_dev = 0, ei;
        float wi;
        for (int i = 0; i < P; ++i) {
            int side = pair_side(packed, k, on_device, skip, i, &ei, &wi);
            if (ei != e) continue;
            chosen += 1;
            on_cpu |= side == 1;
            on_dev |= side == 2;
        }
        counts[e] += chosen;
        ce += on_cpu;
        de += on_dev;
    }
    nc = block_sum_int(nc, part);
    nd = block_sum_int(nd, part);
    skipped = block_sum_int(skipped, part);
    ce = block_sum_int(ce, part);
    de = block_sum_int(de, part);
    if (threadIdx.x == 0) {
        cpu_count[0] = nc;
        dev_count[0] = nd;
        totals[0] += (long long)P; totals[1] += skipped; totals[2] += nc; totals[3] += ce; totals[4] += nd;
        totals[5] += de;
    }
}

extern "C" __global__ void strata_sum_partials(const float* parts, int nodes, long long n, const float* extra,
                                               const float* more, float* out) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float s = parts[i];
    for (int p = 1; p < nodes; ++p) s += parts[(long long)p * n + i];
    if (extra) s += extra[i];
    if (more) s += more[i];
    out[i] = s;
}
"""


@functools.lru_cache(maxsize=None)
def cuda_module():
    import cupy

    return cupy.RawModule(code=SOURCE, options=("--std=c++14", "--fmad=false"))


@dataclass(frozen=True, eq=False)
class SplitPairs:
    """split_pairs' outputs, device arrays: each side's first ``count[0]`` entries are its pairs."""

    cpu_tokens: object  # [T*k] int32
    cpu_experts: object  # [T*k] int32
    cpu_weights: object  # [T*k] float32
    cpu_count: object  # [1] int64
    dev_tokens: object
    dev_experts: object
    dev_weights: object
    dev_count: object


def split_pairs(packed, k: int, on_device, skip: float, counts, totals) -> SplitPairs:
    """packed [T, 2k] (router.route's), on_device [E] uint8, counts [E] and totals [TOTALS] int64 accumulated."""
    import cupy

    T, E = packed.shape[0], on_device.shape[0]
    P = T * k
    i32, f32, i64 = np.int32, np.float32, np.int64
    out = SplitPairs(*(cupy.empty(P, d) for d in (i32, i32, f32)), cupy.empty(1, i64),
                     *(cupy.empty(P, d) for d in (i32, i32, f32)), cupy.empty(1, i64))
    cuda_module().get_function("strata_split_pairs")((1,), (SPLIT_THREADS,), (
        packed, i32(T), i32(k), on_device, i32(E), f32(skip), out.cpu_tokens, out.cpu_experts, out.cpu_weights,
        out.cpu_count, out.dev_tokens, out.dev_experts, out.dev_weights, out.dev_count, counts, totals))
    return out


def sum_partials(parts, extra=None, more=None):
    """parts [N, T, H] float32 (node order) -> Y_0 + ... + Y_{N-1} (+ extra) (+ more) [T, H], one launch."""
    import cupy

    N, T, H = parts.shape
    out = cupy.empty((T, H), np.float32)
    n = T * H
    if n:
        null = np.uint64(0)  # a null pointer: that add is left out
        cuda_module().get_function("strata_sum_partials")(((n + 255) // 256,), (256,), (
            parts, np.int32(N), np.int64(n), extra if extra is not None else null,
            more if more is not None else null, out))
    return out
