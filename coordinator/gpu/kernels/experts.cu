// y [T, H] = for each token t, the sum over its slots s in order of weight[s] * down[s, :];
// slots of token t: order[start[t] .. start[t + 1]) (indices into down's rows). One thread an element.
extern "C" __global__ void strata_slot_sum(const float* down, const float* weight, const int* order,
                                           const int* start, int T, int H, float* y) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)T * H) return;
    int t = (int)(i / H), h = (int)(i % H);
    float acc = 0.0f;
    for (int j = start[t]; j < start[t + 1]; j++) {
        int s = order[j];
        acc += weight[s] * down[(long long)s * H + h];
    }
    y[i] = acc;
}

// The host's slot bookkeeping (DeviceExperts.run) on the device, one block: the first count[0] pairs placed
// into slots by their rank in (expert, token, pair) order (np.lexsort's stable order), a thread a pair; each
// slot's x row, table row and weight; slots past the pairs read x row 0 through table row 0 and belong to no
// token; the slots of each token in slot order (by_token, from start[t]), each slot placed by its rank in
// (token, slot) order. ids[s] = s, the down product's rows.
extern "C" __global__ void strata_order_slots(const int* tokens, const int* experts, const float* weights,
                                              const long long* count, const int* index, int T, int P,
                                              int* slot_rows, int* slot_matrix, float* slot_weights, int* by_token,
                                              int* start, int* ids, int* order) {
    extern __shared__ float order_shared[];  // dynamic: 2 * P ints
    int* keys = reinterpret_cast<int*>(order_shared);  // [P] a pair's expert * T + token: (expert, token) order
    int* rows = keys + P;                              // [P] a slot's token
    int n = (int)count[0];
    for (int p = threadIdx.x; p < n; p += blockDim.x) keys[p] = experts[p] * T + tokens[p];
    __syncthreads();
    for (int p = threadIdx.x; p < n; p += blockDim.x) {
        int kp = keys[p], rank = 0;
        for (int q = 0; q < n; ++q) rank += keys[q] < kp || (keys[q] == kp && q < p);
        order[rank] = p;
    }
    __syncthreads();
    for (int s = threadIdx.x; s < P; s += blockDim.x) {
        ids[s] = s;
        bool used = s < n;
        rows[s] = slot_rows[s] = used ? tokens[order[s]] : 0;
        slot_matrix[s] = used ? index[experts[order[s]]] : 0;
        slot_weights[s] = used ? weights[order[s]] : 0.0f;
    }
    __syncthreads();
    for (int t = threadIdx.x; t <= T; t += blockDim.x) {  // the slots of the tokens before t
        int before = 0;
        for (int s = 0; s < n; ++s) before += rows[s] < t;
        start[t] = before;
    }
    for (int s = threadIdx.x; s < n; s += blockDim.x) {
        int t = rows[s], at = 0;
        for (int q = 0; q < n; ++q) at += rows[q] < t || (rows[q] == t && q < s);
        by_token[at] = s;
    }
}
