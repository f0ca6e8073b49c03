#!/usr/bin/env python
"""The HTTP server's memory across oversized chat requests: RSS before and after N chats of a ~4.1 MB message.

    .venv/bin/python tools/http_memory_probe.py [--requests 8] [--model DIR]

A tiny model is made when none is given; `strata serve --http` runs on it in-process pool mode. Each chat
holds one message of "ab cd " * 690000 (4.14 MB, more tokens than a prompt may have): the server refuses it
by its bytes before tokenising. Prints each answer's status and seconds, and the server's RSS before and
after (issue 47's defect 2: it went from 200 MB to 1.08 GB and stayed while such chats were tokenised).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.cli.make_model import make_model  # noqa: E402
from served import start_server, stop_server  # noqa: E402


def post(url: str, body: dict) -> tuple[int, float]:
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, time.perf_counter() - t0
    except urllib.error.HTTPError as e:
        return e.code, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--model", type=Path, default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="strata-memprobe-"))
    model = args.model or make_model(work / "m", seed=0)
    s = start_server(model, work, "--http", "127.0.0.1:0")
    try:
        proc = psutil.Process(s.proc.pid)
        post(s.http_url, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        before = proc.memory_info().rss
        answers = [post(s.http_url, {"messages": [{"role": "user", "content": "ab cd " * 690000}], "max_tokens": 2})
                   for _ in range(args.requests)]
        after = proc.memory_info().rss
    finally:
        stop_server(s)
    print(f"answers (status, s): {[(code, round(sec, 3)) for code, sec in answers]}")
    print(f"server RSS {before / 2**20:.0f} MB before, {after / 2**20:.0f} MB after {args.requests} chats of "
          f"4.14 MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
