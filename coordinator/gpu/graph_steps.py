"""Graph-ready decode steps: a GPU decode step the host queues without waiting on the device until its logits.

Eager, each MoE layer downloads the router's choice, sorts out the pool's pairs on the host, posts them and waits
in Python for the nodes (a synchronisation a layer, docs/gpu.md). Here the layer stays on the device's stream:

    router kernel -> split_pairs (compact.py: CPU and device pairs, the routing counters)
    -> copies of x and the CPU pairs into the pool segment -> host function ring (shm/pool_signal.py)
    -> the hot experts, the shared experts -> host function wait -> copies of the partials -> sum_partials

so the host's Python runs ahead, queueing the whole step, and waits once, on the logits (with the routing
counters, copied beside them). Every allocation of the step comes from its batch bucket's buffer
(arena.py), so the step's arrays have the same addresses each step; what crosses between host
and device goes through fixed places too: the tables and the embedding rows from page-locked staging into fixed
device rows, RoPE's rows gathered on the device from a table of the context's positions, the logits into
page-locked rows. So two steps of a shape queue the same launches and copies (tests/test_graph_steps.py records
them): a shape's second step is captured as a CUDA graph and every later one launches it (GraphSteps.queue), the
host writing only the tables, the staged embedding rows and the pool's rows before the launch.

GraphSteps is the runner around the network's one forward (model/decoder.py's Decoder.forward, unchanged), as
vLLM's CudaGraphManager and nano-vllm's run_model wrap theirs: it hands the forward a StreamedStep, which takes the
step's inputs from the fixed places, stores keys and values and attends through the tables on the device
(ops.kv_store, gqa_attention_cached, mla_attention_absorbed_cached), drives the pool from the stream and queues
the logits' download, where the eager step (model/step.py) does each from the host.

A step is graph-ready where the pool can be driven from the stream (the process pool) and its rows fit the
largest bucket and the pool's request; otherwise it runs eagerly. Hot experts run on the stream between the
ring and the wait, their slots ordered on the device (DeviceExperts.run_split). A worker that dies or hangs
inside one voids it: the pool recovers it, the caches never took the step's positions, the shape's graph is
dropped and the step is redone eagerly, so no request is lost.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

import numpy as np

from ..model.ops import MlaRows
from ..model.routing import RoutingTotals
from ..model.step import EagerStep, StepBatch, StepOutput
from . import compact
from . import ops as device_ops
from . import transfer as xp_module
from .arena import ArenaFull, StepArena
from .format_kernels import address
from .stream import StreamInterrupted

MAX_ROWS = 64  # the largest bucket: a step of more rows (a prefill chunk) is eager

log = logging.getLogger(__name__)


@dataclass
class Captured:
    """A step's shape captured as a CUDA graph."""

    graph: object  # cupy.cuda.graph.Graph
    result: tuple  # what the capture's queue_step returned: views of the page-locked logits, the hidden rows'
    posts: list  # the pool link's host rows the graph's host functions read (StreamLink.restore)
    generation: int  # the arena bucket's buffer the graph's arrays are in (StepArena.generation)


class StepTables:
    """Where each row of a step reads and writes in the KV caches, uploaded once a step into one device buffer
    whose views the attention kernels take (device_ops.kv_store, gqa_attention_cached); int64 throughout, every
    part at a fixed place for up to MAX_ROWS rows and sequences::

        k_ptrs [L, MAX_ROWS] | v_ptrs [L, MAX_ROWS]   each sequence's cache buffers, per layer (addresses)
        row_seq, row_pos [MAX_ROWS]                    each row's sequence and position
        last_seq, last_pos [MAX_ROWS]                  each sequence's last row's (the last layer's queries)
        last_row [MAX_ROWS]                            each sequence's last row in the step (last_row_ids)
        wanted_row [MAX_ROWS]                          the rows lm_head takes: every row of the sequences in
                                                       all_rows, the last of the others (a gather, where eager
                                                       steps concatenate one slice a sequence)
        seq_len [MAX_ROWS]                             each sequence's keys once the step is cached
        chunk [MAX_ROWS]                               MLA: each row's keys a chunk (device_ops.mla_splits of its
                                                       eager call: its sequence's rows', or with batch invariance
                                                       its own alone's)
        last_chunk [MAX_ROWS]                          each sequence's last row's, as a call of that row alone
    """

    def __init__(self, layers: int, xp):
        self.xp = xp
        M = MAX_ROWS
        self.host = xp_module.pinned(2 * layers * M + 9 * M, np.int64)
        self.device = xp.zeros(self.host.shape, np.int64)
        views = {}
        for name, width, host in (("k_ptrs", layers, True), ("v_ptrs", layers, True), ("row_seq", 1, False),
                                  ("row_pos", 1, False), ("last_seq", 1, False), ("last_pos", 1, False),
                                  ("last_row", 1, False), ("wanted_row", 1, False), ("seq_len", 1, False),
                                  ("chunk", 1, False),
                                  ("last_chunk", 1, False)):
            at = sum(v[1] for v in views.values())
            views[name] = (at, width * M, width, host)
        self._views = views
        self.score_stride = 0  # the longest cache's capacity this step (the context): the attention grids' keys
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

    def fill(self, seqs, chunks=None, all_rows: frozenset[int] = frozenset()) -> None:
        """The step's sequences [(ids, cache)] into the host table, then one upload. ``chunks``: MLA's (each row's
        chunk, each sequence's last row's), or None; ``all_rows``: the sequences whose every row's logits are asked
        for."""
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
        self._part(self.host, "last_row")[:B] = np.cumsum(lengths) - 1
        wanted = [np.arange(hi - (n if k in all_rows else 1), hi) for k, (hi, n) in enumerate(zip(np.cumsum(lengths),
                                                                                                 lengths))]
        self._part(self.host, "wanted_row")[:sum(len(w) for w in wanted)] = np.concatenate(wanted)
        self._part(self.host, "seq_len")[:B] = starts + lengths
        if chunks is not None:
            self._part(self.host, "chunk")[:N], self._part(self.host, "last_chunk")[:B] = chunks
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

    def last_rows(self, sequences: int):
        """Each of the step's sequences' last row [sequences] on the device (a view of the upload)."""
        return self._part(self.device, "last_row")[:sequences]

    def wanted_rows(self, rows: int):
        """The rows lm_head takes [rows] on the device (a view of the upload)."""
        return self._part(self.device, "wanted_row")[:rows]

    def chunks(self, last_rows: bool):
        """MLA's chunks [MAX_ROWS] on the device: for every row's queries or, with ``last_rows``, the last rows'."""
        return self._part(self.device, "last_chunk" if last_rows else "chunk")


class GraphSteps:
    def __init__(self, decoder, link, context: int, capture: bool = True, step_buffer: int = 0, stream=None):
        """The runner of ``decoder``'s small steps (GpuBackend.graph_runner makes it): ``link``: the pool's
        StreamLink; ``context``: the longest a sequence may be (EngineConfig.max_seq_len or the model's), what
        every cache of a graph-ready step is reserved to; ``capture``: each shape's steps replayed as a CUDA graph
        from its second step (else queued launch by launch); ``step_buffer``: the bytes of the steps' buffer
        (arena.py); ``stream``: the steps' own (a capture needs one)."""
        cfg, xp = decoder.cfg, decoder.xp
        self.decoder, self.cfg, self.link, self.xp, self.context = decoder, cfg, link, xp, context
        # every position's RoPE rows (Decoder.rope_tables' bits), which a step gathers its rows' from
        self.rope_table = decoder.rope_tables(np.arange(context))  # cos, sin [context, d] on the device
        # the step's host inputs and outputs at fixed places: page-locked staging, fixed device rows (module docstring)
        embed_dtype = decoder.w.embed.dtype
        self.embed_host = xp_module.pinned((MAX_ROWS, cfg.hidden_size), embed_dtype)  # [MAX_ROWS, H]
        self.embed_device = xp.zeros((MAX_ROWS, cfg.hidden_size), embed_dtype)  # [MAX_ROWS, H]
        self.logits_host = xp_module.pinned((MAX_ROWS, cfg.vocab_size), np.float32)  # [MAX_ROWS, V]
        self.device_experts = decoder.device_experts
        self.has_device = {i: bool(decoder.on_device[i].any()) for i in cfg.moe_layers}
        self.slots = {layer: s for s, layer in enumerate(cfg.moe_layers)}  # MoE layer -> its row in the tables
        E = cfg.num_experts
        self.on_device = {i: xp.asarray(decoder.on_device[i].astype(np.uint8)) for i in cfg.moe_layers}  # [E] each
        self.counts = xp.zeros((max(len(self.slots), 1), E), np.int64)  # [moe layers, E] chosen per expert
        self.totals = xp.zeros(compact.TOTALS, np.int64)  # compact.TOTALS' counters
        self.counts_host = xp_module.pinned(self.counts.shape, np.int64)
        self.totals_host = xp_module.pinned(compact.TOTALS, np.int64)
        self.arena = StepArena(xp, step_buffer)  # the steps' one buffer, made now for the plan's largest step
        self.tables = StepTables(cfg.num_layers, xp)
        self.mla_cached = (False, False)  # MLA read from the caches on the device: (every row's queries, last rows')
        self.steps = 0  # steps run graph-ready
        self.redone = 0  # of them, redone eagerly after a worker died or hung
        self.host_ns = 0  # the host's time queueing the steps (from a step's start to its logits' download)
        self.wall_ns = 0  # the steps' whole time, the wait on the device included
        self.queued_at = 0  # perf_counter_ns when the current step's queueing ended
        # the stream the steps run on: a capture needs one of its own; it waits for the default stream's work and
        # that waits for it (a blocking stream), so eager steps and MTP passes need no events around it
        self.stream = stream or xp.cuda.Stream()
        self.capture = capture
        self.captured: dict[tuple, Captured] = {}  # a step's shape (key) -> its graph
        self.sized: dict[tuple, int] = {}  # shape -> the bucket's buffer generation it last ran inside
        self.failed: set[tuple] = set()  # shapes the driver would not capture
        self.captures = 0  # graphs captured
        self.replays = 0  # steps run by launching a graph

    def takes(self, rows: int) -> bool:
        return rows <= MAX_ROWS and self.link.fits(rows, self.cfg.top_k)

    def forward(self, batch: StepBatch) -> StepOutput:
        """The decoder's forward of ``batch``: graph-ready where it takes the rows, else the eager forward."""
        if not self.takes(batch.rows):
            return self.decoder.forward(batch)
        return self.run(batch)

    def run(self, batch: StepBatch) -> StepOutput:
        """The forward on the stream: the host's part (tables, embedding rows, the pool's state), then the step
        queued, captured or replayed as a graph (queue), one wait, then the caches advanced. A step a worker's
        death voided is redone eagerly."""
        decoder, link = self.decoder, self.link
        t0 = time.perf_counter_ns()

        def queue_step():
            out = decoder.forward(batch, StreamedStep(self, decoder, batch))
            return out.logits, out.hidden

        with self.stream:  # the caches' reserve, the tables and the step, in this order on one stream
            self.begin(batch.seqs, decoder.absorbed if self.cfg.mla is not None else None, batch.all_rows)
            self.stage(decoder.w.embed, batch.ids)
            link.begin_step(batch.rows)
            key = batch.key() + (self.mla_cached,)  # begin has run: the MLA form is part of the shape
            try:
                logits, hidden = self.queue(key, batch.rows, queue_step)
                if hidden is not None:  # the hidden rows outlive the step: copied out of its buffer before the wait
                    hidden = [r.copy() for r in hidden]
                self.queued_at = time.perf_counter_ns()
                self.wait()
                out = [rows_.copy() for rows_ in logits]  # the page-locked rows: the next step overwrites them
            except BaseException:  # the queued work finishes before the pool is touched again; nothing is cached
                self.stream.synchronize()
                self.drop_counters()
                self.forget(key)  # a graph of a failed step is not replayed: its shape is queued, then captured anew
                with contextlib.suppress(Exception):  # the pool recovers from what the stream met; the first raises
                    link.end_step(batch.rows)
                raise
        try:
            waited = link.end_step(batch.rows)
        except BaseException as e:  # the pool met an error or a fault inside the step: nothing is cached
            self.forget(key)
            if not isinstance(e, StreamInterrupted):
                raise
            log.warning("%s; the step is redone eagerly", e)
            self.redone += 1
            return decoder.forward(batch)
        for ids, cache in batch.seqs:  # the step's keys and values are in place: the caches take them
            cache.advance(len(ids))
        self.steps += 1
        self.host_ns += self.queued_at - t0
        self.wall_ns += time.perf_counter_ns() - t0
        self.fold_counters(decoder.stats, waited)
        return StepOutput(out, hidden)

    def begin(self, seqs, absorbed=None, all_rows: frozenset[int] = frozenset()) -> None:
        """Before the step is queued: the caches reserved to the context once (so their buffers never move again
        and the attention's scores' rows are the context long every step: what a captured graph replays), and
        where each row reads and writes them. ``absorbed(T, S)``: whether MLA's eager call of T queries over S keys
        takes the absorbed form (Decoder.absorbed); the cached MLA attention runs where every sequence's does."""
        for ids, cache in seqs:  # a sequence past the context (refused before it gets here) would still fit
            cache.reserve(max(self.context, cache.length + len(ids)), exact=True)
        m, chunks = self.cfg.mla, None
        if m is not None and absorbed is not None:
            nh, c, dr = self.cfg.num_heads, m.kv_lora_rank, m.qk_rope_head_dim
            sizes = [(len(ids), cache.length + len(ids)) for ids, cache in seqs]  # (rows, keys once cached)

            def row_chunks(n: int, S: int) -> list[int]:
                """A sequence's rows' chunks: its rows' eager call's, or each row's alone over its own keys."""
                if self.decoder.invariant:
                    return [device_ops.mla_splits(1, nh, S - n + 1 + j, c, dr)[1] for j in range(n)]
                return [device_ops.mla_splits(n, nh, S, c, dr)[1]] * n
            chunks = ([k for n, S in sizes for k in row_chunks(n, S)],
                      [device_ops.mla_splits(1, nh, S, c, dr)[1] for _, S in sizes])
            self.mla_cached = (all(absorbed(n, S) for n, S in sizes), all(absorbed(1, S) for _, S in sizes))
        self.tables.fill(seqs, chunks, all_rows)

    def stage(self, embed, ids: np.ndarray) -> None:
        """The step's rows of the host embedding gathered into the page-locked staging rows (host work, done every
        step before its work is queued or its graph launched)."""
        np.take(embed, ids, axis=0, out=self.embed_host[:ids.shape[0]])

    def embed(self, rows: int):
        """The staged rows [rows, H] on the device: copied into the fixed device rows (a copy from and to the same
        places every step)."""
        xp_module.copy_to_device(self.embed_device[:rows], self.embed_host[:rows], self.xp.cuda.get_current_stream())
        return self.embed_device[:rows]

    def rope(self, rows: int):
        """cos, sin [rows, d]: the step's rows' positions (the tables' row_pos, on the device) gathered from the
        context's table, no upload."""
        positions = self.tables.row_positions(rows)
        return self.rope_table[0][positions], self.rope_table[1][positions]

    def logits(self, logits) -> np.ndarray:
        """The step's logits [R, V] queued for download into the page-locked rows, with the routing counters: the
        rows (valid once ``wait`` returned; the next step overwrites them)."""
        R = logits.shape[0]
        self.queue_counters()
        xp_module.copy_to_host(self.logits_host[:R], self.xp.ascontiguousarray(logits),
                               self.xp.cuda.get_current_stream())
        return self.logits_host[:R]

    def queue(self, key: tuple, rows: int, queue_step):
        """The step's work on the stream: the graph captured for ``key`` launched where there is one whose
        addresses are the bucket's buffer's; else ``queue_step()`` queued (inside the bucket's arena) and, on the
        second step of a shape, captured into a graph first. Returns what queue_step returned (for a launch, what
        it returned when captured: views of the same places)."""
        generation = self.arena.generation(rows)
        entry = self.captured.get(key)
        if entry is not None and entry.generation == generation:
            self.link.restore(entry.posts)
            entry.graph.launch(stream=self.stream)
            self.replays += 1
            return entry.result
        if self.capture and self.sized.get(key) == generation and key not in self.failed:
            captured = self._capture(key, rows, queue_step, generation)
            if captured is not None:
                return captured
        with self.arena.step(rows, key):
            result = queue_step()
        self.sized[key] = self.arena.generation(rows)  # a shape queued within its bucket's buffer: captured next
        return result

    def _capture(self, key: tuple, rows: int, queue_step, generation: int):
        """Capture the step into a graph and launch it; None (nothing queued) where the capture failed or needed
        memory beyond the bucket's buffer (the caller queues the step as it is)."""
        self.link.posts.clear()
        self.stream.begin_capture()
        try:
            with self.arena.step(rows, key, capturing=True):
                result = queue_step()
            graph = self.stream.end_capture()
        except ArenaFull:  # the shape needs a larger buffer: queued (and the buffer grown) first, captured after
            with contextlib.suppress(Exception):
                self.stream.end_capture()
            self.sized.pop(key, None)
            return None
        except Exception as e:  # the driver refused something the step queued: that shape stays uncaptured
            with contextlib.suppress(Exception):  # the stream leaves capture; what was captured is dropped
                self.stream.end_capture()
            log.warning("decode step of shape %s not captured as a CUDA graph (%s: %s): it is queued each step",
                        key, type(e).__name__, e)
            self.failed.add(key)
            return None
        except BaseException:  # an interrupt: the stream leaves capture, the step goes no further
            with contextlib.suppress(Exception):
                self.stream.end_capture()
            raise
        self.captured[key] = Captured(graph, result, list(self.link.posts), generation)
        graph.launch(stream=self.stream)
        self.captures += 1
        return result

    def forget(self, key: tuple) -> None:
        """Drop ``key``'s graph and sizing (its step failed)."""
        self.captured.pop(key, None)
        self.sized.pop(key, None)

    def wait(self) -> None:
        """The step's one synchronisation: its logits and counters are on the host after it."""
        self.stream.synchronize()

    def moe(self, i: int, lw, x):
        """Layer i's MoE output [T, H] for x [T, H], queued on the stream (module docstring)."""
        slot, decoder = self.slots[i], self.decoder
        packed = decoder.backend.route_packed(x @ lw.router.T, lw.router_bias, decoder.router)  # [T, 2k]
        split = compact.split_pairs(packed, self.cfg.top_k, self.on_device[i], decoder.route_tail_skip,
                                    self.counts[slot], self.totals)
        self.link.post(slot, i, x, split)  # the CPU work first ...
        y_dev = self.device_experts.run_split(i, x, split) if self.has_device[i] else None  # ... ours meanwhile
        y_shared = decoder.shared_output(lw, x)
        self.link.wait(slot)
        return compact.sum_partials(self.link.partials(x.shape[0]), y_dev, y_shared)

    def queue_counters(self) -> None:
        """Before the step's one synchronisation: the routing counters copied to the host, then zeroed."""
        stream = self.xp.cuda.get_current_stream()
        xp_module.copy_to_host(self.counts_host, self.counts, stream)
        xp_module.copy_to_host(self.totals_host, self.totals, stream)
        self.counts.fill(0)
        self.totals.fill(0)

    def drop_counters(self) -> None:
        """A step that stopped half-way: its routing is not counted."""
        self.counts.fill(0)
        self.totals.fill(0)

    def fold_counters(self, stats, waited_ns: int) -> None:
        """After it: the step's routing into the decoder's RoutingStats (RoutingStats.add, as an eager layer's)."""
        t = self.totals_host  # the MTP layer is never in these steps (Decoder.forward_mtp is eager)
        stats.add({layer: self.counts_host[slot] for layer, slot in self.slots.items() if layer < self.cfg.num_layers},
                  RoutingTotals(int(t[compact.ROUTED]), int(t[compact.SKIPPED]), int(t[compact.CPU_PAIRS]),
                                int(t[compact.CPU_EXPERTS]), int(t[compact.DEVICE_PAIRS]),
                                int(t[compact.DEVICE_EXPERTS])))
        stats.count_pool_wait(waited_ns)


class StreamedStep(EagerStep):
    """A graph-ready step's side of the forward (model/step.py's EagerStep for the eager one): inputs from the fixed
    places, keys and values stored and attended through the step's tables on the device, the pool driven from the
    stream, the logits queued into page-locked rows; the caches advance once the step's work is done (run)."""

    def __init__(self, graph: GraphSteps, decoder, batch: StepBatch):
        super().__init__(decoder, batch)
        self.graph, self.tables = graph, graph.tables
        self.bf16 = decoder.kv_dtype == "bf16"

    def inputs(self):
        rows = self.batch.rows
        return self.graph.embed(rows), self.graph.rope(rows)

    def last_rows(self):
        return self.tables.last_rows(len(self.batch.seqs))

    def wanted_rows(self, a):
        return a[self.tables.wanted_rows(sum(self.batch.wanted))]  # a gather: no host table

    def logits(self, a):
        return self.graph.logits(a @ self.decoder.w.lm_head.T)  # [R, V] queued; the runner waits

    def finish(self) -> None:
        """Nothing yet: the runner advances the caches after the step's one wait."""

    def moe(self, i: int, lw, x, routed=None):
        """``routed`` is never given here: a GPU's backend has no attention blocks (Backend.attention_block)."""
        return self.graph.moe(i, lw, x)

    def attend(self, i: int, q, k, v, window: int | None, rows=None):
        """The new keys and values stored and every sequence's attention made in two launches that read the
        caches' places and lengths from the step's tables, not from arguments; the same bits as the eager form."""
        k_ptrs, v_ptrs, row_seq, row_pos, q_seq, q_pos, seq_len = self.tables.layer(i, rows is not None)
        device_ops.kv_store(k, v, k_ptrs, v_ptrs, row_seq, row_pos, self.bf16)
        cfg = self.decoder.cfg
        return device_ops.gqa_attention_cached(q, (k_ptrs, v_ptrs, q_seq, q_pos, seq_len), window,
                                               cfg.head_dim ** -0.5, cfg.num_kv_heads, self.tables.score_stride,
                                               self.bf16)  # [N or B, nh*hd]

    def attend_mla(self, i: int, lw, mla: MlaRows, rope, rows=None):
        """The absorbed form where every sequence's eager call takes it (GraphSteps.begin): latent and k_rope
        stored by one kv_store, every sequence's attention in three launches reading the caches' places, lengths
        and chunks from the step's tables; else the eager form. The same bits as the eager form."""
        if not self.graph.mla_cached[rows is not None]:
            return super().attend_mla(i, lw, mla, rope, rows)
        d, tables = self.decoder, self.tables
        cos, sin = rope
        q_rope = d.mla_rotate(mla.q_rope, *((cos, sin) if rows is None else (cos[rows], sin[rows])))  # [Nq, nh, dr]
        k_ptrs, v_ptrs, row_seq, row_pos, q_seq, q_pos, seq_len = tables.layer(i, rows is not None)
        device_ops.kv_store(mla.latent, mla.k_rope, k_ptrs, v_ptrs, row_seq, row_pos, self.bf16)
        w = lw.mla
        w_uk, w_uv = (w.w_uk, w.w_uv) if w.w_uk is not None else d.kv_b_heads(w.kv_b)
        w_uv_t = None if w_uv is None else w_uv.transpose(0, 2, 1)  # None: w_uk is the compact kv_b
        return device_ops.mla_attention_absorbed_cached(
            mla.q_nope, q_rope, (k_ptrs, v_ptrs, q_seq, q_pos, seq_len, tables.chunks(rows is not None)), w_uk, w_uv_t,
            d.cfg.mla.softmax_scale, tables.score_stride, self.bf16)  # [Nq, nh*dv]


__all__ = ["GraphSteps", "MAX_ROWS", "StreamInterrupted", "StreamedStep"]
