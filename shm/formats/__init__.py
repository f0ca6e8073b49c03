"""Expert storage formats: how one row of an expert matrix is laid out in a node's store.

Every expert matrix is stored as rows: gate and up [R, H] (H weights along the
hidden axis), down [H, R] (W_down's columns of the node's slice: R weights
along the intermediate axis, padded with zeros to whole blocks). Every
format's blocks run along the row, so the plan's slices (multiples of 32 rows)
fall on block boundaries, and H must be a multiple of the format's block.

    f32    4 bytes a weight: float32, as today                         (f32.py)
    bf16   2 bytes a weight: bfloat16, the top half of a float32       (bf16.py)
    q8     1.0625 bytes a weight: int8 values, one f16 scale per 32     (q8.py)
    q4     0.5625 bytes a weight: 4-bit values, one f16 scale per 32    (q4.py)

A format module has NAME, BLOCK, ``row_bytes(H)``, ``encode_into(dest, src)``
(float32 rows -> stored rows, at fill) and ``decode_into(dest, src)`` (stored
rows -> float32, exactly the weights the kernels compute with). Stored rows are
an array [R, row_bytes(H)] of uint8 (float32 and uint16 views for f32, bf16).
"""

from __future__ import annotations

from types import ModuleType

import numpy as np

from . import bf16, f32, q4, q8

FORMATS: dict[str, ModuleType] = {m.NAME: m for m in (f32, bf16, q8, q4)}
AUTO = "auto"


class FormatError(ValueError):
    """An expert format that does not exist or does not fit the model."""


def get(name: str) -> ModuleType:
    try:
        return FORMATS[name]
    except KeyError:
        raise FormatError(f"expert format {name!r} is not known; expected one of {', '.join(FORMATS)}") from None


def resolve(name: str, checkpoint_dtype: str, hidden: int) -> ModuleType:
    """The format to store experts in. ``auto`` keeps the checkpoint's weights exactly in the fewest bytes:
    bf16 for a BF16 checkpoint, f32 for F16 and F32 ones (bf16 would round F16's mantissa), q8 and q4 for a
    GGUF file's Q8_0 and Q4_0 blocks (shm/gguf_blocks.py); another GGUF block type needs a chosen format."""
    if name == AUTO:
        from ..checkpoint import is_block_dtype
        from ..gguf_blocks import LOSSLESS, ggml_type

        if is_block_dtype(checkpoint_dtype):
            name = LOSSLESS.get(ggml_type(checkpoint_dtype))
            if name is None:
                raise FormatError(f"the experts are {checkpoint_dtype} blocks, which no store format holds exactly "
                                  "yet: choose --expert-dtype (q8, q4, bf16 or f32) to convert them (a second "
                                  "rounding)")
        else:
            name = "bf16" if checkpoint_dtype == "BF16" else "f32"
    fmt = get(name)
    if hidden % fmt.BLOCK:
        raise FormatError(f"expert format {name} stores blocks of {fmt.BLOCK} weights along the hidden axis; "
                          f"this model's hidden size {hidden} is not a multiple of {fmt.BLOCK}")
    return fmt


def down_width(fmt: ModuleType, rows: int) -> int:
    """Weights in a stored row of W_down [H, R]: R rounded up to whole blocks (a slice that ends in a partial
    block, the last node's when the intermediate size is not a multiple of 32, is padded with zero weights,
    which the kernels multiply by zeros past R)."""
    return -(-rows // fmt.BLOCK) * fmt.BLOCK


def stored_view(fmt: ModuleType, raw: np.ndarray, rows: int, hidden: int) -> np.ndarray:
    """Bytes of a stored matrix -> its array view: [R, H] float32 (f32), [R, H] uint16 (bf16), [R, row_bytes] uint8."""
    return raw.view(fmt.STORED_DTYPE).reshape(rows, fmt.row_bytes(hidden) // np.dtype(fmt.STORED_DTYPE).itemsize)


def decoded(fmt: ModuleType, stored: np.ndarray) -> np.ndarray:
    """Stored rows -> float32 [R, H] (a view for f32, a new array otherwise)."""
    if fmt is f32:
        return stored
    out = np.empty((stored.shape[0], fmt.hidden_of(stored.shape[1])), np.float32)
    fmt.decode_into(out, stored)
    return out
