#!/usr/bin/env python
"""Decode's super-block tile alone (isuper.dot4r1s through rows.quad_super: four rows by one token), one thread.

    .venv/bin/python tools/super_tile.py [--formats q4k,iq4xs,q6k] [--rows 256] [--hidden 2048] [--trials 80]
        [--asm]

Each format's rows are valid random blocks of its GGUF type (tools/kernel_bench.py's stored_rows), --rows of them
(256 rows of 2048 keep a Q6_K matrix in a Zen 3 core's 512 KiB L2), so the figure is the loop's arithmetic:
ns a super-block row (256 weights of one row), the best of --trials runs (a shared host's noise only adds).
--asm: for each format's main loop (the loop of 32 vpmaddubsw: four rows by eight groups, on AVX2) its instructions
and stack references a loop step, and llvm-mca's cycles a step on the host's CPU where llvm-mca is on the PATH.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from numba import njit  # noqa: E402

from kernel_bench import stored_rows  # noqa: E402
from node_worker.kernels import rows as kernel_rows  # noqa: E402
from node_worker.kernels.activations import quantize_rows_super  # noqa: E402
from node_worker.kernels.kernel_set import KernelSet  # noqa: E402
from node_worker.kernels.loops import FORMATS  # noqa: E402
from shm import formats  # noqa: E402


@njit
def tiles(ks, fmt, data, row_bytes, rows, hidden, xq, xd, bs, out, reps) -> None:
    for _ in range(reps):
        for q in range(rows // 4):
            kernel_rows.quad_super(ks, fmt, data, 0, row_bytes, rows, hidden, xq, xd, bs, out, 4 * q)


def loop_stats(asm: str) -> list[dict]:
    """Per basic block of the listing with 32 vpmaddubsw (a decode tile's loop step): its instructions, stack
    references and, with llvm-mca, cycles a step."""
    blocks, label, lines = [], None, []
    for line in asm.splitlines() + [".LBB_end:"]:
        if re.match(r"^\.LBB\w+:", line):
            if label and sum("vpmaddubsw" in x for x in lines) == 32:
                body = [x for x in lines if re.match(r"^\s+[a-z]", x) and not re.match(r"^\s+(j[a-z]+|\.)", x)]
                blocks.append({"instructions": len(body), "stack": sum("rsp)" in x for x in body),
                               "mca_cycles": _mca(body)})
            label, lines = line, []
        else:
            lines.append(line)
    return blocks


def _mca(body: list[str]) -> float | None:
    if not shutil.which("llvm-mca"):
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".s") as f:
        f.write("\n".join(body) + "\n")
        f.flush()
        out = subprocess.run(["llvm-mca", "-iterations=200", f.name], capture_output=True, text=True).stdout
    m = re.search(r"Total Cycles:\s+(\d+)", out)
    return int(m.group(1)) / 200 if m else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default="q4k,iq4xs,q6k")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--trials", type=int, default=80)
    ap.add_argument("--asm", action="store_true")
    args = ap.parse_args()
    names = args.formats.split(",")
    rng = np.random.default_rng(0)
    reps = max(1, 10240 // args.rows)
    for name in names:
        stored = stored_rows(formats.get(name), args.rows, args.hidden, rng)
        data = np.ascontiguousarray(stored).view(np.uint8).reshape(-1)
        xq, xd, bs = quantize_rows_super(rng.standard_normal((1, args.hidden)).astype(np.float32))
        out = np.zeros((1, args.rows), np.float32)
        ks = KernelSet.of([name], True)  # a set of its own: its own compiled tiles, whose loop --asm reads
        call = (ks, list(FORMATS).index(name), data, data.size // args.rows, args.rows, args.hidden, xq, xd, bs,
                out, reps)
        tiles(*call)
        best = float("inf")
        for _ in range(args.trials):
            t = time.perf_counter()
            tiles(*call)
            best = min(best, time.perf_counter() - t)
        per = best / (args.rows * args.hidden // 256 * reps)
        print(f"{name}: {per * 1e9:.2f} ns a super-block row, {data.size * reps / best / 1e9:.1f} GB/s one thread")
        if args.asm:
            sig = next(s for s in tiles.signatures if str(s[0]) == str(tiles.typeof_pyval(ks)))
            for stats in loop_stats(tiles.inspect_asm(sig)):
                print(f"  {name} loop step (four rows): {stats}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
