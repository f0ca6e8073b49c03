"""NodeWorker: one node's expert compute, free of processes and sockets.

The in-process pool drives it directly; the node worker process wraps it with
sockets and signals. Each routed expert the node holds rows of is a task; the
node's threads compute the tasks' contributions and the results are added in
task order (experts ascending), so Y_n is a deterministic function of
(weights, inputs, plan), independent of thread count, task order and timing.

All of it, the grouping of the routed pairs included, is one compiled call
(node_worker/kernels/layer.py, the rows in kernels/rows.py) that reads the
store's format directly on numba's threads, the GIL released, whatever a
group's token count; every format computes with exactly its dequantised
weights. Python only looks up the layer's expert table. (Decoding the rows to
float32 for BLAS is slower, even on a prefill's groups of many tokens.)
"""

from __future__ import annotations

import logging
from typing import Protocol, Sequence

import numba
import numpy as np

from shm import formats
from shm.expert_source import ExpertSlice
from shm.jit_entry import entry_point

from . import kernel_threads
from .kernels.kernel_set import KernelSet, compiled_cover, for_formats
from .kernels.layer import ROUTING_ERRORS, layer_moe, warm_up
from .kernels.rows import SHAPE, loop_id

log = logging.getLogger(__name__)

class ExpertStore(Protocol):
    """A node's expert slices in one buffer (shm/expert_store.py's BufferExpertStore)."""

    node: int
    fmt: str  # shm/formats' ExpertFormats spec
    formats: formats.ExpertFormats
    hidden: int
    data: np.ndarray  # [bytes] uint8
    offsets: dict[tuple[int, int], tuple[int, int, int]]  # (layer, expert) -> gate, up, down byte offsets

    def get(self, layer: int, expert: int) -> ExpertSlice | None: ...

    def close(self) -> None: ...


class NodeWorker:
    def __init__(self, node: int, store: ExpertStore, hidden_size: int, threads: int = 1,
                 cpus: Sequence[int] | None = None, activations: str = "q8", num_experts: int | None = None):
        """``num_experts``: the model's routed experts per layer (default: the highest one the store holds, + 1):
        an id past them is refused."""
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.node = node
        self.activations = activations  # "q8": integer dot products where the format has integers; "f32"
        self.bf16_products = activations == "bf16"  # bf16 rows by bf16 activations (kernels/bf16dp.py)
        # the loops the layer kernel is compiled with: the store's formats, in this activation mode (or a compiled
        # set that covers them)
        self.kernels: KernelSet = compiled_cover(for_formats(store.formats.names, activations))
        self.store = store
        self.hidden_size = hidden_size
        self.threads = threads  # numba's team for this node's kernels (the process is pinned to ``cpus``)
        self.cpus = list(cpus or [])
        self.num_experts = num_experts or max((e for _, e in store.offsets), default=-1) + 1
        self.bytes_read = 0  # expert weight bytes touched, for the benchmark
        self.layer_call = None  # layer_moe's entry point for layer_args' types, taken at the first layer (jit_entry)
        self._tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # layer -> expert offsets [E, 3], rows [E]
        warm_up(self.kernels)  # loaded from the disk cache (or compiled) now, not in the first request

    @property
    def team(self) -> int:
        """The numba threads this node's kernels take: its own, within numba's pool."""
        return min(self.threads, numba.config.NUMBA_NUM_THREADS)

    def use_node_threads(self) -> int:
        """Set numba's thread count (this calling thread's) to the node's, and return it."""
        n = self.team
        kernel_threads.use(n)
        return n

    def layer_args(
        self,
        layer: int,
        x: np.ndarray,  # [T, H] float32: only the tokens routed to a CPU expert
        tokens: np.ndarray,  # [P] row of x for each routed pair
        experts: np.ndarray,  # [P] expert id
        weights: np.ndarray,  # [P] float32 routing weight
        out: np.ndarray | None = None,  # [>= T, H] float32: written in place (the pool's shared segment)
    ) -> tuple:
        """kernels.layer.layer_moe's arguments for this node's partial of the routed pairs (its output y
        [T, H] is ``out[:T]`` when given, else new); numba's thread count set to the node's."""
        data, hidden, offsets, shapes = self.node_args(layer)
        x = np.ascontiguousarray(x, np.float32)
        y = np.empty((x.shape[0], hidden), np.float32) if out is None else out[: x.shape[0]]
        self.use_node_threads()
        return (self.kernels, data, hidden, x, np.ascontiguousarray(tokens, np.int64),
                np.ascontiguousarray(experts, np.int64), np.ascontiguousarray(weights, np.float32), offsets, shapes,
                y)

    def node_args(self, layer: int) -> tuple:
        """layer_moe's arguments for ``layer`` that stay from call to call: (data, hidden, offsets, shapes)."""
        return (self.store.data, self.hidden_size, *self._table(layer))

    def compute(self, layer: int, x: np.ndarray, tokens: np.ndarray, experts: np.ndarray, weights: np.ndarray,
                out: np.ndarray | None = None) -> np.ndarray:
        """This node's partial output Y_n [T, H] for the routed pairs (``out[:T]`` when given): layer_args'."""
        args = self.layer_args(layer, x, tokens, experts, weights, out)
        self.count(layer, self.run_layer(args), args[3].shape[0])
        return args[9]

    def run_layer(self, args: tuple) -> int:
        """layer_moe(*args) for layer_args' args, through the entry point bound at the first layer (layer_args
        fixes every argument's type)."""
        self.layer_call = self.layer_call or entry_point(layer_moe, args)
        return self.layer_call(*args)

    def count(self, layer: int, nbytes: int, rows: int) -> None:
        """layer_moe's answer: the expert bytes it read, or the routing error it found (ValueError)."""
        if nbytes < 0:
            raise ValueError(f"layer {layer}: {self.routing_error(nbytes, rows)}")
        self.bytes_read += nbytes

    def routing_error(self, code: int, rows: int) -> str:
        """What layer_moe's negative answer ``code`` says of a request of ``rows`` rows."""
        return ROUTING_ERRORS[code].format(rows=rows, experts=self.num_experts)

    def _table(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """The layer's expert table, built once: byte offsets [E, 3] and shapes [E, 8] (kernels/rows.py's SHAPE:
        the node's rows R, 0 for none held; each matrix's format and stored row bytes, shm.formats')."""
        table = self._tables.get(layer)
        if table is None:
            gate, up, down = (formats.get(n) for n in self.store.formats.of(layer))
            H = self.hidden_size
            held = {e: off for (lay, e), off in self.store.offsets.items() if lay == layer}
            E = self.num_experts  # every routable id has a row: 0 rows where this node holds none
            offsets, shapes = np.zeros((E, 3), np.int64), np.zeros((E, len(SHAPE)), np.int64)
            for e, off in held.items():
                offsets[e] = off
                R = self.store.get(layer, e).rows
                width = formats.down_width(down, R)
                gate_id, up_id, down_id = (loop_id(m.NAME, self.bf16_products) for m in (gate, up, down))
                shapes[e] = (R, gate_id, gate.row_bytes(H), up_id, up.row_bytes(H), down_id, width,
                             down.row_bytes(width))
            table = self._tables[layer] = (offsets, shapes)
        return table

    def close(self) -> None:
        self.store.close()
