"""NodeWorker: one node's expert compute, free of processes and sockets.

The in-process pool drives it directly; the node worker process wraps it with
sockets and signals. Work is cut into tasks of (expert, block of at most
``task_rows`` of the node's rows); the node's threads compute the tasks'
contributions and the results are added in task order (experts ascending, row
blocks ascending), so Y_n is a deterministic function of (weights, inputs,
plan), independent of thread count, task order and timing. A task's rows are
decoded from the store's format (shm/formats) to float32 first, so every format
computes with exactly its dequantised weights, by the same BLAS calls as f32.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from shm import formats
from shm.expert_source import ExpertSlice

from .kernels import swiglu_partial
from .routing import group_by_expert
from .tasks import TaskRunner

log = logging.getLogger(__name__)

TASK_ROWS = 1024  # rows of one expert per task: whole experts up to 1024 rows (tools/task_bench.py)


class ExpertStore(Protocol):
    node: int

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
    ) -> np.ndarray:
        """This node's partial output Y_n [T, H] for the routed pairs."""
        groups, parts, xs, tasks = [], [], [], []
        for group in group_by_expert(tokens, experts, weights):
            part = self.store.get(layer, group.expert)
            if part is None:  # this node holds no rows of the expert
                continue
            k = len(groups)
            groups.append(group)
            parts.append(part)
            xs.append(x[group.tokens])  # [n, H]
            for start in range(0, part.rows, self.task_rows):
                tasks.append(Task(k, start, min(start + self.task_rows, part.rows)))

        def run(i: int) -> np.ndarray:
            t = tasks[i]
            p = parts[t.group]
            fmt = formats.get(p.fmt)
            return swiglu_partial(xs[t.group], *(formats.decoded(fmt, m[t.start:t.stop])  # [r, H] float32
                                                 for m in (p.gate, p.up, p.down_t)))  # [n, H]

        contribs = self.runner.run(len(tasks), run)
        y = np.zeros((x.shape[0], self.hidden_size), dtype=np.float32)  # [T, H]
        for t, contrib in zip(tasks, contribs):
            g = groups[t.group]
            y[g.tokens] += g.weights[:, None] * contrib
        self.bytes_read += sum(p.nbytes for p in parts)
        return y

    def close(self) -> None:
        self.runner.close()
        self.store.close()
