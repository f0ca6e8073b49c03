"""tests/cuda_emulator.py itself: barriers, shuffles, several blocks and warps, and the launches a GPU would hang on."""

from __future__ import annotations

import numpy as np
import pytest

import cuda_emulator

SOURCE = r"""
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
// out[b] = the sum of x[b * blockDim.x : (b + 1) * blockDim.x], through shuffles and shared memory
extern "C" __global__ void block_sums(const float* x, float* out) {
    __shared__ float partial[32];
    float v = warp_sum(x[blockIdx.x * blockDim.x + threadIdx.x]);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.f;
        for (unsigned w = 0; w < blockDim.x / 32; w++) s += partial[w];
        out[blockIdx.x] = s;
    }
}
// reversed within the block: each thread reads what a later thread wrote, which the barrier makes safe
extern "C" __global__ void reverse(const float* x, float* out) {
    extern __shared__ float buf[];
    buf[threadIdx.x] = x[blockIdx.x * blockDim.x + threadIdx.x];
    __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = buf[blockDim.x - 1 - threadIdx.x];
}
// thread 0 leaves before the barrier the others wait at
extern "C" __global__ void early_exit(float* out) {
    if (threadIdx.x == 0) return;
    __syncthreads();
    out[threadIdx.x] = 1.f;
}
"""


@pytest.fixture(scope="module")
def module():
    ok, why = cuda_emulator.available()
    if not ok:
        pytest.skip(why)
    return cuda_emulator.EmulatedModule(SOURCE, cuda_emulator.cache_dir())


@pytest.mark.parametrize("blocks, threads", [(1, 32), (3, 64), (5, 256)])
def test_shuffles_and_barriers_reduce_each_block(module, blocks, threads):
    x = np.random.default_rng(0).standard_normal(blocks * threads).astype(np.float32)
    out = np.zeros(blocks, np.float32)
    module.get_function("block_sums")((blocks,), (threads,), (x, out))
    np.testing.assert_allclose(out, x.reshape(blocks, threads).astype(np.float64).sum(1), rtol=1e-5, atol=1e-5)


def test_a_barrier_orders_writes_before_reads_across_threads(module):
    x = np.arange(2 * 128, dtype=np.float32)
    out = np.zeros_like(x)
    module.get_function("reverse")((2,), (128,), (x, out), shared_mem=128 * 4)
    np.testing.assert_array_equal(out, x.reshape(2, 128)[:, ::-1].ravel())


def test_a_barrier_part_of_the_block_never_reaches_raises(module):
    out = np.zeros(64, np.float32)
    with pytest.raises(RuntimeError, match="barrier the rest of their block or warp never reaches"):
        module.get_function("early_exit")((1,), (64,), (out,))


def test_the_library_is_built_once_under_the_cache(module):
    again = cuda_emulator.EmulatedModule(SOURCE, cuda_emulator.cache_dir())
    assert again._lib._name == module._lib._name
    assert str(cuda_emulator.cache_dir()) in module._lib._name
    assert not list(cuda_emulator.cache_dir().glob("*.cpp")), "a build left its source behind"


def test_a_source_that_does_not_build_raises_with_the_compilers_words_and_leaves_nothing(tmp_path):
    """A kernel g++ refuses: a RuntimeError carrying the compiler's message, and no source or library left in
    the build folder (a later run would otherwise trip over it)."""
    bad = 'extern "C" __global__ void strata_bad(float* x) { x[0] = undeclared_name; }\n'
    with pytest.raises(RuntimeError, match="undeclared_name"):
        cuda_emulator.EmulatedModule(bad, tmp_path)
    assert not list(tmp_path.iterdir())
