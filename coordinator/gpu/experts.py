"""The routed experts kept whole on the device, in their storage formats, run a layer at a time in four launches.

    slots        the layer's device pairs sorted by expert (then token): slot p = (token, expert, weight)
    gate, up     format_kernels.grouped_matvec over the slots through the layer's pointer tables -> [P, I]
    silu_mul     device_ops.silu_mul -> [P, I]
    down         grouped_matvec over the slots -> [P, H]
    slot sum     y[t] = sum of weight_p * down_p over t's slots in expert order (strata_slot_sum) -> [T, H]

A token's experts are summed in ascending expert order, as the per-expert loop it replaces summed them.
The slots' bookkeeping (the sort, each token's slot list) runs on the host, where the routing is; in a
graph-ready step (``run_split``) it runs on the device instead, from compact.split_pairs' device pairs, in one
block (strata_order_slots: the same order, each pair's key and each slot's token read once into shared memory), over all T*k slots the layer could have, the unused ones
computed and never summed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from . import kernels
from . import format_kernels

ORDER_THREADS = 256  # strata_order_slots' one block: a thread a pair, a slot and a token, in turns past 256

_SOURCE = kernels.source("experts")


@functools.lru_cache(maxsize=None)
def cuda_module():
    import cupy

    return cupy.RawModule(code=_SOURCE, options=("--std=c++14",))


@dataclass(eq=False)
class LayerExperts:
    """One MoE layer's device experts: their formats and the device pointer tables of their matrices."""

    formats: tuple[str, str, str]  # gate, up, down
    index: np.ndarray  # [E] int32: the expert's row in the tables, -1 where it is not on the device
    tables: tuple  # (gate, up, down) device uint64 [n] matrix addresses
    matrices: list  # the DeviceMatrix objects the tables point into (kept alive here)
    index_device: object  # index on the device [E] int32, for run_split


class DeviceExperts:
    """``experts``: (layer, e) -> (gate, up, down) DeviceMatrix, a layer's all in one format triple."""

    def __init__(self, experts: dict, num_experts: int, hidden: int, intermediate: int):
        self.hidden, self.intermediate = hidden, intermediate
        self.layers: dict[int, LayerExperts] = {}
        for layer in sorted({layer for layer, _ in experts}):
            ids = sorted(e for li, e in experts if li == layer)
            mats = [experts[(layer, e)] for e in ids]
            index = np.full(num_experts, -1, np.int32)
            index[ids] = np.arange(len(ids), dtype=np.int32)
            tables = tuple(format_kernels.pointer_table([m[k].data for m in mats]) for k in range(3))
            self.layers[layer] = LayerExperts(tuple(mats[0][k].fmt for k in range(3)), index, tables, mats,
                                              format_kernels.upload_index(index))

    def keys(self) -> list[tuple[int, int]]:
        return [(layer, e) for layer, le in self.layers.items() for e in np.flatnonzero(le.index >= 0).tolist()]

    def __contains__(self, key) -> bool:
        layer, e = key
        return layer in self.layers and self.layers[layer].index[e] >= 0

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for le in self.layers.values() for mats in le.matrices for m in mats)

    def run_split(self, layer: int, x, split):
        """``run`` for a graph-ready step: the device pairs of compact.split_pairs (``split``), the slots ordered on
        the device; the same bits as ``run`` with those pairs. [T, H]."""
        import cupy

        from . import ops as device_ops

        le = self.layers[layer]
        T, H, inter = x.shape[0], self.hidden, self.intermediate
        P = split.dev_tokens.shape[0]  # T*k: every slot the layer could have
        i32 = np.int32
        slot_rows, slot_matrix, by_token, ids, order = (cupy.empty(P, i32) for _ in range(5))
        slot_weights, start = cupy.empty(P, np.float32), cupy.empty(T + 1, i32)
        cuda_module().get_function("strata_order_slots")((1,), (ORDER_THREADS,), (
            split.dev_tokens, split.dev_experts, split.dev_weights, split.dev_count, le.index_device, i32(T), i32(P),
            slot_rows, slot_matrix, slot_weights, by_token, start, ids, order), shared_mem=2 * P * 4)
        xs = cupy.ascontiguousarray(x, dtype=np.float32)
        g = format_kernels.grouped_matvec(le.formats[0], le.tables[0], H, inter, xs, slot_rows, slot_matrix)
        u = format_kernels.grouped_matvec(le.formats[1], le.tables[1], H, inter, xs, slot_rows, slot_matrix)
        act = device_ops.silu_mul(g, u)  # [P, I]
        down = format_kernels.grouped_matvec(le.formats[2], le.tables[2], inter, H, act, ids, slot_matrix)  # [P, H]
        y = cupy.empty((T, H), np.float32)
        n = T * H
        cuda_module().get_function("strata_slot_sum")(((n + 255) // 256,), (256,), (
            down, slot_weights, by_token, start, i32(T), i32(H), y))
        return y

    def run(self, layer: int, x, tokens: np.ndarray, experts: np.ndarray, weights: np.ndarray):
        """The device experts' share of the layer [T, H] for the pairs (tokens, experts, weights) [P]."""
        import cupy

        from . import ops as device_ops

        le = self.layers[layer]
        T, H, inter = x.shape[0], self.hidden, self.intermediate
        order = np.lexsort((tokens, experts))  # slots by expert, then token
        slot_rows = cupy.asarray(tokens[order].astype(np.int32))  # [P] x's row of each slot
        slot_matrix = cupy.asarray(le.index[experts[order]])  # [P] the expert's row in the tables
        xs = cupy.ascontiguousarray(x, dtype=np.float32)
        g = format_kernels.grouped_matvec(le.formats[0], le.tables[0], H, inter, xs, slot_rows, slot_matrix)
        u = format_kernels.grouped_matvec(le.formats[1], le.tables[1], H, inter, xs, slot_rows, slot_matrix)
        act = device_ops.silu_mul(g, u)  # [P, I]
        P = order.size
        down = format_kernels.grouped_matvec(le.formats[2], le.tables[2], inter, H, act,
                                             cupy.asarray(np.arange(P, dtype=np.int32)), slot_matrix)  # [P, H]
        by_token = np.argsort(tokens[order], kind="stable")  # each token's slots, in expert order
        start = np.searchsorted(tokens[order][by_token], np.arange(T + 1)).astype(np.int32)  # [T + 1]
        y = cupy.empty((T, H), np.float32)
        n = T * H
        cuda_module().get_function("strata_slot_sum")(((n + 255) // 256,), (256,), (
            down, cupy.asarray(weights[order].astype(np.float32)), cupy.asarray(by_token.astype(np.int32)),
            cupy.asarray(start), np.int32(T), np.int32(H), y))
        return y
