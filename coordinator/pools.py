"""ExpertPool: where the routed (token, expert, weight) triples of a MoE layer are computed.

``submit`` hands one layer's CPU work to the pool and returns at once;
``collect`` returns the sum of the nodes' partial outputs, added in the plan's
node order. Between the two the coordinator computes whatever runs on the
device. ``InprocPool`` runs the node workers' own task code in this process and
is the reference the process pool is compared with.
"""

from __future__ import annotations

import abc
import logging
import time
from dataclasses import dataclass

import numpy as np

from node_worker import NodeWorker
from node_worker.membw import read_bandwidth
from shm.plan import PoolPlan

log = logging.getLogger(__name__)


@dataclass
class PoolRequest:
    layer: int
    x: np.ndarray  # [T, H] rows of only the tokens routed to a CPU expert
    tokens: np.ndarray  # [P] int64 row of x per pair
    experts: np.ndarray  # [P] int64
    weights: np.ndarray  # [P] float32


@dataclass(frozen=True)
class LayerTiming:
    """One submit/collect: wall time (first send to last partial), each node's own compute and bytes."""

    layer: int
    tokens: int  # rows of X sent
    wall_ns: int
    compute_ns: tuple[int, ...]  # per node, plan order
    bytes_read: tuple[int, ...]  # expert weight bytes per node
    # per node, process pools only: send -> worker has it; worker's own handling beside compute; reply -> here
    to_worker_ns: tuple[int, ...] = ()
    in_worker_ns: tuple[int, ...] = ()
    to_coordinator_ns: tuple[int, ...] = ()

    @property
    def overhead_ns(self) -> int:
        return self.wall_ns - max(self.compute_ns)


class ExpertPool(abc.ABC):
    plan: PoolPlan
    record_timings: bool = False  # the benchmark turns this on
    timings: list[LayerTiming]
    wait_hook = None  # a callable the pool calls now and then while it waits on other processes (the server's)

    def maintain(self) -> None:
        """Between steps: bring back what failed while idle (process pools restart dead workers)."""

    @abc.abstractmethod
    def submit(self, request: PoolRequest) -> None:
        """Start computing one layer's CPU pairs."""

    @abc.abstractmethod
    def collect(self, out: np.ndarray | None = None) -> np.ndarray:
        """The submitted request's output [T, H]: Y_0 + Y_1 + ... in node order, summed into
        ``out`` when given (the coordinator's pinned buffer) and returned."""

    def close(self) -> None:
        """Release the pool's workers and memory."""

    @abc.abstractmethod
    def membw(self, nbytes: int, repeats: int = 3) -> dict:
        """A STREAM-style read of ``nbytes`` per node by the nodes' own threads, all at once:
        {"gb_per_s": aggregate, "per_node": [...]}."""


def sum_in_node_order(partials: list[np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
    """Y_0 + Y_1 + ... [T, H], left to right, into ``out`` when given: the same bits either way."""
    if out is None:
        out = np.empty_like(partials[0])
    elif out.shape != partials[0].shape or out.dtype != partials[0].dtype:
        raise ValueError(f"output buffer is {out.dtype}{list(out.shape)}, "
                         f"the partials are {partials[0].dtype}{list(partials[0].shape)}")
    np.copyto(out, partials[0])
    for part in partials[1:]:
        out += part
    return out


class InprocPool(ExpertPool):
    def __init__(self, plan: PoolPlan, workers: list[NodeWorker]):
        if [w.node for w in workers] != list(plan.node_ids):
            raise ValueError("InprocPool needs one NodeWorker per plan node, in plan order")
        self.plan = plan
        self.workers = workers
        self._pending: PoolRequest | None = None
        self.timings = []

    def submit(self, request: PoolRequest) -> None:
        self._pending = request  # one left by a step that failed before its collect is dropped

    def collect(self, out: np.ndarray | None = None) -> np.ndarray:
        req, self._pending = self._pending, None
        if req is None:
            raise RuntimeError("collect() without submit()")
        partials, compute, nbytes = [], [], []
        t0 = time.perf_counter_ns()
        for w in self.workers:
            t, before = time.perf_counter_ns(), w.bytes_read
            partials.append(w.compute(req.layer, req.x, req.tokens, req.experts, req.weights))
            compute.append(time.perf_counter_ns() - t)
            nbytes.append(w.bytes_read - before)
        if self.record_timings:
            self.timings.append(LayerTiming(req.layer, req.x.shape[0], time.perf_counter_ns() - t0,
                                            tuple(compute), tuple(nbytes)))
        return sum_in_node_order(partials, out)

    def membw(self, nbytes: int, repeats: int = 3) -> dict:
        # the nodes of this pool run one after another in this process: measure them that way
        per_node = []
        for w in self.workers:
            seconds, gbps = read_bandwidth(w.runner, nbytes, repeats)
            per_node.append({"node": w.node, "seconds": seconds, "gb_per_s": gbps, "threads": w.threads})
        total = sum(p["seconds"] for p in per_node)
        return {"gb_per_s": nbytes * len(per_node) / total / 1e9, "per_node": per_node}

    @property
    def bytes_read(self) -> int:
        return sum(w.bytes_read for w in self.workers)

    def close(self) -> None:
        for w in self.workers:
            w.close()
