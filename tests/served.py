"""Helpers for tests of `strata serve` as a real subprocess (the fixtures are in conftest.py)."""


from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq
import zmq.auth

from coordinator.cli.make_model import EOS_ID
from coordinator.config import ENV_VARS

REPO = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 60.0  # start-up: imports, model load, node workers
EXIT_TIMEOUT_S = 30.0
REPLY_TIMEOUT_MS = 10_000
PROMPTS = ["Hello", "The quick brown fox", "abc", "zz top", "1234567", "a", "Once upon a time, there was", "MoE!"]


def server_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in {var for var, _ in ENV_VARS.values()}}


class Served:
    """A running ``strata serve``: its process, the endpoint it printed, and its stderr file."""

    def __init__(self, proc: subprocess.Popen, address: str, stderr: Path, http_url: str | None = None):
        self.proc, self.address, self.stderr_path, self.http_url = proc, address, stderr, http_url

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")


def _reader(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def launch(model: Path, logdir: Path, *args: str, pool: str = "inproc") -> subprocess.Popen:
    err = open(logdir / f"serve-{time.monotonic_ns()}.err", "w")
    cmd = [sys.executable, "-m", "coordinator", "serve", "--model", str(model), *args]
    if pool is not None:
        cmd += ["--pool", pool]
    proc = subprocess.Popen(cmd, cwd=REPO, env=server_env(), stdout=subprocess.PIPE, stderr=err, text=True)
    proc.stderr_file = Path(err.name)  # type: ignore[attr-defined]
    err.close()
    return proc


def start_server(model: Path, logdir: Path, *args: str, bind: str = "tcp://127.0.0.1:*",
                 pool: str = "inproc") -> Served:
    """Start ``strata serve`` and wait for its 'serving on <endpoint>' line on stdout."""
    proc = launch(model, logdir, "--bind", bind, *args, pool=pool)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True).start()
    try:
        line = lines.get(timeout=READY_TIMEOUT_S)
    except queue.Empty:
        line = None
    if not line or not line.startswith("serving on "):
        stop_server(Served(proc, "", proc.stderr_file))
        pytest.fail(f"server did not come up (stdout {line!r}): {proc.stderr_file.read_text()}")
    address, _, http_url = line.split("serving on ", 1)[1].strip().partition(" and ")  # "ZMQ[ and HTTP URL]"
    return Served(proc, address, proc.stderr_file, http_url or None)


def stop_server(s: Served) -> int:
    if s.proc.poll() is None:
        s.proc.send_signal(signal.SIGTERM)
        try:
            s.proc.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            s.proc.kill()
            s.proc.wait(timeout=EXIT_TIMEOUT_S)
            pytest.fail(f"server pid {s.proc.pid} ignored SIGTERM: {s.stderr()}")
    if s.proc.stdout is not None:
        s.proc.stdout.close()
    return s.proc.returncode


# -- fixtures ----------------------------------------------------------------




@contextmanager
def raw_dealer(address: str, **sockopts):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for opt, value in sockopts.items():
        sock.setsockopt(getattr(zmq, opt), value)
    sock.connect(address)
    try:
        yield sock
    finally:
        sock.close(0)
        ctx.term()


def recv_event(sock, timeout_ms: int = REPLY_TIMEOUT_MS) -> dict:
    assert sock.poll(timeout_ms), f"no reply within {timeout_ms} ms"
    return json.loads(sock.recv())


def send_json(sock, doc: dict) -> None:
    sock.send(json.dumps(doc).encode())


def greedy(engine, prompt: str, n: int) -> list[int]:
    return engine.generate(engine.encode(prompt), n, temperature=0.0, stop_at_eos=True)


def check_final(engine, final: dict, prompt: str, n: int) -> None:
    want = greedy(engine, prompt, n)
    assert final["ids"] == want
    assert final["text"] == engine.decode(want)
    assert final["finish_reason"] == ("eos" if want[-1] == EOS_ID else "length")
    assert final["usage"] == {"prompt_tokens": len(engine.encode(prompt)), "completion_tokens": len(want)}


def wait_for(predicate, what: str, timeout_s: float = 15.0, poll_s: float = 0.002):
    """Call predicate() (each call a server round trip) until it returns a truthy value, at most ``timeout_s``
    (a bound in time, not in calls: a fast machine's 20 000 round trips once took less than the 4 s a restart
    window lasts); ``poll_s`` between calls, so the polling does not take the server's CPU."""
    deadline = time.monotonic() + timeout_s
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() > deadline:
            break
        time.sleep(poll_s)  # the polling interval; what is waited for is the predicate
    raise AssertionError(f"{what}: not reached within {timeout_s}s")
