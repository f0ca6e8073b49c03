"""Which storage format each tensor takes on the device, decided from the checkpoint's index before anything is read.

    matrix (2-D, read along its rows)   --dense-dtype / --expert-dtype, or with ``auto`` the file's own:
        GGUF Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, IQ4_XS  -> q8, q4, q4k, q5k, q6k, iq4xs (the blocks as they are)
        F32                                        -> f32
        BF16, F16, F8_E4M3                         -> bf16 (F16 and FP8 rounded once; VRAM, not exactness)
        another GGUF block type                    -> q8 (a second rounding: no device format holds it)
    vector (norms, biases), router              -> f32 (small; the router's top-k is decided on its logits)
    embedding                                   -> the host: a step reads T of its rows (llama.cpp keeps
                                                   token_embd on the CPU too)

A format whose block does not divide the row (q8's 32 into a row of 48) falls back to bf16.
The formats are shm/formats' records (traits.py): the CPU and the device share one table.
"""

from __future__ import annotations

from shm.checkpoint import is_block_dtype
from shm.formats import AUTO, traits

from . import format_kernels

FLOAT_TO_BF16 = ("BF16", "F16", "F8_E4M3")  # float checkpoint types the device holds as bf16 under auto
UNKNOWN_BLOCKS = "q8"  # a GGUF block type no format holds: re-quantised to this


def matrix_format(dtype: str, requested: str, row: int) -> str:
    """The device storage format of a matrix whose checkpoint type is ``dtype`` and rows hold ``row`` weights."""
    if requested != AUTO:
        name = requested
    elif dtype in traits.EXACT and traits.BY_NAME[traits.EXACT[dtype]].integer is not None:
        name = traits.EXACT[dtype]
    elif dtype == "F32":
        name = "f32"
    elif dtype in FLOAT_TO_BF16 or not is_block_dtype(dtype):
        name = "bf16"
    else:
        name = UNKNOWN_BLOCKS
    return name if row % traits.BY_NAME[name].block == 0 else "bf16"


def matrix_bytes(fmt: str, rows: int, row: int) -> int:
    """Device bytes of a [rows, row] matrix in ``fmt``: rows padded to 16 bytes (format_kernels.row_stride)."""
    return rows * format_kernels.row_stride(fmt, row)
