"""ProcessPool: the node workers as processes; only ``submit`` and ``collect`` live here.

The channel (channel.py) carries the messages, the supervisor (supervisor.py)
keeps the workers alive. ``submit`` sends the layer's work to every worker
(restarting a dead one first), ``collect`` waits for their partials, resending
to a worker restarted meanwhile or declared hung (silent past the hang
deadline: a setting, or derived from the layer times seen, with a floor), and
sums them in node order. After any error the pool is clean: the next
``submit`` starts afresh. While it waits, the pool calls ``wait_hook`` every
few tens of milliseconds (the server answers health and sees signals then; the
hook may raise StepInterrupted to abandon the wait).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np

from node_worker import protocol as P
from node_worker.job import WorkerJob
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

__all__ = ["PoolError", "ProcessPool", "WorkerDied"]


class ProcessPool(ExpertPool):
    def __init__(self, plan: PoolPlan, nodes: list[Node], job: WorkerJob, config: EngineConfig):
        if [n.id for n in nodes] != list(plan.node_ids):
            raise PoolError("the pool needs one node per plan node, in plan order")
        self.plan = plan
        self.hang_timeout_s = config.worker_hang_timeout
        self.channel = Channel(job.max_message_bytes, config.pool_spin_us)
        self.job = replace(job, endpoint=self.channel.endpoint)
        job_path = self.channel.write_file("job.json", self.job.to_json())
        self.supervisor = Supervisor(nodes, self.channel, job_path, plan.digest, job.model_digest,
                                     config.worker_start_timeout, config.worker_restart_window, config.keep_shm)
        self.workers = self.supervisor.workers
        self._waiting: dict[int, float] = {}  # node -> monotonic time the current request was sent to it
        self._row_s_max = 0.0  # slowest layer time per row seen, for the derived hang deadline
        self._rid = 0
        self._pending: PoolRequest | None = None
        self.timings = []
        self.stats = new_pool_stats(len(nodes))
        self.closed = False
        self._handlers = {P.Result: self._on_result, P.Error: self._on_error, P.Hello: self._on_hello}
        try:
            self.supervisor.start_all()
        except BaseException:
            self.close()
            raise

    @property
    def wait_hook(self):
        return self.supervisor.wait_hook

    @wait_hook.setter
    def wait_hook(self, hook) -> None:
        self.supervisor.wait_hook = hook

    # -- the ExpertPool interface ---------------------------------------------------------
    def submit(self, request: PoolRequest) -> None:
        if self._pending is not None:  # the last step failed between submit and collect: its replies are stale
            log.warning("request %s was never collected; dropping it", self._rid)
            self._pending = None
        self._rid += 1
        self._sent_at = time.perf_counter_ns()
        self._sent_mono = time.monotonic_ns()
        self._waiting = {}
        frames = self.channel.compute_frames(self._rid, request)
        try:
            for w in self.workers:
                self._send_to(w, frames)
        except BaseException:
            self._waiting = {}
            raise
        self._pending = request

    def _send_to(self, w: WorkerHandle, frames: list) -> None:
        self.supervisor.send_or_recover(w, frames)
        self._waiting[w.node.id] = time.monotonic()

    def collect(self, out: np.ndarray | None = None) -> np.ndarray:
        req, self._pending = self._pending, None
        if req is None:
            raise PoolError("collect() without submit()")
        collect_at = time.monotonic_ns()
        self._got: dict[bytes, P.Result] = {}
        self._arrived: dict[bytes, int] = {}  # monotonic ns each partial came in
        try:
            self._wait_for_partials(req, self._rid)
        finally:
            self._waiting = {}
        got = self._got
        wall = time.perf_counter_ns() - self._sent_at
        self._row_s_max = max(self._row_s_max, wall / 1e9 / max(1, req.x.shape[0]))
        last_sent = max(r.sent_ns for r in got.values())
        self.stats["idle_ns"] += max(0, collect_at - last_sent)
        self.stats["requests"] += 1
        self.stats["wait_ns"] += wall
        self.stats["restarts"] = self.supervisor.restarts
        order = [got[w.identity] for w in self.workers]
        for i, r in enumerate(order):
            self.stats["worker_compute_ns"][i] += r.compute_ns
        if self.record_timings:
            self.timings.append(LayerTiming(
                req.layer, req.x.shape[0], wall, tuple(r.compute_ns for r in order),
                tuple(r.bytes_read for r in order), tuple(r.received_ns - self._sent_mono for r in order),
                tuple(r.sent_ns - r.received_ns - r.compute_ns for r in order),
                tuple(self._arrived[w.identity] - got[w.identity].sent_ns for w in self.workers)))
        return sum_in_node_order([r.y for r in order], out)

    def _wait_for_partials(self, req: PoolRequest, rid: int) -> None:
        """Every worker's partial of request ``rid``; the dead and the hung are restarted and sent it again."""
        sup = self.supervisor
        deadline_s = self._hang_deadline_s(req.x.shape[0])
        sup.reset_hook_timer()
        while len(self._got) < len(self.workers):
            readable, fired = self.channel.poll(POLL_MS, sup.pidfds())
            if readable:
                identity, msg = self.channel.recv()
                w = sup.by_identity(identity)
                handler = self._handlers.get(type(msg))
                if w is not None and handler is not None:
                    handler(w, msg, rid)
            for w in sup.dead_among(fired):
                if w.identity not in self._got:  # done with this request: the next send restarts it
                    sup.recover(w, w.died())
                    self._send_to(w, self.channel.compute_frames(rid, req))
            now = time.monotonic()
            for w in self.workers:
                sent = self._waiting.get(w.node.id)
                if sent is not None and now - sent > deadline_s:
                    sup.recover(w, sup.kill_hung(w, now - sent))
                    self._send_to(w, self.channel.compute_frames(rid, req))
            sup.call_hook()

    def _on_result(self, w: WorkerHandle, msg: P.Result, rid: int) -> None:
        if msg.request_id == rid:
            self._arrived[w.identity] = time.monotonic_ns()
            self._got[w.identity] = msg
            self._waiting.pop(w.node.id, None)

    def _on_error(self, w: WorkerHandle, msg: P.Error, rid: int) -> None:
        if msg.fatal:
            w.last_words = msg.message  # the sentinel follows
        elif msg.request_id in (rid, 0):
            raise PoolError(msg.message)

    def _on_hello(self, w: WorkerHandle, msg: P.Hello, rid: int) -> None:
        w.hello = msg.info  # a late HELLO of a restarted worker

    def _hang_deadline_s(self, rows: int) -> float:
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
        """One empty round trip to every worker over the pool's sockets; seconds."""
        self._rid += 1
        t0 = time.perf_counter()
        self._ask_all(P.encode_ping(P.Ping(self._rid)), P.Pong, self._rid)
        return time.perf_counter() - t0

    def health(self) -> list[NodeHealth]:
        now = time.monotonic()
        return self.supervisor.health({node: now - sent for node, sent in self._waiting.items()})

    def maintain(self) -> None:
        self.supervisor.maintain()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.supervisor.close()
        self.channel.close()
