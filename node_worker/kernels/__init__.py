"""Expert kernels, shared by the in-process pool and the node worker processes.

A node holds rows R of each expert's intermediate dimension; its partial output
for tokens x is ``(silu(x·W_gate[R]ᵀ) ⊙ (x·W_up[R]ᵀ)) · W_down[:, R]ᵀ``. Summed
over the nodes of a plan this is the whole expert.

layer.py   one compiled call per node per layer: the routed pairs grouped by expert, cut in tasks
rows.py    the tasks' loops (decode: four rows by one token; prefill: two rows by four tokens)
simd.py    the vector loops both use (rows' dot products, rows added into an output, a row decoded, the next
           rows prefetched), in LLVM IR; f32.py, bf16.py, q8.py, q4.py: each format's block reader, its layout drawn
isimd.py   decode's loop for the quantised formats with int8 activations: each format's integers (its
           ``iblocks``) times the activations' in integers (idot.py: VNNI, AVX2 or generic IR, chosen for the
           host), activations.py quantising them per block of 32 (EngineConfig.activations q8)
dense.py   a whole stored matrix times a few rows, and rows decoded for BLAS (the CPU device side's
           dense matrices, coordinator/host/packed.py)
rows8.py   q8 rows interleaved eight at a time (llama.cpp's repacked Q8_0): eight rows a vector, for every T
           (the dense q8 matrices with integer activations)
common.py  numba's options and the CPU the code is compiled for (shm/jit.py keeps the compiled code)
kernel_set.py  the formats a kernel is compiled with: a compile-time argument of every entry, so a model compiles
           its own formats' loops alone (coordinator/warmup.py compiles them before anything runs them)
"""

from __future__ import annotations


def target_summary() -> str:
    """The CPU the kernels are compiled for and what that chose, for a benchmark's report: "host" or numba's
    NUMBA_CPU_NAME, the 512-bit tiles (simd.WIDE_TILES), vdpbf16ps (bf16dp.NATIVE), the integer dot lowering."""
    from numba.core import config

    from . import bf16dp, idot, simd

    cpu = f"{config.CPU_NAME} (NUMBA_CPU_NAME)" if config.CPU_NAME else "the host's"
    return (f"kernels compiled for {cpu}: {'512' if simd.WIDE_TILES else '256'}-bit tiles, "
            f"vdpbf16ps {'yes' if bf16dp.NATIVE else 'no'}, integer dots {idot.host_lowering()}")
