"""Where a decode step's time goes (``strata bench``'s step split): per token, the time and bytes of the experts,
the dense matrices, the attention over the cache, the norms, router and sampling, and what is left between them,
the per-layer overhead.

A profiled decode, after the bench's timed rounds, wraps the calls each part is made of and adds up their own time
(a part's time less the parts nested in it: the dense matrices inside a Gated DeltaNet layer count as dense):

    experts     the pool's submit and collect (in-process: the layer's compute; a process pool: the coordinator's
                wait for the workers), the host's MoE block (host/blocks.py: a decode token's experts on an
                in-process node, with the residual add and the next norm), the device side's hot experts; bytes:
                the experts the routing loaded
    dense       every packed dense matrix's product (attention's projections, shared and dense MLPs, the lm_head);
                bytes: each matrix once a call
    attention   the step's attend (the cache's append and the attention kernel), MLA's and the Gated DeltaNet's
                cores; bytes: the KV cache read, every position's keys and values once a token
    attention block
                the host's joined call for a decode token's attention half (host/blocks.py: q, k, v and o
                projections, qk-norm, RoPE, the attention, the residual add and norm, the router); bytes: its four
                matrices and the keys and values it reads (not counted again under attention)
    norms, router, sampling
                the backend's norms, RoPE, activations and top-k, the routers' products, the sampler
    overhead    the decode wall less the parts and less the wrappers' own cost (measured): the Python between the
                calls, given per token and per layer

Only the host backend is split: a GPU's calls return before their work is done, so wall times of calls would not
say where its time goes.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import numpy as np

from ..host.blocks import HostMoeBlock
from ..host.packed import PackedMatrix, RowExactMatrix
from ..model import decoder as decoder_module
from ..model.sampling import Sampler
from ..model.step import EagerStep

PARTS = ("experts", "dense", "attention", "attention block", "norms, router, sampling")
NORM_CALLS = ("rms_norm", "add_rms_norm", "norm_rope", "apply_rope", "apply_rope_interleaved", "sigmoid", "route")
ATTENTION_CALLS = ("mla_attention", "mla_attention_absorbed")


class PartTimer:
    """Wrappers that add a call's own time (less the wrapped calls nested in it) and bytes to its part."""

    def __init__(self):
        self.ns: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls = 0
        self.kv_in_blocks = 0  # the keys and values the attention blocks read (block_bytes)
        self._nested = [0]  # per open call: the time of the wrapped calls inside it

    def reset(self) -> None:
        self.ns.clear()
        self.bytes.clear()
        self.calls = 0
        self.kv_in_blocks = 0

    def block_bytes(self, args) -> int:
        """EagerStep.attention_block's bytes (step, layer, block, ...): the block's matrices and the keys and values
        it reads, where the pass is the one row it takes; the keys' and values' kept apart (kv_in_blocks)."""
        step, block = args[0], args[2]
        if step.batch.rows != 1:
            return 0
        kv = (step.batch.seqs[0][1].length + 1) * block.kv_row_bytes
        self.kv_in_blocks += kv
        return block.matrix_bytes + kv

    def wrap(self, part: str, fn, nbytes=None):
        """fn timed into ``part``; ``nbytes(args)``: the bytes one call reads."""
        nested, clock = self._nested, time.perf_counter_ns

        def timed(*args, **kwargs):
            nested.append(0)
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                took = clock() - t
                self.ns[part] += took - nested.pop()
                nested[-1] += took
                self.calls += 1
                if nbytes is not None:
                    self.bytes[part] += nbytes(args)
        return timed

    def wrapper_ns(self, calls: int = 20000) -> float:
        """One wrapped call's own cost beyond the call, measured here: what the overhead figure is corrected by."""
        def nothing():
            return None
        wrapped = PartTimer().wrap("x", nothing, lambda args: 0)
        best = []
        for f in (nothing, wrapped):
            t = time.perf_counter_ns()
            for _ in range(calls):
                f()
            best.append(time.perf_counter_ns() - t)
        return max(0.0, (best[1] - best[0]) / calls)


@contextlib.contextmanager
def wrapped(timer: PartTimer, decoder):
    """The decoder's parts wrapped into ``timer`` while inside (classes and the backend's, pool's and device
    experts' instances), restored after."""
    patched: list[tuple[object, str, object, bool]] = []  # (owner, name, original, was the owner's own attribute)

    def patch(owner, name: str, part: str, nbytes=None):
        own = name in vars(owner)
        original = getattr(owner, name)
        patched.append((owner, name, vars(owner)[name] if own else original, own))
        setattr(owner, name, timer.wrap(part, original, nbytes))

    b = decoder.backend
    patch(PackedMatrix, "matmul_t", "dense", lambda args: args[0].nbytes)
    patch(RowExactMatrix, "matmul_t", "norms, router, sampling")
    patch(Sampler, "choose", "norms, router, sampling")
    for name in NORM_CALLS:
        patch(b, name, "norms, router, sampling")
    for name in ATTENTION_CALLS:
        patch(b, name, "attention")
    patch(EagerStep, "attend", "attention")
    patch(EagerStep, "attention_block", "attention block", timer.block_bytes)
    patch(decoder_module.linear_attention, "layer", "attention")
    patch(decoder.pool, "submit", "experts")
    patch(decoder.pool, "collect", "experts")
    patch(HostMoeBlock, "__call__", "experts")
    if hasattr(decoder.device_experts, "run"):
        patch(decoder.device_experts, "run", "experts")
    try:
        yield timer
    finally:
        for owner, name, original, own in reversed(patched):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)


def measure(eng, prompt: list[int], tokens: int) -> dict | None:
    """The step split of ``tokens`` greedy decode steps after ``prompt`` on ``eng`` (an open Engine): per token,
    each part's microseconds, MB and GB/s, and the overhead per token and per layer; None on a GPU."""
    d = eng.decoder
    if d.backend.gpu:
        return None
    timer = PartTimer()
    marks: list[int] = []
    stats = d.stats
    loads: list[tuple[int, int]] = []

    def on_token(_token: int) -> None:
        marks.append(time.perf_counter_ns())
        if len(marks) == 1:  # the prompt's step is done: the decode steps are counted from here
            timer.reset()
            loads.append((stats.cpu_expert_loads, stats.device_expert_loads))

    with wrapped(timer, d):
        eng.generate_full(prompt, max_new_tokens=tokens + 1, stop_at_eos=False, on_token=on_token)
    steps = len(marks) - 1
    if steps < 1:
        return None
    wall_ns = (marks[-1] - marks[0]) / steps
    cpu_loads, dev_loads = stats.cpu_expert_loads - loads[0][0], stats.device_expert_loads - loads[0][1]
    timer.bytes["experts"] = cpu_loads * eng.cpu_expert_bytes() + dev_loads * eng.device_expert_bytes()
    cfg = eng.model_config
    contexts = np.arange(len(prompt) + 1, len(prompt) + 1 + steps)  # the keys each decode step reads
    timer.bytes["attention"] = int(contexts.sum()) * cfg.kv_bytes_per_token - timer.kv_in_blocks
    parts = {}
    for part in PARTS:
        us = timer.ns[part] / steps / 1e3
        mb = timer.bytes.get(part, 0) / steps / 1e6
        parts[part] = {"us": us, "share": us * 1e3 / wall_ns,
                       "mb": mb if part != PARTS[-1] else None,
                       "gb_per_s": mb / us * 1e3 if us and mb else None}  # MB/us = 1000 GB/s
    wrappers_us = timer.calls / steps * timer.wrapper_ns() / 1e3
    overhead_us = wall_ns / 1e3 - sum(p["us"] for p in parts.values()) - wrappers_us
    return {"tokens": steps, "step_us": wall_ns / 1e3, "parts": parts,
            "calls_per_token": timer.calls / steps, "wrappers_us": wrappers_us,
            "overhead_us": overhead_us, "layers": cfg.num_layers, "overhead_per_layer_us": overhead_us / cfg.num_layers}


def with_roofline(split: dict | None, stream_gb_per_s: float | None) -> dict | None:
    """The split with each part's share of the measured read bandwidth (the STREAM column: ``roofline``)."""
    if split is None:
        return None
    for p in split["parts"].values():
        p["of_roofline"] = p["gb_per_s"] / stream_gb_per_s if p["gb_per_s"] and stream_gb_per_s else None
    return {**split, "stream_gb_per_s": stream_gb_per_s}


def markdown(mode: str, split: dict | None) -> list[str]:
    """The split of one mode as a table (and a line for the overhead); nothing where none was measured."""
    if split is None:
        return []
    lines = [f"{mode}: a decode step of {split['step_us']:.0f} us, split over {split['tokens']} tokens "
             f"({split['calls_per_token']:.0f} timed calls a token):", "",
             "| part | us a token | share | MB a token | GB/s | of the roofline |", "|---|---|---|---|---|---|"]

    def f(v, spec):
        return "-" if v is None else format(v, spec)
    for name, p in split["parts"].items():
        lines.append(f"| {name} | {p['us']:.0f} | {p['share']:.1%} | {f(p['mb'], '.1f')} | {f(p['gb_per_s'], '.1f')} "
                     f"| {f(p.get('of_roofline'), '.0%')} |")
    lines.append(f"| overhead between them | {split['overhead_us']:.0f} | {split['overhead_us'] / split['step_us']:.1%} "
                 f"| - | - | - |")
    lines += ["", f"{mode}: per-layer overhead {split['overhead_per_layer_us']:.1f} us over {split['layers']} layers "
              f"(the step less its parts and the timers' own {split['wrappers_us']:.0f} us)", ""]
    return lines
