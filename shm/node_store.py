"""Opening one node's expert store: reattach to a complete segment, or make and fill one.

The segment's pages are reserved at creation (posix_fallocate, so a full
tmpfs is an ENOSPC error, not a SIGBUS later) by the calling process, the node
worker, already pinned to its node: the kernel allocates them on that node. The
filling then runs on threads pinned one per CPU of the node.
"""

from __future__ import annotations

import logging
import os
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Mapping

from .checkpoint import Checkpoint
from .expert_source import ExpertRefs, write_expert_slice
from .expert_store import SegmentExpertStore, build_layout
from .plan import PoolPlan
from .progress import Progress
from .segments import open_or_create, segment_name

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadReport:
    segment: str
    reloaded: bool  # False: reattached to a complete segment, nothing read from the checkpoint
    bytes: int
    seconds: float
    threads: int

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def _pinning_initializer(cpus: list[int]):
    pool: queue.Queue[int] = queue.Queue()
    for c in cpus:
        pool.put(c)

    def pin() -> None:
        try:
            os.sched_setaffinity(0, {pool.get_nowait()})  # 0 = this thread on Linux
        except (queue.Empty, OSError) as exc:
            log.debug("fill thread not pinned: %s", exc)

    return pin


def open_node_store(
    ckpt: Checkpoint,
    plan: PoolPlan,
    node: int,
    experts: Mapping[tuple[int, int], tuple[ExpertRefs, int]],
    hidden: int,
    cpus: list[int],
    model_digest: str | None = None,
    node_free: int | None = None,
    fmt: str = "f32",
) -> tuple[SegmentExpertStore, LoadReport]:
    """The node's store in its segment, experts in format ``fmt``; ``experts`` maps (layer, e) -> (refs,
    intermediate size)."""
    model_digest = model_digest or ckpt.digest()
    wanted = {}
    for (layer, e), (refs, inter) in experts.items():
        rows = plan.slice_of(inter, node, e)
        if rows is not None:
            wanted[(layer, e)] = (refs, rows.start, rows.stop)
    layout, data_bytes = build_layout(((l, e, a, b) for (l, e), (_, a, b) in wanted.items()), hidden, fmt)
    name = segment_name(model_digest, plan.digest, node)
    start = time.monotonic()
    segment, needs_fill = open_or_create(name, node, model_digest, plan.digest, layout, data_bytes, node_free)
    try:
        store = SegmentExpertStore(node, segment)
        if needs_fill:
            progress = Progress(data_bytes, f"node {node}: loading experts")
            threads = max(1, len(cpus))

            def fill(key):
                refs, a, b = wanted[key]
                progress.add(write_expert_slice(ckpt, refs, a, b, store.get(*key)))

            with ThreadPoolExecutor(threads, initializer=_pinning_initializer(list(cpus))) as ex:
                list(ex.map(fill, sorted(wanted)))
            progress.finish()
            segment.mark_complete()
        else:
            threads = 0
    except BaseException:
        segment.close()  # owner of a half-written segment: it goes
        raise
    report = LoadReport(name, needs_fill, data_bytes, time.monotonic() - start, threads)
    if needs_fill:
        log.info("node %s: loaded %.2f GB into %s in %.2fs (%.2f GB/s, %d threads)",
                 node, data_bytes / 1e9, name, report.seconds, report.gb_per_s, threads)
    return store, report
