"""Everything that knows CUDA: the GPU backend (backend.py, chosen at open where probe.py finds a usable GPU), its
kernels (kernels/: a .cu file a module and the header they share; ops.py, format_kernels.py, experts.py,
router.py, compact.py, linear_attention.py launch them), the weights in their storage formats (weights.py,
storage.py), the memory plan (vram.py, load.py), transfers and streams (transfer.py), the pool driven from a
stream (stream.py) and graph-ready decode steps (graph_steps.py, arena.py). It imports model/, never host/."""
