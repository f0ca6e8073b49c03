"""ProcessPool: the node workers as processes; only ``submit`` and ``collect`` live here.

The data path is a shared-memory segment the pool owns (shm/pool_io.py): X and
the routing are written there once for every node, each node's doorbell is
rung, and each worker writes its partial in place and rings back. The channel
(channel.py) carries the rest over ZeroMQ (the handshake, errors, last words,
STREAM reads, shutdown); the supervisor (supervisor.py) keeps the workers
alive. ``submit`` asks every worker (restarting a dead one first), ``collect``
spins ``pool_spin_us`` on the partials' sequence numbers (yielding the CPU each
round: doorbell.spin_pause), then sleeps on its
doorbell in slices of SLICE_S, between which it looks for deaths (the pidfds),
last words and errors (the socket) and hangs (silent past the hang deadline: a
setting, or derived from the layer times seen, with a floor); a worker
restarted meanwhile or declared hung is asked again. The partials are summed in
node order. After any error the pool is clean: the next
``submit`` starts afresh. While it waits, the pool calls ``wait_hook`` every
few tens of milliseconds (the server answers health and sees signals then; the
hook may raise StepInterrupted to abandon the wait).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np

from node_worker import kernel_threads
from node_worker import protocol as P
from node_worker.job import WorkerJob
from shm import doorbell, pool_io
from shm.interrupts import deferred
from shm.plan import PoolPlan
from shm.topology import Node

from ..config import EngineConfig
from .base import ExpertPool, LayerTiming, NodeHealth, PoolRequest, new_pool_stats, sum_in_node_order
from .channel import POLL_MS, Channel, PoolError
from .supervisor import Supervisor, WorkerDied, WorkerHandle

log = logging.getLogger(__name__)

HANG_FLOOR_S = 10.0  # a derived hang deadline is never below this ...
HANG_FLOOR_PER_ROW_S = 0.01  # ... plus this per row of the layer's batch
HANG_FACTOR = 50.0  # times the slowest per-row layer time seen so far
SLICE_S = 0.01  # the longest sleep on the doorbell between looks at the workers' health and the socket

__all__ = ["PoolError", "ProcessPool", "WorkerDied", "row_pieces"]


def row_pieces(tokens: np.ndarray, rows: int, max_rows: int, max_pairs: int) -> list[tuple[int, int]]:
    """A request's rows cut into consecutive ranges [lo, hi) the segment holds (at most max_rows rows and
    max_pairs pairs each); one range when it fits. A token's output depends on its own row and pairs alone, up
    to float32 rounding: the kernels tile an expert's tokens by their count (node_worker/kernels/rows.py), so a
    piece's rows may round otherwise than in one request. Only passes beyond a step's rows are cut (a whole
    prompt in one pass, Engine.logits); the serving steps fit (coordinator/context.py, segment_rows)."""
    if rows <= max_rows and tokens.size <= max_pairs:
        return [(0, rows)]
    if tokens.size and (tokens.min() < 0 or tokens.max() >= rows):  # the cut would drop such a pair unrefused
        raise PoolError(f"token index out of range [0, {rows})")
    per_row = np.bincount(tokens, minlength=rows)  # [rows] pairs
    if per_row.max(initial=0) > max_pairs:
        raise PoolError(f"a row routes {per_row.max()} pairs; the segment holds {max_pairs}")
    pieces, lo, pairs = [], 0, 0
    for r in range(rows):
        if r - lo == max_rows or pairs + per_row[r] > max_pairs:
            pieces.append((lo, r))
            lo, pairs = r, 0
        pairs += int(per_row[r])
    pieces.append((lo, rows))
    return pieces


class ProcessPool(ExpertPool):
    def __init__(self, plan: PoolPlan, nodes: list[Node], job: WorkerJob, config: EngineConfig,
                 kernel_team: bool = False, max_pairs: int | None = None):
        """``max_pairs``: the pairs the segment holds (job.max_tokens rows x top_k); every expert of every row
        when None."""
        if [n.id for n in nodes] != list(plan.node_ids):
            raise PoolError("the pool needs one node per plan node, in plan order")
        self.plan = plan
        self.hang_timeout_s = config.worker_hang_timeout
        self.channel = Channel(job.max_message_bytes, config.pool_spin_us)
        self.spin_s = config.pool_spin_us / 1e6
        # a coordinator with kernels of its own waits with numba's team asleep on its doorbell (kernel_threads.py)
        self.kernel_team = kernel_team
        self.wait_threads = kernel_threads.team_size() if kernel_team else 1
        self.closed = False
        self.io: pool_io.PoolIo | None = None
        self._link = None  # the stream-driven data path (stream.py), made on a decoder's first ask
        self._pieces: list[tuple[int, int]] = []  # the pending request's row ranges, posted one by one
        self.supervisor: Supervisor | None = None
        try:  # whatever stops the start (Ctrl-C included), everything made so far goes (close)
            self._start(plan, nodes, job, config, max_pairs or job.max_tokens * job.num_experts)
        except BaseException:
            self.close()
            raise

    def _start(self, plan: PoolPlan, nodes: list[Node], job: WorkerJob, config: EngineConfig, max_pairs: int) -> None:
        doorbell.warm_up()
        for name in pool_io.remove_stale():
            log.info("removed %s: its coordinator is gone", name)
        self.io = pool_io.create(pool_io.PoolIoLayout(len(nodes), job.max_tokens, max_pairs, job.hidden),
                                 job.model_digest, plan.digest)
        self.job = replace(job, endpoint=self.channel.endpoint, pool_io=self.io.segment.name)
        job_path = self.channel.write_file("job.json", self.job.to_json())
        self.supervisor = Supervisor(nodes, self.channel, job_path, plan.digest, job.model_digest,
                                     config.worker_start_timeout, config.worker_restart_window, config.keep_shm,
                                     job.expert_format)
        self.workers = self.supervisor.workers
        self.index = {w.node.id: i for i, w in enumerate(self.workers)}  # node -> its line in the segment
        self.supervisor.on_spawn = lambda w: self.io.cancel(self.index[w.node.id])
        self.supervisor.on_sent = lambda w: doorbell.ring(self.io.node_bells[self.index[w.node.id]], 0)
        self._waiting: dict[int, float] = {}  # node -> monotonic time the current request was sent to it
        self._row_s_max = 0.0  # slowest layer time per row seen, for the derived hang deadline
        self._rid = 0
        self._pending: PoolRequest | None = None
        self.timings = []
        self.stats = new_pool_stats(len(nodes))
        self._handlers = {P.Error: self._on_error, P.Hello: self._on_hello}
        self.supervisor.start_all()

    @property
    def wait_hook(self):
        return self.supervisor.wait_hook

    @wait_hook.setter
    def wait_hook(self, hook) -> None:
        self.supervisor.wait_hook = hook

    # -- the ExpertPool interface ---------------------------------------------------------
    @property
    def request_id(self) -> int:
        """The last request posted: the eager path's and the stream's share one sequence."""
        return self._rid

    @request_id.setter
    def request_id(self, rid: int) -> None:
        self._rid = rid

    def stream_link(self, make):
        """The pool driven from the device's stream through ``make(pool)``'s link (coordinator/gpu/stream.py),
        made once; None when timings are recorded per layer (the benchmark's breakdown needs the eager path)."""
        if self.record_timings:
            return None
        if self._link is None:
            self._link = make(self)
        return self._link

    def close_stream_link(self) -> None:
        """The stream link given up (its segment unregistered): the pool is driven from Python only."""
        if self._link is not None:
            self._link.close()
            self._link = None

    def recover_stream(self, error: int, node: int, rows: int) -> None:
        """After a stream-driven step met ``error`` on request ``request_id``: a node's error answer raises
        PoolError; a dead or hung worker is recovered and the request finished the eager way (restarted, asked
        again, every node waited for), so that the pool is idle for the step to be redone."""
        from shm import pool_signal

        seq, io = self._rid, self.io
        if error == pool_signal.ERR_NODE:
            raise PoolError(io.error_message(node))
        now = time.monotonic()
        self._waiting = {w.node.id: now for i, w in enumerate(self.workers) if io.done(i) != seq}
        try:
            if error == pool_signal.ERR_HUNG and io.done(node) != seq:
                w = self.workers[node]
                self.supervisor.recover(w, self.supervisor.kill_hung(w, self.hang_deadline_s(rows)))
                self._ask(w, seq)
            self._wait_for_partials(seq, rows)
        finally:
            self._waiting = {}

    def submit(self, request: PoolRequest) -> None:
        if self._pending is not None:  # the last step failed between submit and collect: its replies are stale
            log.warning("request %s was never collected; dropping it", self._rid)
            self._pending = None
        self._sent_at = time.perf_counter_ns()
        self._pieces = row_pieces(request.tokens, request.x.shape[0], self.io.layout.max_tokens,
                                  self.io.layout.max_pairs)
        self._post(request, self._pieces[0])
        self._pending = request

    def _post(self, request: PoolRequest, rows: tuple[int, int]) -> None:
        """Write the request's rows [lo, hi) and their pairs (rows renumbered from 0) and ask every worker."""
        lo, hi = rows
        tokens, experts, weights = request.tokens, request.experts, request.weights
        if (lo, hi) != (0, request.x.shape[0]):
            mine = (tokens >= lo) & (tokens < hi)
            tokens, experts, weights = tokens[mine] - lo, experts[mine], weights[mine]
        self._rid += 1
        self._sent_mono = time.monotonic_ns()
        self._waiting = {}
        self.io.post(self._rid, request.layer, request.x[lo:hi], tokens, experts, weights)
        try:
            for w in self.workers:
                self._ask(w, self._rid)
        except BaseException:
            self._waiting = {}
            raise

    def _ask(self, w: WorkerHandle, seq: int) -> None:
        """Ask one worker for request ``seq`` (already in the segment), restarting it first when it is dead."""
        self.supervisor.ensure_running(w)
        self.io.ask(self.index[w.node.id], seq)
        self._waiting[w.node.id] = time.monotonic()

    def collect(self, out: np.ndarray | None = None) -> np.ndarray:
        req, self._pending = self._pending, None
        if req is None:
            raise PoolError("collect() without submit()")
        pieces = self._pieces
        if len(pieces) == 1:
            return self._collect_piece(req, req.x.shape[0], out)
        if out is None:  # a request larger than the segment: its row pieces one after another
            out = np.empty((req.x.shape[0], self.io.layout.hidden), np.float32)
        for k, (lo, hi) in enumerate(pieces):
            if k:
                self._post(req, (lo, hi))
            self._collect_piece(req, hi - lo, out[lo:hi])
        return out

    def _collect_piece(self, req: PoolRequest, T: int, out: np.ndarray | None) -> np.ndarray:
        """The partials of the request posted last (T rows), summed in node order into ``out``."""
        collect_at = time.monotonic_ns()
        try:
            arrived = self._wait_for_partials(self._rid, T)
        finally:
            self._waiting = {}
        wall = time.perf_counter_ns() - self._sent_at
        self._row_s_max = max(self._row_s_max, wall / 1e9 / max(1, T))
        lines = [self.io.node_lines[i] for i in range(len(self.workers))]
        self.stats["idle_ns"] += max(0, collect_at - max(int(line[pool_io.NODE_SENT_NS]) for line in lines))
        self.stats["requests"] += 1
        self.stats["wait_ns"] += wall
        self.stats["restarts"] = self.supervisor.restarts
        compute = tuple(int(line[pool_io.NODE_COMPUTE_NS]) for line in lines)
        for i, c in enumerate(compute):
            self.stats["worker_compute_ns"][i] += c
        if self.record_timings:
            received = tuple(int(line[pool_io.NODE_RECEIVED_NS]) for line in lines)
            sent = tuple(int(line[pool_io.NODE_SENT_NS]) for line in lines)
            self.timings.append(LayerTiming(
                req.layer, T, wall, compute, tuple(int(line[pool_io.NODE_BYTES]) for line in lines),
                tuple(r - self._sent_mono for r in received),
                tuple(s - r - c for s, r, c in zip(sent, received, compute)),
                tuple(a - s for a, s in zip(arrived, sent))))
        self._sent_at = time.perf_counter_ns()  # the next piece's wall starts at its post
        return sum_in_node_order([self.io.y[i][:T] for i in range(len(self.workers))], out)

    def _wait_for_partials(self, seq: int, rows: int) -> list[int]:
        """Every worker's answer to request ``seq`` (monotonic ns each was seen); spins, then sleeps on the
        doorbell; the dead and the hung are restarted and asked again. An error answer raises PoolError."""
        io, sup = self.io, self.supervisor
        deadline_s = self.hang_deadline_s(rows)
        sup.reset_hook_timer()
        pending = set(range(len(self.workers)))
        arrived = [0] * len(self.workers)
        spin_until = time.perf_counter() + self.spin_s
        look_at = time.monotonic() + SLICE_S
        while True:
            seen = io.bell_count()
            for i in list(pending):
                if io.done(i) == seq:
                    pending.discard(i)
                    arrived[i] = time.monotonic_ns()
                    self._waiting.pop(self.workers[i].node.id, None)
                    if io.node_lines[i][pool_io.NODE_STATUS] != pool_io.STATUS_OK:
                        raise PoolError(io.error_message(i))
            if not pending:
                return arrived
            if time.perf_counter() >= spin_until:
                io.wait_bell(seen, SLICE_S, self.wait_threads)
            else:
                doorbell.spin_pause()
            if time.monotonic() >= look_at or io.bell_count() == seen and time.perf_counter() >= spin_until:
                look_at = time.monotonic() + SLICE_S  # quiet, or spinning for a while: look at the workers
                self._look_at_workers(seq, pending, deadline_s)

    def _look_at_workers(self, seq: int, pending: set[int], deadline_s: float) -> None:
        """Between sleeps: the socket (last words, errors), deaths (pidfds), hangs, the wait hook."""
        sup = self.supervisor
        readable, fired = self.channel.poll(0, sup.pidfds())
        while readable:
            identity, msg = self.channel.recv()
            w = sup.by_identity(identity)
            handler = self._handlers.get(type(msg))
            if w is not None and handler is not None:
                handler(w, msg, seq)
            readable, more = self.channel.poll(0, sup.pidfds())
            fired |= more
        for w in sup.dead_among(fired):
            if self.index[w.node.id] in pending:  # done with this request: the next ask restarts it
                sup.recover(w, w.died())
                self._ask(w, seq)
        now = time.monotonic()
        for w in self.workers:
            sent = self._waiting.get(w.node.id)
            if sent is not None and now - sent > deadline_s:
                sup.recover(w, sup.kill_hung(w, now - sent))
                self._ask(w, seq)
        sup.call_hook()

    def _on_error(self, w: WorkerHandle, msg: P.Error, rid: int) -> None:
        if msg.fatal:
            w.last_words = msg.message  # the sentinel follows
        elif msg.request_id in (rid, 0):
            raise PoolError(msg.message)

    def _on_hello(self, w: WorkerHandle, msg: P.Hello, rid: int) -> None:
        w.hello = msg.info  # a late HELLO of a restarted worker

    def hang_deadline_s(self, rows: int) -> float:
        """How long a worker may stay silent on a layer of ``rows`` rows before it is declared hung."""
        if self.hang_timeout_s is not None:
            return self.hang_timeout_s
        return max(HANG_FLOOR_S + HANG_FLOOR_PER_ROW_S * rows, HANG_FACTOR * self._row_s_max * rows)

    def _ask_all(self, frames: list, reply_type: type, rid: int) -> dict[bytes, object]:
        """Send the same message to every worker and wait for each one's reply of ``reply_type``."""
        sup = self.supervisor
        for w in self.workers:
            sup.send(w, frames)
        got: dict[bytes, object] = {}
        sup.reset_hook_timer()
        while len(got) < len(self.workers):
            readable, fired = self.channel.poll(POLL_MS, sup.pidfds())
            sup.call_hook()
            dead = sup.dead_among(fired)
            if dead:
                raise dead[0].died()
            if readable:
                identity, msg = self.channel.recv()
                if isinstance(msg, reply_type) and msg.request_id == rid:
                    got[identity] = msg
                elif isinstance(msg, P.Error) and msg.request_id in (rid, 0):
                    raise PoolError(msg.message)
        return got

    def membw(self, nbytes: int, repeats: int = 3) -> dict:
        self._rid += 1
        got = self._ask_all(P.encode_membw(P.MemBw(self._rid, nbytes, repeats)), P.MemBwResult, self._rid)
        per_node = [{"node": w.node.id, "seconds": got[w.identity].seconds, "gb_per_s": got[w.identity].gb_per_s,
                     "threads": w.hello.get("threads")} for w in self.workers]
        slowest = max(p["seconds"] for p in per_node)  # all nodes read at once
        return {"gb_per_s": nbytes * len(per_node) / slowest / 1e9, "per_node": per_node}

    def ping(self) -> float:
        """One empty round trip to every worker over the data path (the doorbells, nothing computed); seconds."""
        self._rid += 1
        t0 = time.perf_counter()
        self.io.post(self._rid, 0, self.io.x[:0], self.io.tokens[:0], self.io.experts[:0], self.io.weights[:0],
                     kind=pool_io.KIND_PING)
        try:
            for w in self.workers:
                self._ask(w, self._rid)
            self._wait_for_partials(self._rid, 1)
        finally:
            self._waiting = {}
        return time.perf_counter() - t0

    def health(self) -> list[NodeHealth]:
        now = time.monotonic()
        return self.supervisor.health({node: now - sent for node, sent in self._waiting.items()})

    def maintain(self) -> None:
        self.supervisor.maintain()

    def close(self) -> None:
        """Stop the workers, remove their segments (unless kept), the pool's segment and its folder; a Ctrl-C
        meanwhile waits until it is done (shm/interrupts.py). Also after a start that stopped half-way."""
        if self.closed:
            return
        self.closed = True
        with deferred():
            try:
                if self._link is not None:
                    self._link.close()
                if self.supervisor is not None:
                    self.supervisor.close()
                self.channel.close()
            finally:
                if self.io is not None:
                    self.io.close()
