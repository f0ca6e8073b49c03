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

from . import kernels

TOTALS = 6
SPLIT_THREADS = 256  # strata_split_pairs' one block: a thread a pair (and an expert), in turns past 256
ROUTED, SKIPPED, CPU_PAIRS, CPU_EXPERTS, DEVICE_PAIRS, DEVICE_EXPERTS = range(TOTALS)

SOURCE = kernels.source("compact")


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
        out.cpu_count, out.dev_tokens, out.dev_experts, out.dev_weights, out.dev_count, counts, totals),
        shared_mem=2 * P * 4)  # each pair's side and expert
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
