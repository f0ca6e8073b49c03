"""``strata serve`` under hostile input and faults: nothing a request, a worker or a client does ends the server.

Each test reproduces one defect of issue 11 against a real server process (or a Server in this process where a
defect has to be injected), and checks the server is still serving afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest
import zmq
from served import EXIT_TIMEOUT_S, PROMPTS, check_final, greedy, raw_dealer, recv_event, send_json, wait_for

from coordinator.serving.api import GENERATE_FIELDS
from coordinator.serving.client import Client, RequestFailed
from coordinator.serving.server import Server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("dev_shm_alone")]  # `strata serve` processes and their workers, killed

TERMINAL = {"error", "final", "stats", "health"}


def ask(sock, doc_or_raw) -> dict:
    """Send one request; the first event that ends it (tokens of a stream are read past)."""
    sock.send(doc_or_raw if isinstance(doc_or_raw, bytes) else json.dumps(doc_or_raw).encode())
    for _ in range(10_000):
        ev = recv_event(sock)
        if ev["type"] in TERMINAL:
            return ev
    raise AssertionError("no terminal event")


def health_of(address: str, timeout: float = 10.0) -> dict:
    with Client(address, timeout=timeout) as c:
        return c.health()


def stats_of(address: str) -> dict:
    with Client(address, timeout=10) as c:
        return c.stats()


# -- 1. one frame cannot kill the server ----------------------------------------

WRONG_VALUES = [None, [], {}, "x", "", -1, 0, 1.5, True, 10**30, -(10**30), "\ud800", [[[[]]]], {"a": {"b": 1}},
                float("inf"), "9" * 50]
BASE = {"generate": {"type": "generate", "id": "g", "prompt": "abc", "max_new_tokens": 1, "stream": True},
        "cancel": {"type": "cancel", "id": "c"}, "stats": {"type": "stats"}, "health": {"type": "health"}}


def hostile_frames() -> list[bytes]:
    """Every field of every message type with every wrong value, then raw frames that broke the parser."""
    frames = []
    fields = sorted(GENERATE_FIELDS)
    for kind, base in BASE.items():
        for i, (field, value) in enumerate((f, v) for f in fields for v in WRONG_VALUES):
            doc = dict(base, id=f"{kind}-{i}") if "id" in base else dict(base)
            doc[field] = value
            frames.append(json.dumps(doc, allow_nan=True).encode())
    frames += [
        b'{"type": "generate", "id": "x", "prompt": "\\ud800"}',  # a lone surrogate
        b'{"type": "generate", "id": "\\udfff", "prompt": "a"}',
        b'{"type": "generate", "id": "s", "prompt": "a", "stop": ["\\ud83d"]}',
        b"[" * 1000 + b"]" * 1000,  # nested 1000 deep
        b'{"a":' * 5000 + b"1" + b"}" * 5000,
        b'{"type": "generate", "id": "n", "prompt_ids": [' + b"9" * 5000 + b"]}",  # past int's digit limit
        b'{"type": "generate", "id": "nan", "prompt": "a", "temperature": NaN}',
        b"\xff\xfe", b"", b"null", b'"generate"', b"{}", b'{"type": null}',
    ]
    return frames


def test_hostile_frames_get_errors_and_the_server_keeps_serving(server, serve_engine):
    frames = hostile_frames()
    assert len(frames) > 700
    replies = []
    with raw_dealer(server.address) as sock:
        for raw in frames:
            replies.append(ask(sock, raw))
    assert server.proc.poll() is None, server.stderr()
    kinds = {ev["type"] for ev in replies}
    assert kinds <= TERMINAL
    errors = [ev for ev in replies if ev["type"] == "error"]
    assert len(errors) > len(frames) / 2 and all(ev["code"] in ("bad_request", "not_found", "too_long")
                                                   for ev in errors), {ev["code"] for ev in errors}
    surrogate = replies[frames.index(b'{"type": "generate", "id": "x", "prompt": "\\ud800"}')]
    assert surrogate["code"] == "bad_request" and "surrogate" in surrogate["message"] and surrogate["id"] == "x"
    assert "nested too deeply" in replies[frames.index(b"[" * 1000 + b"]" * 1000)]["message"]
    st = stats_of(server.address)
    assert st["internal_errors"] == 0  # every one was refused by validation, none reached a defect
    with Client(server.address, timeout=10) as c:
        gen = c.generate(PROMPTS[0], max_new_tokens=6)
        list(gen)
    check_final(serve_engine, gen.final, PROMPTS[0], 6)
    assert health_of(server.address)["ok"]


def test_a_defect_while_handling_is_that_requests_error(serve_engine, monkeypatch):
    """Whatever raises while one request is handled becomes its 'internal' error; the next request is served."""
    srv = Server(serve_engine, "tcp://127.0.0.1:*")
    sent = []
    monkeypatch.setattr(srv, "_emit", lambda client, ev: sent.append((client, ev)))
    try:
        def broken_add(*_a, **_kw):
            raise RuntimeError("a defect")

        monkeypatch.setattr(srv.scheduler, "add", broken_add)
        srv.handle([b"c1", json.dumps({"type": "generate", "id": "r1", "prompt_ids": [1, 2]}).encode()])
        srv.handle([b"c2", b'{"type": "health"}'])
    finally:
        srv.close()
    (c1, ev1), (c2, ev2) = sent
    assert c1 == b"c1" and ev1["type"] == "error" and ev1["code"] == "internal" and ev1["id"] == "r1"
    assert "RuntimeError: a defect" in ev1["message"]
    assert c2 == b"c2" and ev2["type"] == "health"
    assert srv.counts["internal_errors"] == 1


# -- 2 and 3. worker deaths and hangs ---------------------------------------------


def worker_pids(address: str) -> list[int]:
    return [n["pid"] for n in health_of(address)["pool"]["nodes"]]


def kill_and_wait(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    try:
        psutil.Process(pid).wait(timeout=10)
    except psutil.NoSuchProcess:
        pass


@pytest.mark.slow
def test_kill_kill_again_wait_past_the_window_and_serve(serve, serve_engine):
    s = serve("--numa-split", "--nodes", "2", "--worker-restart-window", "4", pool="process")
    with Client(s.address, timeout=30) as c:
        def generate_ok():
            gen = c.generate(PROMPTS[1], max_new_tokens=5)
            list(gen)
            check_final(serve_engine, gen.final, PROMPTS[1], 5)

        generate_ok()
        first = worker_pids(s.address)[0]
        kill_and_wait(first)
        wait_for(lambda: (n := c.health()["pool"]["nodes"][0])["alive"] and n["pid"] != first,
                 "restart after the first death")
        generate_ok()
        kill_and_wait(worker_pids(s.address)[0])  # the second death within the window
        down = wait_for(lambda: (h := c.health())["problems"] and h, "health naming the refused restart")
        assert not down["ok"] and "restart refused" in down["problems"][0] and "node 0" in down["problems"][0]
        assert "SIGKILL" in down["pool"]["nodes"][0]["last_error"]
        with pytest.raises(RequestFailed) as info:  # refused while the window lasts, never "submit() twice"
            list(c.generate(PROMPTS[1], max_new_tokens=5))
        assert info.value.code == "unavailable" and "restart" in info.value.message  # HTTP: 503, Retry-After
        assert "twice without collect" not in info.value.message
        wait_for(lambda: c.health()["ok"], "the worker back once its window passed", timeout_s=30)
        generate_ok()
    assert s.proc.poll() is None


@pytest.mark.slow
def test_stopped_worker_health_answered_then_hang_killed_and_step_retried(serve, serve_engine):
    s = serve("--numa-split", "--nodes", "2", "--worker-hang-timeout", "3", pool="process")
    pid = worker_pids(s.address)[1]
    n = 24
    with raw_dealer(s.address) as sock:
        send_json(sock, {"type": "generate", "id": "long", "prompt": PROMPTS[6], "max_new_tokens": n})
        assert recv_event(sock)["type"] == "token"
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            h = health_of(s.address, timeout=2.0)  # answered within 2 s while the step waits on the stopped worker
            assert time.monotonic() - t0 < 2.0 and h["type"] == "health"
            silent = wait_for(lambda: (h := health_of(s.address, timeout=2.0))["problems"] and h,
                              "health saying the worker is silent", timeout_s=10)
            assert "silent for" in silent["problems"][0] and "node 1" in silent["problems"][0]
            events = []
            while not events or events[-1]["type"] not in ("final", "error"):
                events.append(recv_event(sock, timeout_ms=30_000))
        finally:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGCONT)
    final = events[-1]
    assert final["type"] == "final", final
    check_final(serve_engine, final, PROMPTS[6], n)
    node = health_of(s.address)["pool"]["nodes"][1]
    assert node["pid"] != pid and node["alive"] and "hung" in node["last_error"]


@pytest.mark.slow
def test_sigterm_ends_the_server_within_5s_with_a_stopped_worker(serve):
    s = serve("--numa-split", "--nodes", "2", pool="process")  # the derived hang deadline: 10 s or more
    pids = worker_pids(s.address)
    segments = [n["segment"] for n in health_of(s.address)["pool"]["nodes"]]
    with raw_dealer(s.address) as sock:
        send_json(sock, {"type": "generate", "id": "long", "prompt": PROMPTS[6], "max_new_tokens": 2000})
        assert recv_event(sock)["type"] == "token"
        os.kill(pids[0], signal.SIGSTOP)
        wait_for(lambda: health_of(s.address, timeout=2.0)["problems"], "the step waiting on the stopped worker")
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        try:
            code = s.proc.wait(timeout=EXIT_TIMEOUT_S)
        finally:
            for pid in pids:
                if psutil.pid_exists(pid):
                    os.kill(pid, signal.SIGCONT)
        took = time.monotonic() - t0
        last = [recv_event(sock)]
        while last[-1]["type"] == "token":
            last.append(recv_event(sock))
    assert took < 5.0, f"SIGTERM took {took:.1f}s"
    assert code == 0, s.stderr()
    assert last[-1]["type"] == "error" and last[-1]["code"] == "shutdown"
    assert not any(psutil.pid_exists(p) for p in pids)
    assert not any(os.path.exists("/dev/shm" + name) for name in segments)


# -- 4. clients that left ---------------------------------------------------------


def test_disconnected_clients_are_cancelled_within_a_second(serve):
    s = serve("--max-active", "4")
    socks = []
    ctx = zmq.Context()
    try:
        for i in range(4):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(s.address)
            send_json(sock, {"type": "generate", "id": f"gone{i}", "prompt": "abc", "max_new_tokens": 3000,
                             "stream": False})
            socks.append(sock)
        wait_for(lambda: stats_of(s.address)["active"] == 4, "the four requests running")
        for sock in socks:
            sock.close(0)
        t0 = time.monotonic()
        st = wait_for(lambda: (st := stats_of(s.address))["active"] + st["queued"] == 0 and st,
                      "the requests of the clients that left cancelled", timeout_s=5)
        took = time.monotonic() - t0
    finally:
        ctx.term()
    assert took < 1.0, f"cancelled after {took:.2f}s"
    assert st["gone_clients"] == 4 and st["tokens"] < 4 * 3000


def test_deadline_ends_a_request_with_what_it_made(server, serve_engine):
    with Client(server.address, timeout=30) as c:
        gen = c.generate(PROMPTS[0], max_new_tokens=3000, deadline_s=0.5, stream=False)
        list(gen)
    final = gen.final
    assert final["finish_reason"] == "deadline"
    assert 0 < len(final["ids"]) < 3000
    assert final["ids"] == greedy(serve_engine, PROMPTS[0], len(final["ids"]))


# -- 6. head-of-line blocking ------------------------------------------------------


def test_megabyte_prompt_is_refused_by_its_byte_length_untokenised(server):
    with raw_dealer(server.address) as sock:
        ev = ask(sock, {"type": "generate", "id": "big", "prompt": "x" * 1_000_000})
    assert ev["code"] == "too_long" and "1000000 bytes, so at least" in ev["message"]


def test_long_tokenisation_does_not_hold_up_other_clients(serve, serve_engine):
    text = "lorem ipsum dolor " * 55_000  # 990 kB, a token per byte with this tokenizer: about a second to tokenise
    nbytes = len(text.encode())
    limit = nbytes // 2  # passes the byte check, fails once tokenised
    assert nbytes // serve_engine.codec.max_token_bytes() <= limit
    s = serve("--max-prompt-tokens", str(limit))
    with raw_dealer(s.address) as slow, raw_dealer(s.address) as fast:
        assert ask(fast, {"type": "health"})["ok"]  # connected
        send_json(slow, {"type": "generate", "id": "long", "prompt": text})
        seen_tokenizing = False
        for _ in range(10_000):  # stats answered while the prompt is being tokenised
            st = ask(fast, {"type": "stats"})
            if st["tokenizing"] == 1:
                seen_tokenizing = True
                break
            assert slow.poll(0) == 0, "the prompt's reply came before any stats saw it being tokenised"
        ev = recv_event(slow)
    assert seen_tokenizing and st["queued"] == 1
    assert ev["code"] == "too_long" and f"{nbytes} tokens" in ev["message"]
