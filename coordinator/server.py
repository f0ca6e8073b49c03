"""``strata serve``: the Scheduler behind a ZeroMQ ROUTER socket.

One thread does everything: it drains incoming requests without blocking while
sequences are active (and waits up to POLL_MS when idle), then runs one
scheduler step. Replies go out with ROUTER_MANDATORY, so a vanished client is
noticed and its sequences freed; sends never block (SNDTIMEO). Messages are
size-capped by MAXMSGSIZE and by a frame count and total size check here.
"""

from __future__ import annotations

import ipaddress
import logging
import signal
import stat
from pathlib import Path
from urllib.parse import urlsplit

import zmq

from .api import (ApiError, CancelRequest, GenerateRequest, HealthRequest, Limits, StatsRequest, decode_request,
                  encode_event, error_event)
from .errors import StrataError
from .scheduler import Scheduler

log = logging.getLogger(__name__)

POLL_MS = 100
MAX_FRAMES = 3  # [identity, (empty delimiter,) payload]
MAX_REQUEST_BYTES = 4 << 20
SEND_TIMEOUT_MS = 1000


class BindRefused(StrataError):
    """The bind address is not loopback and the user did not allow remote access."""


def check_bind(address: str, curve: bool, insecure_remote: bool) -> None:
    """Loopback only, unless CURVE keys are given or the user says --insecure-remote."""
    parts = urlsplit(address)
    if parts.scheme == "ipc":
        return
    if parts.scheme != "tcp":
        raise BindRefused(f"bind address {address!r}: use tcp://HOST:PORT or ipc://PATH")
    host = parts.hostname or ""
    loopback = host == "localhost"
    if not loopback:
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
    if not loopback and not (curve or insecure_remote):
        raise BindRefused(
            f"refusing to bind {address}: it is not a loopback address. Give --curve-keys DIR to "
            "authenticate clients with CURVE, or --insecure-remote to serve anyone who can reach it"
        )


def prepare_ipc(address: str) -> None:
    """An ipc:// endpoint lives in a private 0700 directory (made if missing, refused if open to others)."""
    path = Path(address[len("ipc://"):])
    parent = path.parent
    if not parent.exists():
        parent.mkdir(parents=True, mode=0o700)
    mode = stat.S_IMODE(parent.stat().st_mode)
    if mode & 0o077:
        raise BindRefused(f"ipc directory {parent} has mode {mode:o}; it must be private (chmod 700 {parent})")


class Server:
    def __init__(self, engine, address: str, limits: Limits = Limits(), max_active: int = 8, max_queued: int = 32,
                 curve_keys: str | None = None, insecure_remote: bool = False):
        check_bind(address, curve_keys is not None, insecure_remote)
        if address.startswith("ipc://"):
            prepare_ipc(address)
        self.engine = engine
        self.limits = limits
        self.ctx = zmq.Context()
        self.auth = None
        self.sock = self.ctx.socket(zmq.ROUTER)
        if curve_keys:
            self._setup_curve(Path(curve_keys))
        for opt, value in ((zmq.ROUTER_MANDATORY, 1), (zmq.LINGER, 0), (zmq.MAXMSGSIZE, MAX_REQUEST_BYTES),
                           (zmq.SNDTIMEO, SEND_TIMEOUT_MS), (zmq.SNDHWM, 10000)):
            self.sock.setsockopt(opt, value)
        self.sock.bind(address)
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.scheduler = Scheduler(engine, self._emit, max_active, max_queued, limits)
        self.req_clients: set[bytes] = set()  # REQ sockets: replies need the empty delimiter back
        self.stopping = False
        self.engine_failed = False
        self.dead_clients: set[bytes] = set()

    def _setup_curve(self, keys: Path) -> None:
        from zmq.auth import load_certificate
        from zmq.auth.thread import ThreadAuthenticator

        secret = keys / "server.key_secret"
        clients = keys / "clients"
        if not secret.is_file() or not clients.is_dir():
            raise BindRefused(f"--curve-keys {keys}: needs server.key_secret and a clients/ folder of public keys "
                              "(make them with zmq.auth.create_certificates)")
        self.auth = ThreadAuthenticator(self.ctx)
        self.auth.start()
        self.auth.configure_curve(domain="*", location=str(clients))
        public, private = load_certificate(str(secret))
        self.sock.curve_secretkey = private
        self.sock.curve_publickey = public
        self.sock.curve_server = True

    # -- replies -------------------------------------------------------------
    def _emit(self, client: bytes, event: dict) -> None:
        if client in self.dead_clients:
            return
        try:
            envelope = [client, b""] if client in self.req_clients else [client]
            self.sock.send_multipart(envelope + [encode_event(event)])
        except zmq.ZMQError as exc:  # EHOSTUNREACH (gone) or EAGAIN (not reading): drop the client
            log.info("client %s unreachable (%s); freeing its sequences", client.hex(), exc)
            self.dead_clients.add(client)

    # -- requests ------------------------------------------------------------
    def handle(self, frames: list[bytes]) -> None:
        client = frames[0]
        self.dead_clients.discard(client)
        if len(frames) > MAX_FRAMES or sum(len(f) for f in frames) > MAX_REQUEST_BYTES:
            self._emit(client, error_event("bad_request", f"a request is one frame of at most {MAX_REQUEST_BYTES} "
                                                          "bytes"))
            return
        payload = frames[-1]
        if len(frames) == 3 and frames[1] != b"":
            self._emit(client, error_event("bad_request", "a request is one frame"))
            return
        if len(frames) == 3:
            self.req_clients.add(client)
        try:
            req = decode_request(payload, self.limits)
            if self.stopping:
                raise ApiError("shutdown", "the server is shutting down", getattr(req, "id", None))
            if isinstance(req, GenerateRequest):
                self.scheduler.add(client, req)
            elif isinstance(req, CancelRequest):
                if not self.scheduler.cancel(client, req.id):
                    raise ApiError("not_found", f"no request {req.id!r} in flight", req.id)
            elif isinstance(req, StatsRequest):
                self._emit(client, {"type": "stats", **self.stats()})
            elif isinstance(req, HealthRequest):
                self._emit(client, {"type": "health", **self.health()})
        except ApiError as exc:
            self._emit(client, error_event(exc.code, exc.message, exc.request_id))

    def stats(self) -> dict:
        s = dict(self.scheduler.stats)
        s["queued"], s["active"] = len(self.scheduler.queue), len(self.scheduler.active)
        s["tokens_per_s"] = s["tokens"] / s["step_s"] if s["step_s"] else None
        dstats = self.engine.decoder.stats
        s["routed_pairs"], s["skipped_pairs"] = dstats.routed_pairs, dstats.skipped_pairs
        s["experts"] = self.engine.expert_report()
        s["pool"] = self.health()["pool"]
        return s

    def health(self) -> dict:
        pool = self.engine.pool
        nodes = pool.health() if hasattr(pool, "health") else [
            {"node": n.id, "virtual": n.virtual, "alive": True} for n in self.engine.nodes]
        ok = all(n.get("alive", True) for n in nodes) and not self.engine_failed
        return {"ok": ok, "stopping": self.stopping, "pool": {"kind": self.engine.config.pool, "nodes": nodes,
                                                             "plan": pool.plan.digest}}

    # -- loop ----------------------------------------------------------------
    def request_stop(self, *_args) -> None:
        self.stopping = True

    def run(self) -> int:
        log.info("serving on %s", self.address)
        while not self.stopping:
            timeout = 0 if self.scheduler.busy else POLL_MS
            if self.sock.poll(timeout):
                for _ in range(256):  # drain what is waiting, then compute
                    try:
                        self.handle(self.sock.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        break
            for client in list(self.dead_clients):
                self.scheduler.drop_client(client)
            if self.scheduler.busy and not self.stopping:
                try:
                    self.scheduler.step()
                except Exception as exc:
                    self.engine_failed = not self._engine_alive()
                    log.error("step failed: %s", exc)
        self.scheduler.fail_all("shutdown", "the server is shutting down")
        return 1 if self.engine_failed else 0

    def _engine_alive(self) -> bool:
        pool = self.engine.pool
        return all(n.get("alive", True) for n in pool.health()) if hasattr(pool, "health") else True

    def close(self) -> None:
        self.sock.close(linger=500)  # let the last events (shutdown errors) out
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()


def serve(engine, address: str, **kwargs) -> int:
    server = Server(engine, address, **kwargs)
    signal.signal(signal.SIGTERM, server.request_stop)
    signal.signal(signal.SIGINT, server.request_stop)
    print(f"serving on {server.address}", flush=True)
    try:
        return server.run()
    finally:
        server.close()
