"""Expert kernels, shared by the in-process pool and the node worker processes.

A node holds rows R of each expert's intermediate dimension; its partial output
for tokens x is ``(silu(x·W_gate[R]ᵀ) ⊙ (x·W_up[R]ᵀ)) · W_down[:, R]ᵀ``. Summed
over the nodes of a plan this is the whole expert.

blas.py    groups of many tokens: the rows decoded to float32, then BLAS (prefill)
rows.py    groups of few tokens: one compiled call per layer over every (expert, row block) task (decode)
simd.py    the vector loops both use (four rows' dot products, four rows added into an output, a row
           decoded), in LLVM IR; f32.py, bf16.py, q8.py, q4.py: each format's block reader, its layout drawn
dense.py   a whole stored matrix times a few rows, and rows decoded for BLAS (the CPU device side's
           dense matrices, coordinator/model/packed.py)
common.py  numba's options and the disk cache of the compiled code
"""

from .blas import sigmoid, silu, swiglu_partial

__all__ = ["sigmoid", "silu", "swiglu_partial"]
