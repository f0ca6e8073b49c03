#!/usr/bin/env python
"""What the OpenAI HTTP layer costs: the same streaming load over HTTP and over the ZeroMQ API, side by side.

    .venv/bin/python tools/http_bench.py --model M [--clients 4] [--tokens 64] [--rounds 3] [--json out.json]
                                         [-- extra strata serve flags, e.g. --pool process]

It starts one ``strata serve --http`` on loopback, then runs ``--rounds`` rounds
of each API alternately (ZeroMQ, HTTP, ZeroMQ, HTTP...): in a round
``--clients`` clients each stream one greedy completion of ``--tokens`` tokens
at once (prompts differ per client, the same ones on both APIs). Per round it
records the aggregate tokens/s (completion tokens of all clients over the
round's wall time) and each client's time to first token; it reports the
median of each per API and the ratio HTTP / ZeroMQ. The HTTP clients are lean
(``http.client`` reading the server-sent events line by line), so the figure is
the server's HTTP layer, not a client library's. Without ``--model`` it makes
the tests' tiny model, where a token costs little and the layer's share is the
largest it gets.
"""

from __future__ import annotations

from shm import threads_env

threads_env.apply()  # the thread settings strata's commands run with, before NumPy loads

import argparse
import http.client
import json
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from coordinator.serving.client import Client  # noqa: E402

PROMPTS = ["Hello", "The quick brown fox", "Once upon a time", "abc def", "MoE on two sockets", "zz top",
           "1234567", "In the beginning"]
START_TIMEOUT_S = 300


def start(model: Path, extra: list[str]) -> tuple[subprocess.Popen, str, str]:
    cmd = [sys.executable, "-m", "coordinator", "serve", "--model", str(model), "--bind", "tcp://127.0.0.1:*",
           "--http", "127.0.0.1:0", *extra]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    line = lines.get(timeout=START_TIMEOUT_S)
    if not line.startswith("serving on "):
        proc.kill()
        raise SystemExit(f"strata serve did not start: {line!r}")
    zmq_address, _, http_url = line.split("serving on ", 1)[1].strip().partition(" and ")
    return proc, zmq_address, http_url


def zmq_client(address: str, prompt: str, tokens: int) -> tuple[float, int]:
    """(seconds to the first token, completion tokens) of one streamed greedy request."""
    t0 = time.perf_counter()
    first = None
    with Client(address, timeout=600) as c:
        gen = c.generate(prompt, max_new_tokens=tokens, temperature=0.0, stream=True)
        for _ in gen:
            first = first or time.perf_counter() - t0
    return first or time.perf_counter() - t0, gen.final["usage"]["completion_tokens"]


def http_client(url: str, prompt: str, tokens: int) -> tuple[float, int]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
    body = json.dumps({"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
    first, used = None, 0
    for line in resp:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        doc = json.loads(line[6:])
        if doc.get("choices") and doc["choices"][0].get("text"):
            first = first or time.perf_counter() - t0
        if doc.get("usage"):
            used = doc["usage"]["completion_tokens"]
    conn.close()
    return first or time.perf_counter() - t0, used


def one_round(run, target: str, clients: int, tokens: int) -> dict:
    results: list = [None] * clients
    barrier = threading.Barrier(clients + 1)

    def worker(i: int) -> None:
        barrier.wait()
        results[i] = run(target, PROMPTS[i % len(PROMPTS)], tokens)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"tokens_per_s": sum(r[1] for r in results) / wall, "ttft_s": statistics.median(r[0] for r in results),
            "tokens": sum(r[1] for r in results)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="a checkpoint folder or GGUF (default: a tiny one)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64, help="completion tokens per client")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per API, alternating")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: more strata serve flags")
    args = ap.parse_args()
    extra = [a for a in args.serve_args if a != "--"]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from coordinator.cli.make_model import make_model

            model = make_model(Path(tmp) / "m", seed=0)
        proc, zmq_address, http_url = start(model, extra)
        try:
            one_round(zmq_client, zmq_address, args.clients, 4)  # warm-up: kernels, caches, connections
            one_round(http_client, http_url, args.clients, 4)
            rounds: dict[str, list[dict]] = {"zmq": [], "http": []}
            for _ in range(args.rounds):
                rounds["zmq"].append(one_round(zmq_client, zmq_address, args.clients, args.tokens))
                rounds["http"].append(one_round(http_client, http_url, args.clients, args.tokens))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    summary = {api: {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                     "ttft_ms": 1000 * statistics.median(r["ttft_s"] for r in rs),
                     "tokens": rs[0]["tokens"]} for api, rs in rounds.items()}
    ratio = summary["http"]["tokens_per_s"] / summary["zmq"]["tokens_per_s"]
    print(f"model {model}, {args.clients} concurrent streams x {args.tokens} tokens, {args.rounds} rounds per API "
          f"(alternating), serve flags {' '.join(extra) or '(defaults)'}")
    print(f"{'API':<6} {'tok/s (aggregate)':>18} {'TTFT ms (median)':>17} {'tokens/round':>13}")
    for api in ("zmq", "http"):
        s = summary[api]
        print(f"{api:<6} {s['tokens_per_s']:>18.1f} {s['ttft_ms']:>17.1f} {s['tokens']:>13d}")
    print(f"HTTP / ZeroMQ aggregate tokens/s: {ratio:.3f} (the layer costs {100 * (1 - ratio):.1f} %)")
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "ratio": ratio, "rounds": rounds,
                                         "clients": args.clients, "tokens": args.tokens, "model": str(model),
                                         "serve_args": extra}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
