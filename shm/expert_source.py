"""Reads one node's rows of an expert straight from the checkpoint.

Only rows ``start..stop`` of W_gate and W_up, and columns ``start..stop`` of
W_down, are touched in the memory-mapped files; they are converted to float32
and returned in the node's storage layout: gate and up [R, H] (a row per
intermediate row, blocks along H), down [H, R] = W_down[:, rows] (a row per
output value, its R weights contiguous, blocks along the intermediate axis as
GGUF files quantise ffn_down, so a file's blocks are kept as they are and
every matrix is computed by the same dot-product loops).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Callable

import numpy as np

from . import formats, gguf_blocks
from .formats import traits
from .formats.encode import encode_into as compiled_encode_into
from .checkpoint import Checkpoint, is_block_dtype
from .gguf_checkpoint import block_float32, block_geometry


@dataclass(frozen=True)
class TensorRef:
    """Where one expert matrix lives: a tensor, optionally one expert of a fused [E, ...] tensor."""

    name: str
    expert: int | None = None  # index into the leading expert axis of a fused tensor
    row_offset: int = 0  # the matrix starts at this row (the up half of a fused gate_up tensor)


@dataclass(frozen=True)
class ExpertRefs:
    gate: TensorRef  # [I, H]
    up: TensorRef  # [I, H]
    down: TensorRef  # [H, I]

    def renamed(self, name: Callable[[str], str]) -> ExpertRefs:
        """The same matrices under the names ``name`` gives them (a GGUF file's own, for a node worker's job)."""
        return ExpertRefs(*(replace(r, name=name(r.name)) for r in (self.gate, self.up, self.down)))


@dataclass(frozen=True)
class ExpertSlice:
    """One node's rows of one expert in storage formats (shm/formats), each C-contiguous stored rows:
    float32 for f32 (the arrays are the weights), uint16 for bf16, row bytes of uint8 for the others."""

    gate: np.ndarray  # [R, .] rows of W_gate (H weights each)
    up: np.ndarray  # [R, .] rows of W_up
    down: np.ndarray  # [H, .] = W_down[:, rows] (R weights each, zeros to whole blocks: formats.down_width)
    fmt: str = "f32"  # one format, or gate/up/down formats (an ExpertFormats spec of one triple)

    @cached_property
    def formats(self) -> formats.Triple:
        """The (gate, up, down) formats ``fmt`` names, read once."""
        return formats.ExpertFormats.parse(self.fmt).default

    @property
    def rows(self) -> int:
        return self.gate.shape[0]

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes


def _matrix(ckpt: Checkpoint, ref: TensorRef) -> tuple[np.ndarray, str]:
    raw = ckpt.raw(ref.name)
    if ref.expert is not None:
        raw = raw[ref.expert]
    return raw, ckpt.info(ref.name).dtype


def convert_into(dest: np.ndarray, raw: np.ndarray, dtype: str) -> None:
    """dest (float32) <- raw storage of the same shape, converted in one pass with no temporary.

    BF16 is the top half of a float32: its bits go to the high uint16 of each
    little-endian float32 and the low half is zeroed. A GGUF block type's rows
    (uint8 [..., row bytes]) are dequantised as gguf.quants reads them.
    """
    if is_block_dtype(dtype):
        dest[...] = block_float32(raw, dtype)
    elif dtype == "BF16":
        halves = dest.view(np.uint16).reshape(*dest.shape, 2)  # [..., (low, high)]
        halves[..., 0] = 0
        halves[..., 1] = raw
    else:
        dest[...] = raw


def _rows(ckpt: Checkpoint, ref: TensorRef, start: int, stop: int) -> tuple[np.ndarray, str]:
    """Storage view of rows [start, stop) of an [I, H] matrix, and its dtype."""
    raw, dtype = _matrix(ckpt, ref)
    return raw[ref.row_offset + start : ref.row_offset + stop], dtype


def _columns(ckpt: Checkpoint, ref: TensorRef, start: int, stop: int) -> tuple[np.ndarray, str]:
    """Storage view of columns [start, stop) of an [H, I] matrix ([H, R]), and its dtype; for a GGUF block
    type, the bytes of the blocks that hold them (the slice must fall on the type's block boundaries)."""
    raw, dtype = _matrix(ckpt, ref)
    geometry = block_geometry(dtype) if is_block_dtype(dtype) else None
    if geometry is None:
        return raw[:, start:stop], dtype
    values, nbytes = geometry
    if start % values or stop % values:
        raise ValueError(f"{ref.name}: columns [{start}, {stop}) of {dtype} rows cut its {values}-value blocks")
    return raw[:, start // values * nbytes : stop // values * nbytes], dtype


def values_shape(raw: np.ndarray, dtype: str) -> tuple[int, ...]:
    """The shape of the weights a storage view holds (a GGUF block type's rows hold more values than bytes)."""
    if not is_block_dtype(dtype):
        return raw.shape
    values, nbytes = block_geometry(dtype)
    return (*raw.shape[:-1], raw.shape[-1] // nbytes * values)


def _converted(view: np.ndarray, dtype: str) -> np.ndarray:
    out = np.empty(values_shape(view, dtype), np.float32)
    convert_into(out, view, dtype)
    return out


def read_rows(ckpt: Checkpoint, ref: TensorRef, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of an [I, H] matrix as float32 [R, H]."""
    return _converted(*_rows(ckpt, ref, start, stop))


def read_columns(ckpt: Checkpoint, ref: TensorRef, start: int, stop: int) -> np.ndarray:
    """Columns [start, stop) of an [H, I] matrix: float32 [H, R]."""
    return _converted(*_columns(ckpt, ref, start, stop))


def read_expert_slice(ckpt: Checkpoint, refs: ExpertRefs, start: int, stop: int, fmt: str = "f32") -> ExpertSlice:
    """Rows [start, stop) of the expert, stored in format ``fmt`` (shm/formats; or gate/up/down formats)."""
    if fmt == "f32":
        return ExpertSlice(read_rows(ckpt, refs.gate, start, stop), read_rows(ckpt, refs.up, start, stop),
                           read_columns(ckpt, refs.down, start, stop))
    g, u, d = (formats.get(n) for n in formats.ExpertFormats.parse(fmt).default)
    hidden, rows = ckpt_hidden(ckpt, refs), stop - start

    def stored(f, count: int, weights: int) -> np.ndarray:
        return np.empty((count, f.row_bytes(weights) // np.dtype(f.STORED_DTYPE).itemsize), f.STORED_DTYPE)

    dest = ExpertSlice(stored(g, rows, hidden), stored(u, rows, hidden), stored(d, hidden, formats.down_width(d, rows)),
                       fmt=fmt)
    write_expert_slice(ckpt, refs, start, stop, dest)
    return dest


def ckpt_hidden(ckpt: Checkpoint, refs: ExpertRefs) -> int:
    """H of an expert: the gate matrix's row length."""
    return int(ckpt.info(refs.gate.name).shape[-1])


def write_expert_slice(ckpt: Checkpoint, refs: ExpertRefs, start: int, stop: int, dest: ExpertSlice) -> int:
    """Read the rows straight into the destination (f32: no intermediate copies; other formats through
    float32 blocks of rows, encoded at once); returns bytes written."""
    for sink, (raw, dtype), fmt in zip((dest.gate, dest.up, dest.down),
                                       (_rows(ckpt, refs.gate, start, stop), _rows(ckpt, refs.up, start, stop),
                                        _columns(ckpt, refs.down, start, stop)), dest.formats):
        store_into(sink, raw, dtype, fmt)
    return dest.nbytes


ENCODE_ROWS = 256  # rows converted to float32 at a time before encoding


def store_into(dest: np.ndarray, raw: np.ndarray, dtype: str, fmt: str) -> None:
    """Stored rows of format ``fmt`` <- checkpoint rows ``raw`` of ``dtype``, zeros past raw's width when a row
    holds more weights (W_down's rows padded to whole blocks). A BF16 source kept as bf16 is copied bit for bit."""
    if is_block_dtype(dtype) and traits.EXACT.get(dtype) == fmt:
        width = formats.get(fmt).hidden_of(dest.shape[1])
        for a in range(0, raw.shape[0], ENCODE_ROWS):  # the file's blocks, their bytes moved (no rounding)
            b = min(a + ENCODE_ROWS, raw.shape[0])
            dest[a:b] = gguf_blocks.repack(raw[a:b], gguf_blocks.ggml_type(dtype), width)[1]
    elif fmt == "f32":
        convert_into(dest, raw, dtype)
    elif fmt == "bf16" and dtype == "BF16":
        dest[...] = raw
    else:
        f = formats.get(fmt)
        width = f.hidden_of(dest.shape[1])
        block = np.zeros((min(ENCODE_ROWS, raw.shape[0]), width), np.float32)  # [rows, width]: zeros past raw's
        for a in range(0, raw.shape[0], ENCODE_ROWS):
            b = min(a + ENCODE_ROWS, raw.shape[0])
            convert_into(block[: b - a, : values_shape(raw, dtype)[1]], raw[a:b], dtype)
            compiled_encode_into(f, dest[a:b], block[: b - a])
