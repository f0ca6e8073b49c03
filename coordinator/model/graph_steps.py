"""Graph-ready decode steps: a GPU decode step the host queues without waiting on the device until its logits.

Eager, each MoE layer downloads the router's choice, sorts out the pool's pairs on the host, posts them and waits
in Python for the nodes (a synchronisation a layer, docs/gpu.md). Here the layer stays on the device's stream:

    router kernel -> split_pairs (coordinator/device/compact.py: CPU and device pairs, the routing counters)
    -> copies of x and the CPU pairs into the pool segment -> host function ring (shm/pool_signal.py)
    -> the shared experts -> host function wait -> copies of the partials -> sum_partials

so the host's Python runs ahead, queueing the whole step, and waits once, on the logits (with the routing
counters, copied beside them). Every allocation of the step comes from its batch bucket's buffer
(coordinator/device/arena.py), so the step's arrays have the same addresses each step.

A step is graph-ready where the pool can be driven from the stream (the process pool), no expert is kept on the
device (their grouped kernels take the pairs from the host), and its rows fit the largest bucket and the pool's
request; otherwise it runs eagerly. A worker that dies or hangs inside one voids it: the pool recovers it, the
caches forget the step's positions and the step is redone eagerly, so no request is lost.
"""

from __future__ import annotations

import time

import numpy as np

from ..device import compact
from ..device.arena import StepArena
from ..pool.stream import StreamInterrupted
from . import xp as xp_module

MAX_ROWS = 64  # the largest bucket: a step of more rows (a prefill chunk) is eager


class GraphSteps:
    def __init__(self, cfg, on_device: dict[int, np.ndarray], link, xp):
        """``on_device``: layer -> [E] bool, the experts kept on the device (none, today: see the module
        docstring); ``link``: the pool's StreamLink."""
        self.cfg, self.link, self.xp = cfg, link, xp
        self.slots = {layer: s for s, layer in enumerate(cfg.moe_layers)}  # MoE layer -> its row in the tables
        E = cfg.num_experts
        self.on_device = {i: xp.asarray(on_device[i].astype(np.uint8)) for i in cfg.moe_layers}  # [E] each
        self.counts = xp.zeros((max(len(self.slots), 1), E), np.int64)  # [moe layers, E] chosen per expert
        self.totals = xp.zeros(compact.TOTALS, np.int64)  # compact.TOTALS' counters
        self.counts_host = xp_module.pinned(self.counts.shape, np.int64)
        self.totals_host = xp_module.pinned(compact.TOTALS, np.int64)
        self.arena = StepArena(xp)
        self.steps = 0  # steps run graph-ready
        self.redone = 0  # of them, redone eagerly after a worker died or hung
        self.host_ns = 0  # the host's time queueing the steps (from a step's start to its logits' download)
        self.wall_ns = 0  # the steps' whole time, the wait on the device included
        self.queued_at = 0  # perf_counter_ns when the current step's queueing ended

    def takes(self, rows: int) -> bool:
        return rows <= MAX_ROWS and self.link.fits(rows, self.cfg.top_k)

    def moe(self, decoder, i: int, lw, x):
        """Layer i's MoE output [T, H] for x [T, H], queued on the stream (module docstring)."""
        slot = self.slots[i]
        packed = decoder.route_packed(x @ lw.router.T, lw.router_bias)  # [T, 2k]
        split = compact.split_pairs(packed, self.cfg.top_k, self.on_device[i], decoder.route_tail_skip,
                                    self.counts[slot], self.totals)
        self.link.post(slot, i, x, split)  # the CPU work first ...
        y_shared = decoder.shared_output(lw, x)  # ... the shared experts while the nodes compute
        self.link.wait(slot)
        return compact.sum_partials(self.link.partials(x.shape[0]), None, y_shared)

    def queue_counters(self) -> None:
        """Before the step's one synchronisation: the routing counters copied to the host, then zeroed."""
        self.queued_at = time.perf_counter_ns()
        stream = self.xp.cuda.get_current_stream()
        self.counts.get(stream=stream, out=self.counts_host, blocking=False)
        self.totals.get(stream=stream, out=self.totals_host, blocking=False)
        self.counts.fill(0)
        self.totals.fill(0)

    def drop_counters(self) -> None:
        """A step that stopped half-way: its routing is not counted."""
        self.counts.fill(0)
        self.totals.fill(0)

    def fold_counters(self, stats, waited_ns: int) -> None:
        """After it: the step's routing into the decoder's RoutingStats, as the eager path counts it."""
        for layer, slot in self.slots.items():
            per = stats.per_layer_expert.setdefault(layer, np.zeros(self.cfg.num_experts, np.int64))
            per += self.counts_host[slot]
        t = self.totals_host
        stats.routed_pairs += int(t[compact.ROUTED])
        stats.skipped_pairs += int(t[compact.SKIPPED])
        stats.cpu_pairs += int(t[compact.CPU_PAIRS])
        stats.cpu_expert_loads += int(t[compact.CPU_EXPERTS])
        stats.device_pairs += int(t[compact.DEVICE_PAIRS])
        stats.device_expert_loads += int(t[compact.DEVICE_EXPERTS])
        stats.count_pool_wait(waited_ns)


__all__ = ["GraphSteps", "MAX_ROWS", "StreamInterrupted"]
