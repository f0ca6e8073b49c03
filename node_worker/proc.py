"""The node worker process: NodeWorker behind a DEALER socket, pinned to its node.

Started by the coordinator as ``python -m node_worker --job FILE --node N
--identity ID --parent-pid PID``; everything else is in the job (node_worker/job.py).
It pins itself to its node's CPUs (or runs under numactl), names itself
``strata-node<N>``, opens or fills its segment, maps the pool's data-path
segment (shm/pool_io.py), connects, says HELLO, and then serves until SHUTDOWN:
layers (and empty round trips) arrive through the data-path segment and its
doorbell, the rest (STREAM reads, shutdown, anything malformed) over the socket.
One thread waits on both: it spins ``spin_us`` on the request word (yielding
the CPU each round: doorbell.spin_pause), then sleeps
on its doorbell (a futex) for at most POLL_S, and looks at the socket whenever
it wakes; the coordinator rings the doorbell after each socket message too.
Where the kernel threads spin after a kernel (experts in an integer format:
kernel_threads.py) they sleep on the doorbell with it, and with ``spin_us`` 0 a
layer's answer, that sleep and the coordinator's ring are one compiled call
(node_worker/answer.py). It dies with its parent: a watcher
thread waits on the parent's pidfd and sends this process SIGTERM, whose
handler unwinds through the clean-up (the segment goes unless --keep-shm).
An exception that ends the process is sent first as a fatal ERROR (its last
words).
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import threading
import time
from pathlib import Path

import zmq

from shm import compile_log, doorbell, pool_io, segments
from shm.gguf_checkpoint import open_checkpoint
from shm.interrupts import deferred
from shm.jit_entry import entry_point
from shm.node_store import open_node_store
from shm.placement import segment_placement
from shm.plan import plan_from_dict

from . import answer, kernel_threads
from . import protocol as P
from .answer import compute_answer_sleep
from .job import JobError, WorkerJob
from .membw import read_bandwidth
from .worker import NodeWorker

log = logging.getLogger(__name__)
POLL_S = 0.1  # the longest sleep on the doorbell before the socket is looked at anyway


def set_title(node: int) -> None:
    title = f"strata-node{node}"
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:
        pass
    try:
        Path("/proc/self/comm").write_text(title[:15])
    except OSError:
        pass


def watch_parent(parent_pid: int) -> None:
    """SIGTERM this process when the parent exits (works from any parent thread, unlike PDEATHSIG)."""
    try:
        fd = os.pidfd_open(parent_pid)
    except (OSError, AttributeError):
        fd = None

    def run() -> None:
        if fd is not None:
            select.select([fd], [], [])
        else:
            while os.getppid() == parent_pid:
                time.sleep(0.5)
        log.warning("coordinator pid %s is gone; exiting", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)

    if os.getppid() != parent_pid:
        raise SystemExit(f"parent {parent_pid} already gone")
    threading.Thread(target=run, name="parent-watch", daemon=True).start()


_terminating: list[int] = []


def _term(signum, frame):
    """SIGTERM (the coordinator's stop, or the parent-watch's): unwind through the clean-up once; a second
    signal while it runs is ignored, so it finishes."""
    if not _terminating:
        _terminating.append(signum)
        raise SystemExit(128 + signum)


def load_job(path: Path, node: int) -> WorkerJob:
    try:
        job = WorkerJob.from_json(path.read_text())
        job.node(node)
        return job
    except (OSError, JobError) as exc:
        raise SystemExit(f"node worker {node}: cannot use the job {path}: {exc}") from None


class WorkerProcess:
    def __init__(self, job: WorkerJob, node: int, identity: str, parent_pid: int | None = None):
        self.job = job
        self.parent_pid = parent_pid
        self.node = node
        self.node_job = job.node(node)
        self.cpus = list(self.node_job.cpus) or sorted(os.sched_getaffinity(0))
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, (identity or f"node{node}").encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        # No MAXMSGSIZE here: libzmq drops a connection that breaks it and the DEALER
        # does not come back. The peer is our own coordinator over a 0700 ipc path, so
        # the limit is checked per message instead, and answered with an ERROR.
        self.max_message_bytes = job.max_message_bytes
        self.moe_layers = set(job.moe_layers)
        self.sock.connect(job.endpoint)
        self.worker: NodeWorker | None = None
        self.io: pool_io.PoolIo | None = None
        self.index = [n.node for n in job.nodes].index(node)  # this node's line and partial in the segment
        self.done_seq = 0
        self.spin_s = job.spin_us / 1e6
        self.poll_timespec = doorbell.timespec(POLL_S)  # the longest sleep of compute_answer_sleep
        self.team, self.answer_and_sleep = 1, False  # set in start(), once the node's threads are known
        self.answer_call = None  # compute_answer_sleep's entry point for its arguments' types (shm/jit_entry.py)
        self.handlers = {P.MemBw: self.on_membw}  # the socket's requests; layers come through the data path

    def send(self, frames: list) -> None:
        self.sock.send_multipart(frames, copy=False)

    def start(self) -> None:
        job, nj = self.job, self.node_job
        plan = plan_from_dict(job.plan)
        ckpt = open_checkpoint(job.model_dir)
        store, report = open_node_store(ckpt, plan, self.node, job.expert_map(), job.hidden, self.cpus,
                                        model_digest=job.model_digest, node_free=nj.node_free or None,
                                        fmt=job.expert_format)
        store.segment.keep = job.keep_shm
        try:
            self.worker = NodeWorker(self.node, store, job.hidden, threads=nj.threads, cpus=self.cpus,
                                     activations=job.activations, num_experts=job.num_experts)
        except BaseException:  # stopped (SIGTERM) or failed while loading its kernels: the segment goes unless kept
            store.close()
            raise
        self.worker.use_node_threads()  # this thread's numba count, set again by each layer's layer_args
        self.team = kernel_threads.team_size()  # the threads that sleep on the doorbell: the layer kernel's team
        # a layer's answer and the team's sleep in one compiled call (node_worker/answer.py)
        self.answer_and_sleep = self.team > 1 and not self.spin_s and doorbell.futex_available()
        self.io = pool_io.attach(job.pool_io, job.model_digest, plan.digest)
        doorbell.warm_up()
        answer.warm_up(self.worker.kernels)
        self.done_seq = self.io.done(self.index)
        placement = segment_placement(os.getpid(), report.segment, nj.local_node)
        rows = plan.slice_of(job.intermediate, self.node)
        self.send(P.encode_hello(P.Hello({
            "version": P.PROTOCOL_VERSION, "pid": os.getpid(), "node": self.node,
            "model_digest": job.model_digest, "plan_digest": plan.digest,
            "slice_rows": [rows.start, rows.stop] if rows else None, "threads": self.worker.threads,
            "cpus": self.cpus, "segment": report.segment, "segment_bytes": report.bytes,
            "reloaded": report.reloaded, "expert_format": job.expert_format, "load_s": report.seconds, "load_gb_per_s": report.gb_per_s,
            "compiled": compile_log.compiled(),  # [] where the coordinator compiled everything beforehand
            "placement": placement.as_dict() if placement else None,
        })))

    def wait(self) -> None:
        """Until the coordinator asks for something new or rings: spin, then sleep on the doorbell."""
        io, k = self.io, self.index
        seen = io.my_bell_count(k)
        if io.asked(k) != self.done_seq:
            return
        if self.spin_s and doorbell.spin_until(
                self.spin_s, lambda: io.asked(k) != self.done_seq or io.my_bell_count(k) != seen):
            return
        io.wait_my_bell(k, seen, POLL_S, self.team)

    def on_request(self) -> None:
        """The request the data path asks this node for: check its fixed fields, compute into this node's
        partial in the segment (the kernel checks the routing: layer_moe), ring back."""
        io, k = self.io, self.index
        seq = io.asked(k)
        received = time.monotonic_ns()
        layer, T, Pn, kind = (int(v) for v in io.request[pool_io.REQ_LAYER:pool_io.REQ_KIND + 1])
        compute_ns = bytes_read = 0
        problem = ""
        if kind == pool_io.KIND_COMPUTE:
            problem = self.check_request(layer, T, Pn)
            if not problem:
                started = time.monotonic_ns()
                args = self.worker.layer_args(layer, io.x[:T], io.tokens[:Pn], io.experts[:Pn], io.weights[:Pn],
                                              out=io.y[k])
                if self.answer_and_sleep:
                    seen = io.my_bell_count(k)  # before the answer: the next request's ring comes after it
                    every = args + (io.node_lines[k], seq, received, started, io.coordinator_bell, io.bell_address(k),
                                    seen, self.poll_timespec.ctypes.data, self.team)
                    self.answer_call = self.answer_call or entry_point(compute_answer_sleep, every)  # fixed types
                    bytes_read = self.answer_call(*every)
                    if bytes_read >= 0:
                        self.worker.count(layer, bytes_read, T)
                        self.done_seq = seq
                        return
                else:
                    bytes_read = self.worker.run_layer(args)
                compute_ns = time.monotonic_ns() - started
                if bytes_read < 0:
                    problem = self.worker.routing_error(bytes_read, T)
                else:
                    self.worker.count(layer, bytes_read, T)
        elif kind != pool_io.KIND_PING:
            problem = f"unknown request kind {kind}"
        if problem:
            log.error("node %s: bad request %s: %s", self.node, seq, problem)
        io.finish(k, seq, pool_io.STATUS_ERROR if problem else pool_io.STATUS_OK, compute_ns, bytes_read, received,
                  f"node {self.node}: bad request: {problem}" if problem else "")
        self.done_seq = seq

    def check_request(self, layer: int, T: int, Pn: int) -> str:
        """What is wrong with a request's fixed fields ('' when nothing)."""
        lay = self.io.layout
        if not 0 < T <= lay.max_tokens:
            return f"{T} rows outside [1, {lay.max_tokens}]"
        if not 0 <= Pn <= lay.max_pairs:
            return f"{Pn} pairs outside [0, {lay.max_pairs}]"
        if layer not in self.moe_layers:
            return f"layer {layer} is not a MoE layer"
        return ""

    def handle(self, frames) -> bool:
        """Answer one message; False on SHUTDOWN."""
        received = time.monotonic_ns()
        size = sum(len(f) for f in frames)
        if size > self.max_message_bytes:
            self.send(P.encode_error(P.Error(0, False, f"node {self.node}: bad message: {size} bytes exceed the "
                                                       f"limit of {self.max_message_bytes}")))
            return True
        try:
            msg = P.decode(frames)
        except P.ProtocolError as exc:
            self.send(P.encode_error(P.Error(0, False, f"node {self.node}: bad message: {exc}")))
            return True
        if isinstance(msg, P.Shutdown):
            return False
        handler = self.handlers.get(type(msg))
        if handler is None:
            self.send(P.encode_error(P.Error(0, False, f"node {self.node}: unexpected {type(msg).__name__}")))
        else:
            handler(msg, received)
        return True

    def on_membw(self, msg: P.MemBw, received: int) -> None:
        seconds, gbps = read_bandwidth(self.worker.threads, msg.nbytes, msg.repeats)
        self.send(P.encode_membw_result(P.MemBwResult(msg.request_id, seconds, gbps)))

    def serve(self) -> None:
        while True:
            self.wait()
            if self.io.asked(self.index) != self.done_seq:
                self.on_request()
            while self.sock.poll(0):  # control messages, and anything malformed, over the socket
                if not self.handle(self.sock.recv_multipart(copy=False)):
                    return

    def close(self) -> None:
        with deferred():  # a SIGTERM meanwhile waits until the segment is gone
            self._close()

    def _close(self) -> None:
        if self.io is not None:
            self.io.close()
            if self.parent_pid is not None and os.getppid() != self.parent_pid:
                # the coordinator, the data path's owner, is gone (SIGKILL): its segment goes with the workers
                segments.unlink(self.io.segment.name)
        if self.worker is not None:
            self.worker.close()
        self.sock.close(linger=500)  # let last words out, never block for long
        self.ctx.term()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m node_worker")
    p.add_argument("--job", type=Path, required=True, help="the pool's job file (node_worker/job.py)")
    p.add_argument("--node", type=int, required=True, help="which of the job's nodes this worker serves")
    p.add_argument("--identity", default="", help="the DEALER routing id of this incarnation (default node<N>)")
    p.add_argument("--parent-pid", dest="parent_pid", type=int, required=True, help="exit when this process does")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    job = load_job(args.job, args.node)
    logging.basicConfig(level=job.log_level, format=f"%(levelname)s node{args.node} %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGINT, _term)
    set_title(args.node)
    watch_parent(args.parent_pid)
    cpus = job.node(args.node).cpus
    if cpus:
        try:
            os.sched_setaffinity(0, set(cpus))
        except OSError as exc:
            log.warning("cannot pin to CPUs %s: %s", cpus, exc)
    proc = WorkerProcess(job, args.node, args.identity, args.parent_pid)
    try:
        proc.start()
        proc.serve()
        return 0
    except SystemExit:
        raise
    except BaseException as exc:
        # last words: the coordinator hears why before it sees the exit
        try:
            proc.send(P.encode_error(P.Error(0, True, f"node {args.node} (pid {os.getpid()}) failed: "
                                                      f"{type(exc).__name__}: {exc}")))
        except zmq.ZMQError:
            pass
        log.exception("node worker failed")
        return 3
    finally:
        proc.close()
        for sig in (signal.SIGTERM, signal.SIGINT):  # cleaned up: a later signal (the parent-watch's, as the
            signal.signal(sig, signal.SIG_IGN)     # coordinator exits) leaves the exit to finish quietly
