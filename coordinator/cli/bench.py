"""``strata bench``: the pool modes side by side in one run.

Modes (each one Engine, all opened before measuring):
  inproc  the in-process pool, one node's CPUs as its threads (no processes)
  single  one node worker process holding whole experts (the default path)
  split   one node worker per node (virtual when the machine has fewer)

With ``formats`` (``--formats f32,bf16``) each mode is opened once per storage format, labelled
``mode@format``, and each label's decode and prefill are also given as a ratio to the same mode in the
first format, from the same rounds (issue 13's "bf16 decode >= 1.8x our f32" is such a ratio).

Rounds interleave the modes (A B C A B C ...) after a warm-up: the whole prompt and a few new tokens per
mode, as llama-bench warms up on the test it times: the first prefill of a process is otherwise slower
than the next ones. Per mode: decode
and prefill tokens/s; per MoE layer at decode, the pool's wall time (first send
to last partial), the workers' own compute and the difference, next to the empty
round trip over the same sockets; the pool's effective bandwidth (expert bytes
read per second of compute) next to a STREAM-style read by the same pinned
threads over an array 4x the last-level cache; per node its threads, rows,
placement and whether it is virtual. Ratios are computed within the run. After the rounds, a profiled decode
per mode splits the step (step_split.py): the experts, the dense matrices, the attention, the norms, router and
sampling, each in microseconds and GB/s a token and against the STREAM read, and the per-layer overhead.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import psutil

from node_worker.kernels import target_summary

from ..config import DENSE_DTYPES, EXPERT_DTYPES, EngineConfig
from ..engine import Engine
from ..errors import StrataError
from ..quality import compare_logits
from .make_model import l3_bytes
from . import step_split

log = logging.getLogger(__name__)

MODES = ("inproc", "single", "split")
REPEATED_PHRASE = 16  # --repetitive: the prompt is its first this many tokens over and over
HEADROOM = 0.9  # the modes still to open may take this share of the memory available


class BenchNoRoom(StrataError):
    """The modes' engines, all open at once, would not fit in the machine's memory."""


def check_room_for_modes(took: int, opened: list[str], left: list[str], available: int) -> None:
    """Refuse, before the kernel's OOM killer does, to open ``left`` when each is likely to take ``took`` bytes
    (the most one opened engine took) and the machine has ``available`` bytes free (as MemAvailable)."""
    need = took * len(left)
    if left and need > HEADROOM * available:
        raise BenchNoRoom(
            f"bench: the modes are all open at once and {', '.join(opened)} took up to {took / 2**30:.1f} GiB each; "
            f"{', '.join(left)} would need about {need / 2**30:.1f} GiB more but the machine has "
            f"{available / 2**30:.1f} GiB available. Run fewer modes at once (--modes), store the experts smaller "
            "(--expert-dtype), or bench a model with fewer layers")


def parse_formats(text: str) -> list[tuple[str, dict]]:
    """``--formats``: comma-separated storage formats, each ``E`` (experts and dense matrices as E) or ``E+D``
    (experts E, dense matrices D), as (label, EngineConfig fields) in the order given."""
    out = []
    for entry in (e.strip() for e in text.split(",")):
        expert, _, dense = entry.partition("+")
        dense = dense or expert
        if not entry or expert not in EXPERT_DTYPES or dense not in DENSE_DTYPES:
            raise StrataError(
                f"--formats: {entry!r} is not a format; give FORMAT (experts and dense matrices) or "
                f"EXPERTS+DENSE, experts one of {', '.join(EXPERT_DTYPES)}, dense matrices one of "
                f"{', '.join(DENSE_DTYPES)} (a GGUF file's own blocks are for experts only: q4k+q8)")
        if entry in (label for label, _ in out):
            raise StrataError(f"--formats: {entry!r} is given twice")
        out.append((entry, {"expert_dtype": expert, "dense_dtype": dense}))
    return out


INVARIANCE = (("invariant", {"batch_invariant": True}), ("variable", {"batch_invariant": False}))


def with_invariance(formats: list[tuple[str, dict]] | None) -> list[tuple[str, dict]]:
    """``--invariance both``: each format (or the engine's own, without --formats) measured with batch-invariant
    numerics and without, side by side (labels FORMAT/invariant and FORMAT/variable; the invariant one first, the
    base of the ratios)."""
    if not formats:
        return list(INVARIANCE)
    return [(f"{label}/{name}", {**fields, **extra}) for label, fields in formats for name, extra in INVARIANCE]


def labels_for(modes, formats: list[tuple[str, dict]] | None) -> list[tuple[str, str, dict]]:
    """(label, mode, the format's EngineConfig fields) for each mode and format: the mode's name alone without
    formats, else mode@format, the formats of a mode side by side."""
    if not formats:
        return [(mode, mode, {}) for mode in modes]
    return [(f"{mode}@{label}", mode, fields) for mode in modes for label, fields in formats]


def mode_fields(mode: str, nodes: int) -> dict:
    """The EngineConfig fields a mode sets itself (the rest: the command's flags, variables and defaults)."""
    if mode == "inproc":  # threads: the node's CPUs (cpu_experts.build_inproc_pool)
        return {"pool": "inproc", "numa_split": False, "nodes": None}
    if mode == "single":
        return {"pool": "process", "numa_split": False, "nodes": None}
    if mode == "split":
        return {"pool": "process", "numa_split": True, "nodes": nodes, "pool_node": 0}
    raise ValueError(f"unknown bench mode {mode!r}; expected one of {', '.join(MODES)}")


@dataclass(frozen=True)
class BenchEngine:
    label: str  # the mode's name, or mode@format
    mode: str
    config: EngineConfig


@dataclass(frozen=True)
class BenchPlan:
    engines: tuple[BenchEngine, ...]  # opened in this order, all at once, and measured interleaved
    formats: tuple[str, ...] = ()  # --formats' entries: each mode once per format, the first the ratios' base
    settings: dict = field(default_factory=dict)  # the settings given beside the modes' own, for the report
    tokens: int = 64  # decoded a round
    prompt_tokens: int = 256  # prefilled a round
    rounds: int = 3
    warmup_tokens: int = 4
    membw_bytes: int | None = None  # the STREAM-style read's array; None: stream_bytes
    seed: int = 0
    quality_positions: int = 0  # compare the first mode's logits with an f32 computation over this many; 0: not
    speculative: str = "off"  # also decode each round with this speculative decoding, beside plain decoding
    repetitive: bool = False  # the prompt: one random phrase repeated (prompt lookup drafts from it)
    prompt_text: str | None = None  # the prompt: this text's first prompt_tokens tokens (None: random tokens)
    temperature: float = 0.0  # the decode rounds' sampling (0: greedy); seeded per round, the same in both runs


def bench_engines(modes, nodes: int, formats: list[tuple[str, dict]] | None,
                  resolve: Callable[[dict], EngineConfig]) -> tuple[BenchEngine, ...]:
    """One engine per mode, or per mode and format, its config ``resolve``d from the fields the mode and the
    format set (the command resolves the rest as every command does: flag > variable > default)."""
    return tuple(BenchEngine(label, mode, resolve({**mode_fields(mode, nodes), **fields}))
                 for label, mode, fields in labels_for(modes, formats))


def reference_config(config: EngineConfig) -> EngineConfig:
    """The quality reference of an engine: the same settings, in-process, with f32 experts, dense matrices and
    activations."""
    return dataclasses.replace(config, pool="inproc", numa_split=False, nodes=None, pool_node=0,
                               **{name: "f32" for name in QUALITY_SETTINGS})


def summary(values: list[float]) -> dict:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def by_round(values: list[float]) -> dict:
    """summary of one figure a round, with the rounds' values in order (the rounds pair up across figures)."""
    return {**summary(values), "values": list(values)}


def layer_figures(timings, decode_only: bool = True) -> dict:
    """Per MoE layer call: wall, compute (slowest node), overhead, bytes, in microseconds and bytes."""
    rows = [t for t in timings if not decode_only or t.tokens <= 1]
    return {
        "calls": len(rows),
        "wall_us": summary([t.wall_ns / 1e3 for t in rows]),
        "compute_us": summary([max(t.compute_ns) / 1e3 for t in rows]),
        "overhead_us": summary([t.overhead_ns / 1e3 for t in rows]),
        # where the overhead goes (process pools): the slowest node's hop times
        "to_worker_us": summary([max(t.to_worker_ns) / 1e3 for t in rows if t.to_worker_ns]),
        "in_worker_us": summary([max(t.in_worker_ns) / 1e3 for t in rows if t.in_worker_ns]),
        "to_coordinator_us": summary([max(t.to_coordinator_ns) / 1e3 for t in rows if t.to_coordinator_ns]),
        "bytes_read": int(sum(sum(t.bytes_read) for t in rows)),
        "compute_s": sum(max(t.compute_ns) for t in rows) / 1e9,
    }


STREAM_MAX_BYTES = 1 << 30  # the STREAM-style read's array: at most this ...
STREAM_MEMORY_SHARE = 16  # ... and this share of the available memory (beside the modes' engines) ...
STREAM_MIN_BYTES = 64 << 20  # ... and at least this, wherever the others come out smaller


def stream_bytes(last_level_cache: int, available: int) -> int:
    """The STREAM-style read's array: four times the last-level cache (out of it, as STREAM asks), within
    STREAM_MAX_BYTES and a STREAM_MEMORY_SHARE of the memory available beside the engines (a guest may
    report a large L3, which alone would ask for gigabytes beside a tiny model on a small machine)."""
    return max(STREAM_MIN_BYTES, min(4 * last_level_cache, STREAM_MAX_BYTES, available // STREAM_MEMORY_SHARE))


def plot_available() -> str:
    """'' when --plot can draw (matplotlib imports), else what to install."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--plot needs matplotlib: pip install 'strata-numa[plot]'"
    return ""


def run_bench(model_dir: str | Path, plan: BenchPlan) -> dict:
    """Open ``plan``'s engines and measure them side by side. With ``plan.quality_positions`` also compare the
    first mode's logits (with formats, the first mode's in each format) over that many positions, one decode
    step each, with an f32 computation of the same checkpoint (reference_config)."""
    model_dir = Path(model_dir)
    engines: dict[str, Engine] = {}
    labels = [(e.label, e.mode) for e in plan.engines]
    try:
        available = _open_engines(model_dir, plan, engines)
        membw_bytes = plan.membw_bytes or stream_bytes(l3_bytes(), available)  # beside every mode's engine
        any_eng = next(iter(engines.values()))
        mcfg = any_eng.model_config
        prompt = bench_prompt(plan, any_eng, np.random.default_rng(plan.seed))
        results = _rounds(engines, plan, prompt)
        for mode, eng in engines.items():  # after the timed rounds: the wrappers time what the rounds ran bare
            results[mode]["step_split"] = step_split.measure(eng, prompt, plan.tokens)
        report = {"model": str(model_dir), "arch": mcfg.arch, "kv_bytes_per_token": mcfg.kv_bytes_per_token,
                  "state_bytes_per_sequence": mcfg.state_bytes_per_sequence,
                  "spin_us": plan.engines[0].config.pool_spin_us, "tokens": plan.tokens, "prompt_tokens": len(prompt),
                  "prompt": "text" if plan.prompt_text is not None else "repetitive" if plan.repetitive else "random",
                  "rounds": plan.rounds, "membw_bytes": membw_bytes, "l3_bytes": l3_bytes(),
                  "device": dict(plan.settings), "formats": list(plan.formats), "kernels": target_summary(),
                  "modes": {mode: {"mode": next(m for label, m in labels if label == mode),
                                   **_mode_report(eng, results[mode], membw_bytes, plan.speculative)}
                            for mode, eng in engines.items()}}
        if plan.quality_positions:
            # the first mode in each format (the first mode alone without formats); the rest are measured and
            # closed first: their memory goes to the f32 reference engine
            compared = [label for label, mode in labels if mode == labels[0][1]]
            for label in [name for name in engines if name not in compared]:
                engines.pop(label).close()
            quality = measure_quality(model_dir, engines, compared, plan.quality_positions, plan.seed)
            report["quality"] = quality[compared[0]]
            if plan.formats:
                report["quality_by_format"] = quality
        report["numpy_sum"] = numpy_sum(membw_bytes)
        add_ratios(report, plan.formats)
        return report
    finally:
        for eng in engines.values():
            eng.close()


def _open_engines(model_dir: Path, plan: BenchPlan, engines: dict) -> int:
    """Each mode's engine opened into ``engines`` (its label -> engine; the caller closes them), refused before
    the next where the memory left cannot hold the rest; the memory available after the last."""
    labels = [e.label for e in plan.engines]
    took = available = 0
    for k, bench_engine in enumerate(plan.engines):
        before = psutil.virtual_memory().available
        engines[bench_engine.label] = Engine.open(model_dir, bench_engine.config)
        available = psutil.virtual_memory().available
        took = max(took, before - available)  # the engine's heap, segments and workers
        check_room_for_modes(took, list(engines), labels[k + 1:], available)
    return available


def _rounds(engines: dict, plan: BenchPlan, prompt: list[int]) -> dict[str, dict]:
    """Every mode's figures over plan.rounds rounds, the modes interleaved (A B C A B C ...) after a warm-up."""
    results: dict[str, dict] = {m: {"decode_tps": [], "prefill_tps": [], "timings": [], "pairs": 0,
                                    "expert_loads": 0, "spec_tps": [], "spec_steps": 0, "drafted": 0,
                                    "accepted": 0, "spec_tokens": 0} for m in engines}
    for eng in engines.values():
        eng.generate(prompt, max_new_tokens=plan.warmup_tokens, stop_at_eos=False)
    for k in range(plan.rounds):
        print(f"bench: round {k + 1} of {plan.rounds} ({', '.join(engines)})", file=sys.stderr, flush=True)
        for mode, eng in engines.items():
            pool = eng.pool
            sampling = {"temperature": plan.temperature, "seed": plan.seed + k}
            res = results[mode]
            drafts_first = plan.speculative != "off" and k % 2 == 1  # the order alternates, so drift evens out
            if drafts_first:
                _drafted_round(eng, plan.speculative, prompt, plan.tokens, sampling, res)
            pool.record_timings, pool.timings = True, []
            loads0, pairs0 = eng.decoder.stats.cpu_expert_loads, eng.decoder.stats.routed_pairs
            r = eng.generate_full(prompt, max_new_tokens=plan.tokens, stop_at_eos=False, speculative="off",
                                  **sampling)
            pool.record_timings = False
            res["decode_tps"].append(r.timings["decode_tokens_per_s"])
            res["prefill_tps"].append(r.timings["prefill_tokens_per_s"])
            res["timings"].extend(pool.timings)
            res["expert_loads"] += eng.decoder.stats.cpu_expert_loads - loads0
            res["pairs"] += eng.decoder.stats.routed_pairs - pairs0
            if plan.speculative != "off" and not drafts_first:
                _drafted_round(eng, plan.speculative, prompt, plan.tokens, sampling, res)
    return results


def numpy_sum(nbytes: int) -> dict:
    """The STREAM column's yardstick: NumPy's sum over an array of ``nbytes``, on as many threads of this process
    as it may run on (membw.numpy_read_bandwidth)."""
    from node_worker.membw import numpy_read_bandwidth

    threads = len(os.sched_getaffinity(0))
    return {"threads": threads, "gb_per_s": numpy_read_bandwidth(threads, nbytes)[1]}


def _mode_report(eng: Engine, res: dict, membw_bytes: int, speculative: str) -> dict:
    """One mode's figures: its rounds' speeds, the MoE layer's times, the pool's floor and bandwidth, the experts
    read, each node's share."""
    mcfg, pool = eng.model_config, eng.pool
    floor = [pool.ping() * 1e6 for _ in range(100)]  # in-process: a call's time, no sockets
    bw = pool.membw(membw_bytes)
    decode = layer_figures(res["timings"], decode_only=True)
    all_calls = layer_figures(res["timings"], decode_only=False)
    pool_gbps = decode["bytes_read"] / decode["compute_s"] / 1e9 if decode["compute_s"] else None
    health = pool.health()
    node_info = {n.id: n for n in eng.nodes}
    stored = sum(h["segment_bytes"] or 0 for h in health)  # each node's store, in a segment or the heap
    return {
        "config": {"pool": eng.config.pool, "numa_split": eng.config.numa_split, "plan": pool.plan.digest},
        "decode_tokens_per_s": by_round(res["decode_tps"]),
        "prefill_tokens_per_s": summary(res["prefill_tps"]),
        "moe_layer_decode": decode,
        "empty_round_trip_us": summary(floor),
        "overhead_per_token": per_token_overhead(decode, len(mcfg.moe_layers), res["decode_tps"]),
        "overhead_vs_floor": (decode["overhead_us"]["median"] / statistics.median(floor)
                              if statistics.median(floor) > 0 and decode["overhead_us"]["median"] is not None
                              else None),
        "pool_gb_per_s": pool_gbps,
        "membw": bw,
        "bandwidth_ratio": pool_gbps / bw["gb_per_s"] if pool_gbps else None,
        "experts": eng.expert_report(),
        "expert_format": eng.expert_format,
        "dense_format": eng.dense_format,
        "gpu_memory": eng.gpu_memory.as_dict() if eng.gpu_memory is not None else None,
        "stored_bytes_per_weight": stored / eng.cpu_expert_weights() if eng.cpu_expert_weights() else None,
        "bytes": {"counted": all_calls["bytes_read"],
                  "implied_by_routing": res["expert_loads"] * eng.cpu_expert_bytes(),
                  "expert_loads": res["expert_loads"], "routed_pairs": res["pairs"]},
        "nodes": [{
            "node": h["node"], "virtual": node_info[h["node"]].virtual, "threads": h.get("threads"),
            "cpus": list(node_info[h["node"]].cpus), "slice_rows": h.get("slice_rows"),
            "mean_rows": pool.plan.mean_rows(mcfg.moe_intermediate_size, h["node"]),
            "local_share": (h.get("placement") or {}).get("local_share"),
        } for h in health],
        "balance": node_balance(res["timings"], pool.plan),
        "speculative": speculative_figures(speculative, res),
        "step_split": step_split.with_roofline(res.get("step_split"), bw["gb_per_s"]),
    }


def bench_prompt(plan: BenchPlan, eng: Engine, rng: np.random.Generator) -> list[int]:
    """The rounds' prompt: ``plan.prompt_text``'s first prompt_tokens tokens (all of them where it has fewer),
    else prompt_tokens random ids below 256 (one phrase repeated with ``plan.repetitive``)."""
    if plan.prompt_text is not None:
        ids = eng.encode(plan.prompt_text)[:plan.prompt_tokens]
        if not ids:
            raise StrataError("--prompt-file: the file holds no text to make a prompt of")
        return ids
    prompt = rng.integers(0, min(eng.model_config.vocab_size, 256), plan.prompt_tokens).tolist()
    if plan.repetitive:
        prompt = (prompt[:REPEATED_PHRASE] * (plan.prompt_tokens // REPEATED_PHRASE + 1))[:plan.prompt_tokens]
    return prompt


def _drafted_round(eng, mode: str, prompt: list[int], tokens: int, sampling: dict, res: dict) -> None:
    """A round's decode with ``mode``'s drafts, beside its plain decode: the same prompt, tokens and sampling."""
    s = eng.generate_full(prompt, max_new_tokens=tokens, stop_at_eos=False, speculative=mode, **sampling)
    res["spec_tps"].append(s.timings["decode_tokens_per_s"])
    res["spec_steps"] += s.timings["steps"] - 1  # the decode steps (the first one prefilled)
    res["spec_tokens"] += s.timings["decode_tokens"]
    res["drafted"] += s.timings["drafted_tokens"]
    res["accepted"] += s.timings["accepted_drafts"]


def _middle(sp: dict) -> str:
    """', their middle half LO-HIGH' where the rounds' ratios have quartiles."""
    q = sp.get("speedup_quartiles")
    return f", their middle half {q[0]:.2f}-{q[1]:.2f}" if q else ""


def speculative_figures(mode: str, res: dict) -> dict | None:
    """Decode with drafts beside decode without, from the same rounds: tok/s of both, the speedup (the median of
    the rounds' ratios: each round's pair ran back to back, so a slow spell of the machine enters both sides of
    one ratio) and the quartiles of those ratios (how far a noisy machine spreads them), the share of drafted tokens
    that stood, and the tokens a decode step made."""
    if mode == "off":
        return None
    with_drafts = by_round(res["spec_tps"])
    ratios = [d / p for d, p in zip(res["spec_tps"], res["decode_tps"]) if d and p]
    return {"mode": mode, "decode_tokens_per_s": with_drafts, "speedup_by_round": ratios,
            "speedup": float(np.median(ratios)) if ratios else None,
            "speedup_quartiles": [float(q) for q in np.percentile(ratios, [25, 75])] if ratios else None,
            "acceptance_rate": res["accepted"] / res["drafted"] if res["drafted"] else None,
            "tokens_per_step": res["spec_tokens"] / res["spec_steps"] if res["spec_steps"] else None,
            "drafted_tokens": res["drafted"], "accepted_drafts": res["accepted"]}


def _ratio(report: dict, label: str, base_label: str, key: str) -> float | None:
    base = report["modes"].get(base_label, {}).get(key, {}).get("median")
    value = report["modes"][label][key]["median"]
    return value / base if base and value else None


def add_ratios(report: dict, formats: tuple[str, ...]) -> None:
    """Each label's decode against inproc in its format; with formats, its decode and prefill against the same
    mode in the first format. Both from the same interleaved rounds."""
    for label, m in report["modes"].items():
        fmt = label.partition("@")[2]
        m["decode_vs_inproc"] = _ratio(report, label, f"inproc@{fmt}" if fmt else "inproc", "decode_tokens_per_s")
        if formats:
            first = f"{m['mode']}@{formats[0]}"
            m["vs_first_format"] = {"of": first,
                                    "decode": _ratio(report, label, first, "decode_tokens_per_s"),
                                    "prefill": _ratio(report, label, first, "prefill_tokens_per_s")}


def node_balance(timings, plan) -> dict:
    """Each node's compute summed over the decode layer calls, and the slowest node's over the mean: the cost
    of uneven slices (a GGUF K type's 256-row blocks: 768 rows are 1.5 blocks a node for two nodes; the plan's
    turns give the spare block to each node in turn, expert by expert)."""
    calls = [t for t in timings if t.tokens <= 1]
    per_node = [sum(t.compute_ns[k] for t in calls) / 1e9 for k in range(len(plan.node_ids))] if calls else []
    mean = sum(per_node) / len(per_node) if per_node else 0
    return {"nodes": list(plan.node_ids), "compute_s": per_node,
            "max_over_mean": max(per_node) / mean if mean else None}


def per_token_overhead(decode: dict, moe_layers: int, decode_tps: list[float]) -> dict:
    """The boundary's cost per decode step: the median overhead per MoE layer times the MoE layers a token
    crosses, and its share of the median decode step."""
    per_layer = decode["overhead_us"]["median"]
    if per_layer is None or not decode_tps:
        return {"us": None, "share_of_step": None, "moe_layers": moe_layers}
    step_us = 1e6 / statistics.median(decode_tps)
    return {"us": per_layer * moe_layers, "share_of_step": per_layer * moe_layers / step_us, "moe_layers": moe_layers}


def measure_quality(model_dir: Path, engines: dict[str, Engine], compared: list[str], positions: int,
                    seed: int) -> dict[str, dict]:
    """The logits of each engine named in ``compared`` against one f32 computation of the same checkpoint,
    over one prompt: one decode step a position, and (under "prefill") the prompt in one pass, as prefill
    computes it. Each engine is closed (and taken out of ``engines``) once its logits are taken, so the
    reference opens beside none of them."""
    rng = np.random.default_rng(seed + 1)
    prompt = rng.integers(0, min(engines[compared[0]].model_config.vocab_size, 256), positions).tolist()
    got = {}
    for label in compared:
        eng = engines[label]
        # decode steps (where quantised activations are used), then [positions, V] in one pass: prefill's kernels
        got[label] = (eng.logits(prompt, steps=True), eng.logits(prompt),
                      {"expert_format": eng.expert_format, "dense_format": eng.dense_format,
                       "activations": eng.config.activations})
        ref_config = reference_config(eng.config)
        engines.pop(label).close()
    with Engine.open(model_dir, ref_config) as ref:
        want = ref.logits(prompt, steps=True)
        want_prefill = ref.logits(prompt)
    return {label: {**about, "reference": "f32 experts, dense matrices and activations, in-process, one decode "
                                          "step a position",
                    **compare_logits(want, steps), "prefill": compare_logits(want_prefill, one_pass)}
            for label, (steps, one_pass, about) in got.items()}


QUALITY_SETTINGS = ("expert_dtype", "dense_dtype", "activations")  # what the quality reference sets itself


def _fmt(v, spec=".1f") -> str:
    return "-" if v is None else format(v, spec)


def _quality_by_label(report: dict) -> dict[str, dict]:
    """The quality figures to print: per format's label, or the one set under no label (no --formats)."""
    if report.get("quality_by_format"):
        return report["quality_by_format"]
    return {"": report["quality"]} if report.get("quality") else {}


def markdown(report: dict) -> str:
    lines = [f"model {report['model']} ({report['arch']}), {report['prompt_tokens']} {report.get('prompt', 'random')} "
             f"prompt + {report['tokens']} "
             f"new tokens, {report['rounds']} interleaved rounds; STREAM array {report['membw_bytes'] / 2**20:.0f} MiB "
             f"(4x LLC); KV cache {report.get('kv_bytes_per_token', 0)} bytes a token"
             + (f", state {report['state_bytes_per_sequence']} bytes a sequence" if report.get(
                 'state_bytes_per_sequence') else "") + f"; {report.get('kernels', '')}", "",
             "| mode | decode tok/s (min-max) | vs inproc | prefill tok/s | MoE layer wall us | worker compute us "
             "| overhead us | empty RTT us | overhead/RTT | pool GB/s | STREAM GB/s | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, m in report["modes"].items():
        d, p, L = m["decode_tokens_per_s"], m["prefill_tokens_per_s"], m["moe_layer_decode"]
        rtt = m["empty_round_trip_us"]["median"] if m["empty_round_trip_us"] else None
        lines.append(
            f"| {mode} | {_fmt(d['median'])} ({_fmt(d['min'])}-{_fmt(d['max'])}) | {_fmt(m['decode_vs_inproc'], '.2f')} "
            f"| {_fmt(p['median'])} | {_fmt(L['wall_us']['median'], '.0f')} | {_fmt(L['compute_us']['median'], '.0f')} "
            f"| {_fmt(L['overhead_us']['median'], '.0f')} | {_fmt(rtt, '.0f')} | {_fmt(m['overhead_vs_floor'], '.2f')} "
            f"| {_fmt(m['pool_gb_per_s'])} | {_fmt(m['membw']['gb_per_s'])} | {_fmt(m['bandwidth_ratio'], '.2f')} |")
    lines.append("")
    if report.get("numpy_sum"):
        n = report["numpy_sum"]
        lines.append(f"NumPy's sum on {n['threads']} threads of this process reads {_fmt(n['gb_per_s'])} GB/s: the "
                     "STREAM column's yardstick (a read that reaches it measures the memory, not its own loop)")
    for mode, m in report["modes"].items():
        r = m.get("vs_first_format")
        if r and r["of"] != mode:
            lines.append(f"{mode}: decode {_fmt(r['decode'], '.2f')}x and prefill {_fmt(r['prefill'], '.2f')}x "
                         f"{r['of']} (experts {m['expert_format']}, dense {m['dense_format']}; the same rounds)")
    for mode, m in report["modes"].items():
        sp = m.get("speculative")
        if sp:
            d = sp["decode_tokens_per_s"]
            lines.append(f"{mode}: with {sp['mode']} drafts decode {_fmt(d['median'])} tok/s, "
                         f"{_fmt(sp['speedup'], '.2f')}x without (median of the rounds' ratios{_middle(sp)}); "
                         f"acceptance {_fmt(sp['acceptance_rate'], '.1%')} of {sp['drafted_tokens']} drafted, "
                         f"{_fmt(sp['tokens_per_step'], '.2f')} tokens a step")
    for mode, m in report["modes"].items():
        o = m["overhead_per_token"]
        if o["us"] is not None:
            lines.append(f"{mode}: boundary overhead per token = {o['us']:.0f} us over {o['moe_layers']} MoE layers, "
                         f"{o['share_of_step']:.1%} of the decode step")
    lines.append("")
    for mode, m in report["modes"].items():
        lines += step_split.markdown(mode, m.get("step_split"))
    for mode, m in report["modes"].items():
        L = m["moe_layer_decode"]
        if L["to_worker_us"]["median"] is not None:
            lines.append(f"{mode}: overhead per layer = to worker {L['to_worker_us']['median']:.0f} us + in worker "
                         f"(decode, checks, reply) {L['in_worker_us']['median']:.0f} us + back "
                         f"{L['to_coordinator_us']['median']:.0f} us (medians)")
    lines.append("")
    for mode, m in report["modes"].items():
        lines.append(f"{mode}: CPU experts stored as {m['expert_format']}, "
                     f"{_fmt(m['stored_bytes_per_weight'], '.3f')} bytes a weight")
    for label, q in _quality_by_label(report).items():
        lines.append(f"{label + ': ' if label else ''}quality of experts {q['expert_format']} + dense "
                     f"{q['dense_format']}, activations {q['activations']}, against {q['reference']}, "
                     f"{q['positions']} positions: max rel logits error {q['max_rel_logits_error']:.2e}, mean KL "
                     f"{q['mean_kl']:.2e}, top-1 agreement {q['top1_agreement']:.1%}")
        p = q["prefill"]
        lines.append(f"{label + ': ' if label else ''}quality of the same in one prefill pass over the "
                     f"{p['positions']} positions: max rel logits error {p['max_rel_logits_error']:.2e}, mean KL "
                     f"{p['mean_kl']:.2e}, top-1 agreement {p['top1_agreement']:.1%}")
    lines.append("")
    for mode, m in report["modes"].items():
        e = m["experts"]
        placed = e["device_experts"]
        lines.append(f"{mode}: device side {placed['backend']}, {placed['experts']} experts on it ({placed['chosen']}), "
                     f"hit rate {_fmt(e['hit_rate'], '.1%')}, expert GB read: device {e['device_bytes_read'] / 1e9:.2f}, "
                     f"CPU {e['cpu_bytes_read'] / 1e9:.2f}; waited: coordinator on pool "
                     f"{e['coordinator_wait_on_pool_s']:.2f} s, pool on coordinator {e['pool_wait_on_coordinator_s']:.2f} s")
    lines.append("")
    for mode, m in report["modes"].items():
        for n in m["nodes"]:
            lines.append(f"{mode}: node {n['node']} ({'virtual' if n['virtual'] else 'real'}), threads {n['threads']}, "
                         f"rows {n['slice_rows']} of expert 0, {_fmt(n['mean_rows'], '.0f')} an expert on average, "
                         f"local pages {_fmt(n['local_share'], '.0%')}")
        b = m["balance"]
        if len(b["nodes"]) > 1 and b["max_over_mean"] is not None:
            lines.append(f"{mode}: decode compute per node " + ", ".join(
                f"node {n} {c:.2f} s" for n, c in zip(b["nodes"], b["compute_s"]))
                + f": slowest / mean {b['max_over_mean']:.2f}")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    modes = list(report["modes"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar(modes, [report["modes"][m]["decode_tokens_per_s"]["median"] or 0 for m in modes])
    a.set_title("decode tokens/s")
    b.bar(modes, [report["modes"][m]["bandwidth_ratio"] or 0 for m in modes])
    b.axhline(0.8, linestyle="--", color="grey")
    b.set_title("pool bandwidth / STREAM read")
    fig.tight_layout()
    fig.savefig(path)


def write_json(report: dict, path: str) -> None:
    Path(path).write_text(json.dumps(report, indent=2))
