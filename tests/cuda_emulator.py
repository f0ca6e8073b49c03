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
one every run shows). What it cannot: CUDA's own float rounding (expf, fused
multiply-adds), warp divergence around a shuffle (each lane here waits for
all 32), and speed. tests/test_device_kernels.py runs the same checks on a GPU.
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
#include <barrier>
#include <cmath>
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
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
static inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }
static inline float __int_as_float(unsigned v) { float f; std::memcpy(&f, &v, 4); return f; }
static inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
    unsigned lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    emu_warp_values[w][lane] = v;
    emu_warp_barriers[w]->arrive_and_wait();
    float other = emu_warp_values[w][lane ^ lane_mask];
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
    for (unsigned b = 0; b < grid; b++) {
        std::vector<std::thread> threads;
        for (unsigned t = 0; t < block; t++)
            threads.emplace_back([=] { threadIdx.x = t; blockIdx.x = b; kernel(args...); });
        for (auto& th : threads) th.join();
    }
}
"""

_KERNEL = re.compile(r'extern "C" __global__ void (\w+)\(([^)]*)\)', re.S)
_CTYPES = {"int": ctypes.c_int, "long long": ctypes.c_longlong, "float": ctypes.c_float}


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
            f'extern "C" void emu_{name}(unsigned grid, unsigned block, long shared, '
            f'{", ".join(f"{t} {n}" for t, n in params)}) '
            f'{{ emu_launch({name}, grid, block, shared, {", ".join(n for _, n in params)}); }}'
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
        fn.restype = None

        def launch(grid, block, args, shared_mem=0):
            assert len(grid) == 1 and len(block) == 1 and block[0] % 32 == 0, (grid, block)
            values = [a.ctypes.data if isinstance(a, np.ndarray) else a.item() if isinstance(a, np.generic) else a
                      for a in args]
            fn(grid[0], block[0], shared_mem, *values)

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
