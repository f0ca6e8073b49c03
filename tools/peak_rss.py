#!/usr/bin/env python
"""Run a command and report its wall time and the peak resident memory of every process in its tree.

    python tools/peak_rss.py ./tools/demo.sh            (any Python with psutil: the project's .venv has it)

Each process's RSS is sampled every INTERVAL_S (so a peak shorter than that can be missed); the report, on
stderr after the command's own output, lists the largest peaks first with their command lines.
"""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

INTERVAL_S = 0.05
SHOWN = 8


def main() -> int:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    start = time.monotonic()
    proc = subprocess.Popen(sys.argv[1:])
    root = psutil.Process(proc.pid)
    peaks: dict[int, tuple[int, str]] = {}  # pid -> (peak RSS, its command line when last seen)
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            tree = []
        for p in tree:
            try:
                rss, cmd = p.memory_info().rss, " ".join(p.cmdline())[:100]
            except psutil.Error:
                continue
            peaks[p.pid] = (max(rss, peaks.get(p.pid, (0, ""))[0]), cmd)
        time.sleep(INTERVAL_S)
    print(f"exit {proc.returncode}, wall {time.monotonic() - start:.1f} s; peak RSS by process:", file=sys.stderr)
    for pid, (rss, cmd) in sorted(peaks.items(), key=lambda kv: -kv[1][0])[:SHOWN]:
        print(f"  {rss / 2**20:7.0f} MiB  pid {pid}  {cmd}", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
