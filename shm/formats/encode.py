"""Compiled quantisation at fill: the same bytes as shm/formats' NumPy encoders, many times faster.

q8 and q4 are encoded in two compiled passes around one NumPy step:

    1. per block, the float32 value the scale is made from   (q8: max |w| / 127; q4: m / -8, m the
                                                               value of largest magnitude, the first one)
    2. NumPy rounds those to float16 (round to nearest even, as shm/formats does)
    3. per value, q = clip(rint(w * (1 / d)), ...) with d the float16 scale read back as float32

No fastmath: each step is the IEEE float32 operation the NumPy encoder does, so
the bytes are identical (tests/test_formats.py checks it); bf16 and f32 stay
NumPy (one vectorised bit operation or a copy). Used by the fill
(shm/expert_source.py) and the dense matrices (coordinator/host/packed.py).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..jit import CACHED

EXACT = CACHED  # no fastmath
BLOCK = 32


@njit(**EXACT)
def _q8_scale_values(src, out):  # src [R, H] float32 -> out [R, H/32] float32
    for r in range(src.shape[0]):
        for b in range(src.shape[1] // BLOCK):
            amax = np.float32(0.0)
            for j in range(BLOCK):
                amax = max(amax, abs(src[r, BLOCK * b + j]))
            out[r, b] = amax / np.float32(127.0)


@njit(**EXACT)
def _q4_scale_values(src, out):
    for r in range(src.shape[0]):
        for b in range(src.shape[1] // BLOCK):
            m = src[r, BLOCK * b]
            for j in range(1, BLOCK):
                v = src[r, BLOCK * b + j]
                if abs(v) > abs(m):  # the first of equal magnitudes, as argmax
                    m = v
            out[r, b] = m / np.float32(-8.0)


@njit(**EXACT)
def _inverse(d):
    return np.float32(1.0) / d if d != 0 else np.float32(0.0)


@njit(**EXACT)
def _q8_values(src, d, dest):  # dest [R, row_bytes] uint8: the int8 values
    for r in range(src.shape[0]):
        for b in range(src.shape[1] // BLOCK):
            inv = _inverse(d[r, b])
            for j in range(BLOCK):
                q = min(max(np.rint(src[r, BLOCK * b + j] * inv), np.float32(-127.0)), np.float32(127.0))
                dest[r, BLOCK * b + j] = np.uint8(np.int32(q) & 255)


@njit(**EXACT)
def _q4_values(src, d, dest):
    for r in range(src.shape[0]):
        for b in range(src.shape[1] // BLOCK):
            inv = _inverse(d[r, b])
            for j in range(BLOCK // 2):
                lo = min(max(np.rint(src[r, BLOCK * b + j] * inv), np.float32(-8.0)), np.float32(7.0))
                hi = min(max(np.rint(src[r, BLOCK * b + j + 16] * inv), np.float32(-8.0)), np.float32(7.0))
                dest[r, (BLOCK // 2) * b + j] = np.uint8(np.int32(lo) + 8) | (np.uint8(np.int32(hi) + 8) << np.uint8(4))


def encode_into(fmt, dest: np.ndarray, src: np.ndarray) -> None:
    """Stored rows of ``fmt`` (a shm/formats module) [R, row_bytes] <- float32 rows src [R, H]."""
    if fmt.NAME not in ("q8", "q4"):
        fmt.encode_into(dest, src)
        return
    src = np.ascontiguousarray(src, np.float32)
    R, H = src.shape
    nb = H // BLOCK
    scale_values = np.empty((R, nb), np.float32)
    (_q8_scale_values if fmt.NAME == "q8" else _q4_scale_values)(src, scale_values)
    d16 = scale_values.astype(np.float16)  # [R, nb]
    values = H if fmt.NAME == "q8" else H // 2  # bytes of values before the scales
    (_q8_values if fmt.NAME == "q8" else _q4_values)(src, d16.astype(np.float32), dest)
    dest[:, values:] = d16.view(np.uint8).reshape(R, -1)


def warm_up(name: str) -> None:
    """Compile (or load from the disk cache) format ``name``'s encoder (q8 or q4; the others are NumPy), on the
    types the fill passes: float32 rows into a store's rows."""
    from . import get

    fmt = get(name)
    encode_into(fmt, np.zeros((1, fmt.row_bytes(BLOCK)), np.uint8), np.zeros((1, BLOCK), np.float32))
