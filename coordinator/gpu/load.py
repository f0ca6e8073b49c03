"""Putting a model on the GPU: the memory planned from the index and checked first, then the upload.

    place(cfg, ckpt, config) -> Placement       the hot experts chosen and the memory planned and checked
    out_of_memory(plan)                         a context in which CuPy's allocation failure is a VramError
    expert_formats(cfg, ckpt, expert_dtype)     MoE layer -> its hot experts' (gate, up, down) device formats
    plan_memory(cfg, ckpt, config, experts, formats) -> vram.VramPlan
    free_bytes(), release_pool()                the device's free memory; CuPy's cached blocks handed back
    load_experts(ckpt, refs, keys, formats, cfg, xp) -> experts.DeviceExperts
"""

from __future__ import annotations

import contextlib
import logging

import numpy as np

from shm.checkpoint import Checkpoint
from shm.expert_source import read_expert_slice

from ..config import EngineConfig
from ..model.backend import Placement
from ..model.model_config import ModelConfig
from ..model.weights import layer_experts
from ..pool.hot_experts import device_expert_set
from . import storage, vram
from .experts import DeviceExperts
from .weights import DeviceMatrix, checkpoint_dtype

Triple = tuple[str, str, str]
log = logging.getLogger(__name__)


def place(cfg: ModelConfig, ckpt: Checkpoint, config: EngineConfig) -> Placement:
    """Which experts the GPU holds and its memory by category, from the index, before anything is read:
    refused (vram.VramError, every figure named) when the dense weights, the KV cache, the scratch and the
    experts asked for do not fit the free memory. --gpu-expert-memory fills at most what the rest leaves."""
    formats = expert_formats(cfg, ckpt, config.expert_dtype)
    one = largest_expert(cfg, formats)[0]
    free = free_bytes()
    budget = None
    if config.gpu_expert_memory is not None:
        left = max(0, free - plan_memory(cfg, ckpt, config, 0, formats).total)
        budget = min(int(config.gpu_expert_memory * 1e9), left)
        if budget < int(config.gpu_expert_memory * 1e9):
            log.warning("--gpu-expert-memory %.2f GB: the GPU has %.2f GB left after the dense weights, the KV "
                        "cache and the scratch; the hot experts take that", config.gpu_expert_memory, left / 1e9)
    experts, chosen = device_expert_set(cfg, ckpt, config, one, budget)  # a count the model cannot give: refused
    memory = plan_memory(cfg, ckpt, config, len(experts), formats)
    log.info("GPU memory planned: %s", memory.describe())
    memory.check(free)
    return Placement(experts, chosen, one, formats, memory)


def expert_formats(cfg: ModelConfig, ckpt: Checkpoint, expert_dtype: str) -> dict[int, Triple]:
    """Each MoE layer's hot-expert formats: --expert-dtype, or with auto each matrix's own (storage.py)."""
    out = {}
    for (layer, _), refs in layer_experts(cfg, ckpt).items():
        out[layer] = tuple(storage.matrix_format(ckpt.info(ref.name).dtype, expert_dtype, k) for ref, k in
                           ((refs.gate, cfg.hidden_size), (refs.up, cfg.hidden_size),
                            (refs.down, cfg.moe_intermediate_size)))
    return out


def largest_expert(cfg: ModelConfig, formats: dict[int, Triple]) -> tuple[int, Triple | None]:
    """(the bytes of the largest layer's expert, its formats): what a budget of hot experts is counted in."""
    if not formats:
        return 0, None
    layer = max(formats, key=lambda i: vram.expert_bytes(cfg, formats[i]))
    return vram.expert_bytes(cfg, formats[layer]), formats[layer]


def plan_memory(cfg: ModelConfig, ckpt: Checkpoint, config: EngineConfig, experts: int,
                formats: dict[int, Triple]) -> vram.VramPlan:
    """What the device will hold, by category (vram.py), from the checkpoint's index alone."""
    tied = "lm_head.weight" not in ckpt

    def dtype_of(name: str) -> str:
        return checkpoint_dtype(ckpt, "model.embed_tokens.weight" if tied and name == "lm_head.weight" else name)

    tokens = config.max_seq_len or cfg.max_position_embeddings
    kv_dtype = "f32" if config.kv_dtype == "f32" else "bf16"
    return vram.plan(cfg, dtype_of, config.dense_dtype, kv_dtype, tokens, config.prefill_chunk,
                     largest_expert(cfg, formats)[1], experts, graph_step_rows(cfg, config))


def graph_step_rows(cfg: ModelConfig, config: EngineConfig) -> int:
    """The largest graph-ready decode step the engine will run (its buffer is in the plan), 0 where steps will be
    eager: Decoder.enable_graph_steps' conditions that the configuration alone decides."""
    from .graph_steps import MAX_ROWS

    return MAX_ROWS if config.graph and config.pool == "process" and cfg.linear is None else 0


def compile_kernels() -> None:
    """Every CUDA module built now, at open (NVRTC, or CuPy's kernel cache on disk after a first run), with a
    progress line once it has taken 2 s: no request waits for a compile."""
    from shm.progress import Progress

    from . import ops as device_ops
    from . import compact, experts, format_kernels, router

    modules = (device_ops, format_kernels, experts, compact, router)
    progress = Progress(len(modules), "compiling the CUDA kernels (NVRTC; cached for later runs)", unit="modules")
    for mod in modules:
        mod.cuda_module().compile()
        progress.add(1)
    progress.finish()


@contextlib.contextmanager
def out_of_memory(plan: vram.VramPlan):
    """The upload inside: a failed allocation (the memory the plan counted taken meanwhile by another process,
    or fragmented) is refused as a VramError naming the plan and what is free, not a CuPy traceback."""
    import cupy

    try:
        yield
    except cupy.cuda.memory.OutOfMemoryError as exc:
        release_pool()
        raise vram.VramError(f"the GPU ran out of memory while the model was uploaded ({exc}); planned: "
                             f"{plan.describe()}; free now: {free_bytes() / vram.GB:.2f} GB") from None


def free_bytes() -> int:
    import cupy

    return int(cupy.cuda.runtime.memGetInfo()[0])


def release_pool() -> None:
    """Hand CuPy's cached, unused blocks back to the driver (the host copies and temporaries of the upload)."""
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()


def load_experts(ckpt: Checkpoint, refs: dict, keys, formats: dict[int, Triple], cfg: ModelConfig,
                 xp) -> DeviceExperts:
    """The experts ``keys`` ((layer, e)) read from the checkpoint in their layer's device formats and uploaded."""
    H, inter = cfg.hidden_size, cfg.moe_intermediate_size
    experts = {}
    for layer, e in sorted(keys):
        triple = formats[layer]
        part = read_expert_slice(ckpt, refs[(layer, e)], 0, inter, "/".join(triple))
        experts[(layer, e)] = tuple(DeviceMatrix.from_stored(fmt, np.ascontiguousarray(stored), k, xp)
                                    for fmt, stored, k in zip(triple, (part.gate, part.up, part.down), (H, H, inter)))
    return DeviceExperts(experts, cfg.num_experts, H, inter)
