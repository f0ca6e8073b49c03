"""The pool's data path driven from a CUDA stream: the coordinator's ring and wait as compiled host functions.

A decode step queues its whole work on the GPU's stream without the host waiting on any layer: each MoE
layer's rows and routing are copied by the stream into the pool segment (pool_io's X and pairs regions),
then the stream calls ``ring`` (post the request line, ask every node), the device's own work for the layer
runs, and the stream calls ``wait`` (until every node answered) before it copies the partials back. Both are
C callables (numba cfuncs, ``void f(void *user)``: CUDA's host-function type) that touch no Python object and
take no GIL, so the CUDA driver's callback thread runs them while the coordinator's Python thread is elsewhere.

They speak pool_io's protocol exactly (the same request line, go/done words and doorbells as
``PoolIo.post``/``ask``/``done``), reading everything they need from two tables in page-locked host memory::

    control  int64 [CONTROL_WORDS]: one per pool
      0 error       0 none, ERR_NODE (a node answered status error), ERR_DEAD (a worker ended),
                    ERR_HUNG (no answer within the deadline); once set, ring and wait do nothing
      1 error_node  the node index the error names
      2 seq         the last request posted (the pool's request ids; Python's eager path shares them)
      3 base        the pool segment's data address (pool_io's line 0)
      4 nodes       how many nodes
      5 spin_ns     how long wait spins before it sleeps (pool_spin_us)
      6 hang_ns     the wait's deadline after the ring (the pool's hang deadline)
      7 wait_ns     the host functions' summed wait, ring to answered (stats)
      8 requests    the requests answered (stats)
      9 sent_ns     monotonic ns of the last ring
      10 pollfds    the address of ``nodes`` struct pollfd (the workers' pidfds, POLLIN)
      11 slice      a struct timespec (2 words): the sleep's slice, between looks at the pidfds and the deadline
      16 + n        node n's summed compute_ns (stats)
    a layer's row  int64 [ROW_WORDS]: one per MoE layer of the step, the host functions' user data
      0 control's address | 1 layer | 2 T (rows) | 3 P (pairs: written by the stream's copy of the device's
      count before the ring runs)

Errors do not raise (there is no caller to raise to): the first one is written to ``control`` and every later
host function returns at once; the stream's remaining work runs on stale data, and after the step's one
synchronisation the coordinator reads the error word, recovers the pool the eager way and redoes the step
(coordinator/pool/process.py's ``recover_stream``).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import cfunc, njit, types

from . import doorbell, pool_io
from .jit import CACHED

CONTROL_WORDS = 64
ROW_WORDS = 8
ERROR, ERROR_NODE, SEQ, BASE, NODES, SPIN_NS, HANG_NS, WAIT_NS, REQUESTS, SENT_NS, POLLFDS, SLICE = range(12)
COMPUTE_NS = 16  # + node index
MAX_NODES = CONTROL_WORDS - COMPUTE_NS
ERR_NODE, ERR_DEAD, ERR_HUNG = 1, 2, 3
ROW_CONTROL, ROW_LAYER, ROW_T, ROW_P = range(4)
SLICE_NS = 10_000_000  # a sleep's slice (10 ms, as the eager wait's)

_LINE = pool_io.LINE
_REQ_SEQ, _REQ_LAYER, _REQ_T, _REQ_P, _REQ_KIND = (8 * i for i in (pool_io.REQ_SEQ, pool_io.REQ_LAYER, pool_io.REQ_T,
                                                                   pool_io.REQ_P, pool_io.REQ_KIND))
_GO, _DONE, _STATUS, _COMPUTE = (8 * i for i in (pool_io.NODE_GO, pool_io.NODE_DONE, pool_io.NODE_STATUS,
                                                 pool_io.NODE_COMPUTE_NS))
_KIND_COMPUTE, _STATUS_OK = pool_io.KIND_COMPUTE, pool_io.STATUS_OK


@njit(**CACHED)
def _word(control, index):
    return doorbell.load_acquire_at(control + 8 * index)


@njit(**CACHED)
def _set(control, index, value):
    doorbell.store_release_at(control + 8 * index, value)


@njit(**CACHED)
def ring(row):
    """Post the layer's request (row: its row's address) and ask every node, as PoolIo.post and ask do."""
    control = doorbell.load_acquire_at(row + 8 * ROW_CONTROL)
    if _word(control, ERROR) != 0:
        return
    seq = _word(control, SEQ) + 1
    _set(control, SEQ, seq)
    base = _word(control, BASE)
    _set(base, _REQ_LAYER // 8, doorbell.load_acquire_at(row + 8 * ROW_LAYER))
    _set(base, _REQ_T // 8, doorbell.load_acquire_at(row + 8 * ROW_T))
    _set(base, _REQ_P // 8, doorbell.load_acquire_at(row + 8 * ROW_P))
    _set(base, _REQ_KIND // 8, _KIND_COMPUTE)
    doorbell.store_release_at(base + _REQ_SEQ, seq)
    _set(control, SENT_NS, doorbell.monotonic_ns())
    for n in range(_word(control, NODES)):
        line = base + (2 + n) * _LINE
        doorbell.store_release_at(line + _GO, seq)
        doorbell.ring_at(line)  # the node's doorbell: word 0 of its line


@njit(**CACHED)
def wait(row):
    """Until every node answered the last request: spin ``spin_ns``, then sleep on the coordinator's doorbell in
    slices, looking at the pidfds and the deadline between them; an error is written to the control table."""
    control = doorbell.load_acquire_at(row + 8 * ROW_CONTROL)
    if _word(control, ERROR) != 0:
        return
    seq, base, nodes = _word(control, SEQ), _word(control, BASE), _word(control, NODES)
    sent = _word(control, SENT_NS)
    spin_until, deadline = sent + _word(control, SPIN_NS), sent + _word(control, HANG_NS)
    bell, timespec = base + _LINE, control + 8 * SLICE
    while True:
        seen = doorbell.bell_count_at(bell)
        pending = -1
        for n in range(nodes):
            line = base + (2 + n) * _LINE
            if doorbell.load_acquire_at(line + _DONE) != seq:
                if pending < 0:
                    pending = n
            elif doorbell.load_acquire_at(line + _STATUS) != _STATUS_OK:
                _set(control, ERROR_NODE, n)
                _set(control, ERROR, ERR_NODE)
                return
        now = doorbell.monotonic_ns()
        if pending < 0:
            break
        if now >= deadline:
            _set(control, ERROR_NODE, pending)
            _set(control, ERROR, ERR_HUNG)
            return
        if now < spin_until:
            doorbell.yield_cpu()
            continue
        if doorbell.any_readable(_word(control, POLLFDS), nodes):
            _set(control, ERROR_NODE, pending)  # which one ended is the supervisor's to find
            _set(control, ERROR, ERR_DEAD)
            return
        doorbell.futex_wait_at(bell, seen, timespec)
    _set(control, WAIT_NS, _word(control, WAIT_NS) + now - sent)
    _set(control, REQUESTS, _word(control, REQUESTS) + 1)
    for n in range(nodes):
        compute = doorbell.load_acquire_at(base + (2 + n) * _LINE + _COMPUTE)
        _set(control, COMPUTE_NS + n, _word(control, COMPUTE_NS + n) + compute)


_HOST_FN = types.void(types.voidptr)


def ring_host_fn(row):
    ring(doorbell.pointer_value(row))


def wait_host_fn(row):
    wait(doorbell.pointer_value(row))


@lru_cache(maxsize=None)
def _host_function(fn):
    """``fn`` as a C callable, compiled (or loaded from the cache) on first use, not at import: a cfunc compiles
    when it is made, and made at import it compiled in every process that imports the engine, a cold
    `strata generate` included, where a Ctrl-C then landed inside numba's callbacks (the compile child
    compiles it instead: coordinator/warmup.py's stream unit)."""
    return cfunc(_HOST_FN, **CACHED)(fn)


def ring_address() -> int:
    """The address of ``ring`` as a CUDA host function (CUhostFn)."""
    return _host_function(ring_host_fn).address


def wait_address() -> int:
    return _host_function(wait_host_fn).address


class SignalTables:
    """The control table and the layers' rows, in page-locked memory where ``alloc`` gives it (the host
    functions and the stream's copies read and write them)."""

    def __init__(self, io: pool_io.PoolIo, layers: int, spin_ns: int, hang_ns: int, alloc=np.zeros):
        nodes = io.layout.nodes
        if nodes > MAX_NODES:
            raise ValueError(f"the stream-signalled pool takes at most {MAX_NODES} nodes, not {nodes}")
        self.control = alloc(CONTROL_WORDS, np.int64)  # [CONTROL_WORDS]
        self.control[:] = 0
        self.rows = alloc(max(layers, 1) * ROW_WORDS, np.int64).reshape(-1, ROW_WORDS)  # [layers, ROW_WORDS]
        self.rows[:] = 0
        self.rows[:, ROW_CONTROL] = self.control.ctypes.data
        self.pollfds = np.zeros((nodes, 2), np.int32)  # struct pollfd: fd, events | revents << 16
        self.control[BASE] = io.segment.data.ctypes.data
        self.control[NODES] = nodes
        self.control[SPIN_NS], self.control[HANG_NS] = spin_ns, hang_ns
        self.control[POLLFDS] = self.pollfds.ctypes.data
        self.control[SLICE + 1] = SLICE_NS

    def set_pidfds(self, pidfds: list[int]) -> None:
        """The workers' pidfds (-1 where a worker has none: poll skips it)."""
        for n, fd in enumerate(pidfds):
            self.pollfds[n] = (fd, 1)  # POLLIN

    def row_address(self, slot: int) -> int:
        return self.rows[slot].ctypes.data

    def error(self) -> tuple[int, int]:
        """(error, node index): (0, 0) when the last step's host functions met none."""
        return int(self.control[ERROR]), int(self.control[ERROR_NODE])

    def clear_error(self) -> None:
        self.control[ERROR] = self.control[ERROR_NODE] = 0


def warm_up() -> None:
    """Compile (or load) the host functions now: their first call is on CUDA's callback thread."""
    assert ring_address() and wait_address()
