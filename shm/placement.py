"""Where a segment's pages are: per-node page counts from /proc/<pid>/numa_maps."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Placement:
    segment: str
    pages_per_node: dict[int, int]  # node -> resident pages of the mapping
    local_node: int  # the (real) node the segment belongs to

    @property
    def pages(self) -> int:
        return sum(self.pages_per_node.values())

    @property
    def local_share(self) -> float | None:
        """Share of resident pages on the local node; None when nothing is resident yet."""
        return self.pages_per_node.get(self.local_node, 0) / self.pages if self.pages else None

    def as_dict(self) -> dict:
        return {"segment": self.segment, "pages_per_node": self.pages_per_node, "local_node": self.local_node,
                "pages": self.pages, "local_share": self.local_share}


def parse_numa_maps(text: str, segment: str) -> dict[int, int]:
    """Pages per node of every mapping of ``/dev/shm/<segment>`` in a numa_maps text."""
    name = segment.lstrip("/")
    pages: dict[int, int] = {}
    for line in text.splitlines():
        fields = line.split()
        if not any(f == f"file=/dev/shm/{name}" for f in fields):
            continue
        for f in fields:
            m = re.fullmatch(r"N(\d+)=(\d+)", f)
            if m:
                pages[int(m.group(1))] = pages.get(int(m.group(1)), 0) + int(m.group(2))
    return pages


def segment_placement(pid: int, segment: str, local_node: int, proc: Path = Path("/proc")) -> Placement | None:
    """Placement of ``segment`` as mapped by ``pid``, or None if numa_maps is unreadable."""
    try:
        text = (proc / str(pid) / "numa_maps").read_text()
    except OSError:
        return None
    return Placement(segment, parse_numa_maps(text, segment), local_node)


def owner_node(pid: int, node: int) -> int:
    """The real node whose CPUs process ``pid`` runs on (all of its allowed CPUs in one node), else ``node``.

    A segment's header names its plan node, which for a virtual node is not a
    memory node: its pages are local when they sit on the real node under the
    owner's CPUs, as the worker itself reports (its job's local node)."""
    from .topology import real_nodes

    try:
        allowed = set(os.sched_getaffinity(pid))
    except OSError:
        return node
    holding = [n.id for n in real_nodes(allowed=allowed) if n.cpus]
    return holding[0] if len(holding) == 1 else node
