// One plain extern "C" declaration a kernel and format (@F@: the format's name), appended to formats.cu once
// a format: NVRTC and tests/cuda_emulator.py's parser both see them.
extern "C" __global__ void strata_matvec_@F@(const unsigned char* w, long long stride, int R, int K,
        const float* x, int T, const float* bias, int has_bias, const float* residual, int has_residual,
        float* out) {
    matvec<Reader_@F@>(w, stride, R, K, x, T, bias, has_bias, residual, has_residual, out);
}
extern "C" __global__ void strata_grouped_matvec_@F@(const unsigned long long* table, long long stride, int R,
        int K, const float* x, const int* slot_rows, const int* slot_matrix, float* out) {
    grouped_matvec<Reader_@F@>(table, stride, R, K, x, slot_rows, slot_matrix, out);
}
extern "C" __global__ void strata_dequantize_@F@(const unsigned char* w, long long stride, int rows, int K,
        float* out) {
    dequantize<Reader_@F@>(w, stride, rows, K, out);
}
extern "C" __global__ void strata_absorb_rows_@F@(const unsigned char* w, long long stride, int head_rows, int n,
        int K, const float* x, long long x_row, long long x_head, int T, int nh, float* out) {
    absorb_rows<Reader_@F@>(w, stride, head_rows, n, K, x, x_row, x_head, T, nh, out);
}
extern "C" __global__ void strata_head_rows_matvec_@F@(const unsigned char* w, long long stride, int head_rows,
        int first, int R, int K, const float* x, int nh, float* out) {
    head_rows_matvec<Reader_@F@>(w, stride, head_rows, first, R, K, x, nh, out);
}
