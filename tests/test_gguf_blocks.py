"""GGUF rows repacked into the stores' formats dequantise to exactly what gguf.quants reads from the file."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants

from shm import formats, gguf_blocks

H = 256


def random_rows(ggml_type: int, rows: int, rng: np.random.Generator) -> np.ndarray:
    """Valid random rows of the file: any value bytes, finite float16 scales of either sign."""
    raw = rng.integers(0, 256, (rows, gguf_blocks.file_row_bytes(ggml_type, H)), dtype=np.uint8)
    if ggml_type in gguf_blocks.BLOCK_BYTES:
        blocks = raw.reshape(rows, H // 32, gguf_blocks.BLOCK_BYTES[ggml_type])
        scales = (rng.standard_normal((rows, H // 32)) * 1e-2).astype(np.float16)
        blocks[:, :, :2] = scales.view(np.uint8).reshape(rows, H // 32, 2)
    elif ggml_type == gguf_blocks.F32:
        raw = rng.standard_normal((rows, H)).astype(np.float32).view(np.uint8)
    elif ggml_type == gguf_blocks.F16:
        raw = rng.standard_normal((rows, H)).astype(np.float16).view(np.uint8)
    return raw


@pytest.mark.parametrize("ggml_type", sorted(gguf_blocks.LOSSLESS), ids=lambda t: t.name)
def test_repacked_rows_dequantise_bit_exactly_as_gguf_reads_them(ggml_type):
    assert int(ggml_type) == {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 8, "BF16": 30}[Q(ggml_type).name]  # the file's ids
    raw = random_rows(ggml_type, 7, np.random.default_rng(ggml_type))
    name, stored = gguf_blocks.repack(raw, ggml_type, H)
    fmt = formats.get(name)
    assert stored.shape == (7, fmt.row_bytes(H) // np.dtype(fmt.STORED_DTYPE).itemsize)
    want = quants.dequantize(raw, Q(ggml_type)).astype(np.float32)  # [7, H]
    got = formats.decoded(fmt, stored)
    assert got.shape == want.shape == (7, H)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))  # every bit, the signs of zeros too


def test_types_without_a_lossless_format_and_wrong_row_sizes_are_named():
    with pytest.raises(ValueError, match="Q4_K has no lossless store format .*Q8_0"):
        gguf_blocks.repack(np.zeros((1, 144), np.uint8), int(Q.Q4_K), H)
    with pytest.raises(ValueError, match="Q8_0 rows of 256 values take 272 bytes, got 271"):
        gguf_blocks.repack(np.zeros((1, 271), np.uint8), gguf_blocks.Q8_0, H)
    with pytest.raises(ValueError, match="Q4_0 rows of 40 values: not a whole number of 32-blocks"):
        gguf_blocks.repack(np.zeros((1, 20), np.uint8), gguf_blocks.Q4_0, 40)
