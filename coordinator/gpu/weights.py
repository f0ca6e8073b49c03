"""The model's weights on the device, each matrix in its storage format (storage.py), multiplied by our kernels.

A DeviceMatrix stands where a float32 array stood: the decoder's ``x @ w.T`` works unchanged (``.T`` gives a
transposed view whose ``__rmatmul__`` runs format_kernels), so the model code has one form for both.

    x [T, K] @ m.T -> [T, R]
        T <= BLOCKED_ROWS (64), or any T  the format's matrix x vector kernel (a warp a row), a launch for each
        batch-invariant                  block of format_kernels.MAX_TOKENS rows of x: a graph-ready step reads
                                         the compact weights, dequantises nothing, takes no scratch beyond its
                                         output; a row's sums are its own, whatever rows are beside it
        more, not invariant              tiles of vram.TILE_ROWS rows dequantised to float32 scratch, cuBLAS

Without batch invariance f32 matrices stay plain device arrays (cuBLAS reads them as they are); with it
(EngineConfig.batch_invariant) they and the routers are f32 DeviceMatrix rows for the same kernel, since
cuBLAS picks its kernels (and splits of K) by the row count. ``upload`` builds the device ModelWeights from the
host one: matrices in their formats (a GGUF file's blocks and a BF16 file's bits moved as they are, the rest
encoded from float32), vectors float32, the embedding left on the host.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from shm import formats, gguf_blocks
from shm.checkpoint import Checkpoint, is_block_dtype
from shm.expert_source import store_into
from shm.formats import traits

from . import format_kernels, storage
from .vram import TILE_ROWS
from ..model.weights import TensorSources

log = logging.getLogger(__name__)

BLOCKED_ROWS = 64  # graph_steps.MAX_ROWS: up to these rows x reads the compact rows in blocks of MAX_TOKENS


class DeviceMatrix:
    """W [R, K] on the device: R rows of ``format_kernels.row_stride(fmt, K)`` bytes, the format's stored rows."""

    __array_ufunc__ = None  # ndarray @ DeviceMatrix.T defers to __rmatmul__

    def __init__(self, fmt: str, data, shape: tuple[int, int], invariant: bool = True):
        self.fmt = fmt
        self.data = data  # device uint8 [R * stride]
        self.shape = (int(shape[0]), int(shape[1]))
        self.stride = format_kernels.row_stride(fmt, self.shape[1])
        self.invariant = invariant  # every row count through the matrix x vector kernel, never cuBLAS

    @classmethod
    def from_stored(cls, fmt: str, stored: np.ndarray, K: int, xp) -> "DeviceMatrix":
        """Host stored rows [R, row_bytes(K)] of ``fmt`` -> the device copy, rows padded to the stride."""
        rows = format_kernels.to_device_rows(fmt, stored)  # [R, stride] uint8
        return cls(fmt, xp.asarray(rows.reshape(-1)), (stored.shape[0], K))

    @classmethod
    def encode(cls, w: np.ndarray, fmt: str, xp) -> "DeviceMatrix":
        """float32 [R, K] -> the device copy in ``fmt`` (bf16 rounded to nearest even; q8, q4 quantised)."""
        stored = _stored(fmt, w.shape)
        store_into(stored, np.asarray(w, np.float32), "F32", fmt)
        return cls.from_stored(fmt, stored, w.shape[1], xp)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def T(self) -> "_Transposed":
        return _Transposed(self)

    def rows(self, start: int, stop: int) -> "DeviceMatrix":
        """Rows [start, stop) as a matrix that shares this one's memory."""
        return DeviceMatrix(self.fmt, self.data[start * self.stride : stop * self.stride], (stop - start,
                                                                                          self.shape[1]),
                            self.invariant)

    def decoded(self, out=None):
        """W as float32 [R, K] on the device (tests, MLA's absorbed decode)."""
        R, K = self.shape
        return format_kernels.dequantize(self.fmt, self.data, R, K, out=out)

    def matmul_t(self, x, bias=None, residual=None):
        """x [..., K] -> x · Wᵀ (+ bias [R]) (+ residual [..., R]): [..., R]."""
        import cupy

        R, K = self.shape
        lead = x.shape[:-1]
        x2 = cupy.ascontiguousarray(x.reshape(-1, K), dtype=np.float32)  # [T, K]
        T = x2.shape[0]
        res = None if residual is None else cupy.ascontiguousarray(residual.reshape(T, R), dtype=np.float32)
        if T <= BLOCKED_ROWS or self.invariant:  # a launch a block of MAX_TOKENS rows: a row's sums are its own
            out = format_kernels.matvec(self.fmt, self.data, R, K, x2, bias, res)
            return out.reshape(*lead, R)
        out = cupy.empty((T, R), np.float32)
        scratch = _scratch(cupy, min(TILE_ROWS, R) * K)
        for r in range(0, R, TILE_ROWS):
            n = min(TILE_ROWS, R - r)
            tile = format_kernels.dequantize(self.fmt, self.data, R, K, r, n, out=scratch[: n * K].reshape(n, K))
            out[:, r : r + n] = x2 @ tile.T  # cuBLAS on the dequantised tile
        if bias is not None:
            out += bias
        if res is not None:
            out += res
        return out.reshape(*lead, R)

    @staticmethod
    def stack(matrices: list["DeviceMatrix"], xp) -> "DeviceMatrix":
        """One matrix of the matrices' rows in order (one format, one K): the fused q, k, v projection."""
        fmt, K = matrices[0].fmt, matrices[0].shape[1]
        assert all(m.fmt == fmt and m.shape[1] == K for m in matrices)
        return DeviceMatrix(fmt, xp.concatenate([m.data for m in matrices]), (sum(m.shape[0] for m in matrices), K),
                            all(m.invariant for m in matrices))


class _Transposed:
    __array_ufunc__ = None

    def __init__(self, matrix: DeviceMatrix):
        self.matrix = matrix

    def __rmatmul__(self, x):
        return self.matrix.matmul_t(x)


_SCRATCH: dict[int, object] = {}  # id(module) -> the float32 buffer the prefill's tiles are dequantised into


def _scratch(xp, n: int):
    """A float32 device buffer of at least n values, reused by every matrix (one product runs at a time)."""
    buf = _SCRATCH.get(id(xp))
    if buf is None or buf.size < n:
        buf = _SCRATCH[id(xp)] = xp.empty(n, np.float32)
    return buf


def _stored(fmt: str, shape: tuple[int, int]) -> np.ndarray:
    f = formats.get(fmt)
    dtype = np.dtype(f.STORED_DTYPE)
    return np.empty((shape[0], f.row_bytes(shape[1]) // dtype.itemsize), dtype)


def upload_matrix(w: np.ndarray, fmt: str, xp, raw: np.ndarray | None = None, dtype: str = "F32",
                  invariant: bool = False):
    """A host matrix -> the device: a plain float32 array for f32 (f32 rows of a DeviceMatrix where
    ``invariant``), else a DeviceMatrix in ``fmt``. ``raw`` (the checkpoint's own rows of ``dtype``) is moved as
    it is where ``fmt`` holds that type exactly."""
    if fmt == "f32" and invariant:
        return DeviceMatrix.encode(np.asarray(w, np.float32), "f32", xp)
    if fmt == "f32":
        return xp.asarray(np.ascontiguousarray(w, np.float32))
    exact = raw is not None and ((is_block_dtype(dtype) and traits.EXACT.get(dtype) == fmt) or
                                 (dtype == "BF16" and fmt == "bf16"))
    if not exact:
        return DeviceMatrix.encode(w, fmt, xp)
    if fmt == "bf16":
        return DeviceMatrix.from_stored(fmt, np.ascontiguousarray(raw), w.shape[1], xp)
    stored = gguf_blocks.repack(raw, gguf_blocks.ggml_type(dtype), w.shape[1])[1]
    return DeviceMatrix.from_stored(fmt, stored, w.shape[1], xp)


def checkpoint_rows(ckpt: Checkpoint | None, source) -> tuple[np.ndarray | None, str]:
    """(the rows ``source`` (weights.RowSource) names as the checkpoint stores them, their type) where they can be
    moved as they are: a BF16 tensor's or a block type's, gathered where the loader regrouped or un-permuted them;
    (None, "F32") for a float32 one, a joined GGUF kv_b or an FP8 one (scaled per block)."""
    if ckpt is None or source is None or source.tensor not in ckpt:
        return None, "F32"
    dtype = ckpt.info(source.tensor).dtype
    if dtype != "BF16" and not is_block_dtype(dtype):
        return None, "F32"
    rows = ckpt.stored_rows(source.tensor, source.rows)
    return (None, "F32") if rows is None else (np.ascontiguousarray(rows.reshape(rows.shape[0], -1)), dtype)


def checkpoint_dtype(ckpt: Checkpoint | None, name: str | None) -> str:
    """The type the checkpoint stores ``name`` in (a joined GGUF kv_b: its parts' type, so auto keeps it
    compact); F32 when unknown."""
    if ckpt is None or name is None or name not in ckpt:
        return "F32"
    return ckpt.stored_type(name)


MATRICES = ("q", "k", "v", "o", "q_gate")  # LayerWeights' matrices (the MLP's, MLA's and linear's walked below)
LINEAR_MATRICES = ("qkv", "z", "ba", "out")  # a Gated DeltaNet layer's (its taps and per-head vectors: float32)
MLA_MATRICES = ("q", "q_a", "q_b", "kv_a", "kv_b")
ROUTERS = ("router", "shared_expert_gate")  # float32 arrays, or batch-invariant f32 rows of a DeviceMatrix


def upload(weights, xp, ckpt: Checkpoint | None = None, dense_dtype: str = formats.AUTO, invariant: bool = False):
    """The host ModelWeights -> a device one (a new object; the host one is unchanged): matrices in
    their storage formats (storage.matrix_format), everything else float32, the embedding kept on the
    host. MLA keeps kv_b alone (w_uk and w_uv are its rows: the decoder reads them from it). ``invariant``
    (EngineConfig.batch_invariant): every matrix a DeviceMatrix that takes the matrix x vector kernel at any row
    count, the routers and shared-expert gates among them."""
    uploaded: dict[int, object] = {}  # id(host array) -> device: a tied lm_head shares nothing with the host

    def matrix(w, products: bool = True):
        """``products`` False: a matrix the network never multiplies rows by (MLA's kv_b, read as w_uk and w_uv by
        the absorbed attention's kernels), left a float32 array where f32."""
        if w is None:
            return None
        if id(w) not in uploaded:
            source = weights.sources.get(w)  # a tensor, or rows of one the loader regrouped
            fmt = storage.matrix_format(checkpoint_dtype(ckpt, source and source.tensor), dense_dtype, w.shape[1])
            raw, dtype = checkpoint_rows(ckpt, source)
            uploaded[id(w)] = upload_matrix(w, fmt, xp, raw, dtype, invariant and products)
            if isinstance(uploaded[id(w)], DeviceMatrix):
                uploaded[id(w)].invariant = invariant
        return uploaded[id(w)]

    def vector(a):
        return None if a is None else xp.asarray(np.ascontiguousarray(a, np.float32))

    def mlp(m):
        return None if m is None else type(m)(**{f.name: matrix(getattr(m, f.name)) for f in dataclasses.fields(m)})

    layers = []
    for lw in weights.layers:
        rows_kernel = ROUTERS if invariant else ()  # their products too: cuBLAS's bits change with the row count
        changes = {f.name: vector(getattr(lw, f.name)) for f in dataclasses.fields(lw)  # the matrices below, once
                   if f.name not in MATRICES + rows_kernel and isinstance(getattr(lw, f.name), np.ndarray)}
        changes.update({name: matrix(getattr(lw, name)) for name in MATRICES})
        changes.update({name: DeviceMatrix.encode(getattr(lw, name), "f32", xp)
                        for name in rows_kernel if getattr(lw, name) is not None})
        changes.update(dense_mlp=mlp(lw.dense_mlp), shared_expert=mlp(lw.shared_expert))
        if lw.mla is not None:
            m = lw.mla
            changes["mla"] = dataclasses.replace(  # batch-invariant, kv_b is read only by the absorbed form
                m, **{name: matrix(getattr(m, name), name != "kv_b") for name in MLA_MATRICES},
                q_a_norm=vector(m.q_a_norm), kv_a_norm=vector(m.kv_a_norm), w_uk=None, w_uv=None)
        if lw.linear is not None:
            g = lw.linear
            changes["linear"] = dataclasses.replace(
                g, **{name: matrix(getattr(g, name)) for name in LINEAR_MATRICES},
                **{f.name: vector(getattr(g, f.name)) for f in dataclasses.fields(g) if f.name not in LINEAR_MATRICES})
        layers.append(dataclasses.replace(lw, **changes))
    return dataclasses.replace(weights, layers=layers, final_norm=vector(weights.final_norm),
                               lm_head=matrix(weights.lm_head), sources=TensorSources())


def nbytes(obj) -> int:
    """Device bytes held by a weights dataclass (nested), each array counted once."""
    seen: set[int] = set()

    def walk(o) -> int:
        if o is None or isinstance(o, (int, float, str)) or type(o) is np.ndarray or id(o) in seen:
            return 0  # host arrays (the embedding) hold no device memory
        seen.add(id(o))
        if isinstance(o, DeviceMatrix):
            return o.nbytes
        if isinstance(o, (list, tuple)):
            return sum(walk(v) for v in o)
        if hasattr(o, "__dataclass_fields__"):
            return sum(walk(getattr(o, k)) for k in o.__dataclass_fields__)
        return int(getattr(o, "nbytes", 0))

    return walk(obj)
