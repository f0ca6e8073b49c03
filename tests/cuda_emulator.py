"""device_ops' CUDA C kernels run on the CPU, so their logic is tested where no GPU is (CI, most sessions).

The source is compiled as C++20 by g++ with a prelude that gives CUDA's names a
CPU meaning: each block's threads are OS threads (blocks one after another),
``__syncthreads`` a barrier of the block, ``__shfl_xor_sync`` an exchange
through a per-warp array between two barriers of the warp, ``__shared__``
memory one static array per launch. ``cupy_shim()`` is a module that stands for
CuPy in device_ops: NumPy arrays, and a RawModule whose kernels launch here.

What it checks: indexing, the reductions' arithmetic, the wrappers' arguments
and shared-memory sizes, and the synchronisation points as far as threads
really race here (a missing barrier is a data race on the CPU too, though not
one every run shows). Vector types (uint2, uint4, float4) and ``__ldg`` are
here too; an ``__ldg`` through a pointer not aligned to its type, which faults
on a GPU, makes the launch raise. What it cannot: CUDA's own float rounding
(expf, contracted multiply-adds; ``fmaf`` and the ``__f*_rn`` intrinsics round
as on a GPU), warp divergence around a shuffle (each lane here waits for all
32), loads that skip ``__ldg``'s alignment check, and speed.
tests/test_device_kernels.py and tests/test_format_kernels.py run the same
checks on a GPU.
"""

from __future__ import annotations

import ctypes
import hashlib
import re
import shutil
import subprocess
import types
from pathlib import Path

import numpy as np

PRELUDE = r"""
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <math.h>
#include <memory>
#include <thread>
#include <vector>
struct dim3 { unsigned x = 0, y = 1, z = 1; };
static thread_local dim3 threadIdx, blockIdx;
static dim3 blockDim;
static float* emu_dynamic_shared;
static std::barrier<>* emu_block_barrier;
static std::vector<std::unique_ptr<std::barrier<>>> emu_warp_barriers;
static float emu_warp_values[32][32];  // [warp][lane]
static int emu_warp_ints[32][32];  // [warp][lane], the int shuffles'
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
static inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }
static inline float __int_as_float(unsigned v) { float f; std::memcpy(&f, &v, 4); return f; }
static inline float __uint_as_float(unsigned v) { float f; std::memcpy(&f, &v, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned v; std::memcpy(&v, &f, 4); return v; }
// one IEEE operation each: g++ in ISO C++ mode contracts no multiply into an add
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) float4 { float x, y, z, w; };
static inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
static std::atomic<int> emu_misaligned{0};  // set by a load a GPU would fault on; the launch reports it
template <typename T>
static inline T __ldg(const T* p) {
    if (reinterpret_cast<std::uintptr_t>(p) % alignof(T)) emu_misaligned = 1;
    T v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
static inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
    unsigned lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    emu_warp_values[w][lane] = v;
    emu_warp_barriers[w]->arrive_and_wait();
    float other = emu_warp_values[w][lane ^ lane_mask];
    emu_warp_barriers[w]->arrive_and_wait();
    return other;
}
static inline int __shfl_xor_sync(unsigned, int v, int lane_mask) {
    unsigned lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    emu_warp_ints[w][lane] = v;
    emu_warp_barriers[w]->arrive_and_wait();
    int other = emu_warp_ints[w][lane ^ lane_mask];
    emu_warp_barriers[w]->arrive_and_wait();
    return other;
}
template <typename... A>
static void emu_launch(void (*kernel)(A...), unsigned grid, unsigned block, long shared_bytes, A... args) {
    std::vector<float> dynamic(shared_bytes / 4 + 1);
    emu_dynamic_shared = dynamic.data();
    blockDim.x = block;
    std::barrier<> bar(block);
    emu_block_barrier = &bar;
    emu_warp_barriers.clear();
    for (unsigned w = 0; w < block / 32; w++) emu_warp_barriers.emplace_back(new std::barrier<>(32));
    // one OS thread a thread of the block, made once: each runs the blocks in turn, all of block b done
    // (a barrier) before any starts block b + 1, whose shared memory is the same static arrays
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < block; t++)
        threads.emplace_back([=, &bar] {
            threadIdx.x = t;
            for (unsigned b = 0; b < grid; b++) {
                blockIdx.x = b;
                kernel(args...);
                bar.arrive_and_wait();
            }
        });
    for (auto& th : threads) th.join();
}
"""

_KERNEL = re.compile(r'extern "C" __global__ void (\w+)\(([^)]*)\)', re.S)
_CTYPES = {"int": ctypes.c_int, "unsigned": ctypes.c_uint, "unsigned int": ctypes.c_uint, "short": ctypes.c_short,
           "unsigned short": ctypes.c_ushort, "long long": ctypes.c_longlong,
           "unsigned long long": ctypes.c_ulonglong, "float": ctypes.c_float, "double": ctypes.c_double}


def _params(text: str) -> list[tuple[str, str]]:
    """'const float* x, int n' -> [('const float*', 'x'), ('int', 'n')]."""
    out = []
    for p in text.split(","):
        p = " ".join(p.split())
        name = re.search(r"(\w+)$", p).group(1)
        out.append((p[: -len(name)].strip(), name))
    return out


def _ctype(decl: str):
    return ctypes.c_void_p if "*" in decl else _CTYPES[decl]


class EmulatedModule:
    """A CUDA source's kernels compiled for the CPU; ``get_function(name)(grid, block, args, shared_mem=0)``
    launches one as CuPy's RawKernel would."""

    def __init__(self, code: str, build_dir: Path):
        kernels = {name: _params(params) for name, params in _KERNEL.findall(code)}
        body = re.sub(r"extern __shared__ float (\w+)\[\];", r"float* \1 = emu_dynamic_shared;", code)
        wrappers = [
            f'extern "C" int emu_{name}(unsigned grid, unsigned block, long shared, '
            f'{", ".join(f"{t} {n}" for t, n in params)}) {{ emu_misaligned = 0; '
            f'emu_launch({name}, grid, block, shared, {", ".join(n for _, n in params)}); return emu_misaligned; }}'
            for name, params in kernels.items()]
        source = PRELUDE + body + "\n" + "\n".join(wrappers) + "\n"
        digest = hashlib.sha256(source.encode()).hexdigest()[:16]
        lib = build_dir / f"emulated-{digest}.so"
        if not lib.exists():
            src = build_dir / f"emulated-{digest}.cpp"
            src.write_text(source)
            subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", "-shared", "-fPIC", "-o", str(lib), str(src)],
                           check=True, capture_output=True, text=True)
        self._lib = ctypes.CDLL(str(lib))
        self._params = kernels

    def get_function(self, name: str):
        fn = getattr(self._lib, f"emu_{name}")
        fn.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_long] + [_ctype(t) for t, _ in self._params[name]]
        fn.restype = ctypes.c_int

        def launch(grid, block, args, shared_mem=0):
            assert len(grid) == 1 and len(block) == 1 and block[0] % 32 == 0, (grid, block)
            values = [a.ctypes.data if isinstance(a, np.ndarray) else a.item() if isinstance(a, np.generic) else a
                      for a in args]
            if fn(grid[0], block[0], shared_mem, *values):
                raise RuntimeError(f"{name}: an __ldg through a pointer not aligned to its type (a GPU faults)")

        return launch


def available() -> tuple[bool, str]:
    if shutil.which("g++") is None:
        return False, "no g++ to build the emulated kernels"
    return True, ""


def cupy_shim(build_dir: Path) -> types.ModuleType:
    """A module that stands for CuPy in device_ops (and the tests' checks): NumPy arrays, emulated kernels."""
    cp = types.ModuleType("cupy")
    cp.EMULATED = True
    for name in ("ascontiguousarray", "empty_like", "empty", "bool_", "array_equal", "asarray", "shares_memory"):
        setattr(cp, name, getattr(np, name))
    cp.asnumpy = np.asarray
    cp.RawModule = lambda code, options=(): EmulatedModule(code, build_dir)
    return cp
