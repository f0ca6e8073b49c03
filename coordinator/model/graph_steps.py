"""Graph-ready decode steps: a GPU decode step the host queues without waiting on the device until its logits.

Eager, each MoE layer downloads the router's choice, sorts out the pool's pairs on the host, posts them and waits
in Python for the nodes (a synchronisation a layer, docs/gpu.md). Here the layer stays on the device's stream:

    router kernel -> split_pairs (coordinator/device/compact.py: CPU and device pairs, the routing counters)
    -> copies of x and the CPU pairs into the pool segment -> host function ring (shm/pool_signal.py)
    -> the hot experts, the shared experts -> host function wait -> copies of the partials -> sum_partials

so the host's Python runs ahead, queueing the whole step, and waits once, on the logits (with the routing
counters, copied beside them). Every allocation of the step comes from its batch bucket's buffer
(coordinator/device/arena.py), so the step's arrays have the same addresses each step; what crosses between host
and device goes through fixed places too: the tables and the embedding rows from page-locked staging into fixed
device rows, RoPE's rows gathered on the device from a table of the context's positions, the logits into
page-locked rows. So two steps of a bucket queue the same launches and copies (tests/test_graph_steps.py records
them), what a captured CUDA graph needs to replay them.

A step is graph-ready where the pool can be driven from the stream (the process pool) and its rows fit the
largest bucket and the pool's request; otherwise it runs eagerly. Hot experts run on the stream between the
ring and the wait, their slots ordered on the device (DeviceExperts.run_split). A worker that dies or hangs inside one voids it: the pool recovers it, the
caches forget the step's positions and the step is redone eagerly, so no request is lost.
"""

from __future__ import annotations

import time

import numpy as np

from ..device import compact
from ..device.arena import StepArena
from ..device.format_kernels import address
from ..pool.stream import StreamInterrupted
from . import device_ops
from . import xp as xp_module

MAX_ROWS = 64  # the largest bucket: a step of more rows (a prefill chunk) is eager


class StepTables:
    """Where each row of a step reads and writes in the KV caches, uploaded once a step into one device buffer
    whose views the attention kernels take (device_ops.kv_store, gqa_attention_cached); int64 throughout, every
    part at a fixed place for up to MAX_ROWS rows and sequences::

        k_ptrs [L, MAX_ROWS] | v_ptrs [L, MAX_ROWS]   each sequence's cache buffers, per layer (addresses)
        row_seq, row_pos [MAX_ROWS]                    each row's sequence and position
        last_seq, last_pos [MAX_ROWS]                  each sequence's last row's (the last layer's queries)
        seq_len [MAX_ROWS]                             each sequence's keys once the step is cached
        chunk, last_chunk [MAX_ROWS]                   MLA: each sequence's keys a chunk (device_ops.mla_splits of
                                                       its eager call: every row's queries, or its last row's)
    """

    def __init__(self, layers: int, xp):
        self.xp = xp
        M = MAX_ROWS
        self.host = xp_module.pinned(2 * layers * M + 7 * M, np.int64)
        self.device = xp.zeros(self.host.shape, np.int64)
        views = {}
        for name, width, host in (("k_ptrs", layers, True), ("v_ptrs", layers, True), ("row_seq", 1, False),
                                  ("row_pos", 1, False), ("last_seq", 1, False), ("last_pos", 1, False),
                                  ("seq_len", 1, False), ("chunk", 1, False), ("last_chunk", 1, False)):
            at = sum(v[1] for v in views.values())
            views[name] = (at, width * M, width, host)
        self._views = views
        self.score_stride = 0  # the longest cache's capacity this step (the context): the scores' row length
        self._known: dict = {}  # id(cache) -> _addresses' entry, the last step's caches

    def _addresses(self, cache) -> tuple:
        """(cache, its moves, keys' [L] and values' [L] buffer addresses): the last step's where its buffers have
        not moved since, so a step does not read L addresses a sequence again."""
        kept = self._known.get(id(cache))
        if kept is not None and kept[0] is cache and kept[1] == cache.moves:
            return kept
        pairs = [cache.buffers(layer) for layer in range(self._part(self.host, "k_ptrs").shape[0])]
        return (cache, cache.moves, np.array([address(k) for k, _ in pairs], np.int64),
                np.array([address(v) for _, v in pairs], np.int64))

    def _part(self, array, name: str):
        at, size, width, per_layer = self._views[name]
        part = array[at:at + size]
        return part.reshape(width, MAX_ROWS) if per_layer else part

    def fill(self, seqs, chunks=None) -> None:
        """The step's sequences [(ids, cache)] into the host table, then one upload. ``chunks``: MLA's (chunk,
        last_chunk) of each sequence, or None."""
        k_ptrs, v_ptrs = self._part(self.host, "k_ptrs"), self._part(self.host, "v_ptrs")
        seen = {}
        for s, (_, cache) in enumerate(seqs):
            entry = seen[id(cache)] = self._addresses(cache)
            k_ptrs[:, s], v_ptrs[:, s] = entry[2], entry[3]
        self._known = seen  # this step's caches only: one gone from the batch is forgotten
        lengths = np.array([len(ids) for ids, _ in seqs])
        starts = np.array([cache.length for _, cache in seqs])
        N, B = int(lengths.sum()), len(seqs)
        self._part(self.host, "row_seq")[:N] = np.repeat(np.arange(B), lengths)
        self._part(self.host, "row_pos")[:N] = np.concatenate([np.arange(a, a + n) for a, n in zip(starts, lengths)])
        self._part(self.host, "last_seq")[:B] = np.arange(B)
        self._part(self.host, "last_pos")[:B] = starts + lengths - 1
        self._part(self.host, "seq_len")[:B] = starts + lengths
        if chunks is not None:
            self._part(self.host, "chunk")[:B], self._part(self.host, "last_chunk")[:B] = np.array(chunks).T
        self.score_stride = max(cache.capacity for _, cache in seqs)
        self.device.set(self.host, stream=self.xp.cuda.get_current_stream())

    def layer(self, layer: int, last_rows: bool):
        """Layer ``layer``'s views: (k_ptrs, v_ptrs, row_seq, row_pos, q_seq, q_pos, seq_len), the queries every
        row's or, with ``last_rows``, each sequence's last row's."""
        d = self.device
        q = ("last_seq", "last_pos") if last_rows else ("row_seq", "row_pos")
        return (self._part(d, "k_ptrs")[layer], self._part(d, "v_ptrs")[layer], self._part(d, "row_seq"),
                self._part(d, "row_pos"), self._part(d, q[0]), self._part(d, q[1]), self._part(d, "seq_len"))

    def row_positions(self, rows: int):
        """The step's first ``rows`` rows' positions [rows] on the device (a view of the upload)."""
        return self._part(self.device, "row_pos")[:rows]

    def chunks(self, last_rows: bool):
        """MLA's chunks [MAX_ROWS] on the device: for every row's queries or, with ``last_rows``, the last rows'."""
        return self._part(self.device, "last_chunk" if last_rows else "chunk")


class GraphSteps:
    def __init__(self, cfg, on_device: dict[int, np.ndarray], device_experts, link, xp, context: int, rope,
                 embed_dtype):
        """``on_device``: layer -> [E] bool, the experts kept on the device, ``device_experts`` their DeviceExperts;
        ``link``: the pool's StreamLink; ``context``: the longest a sequence may be (EngineConfig.max_seq_len or the
        model's), what every cache of a graph-ready step is reserved to; ``rope``: (cos, sin) [context, d] on the
        device, every position's RoPE rows (Decoder._rope_tables' bits), which a step gathers its rows' from;
        ``embed_dtype``: the host embedding's, which the step's rows are staged in."""
        self.cfg, self.link, self.xp, self.context = cfg, link, xp, context
        self.rope_table = rope
        # the step's host inputs and outputs at fixed places: page-locked staging, fixed device rows (module docstring)
        self.embed_host = xp_module.pinned((MAX_ROWS, cfg.hidden_size), embed_dtype)  # [MAX_ROWS, H]
        self.embed_device = xp.zeros((MAX_ROWS, cfg.hidden_size), embed_dtype)  # [MAX_ROWS, H]
        self.logits_host = xp_module.pinned((MAX_ROWS, cfg.vocab_size), np.float32)  # [MAX_ROWS, V]
        self.device_experts = device_experts
        self.has_device = {i: bool(on_device[i].any()) for i in cfg.moe_layers}
        self.slots = {layer: s for s, layer in enumerate(cfg.moe_layers)}  # MoE layer -> its row in the tables
        E = cfg.num_experts
        self.on_device = {i: xp.asarray(on_device[i].astype(np.uint8)) for i in cfg.moe_layers}  # [E] each
        self.counts = xp.zeros((max(len(self.slots), 1), E), np.int64)  # [moe layers, E] chosen per expert
        self.totals = xp.zeros(compact.TOTALS, np.int64)  # compact.TOTALS' counters
        self.counts_host = xp_module.pinned(self.counts.shape, np.int64)
        self.totals_host = xp_module.pinned(compact.TOTALS, np.int64)
        self.arena = StepArena(xp)
        self.tables = StepTables(cfg.num_layers, xp)
        self.mla_cached = (False, False)  # MLA read from the caches on the device: (every row's queries, last rows')
        self.steps = 0  # steps run graph-ready
        self.redone = 0  # of them, redone eagerly after a worker died or hung
        self.host_ns = 0  # the host's time queueing the steps (from a step's start to its logits' download)
        self.wall_ns = 0  # the steps' whole time, the wait on the device included
        self.queued_at = 0  # perf_counter_ns when the current step's queueing ended

    def takes(self, rows: int) -> bool:
        return rows <= MAX_ROWS and self.link.fits(rows, self.cfg.top_k)

    def begin(self, seqs, absorbed=None) -> None:
        """Before the step is queued: the caches reserved to the context once (so their buffers never move again
        and the attention's scores' rows are the context long every step: what a captured graph replays), and
        where each row reads and writes them. ``absorbed(T, S)``: whether MLA's eager call of T queries over S keys
        takes the absorbed form (Decoder._absorbed); the cached MLA attention runs where every sequence's does."""
        for ids, cache in seqs:  # a sequence past the context (refused before it gets here) would still fit
            cache.reserve(max(self.context, cache.length + len(ids)), exact=True)
        m, chunks = self.cfg.mla, None
        if m is not None and absorbed is not None:
            nh, c, dr = self.cfg.num_heads, m.kv_lora_rank, m.qk_rope_head_dim
            sizes = [(len(ids), cache.length + len(ids)) for ids, cache in seqs]  # (rows, keys once cached)
            chunks = [(device_ops.mla_splits(n, nh, S, c, dr)[1], device_ops.mla_splits(1, nh, S, c, dr)[1])
                      for n, S in sizes]
            self.mla_cached = (all(absorbed(n, S) for n, S in sizes), all(absorbed(1, S) for _, S in sizes))
        self.tables.fill(seqs, chunks)

    def embed(self, embed, ids: np.ndarray):
        """The step's rows of the host embedding [N, H] on the device: gathered into the page-locked staging rows,
        copied into the fixed device rows (a copy from and to the same places every step)."""
        N = ids.shape[0]
        np.take(embed, ids, axis=0, out=self.embed_host[:N])
        self.embed_device[:N].set(self.embed_host[:N], stream=self.xp.cuda.get_current_stream())
        return self.embed_device[:N]

    def rope(self, rows: int):
        """cos, sin [rows, d]: the step's rows' positions (the tables' row_pos, on the device) gathered from the
        context's table, no upload."""
        positions = self.tables.row_positions(rows)
        return self.rope_table[0][positions], self.rope_table[1][positions]

    def logits(self, logits) -> np.ndarray:
        """The step's logits [R, V] on the host: downloaded into the page-locked rows, then the step's one wait."""
        R = logits.shape[0]
        stream = self.xp.cuda.get_current_stream()
        logits.get(stream=stream, out=self.logits_host[:R], blocking=False)
        stream.synchronize()
        return self.logits_host[:R].copy()  # the rows outlive the step; the next one overwrites the staging

    def moe(self, decoder, i: int, lw, x):
        """Layer i's MoE output [T, H] for x [T, H], queued on the stream (module docstring)."""
        slot = self.slots[i]
        packed = decoder.route_packed(x @ lw.router.T, lw.router_bias)  # [T, 2k]
        split = compact.split_pairs(packed, self.cfg.top_k, self.on_device[i], decoder.route_tail_skip,
                                    self.counts[slot], self.totals)
        self.link.post(slot, i, x, split)  # the CPU work first ...
        y_dev = self.device_experts.run_split(i, x, split) if self.has_device[i] else None  # ... ours meanwhile
        y_shared = decoder.shared_output(lw, x)
        self.link.wait(slot)
        return compact.sum_partials(self.link.partials(x.shape[0]), y_dev, y_shared)

    def queue_counters(self) -> None:
        """Before the step's one synchronisation: the routing counters copied to the host, then zeroed."""
        self.queued_at = time.perf_counter_ns()
        stream = self.xp.cuda.get_current_stream()
        self.counts.get(stream=stream, out=self.counts_host, blocking=False)
        self.totals.get(stream=stream, out=self.totals_host, blocking=False)
        self.counts.fill(0)
        self.totals.fill(0)

    def drop_counters(self) -> None:
        """A step that stopped half-way: its routing is not counted."""
        self.counts.fill(0)
        self.totals.fill(0)

    def fold_counters(self, stats, waited_ns: int) -> None:
        """After it: the step's routing into the decoder's RoutingStats, as the eager path counts it."""
        for layer, slot in self.slots.items():
            if layer >= self.cfg.num_layers:  # the MTP layer: never in these steps (Decoder.forward_mtp is eager)
                continue
            per = stats.per_layer_expert.setdefault(layer, np.zeros(self.cfg.num_experts, np.int64))
            per += self.counts_host[slot]
        t = self.totals_host
        stats.routed_pairs += int(t[compact.ROUTED])
        stats.skipped_pairs += int(t[compact.SKIPPED])
        stats.cpu_pairs += int(t[compact.CPU_PAIRS])
        stats.cpu_expert_loads += int(t[compact.CPU_EXPERTS])
        stats.device_pairs += int(t[compact.DEVICE_PAIRS])
        stats.device_expert_loads += int(t[compact.DEVICE_EXPERTS])
        stats.count_pool_wait(waited_ns)


__all__ = ["GraphSteps", "MAX_ROWS", "StreamInterrupted"]
