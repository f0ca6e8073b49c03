"""NodeWorker: one node's expert compute, free of processes and sockets.

The in-process pool drives it directly; the node worker process wraps it with
sockets and signals. Work is cut into tasks of (expert, block of at most
``task_rows`` of the node's rows); the node's threads compute the tasks'
contributions and the results are added in task order (experts ascending, row
blocks ascending), so Y_n is a deterministic function of (weights, inputs,
plan), independent of thread count, task order and timing.

Every task of the layer, whatever its group's token count, goes into one
compiled call that reads the store's format directly
(node_worker/kernels/rows.py: one token, or up to 8 at a time for prefill's
groups), on numba's threads, the GIL released; every format computes with
exactly its dequantised weights. (Decoding the rows to float32 for BLAS was
3x slower on groups of 16 tokens: tools/kernel_bench.py --tokens 16.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol, Sequence

import numba
import numpy as np

from shm.expert_source import ExpertSlice

from .kernels import dense
from .kernels.rows import FORMAT_IDS, layer_rows, warm_up
from .routing import group_by_expert
from .tasks import TaskRunner

log = logging.getLogger(__name__)

TASK_ROWS = 1024  # rows of one expert per task: whole experts up to 1024 rows (tools/task_bench.py)


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
        contribs = self._row_kernel(layer, x, groups, tasks)
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
