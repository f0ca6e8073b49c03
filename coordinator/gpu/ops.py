"""Fused CuPy kernels for the decoder's small per-row ops: one launch where CuPy's array calls take five to ten.

At decode a layer's rows are one token, so the device side is bound by calls, not
arithmetic: each CuPy call costs tens of microseconds on the host whatever its size,
and rms_norm, RoPE, the masked softmax, the router and silu take several calls each.
Each of those is one kernel here (the router's is coordinator/gpu/router.py's, the
host's bits); ops.py calls them for CuPy arrays and keeps its NumPy forms (and host_ops'
compiled loops) for the host. Results equal the NumPy forms to float32 rounding
(tests/test_gpu.py, against float64). A layer's attention is one launch too (CuPy's
batched matmuls over broadcast, transposed operands cost more than the projections):
one launch for up to ops.DEVICE_ATTENTION_TOKENS query tokens, q/k norm and RoPE one
launch each reading the fused QKV output in place (decoder.fuse_qkv: one matmul
for the three projections), and each residual add joins the norm after it.
DeepSeek's multi-head latent attention takes three launches (the absorbed form) and its
interleaved RoPE one. A KV cache may hold bf16: CuPy has no such dtype, so its values are
uint16 arrays of the bits (a float32's top half, shm/formats/bf16's rounding), written by
to_bf16 and read by the attention kernels, which widen them exactly.
Those kernels were written without a GPU at hand: tests/test_device_kernels.py
checks them against float64 through tests/cuda_emulator.py (the same source
built for the CPU) and, on a GPU, through CuPy.

    rms_norm(x [..., D], weight [D], eps)             -> [..., D]    one block a row
    add_rms_norm(h, delta [..., D], weight, eps)      -> (h + delta, rms_norm(h + delta))
    apply_rope(x [T, heads, hd], cos [T, d], sin)     -> [T, heads, hd], d <= hd (the rest passed through)
    norm_rope(x [T, heads, hd], weight|None, eps, cos, sin) -> apply_rope(rms_norm(x)), x's rows may lie apart
    apply_rope_interleaved(x [T, heads, d], cos [T, d], sin) -> [T, heads, d]   x's rows and heads may lie apart
    masked_softmax(scores [R, T, S], mask [T, S], s)  -> softmax(where(mask, scores * s, -inf)) over S
    gqa_attention(q [T, nh, hd], k/v [S, nkv, hd], mask [T, S], s) -> [T, nh*hd]   one block a (token, head)
    gqa_attention_cached(q [Nq, nh, hd], tables, window, s, ...) -> [Nq, nh*hd]  the same, each query over its
                                                      sequence's cache, lengths and mask read on the device
    kv_store(k [N, ...], v [N, ...], k_ptrs, v_ptrs, row_seq, row_pos, bf16)  each row into its sequence's cache
    mla_attention_absorbed(MlaRows(q_nope [T, nh, dn], q_rope [T, nh, dr], latent [S, c], k_rope [S, dr]),
                           w_uk [nh, dn, c], w_uv_t [nh, c, dv], mask [T, S], s) -> [T, nh*dv]
    mla_attention_absorbed_cached(q_nope [Nq, nh, dn], q_rope, tables, w_uk, w_uv_t, s, max_keys, bf16)
                                                      -> [Nq, nh*dv]  the same over each query's sequence's cache
    gated_delta(qkv [N, C], z [N, Hv dv], ba [N, 2Hv], taps, a_neg, dt_bias, norm, eps, tables, slot, dims) -> [N, Hv dv]
                                                      Qwen3-Next's Gated DeltaNet step, a block a (sequence, head)
    silu_mul(g, u)                                    -> g * sigmoid(g) * u, elementwise
    to_bf16(x [...], out=None)                        -> bf16 bits, uint16 [...] (out: a cache's rows, in place)
    from_bf16(bits [...])                             -> float32 [...], exact

All take float32 arrays (mask: bool; the attentions' k/v, latent/k_rope: float32 or
bf16 bits) and return new C-contiguous arrays; the joined kernels repeat the separate
ones' arithmetic, so their results are equal, and a bf16 cache's attention equals the
float32 kernel's on the widened values.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from ..model.ops import MlaRows
from . import format_kernels
from . import kernels

THREADS = 128  # a block per row; a multiple of the warp, as the shuffle reductions need

_SOURCE = kernels.source("ops")


@functools.lru_cache(maxsize=None)
def _kernel(name: str):
    return cuda_module().get_function(name)


@functools.lru_cache(maxsize=None)
def cuda_module():
    import cupy

    return cupy.RawModule(code=_SOURCE, options=("--std=c++14",))  # NVRTC; CuPy keeps the binary on disk


def _contiguous_f32(a):
    import cupy

    return cupy.ascontiguousarray(a, dtype=np.float32)


def _elementwise_grid(n: int) -> tuple[tuple[int], tuple[int]]:
    return ((n + 255) // 256,), (256,)


def rms_norm(x, weight, eps: float):
    import cupy

    x = _contiguous_f32(x)
    D = x.shape[-1]
    out = cupy.empty_like(x)
    rows = x.size // D if D else 0
    if rows:
        _kernel("strata_rms_norm")((rows,), (THREADS,), (x, _contiguous_f32(weight), np.float32(eps), np.int32(D), out))
    return out


def masked_softmax(scores, mask, scale: float):
    """scores [..., T, S] float32, mask [T, S] bool -> softmax over S of where(mask, scores * scale, -inf)."""
    import cupy

    scores = _contiguous_f32(scores)
    T, S = scores.shape[-2:]
    out = cupy.empty_like(scores)
    rows = scores.size // S if S else 0
    if rows:
        m = cupy.ascontiguousarray(mask, dtype=cupy.bool_)
        _kernel("strata_masked_softmax")((rows,), (THREADS,), (scores, m, np.float32(scale), np.int32(T),
                                                               np.int32(S), out))
    return out


def apply_rope(x, cos, sin):
    """x [T, heads, hd]; cos, sin [T, d] with d <= hd, d even: norm_rope's kernel without the norm."""
    return norm_rope(x, None, 0.0, cos, sin)


def silu_mul(g, u):
    import cupy

    g, u = _contiguous_f32(g), _contiguous_f32(u)
    out = cupy.empty_like(g)
    if g.size:
        grid, block = _elementwise_grid(g.size)
        _kernel("strata_silu_mul")(grid, block, (g, u, np.int64(g.size), out))
    return out


def add_rms_norm(h, delta, weight, eps: float):
    """(h + delta, rms_norm(h + delta)) in one launch: the residual add and the next norm. h, delta [..., D]."""
    import cupy

    h, delta = _contiguous_f32(h), _contiguous_f32(delta)
    D = h.shape[-1]
    total, out = cupy.empty_like(h), cupy.empty_like(h)
    rows = h.size // D if D else 0
    if rows:
        _kernel("strata_add_rms_norm")((rows,), (THREADS,), (h, delta, _contiguous_f32(weight), np.float32(eps),
                                                             np.int32(D), total, out))
    return total, out


def norm_rope(x, weight, eps: float, cos, sin):
    """x [T, heads, hd] (its rows may lie apart: a column slice of the fused QKV output), each head
    rms-normalised by weight [hd] (None: not normalised), then RoPE'd by cos, sin [T, d], d <= hd, d even."""
    import cupy

    T, heads, hd = x.shape
    if x.strides[1:] != (hd * 4, 4) or x.dtype != np.float32:
        x = _contiguous_f32(x)
    out = cupy.empty((T, heads, hd), np.float32)
    if out.size:
        w = _contiguous_f32(weight) if weight is not None else out  # any pointer: not read
        _kernel("strata_norm_rope")((T * heads,), (THREADS,), (
            x, np.int64(x.strides[0] // 4), np.int32(heads), np.int32(hd), w, np.int32(weight is not None),
            np.float32(eps), _contiguous_f32(cos), _contiguous_f32(sin), np.int32(cos.shape[-1]), out),
            shared_mem=hd * 4)
    return out


GQA_TILE, GQA_MIN_KEYS, GQA_MAX_SPLITS = 1024, 256, 32  # the kernels' GQA_TILE, GQA_MIN_KEYS, GQA_MAX_SPLITS


def gqa_splits(S: int) -> tuple[int, int]:
    """(splits, chunk): the kernels' gqa_splits of S keys, a formula of S alone."""
    splits = min(GQA_MAX_SPLITS, max(1, -(-S // GQA_MIN_KEYS)))
    chunk = -(-S // splits)
    return -(-S // chunk), chunk


def gqa_max_splits(max_keys: int) -> int:
    """The most splits any length up to ``max_keys`` takes: a cached step's grid and its partials' row length."""
    return max(gqa_splits(S)[0] for S in {max(1, max_keys), min(max_keys, GQA_MAX_SPLITS * GQA_MIN_KEYS)})


def _gqa_combine(part, stats, keys, rows: int, nh: int, hd: int, stride: int):
    """strata_gqa_combine: each (row, head)'s splits merged -> [rows, nh*hd]; ``keys`` says how many keys each row
    counted: (mask [rows, S], S) (eager), or the tables (q_seq, q_pos, seq_len) (cached)."""
    import cupy

    out = cupy.empty((rows, nh * hd), np.float32)
    cached = len(keys) == 3
    mask, S = (stats, 0) if cached else keys  # any pointer where not read
    q_seq, q_pos, seq_len = keys if cached else (stats, stats, stats)
    _kernel("strata_gqa_combine")((rows * nh,), (THREADS,), (
        part, stats, mask, np.int32(S), q_seq, q_pos, seq_len, np.int32(cached), np.int32(nh), np.int32(hd),
        np.int32(stride), out))
    return out


def gqa_attention(q, k, v, mask, scale: float):
    """q [T, nh, hd], k/v [S, nkv, hd], mask [T, S] bool -> [T, nh*hd]: each row's keys split over (gqa_splits of
    its own count: the same bits as the row alone), a block a (token, head, split), then the splits merged: two
    launches. k and v float32, or both bf16 bits (uint16, a
    bf16 cache's): read and widened in the kernel, the result equal to the float32 kernel's on the widened
    values."""
    import cupy

    q = _contiguous_f32(q)
    k, v, bf16 = _kv_pair(k, v)
    T, nh, hd = q.shape
    S, nkv = k.shape[:2]
    if not (T * nh * hd and S):
        return cupy.empty((T, nh * hd), np.float32)
    splits = gqa_max_splits(S)  # each row splits its own keys (at most S): the grid for the longest
    part, stats = cupy.empty((T * nh * splits, hd), np.float32), cupy.empty((T * nh * splits, 2), np.float32)
    m = cupy.ascontiguousarray(mask, dtype=cupy.bool_)
    _kernel("strata_gqa_partial")((T * nh * splits,), (THREADS,), (
        q, k, v, m, np.float32(scale), np.int32(S), np.int32(nh), np.int32(nkv), np.int32(hd), np.int32(splits),
        np.int32(bf16), part, stats), shared_mem=(hd + GQA_TILE + max(THREADS, hd)) * 4)
    return _gqa_combine(part, stats, (m, S), T, nh, hd, splits)


def gqa_attention_cached(q, tables, window: int | None, scale: float, nkv: int, max_keys: int, bf16: bool):
    """q [Nq, nh, hd] -> [Nq, nh*hd]: gqa_attention over each query's own sequence's cache, where and how far
    read from the device: ``tables`` (k_ptrs, v_ptrs [B] int64 addresses of the layer's cache buffers, q_seq,
    q_pos [Nq], seq_len [B] int64), the mask made in the kernel; the grid sized for ``max_keys`` (the longest a
    cache may be: gqa_max_splits). Equal to gqa_attention with ops.attention_mask's mask, bit for bit."""
    import cupy

    q = _contiguous_f32(q)
    Nq, nh, hd = q.shape
    k_ptrs, v_ptrs, q_seq, q_pos, seq_len = tables
    if not q.size:
        return cupy.empty((Nq, nh * hd), np.float32)
    stride = gqa_max_splits(max_keys)
    part, stats = cupy.empty((Nq * nh * stride, hd), np.float32), cupy.empty((Nq * nh * stride, 2), np.float32)
    _kernel("strata_gqa_partial_cached")((Nq * nh * stride,), (THREADS,), (
        q, k_ptrs, v_ptrs, q_seq, q_pos, seq_len, np.int32(window or 0), np.float32(scale), np.int32(nh),
        np.int32(nkv), np.int32(hd), np.int32(stride), np.int32(bf16), part, stats),
        shared_mem=(hd + GQA_TILE + max(THREADS, hd)) * 4)
    return _gqa_combine(part, stats, (q_seq, q_pos, seq_len), Nq, nh, hd, stride)


def kv_store(k, v, k_ptrs, v_ptrs, row_seq, row_pos, bf16: bool) -> None:
    """Each row of k [N, ...], v [N, ...] (rows may lie apart: the fused QKV output's columns; MLA's latent [N, c]
    and rope key [N, dr] are of different widths) into its sequence's cache: row t at position row_pos[t] of the
    buffers at k_ptrs[row_seq[t]], v_ptrs[...] (device int64 tables; a row of sequence -1 is padding, stored
    nowhere); float32, or bf16 bits rounded as to_bf16 rounds. One launch."""
    k, k_stride, k_width = _rows_f32(k)
    v, v_stride, v_width = _rows_f32(v)
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"kv_store: {k.shape[0]} keys, {v.shape[0]} values")
    if k.shape[0]:
        _kernel("strata_kv_store")((k.shape[0],), (THREADS,), (k, v, k_stride, v_stride, np.int32(k_width),
                                                              np.int32(v_width), k_ptrs, v_ptrs, row_seq, row_pos,
                                                              np.int32(bf16)))


def _kv_pair(k, v):
    """Cache entries as the kernels take them: (k, v, True) both bf16 bits, C-contiguous; else float32 (a lone
    bf16 one widened), (k, v, False)."""
    import cupy

    if k.dtype == np.uint16 and v.dtype == np.uint16:
        return cupy.ascontiguousarray(k), cupy.ascontiguousarray(v), True
    k, v = (from_bf16(a) if a.dtype == np.uint16 else _contiguous_f32(a) for a in (k, v))
    return k, v, False


def to_bf16(x, out=None):
    """float32 [...] -> bf16 bits (uint16) [...], round to nearest even, NaN kept NaN: shm/formats/bf16's
    encode_into. x's rows may lie apart (V's columns of the fused QKV output). ``out``: a C-contiguous uint16
    array of x's size (rows of a cache buffer), written in place."""
    import cupy

    x, row_stride, width = _rows_f32(x)
    if out is None:
        out = cupy.empty(x.shape, np.uint16)
    elif out.dtype != np.uint16 or out.size != x.size or not out.flags.c_contiguous:
        raise ValueError(f"to_bf16: out must be C-contiguous uint16 of {x.size} values, not {out.dtype} "
                         f"{out.shape} (contiguous: {out.flags.c_contiguous})")
    if x.size:
        grid, block = _elementwise_grid(x.size)
        _kernel("strata_to_bf16")(grid, block, (x, row_stride, width, np.int64(x.size), out))
    return out


def _rows_f32(x):
    """x [R, ...] as rows of float32 whose own values are adjacent, the rows possibly apart: (x, row stride,
    row width) in floats; a copy where x is laid out otherwise."""
    if x.dtype == np.float32 and x.ndim >= 2 and x.strides[0] >= 0 and x.strides[0] % 4 == 0:
        width = x.size // x.shape[0] if x.shape[0] else 0
        inner = [4 * int(np.prod(x.shape[i + 1:])) for i in range(1, x.ndim)]  # C-contiguous strides of a row
        if all(s == want for s, want, n in zip(x.strides[1:], inner, x.shape[1:]) if n > 1):
            return x, np.int64(x.strides[0] // 4), np.int64(max(width, 1))
    x = _contiguous_f32(x)
    return x, np.int64(max(x.size, 1)), np.int64(max(x.size, 1))


def from_bf16(bits):
    """bf16 bits (uint16) [...] -> float32 [...], exact: for the paths that take float32 (CuPy's matmuls)."""
    import cupy

    if bits.dtype != np.uint16:
        raise ValueError(f"from_bf16: bf16 bits are uint16, not {bits.dtype}")
    bits = cupy.ascontiguousarray(bits)
    out = cupy.empty(bits.shape, np.float32)
    if bits.size:
        grid, block = _elementwise_grid(bits.size)
        _kernel("strata_from_bf16")(grid, block, (bits, np.int64(bits.size), out))
    return out


def _heads_f32(x):
    """x [T, heads, d] as the kernels read it: float32, each head's d values adjacent; rows and heads may lie
    apart (column slices of a projection's output). Returns (x, row stride, head stride) in floats."""
    if x.dtype != np.float32 or x.strides[2] != 4 or min(x.strides) < 0 or any(s % 4 for s in x.strides):
        x = _contiguous_f32(x)
    return x, np.int64(x.strides[0] // 4), np.int64(x.strides[1] // 4)


def _strided_f32(a):
    """a float32 array read where it lies: (a, its strides in floats); a copy where they are not whole floats."""
    if a.dtype != np.float32 or min(a.strides) < 0 or any(s % 4 for s in a.strides):
        a = _contiguous_f32(a)
    return a, tuple(np.int64(s // 4) for s in a.strides)


def apply_rope_interleaved(x, cos, sin):
    """x [T, heads, d], d even (its rows and heads may lie apart: q's rope columns, kv_a's rope key); cos, sin
    [T, >= d/2] in the half-split layout -> [T, heads, d]: ops.apply_rope_interleaved in one launch."""
    import cupy

    T, heads, d = x.shape
    if d % 2 or cos.shape != sin.shape or cos.shape[0] != T or cos.shape[-1] < d // 2:
        raise ValueError(f"apply_rope_interleaved: x {x.shape} (d even) takes cos, sin [{T}, >= {d // 2}], "
                         f"not {cos.shape}, {sin.shape}")
    x, row_stride, head_stride = _heads_f32(x)
    cos, sin = _contiguous_f32(cos), _contiguous_f32(sin)
    out = cupy.empty((T, heads, d), np.float32)
    if out.size:
        grid, block = _elementwise_grid(out.size)
        _kernel("strata_rope_interleaved")(grid, block, (
            x, row_stride, head_stride, np.int32(heads), np.int32(d), cos, sin, np.int32(cos.shape[-1]),
            np.int64(out.size), out))
    return out


MLA_ROWS = 8  # the kernels' MLA_ROWS: query rows (token, head) a strata_mla_partial block, tokens the others' block
MLA_CHUNK_MIN = 64  # keys a block at least when the keys are split to fill the device
MLA_CHUNK_MAX = 512  # keys a tile at most: a tile's scores live in shared memory
MLA_BLOCKS = 264  # strata_mla_partial's grid is split up to this many blocks: two an H100 SM
SHARED_FLOATS = 48 * 1024 // 4  # the dynamic shared memory a block gets without opting in


def mla_chunk_cap(c: int, dr: int) -> int:
    """The keys a strata_mla_partial block scores at once (its tile): their scores live in shared memory beside
    the rows' queries and running sums (< 1: mla_attention_absorbed's check raises)."""
    return max(1, min(MLA_CHUNK_MAX, SHARED_FLOATS // MLA_ROWS - 2 * max(c + dr, THREADS)))


def mla_splits(T: int, nh: int, S: int, c: int, dr: int) -> tuple[int, int]:
    """(splits, chunk): the S keys in ``splits`` chunks of ``chunk`` keys (the last may be shorter) for
    strata_mla_partial, each block walking its chunk a tile at a time. Few query rows (decode): enough chunks of
    at least MLA_CHUNK_MIN keys to fill about MLA_BLOCKS blocks; many: one, the rows' blocks fill the device. The
    splits never depend on the context beyond that: the partials are bounded."""
    row_blocks = -(-T * nh // MLA_ROWS)
    return _chunked(S, max(1, min(-(-S // MLA_CHUNK_MIN), -(-MLA_BLOCKS // row_blocks))))


def mla_max_splits(nh: int, max_keys: int, c: int, dr: int) -> int:
    """The most chunks mla_splits gives any query count over up to ``max_keys`` keys: the cached form's grid and
    its part's row length (min(S / MLA_CHUNK_MIN, MLA_BLOCKS / row blocks), largest at one query token and
    S = max_keys; at most MLA_BLOCKS / ceil(nh / MLA_ROWS), whatever the context)."""
    return max(1, min(-(-max_keys // MLA_CHUNK_MIN), -(-MLA_BLOCKS // -(-nh // MLA_ROWS))))


def _chunked(S: int, splits: int) -> tuple[int, int]:
    chunk = -(-S // max(1, min(splits, S)))
    return -(-S // chunk), chunk


@dataclass(frozen=True, eq=False)
class CompactKvB:
    """MLA's kv_b [nh * (dn + dv), c] kept in its storage format, a head's dn rows of W_uk then dv of W_uv: the
    absorbed attention reads it as it lies (format_kernels.absorb_rows for q_nope · W_uk, head_rows_matvec for
    out_lat · W_uvᵀ), never widened to float32. Passed as w_uk, with w_uv_t None."""

    fmt: str
    data: object  # the stored rows on the device (DeviceMatrix.data)
    nh: int
    dn: int
    dv: int
    c: int


def _mla_weights(w_uk, w_uv_t):
    """(the compact kv_b or None, w_uk's [nh, dn, c] and w_uv_t's [nh, c] shapes, dv)."""
    if isinstance(w_uk, CompactKvB):
        return w_uk, (w_uk.nh, w_uk.dn, w_uk.c), (w_uk.nh, w_uk.c), w_uk.dv
    return None, w_uk.shape, w_uv_t.shape[:2], w_uv_t.shape[2]


def _compact_output(compact: CompactKvB, combine, T: int, nh: int, c: int, dv: int):
    """The combine (``combine(w_uv_t, strides, lat_out, out)``) writing out_lat [T*nh, c], then W_uv's rows of the
    compact kv_b applied as they lie: [T, nh*dv]."""
    import cupy

    out_lat = cupy.empty((T * nh, c), np.float32)
    combine(out_lat, (np.int64(0),) * 3, 1, out_lat)  # any pointer for W_uv: not read
    return format_kernels.head_rows_matvec(compact.fmt, compact.data, nh, compact.dn + compact.dv, compact.dn, dv,
                                           c, out_lat).reshape(T, nh * dv)


def mla_attention_absorbed(rows: MlaRows, w_uk, w_uv_t, mask, scale: float, splits=None):
    """Absorbed multi-head latent attention, ops.mla_attention_absorbed's mathematics in three launches.

    rows: q_nope [T, nh, dn], q_rope [T, nh, dr] (rows and heads may lie apart: column slices of q); latent [S, c],
    k_rope [S, dr]: float32, or both bf16 bits (uint16, a bf16 cache's: equal to float32 on the widened values);
    w_uk [nh, dn, c], w_uv_t [nh, c, dv]: float32, any layout read where it lies (views of kv_b's rows,
    w_uv.transpose(0, 2, 1)); w_uk with c, w_uv_t with dv adjacent reads fastest (w_uv [nh, dv, c] transposed
    once at load); or w_uk a CompactKvB and w_uv_t None; mask [T, S] bool -> [T, nh*dv]. ``splits``: chunks of
    keys (None: mla_splits' choice; the tests force several)."""
    import cupy

    q_nope, q_rope, latent, k_rope = rows.q_nope, rows.q_rope, rows.latent, rows.k_rope
    T, nh, dn = q_nope.shape
    S, c = latent.shape
    compact, uk_shape, uv_shape, dv = _mla_weights(w_uk, w_uv_t)
    dr = k_rope.shape[1]
    if (q_rope.shape, k_rope.shape, uk_shape, uv_shape, mask.shape) != (
            (T, nh, dr), (S, dr), (nh, dn, c), (nh, c), (T, S)):  # the kernels trust these: a mismatch reads astray
        raise ValueError(f"mla_attention_absorbed: shapes q_nope {q_nope.shape} q_rope {q_rope.shape} latent "
                         f"{latent.shape} k_rope {k_rope.shape} w_uk {uk_shape} w_uv_t {uv_shape} "
                         f"mask {mask.shape}")
    q_nope, qn_row, qn_head = _heads_f32(q_nope)
    q_rope, qr_row, qr_head = _heads_f32(q_rope)
    latent, k_rope, bf16 = _kv_pair(latent, k_rope)
    if compact is None:
        (w_uk, wk_strides), (w_uv_t, wv_strides) = _strided_f32(w_uk), _strided_f32(w_uv_t)
    else:
        wk_strides = None
    out = cupy.empty((T, nh * dv), np.float32)
    if not (out.size and S):
        return out
    splits, chunk = mla_splits(T, nh, S, c, dr) if splits is None else _chunked(S, splits)
    R = T * nh
    q_lat, part, stats, partial_shared, combine_shared = _mla_absorb(
        q_nope, qn_row, qn_head, w_uk, wk_strides, splits, dr, dv,
        f"mla_attention_absorbed: c {c}, dr {dr}, dv {dv} in {splits} chunks of {chunk} keys")
    token_blocks = nh * -(-T // MLA_ROWS)
    i32 = np.int32
    m = cupy.ascontiguousarray(mask, dtype=cupy.bool_)
    _kernel("strata_mla_partial_bf16" if bf16 else "strata_mla_partial")((-(-R // MLA_ROWS) * splits,), (THREADS,), (
        q_lat, q_rope, qr_row, qr_head, latent, k_rope, m, np.float32(scale), i32(R), i32(nh), i32(S), i32(c),
        i32(dr), i32(chunk), i32(mla_chunk_cap(c, dr)), i32(splits), part, stats), shared_mem=partial_shared * 4)

    def combine(w_uv, strides, lat_out: int, into):
        _kernel("strata_mla_combine")((token_blocks,), (THREADS,), (
            part, stats, w_uv, *strides, i32(T), i32(nh), i32(c), i32(dv), i32(splits), i32(lat_out), into),
            shared_mem=combine_shared * 4)
    if compact is not None:
        return _compact_output(compact, combine, T, nh, c, dv)
    combine(w_uv_t, wv_strides, 0, out)
    return out


def _mla_absorb(q_nope, qn_row, qn_head, w_uk, wk_strides, splits: int, dr: int, dv: int, what: str):
    """The absorbed MLA's first launch and its scratch, shared by the eager and the cached forms: q_lat [R, c] =
    q_nope · W_UK per (token, head), with part [R, splits, c] and stats [R, splits, 2] beside it in one
    allocation; and the shared floats a block of the partial and the combine kernels takes (refused, naming
    ``what``, beyond SHARED_FLOATS). -> (q_lat, part, stats, partial_shared, combine_shared)."""
    import cupy

    T, nh, dn = q_nope.shape
    c = w_uk.c if isinstance(w_uk, CompactKvB) else w_uk.shape[2]
    partial_shared = MLA_ROWS * (2 * max(c + dr, THREADS) + mla_chunk_cap(c, dr))
    combine_shared = MLA_ROWS * (c + max(splits, THREADS, dv))
    if max(partial_shared, combine_shared, MLA_ROWS * dn) > SHARED_FLOATS:
        raise ValueError(f"{what} need more than {SHARED_FLOATS * 4} bytes of shared memory a block")
    R = T * nh
    scratch = cupy.empty(R * c + R * splits * (c + 2), np.float32)  # one allocation: q_lat, part, stats
    q_lat = scratch[: R * c]  # [R, c]
    if isinstance(w_uk, CompactKvB):  # W_uk's rows read as they are stored
        format_kernels.absorb_rows(w_uk.fmt, w_uk.data, nh, w_uk.dn + w_uk.dv, dn, c, q_nope, int(qn_row),
                                   int(qn_head), T, q_lat)
    else:
        _kernel("strata_mla_q_absorb")((nh * -(-T // MLA_ROWS),), (THREADS,), (
            q_nope, qn_row, qn_head, w_uk, *wk_strides, np.int32(T), np.int32(nh), np.int32(dn), np.int32(c),
            q_lat), shared_mem=MLA_ROWS * dn * 4)
    return q_lat, scratch[R * c : R * c + R * splits * c], scratch[R * c + R * splits * c :], partial_shared, \
        combine_shared


def mla_attention_absorbed_cached(q_nope, q_rope, tables, w_uk, w_uv_t, scale: float, max_keys: int, bf16: bool):
    """mla_attention_absorbed with each query token over its own sequence's cache, where and how far read from the
    device (as gqa_attention_cached): ``tables`` (lat_ptrs, rope_ptrs [B] int64 addresses of the layer's cache
    buffers (latents [cap, c], rope keys [cap, dr]), q_seq, q_pos [Nq], seq_len [B], chunks [Nq]: each query's
    mla_splits chunk for its eager call, so the sums are the eager call's, bit for bit); the mask (causal) made in
    the kernel. ``max_keys``: the longest a cache may be (mla_max_splits: the grid). Every launch's grid and
    arguments depend on Nq and max_keys alone. -> [Nq, nh*dv]."""
    import cupy

    Nq, nh, dn = q_nope.shape
    compact, uk_shape, uv_shape, dv = _mla_weights(w_uk, w_uv_t)
    c, dr = uk_shape[2], q_rope.shape[2]
    if (q_rope.shape[:2], uk_shape[:2], uv_shape) != ((Nq, nh), (nh, dn), (nh, c)):
        raise ValueError(f"mla_attention_absorbed_cached: shapes q_nope {q_nope.shape} q_rope {q_rope.shape} "
                         f"w_uk {uk_shape} w_uv_t {uv_shape}")
    lat_ptrs, rope_ptrs, q_seq, q_pos, seq_len, chunks = tables
    q_nope, qn_row, qn_head = _heads_f32(q_nope)
    q_rope, qr_row, qr_head = _heads_f32(q_rope)
    if compact is None:
        (w_uk, wk_strides), (w_uv_t, wv_strides) = _strided_f32(w_uk), _strided_f32(w_uv_t)
    else:
        wk_strides = None
    out = cupy.empty((Nq, nh * dv), np.float32)
    if not out.size:
        return out
    stride, cap = mla_max_splits(nh, max_keys, c, dr), mla_chunk_cap(c, dr)
    q_lat, part, stats, partial_shared, combine_shared = _mla_absorb(
        q_nope, qn_row, qn_head, w_uk, wk_strides, stride, dr, dv,
        f"mla_attention_absorbed_cached: c {c}, dr {dr}, dv {dv} over {max_keys} keys")
    token_blocks = nh * -(-Nq // MLA_ROWS)
    i32 = np.int32
    _kernel("strata_mla_partial_cached")((Nq * -(-nh // MLA_ROWS) * stride,), (THREADS,), (
        q_lat, q_rope, qr_row, qr_head, lat_ptrs, rope_ptrs, q_seq, q_pos, seq_len, chunks, np.float32(scale),
        i32(nh), i32(c), i32(dr), i32(cap), i32(stride), i32(bf16), part, stats), shared_mem=partial_shared * 4)

    def combine(w_uv, strides, lat_out: int, into):
        _kernel("strata_mla_combine_cached")((token_blocks,), (THREADS,), (
            part, stats, w_uv, *strides, i32(Nq), i32(nh), i32(c), i32(dv), i32(stride), q_seq, q_pos, seq_len, chunks,
            i32(lat_out), into), shared_mem=combine_shared * 4)
    if compact is not None:
        return _compact_output(compact, combine, Nq, nh, c, dv)
    combine(w_uv_t, wv_strides, 0, out)
    return out


def gated_delta(qkv, z, ba, taps, a_neg, dt_bias, norm, eps: float, tables, slot: int, dims) -> object:
    """Qwen3-Next's Gated DeltaNet layer between its projections, every sequence of a step in one launch (a block a
    (sequence, value head), its tokens in order): qkv [N, C], z [N, Hv dv] and ba [N, 2 Hv] (their rows may lie
    apart),
    taps [C, K], a_neg, dt_bias [Hv], norm [dv]; ``tables`` (row_start [B + 1], conv_src, conv_dst, rec_src, rec_dst
    [B]: device int64, the sequences' rows and their state buffers' addresses, linear_attention.DeviceLinearStates);
    ``slot``: the layer's place in those buffers; dims (Hk, Hv, dk, dv, K). Returns rms_norm(o) * norm * silu(z)
    [N, Hv dv], the state read from the src buffers and written to the dst ones."""
    import cupy

    Hk, Hv, dk, dv, K = dims
    qkv, qkv_stride, _ = _rows_f32(qkv)
    z, z_stride, _ = _rows_f32(z)
    ba, ba_stride, _ = _rows_f32(ba)
    row_start, conv_src, conv_dst, rec_src, rec_dst = tables
    out = cupy.empty((qkv.shape[0], Hv * dv), np.float32)
    B = conv_src.shape[0]
    if out.size and B:
        threads = min(THREADS, 32 * -(-max(dv, dk) // 32))  # a thread a column of S where dv allows
        i32 = np.int32
        _kernel("strata_gated_delta")((B * Hv,), (threads,), (
            qkv, qkv_stride, z, z_stride, ba, ba_stride, _contiguous_f32(taps), _contiguous_f32(a_neg),
            _contiguous_f32(dt_bias), _contiguous_f32(norm), np.float32(eps), np.float32(dk ** -0.5), row_start,
            conv_src, conv_dst, rec_src, rec_dst, i32(slot), i32(Hk), i32(Hv), i32(dk), i32(dv), i32(K), out),
            shared_mem=(2 * dk + 2 * dv) * 4)
    return out
