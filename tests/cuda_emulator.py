"""device_ops' CUDA C kernels run on the CPU, so their logic is tested where no GPU is (CI, most sessions).

The source is compiled as C++20 by g++ with a prelude that gives CUDA's names a
CPU meaning. The blocks of a grid run one after another; a block's threads are
fibers of one OS thread (a stack each, switched by a few instructions), run in
thread order, each until it waits at a barrier: ``__syncthreads`` waits for the
block, ``__shfl_xor_sync`` is an exchange through a per-warp array between two
waits for the warp. ``__shared__`` memory is one static array per launch. So a
launch costs about what the same C++ loops cost, not an OS thread per CUDA
thread. ``cupy_shim()`` is a module that stands for CuPy in device_ops: NumPy
arrays, and a RawModule whose kernels launch here. The libraries are built once
per machine and source under ``cache_dir()`` (beside the numba kernels).

What it checks: indexing, the reductions' arithmetic, the wrappers' arguments
and shared-memory sizes, and the synchronisation points: threads waiting at a
barrier that the rest of their block (or warp) never reaches make the launch
raise (a GPU hangs or is undefined there). A missing barrier shows only where
the thread order here reads a value before its writer ran (threads run in
order, so a race on a later thread's write shows, one on an earlier's does
not). Vector types (uint2, uint4, float4) and ``__ldg`` are here too; an
``__ldg`` through a pointer not aligned to its type, which faults on a GPU,
makes the launch raise. What it cannot: CUDA's own float rounding (expf,
contracted multiply-adds; ``fmaf`` and the ``__f*_rn`` intrinsics round as on a
GPU), warp divergence around a shuffle (each lane here waits for all 32), loads
that skip ``__ldg``'s alignment check, and speed.
tests/test_device_kernels.py and tests/test_format_kernels.py run the same
checks on a GPU.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import types
from pathlib import Path

import numpy as np

PRELUDE = r"""
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <math.h>
#include <sys/mman.h>
#include <vector>
#if !defined(__x86_64__)
#include <ucontext.h>
#endif
struct dim3 { unsigned x = 0, y = 1, z = 1; };
static dim3 threadIdx, blockIdx, blockDim;  // threadIdx is the running fiber's, set by the scheduler at each switch
static float* emu_dynamic_shared;
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

// -- fibers: a CUDA thread is a stack of its own in this one OS thread, run until it waits at a barrier --------
#if defined(__x86_64__)
// the callee-saved registers, MXCSR and the x87 control word pushed on the old stack, popped from the new one
extern "C" void emu_switch(void** save_sp, void* load_sp);
asm(R"(
.text
.hidden emu_switch
.globl emu_switch
.type emu_switch,@function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
)");
#endif
struct EmuBarrier { unsigned count = 0, expected = 0, generation = 0; };
struct EmuFiber {
    char* stack = nullptr;
#if defined(__x86_64__)
    void* sp = nullptr;
#else
    ucontext_t context;
#endif
    EmuBarrier* waiting = nullptr;  // the barrier it waits at, or none
    unsigned generation = 0;  // that barrier's generation when it arrived: it runs again once that changed
    bool done = false;
};
static const size_t EMU_STACK = 256 << 10;
static std::vector<EmuFiber> emu_fibers;
static unsigned emu_current;
static std::function<void()> emu_body;  // the kernel with its arguments
#if defined(__x86_64__)
static void* emu_main_sp;
#else
static ucontext_t emu_main_context;
#endif
static EmuBarrier emu_block_barrier, emu_warp_barriers[32];
static float emu_warp_values[32][32];  // [warp][lane]
static int emu_warp_ints[32][32];  // [warp][lane], the int shuffles'
static int emu_misaligned;  // set by a load a GPU would fault on; the launch reports it

static void emu_to_scheduler() {
    EmuFiber& f = emu_fibers[emu_current];
#if defined(__x86_64__)
    emu_switch(&f.sp, emu_main_sp);
#else
    swapcontext(&f.context, &emu_main_context);
#endif
}
static void emu_fiber_main() {
    emu_body();
    emu_fibers[emu_current].done = true;
    emu_to_scheduler();  // never resumed
    std::abort();
}
static void emu_fiber_start(EmuFiber& f) {
    f.done = false;
    f.waiting = nullptr;
#if defined(__x86_64__)
    // the frame emu_switch pops: MXCSR and control word, six registers, then emu_fiber_main as the return
    // address, entered with the stack as a call leaves it (16-byte aligned plus the return slot)
    auto top = reinterpret_cast<std::uintptr_t>(f.stack + EMU_STACK) & ~std::uintptr_t(15);
    void** sp = reinterpret_cast<void**>(top) - 2;
    sp[0] = reinterpret_cast<void*>(&emu_fiber_main);
    sp[1] = nullptr;
    sp -= 7;
    std::memset(sp, 0, 7 * sizeof(void*));
    unsigned csr[2];
    asm volatile("stmxcsr %0" : "=m"(csr[0]));
    asm volatile("fnstcw %0" : "=m"(csr[1]));
    std::memcpy(sp, csr, 8);
    f.sp = sp;
#else
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack;
    f.context.uc_stack.ss_size = EMU_STACK;
    f.context.uc_link = nullptr;
    makecontext(&f.context, emu_fiber_main, 0);
#endif
}
static void emu_resume(unsigned i) {
    emu_current = i;
    threadIdx.x = i;
#if defined(__x86_64__)
    emu_switch(&emu_main_sp, emu_fibers[i].sp);
#else
    swapcontext(&emu_main_context, &emu_fibers[i].context);
#endif
}
// every thread that counts on the barrier arrives before any passes it; the last to arrive goes on at once
static void emu_arrive_and_wait(EmuBarrier& b) {
    if (++b.count == b.expected) {
        b.count = 0;
        b.generation++;
        return;
    }
    EmuFiber& f = emu_fibers[emu_current];
    f.waiting = &b;
    f.generation = b.generation;
    emu_to_scheduler();
}
static inline void __syncthreads() { emu_arrive_and_wait(emu_block_barrier); }
static inline float __int_as_float(unsigned v) { float f; std::memcpy(&f, &v, 4); return f; }
static inline float __uint_as_float(unsigned v) { float f; std::memcpy(&f, &v, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned v; std::memcpy(&v, &f, 4); return v; }
// CUDA's integer min and max (its math headers overload them for the integer types)
static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline long long min(long long a, long long b) { return a < b ? a : b; }
static inline long long max(long long a, long long b) { return a > b ? a : b; }
// one IEEE operation each: g++ in ISO C++ mode contracts no multiply into an add
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) float4 { float x, y, z, w; };
static inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
template <typename T>
static inline T __ldg(const T* p) {
    if (reinterpret_cast<std::uintptr_t>(p) % alignof(T)) emu_misaligned = 1;
    T v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
template <typename T>
static inline T emu_shuffle_xor(T (&values)[32][32], T v, int lane_mask) {
    unsigned lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    values[w][lane] = v;
    emu_arrive_and_wait(emu_warp_barriers[w]);
    T other = values[w][lane ^ lane_mask];
    emu_arrive_and_wait(emu_warp_barriers[w]);
    return other;
}
static inline float __shfl_xor_sync(unsigned, float v, int lane_mask) { return emu_shuffle_xor(emu_warp_values, v, lane_mask); }
static inline int __shfl_xor_sync(unsigned, int v, int lane_mask) { return emu_shuffle_xor(emu_warp_ints, v, lane_mask); }

// runs the grid's blocks one after another, each block's threads as fibers taken in turn (thread order) until
// all are done; returns 2 where threads wait at a barrier that the rest of the block never reaches (a GPU hangs)
template <typename... A>
static int emu_launch(void (*kernel)(A...), unsigned grid, unsigned block, long shared_bytes, A... args) {
    std::vector<float> dynamic(shared_bytes / 4 + 1);
    emu_dynamic_shared = dynamic.data();
    blockDim.x = block;
    emu_block_barrier = EmuBarrier{0, block, 0};
    for (unsigned w = 0; w < 32; w++) emu_warp_barriers[w] = EmuBarrier{0, 32, 0};
    if (emu_fibers.size() < block) emu_fibers.resize(block);
    for (unsigned t = 0; t < block; t++)
        if (!emu_fibers[t].stack) {
            void* m = mmap(nullptr, EMU_STACK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (m == MAP_FAILED) std::abort();
            emu_fibers[t].stack = static_cast<char*>(m);
        }
    emu_body = [=] { kernel(args...); };
    for (unsigned b = 0; b < grid; b++) {
        blockIdx.x = b;
        for (unsigned t = 0; t < block; t++) emu_fiber_start(emu_fibers[t]);
        for (unsigned left = block; left;) {
            bool ran = false;
            for (unsigned t = 0; t < block; t++) {
                EmuFiber& f = emu_fibers[t];
                if (f.done || (f.waiting && f.waiting->generation == f.generation)) continue;
                f.waiting = nullptr;
                emu_resume(t);
                ran = true;
                left -= f.done;
            }
            if (!ran) return 2;
        }
    }
    return 0;
}
"""

_STUCK = 2  # emu_launch's status where a barrier is never passed
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
            f'int stuck = emu_launch({name}, grid, block, shared, {", ".join(n for _, n in params)}); '
            f'return stuck ? stuck : emu_misaligned; }}'
            for name, params in kernels.items()]
        source = PRELUDE + body + "\n" + "\n".join(wrappers) + "\n"
        digest = hashlib.sha256(source.encode()).hexdigest()[:16]
        lib = build_dir / f"emulated-{digest}.so"
        if not lib.exists():
            src = build_dir / f"emulated-{digest}.{os.getpid()}.cpp"
            src.write_text(source)
            tmp = build_dir / f"emulated-{digest}.{os.getpid()}.so"
            try:
                built = subprocess.run(["g++", "-std=c++20", "-O2", "-shared", "-fPIC", "-o", str(tmp), str(src)],
                                       capture_output=True, text=True)
                if built.returncode:  # the compiler's own lines name the CUDA source's line (and leave nothing)
                    raise RuntimeError(f"the emulator's g++ build failed:\n{built.stderr[-4000:]}")
                os.replace(tmp, lib)  # whole or absent: a run beside this one never loads a half-written library
            finally:
                src.unlink(missing_ok=True)
                tmp.unlink(missing_ok=True)
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
            status = fn(grid[0], block[0], shared_mem, *values)
            if status == _STUCK:
                raise RuntimeError(f"{name}: threads wait at a barrier the rest of their block or warp never reaches "
                                   "(a GPU hangs or is undefined there)")
            if status:
                raise RuntimeError(f"{name}: an __ldg through a pointer not aligned to its type (a GPU faults)")

        return launch


def cache_dir() -> Path:
    """Where the emulated kernels are built, once per machine and source: beside the numba kernels' cache."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = Path(root) / "strata-numa" / "emulator"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


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
