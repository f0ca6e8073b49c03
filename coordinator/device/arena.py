"""Device memory for one decode step, preallocated per batch bucket: a step allocates nothing from CUDA or CuPy's
pool, and its arrays sit at the same addresses every step (what a CUDA graph's replay needs; PyTorch's graphs
keep a private pool the same way).

Inside ``arena.step(rows)`` every CuPy allocation is a bump of an offset in the bucket's one buffer
(``cupy.cuda.using_allocator``); the offset goes back to zero at the next step, so nothing made inside may
outlive the step (the KV cache is reserved before it, the logits are copied to the host inside it). A bucket's
first step sizes it: its allocations come from CuPy's pool and are counted, and the bucket's buffer is made
for that many bytes (and a quarter more) after it. A step that asks for more than its buffer holds gets the
rest from the pool and grows the buffer after it, except inside a stream capture (``step(rows, capturing=True)``):
there it raises ArenaFull, as a graph holding a block of the pool would write memory the pool hands out again.

    buckets 1, 2, 4, 8, ... up to max_rows: a step of T rows takes the smallest bucket of at least T
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

ALIGN = 256  # CuPy's own allocation granularity: every array starts aligned for the widest loads


def bucket(rows: int) -> int:
    """The smallest power of two of at least ``rows``."""
    return 1 << max(rows - 1, 0).bit_length()


class ArenaFull(Exception):
    """A captured step asked for more than its bucket's buffer holds: the capture is abandoned, the step queued."""


@dataclass
class ArenaStats:
    steps: int = 0  # steps run inside a bucket's buffer
    pool_allocations: int = 0  # allocations that went to CuPy's pool (sizing steps, overflows)
    bytes: int = 0  # every bucket's buffer together
    buckets: dict[int, int] = field(default_factory=dict)  # bucket -> its buffer's bytes
    # bucket -> how many buffers it has had: a captured graph holds the addresses of one (graph_steps.py)
    generations: dict[int, int] = field(default_factory=dict)


class StepArena:
    def __init__(self, xp):
        self.xp = xp
        self._buffers: dict[int, object] = {}  # bucket -> cupy MemoryPointer of its buffer
        self._needed = 0  # bytes the current step asked for
        self._capacity = 0
        self._buffer = None
        self._capturing = False
        self.stats = ArenaStats()

    def generation(self, rows: int) -> int:
        """How many buffers ``rows``' bucket has had (0: none yet): a step's arrays are where the last step's of the
        same shape were while this stays the same."""
        return self.stats.generations.get(bucket(rows), 0)

    def _malloc(self, size: int):
        aligned = -(-max(size, 1) // ALIGN) * ALIGN
        offset, self._needed = self._needed, self._needed + aligned
        if self._buffer is not None and offset + aligned <= self._capacity:
            return self._buffer + offset
        if self._capturing:
            raise ArenaFull(f"a captured step needs more than its bucket's {self._capacity} bytes")
        self.stats.pool_allocations += 1
        return self.xp.get_default_memory_pool().malloc(size)  # beyond the buffer: the pool; the buffer grows after

    @contextlib.contextmanager
    def step(self, rows: int, capturing: bool = False):
        """Allocations inside come from ``rows``' bucket (and only from it, ``capturing``)."""
        b = bucket(rows)
        self._buffer = self._buffers.get(b)
        self._capacity = self.stats.buckets.get(b, 0)
        self._needed = 0
        self._capturing = capturing
        try:
            with self.xp.cuda.using_allocator(self._malloc):
                yield
        finally:
            self._capturing = False
            if self._needed > self._capacity:  # sized (or grown) for the next step of this bucket
                size = -(-self._needed * 5 // 4 // ALIGN) * ALIGN
                self._buffers[b] = self.xp.get_default_memory_pool().malloc(size)
                self.stats.bytes += size - self._capacity
                self.stats.buckets[b] = size
                self.stats.generations[b] = self.stats.generations.get(b, 0) + 1
            else:
                self.stats.steps += 1
            self._buffer = None
