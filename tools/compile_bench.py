#!/usr/bin/env python
"""What each compile unit costs on a first run: each compiled alone into an empty cache, in the child process a
run starts (python -m coordinator.warmup), one after another; seconds, functions compiled, the child's peak memory.

    .venv/bin/python tools/compile_bench.py [--units host,doorbells,experts/f32,...] [--json FILE]

The default units: the host loops, the doorbells, the experts' layer of each format alone (with the integer
loops where the format has them: EngineConfig.activations q8, the default), a Q4_K_M file's experts (q4k and
q6k together), every format at once, and the dense matrices of each integer format. A model's first run pays
its units' sum (`strata cache` lists what a run compiled); a unit shares nothing with another here, where a
real first run compiles the shared helpers (the activations' quantisers, the weighted sum) once.
"""

from __future__ import annotations

from shm import threads_env

threads_env.apply()  # the thread settings strata's commands run with, before NumPy loads

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from coordinator.warmup import Unit, marker  # noqa: E402
from node_worker.kernels.kernel_set import KernelSet, for_formats  # noqa: E402

FORMATS = ("f32", "bf16", "q8", "q4", "q4k", "q5k", "q6k", "iq4xs")


def default_units() -> list[str]:
    units = ["host", "doorbells"]
    units += [Unit.experts(for_formats([name], "q8")).name for name in FORMATS]
    units += [Unit.experts(for_formats(["bf16"], "bf16")).name]  # bf16 rows by bf16 activations
    units += [Unit.experts(for_formats(["q4k", "q6k"], "q8")).name, Unit.experts(KernelSet.everything()).name]
    units += [Unit.dense(for_formats([name], "q8")).name for name in ("q8", "q4k", "q6k")]
    return units


def measure(unit: str) -> dict:
    """Compile ``unit`` alone into an empty cache of its own; its marker (seconds, functions, peak_mb)."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}
        out = subprocess.run([sys.executable, "-m", "coordinator.warmup", unit, "-q"], cwd=REPO, env=env,
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"{unit}: {out.stderr.strip()}")
        folder = next(p for p in Path(cache).iterdir() if p.is_dir())
        info = marker(Unit.parse(unit), folder)
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--units", default=None, help="comma-separated compile units (default: the list above)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args()
    units = args.units.split(",") if args.units else default_units()
    from shm import jit

    print(f"each unit alone into an empty cache; {jit.build_key().describe()}\n")
    print("| unit | seconds | functions compiled | peak MB |\n|---|---|---|---|")
    rows = []
    for unit in units:
        info = measure(unit)
        rows.append(info)
        print(f"| {info['label']} | {info['seconds']:.1f} | {info['functions']} | {info['peak_mb']} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"build": jit.build_key().describe(), "units": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
