"""Fused CuPy kernels for the decoder's small per-row ops: one launch where CuPy's array calls take five to ten.

At decode a layer's rows are one token, so the device side is bound by calls, not
arithmetic: each CuPy call costs tens of microseconds on the host whatever its size,
and rms_norm, RoPE, the masked softmax, the router and silu take several calls each.
Each of those is one kernel here (and the router's top-k runs on the host, on logits
copied once); ops.py calls them for CuPy arrays and keeps its NumPy forms (and host_ops'
compiled loops) for the host. Results equal the NumPy forms to float32 rounding
(tests/test_gpu.py, against float64). A layer's attention is one launch too (CuPy's
batched matmuls over broadcast, transposed operands cost more than the projections):
one launch for up to ops.DEVICE_ATTENTION_TOKENS query tokens, q/k norm and RoPE one
launch each reading the fused QKV output in place (decoder.fuse_qkv: one matmul
for the three projections), and each residual add joins the norm after it.
Those four were written without a GPU at hand: tests/test_device_kernels.py
checks them against float64 through tests/cuda_emulator.py (the same source
built for the CPU) and, on a GPU, through CuPy.

    rms_norm(x [..., D], weight [D], eps)             -> [..., D]    one block a row
    add_rms_norm(h, delta [..., D], weight, eps)      -> (h + delta, rms_norm(h + delta))
    apply_rope(x [T, heads, hd], cos [T, d], sin)     -> [T, heads, hd], d <= hd (the rest passed through)
    norm_rope(x [T, heads, hd], weight|None, eps, cos, sin) -> apply_rope(rms_norm(x)), x's rows may lie apart
    masked_softmax(scores [R, T, S], mask [T, S], s)  -> softmax(where(mask, scores * s, -inf)) over S
    gqa_attention(q [T, nh, hd], k/v [S, nkv, hd], mask [T, S], s) -> [T, nh*hd]   one block a (token, head)
    silu_mul(g, u)                                    -> g * sigmoid(g) * u, elementwise

All take float32 arrays (mask: bool) and return new C-contiguous arrays; the
joined kernels repeat the separate ones' arithmetic, so their results are equal.
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

// Attention of T query tokens over S keys, heads sharing KV heads in groups of nh / nkv.
// q [T, nh, hd]; k, v [S, nkv, hd]; mask [T, S] bytes, nonzero where the key is seen; out [T, nh * hd];
// scores [T * nh, S] scratch. One block a (token, head):
//   scores   a warp a key: the lanes split hd, a shuffle sum; masked keys -inf
//   softmax  block max, e^(s - max) (masked: 0), block sum (strata_masked_softmax's arithmetic)
//   output   the threads split (dim, key group): groups = blockDim / hd keys apart, summed in group order
// Dynamic shared memory: hd + max(blockDim, hd) floats.
extern "C" __global__ void strata_gqa_attention(const float* q, const float* k, const float* v,
                                                const unsigned char* mask, float scale, int S, int nh, int nkv,
                                                int hd, float* scores, float* out) {
    extern __shared__ float shared[];
    __shared__ float part[32];
    float* qs = shared;       // [hd] the query row
    float* acc = shared + hd; // [groups * hd] the output's partial sums
    long long t = blockIdx.x / nh;
    int h = blockIdx.x % nh, g = h / (nh / nkv);
    const float* qr = q + (long long)blockIdx.x * hd;
    for (int j = threadIdx.x; j < hd; j += blockDim.x) qs[j] = qr[j];
    __syncthreads();
    float* sc = scores + (long long)blockIdx.x * S;
    const unsigned char* m = mask + t * S;
    long long kv_row = (long long)nkv * hd;
    const float* kh = k + (long long)g * hd;
    const float* vh = v + (long long)g * hd;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int j = w; j < S; j += nw) {
        if (!m[j]) {  // the same j for the whole warp: no lane waits in a shuffle another skips
            if (lane == 0) sc[j] = __int_as_float(0xff800000);
            continue;
        }
        const float* kr = kh + j * kv_row;
        float a = 0.0f;
        for (int d = lane; d < hd; d += 32) a += qs[d] * kr[d];
        a = warp_sum(a);
        if (lane == 0) sc[j] = a * scale;
    }
    __syncthreads();
    float mx = __int_as_float(0xff800000);
    for (int j = threadIdx.x; j < S; j += blockDim.x) mx = fmaxf(mx, sc[j]);
    mx = block_max(mx, part);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < S; j += blockDim.x) {
        float e = m[j] ? expf(sc[j] - mx) : 0.0f;
        sc[j] = e;
        sum += e;
    }
    sum = block_sum(sum, part);  // synchronises: sc[] holds every e
    int groups = hd <= blockDim.x ? blockDim.x / hd : 1;
    for (int i = threadIdx.x; i < groups * hd; i += blockDim.x) {
        int d = i % hd, grp = i / hd;
        float a = 0.0f;
        for (int j = grp; j < S; j += groups) a += sc[j] * vh[j * kv_row + d];
        acc[grp * hd + d] = a;
    }
    __syncthreads();
    float* o = out + (long long)blockIdx.x * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = 0.0f;
        for (int grp = 0; grp < groups; grp++) a += acc[grp * hd + d];
        o[d] = a / sum;
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
    return _module().get_function(name)


@functools.lru_cache(maxsize=None)
def _module():
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


def gqa_attention(q, k, v, mask, scale: float):
    """q [T, nh, hd], k/v [S, nkv, hd], mask [T, S] bool -> [T, nh*hd]: one launch, a block a (token, head)."""
    import cupy

    q, k, v = _contiguous_f32(q), _contiguous_f32(k), _contiguous_f32(v)
    T, nh, hd = q.shape
    S, nkv = k.shape[:2]
    out = cupy.empty((T, nh * hd), np.float32)
    if out.size and S:
        scores = cupy.empty((T * nh, S), np.float32)
        m = cupy.ascontiguousarray(mask, dtype=cupy.bool_)
        _kernel("strata_gqa_attention")((T * nh,), (THREADS,), (
            q, k, v, m, np.float32(scale), np.int32(S), np.int32(nh), np.int32(nkv), np.int32(hd), scores, out),
            shared_mem=(hd + max(THREADS, hd)) * 4)
    return out
