"""Python client of ``strata serve``.

    from coordinator.client import Client
    with Client("tcp://127.0.0.1:5557") as c:
        gen = c.generate("Hello", max_new_tokens=32)
        for piece in gen:              # text chunks as they are made
            print(piece, end="")
        final = gen.final              # the final event: finish_reason, usage, ids, text

A server that does not answer within ``timeout`` seconds raises ServerTimeout;
an error event raises RequestFailed with its code.
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Iterator

import zmq

from .errors import StrataError

DEFAULT_ADDRESS = "tcp://127.0.0.1:5557"


class ServerTimeout(StrataError):
    """No reply within the timeout: the server is down, stuck, or unreachable."""


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
    def __init__(self, address: str = DEFAULT_ADDRESS, timeout: float = 30.0, curve_keys: str | None = None):
        self.address = address
        self.timeout_ms = int(timeout * 1000)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
        if curve_keys:
            from zmq.auth import load_certificate

            pub, sec = load_certificate(os.path.join(curve_keys, "client.key_secret"))
            server_pub, _ = load_certificate(os.path.join(curve_keys, "server.key"))
            self.sock.curve_publickey, self.sock.curve_secretkey, self.sock.curve_serverkey = pub, sec, server_pub
        self.sock.connect(address)
        self._ids = itertools.count(1)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()

    def send(self, doc: dict) -> None:
        try:
            self.sock.send(json.dumps(doc).encode())
        except zmq.Again:
            raise ServerTimeout(f"cannot send to {self.address} within {self.timeout_ms / 1000:.0f}s") from None

    def recv(self) -> dict:
        if not self.sock.poll(self.timeout_ms):
            raise ServerTimeout(f"no reply from {self.address} within {self.timeout_ms / 1000:.0f}s; "
                                "is `strata serve` running there?")
        return json.loads(self.sock.recv())

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
