"""The client's request size limit: refused before sending, and a connection the server drops is an error."""

from __future__ import annotations

import json
import time

import pytest
from served import start_server, stop_server

from coordinator.cli.make_model import make_model
from coordinator.errors import StrataError
from coordinator.serving.client import Client, RequestTooLarge, ServerDisconnected
from coordinator.serving.api import MAX_REQUEST_BYTES

pytestmark = pytest.mark.slow  # `strata serve` processes


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_model(tmp_path_factory.mktemp("limits") / "m", seed=0)
    s = start_server(model, tmp_path_factory.mktemp("limits-logs"))
    yield s
    assert stop_server(s) == 0, s.stderr()


def test_client_limit_is_the_servers():
    assert issubclass(RequestTooLarge, StrataError) and issubclass(ServerDisconnected, StrataError)
    with Client("tcp://127.0.0.1:1", timeout=1) as c:
        assert c.max_request_bytes == MAX_REQUEST_BYTES == 4 << 20


def test_oversized_prompt_is_refused_before_sending(server):
    with Client(server.address, timeout=10) as c:
        with pytest.raises(RequestTooLarge) as info:
            c.generate("x" * (5 << 20), max_new_tokens=1)
        msg = str(info.value)
        assert str(MAX_REQUEST_BYTES) in msg and "4.0 MiB" in msg, msg
        assert info.value.limit == MAX_REQUEST_BYTES and info.value.size > 5 << 20
        assert c.health()["ok"] is True  # nothing was sent: the same connection still serves
        gen = c.generate("abc", max_new_tokens=3)
        assert "".join(gen) == gen.final["text"]
    assert server.proc.poll() is None


def test_request_at_the_limit_is_sent():
    doc = {"type": "generate", "id": "r", "prompt": "x" * 64}
    size = len(json.dumps(doc).encode())
    with Client("tcp://127.0.0.1:1", timeout=1, max_request_bytes=size) as c:
        c.send(doc)  # queued for a server that is not there: at the limit is allowed
        doc["prompt"] += "x"
        with pytest.raises(RequestTooLarge, match=f"{size + 1} bytes .* over the server's size limit of {size} bytes"):
            c.send(doc)


def test_dropped_connection_raises_promptly(server):
    with Client(server.address, timeout=30, max_request_bytes=1 << 30) as c:
        assert c.health()["ok"] is True  # connected and handshaken before the big frame
        t0 = time.monotonic()
        with pytest.raises(ServerDisconnected) as info:
            c.generate("x" * (8 << 20), max_new_tokens=1).text()
        assert time.monotonic() - t0 < 10
        msg = str(info.value)
        assert "closed the connection" in msg and str(MAX_REQUEST_BYTES) in msg, msg
        assert c.health()["ok"] is True  # the client reconnects and keeps working
    assert server.proc.poll() is None


def test_dropped_connection_on_the_first_request(server):
    with Client(server.address, timeout=30, max_request_bytes=1 << 30) as c:  # sent before any handshake
        t0 = time.monotonic()
        with pytest.raises(ServerDisconnected):
            c.generate("y" * (8 << 20), max_new_tokens=1).text()
        assert time.monotonic() - t0 < 10
    with Client(server.address, timeout=10) as c:
        assert c.health()["ok"] is True


def test_server_restart_between_requests_is_not_an_error(tmp_path):
    """A connection that drops while no reply is awaited is no error for the next request."""
    model = make_model(tmp_path / "m", seed=0)
    first = start_server(model, tmp_path)
    try:
        c = Client(first.address, timeout=30)
        assert c.health()["ok"] is True
    finally:
        assert stop_server(first) == 0, first.stderr()
    try:
        second = start_server(model, tmp_path, bind=first.address)
        try:
            assert c.health()["ok"] is True
            for _ in range(3):
                assert c.stats()["type"] == "stats"
        finally:
            assert stop_server(second) == 0, second.stderr()
    finally:
        c.close()
