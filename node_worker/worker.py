"""NodeWorker: one node's expert compute, free of processes and sockets.

The in-process pool drives it directly; the node worker process wraps it with
sockets and signals. Its output is a deterministic function of (weights,
inputs, plan): experts are visited in ascending order and each one's
contribution is added in that order.
"""

from __future__ import annotations

import logging
from typing import Protocol

import numpy as np

from shm.expert_source import ExpertSlice

from .kernels import swiglu_partial
from .routing import group_by_expert

log = logging.getLogger(__name__)


class ExpertStore(Protocol):
    node: int

    def get(self, layer: int, expert: int) -> ExpertSlice | None: ...


class NodeWorker:
    def __init__(self, node: int, store: ExpertStore, hidden_size: int):
        self.node = node
        self.store = store
        self.hidden_size = hidden_size
        self.bytes_read = 0  # expert weight bytes touched, for the benchmark

    def compute(
        self,
        layer: int,
        x: np.ndarray,  # [T, H] float32: only the tokens routed to a CPU expert
        tokens: np.ndarray,  # [P] int64 row of x for each routed pair
        experts: np.ndarray,  # [P] int64 expert id
        weights: np.ndarray,  # [P] float32 routing weight
    ) -> np.ndarray:
        """This node's partial output Y_n [T, H] for the routed pairs."""
        y = np.zeros((x.shape[0], self.hidden_size), dtype=np.float32)  # [T, H]
        for group in group_by_expert(tokens, experts, weights):
            part = self.store.get(layer, group.expert)
            if part is None:  # this node holds no rows of the expert
                continue
            contrib = swiglu_partial(x[group.tokens], part.gate, part.up, part.down_t)  # [n, H]
            y[group.tokens] += group.weights[:, None] * contrib
            self.bytes_read += part.nbytes
        return y
