"""Matrix products with weights kept on the device in the storage formats, dequantised as the kernels read them.

A matrix W [R, K] in format ``fmt`` (shm/formats: f32, bf16, q8, q4, q4k, q5k, q6k, iq4xs) is held as uint8
bytes: R stored rows (``formats.get(fmt).row_bytes(K)`` bytes each) at ``row_stride(fmt, K)``, each row padded
with zeros to 16 bytes so every row starts 16-byte aligned.

    row_stride(fmt, K)                          -> round_up(row_bytes(K), 16)
    to_device_rows(fmt, stored [R, width])      -> uint8 [R, row_stride] on the host (the caller uploads it)
    matvec(fmt, w, R, K, x [T, K], bias [R], residual [T, R])  -> [T, R] = (x Wᵀ + bias) + residual
    dequantize(fmt, w, R, K, row0, rows)        -> [rows, K], rows row0.. of W: decode_into's floats, bit for bit
    pointer_table(matrices)                     -> uint64 [E] device pointers of E matrices (for grouped_matvec)
    grouped_matvec(fmt, table, K, R, x [N, K], slot_rows [P], slot_matrix [P]) -> [P, R]:
                                                   out[p] = x[slot_rows[p]] · table[slot_matrix[p]]ᵀ, one launch

Every kernel decodes through one ``__device__`` reader per format (SOURCE's ``struct Reader_<fmt>``), which
turns a chunk of a row's weights into float32 exactly as the format's ``decode_into`` does (float16 scales
converted bit for bit, each product one rounded multiply, no fused multiply-add). matvec gives a row a warp:
the lanes stride along its chunks, accumulate the T <= MAX_TOKENS tokens' sums in float32 registers, and a
shuffle sum ends it; lane 0 adds bias and residual in that order. grouped_matvec runs the same row sum (one
token), so a slot's output equals matvec's for that row and matrix bit for bit.

Loads: 16-byte (uint4) for f32, bf16, the values of q8 and q4, and the super-blocks of q4k (144 bytes) and
q5k (176); 8-byte (uint2) for iq4xs (136-byte super-blocks), 2-byte for q6k (210) and q8/q4's scale runs.
"""

from __future__ import annotations

import functools

import numpy as np

from shm import formats
from shm.formats import iq4xs, traits

from . import kernels
from .transfer import device_address

MAX_TOKENS = 8  # rows of x a matvec launch takes: one float32 sum each in every lane's registers
WARPS = 4  # output rows a block, a warp each
ALIGN = 16  # bytes: every stored row on the device starts at a multiple

_BODY = kernels.source("formats")


# one plain extern "C" declaration a kernel and format: NVRTC and tests/cuda_emulator.py's parser both see them
_WRAPPERS = kernels.template("formats_wrappers")

FORMATS = tuple(t.name for t in traits.TRAITS)  # each has its Reader_<name> in formats.cu (a test holds it)
_IQ4NL = [sum((v & 255) << 8 * i for i, v in enumerate(iq4xs.KVALUES[h:h + 8])) for h in (0, 8)]
SOURCE = (_BODY.replace("@MAX_TOKENS@", str(MAX_TOKENS)).replace("@IQ4NL_LO@", hex(_IQ4NL[0]))
          .replace("@IQ4NL_HI@", hex(_IQ4NL[1])) + "".join(_WRAPPERS.replace("@F@", f) for f in FORMATS))


@functools.lru_cache(maxsize=None)
def cuda_module():
    import cupy

    return cupy.RawModule(code=SOURCE, options=("--std=c++14",))  # NVRTC; CuPy keeps the binary on disk


@functools.lru_cache(maxsize=None)
def _kernel(name: str):
    return cuda_module().get_function(name)


def row_stride(fmt: str, K: int) -> int:
    """Bytes from one device row of a [R, K] matrix in ``fmt`` to the next: its stored row rounded up to 16."""
    return -(-formats.get(fmt).row_bytes(K) // ALIGN) * ALIGN


def to_device_rows(fmt: str, stored: np.ndarray) -> np.ndarray:
    """Stored rows [R, width] (the format's STORED_DTYPE) -> uint8 [R, row_stride], each row's padding zero."""
    raw = np.ascontiguousarray(stored).view(np.uint8).reshape(stored.shape[0], -1)  # [R, row_bytes]
    out = np.zeros((raw.shape[0], -(-raw.shape[1] // ALIGN) * ALIGN), np.uint8)
    out[:, : raw.shape[1]] = raw
    return out


def address(a) -> int:
    """A device array's address (the emulator's: its NumPy memory's)."""
    return device_address(a)


def upload_index(index: np.ndarray):
    """A host int32 table onto the device (made at load, outside any step's buffer)."""
    import cupy

    return cupy.asarray(np.ascontiguousarray(index, dtype=np.int32))


def pointer_table(arrays):
    """Device uint64 [E]: the base addresses of E device matrices (uint8, C-contiguous, 16-byte aligned), for
    grouped_matvec. The table holds no reference: the matrices must outlive its use."""
    import cupy

    addresses = []
    for a in arrays:
        if a.dtype != np.uint8 or not a.flags.c_contiguous or address(a) % ALIGN:
            raise ValueError("a device matrix is contiguous uint8 starting 16-byte aligned")
        addresses.append(address(a))
    return cupy.asarray(np.array(addresses, np.uint64))


def _stride(fmt: str, K: int) -> int:
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} has no device reader; those with one: {', '.join(FORMATS)}")
    block = formats.get(fmt).BLOCK
    if K % block:
        raise ValueError(f"{fmt} rows are blocks of {block} weights; K = {K} is not a multiple")
    return row_stride(fmt, K)


def _matrix(fmt: str, w, R: int, K: int) -> tuple[object, int]:
    """w as a flat uint8 array checked to hold R rows at row_stride, and that stride."""
    stride = _stride(fmt, K)
    if w.dtype != np.uint8 or not w.flags.c_contiguous or w.size < R * stride or address(w) % ALIGN:
        raise ValueError(f"w must be contiguous uint8 of at least {R} x {stride} bytes, 16-byte aligned")
    return w.reshape(-1), stride


def _f32(a):
    import cupy

    return cupy.ascontiguousarray(cupy.asarray(a, dtype=np.float32))


def _output(out, shape: tuple[int, int]):
    import cupy

    if out is None:
        return cupy.empty(shape, np.float32)
    if out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"out must be C-contiguous float32 {shape}")
    return out


def matvec(fmt: str, w, R: int, K: int, x, bias=None, residual=None, out=None):
    """x [T, K] float32 by W [R, K] (w: its device rows) -> out [T, R] = (x Wᵀ + bias) + residual, bias [R] and
    residual [T, R] optional (residual may be out itself). A launch takes MAX_TOKENS rows of x."""
    w, stride = _matrix(fmt, w, R, K)
    x = _f32(x).reshape(-1, K)  # [T, K]
    T = x.shape[0]
    out = _output(out, (T, R))
    b = _f32(bias).reshape(R) if bias is not None else out  # where absent, any pointer: not read
    res = _f32(residual).reshape(T, R) if residual is not None else out
    for t in range(0, T if R else 0, MAX_TOKENS):
        n = min(MAX_TOKENS, T - t)
        _kernel(f"strata_matvec_{fmt}")((-(-R // WARPS),), (WARPS * 32,), (
            w, np.int64(stride), np.int32(R), np.int32(K), x[t : t + n], np.int32(n), b, np.int32(bias is not None),
            res[t : t + n], np.int32(residual is not None), out[t : t + n]))
    return out


ABSORB_ROWS = 8  # formats.cu's ABSORB_ROWS: tokens a strata_absorb_rows block


def absorb_rows(fmt: str, w, heads: int, head_rows: int, n: int, K: int, x, x_row: int, x_head: int, T: int, out):
    """out [T * heads, K] (C-contiguous float32): row t * heads + h = sum over d < n of x[t, h, d] times stored
    row h * head_rows + d of W [heads * head_rows, K] (w: its device rows), in d order; x's row t head h at
    x + t * x_row + h * x_head (floats). MLA's q · W_uk read from a compact kv_b."""
    w, stride = _matrix(fmt, w, heads * head_rows, K)
    if T and heads and K:
        _kernel(f"strata_absorb_rows_{fmt}")((heads * -(-T // ABSORB_ROWS),), (WARPS * 32,), (
            w, np.int64(stride), np.int32(head_rows), np.int32(n), np.int32(K), x, np.int64(x_row),
            np.int64(x_head), np.int32(T), np.int32(heads), out), shared_mem=ABSORB_ROWS * n * 4)
    return out


def head_rows_matvec(fmt: str, w, heads: int, head_rows: int, first: int, R: int, K: int, x, out=None):
    """x [rows, K] -> out [rows, R]: row r times rows first .. first + R of head r % heads' block of head_rows
    stored rows of W [heads * head_rows, K] (grouped_matvec's sums). MLA's out_lat · W_uvᵀ from a compact kv_b."""
    w, stride = _matrix(fmt, w, heads * head_rows, K)
    x = _f32(x).reshape(-1, K)
    out = _output(out, (x.shape[0], R))
    if x.shape[0] and R:
        _kernel(f"strata_head_rows_matvec_{fmt}")((x.shape[0] * -(-R // WARPS),), (WARPS * 32,), (
            w, np.int64(stride), np.int32(head_rows), np.int32(first), np.int32(R), np.int32(K), x,
            np.int32(heads), out))
    return out


def dequantize(fmt: str, w, R: int, K: int, row0: int = 0, rows: int | None = None, out=None):
    """Rows [row0, row0 + rows) of W [R, K] (w: its device rows) -> float32 [rows, K]."""
    w, stride = _matrix(fmt, w, R, K)
    rows = R - row0 if rows is None else rows
    if row0 < 0 or rows < 0 or row0 + rows > R:
        raise ValueError(f"rows [{row0}, {row0 + rows}) are not within the matrix's {R}")
    out = _output(out, (rows, K))
    if rows and K:
        _kernel(f"strata_dequantize_{fmt}")((-(-rows // WARPS),), (WARPS * 32,), (
            w[row0 * stride :], np.int64(stride), np.int32(rows), np.int32(K), out))
    return out


def grouped_matvec(fmt: str, table, K: int, R: int, x, slot_rows, slot_matrix, out=None):
    """out [P, R]: slot p multiplies x [N, K]'s row slot_rows[p] by matrix table[slot_matrix[p]] ([R, K] in
    ``fmt`` at row_stride; table from pointer_table), all slots one launch. Indices are not checked."""
    import cupy

    stride = _stride(fmt, K)
    x = _f32(x).reshape(-1, K)
    slot_rows = cupy.ascontiguousarray(cupy.asarray(slot_rows, dtype=np.int32))  # [P]
    slot_matrix = cupy.ascontiguousarray(cupy.asarray(slot_matrix, dtype=np.int32))
    if table.dtype != np.uint64 or slot_matrix.shape != slot_rows.shape:
        raise ValueError("table is uint64 device pointers; slot_rows and slot_matrix are [P] each")
    P = slot_rows.size
    out = _output(out, (P, R))
    if P and R:
        _kernel(f"strata_grouped_matvec_{fmt}")((P * -(-R // WARPS),), (WARPS * 32,), (
            cupy.ascontiguousarray(table), np.int64(stride), np.int32(R), np.int32(K), x, slot_rows, slot_matrix,
            out))
    return out
