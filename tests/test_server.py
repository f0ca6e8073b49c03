"""``strata serve`` as a real subprocess: the JSON API over ZeroMQ, limits, hostile input, CURVE, shutdown."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import zmq
import zmq.auth
from served import (EXIT_TIMEOUT_S, PROMPTS, READY_TIMEOUT_S, REPO, check_final, greedy, launch, raw_dealer, recv_event,
                    send_json, server_env, start_server, stop_server, wait_for)

from coordinator.serving.client import Client, RequestFailed, ServerTimeout

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("dev_shm_alone")]  # `strata serve` processes


# -- generation ----------------------------------------------------------------


def test_one_client_generate_equals_engine_greedy(server, serve_engine):
    with Client(server.address, timeout=10) as c:
        gen = c.generate(PROMPTS[1], max_new_tokens=12)
        pieces = list(gen)
    final = gen.final
    assert final is not None and final["id"] == gen.id
    assert len(pieces) >= 1
    assert "".join(pieces) == final["text"]
    check_final(serve_engine, final, PROMPTS[1], 12)


def test_eight_concurrent_clients_equal_solo_runs(server, serve_engine):
    lengths = [6 + (i * 5) % 7 for i in range(8)]
    results: dict[int, tuple[str, dict]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(8, timeout=30)

    def one(i: int) -> None:
        try:
            with Client(server.address, timeout=20) as c:
                barrier.wait()
                gen = c.generate(PROMPTS[i], max_new_tokens=lengths[i])
                results[i] = ("".join(gen), gen.final)
        except BaseException as exc:  # reported below
            errors.append(exc)

    with Client(server.address, timeout=10) as c:
        before = c.stats()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
        after = c.stats()
    assert not errors, errors
    assert sorted(results) == list(range(8))
    tokens = 0
    for i, (text, final) in results.items():
        check_final(serve_engine, final, PROMPTS[i], lengths[i])
        assert text == final["text"]
        tokens += len(final["ids"])
    assert after["completed"] - before["completed"] == 8
    assert after["tokens"] - before["tokens"] == tokens
    assert after["steps"] - before["steps"] < tokens  # some steps decoded several requests together


def test_cancel_mid_stream(server, serve_engine):
    with Client(server.address, timeout=10) as c:
        gen = c.generate(PROMPTS[0], max_new_tokens=3000)
        it = iter(gen)
        first = next(it)
        c.cancel(gen.id)
        rest = list(it)
        final = gen.final
        assert final["finish_reason"] == "cancelled"
        assert 1 <= len(final["ids"]) < 3000
        assert final["ids"] == greedy(serve_engine, PROMPTS[0], len(final["ids"]))
        assert first + "".join(rest) == final["text"]
        # the request is gone: cancelling it again is an error naming it
        c.cancel(gen.id)
        ev = c.recv()
        assert ev["type"] == "error" and ev["code"] == "not_found" and ev["id"] == gen.id
        assert c.stats()["active"] == 0


def test_client_vanishing_mid_stream_frees_its_sequence(serve):
    s = serve()
    with raw_dealer(s.address) as sock:
        send_json(sock, {"type": "generate", "id": "gone", "prompt": PROMPTS[1], "max_new_tokens": 3500})
        ev = recv_event(sock)
        assert ev["type"] == "token" and ev["id"] == "gone"  # it is being decoded
    # the dealer is closed; the server notices on its next send and frees the sequence
    with Client(s.address, timeout=10) as c:
        gen = c.generate("abc", max_new_tokens=5)
        assert len(list(gen)) >= 1 and gen.final["finish_reason"] in ("length", "eos")
        st = wait_for(lambda: (lambda st: st if st["active"] == 0 and st["queued"] == 0 else None)(c.stats()),
                      "the vanished client's sequence freed")
        assert st["completed"] == 1 and st["cancelled"] == 0  # freed, not finished: 3500 tokens take far longer
        assert st["requests"] == 2
        assert st["tokens"] < 3500
    assert s.proc.poll() is None


# -- hostile and malformed input ----------------------------------------------------------------


def test_garbage_bytes_are_bad_request(server):
    with raw_dealer(server.address) as sock:
        sock.send(b"\xff\x00garbage")
        ev = recv_event(sock)
        assert ev["type"] == "error" and ev["code"] == "bad_request" and ev["id"] is None
        assert "JSON" in ev["message"]


class _Trap:
    """Unpickling this would create ``path``."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_pickle_payload_is_refused_unread(server, tmp_path):
    marker = tmp_path / "unpickled"
    with raw_dealer(server.address) as sock:
        for payload in (pickle.dumps({"type": "generate"}),
                        pickle.dumps({"type": "generate", "id": "p", "prompt": _Trap(str(marker))})):
            sock.send(payload)
            ev = recv_event(sock)
            assert ev["type"] == "error" and ev["code"] == "bad_request", ev
    assert not marker.exists()


@pytest.mark.parametrize("doc, field", [
    ({"type": "generate", "id": "t1", "prompt": "x", "max_new_tokens": "ten"}, "max_new_tokens"),
    ({"type": "generate", "prompt": "x"}, "id"),
    ({"type": "generate", "id": "t3"}, "prompt"),
    ({"type": "generate", "id": "t4", "prompt": "x", "temperature": "hot"}, "temperature"),
    ({"type": "generate", "id": "t5", "prompt": "x", "stream": "yes"}, "stream"),
    ({"type": "generate", "id": "t6", "prompt": "x", "bogus": 1}, "bogus"),
    ({"type": "cancel"}, "id"),
    ({"type": "launch_missiles", "id": "t8"}, "type"),
])
def test_wrong_types_and_missing_fields_name_the_field(server, doc, field):
    with raw_dealer(server.address) as sock:
        send_json(sock, doc)
        ev = recv_event(sock)
    assert ev["type"] == "error" and ev["code"] == "bad_request", ev
    assert field in ev["message"]
    assert ev["id"] == (doc.get("id") if field != "id" else None)


def test_oversized_frame_drops_the_connection_and_server_keeps_serving(server):
    with raw_dealer(server.address) as sock:
        sock.send(b"x" * ((4 << 20) + 1024))
        assert not sock.poll(1000)  # MAXMSGSIZE: the connection is dropped, nothing comes back
    assert server.proc.poll() is None
    with Client(server.address, timeout=10) as c:
        assert c.health()["ok"] is True
        gen = c.generate("abc", max_new_tokens=3)
        assert "".join(gen) == gen.final["text"]


def test_oversized_multipart_is_bad_request(server):
    with raw_dealer(server.address) as sock:
        sock.send_multipart([b'{"type": "health"}'] * 8)
        ev = recv_event(sock)
        assert ev["type"] == "error" and ev["code"] == "bad_request"
        sock.send_multipart([b"not empty", b'{"type": "health"}'])  # [identity, delimiter?, payload]
        ev = recv_event(sock)
        assert ev["type"] == "error" and ev["code"] == "bad_request"
        sock.send(b'{"type": "health"}')  # the same connection still works
        assert recv_event(sock)["type"] == "health"


@pytest.fixture(scope="module")
def small_limits(serve_model, serve_logdir):
    s = start_server(serve_model, serve_logdir, "--max-new-tokens-limit", "16", "--max-prompt-tokens", "8")
    yield s
    assert stop_server(s) == 0, s.stderr()


def test_max_new_tokens_over_the_limit_is_too_long(small_limits, serve_engine):
    with Client(small_limits.address, timeout=10) as c:
        with pytest.raises(RequestFailed) as info:
            list(c.generate("abc", max_new_tokens=17))
        assert info.value.code == "too_long" and "max_new_tokens" in info.value.message
        gen = c.generate("abc", max_new_tokens=16)
        list(gen)
        check_final(serve_engine, gen.final, "abc", 16)
        with pytest.raises(RequestFailed) as info:  # --max-prompt-tokens 8 holds for token ids
            list(c.generate(list(range(65, 74)), max_new_tokens=4))
        assert info.value.code == "too_long" and "prompt_ids" in info.value.message


def test_max_prompt_tokens_applies_to_text_prompts(small_limits):
    with Client(small_limits.address, timeout=10) as c:
        with pytest.raises(RequestFailed) as info:
            list(c.generate("x" * 20, max_new_tokens=2))  # byte-level tokenizer: 20 tokens > 8
        assert info.value.code == "too_long"


def test_req_socket_envelope_gets_a_reply(server):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.address)
    try:
        sock.send(b'{"type": "health"}')
        assert sock.poll(1000), "no reply reached the REQ socket"
        assert json.loads(sock.recv())["type"] == "health"
    finally:
        sock.close(0)
        ctx.term()


def test_queue_full_is_busy(serve):
    s = serve("--max-active", "1", "--max-queued", "1")
    ids = ["q1", "q2", "q3"]
    with raw_dealer(s.address) as sock:
        for rid in ids:
            send_json(sock, {"type": "generate", "id": rid, "prompt": "abc", "max_new_tokens": 3000, "stream": False})
        send_json(sock, {"type": "stats"})  # handled after the three: every refusal is sent before its reply
        busy = []
        for _ in range(4):  # the accepted ones say nothing before their final (stream false, 3000 tokens)
            ev = recv_event(sock)
            if ev["type"] == "stats":
                st = ev
                break
            assert ev["type"] == "error" and ev["code"] == "busy", ev
            busy.append(ev["id"])
        else:
            raise AssertionError("no stats reply")
        assert 1 <= len(busy) <= 2 and set(busy) <= set(ids) and "q1" not in busy
        assert st["busy_rejections"] == len(busy) and st["active"] + st["queued"] == 3 - len(busy)
        for rid in ids:
            if rid not in busy:
                send_json(sock, {"type": "cancel", "id": rid})
                ev = recv_event(sock)
                assert ev["type"] == "final" and ev["finish_reason"] == "cancelled" and ev["id"] == rid
    with Client(s.address, timeout=10) as c:
        st = c.stats()
    assert st["busy_rejections"] == len(busy) and st["active"] == 0 and st["queued"] == 0


def test_health_and_stats(server):
    with Client(server.address, timeout=10) as c:
        h = c.health()
        st = c.stats()
    assert h["type"] == "health" and h["ok"] is True and h["stopping"] is False
    assert h["pool"]["kind"] == "inproc" and isinstance(h["pool"]["plan"], str)
    assert [n["node"] for n in h["pool"]["nodes"]] == [0]
    assert all(n["alive"] is True for n in h["pool"]["nodes"])
    assert st["type"] == "stats"
    for key in ("requests", "completed", "cancelled", "tokens", "steps", "busy_rejections", "active", "queued"):
        assert isinstance(st[key], int) and st[key] >= 0, key
    assert st["pool"] == h["pool"]


def test_one_log_line_per_request_and_refusals_counted(serve):
    s = serve()
    with Client(s.address, timeout=10) as c:
        refused_before = c.stats()["refused"]
        gen = c.generate([5, 6, 7], max_new_tokens=3, id="logged-1")
        list(gen)
        with pytest.raises(Exception, match="max_new_tokens"):
            list(c.generate([5], max_new_tokens=-1, id="refused-1"))
        st = c.stats()
    assert gen.final["finish_reason"] == "length" and st["refused"] == refused_before + 1
    err = s.stderr()
    assert "request logged-1: 3 prompt + 3 new tokens in " in err and ", length" in err  # shown without -v
    assert "request refused-1 refused: bad_request" in err


# -- shutdown ---------------------------------------------------------------------------


def _our_segments(pids: set[int]) -> list[str]:
    from shm.segments import SegmentError, read_header

    left = []
    for p in Path("/dev/shm").glob("strata.*"):
        try:
            if read_header("/" + p.name).owner_pid in pids:
                left.append(p.name)
        except SegmentError:
            continue
    return left


def test_sigterm_mid_generation_with_process_pool(serve):
    s = serve("--numa-split", "--nodes", "2", pool="process")
    with Client(s.address, timeout=20) as c:
        h = c.health()
        assert h["ok"] is True and h["pool"]["kind"] == "process"
        nodes = h["pool"]["nodes"]
        assert [n["node"] for n in nodes] == [0, 1] and all(n["alive"] for n in nodes)
        pids = {n["pid"] for n in nodes}
        segments = [n["segment"] for n in nodes if n.get("segment")]
        assert len(pids) == 2
        for pid in pids:
            title = " ".join(psutil.Process(pid).cmdline()).strip()
            assert title.startswith("strata-node") or "node_worker" in title, title
            assert psutil.Process(pid).ppid() == s.proc.pid
        assert _our_segments(pids | {s.proc.pid}), "the workers' segments should exist while serving"
        gen = c.generate(PROMPTS[1], max_new_tokens=3500)
        it = iter(gen)
        assert next(it)
        s.proc.send_signal(signal.SIGTERM)
        with pytest.raises(RequestFailed) as info:
            for _ in it:
                pass
        assert info.value.code == "shutdown"
    assert s.proc.wait(timeout=EXIT_TIMEOUT_S) == 0, s.stderr()
    gone = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not gone, f"node workers still running: {gone}"
    assert not _our_segments(pids | {s.proc.pid})
    for name in segments:
        assert not Path("/dev/shm", name.lstrip("/")).exists(), name


def test_sigterm_again_and_again_during_shutdown_still_exits_clean(serve):
    """A supervisor that repeats SIGTERM while the server tears down (the pool, the segments, the interpreter's
    own exit) gets exit status 0 and nothing left behind: the teardown is not cut short half way."""
    s = serve("--numa-split", "--nodes", "2", pool="process")
    with Client(s.address, timeout=20) as c:
        nodes = c.health()["pool"]["nodes"]
    pids = {n["pid"] for n in nodes}
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    sent = 0
    while s.proc.poll() is None and time.monotonic() < deadline:
        s.proc.send_signal(signal.SIGTERM)
        sent += 1
        try:
            s.proc.wait(timeout=0.002)  # pacing between signals, not synchronisation: poll() above decides
        except subprocess.TimeoutExpired:
            pass
    assert s.proc.poll() == 0, f"exit status {s.proc.poll()} after {sent} SIGTERMs: {s.stderr()}"
    assert sent > 1
    gone = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not gone, f"node workers still running: {gone}"
    assert not _our_segments(pids | {s.proc.pid})


# -- binding -----------------------------------------------------------------------------


def test_non_loopback_bind_is_refused_before_loading(tmp_path):
    missing = tmp_path / "no-such-model"  # loading it would fail with a different message
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "coordinator", "serve", "--model", str(missing),
                          "--bind", "tcp://0.0.0.0:*", "--pool", "inproc"],
                         cwd=REPO, env=server_env(), capture_output=True, text=True, timeout=30)
    assert out.returncode != 0
    assert "--curve-keys" in out.stderr and "--insecure-remote" in out.stderr, out.stderr
    assert "serving on" not in out.stdout
    assert str(missing) not in out.stderr  # refused before the model was looked at
    assert time.monotonic() - t0 < 20


@pytest.fixture
def short_dir():
    """A fresh 0700 directory with a short path (ipc paths are limited to ~100 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="strata-ipc-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_ipc_bind_in_private_directory_works(serve, short_dir, serve_engine):
    sock_dir = short_dir / "priv"
    sock_dir.mkdir(mode=0o700)
    os.chmod(sock_dir, 0o700)
    s = serve(bind=f"ipc://{sock_dir}/strata.sock")
    assert s.address == f"ipc://{sock_dir}/strata.sock"
    with Client(s.address, timeout=10) as c:
        gen = c.generate("abc", max_new_tokens=4)
        assert "".join(gen) == gen.final["text"]
    check_final(serve_engine, gen.final, "abc", 4)


def test_ipc_bind_in_open_directory_is_refused(serve_model, serve_logdir, short_dir):
    sock_dir = short_dir / "open"
    sock_dir.mkdir()
    os.chmod(sock_dir, 0o755)
    proc = launch(serve_model, serve_logdir, "--bind", f"ipc://{sock_dir}/strata.sock")
    try:
        out, _ = proc.communicate(timeout=READY_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=EXIT_TIMEOUT_S)
    err = proc.stderr_file.read_text()
    assert proc.returncode != 0
    assert "serving on" not in out
    assert "755" in err and "700" in err, err
    assert not (sock_dir / "strata.sock").exists()


def test_client_without_server_times_out(short_dir):
    with socket.socket() as holder:  # bound, not listening: nobody else gets the port, connects are refused
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
        for address in (f"tcp://127.0.0.1:{port}", f"ipc://{short_dir}/nobody.sock"):
            with Client(address, timeout=1) as c:
                t0 = time.monotonic()
                with pytest.raises(ServerTimeout):
                    c.health()
                assert time.monotonic() - t0 < 3.0


# -- CURVE -------------------------------------------------------------------------------


@pytest.fixture
def curve_keys(tmp_path):
    """(server --curve-keys dir, a good client's key dir, a stranger's key dir)."""
    server_dir, good, stranger = tmp_path / "srv", tmp_path / "good", tmp_path / "stranger"
    (server_dir / "clients").mkdir(parents=True)
    made = tmp_path / "made"
    made.mkdir()
    zmq.auth.create_certificates(str(server_dir), "server")
    zmq.auth.create_certificates(str(made), "client")
    zmq.auth.create_certificates(str(made), "stranger")
    shutil.copy(made / "client.key", server_dir / "clients" / "client.key")  # only the public key is trusted
    for d, name in ((good, "client"), (stranger, "stranger")):
        d.mkdir()
        shutil.copy(made / f"{name}.key_secret", d / "client.key_secret")
        shutil.copy(server_dir / "server.key", d / "server.key")
    return server_dir, good, stranger


def test_curve_authenticates_clients(serve, curve_keys, serve_engine):
    server_dir, good, stranger = curve_keys
    s = serve("--curve-keys", str(server_dir))
    assert s.address.startswith("tcp://127.0.0.1:")
    with Client(s.address, timeout=10, curve_keys=str(good)) as c:
        assert c.health()["ok"] is True
        gen = c.generate("abc", max_new_tokens=5)
        assert "".join(gen) == gen.final["text"]
    check_final(serve_engine, gen.final, "abc", 5)
    with Client(s.address, timeout=1.5) as c:  # no keys at all
        with pytest.raises(ServerTimeout):
            c.health()
    with Client(s.address, timeout=1.5, curve_keys=str(stranger)) as c:  # keys the server does not trust
        with pytest.raises(ServerTimeout):
            c.health()
    with Client(s.address, timeout=10, curve_keys=str(good)) as c:  # still serving
        assert c.health()["ok"] is True


def test_the_client_command_sends_generates_sampling_flags(server, capsys):
    from coordinator.cli.main import main

    assert main(["client", "Hello", "--address", server.address, "-n", "5", "--top-k", "1", "--top-p", "0.5",
                 "--temperature", "0.7", "--seed", "3", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plain["finish_reason"] == "length" and len(plain["ids"]) == 5
    stop = plain["text"][1:3]  # a stop string inside the answer cuts it there
    assert main(["client", "Hello", "--address", server.address, "-n", "5", "--top-k", "1", "--temperature", "0.7",
                 "--seed", "3", "--stop", stop, "--json"]) == 0
    cut = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert cut["finish_reason"] == "stop" and cut["text"] == plain["text"][:plain["text"].index(stop)]
