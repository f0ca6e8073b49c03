"""ExpertPool: where the routed (token, expert, weight) triples of a MoE layer are computed.

``submit`` hands one layer's CPU work to the pool and returns at once;
``collect`` returns the sum of the nodes' partial outputs, added in the plan's
node order. Between the two the coordinator computes whatever runs on the
device. Two implementations: ``InprocPool`` (inproc.py) runs the node workers'
own task code in this process and is the reference the process pool
(process.py) is compared with.
"""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass

import numpy as np

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
