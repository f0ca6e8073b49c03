#!/usr/bin/env python
"""Round trip between two processes: a ZeroMQ ipc ping-pong against the pool's futex doorbells.

    .venv/bin/python tools/rtt_probe.py [--rounds 2000]

Why the pool's data path wakes its workers through a futex word of shared
memory (shm/doorbell.py) and keeps ZeroMQ for the control messages: prints the
median and 90th percentile round trip of each, in microseconds.
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shm import doorbell  # noqa: E402


def zmq_echo(endpoint: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send(b"hi")
    while (msg := sock.recv()) != b"x":
        sock.send(msg)
    sock.close(0)
    ctx.term()


def zmq_rtt(rounds: int) -> list[float]:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    endpoint = f"ipc://{tempfile.mkdtemp(prefix='strata-rtt-')}/s"
    router.bind(endpoint)
    proc = mp.get_context("fork").Process(target=zmq_echo, args=(endpoint,))
    proc.start()
    identity, _ = router.recv_multipart()
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        router.send_multipart([identity, b"p"])
        router.recv_multipart()
        out.append(time.perf_counter() - t)
    router.send_multipart([identity, b"x"])
    proc.join()
    router.close(0)
    ctx.term()
    return out


def bell_echo(buf: mmap.mmap, rounds: int) -> None:
    words = np.frombuffer(buf, np.uint32)  # [0] the echo's bell, [1] the caller's
    for k in range(rounds):
        while doorbell.load_acquire(words, 0) <= k:
            doorbell.wait_ring(words, 0, k, 0.1)
        doorbell.ring(words, 1)


def bell_rtt(rounds: int) -> list[float]:
    doorbell.warm_up()
    buf = mmap.mmap(-1, 64)  # shared with the forked child
    words = np.frombuffer(buf, np.uint32)
    proc = mp.get_context("fork").Process(target=bell_echo, args=(buf, rounds))
    proc.start()
    out = []
    for k in range(rounds):
        t = time.perf_counter()
        doorbell.ring(words, 0)
        while doorbell.load_acquire(words, 1) <= k:
            doorbell.wait_ring(words, 1, k, 0.1)
        out.append(time.perf_counter() - t)
    proc.join()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2000)
    args = ap.parse_args()
    print("| path | median us | p90 us |\n|---|---|---|")
    for name, fn in (("ZeroMQ ipc (DEALER/ROUTER)", zmq_rtt), ("futex doorbells (shm/doorbell.py)", bell_rtt)):
        ts = sorted(fn(args.rounds))
        print(f"| {name} | {ts[len(ts) // 2] * 1e6:.1f} | {ts[int(len(ts) * 0.9)] * 1e6:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
