"""Supervisor: the node worker processes' lives, apart from what they compute.

It spawns one worker per node (under numactl for a real node where numactl
exists; a virtual node's worker pins itself), watches each through its pidfd,
keeps its last words, restarts it after a death, and ends it at close.

A worker's death is seen three ways: its last words (a fatal ERROR), its
process sentinel (a pidfd in the same poll as the socket), and a check before
each send. All three surface as WorkerDied. A worker silent on a layer past the
hang deadline is killed (``kill_hung``), which counts as a death. A dead worker
is restarted (it reattaches to its complete segment) unless this is its second
death within the restart window: then it stays down until the window has
passed, when the next send or ``maintain()`` starts it again. Deaths are
counted, not starts.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import zmq

from node_worker import protocol as P
from node_worker.kernel_threads import worker_env
from shm import formats, jit, segments
from shm.topology import Node

from ..errors import StepInterrupted, StrataError
from .base import NodeHealth
from .channel import Channel, HandshakeTimeout, PeerUnreachable, PoolError, check_hello

log = logging.getLogger(__name__)

REAP_TIMEOUT_S = 2.0  # for a killed or exiting worker to be reaped
SHUTDOWN_WAIT_S = 2.0  # for a worker to exit on SHUTDOWN; then SIGTERM (with SIGCONT), then SIGKILL
TERMINATE_WAIT_S = 1.0  # for SIGTERM to end it before SIGKILL
HOOK_INTERVAL_S = 0.05  # how often a waiting pool calls its wait hook
WORKER_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # its pinned threads only


class WorkerDied(StrataError):
    """A node worker exited; names the node, pid and exit status."""

    def __init__(self, node: int, pid: int, status: str, detail: str = "", retry_after_s: float = 0.0):
        self.node, self.pid, self.status = node, pid, status
        self.retry_after_s = retry_after_s  # when the pool is worth asking again: the refused restart's wait
        super().__init__(f"node worker {node} (pid {pid}) died: {status}" + (f"; {detail}" if detail else ""))


def exit_status(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def numactl_prefix(node: Node) -> list[str]:
    """numactl binding for a real node where numactl exists; virtual nodes are pinned by affinity."""
    if not node.virtual and shutil.which("numactl"):
        return ["numactl", f"--cpunodebind={node.id}", f"--membind={node.id}"]
    return []


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

    def reaped_within(self, timeout_s: float) -> bool:
        try:
            self.proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    def died(self) -> WorkerDied:
        code = None
        if self.proc is not None:
            if not self.reaped_within(REAP_TIMEOUT_S):
                self.proc.kill()
            code = self.proc.wait()
        return WorkerDied(self.node.id, self.pid, exit_status(code), self.last_words)

    def close_pidfd(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


class Supervisor:
    def __init__(self, nodes: list[Node], channel: Channel, job_path: Path, plan_digest: str, model_digest: str,
                 start_timeout_s: float, restart_window_s: float, keep_shm: bool, expert_format: str = "f32"):
        self.channel = channel
        self.expert_formats = formats.ExpertFormats.parse(expert_format)  # the workers' wait settings follow it
        self.job_path = job_path
        self.plan_digest, self.model_digest = plan_digest, model_digest
        self.start_timeout_s = start_timeout_s
        self.restart_window_s = restart_window_s
        self.keep_shm = keep_shm
        self.workers = [WorkerHandle(n, f"node{n.id}".encode()) for n in nodes]
        self.restarts = 0
        self.wait_hook: Callable[[], None] | None = None  # called every HOOK_INTERVAL_S while waiting
        self.on_spawn: Callable[[WorkerHandle], None] | None = None  # before a worker (re)starts
        self.on_sent: Callable[[WorkerHandle], None] | None = None  # after a socket message to a worker
        self._hook_at = 0.0

    # -- start ---------------------------------------------------------------------
    def start_all(self) -> None:
        for w in self.workers:
            self._spawn(w)
        self._handshake(self.workers)

    def _spawn(self, w: WorkerHandle) -> None:
        n = w.node
        if self.on_spawn is not None:
            self.on_spawn(w)
        w.close_pidfd()
        # a fresh identity per incarnation: a dead predecessor's pipe can never take its messages
        w.identity = f"node{n.id}.{len(w.started)}".encode()
        cmd = numactl_prefix(n) + [sys.executable, "-m", "node_worker", "--job", str(self.job_path),
                                   "--node", str(n.id), "--identity", w.identity.decode(),
                                   "--parent-pid", str(os.getpid())]
        # a session of its own: the terminal's Ctrl-C reaches the coordinator alone, which stops the workers in
        # order (a worker stopped by it while filling its segment left the segment behind)
        env = dict(os.environ, **WORKER_ENV, **worker_env(self.expert_formats), **jit.child_env())  # this cache's
        w.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            w.pidfd = os.pidfd_open(w.proc.pid)
        except (OSError, AttributeError):
            w.pidfd = None  # falls back to polling the process at every wake-up
        w.hello, w.last_words, w.death_seen, w.retry_at = {}, "", False, None
        w.started.append(time.monotonic())
        log.info("started node worker %s pid %s: %s", n.id, w.proc.pid, " ".join(cmd))

    def _handshake(self, starting: list[WorkerHandle]) -> None:
        by_id = {w.identity: w for w in starting}

        def tick(fired: set[int]) -> None:
            for w in self.dead_among(fired):
                if w.identity in by_id:
                    raise w.died()
            self.call_hook()

        try:
            hellos = self.channel.await_hellos(set(by_id), self.start_timeout_s, self.pidfds, self.take_last_words,
                                               tick)
        except HandshakeTimeout as exc:
            names = ", ".join(f"node {by_id[i].node.id} (pid {by_id[i].pid})" for i in exc.identities)
            raise PoolError(f"{names} did not finish starting within {self.start_timeout_s:.0f}s; a large model "
                            "may need a longer STRATA_WORKER_START_TIMEOUT, or check the worker's stderr above") from None
        for identity, info in hellos.items():
            w = by_id[identity]
            problems = check_hello(info, w.node.id, self.plan_digest, self.model_digest)
            if problems:
                raise PoolError(f"node worker {w.node.id} (pid {w.pid}) handshake mismatch: {'; '.join(problems)}")
            w.hello = info
            if info.get("compiled"):
                log.warning("node worker %s compiled %d functions itself (%s): the kernel cache lacked them",
                            w.node.id, len(info["compiled"]), ", ".join(info["compiled"][:3]))
            log.info("node %s ready: pid %s, rows %s, %s threads, %s, placement %s", w.node.id, info.get("pid"),
                     info.get("slice_rows"), info.get("threads"),
                     "reloaded" if info.get("reloaded") else "reattached", info.get("placement"))

    # -- watching --------------------------------------------------------------------
    def pidfds(self) -> list[int]:
        return [w.pidfd for w in self.workers if w.pidfd is not None]

    def dead_among(self, fired: set[int]) -> list[WorkerHandle]:
        """The workers whose process ended: their pidfd fired (or, without pidfds, a look at each)."""
        ended = [w for w in self.workers if (w.pidfd in fired if w.pidfd is not None else w.dead())]
        return [w for w in ended if w.dead() or w.reaped_within(REAP_TIMEOUT_S)]

    def by_identity(self, identity: bytes) -> WorkerHandle | None:
        return next((w for w in self.workers if w.identity == identity), None)

    def take_last_words(self, identity: bytes, msg) -> bool:
        """A fatal ERROR is a worker's last words: kept for the WorkerDied its sentinel raises next."""
        w = self.by_identity(identity)
        if w is not None and isinstance(msg, P.Error) and msg.fatal:
            w.last_words = msg.message
            return True
        return False

    def call_hook(self) -> None:
        if self.wait_hook is not None and time.monotonic() - self._hook_at >= HOOK_INTERVAL_S:
            self._hook_at = time.monotonic()
            self.wait_hook()

    def reset_hook_timer(self) -> None:
        self._hook_at = time.monotonic()

    # -- sending -------------------------------------------------------------------------
    def send(self, w: WorkerHandle, frames: list) -> None:
        """Send to a live worker; WorkerDied when it is dead (the check before each send, and a kill that
        races the send: its pipe closes before it is reaped)."""
        if w.dead():
            raise w.died()
        try:
            self.channel.send(w.identity, frames)
        except PeerUnreachable as exc:
            if w.dead() or w.reaped_within(REAP_TIMEOUT_S):
                raise w.died() from None
            raise PoolError(f"cannot send to node worker {w.node.id} (pid {w.pid}): {exc}") from None
        if self.on_sent is not None:
            self.on_sent(w)

    # -- deaths and restarts ----------------------------------------------------------------
    def recover(self, w: WorkerHandle, died: WorkerDied) -> None:
        """Count a death and restart the worker, unless it is its second within the window (then raise)."""
        now = time.monotonic()
        if not w.death_seen:
            w.death_seen = True
            w.deaths.append(now)
        w.last_error = str(died)
        window = self.restart_window_s
        if len([t for t in w.deaths if now - t < window]) >= 2:
            w.retry_at = now + window
            w.down_reason = f"it died twice within {window:.0f}s"
            log.error("%s; it died twice within %.0fs: not restarting for %.0fs", died, window, window)
            raise WorkerDied(died.node, died.pid, died.status,
                             f"it died twice within {window:.0f}s; it is restarted once {window:.0f}s have passed",
                             window)
        log.warning("%s; restarting it", died)
        self._restart(w)

    def _restart(self, w: WorkerHandle) -> None:
        self.restarts += 1
        self._spawn(w)
        try:
            self._handshake([w])
        except StepInterrupted:
            raise
        except StrataError as exc:  # it did not come back: try again after the window
            w.retry_at = time.monotonic() + self.restart_window_s
            w.last_error = f"restart failed: {exc}"
            w.down_reason = f"its restart failed ({exc})"
            if not w.dead():
                w.proc.kill()
                w.proc.wait()
            w.death_seen = True
            raise

    def ensure_running(self, w: WorkerHandle) -> None:
        """The check before each send: a dead worker is restarted now, or refused while its window lasts."""
        if not w.dead():
            return
        if w.retry_at is not None:
            wait = w.retry_at - time.monotonic()
            if wait > 0:
                raise WorkerDied(w.node.id, w.pid, exit_status(w.proc.returncode if w.proc else None),
                                 f"{w.down_reason}; the next restart is tried in {wait:.0f}s", wait)
            log.info("node worker %s: its restart window has passed; starting it again", w.node.id)
            w.retry_at = None
            self._restart(w)
            return
        self.recover(w, w.died())

    def maintain(self) -> None:
        """Between steps: restart workers that died while idle, or whose refused restart is due."""
        for w in self.workers:
            if w.dead() and (w.retry_at is None or time.monotonic() >= w.retry_at):
                try:
                    self.ensure_running(w)
                except StepInterrupted:
                    raise
                except StrataError as exc:
                    log.error("node worker %s: %s", w.node.id, exc)

    def kill_hung(self, w: WorkerHandle, silent_s: float) -> WorkerDied:
        log.error("node worker %s (pid %s) sent nothing for %.1fs on one layer: hung; killing it", w.node.id, w.pid,
                  silent_s)
        w.proc.kill()
        w.proc.wait()
        return WorkerDied(w.node.id, w.pid, f"hung (silent for {silent_s:.1f}s on one layer), killed")

    # -- reporting ------------------------------------------------------------------------------
    def state(self, w: WorkerHandle, silent_s: float = 0.0) -> str:
        """ok | silent for N s on the current layer | down, restarted in N s | dead (restarted at the next request)."""
        if not w.dead():
            return f"silent for {silent_s:.1f}s on the current layer" if silent_s >= 1.0 else "ok"
        if w.retry_at is not None:
            return f"down: restart refused, tried again in {max(0.0, w.retry_at - time.monotonic()):.0f}s"
        return "dead: restarted at the next request"

    def health(self, silent_s: dict[int, float]) -> list[NodeHealth]:
        """One entry per node; ``silent_s`` says how long each node has kept the current layer waiting."""
        return [{"node": w.node.id, "virtual": w.node.virtual, "pid": w.pid, "alive": not w.dead(),
                 "state": self.state(w, silent_s.get(w.node.id, 0.0)), "restarts": len(w.started) - 1,
                 "deaths": len(w.deaths), "last_error": w.last_error or None,
                 **{k: w.hello.get(k) for k in ("slice_rows", "threads", "placement", "reloaded", "segment",
                                                "segment_bytes")}}
                for w in self.workers]

    # -- the end -----------------------------------------------------------------------------------
    def close(self) -> None:
        """SHUTDOWN to each live worker; whoever has not exited within SHUTDOWN_WAIT_S gets SIGTERM (and SIGCONT,
        for a stopped one), then SIGKILL. A dead worker's segment is removed here."""
        for w in self.workers:
            if not w.dead():
                try:
                    self.channel.send(w.identity, P.encode_shutdown(), zmq.NOBLOCK)
                    if self.on_sent is not None:
                        self.on_sent(w)
                except PeerUnreachable:
                    w.proc.terminate()
        deadline = time.monotonic() + SHUTDOWN_WAIT_S
        for w in self.workers:
            if w.proc is None:
                continue
            if not w.reaped_within(max(0.1, deadline - time.monotonic())):
                log.warning("node worker %s (pid %s) did not stop; terminating", w.node.id, w.pid)
                w.proc.terminate()
                w.proc.send_signal(signal.SIGCONT)  # a stopped worker handles SIGTERM only once it runs
                if not w.reaped_within(TERMINATE_WAIT_S):
                    w.proc.kill()
                    w.proc.wait()
            w.close_pidfd()
            self.remove_orphan_segment(w)

    def remove_orphan_segment(self, w: WorkerHandle) -> None:
        """A worker that died cannot unlink its segment; its parent does: a half-written one always (a worker
        stopped while it filled it, before its HELLO), a complete one unless asked to keep it. The segment's
        name follows from the model, the plan and the node (shm/segments.py), HELLO or not."""
        if w.proc is None:
            return
        name = w.hello.get("segment") or segments.segment_name(self.model_digest, self.plan_digest, w.node.id)
        try:
            header = segments.read_header(name)
        except segments.SegmentError:
            return
        if header.owner_pid != w.pid or segments.owner_alive(header) or (self.keep_shm and header.complete):
            return
        segments.unlink(name)
        log.info("removed segment %s of dead node worker %s (pid %s)", name, w.node.id, w.pid)
