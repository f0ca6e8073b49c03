"""NUMA nodes, their CPUs and memory, from sysfs.

psutil has no NUMA view, so nodes come from ``<sys>/devices/system/node/node*``
(``cpulist`` and ``meminfo``), intersected with the CPUs that are online and
that this process may use (its affinity and its cgroup's cpuset). When more
nodes are asked for than the machine has, the usable CPU list is split into
that many groups: virtual nodes, marked ``virtual=True`` in every report.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_SYS = Path("/sys")
CGROUP_CPUSET_FILES = ("fs/cgroup/cpuset.cpus.effective", "fs/cgroup/cpuset/cpuset.effective_cpus")


class TopologyError(RuntimeError):
    """The machine's node layout cannot be read or cannot provide what was asked."""


@dataclass(frozen=True)
class Node:
    id: int  # node number (a virtual node's own index)
    cpus: tuple[int, ...]  # CPUs usable by this process
    mem_total: int | None  # bytes; a virtual node reports its share of the real node
    mem_free: int | None  # bytes available: free plus reclaimable page cache and slab (as MemAvailable)
    virtual: bool = False
    parent: int | None = None  # the real node a virtual one was cut from
    shares_cpus: bool = False  # a virtual node that had to share CPUs (more nodes than CPUs)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["cpus"] = list(self.cpus)
        return d


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise TopologyError(f"cannot parse CPU list {text!r} (at {part!r})")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise TopologyError(f"cannot parse CPU list {text!r}: range {part!r} runs backwards")
        cpus.extend(range(lo, hi + 1))
    return cpus


def format_cpulist(cpus: tuple[int, ...] | list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, run = [], []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


RECLAIMABLE = ("Active(file)", "Inactive(file)", "SReclaimable")  # page cache and reclaimable slab


def _meminfo(path: Path) -> tuple[int | None, int | None]:
    """(MemTotal, available) in bytes from a node's meminfo, or (None, None). Available is MemFree plus the
    node's reclaimable file pages and slab, as the kernel's MemAvailable counts them: a page cache full of
    recently read checkpoints is room, not a reason to refuse a segment."""
    try:
        text = path.read_text()
    except OSError:
        return None, None
    values = {}
    for key in ("MemTotal", "MemFree", *RECLAIMABLE):
        m = re.search(rf"{re.escape(key)}:\s+(\d+)\s*kB", text)
        values[key] = int(m.group(1)) * 1024 if m else None
    if values["MemFree"] is None:
        return values["MemTotal"], None
    return values["MemTotal"], values["MemFree"] + sum(values[k] or 0 for k in RECLAIMABLE)


def usable_cpus(sys_root: Path = DEFAULT_SYS) -> set[int]:
    """CPUs this process may run on: its affinity, within its cgroup's cpuset, online."""
    cpus = set(os.sched_getaffinity(0)) if sys_root == DEFAULT_SYS else None
    for rel in CGROUP_CPUSET_FILES:
        path = sys_root / rel
        if path.is_file():
            text = path.read_text().strip()
            if text:
                allowed = set(parse_cpulist(text))
                cpus = allowed if cpus is None else cpus & allowed
            break
    online = sys_root / "devices/system/cpu/online"
    if online.is_file():
        on = set(parse_cpulist(online.read_text()))
        cpus = on if cpus is None else cpus & on
    if cpus is None:
        raise TopologyError(f"cannot tell which CPUs are usable under {sys_root}")
    return cpus


def real_nodes(sys_root: Path = DEFAULT_SYS, allowed: set[int] | None = None) -> list[Node]:
    """Every NUMA node, CPUs limited to ``allowed`` (default: this process's usable CPUs).

    A node with memory but no usable CPUs (CXL memory, or CPUs outside the
    affinity) is listed with an empty CPU tuple.
    """
    allowed = usable_cpus(sys_root) if allowed is None else allowed
    base = sys_root / "devices/system/node"
    dirs = sorted((p for p in base.glob("node[0-9]*") if p.is_dir()), key=lambda p: int(p.name[4:]))
    if not dirs:
        # no NUMA support in the kernel: one node with every usable CPU
        return [Node(0, tuple(sorted(allowed)), None, None)]
    nodes = []
    for d in dirs:
        cpulist = d / "cpulist"
        cpus = parse_cpulist(cpulist.read_text()) if cpulist.is_file() else []
        total, free = _meminfo(d / "meminfo")
        nodes.append(Node(int(d.name[4:]), tuple(c for c in cpus if c in allowed), total, free))
    return nodes


def _shares(count: int, sizes: list[int]) -> list[int]:
    """``count`` parts over bins of ``sizes``: one each, the rest by largest remainder, never above a bin's size."""
    parts = [1] * len(sizes)
    for _ in range(count - len(sizes)):
        # the bin whose CPUs per part is largest gets the next part (earlier bin on ties)
        k = max((k for k in range(len(sizes)) if parts[k] < sizes[k]), key=lambda k: (sizes[k] / parts[k], -k))
        parts[k] += 1
    return parts


def split_virtual(nodes: list[Node], count: int) -> list[Node]:
    """``count`` virtual nodes cut from the CPUs of ``nodes`` (in order), as even as possible;
    when there are at least as many as real nodes, none spans two real nodes."""
    cpus = [(c, n) for n in nodes for c in n.cpus]
    if not cpus:
        raise TopologyError("no usable CPUs to make virtual nodes from")
    groups: list[list[tuple[int, Node]]] = []
    if len(nodes) <= count <= len(cpus):
        # every virtual node inside one real node: shares by CPU count, at least one each
        per_node = _shares(count, [len(n.cpus) for n in nodes])
        for n, parts in zip(nodes, per_node):
            base, extra = divmod(len(n.cpus), parts)
            start = 0
            for k in range(parts):
                size = base + (1 if k < extra else 0)
                groups.append([(c, n) for c in n.cpus[start : start + size]])
                start += size
    elif count <= len(cpus):
        base, extra = divmod(len(cpus), count)
        start = 0
        for k in range(count):
            size = base + (1 if k < extra else 0)
            groups.append(cpus[start : start + size])
            start += size
    else:
        groups = [[cpus[k % len(cpus)]] for k in range(count)]
    cpus_cut_from: dict[int, int] = {}  # real node -> CPUs handed to its virtual nodes
    for group in groups:
        cpus_cut_from[group[0][1].id] = cpus_cut_from.get(group[0][1].id, 0) + len(group)
    out = []
    for k, group in enumerate(groups):
        parent = group[0][1]
        share = len(group) / cpus_cut_from[parent.id]  # of the parent's memory
        out.append(Node(
            id=k,
            cpus=tuple(c for c, _ in group),
            mem_total=int(parent.mem_total * share) if parent.mem_total is not None else None,
            mem_free=int(parent.mem_free * share) if parent.mem_free is not None else None,
            virtual=True,
            parent=parent.id,
            shares_cpus=count > len(cpus),
        ))
    return out


def select_nodes(count: int | None = None, sys_root: Path = DEFAULT_SYS, allowed: set[int] | None = None) -> list[Node]:
    """The nodes a pool runs on: all real nodes with CPUs, the first ``count`` of them,
    or ``count`` virtual nodes when the machine has fewer."""
    with_cpus = [n for n in real_nodes(sys_root, allowed) if n.cpus]
    if not with_cpus:
        raise TopologyError("no NUMA node has a CPU this process may use")
    if count is None:
        return with_cpus
    if count < 1:
        raise TopologyError(f"asked for {count} nodes; need at least 1")
    if count <= len(with_cpus):
        return with_cpus[:count]
    return split_virtual(with_cpus, count)


def format_table(nodes: list[Node]) -> str:
    def gib(v: int | None) -> str:
        return "-" if v is None else f"{v / 2**30:.1f}"

    rows = [("node", "cpus", "mem total GiB", "mem free GiB", "kind")]
    for n in nodes:
        kind = f"virtual (of node {n.parent}{', shared CPUs' if n.shares_cpus else ''})" if n.virtual else "real"
        if not n.cpus and not n.virtual:
            kind += ", memory only"
        rows.append((str(n.id), format_cpulist(n.cpus) or "-", gib(n.mem_total), gib(n.mem_free), kind))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)
