"""InprocPool: the node workers' own task code, run in the coordinator process.

The reference for tests: the process pool on the same plan is bitwise equal to it.
"""

from __future__ import annotations

import os
import time
from typing import Sequence

import numpy as np

from node_worker import NodeWorker
from node_worker.membw import read_bandwidth
from shm.plan import PoolPlan
from shm.topology import Node

from .base import ExpertPool, LayerTiming, NodeHealth, PoolRequest, RowExperts, new_pool_stats, sum_in_node_order


class InprocPool(ExpertPool):
    def __init__(self, plan: PoolPlan, workers: list[NodeWorker], nodes: Sequence[Node] | None = None):
        """``nodes``: the topology's nodes, to label virtual ones in health(); without them every node is real."""
        if [w.node for w in workers] != list(plan.node_ids):
            raise ValueError("InprocPool needs one NodeWorker per plan node, in plan order")
        self.plan = plan
        self.workers = workers
        self.virtual = {n.id: n.virtual for n in nodes or ()}
        self._pending: PoolRequest | None = None
        self.timings = []
        self.stats = new_pool_stats(len(workers))

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
        self._count(LayerTiming(req.layer, req.x.shape[0], time.perf_counter_ns() - t0, tuple(compute),
                                tuple(nbytes)))
        return sum_in_node_order(partials, out)

    def _count(self, timing: LayerTiming) -> None:
        """One answered request in the pool's counters (and its timing, where the benchmark records them)."""
        self.stats["requests"] += 1
        self.stats["wait_ns"] += timing.wall_ns
        for k, ns in enumerate(timing.compute_ns):
            self.stats["worker_compute_ns"][k] += ns
        if self.record_timings:
            self.timings.append(timing)

    def row_experts(self, layer: int) -> RowExperts | None:
        """With one node, which holds every expert whole: its layer kernel's arguments for ``layer``, counted as a
        request of one row (stats, timings, the node's bytes) on each call's return."""
        if len(self.workers) != 1:
            return None  # several nodes: their partials summed in node order (collect)
        w = self.workers[0]

        def done(answer: int, ns: int) -> None:
            w.count(layer, answer, 1)  # a negative answer: ValueError naming the routing error
            self._count(LayerTiming(layer, 1, ns, (ns,), (answer,)))

        return RowExperts(layer, w.kernels, w.node_args(layer), w.team, done)

    def health(self) -> list[NodeHealth]:
        """The nodes run in this process: alive while the process is, never restarted."""
        sizes = list(self.plan.slices)
        pid = os.getpid()
        out = []
        for w in self.workers:
            rows = self.plan.slice_of(sizes[0], w.node) if len(sizes) == 1 else None
            out.append(NodeHealth(node=w.node, virtual=self.virtual.get(w.node, False), pid=pid, alive=True,
                                  state="ok", restarts=0, deaths=0, last_error=None,
                                  slice_rows=[rows.start, rows.stop] if rows else None, threads=w.threads,
                                  placement=None, reloaded=None, segment=None,
                                  segment_bytes=w.store.nbytes))
        return out

    def ping(self) -> float:
        """No sockets to cross: the time of one empty call per node; seconds."""
        t0 = time.perf_counter()
        for w in self.workers:
            _pong(w)
        return time.perf_counter() - t0

    def membw(self, nbytes: int, repeats: int = 3) -> dict:
        # the nodes of this pool run one after another in this process: measure them that way
        per_node = []
        for w in self.workers:
            seconds, gbps = read_bandwidth(w.threads, nbytes, repeats)
            per_node.append({"node": w.node, "seconds": seconds, "gb_per_s": gbps, "threads": w.threads})
        total = sum(p["seconds"] for p in per_node)
        return {"gb_per_s": nbytes * len(per_node) / total / 1e9, "per_node": per_node}

    @property
    def bytes_read(self) -> int:
        return sum(w.bytes_read for w in self.workers)

    def close(self) -> None:
        for w in self.workers:
            w.close()


def _pong(_worker: NodeWorker) -> None:
    """The empty call ping() times."""
