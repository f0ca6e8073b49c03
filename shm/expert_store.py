"""Where one node's expert slices live.

``HeapExpertStore`` keeps them in this process's memory. ``SegmentExpertStore``
keeps them in the node's shared-memory segment: per expert, its gate rows, up
rows and transposed down columns, each [R, H] weights stored in the engine's
format (shm/formats: f32, bf16, q8, q4), 64-byte aligned, at the offsets of the
layout table stored in the segment header (whose kind names the format), so any
process that maps the segment sees the same zero-copy views.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np

from . import formats
from .checkpoint import Checkpoint
from .expert_source import ExpertRefs, ExpertSlice, read_expert_slice
from .plan import PoolPlan
from .segments import Segment

ALIGN = 64
LAYOUT_PREFIX = "expert-slices/"


def layout_kind(fmt: str) -> str:
    return LAYOUT_PREFIX + ("float32" if fmt == "f32" else fmt)  # f32 keeps the kind older segments carry


def kind_format(kind: str) -> str | None:
    if not isinstance(kind, str) or not kind.startswith(LAYOUT_PREFIX):
        return None
    name = kind[len(LAYOUT_PREFIX):]
    return "f32" if name == "float32" else name


class HeapExpertStore:
    """(layer, expert) -> this node's ExpertSlice, held in ordinary process memory."""

    def __init__(self, node: int, slices: dict[tuple[int, int], ExpertSlice], fmt: str = "f32"):
        self.node = node
        self.fmt = fmt
        self._slices = slices

    @classmethod
    def from_checkpoint(
        cls,
        ckpt: Checkpoint,
        plan: PoolPlan,
        node: int,
        experts: Mapping[tuple[int, int], tuple[ExpertRefs, int]],
        fmt: str = "f32",
    ) -> "HeapExpertStore":
        """Read ``node``'s rows of every expert in format ``fmt``; ``experts`` maps (layer, e) -> (refs,
        intermediate size)."""
        slices: dict[tuple[int, int], ExpertSlice] = {}
        for key, (refs, intermediate) in experts.items():
            rows = plan.slice_of(intermediate, node)
            if rows is not None:
                slices[key] = read_expert_slice(ckpt, refs, rows.start, rows.stop, fmt)
        return cls(node, slices, fmt)

    def get(self, layer: int, expert: int) -> ExpertSlice | None:
        """This node's slice of the expert, or None when the node holds no rows of it."""
        return self._slices.get((layer, expert))

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self._slices.values())

    def close(self) -> None:
        self._slices.clear()


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def build_layout(entries: Iterable[tuple[int, int, int, int]], hidden: int, fmt: str = "f32") -> tuple[dict, int]:
    """entries (layer, expert, row start, row stop) -> (layout table, data bytes), matrices in format ``fmt``.

    Table rows are [layer, expert, start, stop, gate offset, up offset, down_t offset].
    """
    row = formats.get(fmt).row_bytes(hidden)
    table, offset = [], 0
    for layer, expert, start, stop in sorted(entries):
        matrix = (stop - start) * row
        gate, up, down = offset, _align(offset + matrix), _align(_align(offset + matrix) + matrix)
        table.append([layer, expert, start, stop, gate, up, down])
        offset = _align(down + matrix)
    return {"kind": layout_kind(fmt), "hidden": hidden, "experts": table}, offset


class SegmentExpertStore:
    """Zero-copy views of a segment's expert slices."""

    def __init__(self, node: int, segment: Segment):
        self.node = node
        self.segment = segment
        layout = segment.header.layout
        name = kind_format(layout.get("kind"))
        if name not in formats.FORMATS:
            raise ValueError(f"segment {segment.name} layout kind {layout.get('kind')!r} is not an expert store")
        self.fmt = name
        fmt = formats.get(name)
        hidden = layout["hidden"]
        data = segment.data
        self._views: dict[tuple[int, int], ExpertSlice] = {}
        self.row_ranges: dict[tuple[int, int], tuple[int, int]] = {}
        for layer, expert, start, stop, g, u, d in layout["experts"]:
            size = (stop - start) * fmt.row_bytes(hidden)

            def view(off: int) -> np.ndarray:
                return formats.stored_view(fmt, data[off : off + size], stop - start, hidden)

            self._views[(layer, expert)] = ExpertSlice(view(g), view(u), view(d), name)
            self.row_ranges[(layer, expert)] = (start, stop)

    def get(self, layer: int, expert: int) -> ExpertSlice | None:
        return self._views.get((layer, expert))

    def keys(self) -> list[tuple[int, int]]:
        return sorted(self._views)

    @property
    def nbytes(self) -> int:
        return self.segment.header.data_bytes

    def close(self) -> None:
        self._views.clear()
        self.segment.close()
