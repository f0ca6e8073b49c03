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
from dataclasses import dataclass

import numpy as np

from node_worker import NodeWorker
from shm.plan import PoolPlan

log = logging.getLogger(__name__)


@dataclass
class PoolRequest:
    layer: int
    x: np.ndarray  # [T, H] rows of only the tokens routed to a CPU expert
    tokens: np.ndarray  # [P] int64 row of x per pair
    experts: np.ndarray  # [P] int64
    weights: np.ndarray  # [P] float32


class ExpertPool(abc.ABC):
    plan: PoolPlan

    @abc.abstractmethod
    def submit(self, request: PoolRequest) -> None:
        """Start computing one layer's CPU pairs."""

    @abc.abstractmethod
    def collect(self) -> np.ndarray:
        """The submitted request's output [T, H]: Y_0 + Y_1 + ... in node order."""

    def close(self) -> None:
        """Release the pool's workers and memory."""


def sum_in_node_order(partials: list[np.ndarray]) -> np.ndarray:
    total = partials[0].copy()
    for part in partials[1:]:
        total += part
    return total


class InprocPool(ExpertPool):
    def __init__(self, plan: PoolPlan, workers: list[NodeWorker]):
        if [w.node for w in workers] != list(plan.node_ids):
            raise ValueError("InprocPool needs one NodeWorker per plan node, in plan order")
        self.plan = plan
        self.workers = workers
        self._pending: PoolRequest | None = None

    def submit(self, request: PoolRequest) -> None:
        if self._pending is not None:
            raise RuntimeError("submit() called twice without collect()")
        self._pending = request

    def collect(self) -> np.ndarray:
        req, self._pending = self._pending, None
        if req is None:
            raise RuntimeError("collect() without submit()")
        partials = [w.compute(req.layer, req.x, req.tokens, req.experts, req.weights) for w in self.workers]
        return sum_in_node_order(partials)

    @property
    def bytes_read(self) -> int:
        return sum(w.bytes_read for w in self.workers)

    def close(self) -> None:
        for w in self.workers:
            w.close()
