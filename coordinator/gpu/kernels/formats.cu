constexpr int MAX_TOKENS = @MAX_TOKENS@;

// IEEE half bits -> float32, exactly as NumPy's float16 -> float32 (subnormals, infinities and NaNs kept)
__device__ __forceinline__ float half_to_float(unsigned h) {
    unsigned sign = (h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 1023u;
    if (e == 31u) return __uint_as_float(sign | 0x7f800000u | m << 13);
    if (e == 0u) return __uint_as_float(sign | __float_as_uint((float)m * 5.9604644775390625e-8f));  // m 2^-24
    return __uint_as_float(sign | (e + 112u) << 23 | m << 13);
}
// read-only loads of 16, 8 and 2 bytes into 32-bit words (p aligned to the width)
__device__ __forceinline__ void load16(const unsigned char* p, unsigned* u) {
    uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    u[0] = v.x; u[1] = v.y; u[2] = v.z; u[3] = v.w;
}
__device__ __forceinline__ void load8(const unsigned char* p, unsigned* u) {
    uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    u[0] = v.x; u[1] = v.y;
}
__device__ __forceinline__ unsigned load2(const unsigned char* p) {
    return __ldg(reinterpret_cast<const unsigned short*>(p));
}
__device__ __forceinline__ unsigned byte_of(const unsigned* u, int i) { return (u[i >> 2] >> 8 * (i & 3)) & 255u; }

// A reader: CHUNK weights (a multiple of 4) a call; decode(row, K, c, w) writes weights [c CHUNK, (c + 1) CHUNK)
// of a stored row into w. Chunks past K (f32, bf16 only) read the row's zero padding.

// f32.py: K float32
struct Reader_f32 {
    static constexpr int CHUNK = 4;
    static __device__ __forceinline__ void decode(const unsigned char* row, int, int c, float* w) {
        unsigned u[4];
        load16(row + 16 * c, u);
#pragma unroll
        for (int i = 0; i < 4; i++) w[i] = __uint_as_float(u[i]);
    }
};

// bf16.py: K bfloat16 (uint16), each the top half of a float32
struct Reader_bf16 {
    static constexpr int CHUNK = 8;
    static __device__ __forceinline__ void decode(const unsigned char* row, int, int c, float* w) {
        unsigned u[4];
        load16(row + 16 * c, u);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            w[2 * i] = __uint_as_float(u[i] << 16);
            w[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
        }
    }
};

// q8.py: K int8 values, then K / 32 float16 scales; weight i = q[i] * d[i / 32]. A chunk: half a block.
struct Reader_q8 {
    static constexpr int CHUNK = 16;
    static __device__ __forceinline__ void decode(const unsigned char* row, int K, int c, float* w) {
        unsigned u[4];
        load16(row + 16 * c, u);
        float d = half_to_float(load2(row + K + 2 * (c >> 1)));
#pragma unroll
        for (int i = 0; i < 16; i++) w[i] = __fmul_rn((float)(signed char)byte_of(u, i), d);
    }
};

// q4.py: 16 bytes a block of 32 (byte j: q[j] + 8 low, q[j + 16] + 8 high), then K / 32 float16 scales
struct Reader_q4 {
    static constexpr int CHUNK = 32;
    static __device__ __forceinline__ void decode(const unsigned char* row, int K, int c, float* w) {
        unsigned u[4];
        load16(row + 16 * c, u);
        float d = half_to_float(load2(row + K / 2 + 2 * c));
#pragma unroll
        for (int j = 0; j < 16; j++) {
            int b = (int)byte_of(u, j);
            w[j] = __fmul_rn((float)((b & 15) - 8), d);
            w[j + 16] = __fmul_rn((float)((b >> 4) - 8), d);
        }
    }
};

// q4k.py's 12 scale bytes s (bytes 0-7 in lo, 8-11 in hi) -> group j's 6-bit (sc, m); Q5_K packs them alike
__device__ __forceinline__ void k_scale_min(unsigned long long lo, unsigned hi, int j, float& sc, float& m) {
    unsigned s, n;
    if (j < 4) {
        s = (unsigned)(lo >> 8 * j) & 63u;
        n = (unsigned)(lo >> (8 * j + 32)) & 63u;
    } else {
        unsigned t = hi >> 8 * (j - 4);
        s = (t & 15u) | ((unsigned)(lo >> (8 * (j - 4) + 6)) & 3u) << 4;
        n = ((t >> 4) & 15u) | ((unsigned)(lo >> (8 * j + 6)) & 3u) << 4;
    }
    sc = (float)s;
    m = (float)n;
}

// q4k.py: 144-byte super-blocks of 256 (d, dmin, 12 scale bytes, 4 runs of 32 nibble pairs).
// A chunk: run k, groups 2k (low nibbles) and 2k + 1 (high); weight = (d sc) q - (dmin m).
struct Reader_q4k {
    static constexpr int CHUNK = 64;
    static __device__ __forceinline__ void decode(const unsigned char* row, int, int c, float* w) {
        const unsigned char* b = row + 144 * (c >> 2);
        int k = c & 3;
        unsigned h[4], q[8];
        load16(b, h);
        load16(b + 16 + 32 * k, q);
        load16(b + 32 + 32 * k, q + 4);
        float d = half_to_float(h[0] & 0xffffu), dmin = half_to_float(h[0] >> 16), sc, m;
        unsigned long long lo = h[1] | (unsigned long long)h[2] << 32;
#pragma unroll
        for (int part = 0; part < 2; part++) {
            k_scale_min(lo, h[3], 2 * k + part, sc, m);
            float scale = __fmul_rn(d, sc), offset = __fmul_rn(dmin, m);
#pragma unroll
            for (int i = 0; i < 32; i++)
                w[32 * part + i] = __fsub_rn(__fmul_rn(scale, (float)((byte_of(q, i) >> 4 * part) & 15u)), offset);
        }
    }
};

// q5k.py: 176-byte super-blocks (d, dmin, 12 scale bytes, 32 bytes qh, 4 runs of 32 nibble pairs); q4k's
// chunks, each weight's fifth bit from qh (bit j of byte i for weight 32 j + i)
struct Reader_q5k {
    static constexpr int CHUNK = 64;
    static __device__ __forceinline__ void decode(const unsigned char* row, int, int c, float* w) {
        const unsigned char* b = row + 176 * (c >> 2);
        int k = c & 3;
        unsigned h[4], qh[8], q[8];
        load16(b, h);
        load16(b + 16, qh);
        load16(b + 32, qh + 4);
        load16(b + 48 + 32 * k, q);
        load16(b + 64 + 32 * k, q + 4);
        float d = half_to_float(h[0] & 0xffffu), dmin = half_to_float(h[0] >> 16), sc, m;
        unsigned long long lo = h[1] | (unsigned long long)h[2] << 32;
#pragma unroll
        for (int part = 0; part < 2; part++) {
            int j = 2 * k + part;
            k_scale_min(lo, h[3], j, sc, m);
            float scale = __fmul_rn(d, sc), offset = __fmul_rn(dmin, m);
#pragma unroll
            for (int i = 0; i < 32; i++) {
                unsigned v = ((byte_of(q, i) >> 4 * part) & 15u) | ((byte_of(qh, i) >> j) & 1u) << 4;
                w[32 * part + i] = __fsub_rn(__fmul_rn(scale, (float)v), offset);
            }
        }
    }
};

// q6k.py: 210-byte super-blocks (ql 128, qh 64, int8 scales 16, float16 d), only 2-byte aligned: 2-byte loads.
// A chunk: the 32 weights 128 h + 32 k + i; weight = (d scales[w / 16]) (q - 32).
struct Reader_q6k {
    static constexpr int CHUNK = 32;
    static __device__ __forceinline__ void decode(const unsigned char* row, int, int c, float* w) {
        const unsigned char* b = row + 210 * (c >> 3);
        int h = (c >> 2) & 1, k = c & 3;
        const unsigned char* ql = b + 64 * h + 32 * (k & 1);  // low nibbles for k < 2, high for k >= 2
        const unsigned char* qh = b + 128 + 32 * h;           // bits 2k, 2k + 1
        unsigned s = load2(b + 192 + 8 * h + 2 * k);          // the two groups' int8 scales
        float d = half_to_float(load2(b + 208));
        float scale0 = __fmul_rn(d, (float)(signed char)(s & 255u));
        float scale1 = __fmul_rn(d, (float)(signed char)(s >> 8));
#pragma unroll
        for (int p = 0; p < 16; p++) {
            unsigned l = load2(ql + 2 * p) >> 4 * (k >> 1), u = load2(qh + 2 * p) >> 2 * k;
#pragma unroll
            for (int e = 0; e < 2; e++) {
                int q = (int)(((l >> 8 * e) & 15u) | ((u >> 8 * e) & 3u) << 4) - 32;
                w[2 * p + e] = __fmul_rn(p < 8 ? scale0 : scale1, (float)q);
            }
        }
    }
};

// iq4xs.py: 136-byte super-blocks (d, scales_h, scales_l, 8 groups of 16 index bytes), 8-byte aligned: 8-byte
// loads. A chunk: group j; weight = (d (scale_j - 32)) KVALUES[index].
__device__ __forceinline__ float iq4nl(unsigned i) {  // KVALUES[i], packed into two 64-bit words
    unsigned long long v = i < 8 ? @IQ4NL_LO@ull : @IQ4NL_HI@ull;
    return (float)(signed char)(unsigned)(v >> 8 * (i & 7));
}
struct Reader_iq4xs {
    static constexpr int CHUNK = 32;
    static __device__ __forceinline__ void decode(const unsigned char* row, int, int c, float* w) {
        const unsigned char* b = row + 136 * (c >> 3);
        int j = c & 7;
        unsigned h[2], q[4];
        load8(b, h);
        load8(b + 8 + 16 * j, q);
        load8(b + 16 + 16 * j, q + 2);
        int scale = (int)(((h[1] >> 4 * j) & 15u) | ((h[0] >> (16 + 2 * j)) & 3u) << 4);
        float dl = __fmul_rn(half_to_float(h[0] & 0xffffu), (float)(scale - 32));
#pragma unroll
        for (int i = 0; i < 16; i++) {
            w[i] = __fmul_rn(dl, iq4nl(byte_of(q, i) & 15u));
            w[i + 16] = __fmul_rn(dl, iq4nl(byte_of(q, i) >> 4));
        }
    }
};

// A lane's part of row . x[t] for t < T: chunks lane, lane + 32, ...; each weight's products in row order.
template <class F>
__device__ __forceinline__ void row_dot(const unsigned char* row, int K, const float* x, int T, float* acc) {
    bool vec = (K & 3) == 0 && ((unsigned long long)x & 15u) == 0;  // every token's chunk is float4 aligned
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; t++) acc[t] = 0.0f;
    int chunks = (K + F::CHUNK - 1) / F::CHUNK;
    for (int c = threadIdx.x & 31; c < chunks; c += 32) {
        float w[F::CHUNK];
        F::decode(row, K, c, w);
        int base = c * F::CHUNK;
        bool whole = base + F::CHUNK <= K;
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; t++) {
            if (t >= T) break;
            const float* xt = x + (long long)t * K + base;
            if (whole) {
#pragma unroll
                for (int i = 0; i < F::CHUNK; i += 4) {
                    float4 v = vec ? __ldg(reinterpret_cast<const float4*>(xt + i))
                                   : make_float4(xt[i], xt[i + 1], xt[i + 2], xt[i + 3]);
                    acc[t] = fmaf(w[i], v.x, acc[t]);
                    acc[t] = fmaf(w[i + 1], v.y, acc[t]);
                    acc[t] = fmaf(w[i + 2], v.z, acc[t]);
                    acc[t] = fmaf(w[i + 3], v.w, acc[t]);
                }
            } else {  // the last chunk of an f32 or bf16 row whose K is not a multiple of CHUNK
#pragma unroll
                for (int i = 0; i < F::CHUNK; i++)
                    if (base + i < K) acc[t] = fmaf(w[i], xt[i], acc[t]);
            }
        }
    }
}

// out [T, R] = (x [T, K] . W^T + bias [R]) + residual [T, R]; a warp a row, WARPS rows a block
template <class F>
__device__ void matvec(const unsigned char* w, long long stride, int R, int K, const float* x, int T,
                       const float* bias, int has_bias, const float* residual, int has_residual, float* out) {
    int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= R) return;  // the whole warp: no lane waits in a shuffle another skips
    float acc[MAX_TOKENS];
    row_dot<F>(w + r * stride, K, x, T, acc);
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; t++) {
        if (t >= T) break;
        float s = warp_sum(acc[t]);
        if ((threadIdx.x & 31) == 0) {
            if (has_bias) s = s + bias[r];
            if (has_residual) s = s + residual[(long long)t * R + r];
            out[(long long)t * R + r] = s;
        }
    }
}

// out [P, R]: slot p = x[slot_rows[p]] . (matrix table[slot_matrix[p]])^T; blocks run (slot, WARPS rows)
template <class F>
__device__ void grouped_matvec(const unsigned long long* table, long long stride, int R, int K, const float* x,
                               const int* slot_rows, const int* slot_matrix, float* out) {
    int warps = blockDim.x >> 5, groups = (R + warps - 1) / warps;
    int p = blockIdx.x / groups, r = (blockIdx.x % groups) * warps + (threadIdx.x >> 5);
    if (r >= R) return;
    const unsigned char* w = reinterpret_cast<const unsigned char*>(table[slot_matrix[p]]);
    float acc[MAX_TOKENS];
    row_dot<F>(w + r * stride, K, x + (long long)slot_rows[p] * K, 1, acc);
    float s = warp_sum(acc[0]);
    if ((threadIdx.x & 31) == 0) out[(long long)p * R + r] = s;
}

// out [rows, K] float32: a warp a row, its lanes a chunk each in turn
template <class F>
__device__ void dequantize(const unsigned char* w, long long stride, int rows, int K, float* out) {
    int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) return;
    int chunks = (K + F::CHUNK - 1) / F::CHUNK;
    float* o = out + (long long)r * K;
    for (int c = threadIdx.x & 31; c < chunks; c += 32) {
        float v[F::CHUNK];
        F::decode(w + r * stride, K, c, v);
#pragma unroll
        for (int i = 0; i < F::CHUNK; i++)
            if (c * F::CHUNK + i < K) o[c * F::CHUNK + i] = v[i];
    }
}

// MLA's absorbed attention reading a compact kv_b [nh * head_rows, K] (a head's rows: W_uk's n, then W_uv's):
// out [T * nh, K]: out[t * nh + h] = the sum over d < n, in order, of x[t, h, d] * row (h * head_rows + d), the
// rows read through the format's reader (the float32 strata_mla_q_absorb reads, summed as it sums); x row t head h
// at x + t * x_row + h * x_head. A block a head and ABSORB_ROWS tokens, a thread a (token, chunk of columns).
// Dynamic shared memory: ABSORB_ROWS * n floats.
#define ABSORB_ROWS 8
template <class F>
__device__ void absorb_rows(const unsigned char* w, long long stride, int head_rows, int n, int K, const float* x,
                            long long x_row, long long x_head, int T, int nh, float* out) {
    extern __shared__ float xs[];  // [ABSORB_ROWS][n] the tokens' x rows of head h
    int h = blockIdx.x % nh;
    long long t0 = (long long)(blockIdx.x / nh) * ABSORB_ROWS;
    int tb = T - t0 < ABSORB_ROWS ? (int)(T - t0) : ABSORB_ROWS;
    for (int i = threadIdx.x; i < tb * n; i += blockDim.x) xs[i] = x[(t0 + i / n) * x_row + h * x_head + i % n];
    __syncthreads();
    int chunks = (K + F::CHUNK - 1) / F::CHUNK;
    for (int i = threadIdx.x; i < tb * chunks; i += blockDim.x) {
        int tt = i / chunks, c = i % chunks;
        float a[F::CHUNK];
#pragma unroll
        for (int j = 0; j < F::CHUNK; j++) a[j] = 0.0f;
        for (int d = 0; d < n; d++) {
            float wv[F::CHUNK];
            F::decode(w + ((long long)h * head_rows + d) * stride, K, c, wv);
            float q = xs[tt * n + d];
#pragma unroll
            for (int j = 0; j < F::CHUNK; j++) a[j] += q * wv[j];
        }
        float* o = out + ((t0 + tt) * nh + h) * K + (long long)c * F::CHUNK;
#pragma unroll
        for (int j = 0; j < F::CHUNK; j++)
            if (c * F::CHUNK + j < K) o[j] = a[j];
    }
}
// out [rows, R]: row r (head r % nh) = x [rows, K]'s row r . (rows first .. first + R of head h's block of
// head_rows)^T; grouped_matvec's row sum, the matrix a head's rows of one stored matrix. Blocks run (row, WARPS
// output rows).
template <class F>
__device__ void head_rows_matvec(const unsigned char* w, long long stride, int head_rows, int first, int R, int K,
                                 const float* x, int nh, float* out) {
    int warps = blockDim.x >> 5, groups = (R + warps - 1) / warps;
    long long r = blockIdx.x / groups;
    int v = (blockIdx.x % groups) * warps + (threadIdx.x >> 5);
    if (v >= R) return;
    float acc[MAX_TOKENS];
    row_dot<F>(w + ((long long)(r % nh) * head_rows + first + v) * stride, K, x + r * K, 1, acc);
    float s = warp_sum(acc[0]);
    if ((threadIdx.x & 31) == 0) out[r * R + v] = s;
}
