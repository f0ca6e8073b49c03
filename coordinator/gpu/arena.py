"""Device memory for decode steps: one buffer, planned by the arrays' lifetimes, so a step allocates nothing from
CUDA or CuPy's pool, its arrays sit at the same addresses every step of a shape (what a CUDA graph's replay needs;
PyTorch's graphs keep a private pool the same way), and memory a layer frees is what the next layer takes.

Inside ``arena.step(rows, key)`` every CuPy allocation comes from the buffer (``cupy.cuda.using_allocator``). Each
allocation's lifetime is seen: CuPy's ``UnownedMemory`` keeps a token whose finaliser says when the last array on
it is gone (on one stream a later kernel runs after every earlier reader, so the range is free from then on). A
shape's first step takes the smallest free range that fits and records every allocation's size and lifetime; at
its end the shape's plan is made as llama.cpp's graph allocator makes one from a graph: largest first, each at the
lowest offset clear of every allocation alive at the same time, so identical layers share their ranges and the
peak is the most bytes alive at once, whatever the layer count. Later steps of the shape take the plan's offsets
in allocation order (Python frees arrays in the same order each time); one that asks otherwise goes on above the
plan and is planned anew after it. Nothing made inside may outlive the step's arrays' next use: the next step plans
the whole buffer again (the KV cache is reserved before it, the logits are copied to the host inside it).

The buffer is made at open for the plan's step memory (vram.step_bytes of the largest step); a step whose peak is
more (a plan that was short) takes the rest from the pool, and the buffer grows to its peak and a quarter after
it, which voids captured graphs (``generation``). Inside a stream capture (``step(rows, key, capturing=True)``) no
pool block is taken: ArenaFull, as a graph holding one would write memory the pool hands out again.
"""

from __future__ import annotations

import bisect
import contextlib
import weakref
from dataclasses import dataclass, field

import numpy as np

ALIGN = 256  # CuPy's own allocation granularity: every array starts aligned for the widest loads


def bucket(rows: int) -> int:
    """The smallest power of two of at least ``rows``."""
    return 1 << max(rows - 1, 0).bit_length()


class ArenaFull(Exception):
    """A captured step asked for more than the buffer holds: the capture is abandoned, the step queued."""


@dataclass
class ArenaStats:
    steps: int = 0  # steps run inside the buffer
    pool_allocations: int = 0  # allocations that went to CuPy's pool (steps beyond the buffer)
    bytes: int = 0  # the buffer's
    peaks: dict[int, int] = field(default_factory=dict)  # bucket -> the most bytes a step of it had live at once
    generation: int = 0  # buffers made so far: a captured graph holds the addresses of one (graph_steps.py)


@dataclass
class _Plan:
    """A shape's offsets, in allocation order, and the bytes they span."""

    sizes: list[int]
    offsets: list[int]
    peak: int


def plan_offsets(sizes: list[int], starts: list[int], ends: list[int]) -> tuple[list[int], int]:
    """Offsets for allocations of ``sizes`` alive from event ``starts[i]`` to before ``ends[i]``: largest first
    (earlier first among equals), each at the lowest offset whose range meets no placed allocation alive at the
    same time. Returns (offsets, the bytes they span)."""
    n = len(sizes)
    order = sorted(range(n), key=lambda i: (-sizes[i], starts[i]))
    placed_start, placed_end = np.empty(n, np.int64), np.empty(n, np.int64)
    placed_lo, placed_hi = np.empty(n, np.int64), np.empty(n, np.int64)
    offsets, count, peak = [0] * n, 0, 0
    for i in order:
        clash = (placed_start[:count] < ends[i]) & (placed_end[:count] > starts[i])
        offset = 0
        for lo, hi in sorted(zip(placed_lo[:count][clash].tolist(), placed_hi[:count][clash].tolist())):
            if lo >= offset + sizes[i]:
                break  # the gap below this range holds it
            offset = max(offset, hi)
        offsets[i] = offset
        placed_start[count], placed_end[count] = starts[i], ends[i]
        placed_lo[count], placed_hi[count] = offset, offset + sizes[i]
        count += 1
        peak = max(peak, offset + sizes[i])
    return offsets, peak


class _Token:
    """One allocation's owner: the range returns to the free list when CuPy drops the memory that holds it."""

    __slots__ = ("__weakref__",)


class StepArena:
    def __init__(self, xp, reserve: int = 0):
        self.xp = xp
        self._buffer = None  # cupy MemoryPointer of the buffer
        self._capacity = 0
        self._free: list[list[int]] = []  # [offset, size] free ranges, by offset; the last one is unbounded
        self._epoch = 0  # the step whose ranges a finaliser may return (a late one from an earlier step may not)
        self._peak = 0
        self._capturing = False
        self._plans: dict = {}  # a step's shape -> its _Plan
        self._plan: _Plan | None = None  # the current step's, while its allocations follow it
        self._sizes: list[int] = []  # the current step's allocations: sizes, and the events they began and ended
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._events = 0
        self.stats = ArenaStats()
        if reserve:
            self._grow(reserve)

    def generation(self, rows: int | None = None) -> int:
        """How many buffers there have been (0: none yet): a step's arrays are where the last step's of the same
        shape were while this stays the same."""
        return self.stats.generation

    def _grow(self, size: int) -> None:
        size = -(-size // ALIGN) * ALIGN
        self._buffer = self.xp.get_default_memory_pool().malloc(size)
        self._capacity = self.stats.bytes = size
        self.stats.generation += 1

    def _take(self, size: int) -> int:
        """The smallest free range of at least ``size`` bytes (the lowest of equal ones), its start taken: the
        offset (the plan; the buffer may be shorter)."""
        best = min((r for r in self._free if r[1] >= size), key=lambda r: (r[1], r[0]))
        offset = best[0]
        best[0] += size
        best[1] -= size
        if best[1] == 0:
            self._free.remove(best)
        return offset

    def _give_back(self, epoch: int, index: int, offset: int, size: int) -> None:
        if epoch != self._epoch:  # an array that outlived its step: that step's plan is gone
            return
        self._ends[index] = self._events
        self._events += 1
        if self._plan is not None:  # planned offsets: no free list kept
            return
        free = self._free
        i = bisect.bisect_left(free, [offset, 0])
        free.insert(i, [offset, size])
        if i + 1 < len(free) and offset + size == free[i + 1][0]:  # joined with the range after it
            free[i][1] += free.pop(i + 1)[1]
        if i > 0 and free[i - 1][0] + free[i - 1][1] == offset:  # and with the one before
            free[i - 1][1] += free.pop(i)[1]

    def _malloc(self, size: int):
        cuda = self.xp.cuda
        aligned = -(-max(size, 1) // ALIGN) * ALIGN
        index = len(self._sizes)
        plan = self._plan
        if plan is not None and (index >= len(plan.sizes) or plan.sizes[index] != aligned):
            plan = self._plan = None  # asked otherwise than the shape's last step: above the plan from here on
            self._free = [[max(self._peak, self._plans_peak(self._key)), 1 << 62]]
        offset = plan.offsets[index] if plan is not None else self._take(aligned)
        self._sizes.append(aligned)
        self._starts.append(self._events)
        self._ends.append(1 << 62)  # alive past the step unless its finaliser says otherwise
        self._events += 1
        self._peak = max(self._peak, offset + aligned)
        token = _Token()
        weakref.finalize(token, self._give_back, self._epoch, index, offset, aligned)
        if self._buffer is not None and offset + aligned <= self._capacity:  # the device named: no pointer query
            return cuda.MemoryPointer(cuda.UnownedMemory(self._buffer.ptr + offset, aligned, (self._buffer, token),
                                                         self._buffer.device_id), 0)
        if self._capturing:
            raise ArenaFull(f"a captured step needs more than the {self._capacity}-byte step buffer")
        self.stats.pool_allocations += 1  # beyond the buffer: the pool's block, the range kept in the plan
        block = self.xp.get_default_memory_pool().malloc(aligned)
        return cuda.MemoryPointer(cuda.UnownedMemory(block.ptr, aligned, (block, token), block.device_id), 0)

    def _plans_peak(self, key) -> int:
        plan = self._plans.get(key)
        return plan.peak if plan is not None else 0

    @contextlib.contextmanager
    def step(self, rows: int, key=None, capturing: bool = False):
        """Allocations inside come from the buffer (and only from it, ``capturing``), at the offsets of ``key``'s
        plan where it has one (the module docstring)."""
        self._epoch += 1
        self._key, self._plan = key, self._plans.get(key)
        self._free = [[0, 1 << 62]]
        self._sizes, self._starts, self._ends, self._events = [], [], [], 0
        self._peak = 0
        self._capturing = capturing
        completed = False
        try:
            with self.xp.cuda.using_allocator(self._malloc):
                yield
            completed = True
        finally:
            self._capturing = False
            if completed and self._plan is None:  # planned from what this step's allocations did
                offsets, peak = plan_offsets(self._sizes, self._starts, self._ends)
                self._plans[key] = _Plan(list(self._sizes), offsets, peak)
            self._plan = None
            need = self._plans_peak(key) if completed else 0
            b = bucket(rows)
            self.stats.peaks[b] = max(self.stats.peaks.get(b, 0), need)
            if need > self._capacity:  # grown for the shape's next step
                self._grow(need * 5 // 4)
            else:
                self.stats.steps += 1
