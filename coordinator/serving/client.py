"""Python client of ``strata serve``.

    from coordinator.serving.client import Client
    with Client("tcp://127.0.0.1:5557") as c:
        gen = c.generate("Hello", max_new_tokens=32)
        for piece in gen:              # text chunks as they are made
            print(piece, end="")
        final = gen.final              # the final event: finish_reason, usage, ids, text

A server that does not answer within ``timeout`` seconds raises ServerTimeout;
an error event raises RequestFailed with its code. A request whose encoded
frame is over the server's size limit raises RequestTooLarge before anything is
sent; a server that closes the connection while a reply is awaited (libzmq does
so for a frame over its ZMQ_MAXMSGSIZE) raises ServerDisconnected.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import time
from typing import Iterator

import zmq
from zmq.utils.monitor import recv_monitor_message

from ..errors import StrataError
from .api import DEFAULT_ADDRESS, MAX_REQUEST_BYTES


class ServerTimeout(StrataError):
    """No reply within the timeout: the server is down, stuck, or unreachable."""


def _size(n: int) -> str:
    return f"{n} bytes ({n / (1 << 20):.1f} MiB)"


class RequestTooLarge(StrataError):
    """The encoded request is over the server's size limit; nothing was sent."""

    def __init__(self, size: int, limit: int):
        self.size, self.limit = size, limit
        super().__init__(f"request of {_size(size)} is over the server's size limit of {_size(limit)}; "
                         "nothing was sent")


class ServerDisconnected(StrataError):
    """The server closed the connection while a reply was awaited."""


# A connection counts as up once its ZMTP handshake succeeded: a failed handshake (CURVE keys the
# server refuses, no server yet) is reconnect noise, not a dropped request.
_UP = getattr(zmq, "EVENT_HANDSHAKE_SUCCEEDED", zmq.EVENT_CONNECTED)
_DOWN = zmq.EVENT_DISCONNECTED


class RequestFailed(StrataError):
    def __init__(self, code: str, message: str):
        self.code, self.message = code, message
        super().__init__(f"{code}: {message}")


class Generation:
    """Iterates text chunks; ``final`` holds the final event once iteration ends."""

    def __init__(self, events: Iterator[dict]):
        self._events = events
        self.final: dict | None = None
        self.events: list[dict] = []

    def __iter__(self):
        for ev in self._events:
            self.events.append(ev)
            if ev["type"] == "token":
                yield ev["text"]
            elif ev["type"] == "final":
                self.final = ev
                return

    def text(self) -> str:
        pieces = "".join(self)
        return self.final["text"] if self.final and not pieces else pieces


class Client:
    def __init__(self, address: str = DEFAULT_ADDRESS, timeout: float = 30.0, curve_keys: str | None = None,
                 max_request_bytes: int = MAX_REQUEST_BYTES):
        self.address = address
        self.timeout_ms = int(timeout * 1000)
        self.max_request_bytes = max_request_bytes
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
        if curve_keys:
            from zmq.auth import load_certificate

            pub, sec = load_certificate(os.path.join(curve_keys, "client.key_secret"))
            server_pub, _ = load_certificate(os.path.join(curve_keys, "server.key"))
            self.sock.curve_publickey, self.sock.curve_secretkey, self.sock.curve_serverkey = pub, sec, server_pub
        # Connection events, watched while a reply is awaited: a connection that drops then means the
        # request or its reply is lost (libzmq drops an oversized frame by closing the connection).
        self.monitor = self.sock.get_monitor_socket(_UP | _DOWN)
        self._up = False  # a connection has completed its handshake and not dropped since
        self._last_size = 0
        self._closed = False
        self.sock.connect(address)
        self._ids = itertools.count(1)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(zmq.ZMQError):
            self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)
        self.ctx.term()

    def _connection_events(self) -> bool:
        """Read the queued monitor events; True when an up connection dropped among them."""
        dropped = False
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == _UP:
                self._up = True
            elif event == _DOWN:
                dropped |= self._up
                self._up = False
        return dropped

    def send(self, doc: dict) -> None:
        data = json.dumps(doc).encode()
        if len(data) > self.max_request_bytes:
            raise RequestTooLarge(len(data), self.max_request_bytes)
        self._connection_events()  # drops before this request are not about it
        try:
            self.sock.send(data)
        except zmq.Again:
            raise ServerTimeout(f"cannot send to {self.address} within {self.timeout_ms / 1000:.0f}s") from None
        self._last_size = len(data)

    def recv(self) -> dict:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        deadline = time.monotonic() + self.timeout_ms / 1000
        while True:
            if self.sock.poll(0):  # a reply that came before a drop is still delivered
                return json.loads(self.sock.recv())
            if self._connection_events():
                if self.sock.poll(0):
                    return json.loads(self.sock.recv())
                raise ServerDisconnected(
                    f"{self.address} closed the connection while a reply was awaited (the last request was "
                    f"{_size(self._last_size)}): likely a request over the server's size limit of "
                    f"{_size(MAX_REQUEST_BYTES)}, or the server stopping")
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not poller.poll(left_ms):
                raise ServerTimeout(f"no reply from {self.address} within {self.timeout_ms / 1000:.0f}s; "
                                    "is `strata serve` running there?")

    def _events(self, rid: str) -> Iterator[dict]:
        while True:
            ev = self.recv()
            if ev.get("id") not in (rid, None):
                continue  # an event of an earlier, abandoned request
            if ev["type"] == "error":
                raise RequestFailed(ev["code"], ev["message"])
            yield ev
            if ev["type"] == "final":
                return

    def generate(self, prompt: str | list[int], **params) -> Generation:
        rid = params.pop("id", None) or f"r{os.getpid()}-{next(self._ids)}"
        doc = {"type": "generate", "id": rid, **params}
        doc["prompt_ids" if isinstance(prompt, list) else "prompt"] = prompt
        self.send(doc)
        gen = Generation(self._events(rid))
        gen.id = rid
        return gen

    def cancel(self, rid: str) -> None:
        self.send({"type": "cancel", "id": rid})

    def call(self, kind: str) -> dict:
        self.send({"type": kind})
        while True:
            ev = self.recv()
            if ev["type"] == kind:
                return ev
            if ev["type"] == "error" and ev.get("id") is None:
                raise RequestFailed(ev["code"], ev["message"])

    def stats(self) -> dict:
        return self.call("stats")

    def health(self) -> dict:
        return self.call("health")
