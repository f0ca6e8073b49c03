#!/usr/bin/env python
"""The STREAM-style read (node_worker/membw.py) beside NumPy's sum on the same array, in interleaved rounds; with
``--before REV`` also that revision's read (its membw.py taken from git), for a change to the read's loop.

    .venv/bin/python tools/membw_compare.py [--mib 256] [--threads 2] [--rounds 3] [--before REV]
"""

from __future__ import annotations

from shm import threads_env

threads_env.apply()  # the thread settings strata's commands run with, before NumPy loads

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numba  # noqa: E402
import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from node_worker import membw  # noqa: E402


def module_at(rev: str):
    """node_worker/membw.py as it was at ``rev``, imported as a module of its own."""
    text = subprocess.run(["git", "show", f"{rev}:node_worker/membw.py"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout
    path = Path(tempfile.mkdtemp()) / "membw_before.py"
    path.write_text(text.replace("from .kernels", "from node_worker.kernels"))
    spec = importlib.util.spec_from_file_location("membw_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before", default=None, help="a git revision whose read to time beside")
    args = ap.parse_args()
    numba.set_num_threads(args.threads)
    nbytes = args.mib << 20
    data = np.empty(nbytes // 4, np.float32)
    membw.fill(data)
    reads = {"read": membw.read}
    if args.before:
        reads = {f"read at {args.before}": module_at(args.before).read, **reads}

    def best(f, reps: int = 5) -> float:
        b = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            f(data)
            b = min(b, time.perf_counter() - t0)
        return nbytes / b / 1e9

    for f in reads.values():
        f(data)  # compiled (or loaded) before the rounds
    names = [*reads, "NumPy 1 thread", f"NumPy {args.threads} threads"]
    print("| round | " + " | ".join(f"{n} GB/s" for n in names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for r in range(args.rounds):
        got = [best(f) for f in reads.values()]
        got += [membw.numpy_read_bandwidth(1, nbytes, 5)[1], membw.numpy_read_bandwidth(args.threads, nbytes, 5)[1]]
        print(f"| {r + 1} | " + " | ".join(f"{g:.1f}" for g in got) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
