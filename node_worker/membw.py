"""A STREAM-style read of memory by a node's own threads (numba's team, as the expert kernels run): the
bandwidth the expert kernels are measured against.

The array is first written by the same threads (first touch puts its pages on their node), then read whole
REPEATS times, each thread summing its chunks; the best read counts. A chunk is summed by ``block_sum``: four
independent <16 x float> accumulators, 64 floats a loop step (LLVM IR, as the expert kernels' loops are), so
the read is bound by memory, not by the latency of one accumulator's additions, whatever LLVM would make of a
scalar chain (docs/benchmarks.md, "The roofline's read"). ``numpy_read_bandwidth`` reads the same way with
NumPy's sum, the yardstick the bench prints beside it.
"""

from __future__ import annotations

import threading
import time

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from shm.jit import FAST

from .kernels.ir import F32, const
from .kernels.loops import byte_ptr, reduce_sum, register_loop

CHUNK = 2 << 20  # float32 values a task writes or reads: 8 MiB, so the chunks spread over the threads
WIDTH = 16  # floats an accumulator holds: two AVX2 registers, one AVX-512
ACCUMULATORS = 4  # independent ones: an addition's latency hidden behind the other three's loads
STEP = WIDTH * ACCUMULATORS  # floats a loop step reads
VEC = ir.VectorType(F32, WIDTH)


@intrinsic
def block_sum(typingctx, data, lo, n):
    """The sum of data[lo : lo + n - n % STEP] (a float32 array's values), ACCUMULATORS vectors of WIDTH lanes
    a loop step."""
    sig = types.float32(data, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        data_v, lo_v, n_v = args
        base = builder.bitcast(byte_ptr(context, builder, signature.args[0], data_v), F32.as_pointer())
        start = builder.gep(base, [lo_v])

        def step(i, accs):
            at = builder.mul(i, const(STEP))
            loads = [builder.load(builder.bitcast(builder.gep(start, [builder.add(at, const(WIDTH * k))]),
                                                  VEC.as_pointer()), align=4) for k in range(len(accs))]
            return [builder.fadd(acc, v) for acc, v in zip(accs, loads)]

        zero = ir.Constant(VEC, [0.0] * WIDTH)
        accs = register_loop(builder, builder.udiv(n_v, const(STEP)), [zero] * ACCUMULATORS, step)
        while len(accs) > 1:
            accs = [builder.fadd(a, b) for a, b in zip(accs[::2], accs[1::2])]
        return reduce_sum(builder, accs[0])

    return sig, codegen


@njit(parallel=True, **FAST)
def fill(data) -> None:
    for c in prange((data.size + CHUNK - 1) // CHUNK):
        data[c * CHUNK:(c + 1) * CHUNK] = 1.0


@njit(parallel=True, **FAST)
def read(data) -> float:
    """The sum of data [n] float32, chunk by chunk over the threads (block_sum, then a chunk's last values one by
    one; the value only keeps the reads from being optimised away)."""
    chunks = (data.size + CHUNK - 1) // CHUNK
    sums = np.zeros(chunks, np.float32)
    for c in prange(chunks):
        lo = c * CHUNK
        n = min(CHUNK, data.size - lo)
        acc = block_sum(data, lo, n)
        for i in range(lo + n - n % STEP, lo + n):
            acc += data[i]
        sums[c] = acc
    return sums.sum()


def read_bandwidth(threads: int, nbytes: int, repeats: int = 3) -> tuple[float, float]:
    """(best seconds, GB/s) to read ``nbytes`` of float32 with ``threads`` of numba's threads."""
    from . import kernel_threads  # Python only: kept out of the modules whose constants the compiled code holds

    kernel_threads.use(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
    data = np.empty(max(1, nbytes // 4), np.float32)  # [n]
    fill(data)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        read(data)
        best = min(best, time.perf_counter() - t0)
    return best, data.nbytes / best / 1e9


def numpy_read_bandwidth(threads: int, nbytes: int, repeats: int = 3) -> tuple[float, float]:
    """(best seconds, GB/s) to read ``nbytes`` of float32 with NumPy's sum on ``threads`` Python threads, each a
    contiguous share (NumPy lets go of the GIL in a reduction): read_bandwidth's yardstick."""
    data = np.ones(max(threads, nbytes // 4), np.float32)  # [n]
    shares = np.array_split(data, threads)
    best = float("inf")
    for _ in range(repeats):
        workers = [threading.Thread(target=np.add.reduce, args=(share,)) for share in shares]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - t0)
    return best, data.nbytes / best / 1e9


def warm_up() -> None:
    """Compile (or load from the disk cache) the two loops before a benchmark asks for them."""
    data = np.zeros(4, np.float32)
    fill(data)
    read(data)
