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
from typing import Callable, TypedDict

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


@dataclass(frozen=True, eq=False)
class RowExperts:
    """A layer's experts for one row, computed in the calling thread by the node's layer kernel
    (ExpertPool.row_experts): the kernel's arguments that stay, and where the pool counts each call."""

    layer: int
    kernels: object  # the node's KernelSet (node_worker/kernels/kernel_set.py)
    node: tuple  # layer_moe's (data, hidden, offsets, shapes) for this layer
    threads: int  # the node's team
    done: Callable[[int, int], None]  # (the kernel's answer, ns): the pool's counters; a negative answer raises


class NodeHealth(TypedDict):
    """One node of a pool, as ``ExpertPool.health()`` reports it."""

    node: int
    virtual: bool
    pid: int  # the process computing the node's share (this one for an in-process pool; -1 when none)
    alive: bool
    state: str  # "ok", or a sentence: "silent for 3.2s on the current layer", "down: ..."
    restarts: int
    deaths: int
    last_error: str | None
    slice_rows: list[int] | None  # [start, stop) of the node's rows of every expert, None when it holds none
    threads: int | None
    placement: dict | None  # the segment's page placement (process pools), else None
    reloaded: bool | None  # the segment was loaded afresh rather than reattached (process pools)
    segment: str | None  # shared-memory segment name (process pools)
    segment_bytes: int | None  # bytes of the node's expert store: its segment, or its heap buffer (in-process)


class PoolStats(TypedDict):
    """A pool's counters over its life (``ExpertPool.stats``); see ``new_pool_stats``."""

    requests: int  # collect() calls answered
    restarts: int  # worker restarts (process pools)
    wait_ns: int  # submit -> partials summed, summed over requests
    worker_compute_ns: list[int]  # per node, plan order: the nodes' own compute
    idle_ns: int  # partials done before the coordinator came to collect them (process pools)


def new_pool_stats(nodes: int) -> PoolStats:
    return PoolStats(requests=0, restarts=0, wait_ns=0, worker_compute_ns=[0] * nodes, idle_ns=0)


class ExpertPool(abc.ABC):
    plan: PoolPlan
    record_timings: bool = False  # the benchmark turns this on
    timings: list[LayerTiming]
    stats: PoolStats  # set by each pool's __init__ (new_pool_stats)
    wait_hook = None  # a callable the pool calls now and then while it waits on other processes (the server's)

    def row_experts(self, layer: int) -> RowExperts | None:
        """Layer ``layer``'s experts for one row in the calling thread, in one compiled call beside the network's
        (host/blocks.py: HostMoeBlock), or None: the layer's pairs go through submit and collect."""
        return None

    def maintain(self) -> None:
        """Between steps: bring back what failed while idle (process pools restart dead workers)."""

    @abc.abstractmethod
    def health(self) -> list[NodeHealth]:
        """One entry per node, plan order: is it alive, what state is it in, how often did it die."""

    @abc.abstractmethod
    def ping(self) -> float:
        """One empty round trip to every node; seconds."""

    @abc.abstractmethod
    def submit(self, request: PoolRequest) -> None:
        """Start computing one layer's CPU pairs."""

    @abc.abstractmethod
    def collect(self, out: np.ndarray | None = None) -> np.ndarray:
        """The submitted request's output [T, H]: Y_0 + Y_1 + ... in node order, summed into
        ``out`` when given (the coordinator's pinned buffer) and returned."""

    def close(self) -> None:
        """Release the pool's workers and memory."""

    def stream_link(self, make):
        """The pool driven from a GPU stream through the link ``make(pool)`` builds (coordinator/gpu/stream.py),
        kept and closed with the pool; or None: this pool is called from Python only (the in-process pool
        computes in the coordinator's own thread)."""
        return None

    def close_stream_link(self) -> None:
        """Give up the stream link stream_link made (none here)."""

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
