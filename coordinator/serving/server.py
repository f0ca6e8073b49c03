"""``strata serve``: the Scheduler behind a ZeroMQ ROUTER socket.

One thread serves: it drains incoming requests without blocking while
sequences are active (and waits up to POLL_MS when idle), then runs one
scheduler step. A failure while handling one request is that request's own: it
gets an error event and every other client carries on. While a step waits on
the expert pool, the pool calls back (``wait_hook``) every few tens of
milliseconds: health and stats are answered then, other requests wait for the
step's end, and a SIGTERM abandons the step. Prompts are tokenised on a helper
thread, after a byte-length check that refuses a prompt too long to fit.

A client is gone when its connection closes (the socket monitor's
DISCONNECTED event, matched to the client by the connection's descriptor) or
when a reply cannot be delivered (ROUTER_MANDATORY); its sequences are
cancelled. Sends never block (SNDTIMEO). Messages are size-capped by
MAXMSGSIZE and by a frame count and total size check here.
"""

from __future__ import annotations

import concurrent.futures
import ipaddress
import logging
import signal
import socket
import stat
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..errors import StepInterrupted, StrataError
from ..text.grammar import GrammarError
from ..request import DEFAULT_MAX_ACTIVE, DEFAULT_MAX_QUEUED, ApiError, GenerateRequest, Limits
from ..scheduler import Scheduler
from .api import (BRIDGE_FRAME_BYTES, BRIDGE_ID, MAX_REQUEST_BYTES, CancelRequest, HealthRequest, StatsRequest, decode_request, encode_event,
                  error_event)

log = logging.getLogger(__name__)

POLL_MS = 100
MAX_FRAMES = 3  # [identity, (empty delimiter,) payload]
SEND_TIMEOUT_MS = 1000
TOKENIZE_POLL_MS = 5  # how often an otherwise idle loop looks for finished tokenisations
MAX_DEFERRED = 4096  # requests held for the end of a step; past this they wait in the socket


class BindRefused(StrataError):
    """The bind address is not loopback and the user did not allow remote access."""


def check_bind(address: str, curve: bool, insecure_remote: bool,
               remedy: str = "Give --curve-keys DIR to authenticate clients with CURVE, or --insecure-remote to "
                             "serve anyone who can reach it") -> None:
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
        raise BindRefused(f"refusing to bind {address}: it is not a loopback address. {remedy}")
    try:
        port = parts.port
    except ValueError:  # tcp://HOST:* (any free port) or a malformed one: zmq's bind will say
        port = None
    if port is not None:  # the port taken now, not after the model has loaded (closed at once, unlike zmq's)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as zmq binds: TIME_WAIT is no conflict
            try:
                probe.bind(("" if host == "*" else host, port))
            except OSError as exc:
                raise BindRefused(f"cannot bind {address}: {exc.strerror} (is another server running there?)") \
                    from None


def prepare_ipc(address: str) -> None:
    """An ipc:// endpoint lives in a private 0700 directory (made if missing, refused if open to others)."""
    path = Path(address[len("ipc://"):])
    parent = path.parent
    if not parent.exists():
        parent.mkdir(parents=True, mode=0o700)
    mode = stat.S_IMODE(parent.stat().st_mode)
    if mode & 0o077:
        raise BindRefused(f"ipc directory {parent} has mode {mode:o}; it must be private (chmod 700 {parent})")


class ClientTracker:
    """Which connection each client's requests came on, from the socket monitor.

    The monitor reports ACCEPTED and DISCONNECTED with the connection's file
    descriptor; a request carries the descriptor it came on (SRCFD). A
    descriptor is reused after a close, so each one is paired with a count of
    its ACCEPTED events: the monitor is read up to date before a client is
    recorded, so a DISCONNECTED event ends only the clients of that connection.
    """

    def __init__(self, sock: zmq.Socket):
        self.sock = sock
        self.monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.accepted: dict[int, int] = {}  # fd -> connections accepted on it so far
        self.connection: dict[bytes, tuple[int, int]] = {}  # client -> (fd, its accepted count)
        self.gone: set[bytes] = set()

    def drain(self) -> None:
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            fd = event["value"]
            if event["event"] == zmq.EVENT_ACCEPTED:
                self.accepted[fd] = self.accepted.get(fd, 0) + 1
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                closed = (fd, self.accepted.get(fd, 0))
                for client in [c for c, conn in self.connection.items() if conn == closed]:
                    del self.connection[client]
                    self.gone.add(client)

    def seen(self, client: bytes, frame: zmq.Frame) -> None:
        self.drain()
        try:
            fd = frame.get(zmq.SRCFD)
        except zmq.ZMQError:
            return
        self.connection[client] = (fd, self.accepted.get(fd, 0))
        self.gone.discard(client)

    def take_gone(self) -> set[bytes]:
        self.drain()
        gone, self.gone = self.gone, set()
        return gone

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(0)


@dataclass
class Tokenizing:
    """A text prompt being tokenised on the helper thread."""

    client: bytes
    req: GenerateRequest
    arrived: float  # monotonic
    future: concurrent.futures.Future


class Server:
    def __init__(self, engine, address: str, limits: Limits = Limits(), max_active: int = DEFAULT_MAX_ACTIVE,
                 max_queued: int = DEFAULT_MAX_QUEUED, curve_keys: str | None = None, insecure_remote: bool = False):
        check_bind(address, curve_keys is not None, insecure_remote)
        if address.startswith("ipc://"):
            prepare_ipc(address)
        self.engine = engine
        self.limits = limits
        self.max_queued = max_queued
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
        self.clients = ClientTracker(self.sock)
        self.scheduler = Scheduler(engine, self._emit, max_active, max_queued, limits)
        self.req_clients: set[bytes] = set()  # REQ sockets: replies need the empty delimiter back
        self.stopping = False
        self.engine_failed = False
        self.last_error: str | None = None
        self.dead_clients: set[bytes] = set()
        self.tokenizer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="strata-tokenize")
        self.tokenizing: list[Tokenizing] = []
        self.deferred: deque[list] = deque()  # requests that came while a step waited on the pool
        self.counts = {"internal_errors": 0, "gone_clients": 0, "deadline_expired": 0, "refused": 0}
        self.max_token_bytes = engine.codec.max_token_bytes() if engine.codec is not None else None
        engine.set_wait_hook(self._while_waiting)

    def bind_inproc(self) -> str:
        """One more endpoint, in this process only (the HTTP frontend's); its address."""
        endpoint = f"inproc://strata-serve-{id(self):x}"
        self.sock.bind(endpoint)
        return endpoint

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
    def _receive(self, during_step: bool = False) -> None:
        """Take what is waiting on the socket: handled now, or (during a step) health and stats only."""
        for _ in range(256):
            if during_step and len(self.deferred) >= MAX_DEFERRED:
                return
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            client = frames[0].bytes
            self.clients.seen(client, frames[-1])
            self.dead_clients.discard(client)
            raw = [f.bytes for f in frames]
            if during_step and not self._is_probe(raw):
                self.deferred.append(raw)
            else:
                self.handle(raw)

    def _is_probe(self, frames: list[bytes]) -> bool:
        """A small health or stats request, answered even in the middle of a step."""
        if len(frames[-1]) > 256:
            return False
        try:
            return type(decode_request(frames[-1], self.limits)) in self._ANSWERED_DURING_STEP
        except Exception:
            return False

    def handle(self, frames: list[bytes]) -> None:
        """One request; whatever goes wrong with it becomes its error event, never the server's end."""
        client = frames[0]
        rid = None
        try:
            limit = BRIDGE_FRAME_BYTES if client == BRIDGE_ID else MAX_REQUEST_BYTES
            if len(frames) > MAX_FRAMES or sum(len(f) for f in frames) > limit:
                raise ApiError("bad_request", f"a request is one frame of at most {limit} bytes")
            if len(frames) == 3 and frames[1] != b"":
                raise ApiError("bad_request", "a request is one frame")
            if len(frames) == 3:
                self.req_clients.add(client)
            req = decode_request(frames[-1], self.limits)
            rid = getattr(req, "id", None)
            self._dispatch(client, req)
        except ApiError as exc:
            self.counts["refused"] += 1
            log.info("request %s refused: %s (%s)", exc.request_id, exc.code, exc.message)
            self._emit(client, error_event(exc.code, exc.message, exc.request_id))
        except Exception as exc:  # a defect: contained to this request, logged with its traceback
            self.counts["internal_errors"] += 1
            log.exception("request %r from client %s failed", rid, client.hex())
            self._emit(client, error_event("internal", f"the server could not handle this request: "
                                                       f"{type(exc).__name__}: {exc}", rid))

    def _dispatch(self, client: bytes, req) -> None:
        if self.stopping:
            raise ApiError("shutdown", "the server is shutting down", getattr(req, "id", None))
        handler = self._HANDLERS.get(type(req))
        if handler is None:  # decode_request made a request type this table lacks: a defect of ours
            raise TypeError(f"no handler for a {type(req).__name__}")
        handler(self, client, req)

    def _cancel(self, client: bytes, req: CancelRequest) -> None:
        if not (self._cancel_tokenizing(client, req.id) or self.scheduler.cancel(client, req.id)):
            raise ApiError("not_found", f"no request {req.id!r} in flight", req.id)

    def _answer_stats(self, client: bytes, _req: StatsRequest) -> None:
        self._emit(client, {"type": "stats", **self.stats()})

    def _answer_health(self, client: bytes, _req: HealthRequest) -> None:
        self._emit(client, {"type": "health", **self.health()})

    def _admit(self, client: bytes, req: GenerateRequest) -> None:
        """Token ids go to the scheduler now; text is checked by its byte length, then tokenised off the loop, and
        a grammar compiled there too (the first one builds llguidance's tables of the whole vocabulary)."""
        if req.prompt is None and req.grammar is None:
            self.scheduler.add(client, req)
            return
        if any(t.client == client and t.req.id == req.id for t in self.tokenizing):
            raise ApiError("bad_request", f"request id {req.id!r} is already in flight", req.id)
        if len(self.tokenizing) + len(self.scheduler.queue) >= self.max_queued:
            self.scheduler.stats["busy_rejections"] += 1
            raise ApiError("busy", f"the queue is full ({self.max_queued} requests waiting); retry later", req.id)
        if self.engine.codec is None:
            raise ApiError("bad_request", "this model has no tokenizer: send 'prompt_ids' instead of 'prompt'"
                           if req.prompt is not None else "constrained decoding ('grammar') needs the model's "
                           "tokenizer", req.id)
        if req.prompt is not None:
            nbytes = len(req.prompt.encode("utf-8"))
            least = -(-nbytes // self.max_token_bytes)
            if least > self.limits.max_prompt_tokens:
                raise ApiError("too_long", f"the prompt is {nbytes} bytes, so at least {least} tokens (no token of "
                                           f"this tokenizer is longer than {self.max_token_bytes} bytes); the limit "
                                           f"is {self.limits.max_prompt_tokens} tokens", req.id)
        future = self.tokenizer.submit(self._prepare, req)
        self.tokenizing.append(Tokenizing(client, req, time.monotonic(), future))

    # request type -> its handler (client, request), and the types answered in the middle of a step
    _HANDLERS = {GenerateRequest: _admit, CancelRequest: _cancel, StatsRequest: _answer_stats,
                 HealthRequest: _answer_health}
    _ANSWERED_DURING_STEP = frozenset({StatsRequest, HealthRequest})

    def _cancel_tokenizing(self, client: bytes, rid: str, reason: str = "cancelled") -> bool:
        for t in self.tokenizing:
            if t.client == client and t.req.id == rid:
                self.tokenizing.remove(t)
                t.future.cancel()
                final = {"type": "final", "id": rid, "finish_reason": reason, "text": "", "ids": [],
                         "usage": {"prompt_tokens": 0, "completion_tokens": 0}}
                if t.req.logprobs is not None:  # the same shape as the scheduler's finals
                    final["logprobs"] = []
                self._emit(client, final)
                return True
        return False

    def _prepare(self, req: GenerateRequest) -> list[int]:
        """Off the loop: the request's grammar compiled (into the engine's cache), its prompt's ids."""
        if req.grammar is not None:
            self.engine.grammars.compile(req.grammar)
        return list(req.prompt_ids) if req.prompt is None else self.engine.encode(req.prompt)

    def _tokenized(self) -> None:
        """Hand finished tokenisations to the scheduler, in arrival order."""
        while self.tokenizing and self.tokenizing[0].future.done():
            t = self.tokenizing.pop(0)
            try:
                try:
                    ids = t.future.result()
                except GrammarError as exc:
                    raise ApiError("bad_request", str(exc), t.req.id) from None
                except Exception as exc:
                    raise ApiError("bad_request", f"the prompt cannot be tokenised: {exc}", t.req.id) from None
                self.scheduler.add(t.client, t.req, ids=ids, arrived=t.arrived)
            except ApiError as exc:
                self._emit(t.client, error_event(exc.code, exc.message, exc.request_id))
            except Exception as exc:
                self.counts["internal_errors"] += 1
                log.exception("request %r could not be queued", t.req.id)
                self._emit(t.client, error_event("internal", f"{type(exc).__name__}: {exc}", t.req.id))

    def _between_steps(self) -> None:
        """Everything that must not change the scheduler in the middle of a step."""
        while self.deferred:
            self.handle(self.deferred.popleft())
        self._tokenized()
        gone = self.clients.take_gone() | self.dead_clients
        for client in gone:
            dropped = self.scheduler.drop_client(client)
            dropped += sum(1 for t in self.tokenizing if t.client == client)
            self.tokenizing = [t for t in self.tokenizing if t.client != client]
            if dropped:
                self.counts["gone_clients"] += 1
                log.info("client %s went away; cancelled its %d request(s)", client.hex(), dropped)
            self.req_clients.discard(client)
        self.dead_clients.clear()
        now = time.monotonic()
        self.counts["deadline_expired"] += self.scheduler.expire(now)
        for t in [t for t in self.tokenizing if t.req.deadline_s is not None and now > t.arrived + t.req.deadline_s]:
            self._cancel_tokenizing(t.client, t.req.id, reason="deadline")
            self.counts["deadline_expired"] += 1

    def _while_waiting(self) -> None:
        """The pool's wait hook: answer health and stats, see a stop."""
        if self.sock.poll(0):
            self._receive(during_step=True)
        if self.stopping:
            raise StepInterrupted("the server is shutting down")

    def stats(self) -> dict:
        s = dict(self.scheduler.stats)
        sched = self.scheduler
        s["queued"] = len(sched.queue) + len(self.tokenizing)  # waiting: being tokenised or for a slot
        s["active"] = len(sched.prefilling) + len(sched.active)
        s["tokenizing"], s["prefilling"] = len(self.tokenizing), len(sched.prefilling)
        s["tokens_per_s"] = s["tokens"] / s["step_s"] if s["step_s"] else None
        s["latency"] = {k: h.as_dict() for k, h in sched.latency.items()}  # histograms (coordinator/latency.py)
        s.update(self.counts)
        s.update(self.engine.stats())  # routed_pairs, skipped_pairs, experts
        s["pool"] = self.health()["pool"]
        return s

    def health(self) -> dict:
        pool = self.engine.health()
        problems = [f"node {n['node']}{' (virtual)' if n['virtual'] else ''}: {n['state']}"
                    for n in pool["nodes"] if n["state"] != "ok"]
        ok = all(n["alive"] for n in pool["nodes"]) and not self.stopping
        return {"ok": ok, "stopping": self.stopping, "problems": problems, "last_error": self.last_error,
                "pool": pool}

    # -- loop ----------------------------------------------------------------
    def request_stop(self, *_args) -> None:
        self.stopping = True

    def run(self) -> int:
        log.info("serving on %s", self.address)
        while not self.stopping:
            timeout = 0 if self.scheduler.busy else TOKENIZE_POLL_MS if self.tokenizing else POLL_MS
            if self.sock.poll(timeout):
                self._receive()
            self._between_steps()
            if not self.scheduler.busy:
                self._maintain()
            if self.scheduler.busy and not self.stopping:
                self._step()
        self.scheduler.fail_all("shutdown", "the server is shutting down")
        for t in self.tokenizing:
            self._emit(t.client, error_event("shutdown", "the server is shutting down", t.req.id))
        self.tokenizing = []
        return 1 if self.engine_failed else 0

    def _step(self) -> None:
        try:
            self.scheduler.step()
            self.engine_failed = False
        except StepInterrupted:
            log.info("step abandoned: the server is stopping")
        except Exception as exc:  # the scheduler has told each sequence of the step; the pool is clean again
            self.last_error = f"{type(exc).__name__}: {exc}"
            self.engine_failed = not self._engine_alive()
            log.error("step failed: %s", exc)

    def _maintain(self) -> None:
        try:
            self.engine.maintain()
        except StepInterrupted:
            pass
        except Exception as exc:
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.error("pool maintenance failed: %s", exc)

    def _engine_alive(self) -> bool:
        return all(n["alive"] for n in self.engine.health()["nodes"])

    def close(self) -> None:
        self.engine.set_wait_hook(None)
        self.tokenizer.shutdown(wait=False, cancel_futures=True)
        self.clients.close()
        self.sock.close(linger=500)  # let the last events (shutdown errors) out
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()


def serve(engine, address: str, http: dict | None = None, **kwargs) -> int:
    """Serve until SIGTERM or SIGINT; ``http`` (HttpFrontend's arguments: host, port, model_name, api_key) adds
    the OpenAI HTTP API. In-flight requests end with a shutdown error, on both APIs."""
    server = Server(engine, address, **kwargs)
    frontend = None
    try:
        if http is not None:
            from .http import HttpFrontend

            frontend = HttpFrontend(server, **http)
            frontend.start()
        signal.signal(signal.SIGTERM, server.request_stop)
        signal.signal(signal.SIGINT, server.request_stop)
        print(f"serving on {server.address}" + (f" and {frontend.url}" if frontend else ""), flush=True)
        return server.run()
    finally:
        # From here on a repeated signal must not cut the teardown short (the caller still closes the engine:
        # node workers, segments), nor kill the interpreter as it exits, which gives Python handlers back to
        # SIG_DFL but leaves SIG_IGN in place. Every step of the teardown has its own timeout.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if frontend is not None:
            frontend.stop()
        server.close()
