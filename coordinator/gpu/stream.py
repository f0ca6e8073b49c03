"""The process pool driven from the GPU's stream: what a graph-ready decode step queues for each MoE layer.

    link.begin_step(rows)                 before the step: sequence numbers, pidfds, deadline, counters
    link.post(slot, layer, x, split)      the stream copies x [T, H] and the CPU pairs into the pool segment,
                                          then calls shm/pool_signal's ring (the slot's layer and rows written
                                          on the host for it; link.restore writes a captured step's again)
    link.wait(slot)                       the stream calls wait: the work queued after it runs once every
                                          node has answered
    link.partials(T)                      the nodes' partials [N, T, H] copied onto the device, node order
    link.end_step(rows)                   after the step's synchronisation: the pool's stats, and any error
                                          (PoolError for a node's error answer; StreamInterrupted after a
                                          dead or hung worker was recovered: the caller redoes the step)

The pool segment is page-locked for the device (cudaHostRegister), so the copies are asynchronous; the tables the
host functions read are page-locked too. The copies are cudaMemcpyAsync calls (xp.copy_to_host, copy_to_device),
which a stream capture keeps; CuPy's get and set refuse to run inside one. Nothing here waits on the device.
"""

from __future__ import annotations

import numpy as np

from shm import pool_signal

from . import transfer as xp_module


class StreamInterrupted(Exception):
    """A worker died or hung inside a stream-driven step; the pool has recovered, the step's results are void."""


class StreamLink:
    def __init__(self, pool, layers: int, xp):
        pool_signal.warm_up()
        self.pool, self.xp, self.io = pool, xp, pool.io
        self.nodes = len(pool.workers)
        self.tables = pool_signal.SignalTables(pool.io, layers, int(pool.spin_s * 1e9), 0, alloc=xp_module.pinned)
        self.ring_address, self.wait_address = pool_signal.ring_address(), pool_signal.wait_address()
        xp_module.register_host(self.io.segment.data)
        self._registered = True
        self.posts: list[tuple[int, int, int]] = []  # this step's (slot, layer, rows) written for the host functions

    def begin_step(self, rows: int) -> None:
        """The pool's state into the tables: workers restarted where due, their pidfds, the request ids."""
        pool, control = self.pool, self.tables.control
        for w in pool.workers:
            pool.supervisor.ensure_running(w)
        self.tables.set_pidfds([w.pidfd if w.pidfd is not None else -1 for w in pool.workers])
        control[pool_signal.SEQ] = pool.request_id
        control[pool_signal.HANG_NS] = int(pool.hang_deadline_s(rows) * 1e9)
        control[pool_signal.WAIT_NS] = control[pool_signal.REQUESTS] = 0
        control[pool_signal.COMPUTE_NS:pool_signal.COMPUTE_NS + self.nodes] = 0
        self.tables.clear_error()
        self.posts.clear()

    def post(self, slot: int, layer: int, x, split) -> None:
        """Queue the copies of x [T, H] and the CPU pairs (compact.SplitPairs) into the segment, then the ring."""
        io, row = self.io, self.tables.rows[slot]
        T = x.shape[0]
        P = split.cpu_tokens.shape[0]
        row[pool_signal.ROW_LAYER], row[pool_signal.ROW_T] = layer, T
        self.posts.append((slot, layer, T))
        stream = self.xp.cuda.get_current_stream()
        for host, device in ((io.x[:T], self.xp.ascontiguousarray(x)), (io.tokens[:P], split.cpu_tokens),
                             (io.experts[:P], split.cpu_experts), (io.weights[:P], split.cpu_weights),
                             (row[pool_signal.ROW_P:pool_signal.ROW_P + 1], split.cpu_count)):
            xp_module.copy_to_host(host, device, stream)  # into the registered segment and pinned tables
        xp_module.launch_host_func(self.ring_address, self.tables.row_address(slot))

    def restore(self, posts: list[tuple[int, int, int]]) -> None:
        """The host rows a captured step's posts wrote (``posts``), written again before its graph is launched: a
        step of another shape may have written others since."""
        for slot, layer, T in posts:
            row = self.tables.rows[slot]
            row[pool_signal.ROW_LAYER], row[pool_signal.ROW_T] = layer, T

    def wait(self, slot: int) -> None:
        xp_module.launch_host_func(self.wait_address, self.tables.row_address(slot))

    def partials(self, T: int):
        """The nodes' partials [N, T, H] on the device, copied after the wait."""
        parts = self.xp.empty((self.nodes, T, self.io.layout.hidden), np.float32)
        stream = self.xp.cuda.get_current_stream()
        for n in range(self.nodes):
            xp_module.copy_to_device(parts[n], self.io.y[n][:T], stream)
        return parts

    def fits(self, rows: int, top_k: int) -> bool:
        """Whether a step of ``rows`` rows fits the segment's request regions."""
        layout = self.io.layout
        return rows <= layout.max_tokens and rows * top_k <= layout.max_pairs

    def end_step(self, rows: int) -> int:
        """After the step's synchronisation: fold the host functions' counters into the pool's stats; raise on an
        error (module docstring). Returns the nanoseconds the host functions waited on the pool."""
        pool, control = self.pool, self.tables.control
        pool.request_id = int(control[pool_signal.SEQ])
        waited = int(control[pool_signal.WAIT_NS])
        stats = pool.stats
        stats["requests"] += int(control[pool_signal.REQUESTS])
        stats["wait_ns"] += waited
        for n in range(self.nodes):
            stats["worker_compute_ns"][n] += int(control[pool_signal.COMPUTE_NS + n])
        error, node = self.tables.error()
        if error:
            self.tables.clear_error()
            pool.recover_stream(error, node, rows)  # raises PoolError for a node's error answer
            raise StreamInterrupted(f"node worker {node}: "
                                    f"{'ended' if error == pool_signal.ERR_DEAD else 'hung'} during a decode step")
        return waited

    def close(self) -> None:
        if self._registered:
            self._registered = False
            xp_module.unregister_host(self.io.segment.data)
