"""NodeWorker: one node's expert compute, free of processes and sockets.

The in-process pool drives it directly; the node worker process wraps it with
sockets and signals. Work is cut into tasks of (expert, block of at most
``task_rows`` of the node's rows); the node's threads compute the tasks'
contributions and the results are added in task order (experts ascending, row
blocks ascending), so Y_n is a deterministic function of (weights, inputs,
plan), independent of thread count, task order and timing.

Two ways to compute a task, chosen by its group's token count alone (so the
choice is a function of the inputs too): a group of at most
ROW_KERNEL_MAX_TOKENS tokens (decode) goes with all such tasks of the layer
into one compiled call that reads the store's format directly
(node_worker/kernels/rows.py); a larger group (prefill) has its rows decoded
to float32 and multiplied by BLAS on the node's threads. Either way every
format computes with exactly its dequantised weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol, Sequence

import numba
import numpy as np

from shm.expert_source import ExpertSlice

from .kernels import dense, simd, swiglu_partial
from .kernels.dense import decode_rows_serial
from .kernels.rows import FORMAT_IDS, layer_rows, warm_up
from .routing import group_by_expert
from .tasks import TaskRunner

log = logging.getLogger(__name__)

TASK_ROWS = 1024  # rows of one expert per task: whole experts up to 1024 rows (tools/task_bench.py)
ROW_KERNEL_MAX_TOKENS = 8  # groups of up to this many tokens take the compiled row kernel; larger ones BLAS
assert ROW_KERNEL_MAX_TOKENS <= simd.MAX_TOKENS  # the kernel's per-token accumulators


class ExpertStore(Protocol):
    """A node's expert slices in one buffer (shm/expert_store.py's BufferExpertStore)."""

    node: int
    fmt: str  # shm/formats name
    hidden: int
    row_bytes: int
    data: np.ndarray  # [bytes] uint8
    offsets: dict[tuple[int, int], tuple[int, int, int]]  # (layer, expert) -> gate, up, down_t byte offsets

    def get(self, layer: int, expert: int) -> ExpertSlice | None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Task:
    group: int  # index into the request's expert groups
    start: int  # rows [start, stop) of the node's slice of that expert
    stop: int


class NodeWorker:
    def __init__(self, node: int, store: ExpertStore, hidden_size: int, threads: int = 1,
                 cpus: Sequence[int] | None = None, task_rows: int = TASK_ROWS):
        self.node = node
        self.store = store
        self.hidden_size = hidden_size
        self.task_rows = task_rows
        self.runner = TaskRunner(threads, cpus, name=f"node{node}")
        self.bytes_read = 0  # expert weight bytes touched, for the benchmark
        warm_up()  # compiled (or loaded from the disk cache) now, not in the first request
        dense.warm_up()

    @property
    def threads(self) -> int:
        return self.runner.threads

    def compute(
        self,
        layer: int,
        x: np.ndarray,  # [T, H] float32: only the tokens routed to a CPU expert
        tokens: np.ndarray,  # [P] row of x for each routed pair
        experts: np.ndarray,  # [P] expert id
        weights: np.ndarray,  # [P] float32 routing weight
        out: np.ndarray | None = None,  # [>= T, H] float32: written in place (the pool's shared segment)
    ) -> np.ndarray:
        """This node's partial output Y_n [T, H] for the routed pairs (``out[:T]`` when given)."""
        groups, parts, tasks = [], [], []
        for group in group_by_expert(tokens, experts, weights):
            part = self.store.get(layer, group.expert)
            if part is None:  # this node holds no rows of the expert
                continue
            k = len(groups)
            groups.append(group)
            parts.append(part)
            for start in range(0, part.rows, self.task_rows):
                tasks.append(Task(k, start, min(start + self.task_rows, part.rows)))
        x = np.ascontiguousarray(x, np.float32)
        few = [i for i, t in enumerate(tasks) if groups[t.group].tokens.size <= ROW_KERNEL_MAX_TOKENS]
        many = [i for i, t in enumerate(tasks) if groups[t.group].tokens.size > ROW_KERNEL_MAX_TOKENS]
        contribs: list[np.ndarray | None] = [None] * len(tasks)
        for i, c in zip(few, self._row_kernel(layer, x, groups, [tasks[i] for i in few])):
            contribs[i] = c
        fmt_id = FORMAT_IDS[self.store.fmt]

        def decoded(stored: np.ndarray) -> np.ndarray:  # stored rows [r, ...] -> float32 [r, H]
            out = np.empty((stored.shape[0], self.hidden_size), np.float32)
            decode_rows_serial(fmt_id, stored.reshape(-1).view(np.uint8), 0, self.store.row_bytes, 0, out)
            return out

        def run(i: int) -> np.ndarray:
            t = tasks[many[i]]
            p = parts[t.group]
            return swiglu_partial(x[groups[t.group].tokens], *(decoded(m[t.start:t.stop])  # [r, H]
                                                              for m in (p.gate, p.up, p.down_t)))  # [n, H]

        for i, c in zip(many, self.runner.run(len(many), run)):
            contribs[i] = c
        if out is None:
            y = np.zeros((x.shape[0], self.hidden_size), dtype=np.float32)  # [T, H]
        else:
            y = out[: x.shape[0]]
            y[...] = 0
        for t, contrib in zip(tasks, contribs):  # in task order: the same sum whoever computed what
            g = groups[t.group]
            y[g.tokens] += g.weights[:, None] * contrib
        self.bytes_read += sum(p.nbytes for p in parts)
        return y

    def _row_kernel(self, layer: int, x: np.ndarray, groups: list, tasks: list[Task]) -> list[np.ndarray]:
        """The tasks of small groups in one compiled call (node_worker/kernels/rows.py); their contributions."""
        if not tasks:
            return []
        used = sorted({t.group for t in tasks})
        index = {g: i for i, g in enumerate(used)}
        sizes = [groups[g].tokens.size for g in used]
        tok_stop = np.cumsum(sizes, dtype=np.int64)
        tok_start = tok_stop - np.asarray(sizes, np.int64)
        tokens = np.concatenate([groups[g].tokens for g in used]).astype(np.int64)
        offsets = np.array([self.store.offsets[(layer, groups[g].expert)] for g in used], np.int64)  # [G, 3]
        task_group = np.array([index[t.group] for t in tasks], np.int64)
        task_rows = np.array([(t.start, t.stop) for t in tasks], np.int64).reshape(-1, 2)
        lengths = np.array([groups[t.group].tokens.size * self.hidden_size for t in tasks], np.int64)
        contrib_start = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        contrib = np.empty(int(lengths.sum()), np.float32)
        numba.set_num_threads(min(self.threads, numba.config.NUMBA_NUM_THREADS))
        layer_rows(FORMAT_IDS[self.store.fmt], self.store.data, self.hidden_size, self.store.row_bytes, x, tokens,
                   tok_start, tok_stop, offsets, task_group, task_rows, contrib, contrib_start)
        return [contrib[a : a + n].reshape(-1, self.hidden_size) for a, n in zip(contrib_start, lengths)]

    def close(self) -> None:
        self.runner.close()
        self.store.close()
