"""Engine: a loaded model, its expert pool, and generation."""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from node_worker import kernel_threads
from node_worker.kernels.kernel_set import compiled_cover, for_formats
from shm import formats
from shm.checkpoint import Checkpoint
from shm.expert_store import matrix_bytes
from shm.topology import Node, format_cpulist

from .config import EngineConfig
from .cpu_experts import CpuExpertSpec, build_pool, expert_format, plan_cpu_experts, pool_nodes
from .errors import ConfigValueError, StrataError
from .gpu.graph_steps import MAX_ROWS as GRAPH_ROWS
from .gpu.probe import select_device
from .gpu.vram import VramPlan
from .host.backend import HostBackend
from .host.packed import float_rows_kernels
from .model.arch import family
from .model.backend import Backend, Placement
from .model.decoder import Decoder, DecoderOptions
from .model.kv_cache import KVCache
from .model.model_config import MTP_ARCHS, ModelConfig
from .model.source import ModelSource, open_source
from .model.step import StepBatch, StepOutput
from .model.weights import layer_experts, load_weights
from .pool import ExpertPool
from .pool.hot_experts import ExpertProfile, expert_bytes
from .request import DEFAULT_MAX_NEW_TOKENS, GenerateRequest
from .scheduler import GenerationResult, generate
from .speculative import DraftHistory, StepCosts
from .text.chat_template import ChatTemplate
from .text.grammar import Grammars
from .text.tokenizer import TextCodec
from .warmup import Compiles, Unit, engine_units, warm_up_host

log = logging.getLogger(__name__)


def runs_decode_kernels(config: EngineConfig, gpu: bool, gguf: bool) -> bool:
    """Whether the coordinator itself launches compiled kernels in a decode step (node_worker/kernel_threads.py):
    an in-process pool's MoE layers, or dense matrices kept quantised on a NumPy device side (a dense_dtype
    format; auto: a GGUF file's quantised tensors)."""
    quantised_dense = config.dense_dtype not in ("f32", formats.AUTO) or (config.dense_dtype == formats.AUTO and gguf)
    return config.pool == "inproc" or (not gpu and quantised_dense)


def check_prompt_ids(mcfg: ModelConfig, ids: Sequence[int], max_new_tokens: int, max_seq_len: int | None) -> None:
    """Token ids inside the vocabulary, and the prompt plus the new tokens within the context."""
    bad = [t for t in ids if not 0 <= t < mcfg.vocab_size]
    if bad:
        raise ConfigValueError(f"token id {bad[0]} is outside the vocabulary [0, {mcfg.vocab_size})")
    limit = max_seq_len or mcfg.max_position_embeddings
    if len(ids) + max_new_tokens > limit:
        raise ConfigValueError(f"{len(ids)} prompt tokens + {max_new_tokens} new tokens exceed the maximum sequence "
                               f"length {limit}")


def start_units(config: EngineConfig, mcfg: ModelConfig, ckpt: Checkpoint, gpu: bool
                ) -> tuple[formats.ExpertFormats, list[Unit]]:
    """(the CPU experts' formats, the compile units an engine needs before it loads
    anything: coordinator/warmup.py's host loops, doorbells, experts and encoders), from the checkpoint's index
    alone; the dense matrices' units follow once they are packed."""
    spec = expert_format(config, mcfg, ckpt, layer_experts(mcfg, ckpt))
    names = spec.names
    encoders = names if gpu else [*names, config.dense_dtype]  # q8 and q4 quantise floats
    float_rows = float_rows_kernels(ckpt, config.dense_dtype, config.batch_invariant, gpu)  # the f32 dense rows'
    return spec, engine_units(config.pool, compiled_cover(for_formats(names, config.activations)), encoders,
                              gpu=gpu) + [Unit.dense(k) for k in float_rows]


def open_backend(device: str) -> Backend:
    """The side the network runs on, chosen once: 'auto' | 'cpu' | 'cuda' (gpu/probe.py's select_device)."""
    if select_device(device) == "cupy":
        from .gpu.backend import GpuBackend

        return GpuBackend()
    return HostBackend()


def check_speculative(source: ModelSource, config: EngineConfig) -> None:
    """--speculative mtp refused, naming what is missing, where the model has no MTP layer to run."""
    mcfg = source.config
    if config.speculative != "mtp" or mcfg.mtp_layers:
        return
    named = family(mcfg.arch).mtp_tensor_names(mcfg)
    missing = (f"no {named} in the checkpoint" if mcfg.arch in MTP_ARCHS else
               f"an architecture without one; {', '.join(MTP_ARCHS)} have it")
    raise ConfigValueError(f"{source.path}: speculative mtp needs the model's multi-token-prediction layer "
                           f"({mcfg.arch} model, {missing}): use ngram or auto")


def cpu_side(source: ModelSource, config: EngineConfig, weights, placement: Placement, nodes: list, planned,
             compile_missing) -> CpuExpertSpec:
    """The routed experts the network does not keep, planned over the pool's nodes in their format (its kernels
    compiled where the layers' first experts named other formats than the whole layers); a node left idle is
    said once per expert size."""
    mcfg, ckpt = source.config, source.checkpoint
    cpu_experts = {key: refs for key, refs in weights.experts.items() if key not in placement.experts}
    fmt = expert_format(config, mcfg, ckpt, cpu_experts or weights.experts)
    if fmt != planned:
        compile_missing([Unit.experts(compiled_cover(for_formats(fmt.names, config.activations)))])
    cpu = plan_cpu_experts(source, config, cpu_experts, nodes, placement.experts, fmt)
    left_out = cpu.plan.left_out
    for size in sorted({size for size, _, _ in left_out}):  # one line per expert size
        idle = [(node, reason) for s, node, reason in left_out if s == size]
        log.warning("%d of %d nodes hold no rows of the size-%d experts and sit idle (node %s: %s)", len(idle),
                    len(nodes), size, idle[0][0], idle[0][1])
    return cpu


@dataclass(eq=False)
class Engine:
    """A loaded model with its pool (``Engine.open``); generation and text on top."""

    source: ModelSource  # the checkpoint, configuration, tokenizer and chat template
    config: EngineConfig
    decoder: Decoder
    pool: ExpertPool
    graph: object | None  # the GPU's graph-ready steps around decoder.forward (gpu/graph_steps.py), or None
    cpu: CpuExpertSpec  # the CPU side's experts: their format, nodes and plan
    device_placement: dict = field(default_factory=dict)  # which experts the device side holds, and why
    dense_format: str = "f32"  # how the device side's dense matrices are stored: formats and counts
    load_s: float = 0.0  # seconds Engine.open took: the weights, the workers, the kernels compiled on a first run
    compile_s: float = 0.0  # of which compiling kernels this build lacked (coordinator/warmup.py)
    gpu_memory: VramPlan | None = None  # the GPU's memory by category: dense and hot experts as uploaded
    # what a speculative draft costs beside a plain step on this engine, measured by every scheduler that runs it
    step_costs: StepCosts = field(default_factory=StepCosts)
    # per draft source ("mtp", "ngram"): where the last finished sequence left its acceptance, for the next one
    draft_history: dict[str, DraftHistory] = field(default_factory=dict)

    @property
    def model_dir(self) -> Path:
        return self.source.path

    @property
    def model_config(self) -> ModelConfig:
        return self.source.config

    @property
    def ckpt(self) -> Checkpoint:
        return self.source.checkpoint

    @property
    def codec(self) -> TextCodec | None:
        return self.source.codec

    @functools.cached_property
    def grammars(self) -> Grammars | None:
        """Constrained decoding's vocabulary and compiled grammars (model/grammar.py); None without a tokenizer."""
        if self.codec is None:
            return None
        return Grammars(self.codec.tokenizer.to_str(), self.model_config.vocab_size)

    @property
    def chat_template(self) -> ChatTemplate | None:
        return self.source.chat_template

    @property
    def chat_template_error(self) -> str | None:
        return self.source.chat_template_error

    @property
    def nodes(self) -> list[Node]:
        """The pool's nodes, as the topology reported them."""
        return list(self.cpu.nodes)

    @property
    def expert_format(self) -> str:
        """How the CPU experts are stored (shm/formats)."""
        return self.cpu.fmt

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len or self.model_config.max_position_embeddings

    @classmethod
    def open(cls, model_dir: str | Path, config: EngineConfig | None = None, source: ModelSource | None = None,
             quiet: bool = False) -> "Engine":
        """``source``: open_source(model_dir)'s result when the caller has it already (not opened twice).
        ``quiet``: say nothing on stderr of the kernels compiled on a first run (coordinator/warmup.py)."""
        config = config or EngineConfig()
        if not isinstance(config, EngineConfig):
            raise ConfigValueError(f"config must be an EngineConfig, got {type(config).__name__}")
        model_dir = Path(model_dir)
        start = time.perf_counter()
        nodes = pool_nodes(config)  # before anything loads: a pool node that does not exist is refused at once
        source = source or open_source(model_dir)  # GGUF: the config, tokenizer and template from its metadata
        ckpt, mcfg = source.checkpoint, source.config
        check_speculative(source, config)
        backend = open_backend(config.device)  # the side the network runs on, chosen once
        backend.check_memory(mcfg, config, nodes)
        runs_kernels = runs_decode_kernels(config, backend.gpu, source.gguf)
        kernel_threads.settle(runs_kernels)  # before any kernel runs: libgomp reads its wait setting once
        placement = backend.place(mcfg, ckpt, config)  # the experts beside the network, before anything is read
        compile_missing = Compiles(quiet)  # before anything runs them, in a child, what this build lacks
        planned, units = start_units(config, mcfg, ckpt, backend.gpu)
        compile_missing(units)
        weights = load_weights(mcfg, ckpt)
        loaded = backend.load(weights, placement, ckpt, mcfg, config, compile_missing)
        cpu = cpu_side(source, config, weights, placement, nodes, planned, compile_missing)
        max_seq_len = config.max_seq_len or mcfg.max_position_embeddings
        pool = build_pool(source, cpu, config, max_seq_len, runs_kernels)
        try:
            decoder = Decoder(mcfg, weights, pool, backend, loaded, DecoderOptions(
                config.route_tail_skip, "f32" if config.kv_dtype == "f32" else "bf16", config.batch_invariant))
            step_buffer = loaded.memory.step if loaded.memory is not None else 0  # the plan's: no step grows it
            graph = backend.graph_runner(decoder, max_seq_len, config.graph_capture, step_buffer) \
                if config.graph else None
            if graph is not None:
                log.info("decode steps of up to %d rows are graph-ready", GRAPH_ROWS)
            warm_up_host(loaded.dense_kernels)
            load_s = time.perf_counter() - start
            log.info("loaded %s (%s, %d layers) in %.2fs, plan %s over nodes %s",
                     model_dir, mcfg.arch, mcfg.num_layers, load_s, cpu.plan.digest, cpu.plan.node_ids)
            placed = {"backend": backend.name, "experts": len(placement.experts), "chosen": placement.chosen,
                      "bytes": len(placement.experts) * placement.one_expert}
            return cls(source, config, decoder, pool, graph, cpu, placed, loaded.dense_format, load_s,
                       compile_missing.seconds, loaded.memory)
        except BaseException:  # Ctrl-C included: the workers, their segments and the pool's folder go too
            pool.close()
            raise

    def cpu_expert_bytes(self) -> float:
        """Bytes of one whole routed expert (gate, up, down) in the CPU side's storage formats (the mean over
        the MoE layers where they differ)."""
        mcfg = self.model_config
        spec = self.cpu.formats
        sizes = [sum(matrix_bytes(spec.of(layer), mcfg.moe_intermediate_size, mcfg.hidden_size))
                 for layer in mcfg.moe_layers]
        return sum(sizes) / max(1, len(sizes))

    def device_expert_bytes(self) -> int:
        """Bytes of one whole routed expert where the device side holds it (its storage formats on a GPU)."""
        placed = self.device_placement
        return placed["bytes"] // placed["experts"] if placed.get("experts") else expert_bytes(self.model_config)

    def cpu_expert_weights(self) -> int:
        """Weights of the routed experts held on the CPU side (all nodes together)."""
        mcfg = self.model_config
        cpu = len(mcfg.moe_layers) * mcfg.num_experts - self.device_placement.get("experts", 0)
        return cpu * 3 * mcfg.moe_intermediate_size * mcfg.hidden_size

    def expert_report(self) -> dict:
        """Hit rate and expert bytes read on each side, counted over this engine's life."""
        st = self.decoder.stats
        return {"device_experts": self.device_placement, "hit_rate": st.hit_rate, "device_pairs": st.device_pairs,
                "cpu_pairs": st.cpu_pairs, "routed_pairs": st.routed_pairs, "skipped_pairs": st.skipped_pairs,
                "expert_format": self.expert_format,
                "device_bytes_read": st.device_expert_loads * self.device_expert_bytes(),
                "cpu_bytes_read": st.cpu_expert_loads * self.cpu_expert_bytes(),
                "coordinator_wait_on_pool_s": st.pool_wait_ns / 1e9,
                "pool_wait_on_coordinator_s": self.pool.stats["idle_ns"] / 1e9}

    def profile(self) -> ExpertProfile:
        """The routing counted so far, as a frozen expert profile of this model."""
        counts = self.decoder.stats.per_layer_expert
        return ExpertProfile(self.ckpt.digest(), self.pool.plan.digest, self.model_config.num_layers,
                             self.model_config.num_experts,
                             {i: tuple(int(c) for c in counts.get(i, np.zeros(self.model_config.num_experts)))
                              for i in self.model_config.moe_layers})

    def pool_description(self) -> str:
        """One line saying where the experts run, virtual nodes labelled as such."""
        parts = [f"node {n.id}{' (virtual)' if n.virtual else ''}: cpus {format_cpulist(n.cpus)}" for n in self.nodes]
        mode = "split by rows" if self.config.numa_split else "whole experts"
        placed = self.device_placement
        device = (f"; device side {placed['backend']} holds {placed['experts']} experts whole ({placed['chosen']})"
                  if placed.get("experts") else "")
        if self.gpu_memory is not None:
            device += f"; GPU memory: {self.gpu_memory.describe()}"
        return (f"pool {self.config.pool}, {mode}, experts as {self.expert_format}, plan {self.pool.plan.digest}; "
                + "; ".join(parts) + device)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.pool.close()

    # -- text -------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        if self.codec is None:
            raise StrataError(f"{self.model_dir} has no tokenizer.json; pass token ids instead of text")
        return self.codec.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        if self.codec is None:
            raise StrataError(f"{self.model_dir} has no tokenizer.json; cannot turn ids into text")
        return self.codec.decode(list(ids))

    # -- the serving loop's surface (coordinator/scheduler.py, serving/server.py) --------------------------
    def check_ids(self, token_ids: Sequence[int], extra: int = 0) -> np.ndarray:
        """``token_ids`` as int64 [T], refused (ConfigValueError) when empty, not integers, outside the
        vocabulary, or too long for the context with ``extra`` new tokens after them."""
        ids = np.asarray(list(token_ids))
        if ids.ndim != 1 or ids.size == 0:
            raise ConfigValueError("token_ids must be a non-empty sequence of integers")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ConfigValueError(f"token_ids must be integers, got dtype {ids.dtype}")
        check_prompt_ids(self.model_config, ids.tolist(), extra, self.max_seq_len)
        return ids.astype(np.int64)

    def new_cache(self) -> KVCache:
        """An empty KV cache for one sequence."""
        return self.decoder.new_cache()

    def step(self, batch: StepBatch) -> StepOutput:
        """One forward pass over several sequences (StepBatch: each one's next token ids and cache, and which rows'
        logits and hidden states it asks for): each one's logits on the host and, where asked, its hidden rows for
        the MTP layer; the caches advance. Small steps run graph-ready where the GPU's runner is (gpu/graph_steps.py),
        around the same forward."""
        return (self.graph or self.decoder).forward(batch)

    @property
    def has_mtp(self) -> bool:
        """Whether the model's multi-token-prediction layer is loaded (its checkpoint holds one)."""
        return self.decoder.mtp is not None

    def new_mtp_cache(self) -> KVCache:
        """An empty cache of the MTP layer for one sequence."""
        return self.decoder.new_mtp_cache()

    def mtp_step(self, batch: list[tuple[list, np.ndarray, KVCache]]) -> tuple[list[np.ndarray], list]:
        """The MTP layer over several sequences, each (hidden rows from ``step``, the token ids that followed
        them, its MTP cache): each one's last row's logits [1, V] for the token after the next, and that row's
        output, the next call's hidden row (Decoder.forward_mtp)."""
        return self.decoder.forward_mtp(batch)

    def stats(self) -> dict:
        """The routing counted over this engine's life and its expert report."""
        st = self.decoder.stats
        return {"routed_pairs": st.routed_pairs, "skipped_pairs": st.skipped_pairs, "experts": self.expert_report()}

    def health(self) -> dict:
        """The pool's kind, plan and nodes (each alive or not, its state, restarts: pool/base.NodeHealth)."""
        return {"kind": self.config.pool, "nodes": self.pool.health(), "plan": self.pool.plan.digest}

    def maintain(self) -> None:
        """Between steps: restart the pool's dead workers whose restart is due."""
        self.pool.maintain()

    def set_wait_hook(self, hook: Callable[[], None] | None) -> None:
        """A callable the pool calls now and then while a step waits on its workers (None: none); what it
        raises ends the step."""
        self.pool.wait_hook = hook

    # -- compute ----------------------------------------------------------
    def logits(self, token_ids: Sequence[int], steps: bool = False) -> np.ndarray:
        """np.float32 [len(token_ids), vocab] for a fresh sequence: one forward over the prompt, or with
        ``steps`` one decode step a token (the path generation takes after the prompt)."""
        ids = self.check_ids(token_ids)
        if not steps:
            return self.step(StepBatch.of(ids, self.new_cache(), every_row=True)).logits[0].astype(np.float32,
                                                                                                  copy=False)
        cache = self.new_cache()
        return np.concatenate([self.step(StepBatch.of(ids[i:i + 1], cache)).logits[0] for i in range(ids.size)]
                              ).astype(np.float32, copy=False)

    def generate_full(self, token_ids: Sequence[int], max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                      temperature: float = GenerateRequest.temperature, *, stop_at_eos: bool = True,
                      on_token: Callable[[int], None] | None = None, on_text: Callable[[str], None] | None = None,
                      speculative: str | None = None, **options) -> GenerationResult:
        """Generate after ``token_ids`` through the serving loop (coordinator/scheduler.py: the admission,
        sampling and stopping of a served request). ``options``: GenerateRequest's sampling and stopping
        fields (top_k, top_p, min_p, seed, presence_penalty, frequency_penalty, repetition_penalty, stop,
        stop_token_ids). ``stop_at_eos=False`` goes on past the model's eos ids. ``on_token`` sees each id as
        it is chosen, ``on_text`` the text as it streams (held back while it may begin a stop string).
        ``speculative``: a speculative decoding mode for this call (the config's when None)."""
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ConfigValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        ids = self.check_ids(token_ids, max_new_tokens)
        stop = options.pop("stop", None) or ()
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ConfigValueError(f"stop must be non-empty strings, got {stop!r}")
        unknown = sorted(set(options) - GENERATE_OPTIONS)
        if unknown:
            raise ConfigValueError(f"unknown generation option(s): {', '.join(unknown)}")
        options["stop_token_ids"] = tuple(options.get("stop_token_ids", ()))
        req = GenerateRequest("generate", prompt_ids=tuple(ids.tolist()), max_new_tokens=max_new_tokens,
                              temperature=temperature, stop=stop, stream=on_text is not None,
                              ignore_eos=not stop_at_eos, **options)
        return generate(self, req, on_token, on_text, speculative=speculative)

    def generate(self, token_ids: Sequence[int], max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                 temperature: float = GenerateRequest.temperature, **kwargs) -> list[int]:
        """New token ids (list[int]) after ``token_ids``; stops at the model's eos (generate_full's options)."""
        return self.generate_full(token_ids, max_new_tokens, temperature, **kwargs).ids


# GenerateRequest's fields generate_full takes as options (the rest it sets itself)
GENERATE_OPTIONS = frozenset({"top_k", "top_p", "min_p", "seed", "presence_penalty", "frequency_penalty",
                              "repetition_penalty", "stop_token_ids"})
