"""Graph-ready decode steps' device memory on a GPU: steps of 1, 4 and 8 rows (four each: planned, captured,
replayed) through the process pool on a small model, with what CuPy's pool holds before and after them; JSON.

    python tools/gpu_step_memory.py [--out step_memory.json] [--layers 4,8] [--context 4096]

For each layer count: the step buffer's bytes (made at open for the VRAM plan's largest step), each bucket's plan
peak, the plan's own figure for those rows (vram.step_bytes), graphs captured and replayed, pool allocations by
the steps, and what CuPy's pool grew by over each shape's last (replayed) step: nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import json_report  # noqa: E402  (tools/json_report.py, beside this file)
from coordinator.model.step import StepBatch

ROWS = (1, 4, 8)


def measure(layers: int, context: int, folder: Path, **model) -> dict:
    """One model of ``layers`` layers (make_model's geometry, or ``model``'s), its steps' memory (module docstring)."""
    import cupy
    import numpy as np

    from coordinator import Engine, EngineConfig
    from coordinator.cli.make_model import make_model
    from coordinator.gpu import vram

    path = make_model(folder / f"m{layers}", seed=0, num_layers=layers, **model)
    config = EngineConfig(device="cuda", pool="process", numa_split=True, nodes=2, max_seq_len=context,
                          dense_dtype="f32")
    with Engine.open(path, config) as eng:
        graph, pool = eng.graph, cupy.get_default_memory_pool()
        if graph is None:
            return {"layers": layers, "graph_ready": False}
        grown = 0  # CuPy's pool's growth over each shape's last step (the caches were reserved by its first)
        for rows in ROWS:
            caches = [eng.new_cache() for _ in range(rows)]
            for step in range(4):
                before = pool.used_bytes()
                eng.step(StepBatch([(np.array([7]), c) for c in caches])).logits
            grown += pool.used_bytes() - before
        cupy.cuda.Device().synchronize()
        stats = graph.arena.stats
        return {"layers": layers, "graph_ready": True, "buffer_bytes": stats.bytes, "plan_step_bytes":
                eng.gpu_memory.step, "peaks": {str(b): p for b, p in sorted(stats.peaks.items())},
                "planned": {str(r): vram.step_bytes(eng.model_config, r, context) for r in ROWS},
                "generation": stats.generation, "pool_allocations": stats.pool_allocations,
                "captures": graph.captures, "replays": graph.replays, "failed": [str(k) for k in graph.failed],
                "cupy_pool_grown_by_replayed_steps": grown}


def problems(runs: list[dict]) -> list[str]:
    """What the runs show wrong: steps not graph-ready, a buffer grown or a pool block taken, a shape not captured,
    a peak beyond the plan, peaks that differ with the layer count, CuPy's pool grown by the steps."""
    out = []
    for r in runs:
        if not r["graph_ready"]:
            out.append(f"{r['layers']} layers: steps not graph-ready")
            continue
        if r["generation"] != 1 or r["pool_allocations"]:
            out.append(f"{r['layers']} layers: buffer made {r['generation']} times, {r['pool_allocations']} pool blocks")
        if r["captures"] != len(ROWS) or r["failed"] or r["replays"] < len(ROWS):
            out.append(f"{r['layers']} layers: {r['captures']} captures, {r['replays']} replays, failed {r['failed']}")
        out += [f"{r['layers']} layers, {b} rows: peak {r['peaks'][str(b)]} over the plan's {r['planned'][str(b)]}"
                for b in ROWS if r["peaks"][str(b)] > r["planned"][str(b)]]
        if r["cupy_pool_grown_by_replayed_steps"]:
            out.append(f"{r['layers']} layers: replayed steps took {r['cupy_pool_grown_by_replayed_steps']} bytes "
                       "from CuPy's pool")
    if len({json.dumps(r.get("peaks")) for r in runs}) > 1:
        out.append(f"the peaks differ with the layer count: {[r.get('peaks') for r in runs]}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--layers", default="4,8")
    ap.add_argument("--context", type=int, default=4096)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        runs = [measure(int(n), args.context, Path(tmp)) for n in args.layers.split(",")]
    report = {"runs": runs, "problems": problems(runs)}
    report["ok"] = not report["problems"]
    return json_report.emit(report, args.out)


if __name__ == "__main__":
    sys.exit(main())
