"""What a context of ``max_seq_len`` tokens (--ctx-size) takes beside the weights, checked before a model loads.

One sequence's KV cache grows to kv_bytes_per_token x tokens (the attention layers' keys and values, float32 on
the host), plus the fixed state of Qwen3-Next's Gated DeltaNet layers; a process pool's data-path segment
(shm/pool_io.py) holds one step's rows (segment_rows: a prompt chunk and a full decode batch; a larger pass is
sent in pieces, ProcessPool.submit), X and each node's Y as [rows, H] float32 and top_k pairs a row. Engine.open
refuses, with these numbers and the longest context that fits, a context whose one sequence and pool buffers
exceed the memory available (the segment also /dev/shm's free space) before any weight is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shm.pool_io import PoolIoLayout

from .config import EngineConfig
from .errors import ConfigValueError
from .model.model_config import ModelConfig

GIB = 2**30
ROUND = 1024  # the longest context that fits is offered in whole multiples of this many tokens
STEP_DECODE_ROWS = 64  # the decode rows a serving step adds to a prompt chunk: a graph step's largest bucket


class ContextTooLarge(ConfigValueError):
    """The context asked for cannot be held in this machine's memory."""


@dataclass(frozen=True)
class ContextNeeds:
    tokens: int
    kv_cache: int  # bytes of one sequence's keys and values at ``tokens``
    state: int  # bytes of one sequence's Gated DeltaNet state (any length)
    pool_segment: int  # bytes of the process pool's data-path segment (0: an in-process pool)

    @property
    def total(self) -> int:
        return self.kv_cache + self.state + self.pool_segment


def available_memory(meminfo: Path = Path("/proc/meminfo")) -> int:
    """Bytes of memory free for new pages (the kernel's MemAvailable); psutil's figure where there is no
    /proc/meminfo."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil

    return psutil.virtual_memory().available


def segment_rows(tokens: int, prefill_chunk: int) -> int:
    """The rows a process pool's segment holds for a context of ``tokens``: a prompt chunk and a step's decode
    rows, never more than the context."""
    return max(1, min(tokens, prefill_chunk + STEP_DECODE_ROWS))


def segment_layout(mcfg: ModelConfig, tokens: int, nodes: int, prefill_chunk: int) -> PoolIoLayout:
    """The process pool's segment for a context of ``tokens``: segment_rows rows, top_k pairs each."""
    rows = segment_rows(tokens, prefill_chunk)
    return PoolIoLayout(nodes, rows, rows * mcfg.top_k, mcfg.hidden_size)


def context_needs(mcfg: ModelConfig, tokens: int, nodes: int, process_pool: bool,
                  prefill_chunk: int = EngineConfig.prefill_chunk) -> ContextNeeds:
    """The bytes a context of ``tokens`` takes beside the weights (the host's float32 KV cache)."""
    segment = segment_layout(mcfg, tokens, nodes, prefill_chunk).data_bytes if process_pool else 0
    return ContextNeeds(tokens, mcfg.kv_bytes_per_token * tokens, mcfg.state_bytes_per_sequence, segment)


def check_context(mcfg: ModelConfig, tokens: int, nodes: int, process_pool: bool, available: int,
                  shm_free: int, prefill_chunk: int = EngineConfig.prefill_chunk) -> ContextNeeds:
    """``tokens``' needs, or ContextTooLarge naming them, what is available and the longest context that fits.
    ``available``: memory free for new pages (MemAvailable); ``shm_free``: /dev/shm's free bytes."""
    def held(n: int) -> bool:
        need = context_needs(mcfg, n, nodes, process_pool, prefill_chunk)
        return need.total <= available and need.pool_segment <= shm_free

    need = context_needs(mcfg, tokens, nodes, process_pool, prefill_chunk)
    if held(tokens):
        return need
    lo, hi = 0, tokens  # the longest context held: the needs grow with the tokens, so a bisection finds it
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if held(mid) else (lo, mid - 1)
    fits = lo // ROUND * ROUND
    raise ContextTooLarge(
        f"a context of {tokens:,} tokens needs {need.total / GIB:.2f} GiB beside the weights: "
        f"{need.kv_cache / GIB:.2f} GiB of KV cache for one sequence ({mcfg.kv_bytes_per_token:,} bytes a token), "
        f"{need.state / GIB:.2f} GiB of linear-attention state and {need.pool_segment / GIB:.2f} GiB of pool "
        f"buffers in /dev/shm; {available / GIB:.2f} GiB of memory is available and {shm_free / GIB:.2f} GiB of "
        f"/dev/shm is free. Use --ctx-size {fits:,} or less" + ("" if fits else " (none fits)"))
