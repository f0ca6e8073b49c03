"""Expert kernels, shared by the in-process pool and the node worker processes.

A node holds rows R of each expert's intermediate dimension; its partial output
for tokens x is ``(silu(x·W_gate[R]ᵀ) ⊙ (x·W_up[R]ᵀ)) · W_down[:, R]ᵀ``. Summed
over the nodes of a plan this is the whole expert.

blas.py    groups of many tokens: the rows decoded to float32, then BLAS (prefill)
rows.py    groups of few tokens: one compiled call per layer over every (expert, row block) task (decode),
           reading each format's rows (f32.py, bf16.py, q8.py, q4.py: one row decoder per format)
"""

from .blas import sigmoid, silu, swiglu_partial

__all__ = ["sigmoid", "silu", "swiglu_partial"]
