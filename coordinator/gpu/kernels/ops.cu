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
// A query row's keys go to gqa_splits(keys) splits of `chunk` keys, keys the row's own count (its position + 1, or
// the last key its mask row sees + 1: row_keys), never the step's S: a row splits its keys as it does decoded
// alone, whatever rows and keys are beside it (batch invariance; the keys past its own are masked anyway). A
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
// The keys a query row sees up to its last: the last nonzero of its mask row + 1 (0 if none), the block agreeing.
__device__ int row_keys(const unsigned char* m, int S, float* red) {
    float last = 0.0f;
    for (int j = threadIdx.x; j < S; j += blockDim.x)
        if (m[j]) last = fmaxf(last, (float)(j + 1));  // exact: S < 2^24
    return (int)block_max(last, red);
}
template <typename KV>
__device__ void gqa_partial(const float* qr, const KV* k, const KV* v, const unsigned char* m, int pos, int window,
                            float scale, int S, int split, int g, int nkv, int hd, float* part, float* stat) {
    extern __shared__ float gqa_shared[];  // named apart: a C++ function's and the kernels' would clash
    __shared__ float red[32];
    float* qs = gqa_shared;                  // [hd] the query row
    float* sc = gqa_shared + hd;             // [GQA_TILE] a tile's scores, then its e^(s - max)
    float* acc = gqa_shared + hd + GQA_TILE; // [groups * hd] the output's running partial sums
    int keys = m ? row_keys(m, S, red) : min(S, pos + 1);
    int chunk, splits = gqa_splits(keys, &chunk);
    if (split >= splits) return;  // the grid is sized for the longest row: nothing here
    int lo = split * chunk, hi = min(keys, lo + chunk);
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
// max; a block a (token, head). The row's keys as the partials counted them: from its mask row [S] (eager), or,
// `cached`, its position q_pos[t] + 1 within its sequence's seq_len[q_seq[t]] keys.
extern "C" __global__ void strata_gqa_combine(const float* part, const float* stats, const unsigned char* mask,
                                              int S, const long long* q_seq, const long long* q_pos,
                                              const long long* seq_len, int cached, int nh, int hd, int stride,
                                              float* out) {
    __shared__ float red[32];
    long long row = blockIdx.x, t = row / nh;
    int keys = cached ? min((int)seq_len[q_seq[t]], (int)q_pos[t] + 1) : row_keys(mask + t * S, S, red);
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
// and rope keys are seq_len[s] rows at lat_ptrs[s], rope_ptrs[s]; token t reads its keys up to its own
// (min(seq_len[s], q_pos[t] + 1): the later ones are masked) cut in chunks of chunks[t] keys (its eager call's
// mla_splits, so the same sums: the sequence's rows' call's, or with batch invariance its own alone's). Block b: token b / (hblocks * stride), heads from
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
    int S = (int)min(seq_len[s], q_pos[t] + 1), chunk = (int)chunks[t];
    int h0 = (int)((blockIdx.x / stride) % hblocks) * MLA_ROWS;
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
// Token t's chunks: all `stride`, or with q_seq (the cached form) ceil(its keys / chunks[t]), its keys
// min(seq_len[s], q_pos[t] + 1), none for padding (q_seq -1: zeros out). Dynamic shared memory: MLA_ROWS * (c + max(stride, blockDim, dv)) floats.
__device__ void mla_combine(const float* part, const float* stats, const float* w_uv_t, long long wv_head,
                            long long wv_row, long long wv_col, int T, int nh, int c, int dv, int stride,
                            const long long* q_seq, const long long* q_pos, const long long* seq_len,
                            const long long* chunks, int lat_out, float* out) {
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
            long long s = q_seq[t0 + tt], ch = s < 0 ? 0 : chunks[t0 + tt];
            long long keys = s < 0 ? 0 : min(seq_len[s], q_pos[t0 + tt] + 1);
            ns[tt] = ch > 0 ? (int)((keys + ch - 1) / ch) : 0;
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
    if (lat_out) {  // out [T * nh, c]: out_lat itself, W_uv applied by the caller (a compact kv_b's rows)
        for (int i = threadIdx.x; i < tb * c; i += blockDim.x)
            out[((t0 + i / c) * nh + h) * c + i % c] = ol[i];
        return;
    }
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
                                              int c, int dv, int splits, int lat_out, float* out) {
    mla_combine(part, stats, w_uv_t, wv_head, wv_row, wv_col, T, nh, c, dv, splits, nullptr, nullptr, nullptr,
                nullptr, lat_out, out);
}
extern "C" __global__ void strata_mla_combine_cached(const float* part, const float* stats, const float* w_uv_t,
                                                     long long wv_head, long long wv_row, long long wv_col, int T,
                                                     int nh, int c, int dv, int stride, const long long* q_seq,
                                                     const long long* q_pos, const long long* seq_len,
                                                     const long long* chunks, int lat_out, float* out) {
    mla_combine(part, stats, w_uv_t, wv_head, wv_row, wv_col, T, nh, c, dv, stride, q_seq, q_pos, seq_len, chunks,
                lat_out, out);
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
