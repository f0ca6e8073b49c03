"""Fused CuPy kernels for the decoder's small per-row ops: one launch where CuPy's array calls take five to ten.

At decode a layer's rows are one token, so the device side is bound by calls, not
arithmetic: each CuPy call costs tens of microseconds on the host whatever its size,
and rms_norm, RoPE, the masked softmax, the router and silu take several calls each.
Each of those is one kernel here (the router's is coordinator/device/router.py's, the
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
    mla_attention_absorbed(q_nope [T, nh, dn], q_rope [T, nh, dr], latent [S, c], k_rope [S, dr],
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

import numpy as np

THREADS = 128  # a block per row; a multiple of the warp, as the shuffle reductions need

_SOURCE = r"""
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// every thread of the block gets the total; part[] is free again when it returns
__device__ float block_sum(float v, float* part) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) part[w] = v;
    __syncthreads();
    v = warp_sum(lane < nw ? part[lane] : 0.0f);
    __syncthreads();
    return v;
}
__device__ float block_max(float v, float* part) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    if (lane == 0) part[w] = v;
    __syncthreads();
    v = warp_max(lane < nw ? part[lane] : __int_as_float(0xff800000));
    __syncthreads();
    return v;
}
// a key/value cache entry as float: float32 as stored, bf16 bits widened exactly (they are the float's top half)
__device__ __forceinline__ float kv_load(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float kv_load(const unsigned short* p, long long i) {
    return __int_as_float((int)((unsigned)p[i] << 16));
}

// x, out [rows, D]; weight [D]. out = x / sqrt(mean(x^2) + eps) * weight
extern "C" __global__ void strata_rms_norm(const float* x, const float* weight, float eps, int D, float* out) {
    __shared__ float part[32];
    const float* xr = x + (long long)blockIdx.x * D;
    float* o = out + (long long)blockIdx.x * D;
    float s = 0.0f;
    for (int d = threadIdx.x; d < D; d += blockDim.x) s += xr[d] * xr[d];
    s = block_sum(s, part);
    float r = sqrtf(s / (float)D + eps);
    for (int d = threadIdx.x; d < D; d += blockDim.x) o[d] = (xr[d] / r) * weight[d];
}

// scores, out [R, T, S] (row r's query is r % T); mask [T, S] of bytes, nonzero where the key is seen
extern "C" __global__ void strata_masked_softmax(const float* scores, const unsigned char* mask, float scale,
                                                 int T, int S, float* out) {
    __shared__ float part[32];
    long long r = blockIdx.x;
    const float* s = scores + r * S;
    const unsigned char* m = mask + (long long)(r % T) * S;
    float* o = out + r * S;
    float mx = __int_as_float(0xff800000);
    for (int j = threadIdx.x; j < S; j += blockDim.x)
        if (m[j]) mx = fmaxf(mx, s[j] * scale);
    mx = block_max(mx, part);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < S; j += blockDim.x) {
        float e = m[j] ? expf(s[j] * scale - mx) : 0.0f;
        o[j] = e;
        sum += e;
    }
    sum = block_sum(sum, part);
    for (int j = threadIdx.x; j < S; j += blockDim.x) o[j] = o[j] / sum;
}

// h, delta, sum, out [rows, D]: sum = h + delta, out = rms_norm(sum) (strata_rms_norm's arithmetic)
extern "C" __global__ void strata_add_rms_norm(const float* h, const float* delta, const float* weight, float eps,
                                               int D, float* sum, float* out) {
    __shared__ float part[32];
    long long base = (long long)blockIdx.x * D;
    float s = 0.0f;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float v = h[base + d] + delta[base + d];
        sum[base + d] = v;
        s += v * v;
    }
    s = block_sum(s, part);
    float r = sqrtf(s / (float)D + eps);
    for (int d = threadIdx.x; d < D; d += blockDim.x) out[base + d] = (sum[base + d] / r) * weight[d];
}

// x: T rows of `heads` heads of hd floats, row t at x + t * row_stride (a column slice of the fused QKV output);
// out [T, heads, hd]. Each head rms-normalised by weight [hd] (when has_weight: strata_rms_norm's arithmetic),
// then its first d dims rotated in halves by cos, sin [T, d] (x cos + rotate_half(x) sin), the rest copied.
// One block a (token, head); dynamic shared memory: hd floats.
extern "C" __global__ void strata_norm_rope(const float* x, long long row_stride, int heads, int hd,
                                            const float* weight, int has_weight, float eps,
                                            const float* cos, const float* sin, int d, float* out) {
    extern __shared__ float row[];
    __shared__ float part[32];
    long long t = blockIdx.x / heads;
    const float* xr = x + t * row_stride + (long long)(blockIdx.x % heads) * hd;
    float s = 0.0f;
    for (int j = threadIdx.x; j < hd; j += blockDim.x) {
        float v = xr[j];
        row[j] = v;
        s += v * v;
    }
    float r = 1.0f;
    if (has_weight) {
        s = block_sum(s, part);  // synchronises: row[] is complete
        r = sqrtf(s / (float)hd + eps);
        for (int j = threadIdx.x; j < hd; j += blockDim.x) row[j] = (row[j] / r) * weight[j];
    }
    __syncthreads();
    float* o = out + (long long)blockIdx.x * hd;
    int half = d / 2;
    for (int j = threadIdx.x; j < hd; j += blockDim.x) {
        if (j >= d) { o[j] = row[j]; continue; }
        float rotated = j < half ? -row[j + half] : row[j - half];
        o[j] = row[j] * cos[t * d + j] + rotated * sin[t * d + j];
    }
}

// Attention of T query tokens over S keys, heads sharing KV heads in groups of nh / nkv, split over the keys
// (flash-decoding, as the MLA path and llama.cpp's decode do): q [T, nh, hd]; k, v [S, nkv, hd] (KV: float, or
// bf16 bits widened exactly on load); mask [T, S] bytes, nonzero where the key is seen. Without a mask (null), the
// key j is seen by the query at position pos where j <= pos and, with a window, pos - j < window
// (ops.attention_mask's rule, made here).
// The S keys go to gqa_splits(S) splits of `chunk` keys (a formula of S alone, so every caller splits alike); a
// block a (token, head, split) walks its keys in tiles of GQA_TILE:
//   scores   a warp a key: the lanes split hd, a shuffle sum; masked keys -inf
//   softmax  online: the tile's block max, e^(s - max) (masked: 0), its block sum; the running sum and
//            output rescaled by e^(old max - new max)
//   output   the threads split (dim, key group): groups = blockDim / hd keys apart, summed in group order
// and writes its unnormalised output [hd] and (max, sum) to its split's place (rows `stride` splits apart);
// strata_gqa_combine then merges a row's splits in order. The scratch is rows x heads x splits x (hd + 2)
// floats, whatever the context. Dynamic shared memory: hd + GQA_TILE + max(blockDim, hd) floats.
#define GQA_TILE 1024
#define GQA_MIN_KEYS 256
#define GQA_MAX_SPLITS 32
__device__ __forceinline__ int gqa_splits(int S, int* chunk) {
    int splits = min(GQA_MAX_SPLITS, max(1, (S + GQA_MIN_KEYS - 1) / GQA_MIN_KEYS));
    *chunk = (S + splits - 1) / splits;
    return (S + *chunk - 1) / *chunk;
}
template <typename KV>
__device__ void gqa_partial(const float* qr, const KV* k, const KV* v, const unsigned char* m, int pos, int window,
                            float scale, int S, int split, int g, int nkv, int hd, float* part, float* stat) {
    extern __shared__ float gqa_shared[];  // named apart: a C++ function's and the kernels' would clash
    __shared__ float red[32];
    float* qs = gqa_shared;                  // [hd] the query row
    float* sc = gqa_shared + hd;             // [GQA_TILE] a tile's scores, then its e^(s - max)
    float* acc = gqa_shared + hd + GQA_TILE; // [groups * hd] the output's running partial sums
    int chunk, splits = gqa_splits(S, &chunk);
    if (split >= splits) return;  // a cached step's grid is sized for the longest context: nothing here
    int lo = split * chunk, hi = min(S, lo + chunk);
    for (int j = threadIdx.x; j < hd; j += blockDim.x) qs[j] = qr[j];
    int groups = hd <= blockDim.x ? blockDim.x / hd : 1;
    for (int i = threadIdx.x; i < groups * hd; i += blockDim.x) acc[i] = 0.0f;
    __syncthreads();
    long long kv_row = (long long)nkv * hd;
    const KV* kh = k + (long long)g * hd;
    const KV* vh = v + (long long)g * hd;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float run_max = __int_as_float(0xff800000), run_sum = 0.0f;
    for (int t0 = lo; t0 < hi; t0 += GQA_TILE) {
        int n = min(GQA_TILE, hi - t0);
        for (int jj = w; jj < n; jj += nw) {
            int j = t0 + jj;
            if (!(m ? m[j] : j <= pos && (window <= 0 || pos - j < window))) {  // the same j for the whole warp
                if (lane == 0) sc[jj] = __int_as_float(0xff800000);
                continue;
            }
            const KV* kr = kh + j * kv_row;
            float a = 0.0f;
            for (int d = lane; d < hd; d += 32) a += qs[d] * kv_load(kr, d);
            a = warp_sum(a);
            if (lane == 0) sc[jj] = a * scale;
        }
        __syncthreads();
        float mx = __int_as_float(0xff800000);
        for (int jj = threadIdx.x; jj < n; jj += blockDim.x) mx = fmaxf(mx, sc[jj]);
        mx = block_max(mx, red);
        float new_max = fmaxf(run_max, mx);
        if (new_max == __int_as_float(0xff800000)) continue;  // every key so far masked (the block agrees)
        float sum = 0.0f;
        for (int jj = threadIdx.x; jj < n; jj += blockDim.x) {
            int j = t0 + jj;
            float e = (m ? m[j] : j <= pos && (window <= 0 || pos - j < window)) ? expf(sc[jj] - new_max) : 0.0f;
            sc[jj] = e;
            sum += e;
        }
        sum = block_sum(sum, red);  // synchronises: sc[] holds every e
        float rescale = run_max == __int_as_float(0xff800000) ? 0.0f : expf(run_max - new_max);
        run_sum = run_sum * rescale + sum;
        run_max = new_max;
        for (int i = threadIdx.x; i < groups * hd; i += blockDim.x) {
            int d = i % hd, grp = i / hd;
            float a = 0.0f;
            for (int jj = grp; jj < n; jj += groups) a += sc[jj] * kv_load(vh, (t0 + jj) * kv_row + d);
            acc[grp * hd + d] = acc[grp * hd + d] * rescale + a;
        }
        __syncthreads();
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = 0.0f;
        for (int grp = 0; grp < groups; grp++) a += acc[grp * hd + d];
        part[d] = a;
    }
    if (threadIdx.x == 0) { stat[0] = run_max; stat[1] = run_sum; }
}
// a block a (token t, head h, split): blockIdx.x = (t * nh + h) * stride + split
template <typename KV>
__device__ void gqa_partial_row(const float* q, const KV* k, const KV* v, const unsigned char* mask, int pos,
                                int window, float scale, int S, int nh, int nkv, int hd, int stride, float* part,
                                float* stats) {
    long long row = blockIdx.x / stride, t = row / nh;
    int split = blockIdx.x % stride, h = (int)(row % nh);
    gqa_partial(q + row * hd, k, v, mask ? mask + t * S : nullptr, pos, window, scale, S, split, h / (nh / nkv),
                nkv, hd, part + (long long)blockIdx.x * hd, stats + 2LL * blockIdx.x);
}
extern "C" __global__ void strata_gqa_partial(const float* q, const void* k, const void* v,
                                              const unsigned char* mask, float scale, int S, int nh, int nkv, int hd,
                                              int stride, int bf16, float* part, float* stats) {
    if (bf16) gqa_partial_row((const float*)q, (const unsigned short*)k, (const unsigned short*)v, mask, 0, 0, scale,
                              S, nh, nkv, hd, stride, part, stats);
    else gqa_partial_row(q, (const float*)k, (const float*)v, mask, 0, 0, scale, S, nh, nkv, hd, stride, part, stats);
}
// The same partials reading where and how far from the device: query row t belongs to sequence q_seq[t] at
// position q_pos[t]; sequence s's keys and values are seq_len[s] rows at k_ptrs[s] and v_ptrs[s] (its cache's
// buffers for the layer); the mask is made here. Nothing in the arguments changes from step to step but what
// the tables hold; `stride` is gqa_max_splits of the context.
extern "C" __global__ void strata_gqa_partial_cached(const float* q, const long long* k_ptrs,
                                                     const long long* v_ptrs, const long long* q_seq,
                                                     const long long* q_pos, const long long* seq_len, int window,
                                                     float scale, int nh, int nkv, int hd, int stride, int bf16,
                                                     float* part, float* stats) {
    long long t = blockIdx.x / stride / nh, s = q_seq[t];
    if (bf16) gqa_partial_row(q, (const unsigned short*)k_ptrs[s], (const unsigned short*)v_ptrs[s], nullptr,
                              (int)q_pos[t], window, scale, (int)seq_len[s], nh, nkv, hd, stride, part, stats);
    else gqa_partial_row(q, (const float*)k_ptrs[s], (const float*)v_ptrs[s], nullptr, (int)q_pos[t], window, scale,
                         (int)seq_len[s], nh, nkv, hd, stride, part, stats);
}
// A row's splits merged in order: out = sum_c part_c e^(max_c - M) / sum_c sum_c e^(max_c - M), M the largest
// max; a block a (token, head). S is the keys (eager), or, `cached`, each query's sequence's seq_len[q_seq[t]].
extern "C" __global__ void strata_gqa_combine(const float* part, const float* stats, int S, const long long* q_seq,
                                              const long long* seq_len, int cached, int nh, int hd, int stride,
                                              float* out) {
    long long row = blockIdx.x;
    int keys = cached ? (int)seq_len[q_seq[row / nh]] : S;
    int chunk, splits = gqa_splits(keys, &chunk);
    const float* st = stats + 2LL * row * stride;
    float M = __int_as_float(0xff800000);
    for (int c = 0; c < splits; c++) M = fmaxf(M, st[2 * c]);
    float denom = 0.0f;
    for (int c = 0; c < splits; c++) denom += st[2 * c + 1] * (st[2 * c + 1] > 0.0f ? expf(st[2 * c] - M) : 0.0f);
    const float* p = part + row * stride * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = 0.0f;
        for (int c = 0; c < splits; c++)
            if (st[2 * c + 1] > 0.0f) a += p[(long long)c * hd + d] * expf(st[2 * c] - M);
        out[row * hd + d] = a / denom;
    }
}

__device__ __forceinline__ unsigned short bf16_bits(unsigned int b) {
    bool is_nan = (b & 0x7fffffffu) > 0x7f800000u;  // set quiet, not rounded: a carry could make it infinity
    return (unsigned short)(is_nan ? (b >> 16) | 0x40u : (b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

// Row t's key and value (k_width and v_width floats; rows k_stride and v_stride apart: columns of the fused QKV
// output, or MLA's latent and rope key) into its sequence's cache: row_pos[t] of the buffers at k_ptrs[row_seq[t]],
// v_ptrs[row_seq[t]]; as float32, or as bf16 bits rounded as strata_to_bf16 rounds. A block a row; a row of
// sequence -1 (a bucket's padding) stores nothing.
extern "C" __global__ void strata_kv_store(const unsigned int* k, const unsigned int* v, long long k_stride,
                                           long long v_stride, int k_width, int v_width, const long long* k_ptrs,
                                           const long long* v_ptrs, const long long* row_seq,
                                           const long long* row_pos, int bf16) {
    long long t = blockIdx.x, s = row_seq[t];
    if (s < 0) return;
    long long k_at = row_pos[t] * k_width, v_at = row_pos[t] * v_width;
    for (int j = threadIdx.x; j < k_width; j += blockDim.x) {
        unsigned int kb = k[t * k_stride + j];
        if (bf16) ((unsigned short*)k_ptrs[s])[k_at + j] = bf16_bits(kb);
        else ((unsigned int*)k_ptrs[s])[k_at + j] = kb;
    }
    for (int j = threadIdx.x; j < v_width; j += blockDim.x) {
        unsigned int vb = v[t * v_stride + j];
        if (bf16) ((unsigned short*)v_ptrs[s])[v_at + j] = bf16_bits(vb);
        else ((unsigned int*)v_ptrs[s])[v_at + j] = vb;
    }
}

// float32 -> bf16 bits, round to nearest even, NaN kept NaN (shm/formats/bf16.encode_into's integer arithmetic).
// x: rows of `width` floats, row r at x + r * row_stride (a column slice: V in the fused QKV output); out [n]
// C-contiguous. x is read as its bits: integer operations only, so every device rounds alike.
extern "C" __global__ void strata_to_bf16(const unsigned int* x, long long row_stride, long long width, long long n,
                                          unsigned short* out) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = bf16_bits(x[(i / width) * row_stride + i % width]);
}

// bf16 bits -> float32 (written as its bits), exact
extern "C" __global__ void strata_from_bf16(const unsigned short* x, long long n, unsigned int* out) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = (unsigned int)x[i] << 16;
}

// DeepSeek's interleaved RoPE (ops.apply_rope_interleaved): x [T, heads, d], row t head h at
// x + t * row_stride + h * head_stride (column slices of q or of kv_a's output); cos, sin [T, cw], the first
// d / 2 columns used (half-split layout); out [T, heads, d] de-interleaved:
// [even cos - odd sin, odd cos + even sin]. A thread an output element.
extern "C" __global__ void strata_rope_interleaved(const float* x, long long row_stride, long long head_stride,
                                                   int heads, int d, const float* cos, const float* sin, int cw,
                                                   long long n, float* out) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int j = (int)(i % d), half = d / 2;
    long long th = i / d, t = th / heads;
    const float* xr = x + t * row_stride + (th % heads) * head_stride;
    int p = j < half ? j : j - half;  // the pair (x[2p], x[2p + 1]) and its angle
    float c = cos[t * cw + p], s = sin[t * cw + p], even = xr[2 * p], odd = xr[2 * p + 1];
    out[i] = j < half ? even * c - odd * s : odd * c + even * s;
}

// Absorbed multi-head latent attention (ops.mla_attention_absorbed) in three launches. Query rows r = t * nh + h
// (R = T * nh); keys: the cached latent [S, c] and rope key [S, dr], both float or both bf16 bits.
//   1 strata_mla_q_absorb  q_lat [R, c] = q_nope · w_uk[h]: a block a head and MLA_ROWS tokens, so each
//                          step reads w_uk once, not once a key chunk
//   2 strata_mla_partial   a block MLA_ROWS rows x one chunk of keys: scores, the chunk's max and sum of
//                          e^(s - max), part = sum of e^(s - max) latent_j [c]; the rows share each key read, the
//                          chunks fill the device when the rows are few (decode)
//   3 strata_mla_combine   a block a head and MLA_ROWS tokens: the chunks merged (flash-decoding's rescale),
//                          out_lat / sum, then out [T, nh * dv] = out_lat · w_uv_t[h]
#define MLA_ROWS 8

// q_nope: row t head h at q_nope + t * qn_row + h * qn_head (a column slice of q); w_uk [nh, dn, c], element
// (h, d, i) at w_uk + h * wk_head + d * wk_row + i * wk_col (a view of kv_b's rows as well); q_lat [R, c].
// A thread a latent column, the MLA_ROWS tokens' sums in registers. Dynamic shared memory: MLA_ROWS * dn floats.
extern "C" __global__ void strata_mla_q_absorb(const float* q_nope, long long qn_row, long long qn_head,
                                               const float* w_uk, long long wk_head, long long wk_row,
                                               long long wk_col, int T, int nh, int dn, int c, float* q_lat) {
    extern __shared__ float qn[];  // [MLA_ROWS][dn] the tokens' q_nope rows of head h
    int h = blockIdx.x % nh;
    long long t0 = (long long)(blockIdx.x / nh) * MLA_ROWS;
    int tb = T - t0 < MLA_ROWS ? (int)(T - t0) : MLA_ROWS;
    for (int i = threadIdx.x; i < tb * dn; i += blockDim.x)
        qn[i] = q_nope[(t0 + i / dn) * qn_row + (long long)h * qn_head + i % dn];
    __syncthreads();
    for (int i = threadIdx.x; i < c; i += blockDim.x) {
        const float* wk = w_uk + h * wk_head + i * wk_col;
        float a[MLA_ROWS];
        for (int tt = 0; tt < MLA_ROWS; tt++) a[tt] = 0.0f;
        for (int d = 0; d < dn; d++) {
            float w = wk[d * wk_row];
#pragma unroll
            for (int tt = 0; tt < MLA_ROWS; tt++)
                if (tt < tb) a[tt] += qn[tt * dn + d] * w;
        }
#pragma unroll
        for (int tt = 0; tt < MLA_ROWS; tt++)
            if (tt < tb) q_lat[((t0 + tt) * nh + h) * c + i] = a[tt];
    }
}

// q_lat [R, c]; q_rope: row t head h at q_rope + t * qr_row + h * qr_head; latent [S, c], k_rope [S, dr];
// mask [T, S] bytes; chunk: keys a block (splits * chunk >= S), walked `tile` keys at a time; part [R, splits, c],
// stats [R, splits, 2] (max, sum). Block b: rows from (b / splits) * MLA_ROWS, keys from (b % splits) * chunk.
//   scores   a warp a key: the lanes split c + dr, each value read once for every row, a shuffle sum a row;
//            masked -inf
//   softmax  a warp a row: the tile's max against the running one, e^(s - max) (masked: 0), the running sum
//            rescaled and added to
//   part     the threads split (latent column, key group), groups = blockDim / c keys apart, the running sums
//            rescaled and added to, the groups summed in order at the end
// Dynamic shared memory: MLA_ROWS * (2 * max(c + dr, blockDim) + tile) floats.
// Whether query row r sees key j: mask[(r / nh) * S + j], or without a mask (null) j <= pos (causal; the cached
// form's block holds one token's rows, at position pos).
__device__ __forceinline__ bool mla_seen(const unsigned char* mask, long long r, int nh, int S, long long j,
                                         long long pos) {
    return mask ? mask[(r / nh) * S + j] != 0 : j <= pos;
}

// One block of strata_mla_partial: rows r0 .. r0 + rb, keys j0 .. j0 + n of latent and k_rope, walked in tiles of
// `tile` keys with an online softmax (a row's running max and sum, its part rescaled by e^(old max - new max), as
// strata_gqa_partial's), so a split's keys are not bounded by shared memory and the splits need not grow with the
// context; part and stats written at column `split` of rows `stride` columns long.
template <typename KV>
__device__ void mla_partial_block(const float* q_lat, const float* q_rope, long long qr_row, long long qr_head,
                                  const KV* latent, const KV* k_rope, const unsigned char* mask, long long pos,
                                  float scale, int nh, int S, int c, int dr, long long r0, int rb, long long j0, int n,
                                  int tile, int split, int stride, float* part, float* stats) {
    extern __shared__ float mla_shared[];  // named apart, as gqa_shared
    __shared__ float run_max[MLA_ROWS], run_sum[MLA_ROWS], rescale[MLA_ROWS];
    int width = c + dr, span = width > (int)blockDim.x ? width : (int)blockDim.x;
    float* qs = mla_shared;                        // [MLA_ROWS][span] the rows' queries (q_lat, q_rope)
    float* acc = mla_shared + MLA_ROWS * span;     // [MLA_ROWS][span] part's running sums, by column group
    float* sc = mla_shared + 2 * MLA_ROWS * span;  // [MLA_ROWS][tile] a tile's scores, then e^(s - max)
    int groups = c <= (int)blockDim.x ? blockDim.x / c : 1;
    for (int i = threadIdx.x; i < rb * width; i += blockDim.x) {
        int rr = i / width, e = i % width;
        long long r = r0 + rr;
        qs[rr * span + e] = e < c ? q_lat[r * c + e] : q_rope[(r / nh) * qr_row + (r % nh) * qr_head + (e - c)];
    }
    for (int i = threadIdx.x; i < MLA_ROWS * span; i += blockDim.x) acc[i] = 0.0f;
    if (threadIdx.x < MLA_ROWS) { run_max[threadIdx.x] = __int_as_float(0xff800000); run_sum[threadIdx.x] = 0.0f; }
    __syncthreads();
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int t0 = 0; t0 < n; t0 += tile) {
        int tn = n - t0 < tile ? n - t0 : tile;
        for (int j = w; j < tn; j += nw) {
            long long key = j0 + t0 + j;
            bool seen = false;
            for (int rr = 0; rr < rb; rr++) seen = seen || mla_seen(mask, r0 + rr, nh, S, key, pos);
            if (!seen) {  // no row sees it (a later token's key in a prompt): no products
                if (lane == 0)
                    for (int rr = 0; rr < rb; rr++) sc[rr * tile + j] = __int_as_float(0xff800000);
                continue;
            }
            float a[MLA_ROWS];
            for (int rr = 0; rr < MLA_ROWS; rr++) a[rr] = 0.0f;
            for (int e = lane; e < c; e += 32) {
                float kv = kv_load(latent, key * c + e);
#pragma unroll
                for (int rr = 0; rr < MLA_ROWS; rr++)
                    if (rr < rb) a[rr] += qs[rr * span + e] * kv;
            }
            for (int e = lane; e < dr; e += 32) {
                float kv = kv_load(k_rope, key * dr + e);
#pragma unroll
                for (int rr = 0; rr < MLA_ROWS; rr++)
                    if (rr < rb) a[rr] += qs[rr * span + c + e] * kv;
            }
#pragma unroll
            for (int rr = 0; rr < MLA_ROWS; rr++) {  // a constant count, so a[] stays in registers
                if (rr < rb) {
                    bool m = mla_seen(mask, r0 + rr, nh, S, key, pos);  // the same for the whole warp: no lane skips a shuffle
                    float s = m ? warp_sum(a[rr]) : 0.0f;
                    if (lane == 0) sc[rr * tile + j] = m ? s * scale : __int_as_float(0xff800000);
                }
            }
        }
        __syncthreads();
        for (int rr = w; rr < rb; rr += nw) {  // a warp a row: the tile's max, e^(s - new max), their sum
            long long r = r0 + rr;
            float* s = sc + rr * tile;
            float mx = __int_as_float(0xff800000);
            for (int j = lane; j < tn; j += 32) mx = fmaxf(mx, s[j]);
            mx = fmaxf(warp_max(mx), run_max[rr]);
            float sum = 0.0f;
            for (int j = lane; j < tn; j += 32) {
                float e = mla_seen(mask, r, nh, S, j0 + t0 + j, pos) ? expf(s[j] - mx) : 0.0f;
                s[j] = e;
                sum += e;
            }
            sum = warp_sum(sum);
            if (lane == 0) {
                float old = run_max[rr];
                rescale[rr] = old == __int_as_float(0xff800000) ? 0.0f : expf(old - mx);
                run_sum[rr] = run_sum[rr] * rescale[rr] + sum;
                run_max[rr] = mx;
            }
        }
        __syncthreads();  // sc[] holds every e, rescale[] each row's
        for (int i = threadIdx.x; i < groups * c; i += blockDim.x) {
            int col = i % c, grp = i / c;
            float a[MLA_ROWS];
            for (int rr = 0; rr < MLA_ROWS; rr++) a[rr] = 0.0f;
            for (int j = grp; j < tn; j += groups) {
                float kv = kv_load(latent, (j0 + t0 + j) * c + col);
#pragma unroll
                for (int rr = 0; rr < MLA_ROWS; rr++)
                    if (rr < rb) a[rr] += sc[rr * tile + j] * kv;
            }
#pragma unroll
            for (int rr = 0; rr < MLA_ROWS; rr++)
                if (rr < rb) acc[rr * span + grp * c + col] = acc[rr * span + grp * c + col] * rescale[rr] + a[rr];
        }
        __syncthreads();
    }
    for (int rr = threadIdx.x; rr < rb; rr += blockDim.x) {
        stats[((r0 + rr) * stride + split) * 2] = run_max[rr];
        stats[((r0 + rr) * stride + split) * 2 + 1] = run_sum[rr];
    }
    for (int i = threadIdx.x; i < rb * c; i += blockDim.x) {
        int rr = i / c, col = i % c;
        float a = 0.0f;
        for (int grp = 0; grp < groups; grp++) a += acc[rr * span + grp * c + col];
        part[((r0 + rr) * stride + split) * c + col] = a;
    }
}

template <typename KV>
__device__ void mla_partial(const float* q_lat, const float* q_rope, long long qr_row, long long qr_head,
                            const KV* latent, const KV* k_rope, const unsigned char* mask, float scale, int R,
                            int nh, int S, int c, int dr, int chunk, int tile, int splits, float* part,
                            float* stats) {
    long long r0 = (long long)(blockIdx.x / splits) * MLA_ROWS;
    int split = blockIdx.x % splits;
    int rb = R - r0 < MLA_ROWS ? (int)(R - r0) : MLA_ROWS;
    long long j0 = (long long)split * chunk;
    int n = S - j0 < chunk ? (int)(S - j0) : chunk;  // this chunk's keys
    mla_partial_block(q_lat, q_rope, qr_row, qr_head, latent, k_rope, mask, 0, scale, nh, S, c, dr, r0, rb, j0, n,
                      tile, split, splits, part, stats);
}
extern "C" __global__ void strata_mla_partial(const float* q_lat, const float* q_rope, long long qr_row,
                                              long long qr_head, const float* latent, const float* k_rope,
                                              const unsigned char* mask, float scale, int R, int nh, int S, int c,
                                              int dr, int chunk, int tile, int splits, float* part, float* stats) {
    mla_partial(q_lat, q_rope, qr_row, qr_head, latent, k_rope, mask, scale, R, nh, S, c, dr, chunk, tile, splits,
                part, stats);
}
extern "C" __global__ void strata_mla_partial_bf16(const float* q_lat, const float* q_rope, long long qr_row,
                                                   long long qr_head, const unsigned short* latent,
                                                   const unsigned short* k_rope, const unsigned char* mask,
                                                   float scale, int R, int nh, int S, int c, int dr, int chunk,
                                                   int tile, int splits, float* part, float* stats) {
    mla_partial(q_lat, q_rope, qr_row, qr_head, latent, k_rope, mask, scale, R, nh, S, c, dr, chunk, tile, splits,
                part, stats);
}

// strata_mla_partial reading where and how far from the device, as strata_gqa_attention_cached: query token t
// belongs to sequence q_seq[t] (-1: a bucket's padding, nothing done) at position q_pos[t]; sequence s's latents
// and rope keys are seq_len[s] rows at lat_ptrs[s], rope_ptrs[s], cut in chunks of chunks[s] keys (the eager
// call's mla_splits, so the same sums). Block b: token b / (hblocks * stride), heads from
// ((b / stride) % hblocks) * MLA_ROWS, chunk b % stride; a chunk past the sequence's keys does nothing. part
// [Nq * nh, stride, c], stats [Nq * nh, stride, 2]. The grid depends on Nq and stride alone.
template <typename KV>
__device__ void mla_partial_cached(const float* q_lat, const float* q_rope, long long qr_row, long long qr_head,
                                   const long long* lat_ptrs, const long long* rope_ptrs, const long long* q_seq,
                                   const long long* q_pos, const long long* seq_len, const long long* chunks,
                                   float scale, int nh, int c, int dr, int tile, int stride, float* part,
                                   float* stats) {
    int hblocks = (nh + MLA_ROWS - 1) / MLA_ROWS, split = blockIdx.x % stride;
    long long t = blockIdx.x / ((long long)hblocks * stride), s = q_seq[t];
    if (s < 0) return;
    int S = (int)seq_len[s], chunk = (int)chunks[s], h0 = (int)((blockIdx.x / stride) % hblocks) * MLA_ROWS;
    long long j0 = (long long)split * chunk;
    if (chunk <= 0 || j0 >= S) return;  // the whole block alike: no thread waits at a barrier alone
    int n = S - j0 < chunk ? (int)(S - j0) : chunk;
    int rb = nh - h0 < MLA_ROWS ? nh - h0 : MLA_ROWS;
    mla_partial_block((const float*)q_lat, q_rope, qr_row, qr_head, (const KV*)lat_ptrs[s], (const KV*)rope_ptrs[s],
                      (const unsigned char*)nullptr, q_pos[t], scale, nh, S, c, dr, t * nh + h0, rb, j0, n, tile,
                      split, stride, part, stats);
}
extern "C" __global__ void strata_mla_partial_cached(const float* q_lat, const float* q_rope, long long qr_row,
                                                     long long qr_head, const long long* lat_ptrs,
                                                     const long long* rope_ptrs, const long long* q_seq,
                                                     const long long* q_pos, const long long* seq_len,
                                                     const long long* chunks, float scale, int nh, int c, int dr,
                                                     int tile, int stride, int bf16, float* part, float* stats) {
    if (bf16) mla_partial_cached<unsigned short>(q_lat, q_rope, qr_row, qr_head, lat_ptrs, rope_ptrs, q_seq, q_pos,
                                                 seq_len, chunks, scale, nh, c, dr, tile, stride, part, stats);
    else mla_partial_cached<float>(q_lat, q_rope, qr_row, qr_head, lat_ptrs, rope_ptrs, q_seq, q_pos, seq_len, chunks,
                                   scale, nh, c, dr, tile, stride, part, stats);
}

// part [R, stride, c], stats [R, stride, 2] (strata_mla_partial's: stride = splits); w_uv_t [nh, c, dv], element
// (h, k, d) at w_uv_t + h * wv_head + k * wv_row + d * wv_col (contiguous, or w_uv's transposed view); out
// [T, nh * dv]. Block b: head b % nh, tokens from (b / nh) * MLA_ROWS. Each chunk weighs e^(max_s - M) (M the
// row's largest max; an all-masked chunk, max -inf, weighs 0): out_lat = sum of w_s part_s / sum of w_s sum_s,
// then a thread a (output dim, column group), groups = blockDim / dv columns apart, summed in group order.
// Token t's chunks: all `stride`, or with q_seq (the cached form) its sequence's ceil(seq_len / chunk), none for
// padding (q_seq -1: zeros out). Dynamic shared memory: MLA_ROWS * (c + max(stride, blockDim, dv)) floats.
__device__ void mla_combine(const float* part, const float* stats, const float* w_uv_t, long long wv_head,
                            long long wv_row, long long wv_col, int T, int nh, int c, int dv, int stride,
                            const long long* q_seq, const long long* seq_len, const long long* chunks, float* out) {
    extern __shared__ float combine_shared[];
    float* ol = combine_shared;                  // [MLA_ROWS][c] the tokens' out_lat
    float* ws = combine_shared + MLA_ROWS * c;   // [MLA_ROWS][stride] the chunks' weights, then the output's sums
    int h = blockIdx.x % nh;
    long long t0 = (long long)(blockIdx.x / nh) * MLA_ROWS;
    int tb = T - t0 < MLA_ROWS ? (int)(T - t0) : MLA_ROWS;
    int ns[MLA_ROWS];  // each token's chunks
    for (int tt = 0; tt < MLA_ROWS; tt++) {
        ns[tt] = stride;
        if (q_seq && tt < tb) {
            long long s = q_seq[t0 + tt], ch = s < 0 ? 0 : chunks[s];
            ns[tt] = ch > 0 ? (int)((seq_len[s] + ch - 1) / ch) : 0;
        }
    }
    for (int i = threadIdx.x; i < tb * stride; i += blockDim.x) {
        int tt = i / stride, s = i % stride;
        if (s >= ns[tt]) continue;
        const float* st = stats + ((t0 + tt) * nh + h) * stride * 2;
        float mx = __int_as_float(0xff800000);
        for (int k = 0; k < ns[tt]; k++) mx = fmaxf(mx, st[2 * k]);
        ws[tt * stride + s] = expf(st[2 * s] - mx);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < tb * c; i += blockDim.x) {
        int tt = i / c, col = i % c;
        long long r = (t0 + tt) * nh + h;
        const float* st = stats + r * stride * 2;
        const float* p = part + r * stride * c + col;
        float a = 0.0f, sum = 0.0f;
        for (int s = 0; s < ns[tt]; s++) {
            float wt = ws[tt * stride + s];
            a += wt * p[(long long)s * c];
            sum += wt * st[2 * s + 1];
        }
        ol[tt * c + col] = ns[tt] ? a / sum : 0.0f;
    }
    __syncthreads();  // ol[] complete; ws[] is free for the sums
    int groups = dv <= (int)blockDim.x ? blockDim.x / dv : 1;
    for (int i = threadIdx.x; i < groups * dv; i += blockDim.x) {
        int d = i % dv, grp = i / dv;
        const float* wv = w_uv_t + h * wv_head + d * wv_col;
        float a[MLA_ROWS];
        for (int tt = 0; tt < MLA_ROWS; tt++) a[tt] = 0.0f;
        for (int k = grp; k < c; k += groups) {
            float w = wv[k * wv_row];
#pragma unroll
            for (int tt = 0; tt < MLA_ROWS; tt++)
                if (tt < tb) a[tt] += ol[tt * c + k] * w;
        }
#pragma unroll
        for (int tt = 0; tt < MLA_ROWS; tt++)
            if (tt < tb) ws[(grp * MLA_ROWS + tt) * dv + d] = a[tt];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < tb * dv; i += blockDim.x) {
        int tt = i / dv, d = i % dv;
        float a = 0.0f;
        for (int grp = 0; grp < groups; grp++) a += ws[(grp * MLA_ROWS + tt) * dv + d];
        out[((t0 + tt) * nh + h) * dv + d] = a;
    }
}
extern "C" __global__ void strata_mla_combine(const float* part, const float* stats, const float* w_uv_t,
                                              long long wv_head, long long wv_row, long long wv_col, int T, int nh,
                                              int c, int dv, int splits, float* out) {
    mla_combine(part, stats, w_uv_t, wv_head, wv_row, wv_col, T, nh, c, dv, splits, nullptr, nullptr, nullptr, out);
}
extern "C" __global__ void strata_mla_combine_cached(const float* part, const float* stats, const float* w_uv_t,
                                                     long long wv_head, long long wv_row, long long wv_col, int T,
                                                     int nh, int c, int dv, int stride, const long long* q_seq,
                                                     const long long* seq_len, const long long* chunks, float* out) {
    mla_combine(part, stats, w_uv_t, wv_head, wv_row, wv_col, T, nh, c, dv, stride, q_seq, seq_len, chunks, out);
}

// Qwen3-Next's Gated DeltaNet over a step's rows (linear_attention.py's advance, then the gated RMSNorm), one
// block a (sequence, value head) walking its sequence's tokens in order. Row t's inputs: qkv [N, row stride]
// (q | k | v before the conv, C channels), z [N, z stride] (the output gate, Hv * dv) and ba [N, ba stride]
// (b [Hv] | a [Hv]). Sequence s
// has rows row_start[s] .. row_start[s + 1] - 1; its state in layer slot `slot` is read from the buffers at
// conv_src[s] ([slots, K-1, C] floats) and rec_src[s] ([slots, Hv, dk, dv]) and written to conv_dst[s],
// rec_dst[s] (other buffers: a step never overwrites what it reads, so the state before it stays for a rewind).
// Per token: the causal conv of this head's q, k (its key head's) and v channels with SiLU; q and k L2-normalised
// (q times `scale`); beta = sigmoid(b), decay = exp(a_neg softplus(a + dt_bias)); then thread j owns column j of
// S [dk, dv]: S = decay S; d = beta (v - Sᵀk); S += k dᵀ; o = Sᵀq; out = rms_norm(o) * norm * silu(z).
// Dynamic shared memory: 2 dk + 2 dv floats.
extern "C" __global__ void strata_gated_delta(const float* qkv, long long qkv_stride, const float* zs,
                                              long long z_stride, const float* ba,
                                              long long ba_stride, const float* taps, const float* a_neg,
                                              const float* dt_bias, const float* norm, float eps, float scale,
                                              const long long* row_start, const long long* conv_src,
                                              const long long* conv_dst, const long long* rec_src,
                                              const long long* rec_dst, int slot, int Hk, int Hv, int dk, int dv,
                                              int K, float* out) {
    extern __shared__ float delta_shared[];
    __shared__ float part[32];
    float* qs = delta_shared;  // [dk] this token's q, then normalised
    float* ks = qs + dk;       // [dk] k
    float* vs = ks + dk;       // [dv] v
    float* os = vs + dv;       // [dv] o, each thread its own columns
    int s = blockIdx.x / Hv, h = blockIdx.x % Hv, kh = h / (Hv / Hk);
    int C = 2 * Hk * dk + Hv * dv, qc = kh * dk, kc = Hk * dk + kh * dk, vc = 2 * Hk * dk + h * dv;
    long long lo = row_start[s], T = row_start[s + 1] - lo;
    long long conv_size = (long long)(K - 1) * C, rec_size = (long long)Hv * dk * dv;
    const float* cs = (const float*)conv_src[s] + slot * conv_size;
    float* cd = (float*)conv_dst[s] + slot * conv_size;
    const float* S_src = (const float*)rec_src[s] + slot * rec_size + (long long)h * dk * dv;
    float* S = (float*)rec_dst[s] + slot * rec_size + (long long)h * dk * dv;
    for (long long t = 0; t < T; t++) {
        long long row = lo + t;
        for (int i = threadIdx.x; i < 2 * dk + dv; i += blockDim.x) {
            int c = i < dk ? qc + i : i < 2 * dk ? kc + i - dk : vc + i - 2 * dk;
            float a = 0.0f;
            for (int j = 0; j < K; j++) {  // tap j reads the input K-1-j tokens back: the conv state, then rows
                long long f = t + j;
                float x = f < K - 1 ? cs[f * C + c] : qkv[(lo + f - (K - 1)) * qkv_stride + c];
                a = j ? a + x * taps[(long long)c * K + j] : x * taps[(long long)c * K];
            }
            delta_shared[i] = a / (1.0f + expf(-a));
        }
        __syncthreads();
        float sq = 0.0f, sk = 0.0f;
        for (int i = threadIdx.x; i < dk; i += blockDim.x) {
            sq += qs[i] * qs[i];
            sk += ks[i] * ks[i];
        }
        sq = block_sum(sq, part);
        sk = block_sum(sk, part);
        float rq = sqrtf(sq + 1e-6f), rk = sqrtf(sk + 1e-6f);
        for (int i = threadIdx.x; i < dk; i += blockDim.x) {
            qs[i] = qs[i] / rq * scale;
            ks[i] = ks[i] / rk;
        }
        __syncthreads();
        const float* br = ba + row * ba_stride;
        float beta = 1.0f / (1.0f + expf(-br[h]));
        float x = br[Hv + h] + dt_bias[h];
        float decay = expf(a_neg[h] * (x > 20.0f ? x : log1pf(expf(x))));
        const float* Sr = t == 0 ? S_src : S;  // the step's first token reads the state before the step
        float ss = 0.0f;
        for (int j = threadIdx.x; j < dv; j += blockDim.x) {
            float kv = 0.0f;
            for (int i = 0; i < dk; i++) kv += Sr[(long long)i * dv + j] * decay * ks[i];
            float d = (vs[j] - kv) * beta;
            float o = 0.0f;
            for (int i = 0; i < dk; i++) {
                float n = Sr[(long long)i * dv + j] * decay + ks[i] * d;
                S[(long long)i * dv + j] = n;
                o += n * qs[i];
            }
            os[j] = o;
            ss += o * o;
        }
        ss = block_sum(ss, part);  // synchronises: every thread is past its columns before the next token's conv
        float r = sqrtf(ss / (float)dv + eps);
        const float* z = zs + row * z_stride + (long long)h * dv;
        float* orow = out + row * (long long)Hv * dv + (long long)h * dv;
        for (int j = threadIdx.x; j < dv; j += blockDim.x)
            orow[j] = (os[j] / r) * norm[j] * (z[j] / (1.0f + expf(-z[j])));
    }
    // the new conv state: the last K-1 inputs; q's and k's channels written by the first of their key head's blocks
    bool qk = h % (Hv / Hk) == 0;
    for (int i = threadIdx.x; i < 2 * dk + dv; i += blockDim.x) {
        if (i < 2 * dk && !qk) continue;
        int c = i < dk ? qc + i : i < 2 * dk ? kc + i - dk : vc + i - 2 * dk;
        for (int r = 0; r < K - 1; r++) {
            long long f = T + r;
            cd[(long long)r * C + c] = f < K - 1 ? cs[f * C + c] : qkv[(lo + f - (K - 1)) * qkv_stride + c];
        }
    }
}

extern "C" __global__ void strata_silu_mul(const float* g, const float* u, long long n, float* out) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = g[i];
    out[i] = v / (1.0f + expf(-v)) * u[i];
}
"""


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


def _gqa_combine(part, stats, S: int, tables, rows: int, nh: int, hd: int, stride: int):
    """strata_gqa_combine: each (row, head)'s splits merged -> [rows, nh*hd]; ``tables`` (q_seq, seq_len) where
    the keys are each sequence's (cached), else S."""
    import cupy

    out = cupy.empty((rows, nh * hd), np.float32)
    q_seq, seq_len = tables if tables is not None else (stats, stats)  # any pointers: not read without tables
    _kernel("strata_gqa_combine")((rows * nh,), (THREADS,), (
        part, stats, np.int32(S), q_seq, seq_len, np.int32(tables is not None), np.int32(nh), np.int32(hd),
        np.int32(stride), out))
    return out


def gqa_attention(q, k, v, mask, scale: float):
    """q [T, nh, hd], k/v [S, nkv, hd], mask [T, S] bool -> [T, nh*hd]: split over the keys (gqa_splits), a block
    a (token, head, split), then the splits merged: two launches. k and v float32, or both bf16 bits (uint16, a
    bf16 cache's): read and widened in the kernel, the result equal to the float32 kernel's on the widened
    values."""
    import cupy

    q = _contiguous_f32(q)
    k, v, bf16 = _kv_pair(k, v)
    T, nh, hd = q.shape
    S, nkv = k.shape[:2]
    if not (T * nh * hd and S):
        return cupy.empty((T, nh * hd), np.float32)
    splits = gqa_splits(S)[0]
    part, stats = cupy.empty((T * nh * splits, hd), np.float32), cupy.empty((T * nh * splits, 2), np.float32)
    m = cupy.ascontiguousarray(mask, dtype=cupy.bool_)
    _kernel("strata_gqa_partial")((T * nh * splits,), (THREADS,), (
        q, k, v, m, np.float32(scale), np.int32(S), np.int32(nh), np.int32(nkv), np.int32(hd), np.int32(splits),
        np.int32(bf16), part, stats), shared_mem=(hd + GQA_TILE + max(THREADS, hd)) * 4)
    return _gqa_combine(part, stats, S, None, T, nh, hd, splits)


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
    return _gqa_combine(part, stats, 0, (q_seq, seq_len), Nq, nh, hd, stride)


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


def mla_attention_absorbed(q_nope, q_rope, latent, k_rope, w_uk, w_uv_t, mask, scale: float, splits=None):
    """Absorbed multi-head latent attention, ops.mla_attention_absorbed's mathematics in three launches.

    q_nope [T, nh, dn], q_rope [T, nh, dr] (rows and heads may lie apart: column slices of q); latent [S, c],
    k_rope [S, dr]: float32, or both bf16 bits (uint16, a bf16 cache's: equal to float32 on the widened values);
    w_uk [nh, dn, c], w_uv_t [nh, c, dv]: float32, any layout read where it lies (views of kv_b's rows,
    w_uv.transpose(0, 2, 1)); w_uk with c, w_uv_t with dv adjacent reads fastest (w_uv [nh, dv, c] transposed
    once at load); mask [T, S] bool -> [T, nh*dv]. ``splits``: chunks of keys (None: mla_splits' choice; the
    tests force several)."""
    import cupy

    T, nh, dn = q_nope.shape
    S, c = latent.shape
    dr, dv = k_rope.shape[1], w_uv_t.shape[2]
    if (q_rope.shape, k_rope.shape, w_uk.shape, w_uv_t.shape[:2], mask.shape) != (
            (T, nh, dr), (S, dr), (nh, dn, c), (nh, c), (T, S)):  # the kernels trust these: a mismatch reads astray
        raise ValueError(f"mla_attention_absorbed: shapes q_nope {q_nope.shape} q_rope {q_rope.shape} latent "
                         f"{latent.shape} k_rope {k_rope.shape} w_uk {w_uk.shape} w_uv_t {w_uv_t.shape} "
                         f"mask {mask.shape}")
    q_nope, qn_row, qn_head = _heads_f32(q_nope)
    q_rope, qr_row, qr_head = _heads_f32(q_rope)
    latent, k_rope, bf16 = _kv_pair(latent, k_rope)
    (w_uk, wk_strides), (w_uv_t, wv_strides) = _strided_f32(w_uk), _strided_f32(w_uv_t)
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
    _kernel("strata_mla_combine")((token_blocks,), (THREADS,), (
        part, stats, w_uv_t, *wv_strides, i32(T), i32(nh), i32(c), i32(dv), i32(splits), out),
        shared_mem=combine_shared * 4)
    return out


def _mla_absorb(q_nope, qn_row, qn_head, w_uk, wk_strides, splits: int, dr: int, dv: int, what: str):
    """The absorbed MLA's first launch and its scratch, shared by the eager and the cached forms: q_lat [R, c] =
    q_nope · W_UK per (token, head), with part [R, splits, c] and stats [R, splits, 2] beside it in one
    allocation; and the shared floats a block of the partial and the combine kernels takes (refused, naming
    ``what``, beyond SHARED_FLOATS). -> (q_lat, part, stats, partial_shared, combine_shared)."""
    import cupy

    T, nh, dn = q_nope.shape
    c = w_uk.shape[2]
    partial_shared = MLA_ROWS * (2 * max(c + dr, THREADS) + mla_chunk_cap(c, dr))
    combine_shared = MLA_ROWS * (c + max(splits, THREADS, dv))
    if max(partial_shared, combine_shared, MLA_ROWS * dn) > SHARED_FLOATS:
        raise ValueError(f"{what} need more than {SHARED_FLOATS * 4} bytes of shared memory a block")
    R = T * nh
    scratch = cupy.empty(R * c + R * splits * (c + 2), np.float32)  # one allocation: q_lat, part, stats
    q_lat = scratch[: R * c]  # [R, c]
    _kernel("strata_mla_q_absorb")((nh * -(-T // MLA_ROWS),), (THREADS,), (
        q_nope, qn_row, qn_head, w_uk, *wk_strides, np.int32(T), np.int32(nh), np.int32(dn), np.int32(c), q_lat),
        shared_mem=MLA_ROWS * dn * 4)
    return q_lat, scratch[R * c : R * c + R * splits * c], scratch[R * c + R * splits * c :], partial_shared, \
        combine_shared


def mla_attention_absorbed_cached(q_nope, q_rope, tables, w_uk, w_uv_t, scale: float, max_keys: int, bf16: bool):
    """mla_attention_absorbed with each query token over its own sequence's cache, where and how far read from the
    device (as gqa_attention_cached): ``tables`` (lat_ptrs, rope_ptrs [B] int64 addresses of the layer's cache
    buffers (latents [cap, c], rope keys [cap, dr]), q_seq, q_pos [Nq], seq_len [B], chunks [B]: each sequence's
    mla_splits chunk for its eager call, so the sums are the eager call's, bit for bit); the mask (causal) made in
    the kernel. ``max_keys``: the longest a cache may be (mla_max_splits: the grid). Every launch's grid and
    arguments depend on Nq and max_keys alone. -> [Nq, nh*dv]."""
    import cupy

    Nq, nh, dn = q_nope.shape
    c, dr, dv = w_uk.shape[2], q_rope.shape[2], w_uv_t.shape[2]
    if (q_rope.shape[:2], w_uk.shape[:2], w_uv_t.shape[:2]) != ((Nq, nh), (nh, dn), (nh, c)):
        raise ValueError(f"mla_attention_absorbed_cached: shapes q_nope {q_nope.shape} q_rope {q_rope.shape} "
                         f"w_uk {w_uk.shape} w_uv_t {w_uv_t.shape}")
    lat_ptrs, rope_ptrs, q_seq, q_pos, seq_len, chunks = tables
    q_nope, qn_row, qn_head = _heads_f32(q_nope)
    q_rope, qr_row, qr_head = _heads_f32(q_rope)
    (w_uk, wk_strides), (w_uv_t, wv_strides) = _strided_f32(w_uk), _strided_f32(w_uv_t)
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
    _kernel("strata_mla_combine_cached")((token_blocks,), (THREADS,), (
        part, stats, w_uv_t, *wv_strides, i32(Nq), i32(nh), i32(c), i32(dv), i32(stride), q_seq, seq_len, chunks,
        out), shared_mem=combine_shared * 4)
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
