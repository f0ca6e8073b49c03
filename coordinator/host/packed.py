"""Dense matrices of the CPU device side stored in an expert format (``dense_dtype``).

Without a GPU the coordinator's device side is NumPy, and each decode step
reads every dense matrix once: attention, the dense and shared MLPs and, the
largest, the lm_head ([V, H]: 1.2 GB a token at float32 for a 152k vocabulary).
llama.cpp keeps these quantised as the file gives them; ``dense_dtype`` does
the same here: the matrix is stored once in a shm/formats format and
multiplied by the same compiled row loops as the experts
(node_worker/kernels/dense.py). The router, the norms and the embedding stay
float32: they are small, or read one row at a time.

With batch-invariant numerics (EngineConfig.batch_invariant, the default) every matrix is multiplied by loops
that sum a row in one order whatever the row count (never BLAS, whose kernels change with it): the matrices
that stay float32 are kept as f32 rows for them, and the host's whole experts too.

A PackedMatrix stands where the float32 array stood: the decoder's
``x @ w.T`` works unchanged (``.T`` gives a transposed view whose
``__rmatmul__`` runs the kernel), so the model code has one form for both.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from node_worker.kernels import dense, rows8, simd
from node_worker.kernels.dense import ONE_ROW_LOOPS, ROW_GROUPS, ROW_PLAIN, ROW_SUPER, SERIAL
from node_worker.kernels.kernel_set import KernelSet, loop_name
from node_worker.kernels.rows import FORMAT_IDS, GROUPED_FROM, SUPER_IDS, WIDE_IDS
from shm import formats
from shm.expert_store import aligned_buffer
from shm.formats import traits
from shm.formats.encode import encode_into
from shm.huge_pages import advised_copy, advised_empty
from shm.jit_entry import entry_point

from . import ops as host_ops

F32 = formats.get("f32")  # float32 rows: what a matrix that stays float32 is kept as for the invariant loops

BLOCK_IDS = tuple(FORMAT_IDS[name] for name in traits.BLOCK_INT_LOOPS)  # q8, q4: iblock.py's prefill loop

FEW_TOKENS = 8  # up to this many rows of x: the row loops; more: decoded tiles of TILE rows and BLAS
# a K type's or IQ4_XS's integer loop (isuper.py) below this many rows of x, BLAS on decoded tiles from it on:
# the integer loop is the faster up to about this many tokens.
INT_TOKENS = 96
# q8's and q4's (iblock.py): BLAS on decoded tiles overtakes iblock's loop at fewer tokens than isuper's
BLOCK_INT_TOKENS = 48
TILE = 512  # rows of W decoded at once for BLAS (2-8 MB of float32)
# RowExactMatrix's products of at least this many multiply-adds take linear_rows_parallel (a prompt's); fewer, the
# serial loop, which a decode step's router (128 x 2048 a token) runs in less time than a parallel region starts
PARALLEL_ROWS_MACS = 1 << 20
# f32 and bf16 matrices by this many tokens or more, on a host with 512-bit vectors (simd.WIDE_TILES): the experts'
# prefill loop (dense.matmul_tiles, four rows by four tokens) in place of the row loops and of BLAS on decoded tiles.
# bf16 rows by bf16 activations (bf16_products) take it on every host (BLAS would multiply float32 activations)
WIDE_TILE_TOKENS = 3
# q8 with integer activations in whole groups of 8 rows: stored interleaved (rows8.py) and taken by its loop for
# every T, in place of isimd's and iblock's loops and of BLAS: faster at prefill, no slower at decode.
GROUPED = ("q8",)
# q4 matrices of whole groups of 8 rows with integer activations stay row-major (decode's isimd loop reads them so)
# and from rows.GROUPED_FROM tokens on are interleaved on the fly, values unsigned (rows8.matmul_rows_by_eight), in
# place of iblock's loop and of BLAS from BLOCK_INT_TOKENS on, which it outruns at 8 tokens and matches at 64.
# A matrix of fewer bytes takes its one-row loop on the calling thread (dense.SERIAL): its read takes less time
# than a parallel region's start
SERIAL_BYTES = 1 << 17


def kernel_set(format_name: str, int_act: bool, bf16_products: bool) -> KernelSet:
    """The loops a matrix stored in shm format ``format_name`` is multiplied with (node_worker/kernels/dense.py):
    its format's alone, so each format's dense kernels compile once, whatever the model mixes them with."""
    return KernelSet.of([loop_name(format_name, bf16_products)], int_act)


class _StandsForArray:
    """What a matrix that stands where a float32 W [R, K] stood shares: ``x @ m.T`` runs its ``matmul_t``."""

    __array_ufunc__ = None  # ndarray @ m.T defers to __rmatmul__ instead of converting

    @property
    def T(self) -> _Transposed:
        return _Transposed(self)


class PackedMatrix(_StandsForArray):
    """W [R, K] in a storage format; ``x @ packed.T`` = x · Wᵀ."""

    def __init__(self, fmt: ModuleType, stored: np.ndarray, shape: tuple[int, int], int_act: bool = False,
                 bf16_products: bool = False, invariant: bool = True):
        self.fmt = fmt
        self.int_act = int_act  # integer dot products on quantised activations (isimd.py; several tokens: isuper.py)
        self.invariant = invariant  # every row count takes loops that sum a row in one order: never BLAS
        self.bf16_products = bf16_products and fmt.NAME == "bf16"  # by bf16 activations (bf16dp.py)
        self.shape = shape  # [R, K]
        self.row_bytes = fmt.row_bytes(shape[1])
        self.grouped = int_act and fmt.NAME in GROUPED and shape[0] % rows8.GROUP_ROWS == 0
        if self.grouped:  # the same bytes, eight rows interleaved, straight into the advised memory
            rows = np.ascontiguousarray(stored).view(np.uint8).reshape(shape[0], -1)
            self.data = rows8.interleave(rows, shape[1], advised_empty(rows.nbytes))
        else:
            self.data = advised_copy(stored)  # [R * row_bytes] in huge pages where the kernel gives them
        self.fmt_id = FORMAT_IDS[loop_name(fmt.NAME, self.bf16_products)]
        self.kernels = kernel_set(fmt.NAME, int_act, bf16_products)  # its format's loops alone: compiled per format
        self._one_row = None  # the one-row loop with this matrix's arguments bound (_bind_one_row), at first use

    @classmethod
    def encode(cls, w: np.ndarray, fmt: ModuleType, int_act: bool = False, bf16_products: bool = False,
               invariant: bool = True) -> PackedMatrix:
        R, K = w.shape
        stored = np.empty((R, fmt.row_bytes(K) // np.dtype(fmt.STORED_DTYPE).itemsize), fmt.STORED_DTYPE)
        for r in range(0, R, 4 * TILE):  # float32 copies of a few tiles at a time, not of the whole matrix
            encode_into(fmt, stored[r:r + 4 * TILE], np.asarray(w[r:r + 4 * TILE], np.float32))
        return cls(fmt, stored, (R, K), int_act, bf16_products, invariant)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def decoded(self) -> np.ndarray:
        """W as float32 [R, K] (tests, and the reference computations)."""
        out = np.empty(self.shape, np.float32)
        rows = rows8.rows_of(self.data, *self.shape).reshape(-1) if self.grouped else self.data
        dense.decode_rows(self.kernels, self.fmt_id, rows, 0, self.row_bytes, 0, out)
        return out

    def matmul_t(self, x: np.ndarray) -> np.ndarray:
        """x [..., K] -> x · Wᵀ [..., R]."""
        R, K = self.shape
        if type(x) is np.ndarray and x.shape == (1, K) and x.dtype == np.float32 and x.flags.c_contiguous:
            out = np.empty((1, R), np.float32)  # a decode step's row: the one-row loop, bound once
            (self._one_row or self._bind_one_row(x, out))(x, out)
            return out
        x2 = np.ascontiguousarray(x.reshape(-1, K), np.float32)  # [T, K]
        return self._product(x2, x2.shape[0]).reshape(*x.shape[:-1], R)

    @property
    def one_row_kind(self) -> int:
        """The loop one row of x takes (ONE_ROW_LOOPS): the one place that choice is made, for matmul_t's row and
        the host's attention block (host/blocks.py) alike."""
        kind = ROW_GROUPS if self.grouped else ROW_SUPER if self.int_act and self.fmt_id in SUPER_IDS else ROW_PLAIN
        return kind + SERIAL if self.nbytes < SERIAL_BYTES else kind

    @property
    def one_row_args(self) -> tuple:
        """The one-row loop's matrix arguments as host/blocks.py passes them: (kernels, format id, data, row
        bytes, R, K)."""
        return self.kernels, self.fmt_id, self.data, self.row_bytes, *self.shape

    def _bind_one_row(self, x: np.ndarray, out: np.ndarray):
        """The loop _product takes for one row, its matrix arguments bound: (x [1, K], out [1, R]) -> None, x and
        out float32 C-contiguous as these (matmul_t checks x; out it makes): the compiled entry point for their
        types, called without numba's dispatch (shm/jit_entry.py)."""
        R, K = self.shape
        kind = self.one_row_kind
        if kind % SERIAL == ROW_GROUPS:
            bound = (self.kernels, self.data, R, K)
        else:
            bound = (self.kernels, self.fmt_id, self.data, 0, self.row_bytes, R, K)
        self._one_row = functools.partial(entry_point(ONE_ROW_LOOPS[kind], bound + (x, out)), *bound)
        return self._one_row

    def _product(self, x2: np.ndarray, T: int) -> np.ndarray:
        """x2 [T, K] · Wᵀ -> [T, R], by the loop this matrix takes for T rows (the module's constants)."""
        R, K = self.shape
        out = np.empty((T, R), np.float32)
        if T == 1:  # one row: the loop _bind_one_row chose, the one place that choice is made
            (self._one_row or self._bind_one_row())(x2, out)
            return out
        if self.grouped:
            rows8.matmul_groups(self.kernels, self.data, R, K, x2, out)
            return out
        int_block = self.int_act and self.fmt_id in BLOCK_IDS
        int_super = self.int_act and self.fmt_id in SUPER_IDS
        if int_block and R % rows8.GROUP_ROWS == 0 and T >= GROUPED_FROM:
            # q4's rows eight at a time, interleaved on the fly
            rows8.matmul_rows_by_eight(self.kernels, self.fmt_id, self.data, self.row_bytes, R, K, x2, out)
            return out
        if (int_super and (T < INT_TOKENS or self.invariant)) or (
                int_block and 1 < T and (T < BLOCK_INT_TOKENS or self.invariant)):
            return self._integer_tokens(x2, T, int_super)  # q8's and q4's one token: matmul_rows
        wide = self.fmt_id in WIDE_IDS and (simd.WIDE_TILES or self.bf16_products or self.invariant)
        if wide and T >= WIDE_TILE_TOKENS:
            rows = -(-T // 4) * 4
            padded = aligned_buffer(rows * K * 4).view(np.float32).reshape(rows, K)  # [T rounded up to 4, K]
            padded[:T] = x2
            padded[T:] = 0
            tiles = np.empty((padded.shape[0], R + 1), np.float32)
            dense.matmul_tiles(self.kernels, self.fmt_id, self.data, 0, self.row_bytes, R, K, padded, tiles)
            out[:] = tiles[:T, :R]
        elif T <= FEW_TOKENS or self.invariant:  # the invariant form: a token at a time through the rows' loops
            dense.matmul_rows(self.kernels, self.fmt_id, self.data, 0, self.row_bytes, R, K, x2, out)
        else:
            tile = np.empty((min(TILE, R), K), np.float32)
            for r in range(0, R, TILE):
                n = min(TILE, R - r)
                dense.decode_rows(self.kernels, self.fmt_id, self.data, 0, self.row_bytes, r, tile[:n])
                np.matmul(x2, tile[:n].T, out=out[:, r:r + n])
        return out

    def _integer_tokens(self, x2: np.ndarray, T: int, int_super: bool) -> np.ndarray:
        """The integer loops for several tokens (isuper.py, iblock.py) -> [T, R]."""
        R, K = self.shape
        padded = x2
        if T > 1 and T % 4 == 1 and int_super:  # isuper's tiles: 8, 4, 3 or 2 tokens
            padded = np.zeros((T + 3, K), np.float32)
            padded[:T] = x2
        out = np.empty((padded.shape[0], R), np.float32)
        dense.matmul_tokens_int(self.kernels, self.fmt_id, self.data, 0, self.row_bytes, R, K, padded, out)
        return out[:T]


class RowExactMatrix(_StandsForArray):
    """A float32 W [R, K] whose ``x @ m.T`` gives each row of x the same bits whatever rows are beside it
    (host/ops.linear_rows): the routers and the shared expert's one-row gate, whose BLAS products change in
    their last bits with the row count, and with them which experts a near tie routes to (issue 62)."""

    def __init__(self, w: np.ndarray):
        self.wt = np.ascontiguousarray(np.asarray(w, np.float32).T)  # [K, R]: linear_rows' form, a copy
        self.shape = w.shape
        self._one_row = None  # decode's linear_rows (x [1, K], wt, out [1, R]): its entry point, taken once

    @property
    def nbytes(self) -> int:
        return self.wt.nbytes

    def matmul_t(self, x: np.ndarray) -> np.ndarray:
        """x [..., K] -> x · Wᵀ [..., R]."""
        R, K = self.shape
        x2 = np.ascontiguousarray(x.reshape(-1, K), np.float32)  # [T, K]
        out = np.empty((x2.shape[0], R), np.float32)
        if x2.shape[0] == 1 and R * K < PARALLEL_ROWS_MACS:  # decode's row, without numba's dispatch
            if self._one_row is None:
                self._one_row = entry_point(host_ops.linear_rows, (x2, self.wt, out))
            self._one_row(x2, self.wt, out)
            return out.reshape(*x.shape[:-1], R)
        loop = host_ops.linear_rows_parallel if x2.shape[0] * R * K >= PARALLEL_ROWS_MACS else host_ops.linear_rows
        loop(x2, self.wt, out)
        return out.reshape(*x.shape[:-1], R)


def rows_exact(weights) -> None:
    """The routers and shared-expert gates of the host's weights (the MTP layer's too) as RowExactMatrix, in
    place."""
    layers = list(weights.layers) + ([weights.mtp.layer] if weights.mtp is not None else [])
    for layer in layers:
        for name in ("router", "shared_expert_gate"):
            w = getattr(layer, name)
            if isinstance(w, np.ndarray):
                setattr(layer, name, RowExactMatrix(w))


class _Transposed:
    __array_ufunc__ = None

    def __init__(self, matrix: _StandsForArray):
        self.matrix = matrix

    def __rmatmul__(self, x: np.ndarray) -> np.ndarray:
        return self.matrix.matmul_t(x)


def file_blocks(ckpt, source, shape: tuple[int, int], how: Packing) -> PackedMatrix | None:
    """The matrix ``source`` (weights.RowSource: a tensor of a GGUF file, or rows of one the loader regrouped) kept
    as the file's quantised blocks (Q8_0, Q4_0, the K types, IQ4_XS: shm.gguf_blocks' lossless formats), its rows
    gathered where the loader regrouped or un-permuted them; or None: not a GGUF file, a float type, a type no
    format keeps, or rows the file does not store (deepseek2's kv_b_proj, put back together)."""
    from shm.gguf_blocks import ggml_type, repack

    if not hasattr(ckpt, "file"):
        return None
    dtype = ckpt.info(source.tensor).dtype  # a GGUF tensor's type name is always ggml's
    kept = traits.EXACT.get(dtype)
    if kept is None or traits.BY_NAME[kept].integer is None:  # float types are packed as --dense-dtype says
        return None
    rows = ckpt.stored_rows(source.tensor, source.rows)
    if rows is None:
        return None
    fmt_name, stored = repack(np.ascontiguousarray(rows), ggml_type(dtype), shape[1])
    return PackedMatrix(formats.get(fmt_name), stored, shape, how.int_act, invariant=how.invariant)


def dense_matrices(weights) -> list[tuple[object, str]]:
    """Every dense matrix of the host's weights as (the object holding it, its field): attention's (MLA's and the
    Gated DeltaNet's among them), the dense and shared MLPs', the MTP layer's, the lm_head. The router and the
    shared expert's one-row gate are read as float32 (llama-quantize keeps them so), the embedding a row at a time.
    MLA's kv_b put back together from a file's attn_k_b (transposed) and attn_v_b has no rows of the file's and
    stays float32 (counted so), as do its per-head views w_uk and w_uv that the absorbed decode multiplies by."""
    out: list[tuple[object, str]] = []
    layers = list(weights.layers) + ([weights.mtp.layer] if weights.mtp is not None else [])
    for layer in layers:
        out += [(layer, name) for name in ("q", "k", "v", "o", "q_gate")]
        for part, names in ((layer.mla, ("q", "q_a", "q_b", "kv_a", "kv_b")), (layer.linear, ("qkv", "z", "ba", "out")),
                            (layer.dense_mlp, ("gate", "up", "down")), (layer.shared_expert, ("gate", "up", "down"))):
            if part is not None:
                out += [(part, name) for name in names]
    if weights.mtp is not None:
        out.append((weights.mtp, "eh_proj"))
    return out + [(weights, "lm_head")]


@dataclass(frozen=True)
class Packing:
    """How the host's matrices are multiplied: ``int_act`` integer dot products on quantised activations (activations
    q8 or bf16); ``bf16_products`` bf16 rows by activations rounded to bf16 (activations bf16); ``invariant`` the
    loops that sum a row in one order for every row count (EngineConfig.batch_invariant), float32 matrices packed
    as f32 rows for them rather than left to BLAS."""

    int_act: bool = False
    bf16_products: bool = False
    invariant: bool = True


def pack_dense(weights, fmt: ModuleType | None, how: Packing = Packing(), ckpt=None) -> tuple[int, str, list[KernelSet]]:
    """Store the model's dense matrices (dense_matrices) in ``fmt``, in place; returns their bytes, how many are in
    each format ("14 q4k, 3 q6k") and the kernel sets they are multiplied with (one per format). A matrix whose rows
    do not fall on the format's blocks stays float32 (as f32 rows where ``how.invariant``). ``fmt`` None
    (dense_dtype auto): each matrix as ``ckpt``, a GGUF file, has it quantised (file_blocks), as llama.cpp reads
    them; the others stay float32."""
    total = 0
    count: dict[str, int] = {}
    kernels: dict[KernelSet, None] = {}  # in first-use order
    done: dict[int, object] = {}  # id(float32 matrix) -> what stands for it (the MTP layer may share the lm_head)

    def packed(w: np.ndarray) -> PackedMatrix | None:
        if fmt is None:
            source = weights.sources.get(w)
            p = None if source is None or ckpt is None else file_blocks(ckpt, source, w.shape, how)
        else:
            p = PackedMatrix.encode(w, fmt, how.int_act, how.bf16_products, how.invariant) \
                if w.shape[1] % fmt.BLOCK == 0 else None
        if p is None and how.invariant:
            p = PackedMatrix.encode(w, F32, how.int_act, False, True)
        return p
    def store(w):
        """w packed (or itself, as it stays), counted once."""
        nonlocal total
        if id(w) in done:
            return done[id(w)]
        p = packed(w) if isinstance(w, np.ndarray) and w.ndim == 2 else None
        total += (p or w).nbytes
        key = p.fmt.NAME if p is not None else "f32"
        count[key] = count.get(key, 0) + 1
        if p is not None:
            kernels[p.kernels] = None
        done[id(w)] = p or w
        return p or w

    for obj, name in dense_matrices(weights):
        if getattr(obj, name) is not None:
            setattr(obj, name, store(getattr(obj, name)))
    if weights.mtp is not None and id(weights.mtp.head) in done:  # the MTP head is the model's lm_head
        weights.mtp.head = done[id(weights.mtp.head)]
    return (total, ", ".join(f"{n} {name}" for name, n in sorted(count.items(), key=lambda kv: -kv[1])),
            list(kernels))


def float_rows_kernels(ckpt, dense_dtype: str, invariant: bool, gpu: bool) -> list[KernelSet]:
    """The f32 rows' kernel set where a model's dense matrices will stay float32 on the host and so, batch-invariant,
    be packed as f32 rows (a safetensors checkpoint's with dense_dtype auto, or dense_dtype f32): a unit to compile
    with the engine's first ones, from the checkpoint's index alone. A GGUF file keeps its blocks (a float matrix
    of it, rare, compiles the set when it is packed)."""
    if gpu or not invariant or not (dense_dtype == "f32" or (dense_dtype == formats.AUTO and not hasattr(ckpt, "file"))):
        return []
    return [kernel_set(F32.NAME, False, False)]


def pack_experts(experts: dict, int_act: bool) -> tuple[dict, list[KernelSet]]:
    """The device side's whole float32 experts ((layer, e) -> MLPWeights) with their matrices as f32 rows (the
    invariant loops), and the kernel set they take."""
    out = {key: dataclasses.replace(mlp, **{name: PackedMatrix.encode(getattr(mlp, name), F32, int_act)
                                             for name in ("gate", "up", "down")})
           for key, mlp in experts.items()}
    first = next(iter(out.values()))
    return out, [first.gate.kernels]
