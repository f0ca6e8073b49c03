// pair i (token i / k, the router's rank i % k): its expert and weight, and its side: 0 skipped (below the tail
// skip: the host's weights >= skip, where on), 1 the CPU, 2 the device
__device__ __forceinline__ int pair_side(const unsigned int* packed, int k, const unsigned char* on_device,
                                         float skip, int i, int* e, float* w) {
    long long row = (long long)(i / k) * 2 * k;
    *e = (int)packed[row + i % k];
    *w = __int_as_float((int)packed[row + k + i % k]);
    if (skip > 0.0f && !(*w >= skip)) return 0;
    return on_device[*e] ? 2 : 1;
}
// One block. Each pair's side and expert are read once into shared memory (dynamic: 2 * T * k ints); then a
// thread a pair places it at its side's count of earlier pairs (the router order, as the host's pass keeps it),
// a thread an expert counts its pairs and whether each side met it; the totals block-summed.
extern "C" __global__ void strata_split_pairs(const unsigned int* packed, int T, int k, const unsigned char* on_device,
                                              int E, float skip, int* cpu_tokens, int* cpu_experts,
                                              float* cpu_weights, long long* cpu_count, int* dev_tokens,
                                              int* dev_experts, float* dev_weights, long long* dev_count,
                                              long long* counts, long long* totals) {
    extern __shared__ float split_shared[];
    __shared__ int part[32];
    int P = T * k, nc = 0, nd = 0, skipped = 0, ce = 0, de = 0;
    int* sides = reinterpret_cast<int*>(split_shared);  // [P]
    int* experts = sides + P;                            // [P]
    for (int i = threadIdx.x; i < P; i += blockDim.x) {
        float w;
        sides[i] = pair_side(packed, k, on_device, skip, i, &experts[i], &w);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < P; i += blockDim.x) {
        int side = sides[i], e = experts[i];
        if (side == 0) { skipped += 1; continue; }
        int at = 0;
        for (int q = 0; q < i; ++q) at += sides[q] == side;
        float w = __int_as_float((int)packed[(long long)(i / k) * 2 * k + k + i % k]);
        if (side == 2) { dev_tokens[at] = i / k; dev_experts[at] = e; dev_weights[at] = w; nd += 1; }
        else { cpu_tokens[at] = i / k; cpu_experts[at] = e; cpu_weights[at] = w; nc += 1; }
    }
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int chosen = 0, on_cpu = 0, on_dev = 0;
        for (int i = 0; i < P; ++i) {
            if (experts[i] != e) continue;
            chosen += 1;
            on_cpu |= sides[i] == 1;
            on_dev |= sides[i] == 2;
        }
        counts[e] += chosen;
        ce += on_cpu;
        de += on_dev;
    }
    nc = block_sum_int(nc, part);
    nd = block_sum_int(nd, part);
    skipped = block_sum_int(skipped, part);
    ce = block_sum_int(ce, part);
    de = block_sum_int(de, part);
    if (threadIdx.x == 0) {
        cpu_count[0] = nc;
        dev_count[0] = nd;
        totals[0] += (long long)P; totals[1] += skipped; totals[2] += nc; totals[3] += ce; totals[4] += nd;
        totals[5] += de;
    }
}

extern "C" __global__ void strata_sum_partials(const float* parts, int nodes, long long n, const float* extra,
                                               const float* more, float* out) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float s = parts[i];
    for (int p = 1; p < nodes; ++p) s += parts[(long long)p * n + i];
    if (extra) s += extra[i];
    if (more) s += more[i];
    out[i] = s;
}
