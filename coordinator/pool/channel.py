"""Channel: the coordinator's end of the node workers' sockets.

One ROUTER socket bound on an ipc:// endpoint inside a private 0700 folder
(``strata-pool-*`` in the temporary directory, which also holds the job file
and ``owner.json``, the pid and start time of the coordinator that made it:
a folder whose owner is gone, say after a SIGKILL, is removed by the next
pool that starts and by ``strata shm clean``, the rule segments follow);
each worker connects a DEALER whose routing id names the node and the
incarnation. The channel sends and receives typed messages of
node_worker/protocol.py, polls the socket together with other descriptors
(the workers' pidfds), spinning ``spin_us`` first, and waits for the HELLOs
of the start-up handshake. It knows nothing of processes: the supervisor does.

The data path is ``send_compute`` / ``recv``: the boundary work replaces it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Callable, Iterable

import psutil
import zmq

from node_worker import protocol as P
from shm import doorbell
from shm.segments import process_start_time

from ..errors import StrataError

log = logging.getLogger(__name__)

POLL_MS = 100  # the longest a wait blocks before it looks at deaths, hangs and the wait hook
POOL_DIR_PREFIX = "strata-pool-"
OWNER_FILE = "owner.json"


class PoolError(StrataError):
    """A node worker refused a request or the pool could not start."""


class PeerUnreachable(PoolError):
    """A send found no connected peer of that identity (ROUTER_MANDATORY)."""


class HandshakeTimeout(PoolError):
    """Some workers did not say HELLO in time."""

    def __init__(self, identities: list[bytes], timeout_s: float):
        self.identities, self.timeout_s = identities, timeout_s
        super().__init__(f"{', '.join(i.decode() for i in identities)} did not say hello within {timeout_s:.0f}s")


def check_hello(info: dict, node: int, plan_digest: str, model_digest: str) -> list[str]:
    """What in a worker's HELLO does not match this pool (empty when it all does)."""
    want = {"version": P.PROTOCOL_VERSION, "plan_digest": plan_digest, "model_digest": model_digest, "node": node}
    return [f"{key} {info.get(key)!r} != {value!r}" for key, value in want.items() if info.get(key) != value]


def pool_dir_owner_alive(folder: Path) -> bool:
    """True while the coordinator that made ``folder`` runs (pid reuse ruled out by its start time). A folder
    from before owner records counts as alive while a node worker's command line names it."""
    try:
        owner = json.loads((folder / OWNER_FILE).read_text())
        start = process_start_time(int(owner["pid"]))
        return start is not None and abs(start - float(owner["start"])) < 1.0
    except FileNotFoundError:
        return any(str(folder) in " ".join(p.info["cmdline"] or ())
                   for p in psutil.process_iter(["cmdline"]))
    except (OSError, ValueError, KeyError, TypeError):
        return False  # unreadable: nobody can be using it as ours


def pool_dirs(tmp: Path | None = None) -> list[tuple[Path, bool]]:
    """This user's pool folders (job.json, the socket) and whether their coordinator is alive."""
    return [(folder, pool_dir_owner_alive(folder))
            for folder in sorted(Path(tmp or tempfile.gettempdir()).glob(POOL_DIR_PREFIX + "*"))
            if folder.is_dir() and not folder.is_symlink() and folder.stat().st_uid == os.getuid()]


def remove_stale_pool_dirs(tmp: Path | None = None) -> list[Path]:
    """Remove the pool folders whose coordinator is gone; the ones removed."""
    removed = []
    for folder, alive in pool_dirs(tmp):
        if not alive:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
            log.info("removed %s, left by a coordinator that is gone", folder)
    return removed


class Channel:
    def __init__(self, max_message_bytes: int, spin_us: float = 0.0):
        self.spin_s = spin_us / 1e6
        remove_stale_pool_dirs()
        self.dir = Path(tempfile.mkdtemp(prefix=POOL_DIR_PREFIX))
        try:  # stopped half-way (Ctrl-C), the folder goes
            os.chmod(self.dir, 0o700)
            self.write_file(OWNER_FILE, json.dumps({"pid": os.getpid(), "start": process_start_time(os.getpid())}))
            self.endpoint = f"ipc://{self.dir}/pool.sock"
            self.ctx = zmq.Context()
            self.sock = self.ctx.socket(zmq.ROUTER)
            for opt, value in ((zmq.ROUTER_MANDATORY, 1), (zmq.ROUTER_HANDOVER, 1), (zmq.LINGER, 0),
                               (zmq.MAXMSGSIZE, max_message_bytes)):
                self.sock.setsockopt(opt, value)
            self.sock.bind(self.endpoint)
        except BaseException:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        self.backlog: deque[tuple[bytes, object]] = deque()  # received while waiting for something else
        self._poller: zmq.Poller | None = None
        self._fds: tuple[int, ...] = ()

    def write_file(self, name: str, text: str) -> Path:
        path = self.dir / name
        path.write_text(text)
        return path

    # -- sending -----------------------------------------------------------------
    def send(self, identity: bytes, frames: list, flags: int = 0) -> None:
        try:
            self.sock.send_multipart([identity] + frames, flags, copy=False)
        except zmq.ZMQError as exc:  # EHOSTUNREACH under ROUTER_MANDATORY: the peer is gone
            raise PeerUnreachable(f"no connected peer {identity.decode()} ({exc})") from None

    # -- receiving ---------------------------------------------------------------
    def poll(self, timeout_ms: int, fds: Iterable[int] = (), backlog: bool = True) -> tuple[bool, set[int]]:
        """(a message is waiting, the fds that fired); polls the socket for ``spin_us`` before blocking.
        With ``backlog`` a kept-back message counts as waiting."""
        if backlog and self.backlog:
            return True, set()
        if self.spin_s and timeout_ms and doorbell.spin_until(self.spin_s, lambda: self.sock.poll(0)):
            return True, set()
        fds = tuple(fds)
        if self._poller is None or fds != self._fds:  # built once per set of worker pidfds
            self._poller, self._fds = zmq.Poller(), fds
            self._poller.register(self.sock, zmq.POLLIN)
            for fd in fds:
                self._poller.register(fd, zmq.POLLIN)
        events = dict(self._poller.poll(timeout_ms))
        return self.sock in events, {fd for fd in fds if fd in events}

    def recv(self) -> tuple[bytes, object]:
        """The next (identity, typed message): what was kept back first, then the socket."""
        if self.backlog:
            return self.backlog.popleft()
        return self._recv_socket()

    def _recv_socket(self) -> tuple[bytes, object]:
        frames = self.sock.recv_multipart(copy=False)
        identity = bytes(frames[0].buffer)
        try:
            return identity, P.decode(frames[1:])
        except P.ProtocolError as exc:
            raise PoolError(f"{identity.decode(errors='replace')} sent a malformed message: {exc}") from None

    def await_hellos(self, identities: set[bytes], timeout_s: float, fds: Callable[[], Iterable[int]],
                     on_other: Callable[[bytes, object], bool], tick: Callable[[set[int]], None]) -> dict[bytes, dict]:
        """Wait for a HELLO from each identity. Another message goes to ``on_other(identity, msg)`` and, unless
        that returns True (consumed), is kept for later. ``tick(fired fds)`` runs after every poll and may
        raise (a death, a stop)."""
        hellos: dict[bytes, dict] = {}
        kept = []
        deadline = time.monotonic() + timeout_s
        try:
            while len(hellos) < len(identities):
                if time.monotonic() > deadline:
                    raise HandshakeTimeout(sorted(identities - set(hellos)), timeout_s)
                readable, fired = self.poll(POLL_MS, fds(), backlog=False)
                if readable:
                    identity, msg = self._recv_socket()
                    if isinstance(msg, P.Hello) and identity in identities:
                        hellos[identity] = msg.info
                    elif not on_other(identity, msg):
                        kept.append((identity, msg))
                tick(fired)
        finally:
            self.backlog.extend(kept)
        return hellos

    def close(self) -> None:
        try:
            self.sock.close(0)
            self.ctx.term()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
