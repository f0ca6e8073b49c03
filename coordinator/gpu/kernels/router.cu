#define NO_EXPERT 0x7fffffff

// e^x in float32: node_worker/kernels/silu.exp's operations one for one (--fmad=false: none fused)
__device__ __forceinline__ float router_exp(float x) {
    x = fminf(fmaxf(x, -EXP_LIMIT), EXP_LIMIT);
    float n = floorf(x * EXP_LOG2E + 0.5f);
    float r = x - n * EXP_C1 - n * EXP_C2;
    float p = ((((EXP_P0 * r + EXP_P1) * r + EXP_P2) * r + EXP_P3) * r + EXP_P4) * r + EXP_P5;
    return (p * r * r + r + 1.0f) * __int_as_float((unsigned)(((int)n + 127) << 23));
}
// candidate (v, i) before (bv, bi): a larger value, or the same value and a lower id; NO_EXPERT is none
__device__ __forceinline__ bool router_before(float v, int i, float bv, int bi) {
    return i != NO_EXPERT && (bi == NO_EXPERT || v > bv || (v == bv && i < bi));
}
__device__ __forceinline__ void router_warp_argmax(float& v, int& i) {
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (router_before(ov, oi, v, i)) { v = ov; i = oi; }
    }
}

// logits [T, E]; bias [E], read where has_bias; out [T, 2k]: the k ids, then their weights' float32 bits.
// A block a row, blockDim a multiple of 32. Dynamic shared memory: 3 E + 2 n_group words.
extern "C" __global__ void strata_route(const float* logits, const float* bias, int has_bias, int E, int k,
                                        int n_group, int topk_group, int softmax, int normalize, float scaling,
                                        unsigned int* out) {
    extern __shared__ float router_shared[];
    float* score = router_shared;                       // [E] the weights' values
    float* choice = router_shared + E;                  // [E] what the choice ranks
    int* left = (int*)(router_shared + 2 * E);          // [E] 1 where the expert may still be chosen
    float* group = router_shared + 3 * E;               // [n_group] the groups' scores
    int* kept = (int*)(router_shared + 3 * E + n_group);  // [n_group] 1 where the group stays
    __shared__ float part_v[32];
    __shared__ int part_i[32];
    __shared__ float total;
    const float* l = logits + (long long)blockIdx.x * E;
    unsigned int* o = out + (long long)blockIdx.x * 2 * k;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5, size = E / n_group;
    if (softmax) {
        float m = __int_as_float(0xff800000u);
        for (int e = threadIdx.x; e < E; e += blockDim.x) m = fmaxf(m, l[e]);
        for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
        if (lane == 0) part_v[w] = m;
        __syncthreads();
        for (int j = 0; j < nw; j++) m = fmaxf(m, part_v[j]);
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            score[e] = router_exp(l[e] - m);
            choice[e] = l[e];
        }
        __syncthreads();
        if (threadIdx.x == 0) {  // in expert order, as the host adds them
            float s = 0.0f;
            for (int e = 0; e < E; e++) s += score[e];
            total = s;
        }
        __syncthreads();
        for (int e = threadIdx.x; e < E; e += blockDim.x) score[e] = score[e] / total;
    } else {
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            float s = 1.0f / (1.0f + router_exp(-l[e]));
            score[e] = s;
            choice[e] = has_bias ? s + bias[e] : s;
        }
    }
    __syncthreads();
    if (topk_group < n_group) {
        for (int g = threadIdx.x; g < n_group; g += blockDim.x) {
            float b1 = __int_as_float(0xff800000u), b2 = b1;
            for (int e = g * size; e < (g + 1) * size; e++) {
                float v = choice[e];
                if (v > b1) { b2 = b1; b1 = v; }
                else if (v > b2) b2 = v;
            }
            group[g] = softmax || size < 2 ? b1 : b1 + b2;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int g = 0; g < n_group; g++) kept[g] = 0;
            for (int r = 0; r < topk_group; r++) {
                int best = -1;
                for (int g = 0; g < n_group; g++)
                    if (!kept[g] && (best < 0 || group[g] > group[best])) best = g;
                kept[best] = 1;
            }
        }
        __syncthreads();
    }
    for (int e = threadIdx.x; e < E; e += blockDim.x) left[e] = topk_group < n_group ? kept[e / size] : 1;
    __syncthreads();
    for (int j = 0; j < k; j++) {
        float v = 0.0f;
        int i = NO_EXPERT;
        for (int e = threadIdx.x; e < E; e += blockDim.x)
            if (left[e] && router_before(choice[e], e, v, i)) { v = choice[e]; i = e; }
        router_warp_argmax(v, i);
        if (lane == 0) { part_v[w] = v; part_i[w] = i; }
        __syncthreads();
        if (w == 0) {
            v = lane < nw ? part_v[lane] : 0.0f;
            i = lane < nw ? part_i[lane] : NO_EXPERT;
            router_warp_argmax(v, i);
            if (lane == 0) {
                left[i] = 0;
                o[j] = (unsigned int)i;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {  // the ids it wrote above
        float s = 0.0f;
        for (int j = 0; j < k; j++) s += score[o[j]];
        for (int j = 0; j < k; j++) {
            float v = score[o[j]];
            if (normalize) v = v / (s + NORM_EPS);
            o[k + j] = __float_as_uint(v * scaling);
        }
    }
}
