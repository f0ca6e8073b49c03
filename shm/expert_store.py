"""Where one node's expert slices live.

``HeapExpertStore`` keeps them in this process's memory. ``SegmentExpertStore``
keeps them in the node's shared-memory segment: per expert, its gate and up
rows [R, H] and its down columns W_down[:, R] as [H, R] (shm/expert_source.py),
stored in the engine's formats (shm/formats: f32, bf16, q8, q4, or a GGUF
file's q4k, q5k, q6k blocks; per layer and matrix as ExpertFormats says; a
row of down holds R weights padded with zeros to whole blocks), 64-byte
aligned, at the offsets of the layout table stored in the segment header
(whose kind is the formats' spec), so any process that maps the segment sees
the same zero-copy views.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import numpy as np

from . import formats
from .checkpoint import Checkpoint
from .expert_source import ExpertRefs, ExpertSlice, ckpt_hidden, write_expert_slice
from .plan import PoolPlan
from .segments import Segment

ALIGN = 64
LAYOUT_PREFIX = "expert-slices/"


def layout_kind(spec: str) -> str:
    return LAYOUT_PREFIX + ("float32" if spec == "f32" else spec)  # f32 keeps the kind older segments carry


def kind_format(kind: str) -> str | None:
    if not isinstance(kind, str) or not kind.startswith(LAYOUT_PREFIX):
        return None
    name = kind[len(LAYOUT_PREFIX):]
    return "f32" if name == "float32" else name


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def matrix_bytes(triple: formats.Triple, rows: int, hidden: int) -> tuple[int, int, int]:
    """Stored bytes of an expert's gate [R, H], up [R, H] and down [H, R (whole blocks)] in these formats."""
    g, u, d = (formats.get(n) for n in triple)
    return rows * g.row_bytes(hidden), rows * u.row_bytes(hidden), hidden * d.row_bytes(formats.down_width(d, rows))


def build_layout(entries: Iterable[tuple[int, int, int, int]], hidden: int, spec: str = "f32") -> tuple[dict, int]:
    """entries (layer, expert, row start, row stop) -> (layout table, data bytes), matrices in the formats of
    the ExpertFormats ``spec``.

    Table rows are [layer, expert, start, stop, gate offset, up offset, down offset].
    """
    plan = formats.ExpertFormats.parse(spec)
    table, offset = [], 0
    for layer, expert, start, stop in sorted(entries):
        gate_bytes, up_bytes, down_bytes = matrix_bytes(plan.of(layer), stop - start, hidden)
        gate, up = offset, _align(offset + gate_bytes)
        down = _align(up + up_bytes)
        table.append([layer, expert, start, stop, gate, up, down])
        offset = _align(down + down_bytes)
    return {"kind": layout_kind(plan.spec), "hidden": hidden, "experts": table}, offset


class BufferExpertStore:
    """A node's expert slices in one byte buffer laid out by ``build_layout``: zero-copy views per expert, and
    the buffer with its table for the compiled kernels (node_worker/kernels), which read every format from it."""

    def __init__(self, node: int, data: np.ndarray, layout: dict, name: str = "buffer"):
        self.node = node
        spec = kind_format(layout.get("kind"))
        try:
            self.formats = formats.ExpertFormats.parse(spec)
        except formats.FormatError:
            raise ValueError(f"{name}: layout kind {layout.get('kind')!r} is not an expert store") from None
        self.fmt = spec
        self.hidden = int(layout["hidden"])
        self.data = data  # [data bytes] uint8
        self._views: dict[tuple[int, int], ExpertSlice] = {}
        self.row_ranges: dict[tuple[int, int], tuple[int, int]] = {}
        self.offsets: dict[tuple[int, int], tuple[int, int, int]] = {}  # (layer, e) -> gate, up, down byte offsets
        for layer, expert, start, stop, g, u, d in layout["experts"]:
            R = stop - start
            triple = self.formats.of(layer)
            gf, uf, df = (formats.get(n) for n in triple)

            def view(fmt, off: int, rows: int, width: int) -> np.ndarray:
                return formats.stored_view(fmt, data[off : off + rows * fmt.row_bytes(width)], rows, width)

            self._views[(layer, expert)] = ExpertSlice(
                view(gf, g, R, self.hidden), view(uf, u, R, self.hidden),
                view(df, d, self.hidden, formats.down_width(df, R)), formats.ExpertFormats(triple).spec)
            self.row_ranges[(layer, expert)] = (start, stop)
            self.offsets[(layer, expert)] = (g, u, d)

    def get(self, layer: int, expert: int) -> ExpertSlice | None:
        """This node's slice of the expert, or None when the node holds no rows of it."""
        return self._views.get((layer, expert))

    def keys(self) -> list[tuple[int, int]]:
        return sorted(self._views)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def close(self) -> None:
        self._views.clear()


def aligned_buffer(nbytes: int) -> np.ndarray:
    """nbytes of uint8, the first one ALIGN-aligned."""
    raw = np.empty(nbytes + ALIGN, np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return raw[skip : skip + nbytes]


class HeapExpertStore(BufferExpertStore):
    """(layer, expert) -> this node's ExpertSlice, in one buffer of ordinary process memory laid out as a
    segment would be."""

    def __init__(self, node: int, slices: dict[tuple[int, int], ExpertSlice], fmt: str = "f32"):
        first = next(iter(slices.values()), None)
        hidden = formats.get(first.formats[0]).hidden_of(first.gate.shape[1]) if first is not None else 0
        layout, nbytes = build_layout(((l, e, 0, s.rows) for (l, e), s in slices.items()), hidden, fmt)
        super().__init__(node, aligned_buffer(nbytes), layout, f"node {node} heap store")
        for key, s in slices.items():
            view = self._views[key]
            for dest, src in ((view.gate, s.gate), (view.up, s.up), (view.down, s.down)):
                dest[...] = src

    @classmethod
    def from_checkpoint(
        cls,
        ckpt: Checkpoint,
        plan: PoolPlan,
        node: int,
        experts: Mapping[tuple[int, int], tuple[ExpertRefs, int]],
        fmt: str = "f32",
    ) -> BufferExpertStore:
        """Read ``node``'s rows of every expert in format ``fmt``; ``experts`` maps (layer, e) -> (refs,
        intermediate size)."""
        wanted = {}
        for key, (refs, intermediate) in experts.items():
            rows = plan.slice_of(intermediate, node, key[1])
            if rows is not None:
                wanted[key] = (refs, rows.start, rows.stop)
        hidden = max((ckpt_hidden(ckpt, refs) for refs, _, _ in wanted.values()), default=0)
        layout, nbytes = build_layout(((l, e, a, b) for (l, e), (_, a, b) in wanted.items()), hidden, fmt)
        store = BufferExpertStore(node, aligned_buffer(nbytes), layout, f"node {node} heap store")
        for key, (refs, a, b) in wanted.items():
            write_expert_slice(ckpt, refs, a, b, store.get(*key))  # straight into the buffer, no copies
        return store


class SegmentExpertStore(BufferExpertStore):
    """Zero-copy views of a segment's expert slices."""

    def __init__(self, node: int, segment: Segment):
        self.segment = segment
        super().__init__(node, segment.data, segment.header.layout, f"segment {segment.name}")

    @property
    def nbytes(self) -> int:
        return self.segment.header.data_bytes

    def close(self) -> None:
        super().close()
        self.segment.close()
