"""GGUF tensor rows in the expert stores' formats, repacked without loss (the first piece of GGUF loading).

ggml's Q8_0 and Q4_0 compute exactly as the stores' q8 and q4 (shm/formats):
blocks of 32 along the row, one float16 scale d per block, weight = d * q.
Only the byte order differs:

    Q8_0 block, 34 bytes:   float16 d | int8 q[32]
    Q4_0 block, 18 bytes:   float16 d | uint8 qs[16]    qs[j] = (q[j] + 8) | (q[j + 16] + 8) << 4
    q8 row:                 int8 q of every block      | float16 d of every block
    q4 row:                 16 bytes qs of every block  | float16 d of every block

Q4_K, Q5_K, Q6_K and IQ4_XS rows are stored as they are (formats q4k, q5k,
q6k, iq4xs: the kernels read the file's super-blocks of 256). So a row of the file becomes a
stored row by moving bytes, and a node
computes with exactly the file's dequantised weights (gguf.quants.dequantize),
never a second quantisation of them. BF16 and F32 rows are the bf16 and f32
formats byte for byte; F16 rows widen to f32 exactly.

    repack(raw, ggml_type, hidden) -> (format name, stored rows [R, ...] of the format's STORED_DTYPE)
        raw: uint8 [R, the file's bytes per row], the rows of one 2-D slice of a tensor
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from . import formats
from .formats import traits

F32, F16, Q4_0, Q8_0, BF16 = (GGMLQuantizationType[n] for n in ("F32", "F16", "Q4_0", "Q8_0", "BF16"))
LOSSLESS = {GGMLQuantizationType[dtype]: name for dtype, name in traits.EXACT.items()}  # ggml type -> store format
BLOCK = 32
BLOCK_BYTES = {t: GGML_QUANT_SIZES[t][1] for t in (Q8_0, Q4_0)}  # one block: the float16 scale, then the values


def ggml_type(name: str) -> GGMLQuantizationType:
    """The ggml type of a tensor type name (Q8_0, BF16, ...)."""
    return GGMLQuantizationType[name]


def file_row_bytes(ggml_type: int, hidden: int) -> int:
    """Bytes of one row of ``hidden`` values in the file (gguf's block sizes)."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    return hidden // block * size


def _name(ggml_type: int) -> str:
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"ggml type {ggml_type}"


def repack(raw: np.ndarray, ggml_type: int, hidden: int) -> tuple[str, np.ndarray]:
    """The file's rows [R, file_row_bytes] (uint8) -> (format name, the stored rows as shm.formats holds them)."""
    name = LOSSLESS.get(ggml_type)
    if name is None:
        raise ValueError(f"{_name(ggml_type)} has no lossless store format (supported: "
                         f"{', '.join(t.name for t in LOSSLESS)})")
    block = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)][0]
    if hidden % block:
        raise ValueError(f"{_name(ggml_type)} rows of {hidden} values: not a whole number of {block}-blocks")
    raw = np.ascontiguousarray(raw, np.uint8)
    R = raw.shape[0]
    if raw.shape != (R, file_row_bytes(ggml_type, hidden)):
        raise ValueError(f"{_name(ggml_type)} rows of {hidden} values take {file_row_bytes(ggml_type, hidden)} "
                         f"bytes, got {raw.shape[1]}")
    fmt = formats.get(name)
    if ggml_type == F16:
        return name, raw.view(np.float16).astype(np.float32)
    if ggml_type in (F32, BF16) or traits.BY_NAME[name].ggml is not None:  # a file format: the blocks as they are
        return name, raw.copy().view(fmt.STORED_DTYPE)
    blocks = raw.reshape(R, hidden // BLOCK, BLOCK_BYTES[ggml_type])  # [R, nb, block bytes]
    values = blocks[:, :, 2:].reshape(R, -1)  # [R, H] int8 (q8) or [R, H / 2] nibble pairs (q4)
    scales = blocks[:, :, :2].reshape(R, -1)  # [R, 2 nb] float16 bytes
    out = np.empty((R, fmt.row_bytes(hidden)), np.uint8)
    out[:, : values.shape[1]] = values
    out[:, values.shape[1]:] = scales
    return name, out


SCALE_BYTES = {GGMLQuantizationType[n]: at for n, at in (("Q4_K", (0, 2)), ("Q5_K", (0, 2)), ("Q6_K", (208,)),
                                                           ("IQ4_XS", (0,)))}  # a super-block's float16 d (, dmin)


def random_blocks(qtype: int, shape: tuple[int, ...], rng: np.random.Generator, scale: float = 1e-3) -> np.ndarray:
    """Valid random blocks (benchmarks, and tests of the types gguf.quants cannot write): any value bytes (the K
    types' packed 6-bit and int8 sub-scales too), but finite float16 super-block scales (std ``scale``), as a
    quantiser leaves them. uint8 ``shape``, its last axis whole blocks."""
    raw = rng.integers(0, 256, shape, dtype=np.uint8)
    if qtype in SCALE_BYTES:
        supers = raw.reshape(-1, GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][1])
        for at in SCALE_BYTES[qtype]:
            d = (rng.standard_normal(supers.shape[0]) * scale).astype(np.float16)
            supers[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw
