"""Fused CuPy kernels for the decoder's small per-row ops: one launch where CuPy's array calls take five to ten.

At decode a layer's rows are one token, so the device side is bound by calls, not
arithmetic: each CuPy call costs tens of microseconds on the host whatever its size.
Measured on an H200 (deep preset: 48 layers, hidden 512, `strata bench --device cuda`,
2026-12-04) the CuPy decoder spent about 3.5 ms a layer outside the pool, a 192 ms
decode step, most of it in the ~100 array calls a layer of rms_norm (6 calls), RoPE
(6), the masked softmax (8), the router (14) and silu (5). Each of those is one
kernel here (and the router's top-k runs on the host, on logits copied once);
ops.py calls them for CuPy arrays and keeps its NumPy forms (and host_ops'
compiled loops) for the host. Results equal the NumPy forms to float32 rounding
(tests/test_gpu.py, against float64). With them the same bench decoded at 13.8
instead of 5.2 tok/s (a 72 ms step; two lent machines of the same kind, not one
run); what is left is mostly gqa_attention's
batched matmuls over broadcast, transposed operands (about 450 µs a layer under
cProfile), a case for one decode-attention kernel.

    rms_norm(x [..., D], weight [D], eps)             -> [..., D]    one block a row
    apply_rope(x [T, heads, hd], cos [T, d], sin)     -> [T, heads, hd], d <= hd (the rest passed through)
    masked_softmax(scores [R, T, S], mask [T, S], s)  -> softmax(where(mask, scores * s, -inf)) over S
    silu_mul(g, u)                                    -> g * sigmoid(g) * u, elementwise

All take float32 arrays (mask: bool) and return new C-contiguous arrays.
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

// x, out [T, heads, hd]; cos, sin [T, d]: the first d dims of each head rotated in halves, the rest copied
extern "C" __global__ void strata_rope(const float* x, const float* cos, const float* sin, int heads, int hd,
                                       int d, long long n, float* out) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    int j = (int)(i % hd);
    long long t = i / hd / heads;
    if (j >= d) { out[i] = x[i]; return; }
    int half = d / 2;
    float rotated = j < half ? -x[i + half] : x[i - half];
    out[i] = x[i] * cos[t * d + j] + rotated * sin[t * d + j];
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
    """x [T, heads, hd]; cos, sin [T, d] with d <= hd, d even."""
    import cupy

    x = _contiguous_f32(x)
    T, heads, hd = x.shape
    out = cupy.empty_like(x)
    if x.size:
        grid, block = _elementwise_grid(x.size)
        _kernel("strata_rope")(grid, block, (x, _contiguous_f32(cos), _contiguous_f32(sin), np.int32(heads),
                                             np.int32(hd), np.int32(cos.shape[-1]), np.int64(x.size), out))
    return out


def silu_mul(g, u):
    import cupy

    g, u = _contiguous_f32(g), _contiguous_f32(u)
    out = cupy.empty_like(g)
    if g.size:
        grid, block = _elementwise_grid(g.size)
        _kernel("strata_silu_mul")(grid, block, (g, u, np.int64(g.size), out))
    return out
