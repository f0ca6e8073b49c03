"""Reads one node's rows of an expert straight from the checkpoint.

Only rows ``start..stop`` of W_gate and W_up, and columns ``start..stop`` of
W_down, are touched in the memory-mapped files; they are converted to float32
and returned in the node's storage layout (``down_t`` is W_down[:, rows]
transposed, so each intermediate row's H weights are contiguous).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .checkpoint import Checkpoint


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


@dataclass(frozen=True)
class ExpertSlice:
    """One node's rows of one expert, float32, each [R, H] and C-contiguous."""

    gate: np.ndarray  # [R, H] rows of W_gate
    up: np.ndarray  # [R, H] rows of W_up
    down_t: np.ndarray  # [R, H] = W_down[:, rows].T

    @property
    def rows(self) -> int:
        return self.gate.shape[0]

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down_t.nbytes


def _matrix(ckpt: Checkpoint, ref: TensorRef) -> tuple[np.ndarray, str]:
    raw = ckpt.raw(ref.name)
    if ref.expert is not None:
        raw = raw[ref.expert]
    return raw, ckpt.info(ref.name).dtype


def convert_into(dest: np.ndarray, raw: np.ndarray, dtype: str) -> None:
    """dest (float32) <- raw storage of the same shape, converted in one pass with no temporary.

    BF16 is the top half of a float32: its bits go to the high uint16 of each
    little-endian float32 and the low half is zeroed.
    """
    if dtype == "BF16":
        halves = dest.view(np.uint16).reshape(*dest.shape, 2)  # [..., (low, high)]
        halves[..., 0] = 0
        halves[..., 1] = raw
    else:
        dest[...] = raw


def _rows(ckpt: Checkpoint, ref: TensorRef, start: int, stop: int) -> tuple[np.ndarray, str]:
    """Storage view of rows [start, stop) of an [I, H] matrix, and its dtype."""
    raw, dtype = _matrix(ckpt, ref)
    return raw[ref.row_offset + start : ref.row_offset + stop], dtype


def _columns_t(ckpt: Checkpoint, ref: TensorRef, start: int, stop: int) -> tuple[np.ndarray, str]:
    """Storage view of columns [start, stop) of an [H, I] matrix, transposed to [R, H], and its dtype."""
    raw, dtype = _matrix(ckpt, ref)
    return raw[:, start:stop].T, dtype


def _converted(view: np.ndarray, dtype: str) -> np.ndarray:
    out = np.empty(view.shape, np.float32)
    convert_into(out, view, dtype)
    return out


def read_rows(ckpt: Checkpoint, ref: TensorRef, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of an [I, H] matrix as float32 [R, H]."""
    return _converted(*_rows(ckpt, ref, start, stop))


def read_columns_t(ckpt: Checkpoint, ref: TensorRef, start: int, stop: int) -> np.ndarray:
    """Columns [start, stop) of an [H, I] matrix, transposed: float32 [R, H]."""
    return _converted(*_columns_t(ckpt, ref, start, stop))


def read_expert_slice(ckpt: Checkpoint, refs: ExpertRefs, start: int, stop: int) -> ExpertSlice:
    return ExpertSlice(
        gate=read_rows(ckpt, refs.gate, start, stop),
        up=read_rows(ckpt, refs.up, start, stop),
        down_t=read_columns_t(ckpt, refs.down, start, stop),
    )


def write_expert_slice(ckpt: Checkpoint, refs: ExpertRefs, start: int, stop: int, dest: ExpertSlice) -> int:
    """Read the rows straight into the destination views (no intermediate copies); returns bytes written."""
    convert_into(dest.gate, *_rows(ckpt, refs.gate, start, stop))
    convert_into(dest.up, *_rows(ckpt, refs.up, start, stop))
    convert_into(dest.down_t, *_columns_t(ckpt, refs.down, start, stop))
    return dest.nbytes
