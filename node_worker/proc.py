"""The node worker process: NodeWorker behind a DEALER socket, pinned to its node.

Started by the coordinator as ``python -m node_worker --job FILE --node N
--identity ID --parent-pid PID``; everything else is in the job (node_worker/job.py).
It pins itself to its node's CPUs (or runs under numactl), names itself
``strata-node<N>``, opens or fills its segment, connects, says HELLO, and then
answers COMPUTE and PING until SHUTDOWN. It dies with its parent: a watcher
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

from shm.checkpoint import Checkpoint
from shm.node_store import open_node_store
from shm.placement import segment_placement
from shm.plan import plan_from_dict

from . import protocol as P
from .job import JobError, WorkerJob
from .membw import read_bandwidth
from .worker import NodeWorker

log = logging.getLogger(__name__)
POLL_MS = 500


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


def _term(signum, frame):
    raise SystemExit(128 + signum)


def load_job(path: Path, node: int) -> WorkerJob:
    try:
        job = WorkerJob.from_json(path.read_text())
        job.node(node)
        return job
    except (OSError, JobError) as exc:
        raise SystemExit(f"node worker {node}: cannot use the job {path}: {exc}") from None


class WorkerProcess:
    def __init__(self, job: WorkerJob, node: int, identity: str):
        self.job = job
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
        self.spin_s = job.spin_us / 1e6
        self.handlers = {P.Compute: self.on_compute, P.MemBw: self.on_membw, P.Ping: self.on_ping}

    def send(self, frames: list) -> None:
        self.sock.send_multipart(frames, copy=False)

    def start(self) -> None:
        job, nj = self.job, self.node_job
        plan = plan_from_dict(job.plan)
        ckpt = Checkpoint(job.model_dir)
        store, report = open_node_store(ckpt, plan, self.node, job.expert_map(), job.hidden, self.cpus,
                                        model_digest=job.model_digest, node_free=nj.node_free or None,
                                        fmt=job.expert_format)
        store.segment.keep = job.keep_shm
        self.worker = NodeWorker(self.node, store, job.hidden, threads=nj.threads, cpus=self.cpus)
        placement = segment_placement(os.getpid(), report.segment, nj.local_node)
        rows = plan.slice_of(job.intermediate, self.node)
        self.send(P.encode_hello(P.Hello({
            "version": P.PROTOCOL_VERSION, "pid": os.getpid(), "node": self.node,
            "model_digest": job.model_digest, "plan_digest": plan.digest,
            "slice_rows": [rows.start, rows.stop] if rows else None, "threads": self.worker.threads,
            "cpus": self.cpus, "segment": report.segment, "segment_bytes": report.bytes,
            "reloaded": report.reloaded, "expert_format": job.expert_format, "load_s": report.seconds, "load_gb_per_s": report.gb_per_s,
            "placement": placement.as_dict() if placement else None,
        })))

    def recv(self):
        """The next message, spinning ``spin_us`` before blocking; None on timeout."""
        if self.spin_s:
            deadline = time.perf_counter() + self.spin_s
            while time.perf_counter() < deadline:
                try:
                    return self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    pass
        if self.sock.poll(POLL_MS):
            return self.sock.recv_multipart(copy=False)
        return None

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

    def on_compute(self, msg: P.Compute, received: int) -> None:
        job = self.job
        try:
            P.check_compute(msg, job.num_layers, job.num_experts, job.hidden, job.max_tokens)
            if msg.layer not in self.moe_layers:
                raise P.ProtocolError(f"layer {msg.layer} is not a MoE layer")
        except P.ProtocolError as exc:
            self.send(P.encode_error(P.Error(msg.request_id, False, f"node {self.node}: bad COMPUTE: {exc}")))
            return
        t0 = time.perf_counter_ns()
        before = self.worker.bytes_read
        y = self.worker.compute(msg.layer, msg.x, msg.tokens, msg.experts, msg.weights)
        compute = time.perf_counter_ns() - t0
        self.send(P.encode_result(P.Result(msg.request_id, y, compute, self.worker.bytes_read - before,
                                           received, time.monotonic_ns())))

    def on_membw(self, msg: P.MemBw, received: int) -> None:
        seconds, gbps = read_bandwidth(self.worker.runner, msg.nbytes, msg.repeats)
        self.send(P.encode_membw_result(P.MemBwResult(msg.request_id, seconds, gbps)))

    def on_ping(self, msg: P.Ping, received: int) -> None:
        self.send(P.encode_pong(P.Pong(msg.request_id)))

    def serve(self) -> None:
        while True:
            frames = self.recv()
            if frames is not None and not self.handle(frames):
                return

    def close(self) -> None:
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
    proc = WorkerProcess(job, args.node, args.identity)
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
