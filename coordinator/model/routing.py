"""An MoE layer's routing: the pairs the router chose, split by where their expert lives, and the counters kept
over an engine's life."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


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
class RoutingTotals:
    """Some layers' routing in totals (each side's distinct experts a layer at a time, summed)."""

    routed: int  # pairs the router chose
    skipped: int  # dropped by route_tail_skip
    cpu_pairs: int  # sent to the CPU pool
    cpu_experts: int  # distinct experts the pool's requests touched
    device_pairs: int  # served by device-resident experts
    device_experts: int  # distinct device experts


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
        totals = RoutingTotals(routing.chosen.size, routing.skipped, routing.cpu.size, 0, routing.device.size, 0)
        chosen = np.bincount(routing.chosen, minlength=num_experts)  # [E]
        if routing.cpu.experts is routing.chosen:  # every choice went to the pool: its experts are the chosen ones
            totals.cpu_experts = int(np.count_nonzero(chosen))
        elif routing.cpu.size:  # distinct experts: a bincount, not a sort (np.unique), on every layer
            totals.cpu_experts = int(np.count_nonzero(np.bincount(routing.cpu.experts, minlength=num_experts)))
        if routing.device.size:
            totals.device_experts = int(np.count_nonzero(np.bincount(routing.device.experts, minlength=num_experts)))
        self.add({routing.layer: chosen}, totals)

    def add(self, chosen: dict, totals: RoutingTotals) -> None:
        """Some layers' routing: ``chosen`` layer -> [E] the router's choices per expert, and their totals. An
        eager layer's count and a graph-ready step's counters (counted on the device, coordinator/gpu/compact.py)
        both come here; the host's MoE block counts in its kernel (expert_counter) and count_pool_row."""
        for layer, counts in chosen.items():
            self.expert_counter(layer, counts.shape[0])[:] += counts
        self.routed_pairs += totals.routed
        self.skipped_pairs += totals.skipped
        self.cpu_pairs += totals.cpu_pairs
        self.cpu_expert_loads += totals.cpu_experts
        self.device_pairs += totals.device_pairs
        self.device_expert_loads += totals.device_experts

    def expert_counter(self, layer: int, num_experts: int) -> np.ndarray:
        """Layer ``layer``'s [E] counter of the router's choices (per_layer_expert's), made where missing: what a
        compiled MoE block adds to in place (host/blocks.py)."""
        if layer not in self.per_layer_expert:
            self.per_layer_expert[layer] = np.zeros(num_experts, np.int64)
        return self.per_layer_expert[layer]

    def count_pool_row(self, pairs: int, wait_ns: int) -> None:
        """One row's routing served whole by the pool in a compiled MoE block, which counted its experts: its
        ``pairs`` (the router's top-k, distinct experts) and the time the call took."""
        self.routed_pairs += pairs
        self.cpu_pairs += pairs
        self.cpu_expert_loads += pairs
        self.pool_wait_ns += wait_ns

    def count_pool_wait(self, ns: int) -> None:
        self.pool_wait_ns += ns
