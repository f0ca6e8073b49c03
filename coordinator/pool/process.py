"""ProcessPool: the node workers as processes, over ZeroMQ.

The coordinator binds one ROUTER socket on an ipc:// endpoint inside a private
0700 directory; each worker connects a DEALER named ``node<N>``. ``submit``
sends the layer's work to every worker, ``collect`` waits for their partials
and sums them in node order.

A worker's death is seen three ways: its last words (a fatal ERROR), its
process sentinel (a pidfd in the same poll as the socket), and a check before
each send. All three surface as WorkerDied. A worker that stays silent on a
layer past the hang deadline (a setting, or derived from the layer times seen,
with a floor) is declared hung and killed, which counts as a death. The pool
restarts a dead worker (it reattaches to its complete segment) and resends the
request; a second death within the restart window fails the request with
WorkerDied and leaves the worker down until the window has passed, when the
next request or ``maintain()`` starts it again. After any error the pool is
clean: the next ``submit`` starts afresh.

While it waits on the workers the pool calls ``wait_hook`` every
HOOK_INTERVAL_S, so the server can answer health and see signals; the hook may
raise (StepInterrupted) to abandon the wait.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zmq

from node_worker import protocol as P
from shm import segments
from shm.plan import PoolPlan
from shm.topology import Node

from ..errors import StepInterrupted, StrataError
from ..pool import ExpertPool, LayerTiming, PoolRequest, sum_in_node_order

log = logging.getLogger(__name__)

RESTART_WINDOW_S = 30.0
POLL_MS = 100
SHUTDOWN_WAIT_S = 2.0  # for a worker to exit on SHUTDOWN; then SIGTERM (with SIGCONT), then SIGKILL
HOOK_INTERVAL_S = 0.05
HANG_FLOOR_S = 10.0  # a derived hang deadline is never below this ...
HANG_FLOOR_PER_ROW_S = 0.01  # ... plus this per row of the layer's batch
HANG_FACTOR = 50.0  # times the slowest per-row layer time seen so far


class WorkerDied(StrataError):
    """A node worker exited; names the node, pid and exit status."""

    def __init__(self, node: int, pid: int, status: str, detail: str = ""):
        self.node, self.pid, self.status = node, pid, status
        super().__init__(f"node worker {node} (pid {pid}) died: {status}" + (f"; {detail}" if detail else ""))


class PoolError(StrataError):
    """A node worker refused a request or the pool could not start."""


def exit_status(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


@dataclass
class WorkerHandle:
    node: Node
    identity: bytes
    proc: subprocess.Popen | None = None
    pidfd: int | None = None
    hello: dict = field(default_factory=dict)
    last_words: str = ""
    started: list[float] = field(default_factory=list)
    deaths: list[float] = field(default_factory=list)  # monotonic times of this worker's deaths (hangs included)
    death_seen: bool = False  # this incarnation's death is counted already
    retry_at: float | None = None  # a refused restart is tried again from this monotonic time
    down_reason: str = ""  # why it is not restarted before retry_at
    last_error: str = ""

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else -1

    def dead(self) -> bool:
        return self.proc is None or self.proc.poll() is not None

    def died(self) -> WorkerDied:
        code = None
        if self.proc is not None:
            try:
                code = self.proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                code = self.proc.wait()
        return WorkerDied(self.node.id, self.pid, exit_status(code), self.last_words)

    def close_pidfd(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


@dataclass(frozen=True)
class PoolOptions:
    threads: int | None = None  # per worker; None = the node's CPUs
    spin_us: float = 0.0
    keep_shm: bool = False
    start_timeout_s: float = 600.0
    max_tokens: int = 65536
    use_numactl: bool = True
    hang_timeout_s: float | None = None  # None: derived from the layer times seen, at least HANG_FLOOR_S
    restart_window_s: float = RESTART_WINDOW_S


def numactl_prefix(node: Node, use: bool) -> list[str]:
    """numactl binding for a real node where numactl exists; virtual nodes are pinned by affinity."""
    if use and not node.virtual and shutil.which("numactl"):
        return ["numactl", f"--cpunodebind={node.id}", f"--membind={node.id}"]
    return []


class ProcessPool(ExpertPool):
    def __init__(self, plan: PoolPlan, nodes: list[Node], job: dict, options: PoolOptions):
        if [n.id for n in nodes] != list(plan.node_ids):
            raise PoolError("the pool needs one node per plan node, in plan order")
        self.plan = plan
        self.options = options
        self.dir = Path(tempfile.mkdtemp(prefix="strata-pool-"))
        os.chmod(self.dir, 0o700)
        self.endpoint = f"ipc://{self.dir}/pool.sock"
        self.job_path = self.dir / "job.json"
        max_msg = job["max_tokens"] * job["hidden"] * 4 * 2 + (1 << 20)
        self.job = dict(job, max_message_bytes=max_msg)
        self.job_path.write_text(json.dumps(self.job))
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_msg)
        self.sock.bind(self.endpoint)
        self.workers = [WorkerHandle(n, f"node{n.id}".encode()) for n in nodes]
        self._poller: zmq.Poller | None = None
        self.wait_hook = None  # called every HOOK_INTERVAL_S while the pool waits on its workers
        self._waiting: dict[int, float] = {}  # node -> monotonic time the current request was sent to it
        self._row_s_max = 0.0  # slowest layer time per row seen, for the derived hang deadline
        self._rid = 0
        self._pending: PoolRequest | None = None
        self._backlog: list = []  # replies that arrived while a restarted worker was handshaking
        self.timings = []
        self.stats = {"requests": 0, "restarts": 0, "wait_ns": 0, "worker_compute_ns": [0] * len(nodes),
                      "idle_ns": 0}  # idle: partials done before the coordinator came to collect them
        self.closed = False
        try:
            for w in self.workers:
                self._spawn(w)
            self._handshake(self.workers)
        except BaseException:
            self.close()
            raise

    # -- process plumbing ----------------------------------------------------
    def _spawn(self, w: WorkerHandle) -> None:
        n = w.node
        threads = self.options.threads or len(n.cpus)
        cmd = numactl_prefix(n, self.options.use_numactl) + [
            sys.executable, "-m", "node_worker", "--job", str(self.job_path), "--node", str(n.id),
            "--local-node", str(n.parent if n.virtual else n.id), "--cpus", ",".join(map(str, n.cpus)),
            "--threads", str(threads), "--endpoint", self.endpoint, "--parent-pid", str(os.getpid()),
            "--identity", w.identity.decode(), "--spin-us", str(self.options.spin_us), "--node-free", str(n.mem_free or 0),
        ] + (["--keep-shm"] if self.options.keep_shm else [])
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        w.close_pidfd()
        # a fresh identity per incarnation: a dead predecessor's pipe can never take its messages
        w.identity = f"node{n.id}.{len(w.started)}".encode()
        cmd[cmd.index("--identity") + 1] = w.identity.decode()
        w.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
        try:
            w.pidfd = os.pidfd_open(w.proc.pid)
        except (OSError, AttributeError):
            w.pidfd = None  # falls back to polling the process every POLL_MS
        w.hello, w.last_words, w.death_seen, w.retry_at = {}, "", False, None
        self._poller = None
        w.started.append(time.monotonic())
        log.info("started node worker %s pid %s: %s", n.id, w.proc.pid, " ".join(cmd))

    def _poll(self, timeout_ms: int) -> tuple[bool, list[WorkerHandle]]:
        """(socket readable, workers whose process ended); spins ``spin_us`` on the socket before blocking."""
        if self.options.spin_us and timeout_ms:
            deadline = time.perf_counter() + self.options.spin_us / 1e6
            while time.perf_counter() < deadline:
                if self.sock.poll(0):
                    return True, []
        if self._poller is None:  # rebuilt after a (re)spawn changes the pidfds
            self._poller = zmq.Poller()
            self._poller.register(self.sock, zmq.POLLIN)
            for w in self.workers:
                if w.pidfd is not None:
                    self._poller.register(w.pidfd, zmq.POLLIN)
        events = dict(self._poller.poll(timeout_ms))
        readable = self.sock in events
        dead = [w for w in self.workers if (w.pidfd in events if w.pidfd is not None else w.dead())]
        return readable, [w for w in dead if w.dead() or w.proc.wait(timeout=2.0) is not None]

    def _by_identity(self, ident: bytes) -> WorkerHandle | None:
        return next((w for w in self.workers if w.identity == ident), None)

    def _handshake(self, pending: list[WorkerHandle]) -> None:
        waiting = {w.identity: w for w in pending}
        deadline = time.monotonic() + self.options.start_timeout_s
        while waiting:
            if time.monotonic() > deadline:
                names = ", ".join(f"node {w.node.id} (pid {w.pid})" for w in waiting.values())
                raise PoolError(
                    f"{names} did not finish starting within {self.options.start_timeout_s:.0f}s; a large model "
                    "may need a longer STRATA_WORKER_START_TIMEOUT, or check the worker's stderr above"
                )
            readable, dead = self._poll(POLL_MS)
            if readable:
                self._handle_unsolicited(self.sock.recv_multipart(copy=False), waiting)
            for w in dead:
                if w.identity in waiting:
                    raise w.died()
            self._call_hook()

    def _handle_unsolicited(self, frames, waiting: dict) -> None:
        w = self._by_identity(bytes(frames[0].buffer))
        msg = self._decode(frames[1:], w)
        if isinstance(msg, P.Hello) and w is not None:
            self._check_hello(w, msg.info)
            w.hello = msg.info
            waiting.pop(w.identity, None)
        elif isinstance(msg, P.Error) and w is not None and msg.fatal:
            w.last_words = msg.message
        else:
            self._backlog.append(frames)  # another worker's reply, for collect()

    def _check_hello(self, w: WorkerHandle, info: dict) -> None:
        problems = []
        if info.get("version") != P.PROTOCOL_VERSION:
            problems.append(f"protocol {info.get('version')} != {P.PROTOCOL_VERSION}")
        if info.get("plan_digest") != self.plan.digest:
            problems.append(f"plan {info.get('plan_digest')} != {self.plan.digest}")
        if info.get("model_digest") != self.job["model_digest"]:
            problems.append(f"model {info.get('model_digest')} != {self.job['model_digest']}")
        if info.get("node") != w.node.id:
            problems.append(f"node {info.get('node')} != {w.node.id}")
        if problems:
            raise PoolError(f"node worker {w.node.id} (pid {w.pid}) handshake mismatch: {'; '.join(problems)}")
        log.info("node %s ready: pid %s, rows %s, %s threads, %s, placement %s", w.node.id, info.get("pid"),
                 info.get("slice_rows"), info.get("threads"),
                 "reloaded" if info.get("reloaded") else "reattached", info.get("placement"))

    def _decode(self, frames, w: WorkerHandle | None):
        try:
            return P.decode(frames)
        except P.ProtocolError as exc:
            name = f"node worker {w.node.id}" if w else "unknown peer"
            raise PoolError(f"{name} sent a malformed message: {exc}") from None

    def _send(self, w: WorkerHandle, frames: list) -> None:
        if w.dead():  # check before each send
            raise w.died()
        try:
            self.sock.send_multipart([w.identity] + frames, copy=False)
        except zmq.ZMQError as exc:  # EHOSTUNREACH under ROUTER_MANDATORY: the peer is gone
            if w.dead() or self._reaped_soon(w):  # a kill races the send: its pipe closes before it is reaped
                raise w.died() from None
            raise PoolError(f"cannot send to node worker {w.node.id} (pid {w.pid}): {exc}") from None

    @staticmethod
    def _reaped_soon(w: WorkerHandle, timeout_s: float = 2.0) -> bool:
        try:
            w.proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    def _call_hook(self) -> None:
        if self.wait_hook is not None and time.monotonic() - self._hook_at >= HOOK_INTERVAL_S:
            self._hook_at = time.monotonic()
            self.wait_hook()

    _hook_at = 0.0

    # -- deaths and restarts -------------------------------------------------
    def _recover(self, w: WorkerHandle, died: WorkerDied) -> None:
        """Count a death and restart the worker, unless it is its second within the window (then raise)."""
        now = time.monotonic()
        if not w.death_seen:
            w.death_seen = True
            w.deaths.append(now)
        w.last_error = str(died)
        window = self.options.restart_window_s
        if len([t for t in w.deaths if now - t < window]) >= 2:
            w.retry_at = now + window
            w.down_reason = f"it died twice within {window:.0f}s"
            log.error("%s; it died twice within %.0fs: not restarting for %.0fs", died, window, window)
            raise WorkerDied(died.node, died.pid, died.status,
                             f"it died twice within {window:.0f}s; it is restarted once {window:.0f}s have passed")
        log.warning("%s; restarting it", died)
        self._restart(w)

    def _restart(self, w: WorkerHandle) -> None:
        self.stats["restarts"] += 1
        self._spawn(w)
        try:
            self._handshake([w])
        except StepInterrupted:
            raise
        except StrataError as exc:  # it did not come back: try again after the window
            w.retry_at = time.monotonic() + self.options.restart_window_s
            w.last_error = f"restart failed: {exc}"
            w.down_reason = f"its restart failed ({exc})"
            if not w.dead():
                w.proc.kill()
                w.proc.wait()
            w.death_seen = True
            raise

    def _ensure_running(self, w: WorkerHandle) -> None:
        """The check before each send: a dead worker is restarted now, or refused while its window lasts."""
        if not w.dead():
            return
        if w.retry_at is not None:
            wait = w.retry_at - time.monotonic()
            if wait > 0:
                raise WorkerDied(w.node.id, w.pid, exit_status(w.proc.returncode if w.proc else None),
                                 f"{w.down_reason}; the next restart is tried in {wait:.0f}s")
            log.info("node worker %s: its restart window has passed; starting it again", w.node.id)
            w.retry_at = None
            self._restart(w)
            return
        self._recover(w, w.died())

    def maintain(self) -> None:
        """Between steps: restart workers that died while idle, or whose refused restart is due."""
        for w in self.workers:
            if w.dead() and (w.retry_at is None or time.monotonic() >= w.retry_at):
                try:
                    self._ensure_running(w)
                except StepInterrupted:
                    raise
                except StrataError as exc:
                    log.error("node worker %s: %s", w.node.id, exc)

    def _hang_deadline_s(self, rows: int) -> float:
        if self.options.hang_timeout_s is not None:
            return self.options.hang_timeout_s
        return max(HANG_FLOOR_S + HANG_FLOOR_PER_ROW_S * rows, HANG_FACTOR * self._row_s_max * rows)

    def _kill_hung(self, w: WorkerHandle, silent_s: float) -> WorkerDied:
        log.error("node worker %s (pid %s) sent nothing for %.1fs on one layer: hung; killing it", w.node.id, w.pid,
                  silent_s)
        w.proc.kill()
        w.proc.wait()
        return WorkerDied(w.node.id, w.pid, f"hung (silent for {silent_s:.1f}s on one layer), killed")

    # -- the ExpertPool interface -------------------------------------------
    def _compute_frames(self, rid: int, req: PoolRequest) -> list:
        return P.encode_compute(P.Compute(rid, req.layer, req.x, req.tokens.astype(np.int32),
                                          req.experts.astype(np.int32), req.weights.astype(np.float32)))

    def submit(self, request: PoolRequest) -> None:
        if self._pending is not None:  # the last step failed between submit and collect: its replies are stale
            log.warning("request %s was never collected; dropping it", self._rid)
            self._pending = None
        self._rid += 1
        self._sent_at = time.perf_counter_ns()
        self._sent_mono = time.monotonic_ns()
        self._waiting = {}
        frames = self._compute_frames(self._rid, request)
        try:
            for w in self.workers:
                self._send_or_recover(w, frames)
        except BaseException:
            self._waiting = {}
            raise
        self._pending = request

    def _send_or_recover(self, w: WorkerHandle, frames: list) -> None:
        self._ensure_running(w)
        try:
            self._send(w, frames)
        except WorkerDied as died:
            self._recover(w, died)
            self._send(w, frames)
        self._waiting[w.node.id] = time.monotonic()

    def collect(self, out: np.ndarray | None = None) -> np.ndarray:
        req, self._pending = self._pending, None
        if req is None:
            raise PoolError("collect() without submit()")
        rid = self._rid
        collect_at = time.monotonic_ns()
        partials: dict[bytes, np.ndarray] = {}
        compute: dict[bytes, tuple[int, int, int]] = {}  # compute ns, bytes read, sent ns
        hops: dict[bytes, tuple[int, int, int]] = {}
        try:
            self._collect_into(req, rid, partials, compute, hops)
        finally:
            self._waiting = {}
        last_sent = max(c[2] for c in compute.values())
        wall = time.perf_counter_ns() - self._sent_at
        self._row_s_max = max(self._row_s_max, wall / 1e9 / max(1, req.x.shape[0]))
        self.stats["idle_ns"] += max(0, collect_at - last_sent) if last_sent else 0
        self.stats["requests"] += 1
        self.stats["wait_ns"] += wall
        if self.record_timings:
            order = [w.identity for w in self.workers]
            self.timings.append(LayerTiming(req.layer, req.x.shape[0], wall,
                                            tuple(compute[i][0] for i in order), tuple(compute[i][1] for i in order),
                                            tuple(hops.get(i, (0, 0, 0))[0] for i in order),
                                            tuple(hops.get(i, (0, 0, 0))[1] for i in order),
                                            tuple(hops.get(i, (0, 0, 0))[2] for i in order)))
        return sum_in_node_order([partials[w.identity] for w in self.workers], out)

    def _collect_into(self, req: PoolRequest, rid: int, partials: dict, compute: dict, hops: dict) -> None:
        """Wait for every worker's partial of request ``rid``; restart the dead and the hung and resend to them."""
        deadline_s = self._hang_deadline_s(req.x.shape[0])
        self._hook_at = time.monotonic()
        while len(partials) < len(self.workers):
            readable, dead = self._poll(0 if self._backlog else POLL_MS)
            if readable or self._backlog:
                frames = self._backlog.pop(0) if self._backlog else self.sock.recv_multipart(copy=False)
                w = self._by_identity(bytes(frames[0].buffer))
                msg = self._decode(frames[1:], w)
                if w is None:
                    continue
                if isinstance(msg, P.Result) and msg.request_id == rid:
                    partials[w.identity] = msg.y
                    compute[w.identity] = (msg.compute_ns, msg.bytes_read, msg.sent_ns)
                    self._waiting.pop(w.node.id, None)
                    hops[w.identity] = (msg.received_ns - self._sent_mono,
                                        msg.sent_ns - msg.received_ns - msg.compute_ns,
                                        time.monotonic_ns() - msg.sent_ns)
                    self.stats["worker_compute_ns"][self.workers.index(w)] += msg.compute_ns
                elif isinstance(msg, P.Error) and msg.fatal:
                    w.last_words = msg.message  # the sentinel follows
                elif isinstance(msg, P.Error) and msg.request_id in (rid, 0):
                    raise PoolError(msg.message)
                elif isinstance(msg, P.Hello):
                    self._check_hello(w, msg.info)
                    w.hello = msg.info
            for w in dead:
                if w.identity in partials:
                    continue  # its part of this request is done; the next send restarts it
                self._recover(w, w.died())
                self._send_or_recover(w, self._compute_frames(rid, req))
            now = time.monotonic()
            for w in self.workers:
                sent = self._waiting.get(w.node.id)
                if sent is not None and w.identity not in partials and now - sent > deadline_s:
                    self._recover(w, self._kill_hung(w, now - sent))
                    self._send_or_recover(w, self._compute_frames(rid, req))
            self._call_hook()

    def _ask_all(self, frames: list, reply_type: type, rid: int) -> dict[bytes, object]:
        """Send the same message to every worker and wait for each one's reply of ``reply_type``."""
        for w in self.workers:
            self._send(w, frames)
        got: dict[bytes, object] = {}
        while len(got) < len(self.workers):
            readable, dead = self._poll(POLL_MS)
            self._call_hook()
            if dead:
                raise dead[0].died()
            if readable:
                frames_in = self.sock.recv_multipart(copy=False)
                ident = bytes(frames_in[0].buffer)
                msg = self._decode(frames_in[1:], self._by_identity(ident))
                if isinstance(msg, reply_type) and msg.request_id == rid:
                    got[ident] = msg
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

    def health(self) -> list[dict]:
        return [{"node": w.node.id, "virtual": w.node.virtual, "pid": w.pid, "alive": not w.dead(),
                 "state": self._state(w), "restarts": len(w.started) - 1, "deaths": len(w.deaths),
                 "last_error": w.last_error or None,
                 **{k: w.hello.get(k) for k in ("slice_rows", "threads", "placement", "reloaded", "segment",
                                                "segment_bytes")}}
                for w in self.workers]

    def _state(self, w: WorkerHandle) -> str:
        """ok | silent for N s on the current layer | down, restarted in N s | dead (restarted at the next request)."""
        if not w.dead():
            sent = self._waiting.get(w.node.id)
            silent = time.monotonic() - sent if sent is not None else 0.0
            return f"silent for {silent:.1f}s on the current layer" if silent >= 1.0 else "ok"
        if w.retry_at is not None:
            return f"down: restart refused, tried again in {max(0.0, w.retry_at - time.monotonic()):.0f}s"
        return "dead: restarted at the next request"

    def _remove_orphan_segment(self, w: WorkerHandle) -> None:
        """A worker that died cannot unlink its segment; its parent does, unless asked to keep it."""
        name = w.hello.get("segment")
        if not name or self.options.keep_shm or w.proc is None or w.proc.returncode == 0:
            return
        try:
            header = segments.read_header(name)
        except segments.SegmentError:
            return
        if header.owner_pid == w.pid and not segments.owner_alive(header):
            segments.unlink(name)
            log.info("removed segment %s of dead node worker %s (pid %s)", name, w.node.id, w.pid)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for w in self.workers:
            if not w.dead():
                try:
                    self.sock.send_multipart([w.identity] + P.encode_shutdown(), zmq.NOBLOCK)
                except zmq.ZMQError:
                    w.proc.terminate()
        deadline = time.monotonic() + SHUTDOWN_WAIT_S
        for w in self.workers:
            if w.proc is None:
                continue
            try:
                w.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("node worker %s (pid %s) did not stop; terminating", w.node.id, w.pid)
                w.proc.terminate()
                w.proc.send_signal(signal.SIGCONT)  # a stopped worker handles SIGTERM only once it runs
                try:
                    w.proc.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    w.proc.kill()
                    w.proc.wait()
            w.close_pidfd()
            self._remove_orphan_segment(w)
        self.sock.close(0)
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)
