"""Engine: a loaded model, its expert pool, and generation."""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from node_worker import NodeWorker, kernel_threads
from node_worker.kernels import dense
from node_worker.kernels.kernel_set import KernelSet, for_formats
from node_worker.job import ExpertJob, NodeJob, WorkerJob, max_message_bytes
from shm import formats
from shm.checkpoint import Checkpoint
from shm.expert_source import read_expert_slice
from shm.gguf_checkpoint import GgufCheckpoint, gguf_path
from shm.expert_store import HeapExpertStore, matrix_bytes
from shm.plan import DEFAULT_BLOCK, NodeShare, PoolPlan, make_plan, plan_to_dict, single_node_plan
from shm.topology import Node, format_cpulist, select_nodes

from .config import EngineConfig
from .errors import ConfigValueError, StrataError
from .model import host_ops
from .model.backend import select_device
from .model.packed import pack_dense
from .model.decoder import Decoder
from .model.gguf_tokenizer import gguf_codec
from .model.model_config import ModelConfig, load_model_config, parse_model_config
from .model.sampling import Sampler, SamplingParams
from .model.tokenizer import TextCodec
from .model.weights import MLPWeights, layer_experts, load_weights
from .pool import ExpertPool, InprocPool
from .pool.hot_experts import ExpertProfile, choose_device_experts
from .serving.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from .warmup import Unit, engine_units, ensure_compiled

log = logging.getLogger(__name__)


class Compiles:
    """ensure_compiled for an engine's start, the seconds spent where something was compiled added up."""

    def __init__(self, quiet: bool):
        self.quiet, self.seconds = quiet, 0.0

    def __call__(self, units) -> None:
        start = time.perf_counter()
        if ensure_compiled(units, self.quiet):
            self.seconds += time.perf_counter() - start


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    ids: list[int]  # generated ids, the stop token included when one ended it
    finish_reason: str  # "length" | "eos"
    prefill_s: float
    decode_s: float
    timings: dict = field(default_factory=dict)


def pool_nodes(config: EngineConfig) -> list[Node]:
    """The nodes the pool uses: node 0 alone, or ``nodes`` (virtual when the machine has fewer)."""
    if not config.numa_split:
        real = select_nodes(None)
        chosen = [n for n in real if n.id == config.pool_node]
        if not chosen:
            raise ConfigValueError(f"pool_node {config.pool_node} is not a node with usable CPUs "
                                   f"(nodes: {', '.join(str(n.id) for n in real)})")
        return chosen
    return select_nodes(config.nodes)


def refuse_shared_cpus(nodes: int | None) -> None:
    """The command line's limit: a split over more nodes than this process has CPUs is refused, with the limit
    named (the library still builds such virtual nodes, sharing CPUs, for tests of many nodes on few CPUs)."""
    if nodes is None:
        return
    chosen = select_nodes(nodes)
    if any(n.shares_cpus for n in chosen):
        cpus = len({c for n in chosen for c in n.cpus})
        raise ConfigValueError(f"nodes {nodes}: this process may use {cpus} CPUs, so a split runs at most {cpus} "
                               f"nodes (one CPU each at least); ask for {cpus} or fewer")


def runs_decode_kernels(config: EngineConfig, backend: str, gguf: bool) -> bool:
    """Whether the coordinator itself launches compiled kernels in a decode step (node_worker/kernel_threads.py):
    an in-process pool's MoE layers, or dense matrices kept quantised on a NumPy device side (a dense_dtype
    format; auto: a GGUF file's quantised tensors)."""
    quantised_dense = config.dense_dtype not in ("f32", formats.AUTO) or (config.dense_dtype == formats.AUTO and gguf)
    return config.pool == "inproc" or (backend == "numpy" and quantised_dense)


def open_source(model_dir: Path) -> tuple[Checkpoint | GgufCheckpoint, ModelConfig, TextCodec | None]:
    """(checkpoint, configuration, tokenizer) of a model folder or GGUF file, its tensors not read yet."""
    gguf = gguf_path(Path(model_dir))
    if gguf is None:
        mcfg = load_model_config(Path(model_dir))  # first: a missing or broken config is the error to name
        codec = TextCodec.load(model_dir)
        return Checkpoint(model_dir), mcfg, codec
    ckpt = GgufCheckpoint(gguf)
    return ckpt, parse_model_config(ckpt.config(), gguf.parent), gguf_codec(ckpt.file.metadata, gguf)


def check_prompt_ids(mcfg: ModelConfig, ids: Sequence[int], max_new_tokens: int, max_seq_len: int | None) -> None:
    """Token ids inside the vocabulary, and the prompt plus the new tokens within the context."""
    bad = [t for t in ids if not 0 <= t < mcfg.vocab_size]
    if bad:
        raise ConfigValueError(f"token id {bad[0]} is outside the vocabulary [0, {mcfg.vocab_size})")
    limit = max_seq_len or mcfg.max_position_embeddings
    if len(ids) + max_new_tokens > limit:
        raise ConfigValueError(f"{len(ids)} prompt tokens + {max_new_tokens} new tokens exceed the maximum sequence "
                               f"length {limit}")


def warm_up_host(dense_kernels: Sequence[KernelSet] = ()) -> None:
    """Load (or compile) the host loops this engine's requests call, before the first one: the decoder's row
    loops (host_ops: all of them on a NumPy device side, the router's top-k with a GPU too) and, with dense
    matrices kept packed, their kernels (one kernel set per format)."""
    host_ops.warm_up()
    for kernels in dense_kernels:
        dense.warm_up(kernels)


def start_units(config: EngineConfig, mcfg: ModelConfig, ckpt: Checkpoint, backend: str) -> tuple[str, list[Unit]]:
    """(the CPU experts' formats as an ExpertFormats spec, the compile units an engine needs before it loads
    anything: coordinator/warmup.py's host loops, doorbells, experts and encoders), from the checkpoint's index
    alone; the dense matrices' units follow once they are packed."""
    spec = expert_format(config, mcfg, ckpt, layer_experts(mcfg, ckpt))
    names = formats.ExpertFormats.parse(spec).names
    encoders = [*names, config.dense_dtype] if backend == "numpy" else names  # q8 and q4 quantise floats
    return spec, engine_units(config.pool, for_formats(names, config.activations), encoders)


def build_plan(mcfg: ModelConfig, nodes: list[Node], fmt: str = "f32") -> PoolPlan:
    """One slice per node, sized by the node's CPUs, cut on the experts' down-format blocks (at least 32 rows;
    256 for a GGUF file's K blocks, whose rows the nodes keep as they are); a single node holds whole experts."""
    sizes = [mcfg.moe_intermediate_size]
    if len(nodes) == 1:
        return single_node_plan(sizes, node=nodes[0].id, workers=len(nodes[0].cpus))
    block = max(DEFAULT_BLOCK, formats.ExpertFormats.parse(fmt).down_block)
    return make_plan([NodeShare(n.id, len(n.cpus)) for n in nodes], sizes, block)


def build_inproc_pool(ckpt: Checkpoint, mcfg: ModelConfig, plan: PoolPlan, experts: dict,
                      threads: int | None = None, nodes: list[Node] | None = None, fmt: str = "f32",
                      activations: str = EngineConfig.activations) -> InprocPool:
    """One NodeWorker per plan node in this process, experts stored in ``fmt``; threads default to the node's
    CPUs (1 without nodes)."""
    sized = {key: (refs, mcfg.moe_intermediate_size) for key, refs in experts.items()}
    cpus = {n.id: list(n.cpus) for n in nodes or []}
    workers = [
        NodeWorker(node, HeapExpertStore.from_checkpoint(ckpt, plan, node, sized, fmt), mcfg.hidden_size,
                   threads=threads or max(1, len(cpus.get(node, []))), cpus=cpus.get(node), activations=activations)
        for node in plan.node_ids
    ]
    return InprocPool(plan, workers, nodes)


def expert_bytes(mcfg: ModelConfig) -> int:
    """float32 bytes of one whole routed expert (gate, up, down)."""
    return 3 * mcfg.moe_intermediate_size * mcfg.hidden_size * 4


def device_expert_set(mcfg: ModelConfig, ckpt: Checkpoint, config: EngineConfig):
    """(the experts kept whole on the device, how they were chosen)."""
    profile = None
    if config.expert_profile:
        profile = ExpertProfile.load(config.expert_profile, ckpt.digest(), mcfg.moe_layers, mcfg.num_experts)
    memory = int(config.gpu_expert_memory * 1e9) if config.gpu_expert_memory is not None else None
    return choose_device_experts(mcfg.moe_layers, mcfg.num_experts, expert_bytes(mcfg), profile,
                                 config.gpu_experts, memory)


def whole_expert(ckpt: Checkpoint, refs, mcfg: ModelConfig) -> MLPWeights:
    part = read_expert_slice(ckpt, refs, 0, mcfg.moe_intermediate_size)
    return MLPWeights(part.gate, part.up, part.down)


def cpu_set_digest(ckpt: Checkpoint, device_set, fmt: str = "f32") -> str:
    """Names the CPU side's contents: the model, less the experts kept on the device, in its storage format."""
    if not device_set and fmt == "f32":
        return ckpt.digest()  # as before formats existed: f32 segments of older runs are reattached
    blob = (ckpt.digest() + repr(sorted(device_set)) + (f"/{fmt}" if fmt != "f32" else "")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def expert_format(config: EngineConfig, mcfg: ModelConfig, ckpt: Checkpoint, experts: dict) -> str:
    """How the CPU experts are stored, as an ExpertFormats spec (shm/formats): the setting for every matrix, or
    with ``auto`` each layer's gate, up and down resolved from their tensors' dtypes (a GGUF file's blocks kept
    as they are: a Q4_K_M file's Q4_K and Q6_K matrices each in their own format)."""
    first = {}  # layer -> the refs of one of its experts (a layer's experts share their tensors' dtypes)
    for (layer, _), refs in sorted(experts.items()):
        first.setdefault(layer, refs)
    triples = {}
    for layer, refs in first.items():
        chosen = []
        for matrix, ref in (("gate", refs.gate), ("up", refs.up), ("down", refs.down)):
            dtype = ckpt.info(ref.name).dtype
            try:
                chosen.append(formats.resolve(config.expert_dtype, dtype, mcfg.hidden_size).NAME)
            except formats.FormatError as exc:
                raise ConfigValueError(f"{ckpt.dir}: layer {layer} {matrix} ({ref.name}, {dtype}): {exc}") from None
        triples[layer] = tuple(chosen)
    if not triples:
        return formats.resolve(config.expert_dtype, "F32", mcfg.hidden_size).NAME
    return formats.ExpertFormats.of_layers(triples).spec


def worker_job(model_dir: Path, ckpt: Checkpoint, mcfg: ModelConfig, plan: PoolPlan, experts: dict,
               nodes: list[Node], config: EngineConfig, max_tokens: int, model_digest: str | None = None,
               fmt: str | None = None) -> WorkerJob:
    """What the node workers need to build their stores and serve (node_worker/job.py); ``fmt`` defaults to
    the config's expert format for this checkpoint."""
    return WorkerJob(
        model_dir=str(model_dir.resolve()), model_digest=model_digest or ckpt.digest(), hidden=mcfg.hidden_size,
        num_layers=mcfg.num_layers, num_experts=mcfg.num_experts, intermediate=mcfg.moe_intermediate_size,
        moe_layers=tuple(mcfg.moe_layers), plan=plan_to_dict(plan), max_tokens=max_tokens,
        max_message_bytes=max_message_bytes(max_tokens, mcfg.hidden_size),
        nodes=tuple(NodeJob(n.id, n.parent if n.virtual else n.id, tuple(n.cpus),
                            config.worker_threads or len(n.cpus), n.mem_free or 0) for n in nodes),
        experts=tuple(ExpertJob(l, e, mcfg.moe_intermediate_size, refs) for (l, e), refs in sorted(experts.items())),
        spin_us=config.pool_spin_us, keep_shm=config.keep_shm, log_level=config.worker_log_level,
        expert_format=fmt or expert_format(config, mcfg, ckpt, experts), activations=config.activations,
    )


def build_pool(model_dir: Path, ckpt: Checkpoint, mcfg: ModelConfig, plan: PoolPlan, nodes: list[Node],
               experts: dict, config: EngineConfig, max_seq_len: int, model_digest: str, fmt: str,
               kernel_team: bool = False) -> ExpertPool:
    """``kernel_team``: the coordinator runs kernels of its own on the decode path (runs_decode_kernels), so a
    process pool waits for the partials with numba's threads asleep beside it (node_worker/kernel_threads.py)."""
    if config.pool == "inproc":
        return build_inproc_pool(ckpt, mcfg, plan, experts, config.worker_threads, nodes, fmt, config.activations)
    from .pool.process import ProcessPool

    job = worker_job(model_dir, ckpt, mcfg, plan, experts, nodes, config, max_seq_len, model_digest, fmt)
    return ProcessPool(plan, nodes, job, config, kernel_team)


@dataclass(eq=False)
class Engine:
    """A loaded model with its pool (``Engine.open``); generation and text on top."""

    model_dir: Path
    config: EngineConfig
    model_config: ModelConfig
    ckpt: Checkpoint
    decoder: Decoder
    pool: ExpertPool
    codec: TextCodec | None
    nodes: list[Node]  # the pool's nodes, as the topology reported them
    device_placement: dict = field(default_factory=dict)  # which experts the device side holds, and why
    expert_format: str = "f32"  # how the CPU experts are stored (shm/formats)
    dense_format: str = "f32"  # how the CPU device side's dense matrices are stored: formats and counts
    chat_template: ChatTemplate | None = None  # the model's, when it has one (serving/chat_template.py)
    chat_template_error: str | None = None  # why the model's template cannot be used, when it is broken
    load_s: float = 0.0  # seconds Engine.open took: the weights, the workers, the kernels compiled on a first run
    compile_s: float = 0.0  # of which compiling kernels this build lacked (coordinator/warmup.py)

    @property
    def max_seq_len(self) -> int:
        return self.config.max_seq_len or self.model_config.max_position_embeddings

    @classmethod
    def open(cls, model_dir: str | Path, config: EngineConfig | None = None, source: tuple | None = None,
             quiet: bool = False) -> "Engine":
        """``source``: open_source(model_dir)'s result when the caller has it already (not opened twice).
        ``quiet``: say nothing on stderr of the kernels compiled on a first run (coordinator/warmup.py)."""
        config = config or EngineConfig()
        if not isinstance(config, EngineConfig):
            raise ConfigValueError(f"config must be an EngineConfig, got {type(config).__name__}")
        model_dir = Path(model_dir)
        start = time.perf_counter()
        nodes = pool_nodes(config)  # before anything loads: a pool node that does not exist is refused at once
        ckpt, mcfg, codec = source or open_source(model_dir)  # GGUF: the config and the tokenizer from its metadata
        chat_template, chat_template_error = None, None
        try:  # a broken template is named before the weights load; it turns chat off, not the model
            chat_template = load_chat_template(model_dir, ckpt.file.metadata if isinstance(ckpt, GgufCheckpoint)
                                               else None)
        except ChatTemplateError as exc:
            chat_template_error = str(exc)
            log.warning("%s: chat is off for this model", exc)
        backend = select_device(config.device)
        runs_kernels = runs_decode_kernels(config, backend, isinstance(ckpt, GgufCheckpoint))
        kernel_threads.settle(runs_kernels)  # before any kernel runs: libgomp reads its wait setting once
        if config.dense_dtype not in ("f32", formats.AUTO) and backend != "numpy":
            raise ConfigValueError(f"dense_dtype {config.dense_dtype} is for a CPU device side (NumPy); the GPU "
                                   "keeps the dense weights in float32: leave dense_dtype at f32 with a GPU")
        device_set, placement = device_expert_set(mcfg, ckpt, config)  # a count the model cannot give: refused now
        compile_missing = Compiles(quiet)  # before anything runs them, in a child, what this build lacks
        planned, units = start_units(config, mcfg, ckpt, backend)
        compile_missing(units)
        weights = load_weights(mcfg, ckpt)
        dense_format, dense_kernels = "f32", []
        if config.dense_dtype != "f32" and backend == "numpy":
            fmt = None if config.dense_dtype == formats.AUTO else formats.get(config.dense_dtype)
            nbytes, dense_format, dense_kernels = pack_dense(weights, fmt, config.activations != "f32", ckpt,
                                                             config.activations == "bf16")
            log.info("dense matrices (%s) stored as %s: %.2f GB", config.dense_dtype, dense_format, nbytes / 1e9)
            compile_missing([Unit.dense(kernels) for kernels in dense_kernels])
        device_experts = {key: whole_expert(ckpt, weights.experts[key], mcfg) for key in sorted(device_set)}
        cpu_experts = {key: refs for key, refs in weights.experts.items() if key not in device_set}
        fmt = expert_format(config, mcfg, ckpt, cpu_experts or weights.experts)
        if fmt != planned:  # the layers' first experts named other formats than the whole layers (not seen)
            compile_missing([Unit.experts(for_formats(formats.ExpertFormats.parse(fmt).names, config.activations))])
        plan = build_plan(mcfg, nodes, fmt)
        for size in sorted({size for size, _, _ in plan.left_out}):  # one line per expert size
            idle = [(node, reason) for s, node, reason in plan.left_out if s == size]
            log.warning("%d of %d nodes hold no rows of the size-%d experts and sit idle (node %s: %s)", len(idle),
                        len(nodes), size, idle[0][0], idle[0][1])
        max_seq_len = config.max_seq_len or mcfg.max_position_embeddings
        pool = build_pool(model_dir, ckpt, mcfg, plan, nodes, cpu_experts, config, max_seq_len,
                          cpu_set_digest(ckpt, device_set, fmt), fmt, runs_kernels)
        try:
            decoder = Decoder(mcfg, weights, pool, config.route_tail_skip, device_experts, backend)
            warm_up_host(dense_kernels)
            load_s = time.perf_counter() - start
            log.info("loaded %s (%s, %d layers) in %.2fs, plan %s over nodes %s",
                     model_dir, mcfg.arch, mcfg.num_layers, load_s, plan.digest, plan.node_ids)
            return cls(model_dir, config, mcfg, ckpt, decoder, pool, codec, nodes,
                       {"backend": backend, "experts": len(device_set), "chosen": placement,
                        "bytes": len(device_set) * expert_bytes(mcfg)}, fmt, dense_format, chat_template,
                       chat_template_error, load_s, compile_missing.seconds)
        except BaseException:  # Ctrl-C included: the workers, their segments and the pool's folder go too
            pool.close()
            raise

    def cpu_expert_bytes(self) -> float:
        """Bytes of one whole routed expert (gate, up, down) in the CPU side's storage formats (the mean over
        the MoE layers where they differ)."""
        mcfg = self.model_config
        spec = formats.ExpertFormats.parse(self.expert_format)
        sizes = [sum(matrix_bytes(spec.of(layer), mcfg.moe_intermediate_size, mcfg.hidden_size))
                 for layer in mcfg.moe_layers]
        return sum(sizes) / max(1, len(sizes))

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
                "device_bytes_read": st.device_expert_loads * expert_bytes(self.model_config),
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

    # -- compute ----------------------------------------------------------
    def _check_ids(self, token_ids: Sequence[int], extra: int = 0) -> np.ndarray:
        ids = np.asarray(list(token_ids))
        if ids.ndim != 1 or ids.size == 0:
            raise ConfigValueError("token_ids must be a non-empty sequence of integers")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ConfigValueError(f"token_ids must be integers, got dtype {ids.dtype}")
        check_prompt_ids(self.model_config, ids.tolist(), extra, self.max_seq_len)
        return ids.astype(np.int64)

    def logits(self, token_ids: Sequence[int], steps: bool = False) -> np.ndarray:
        """np.float32 [len(token_ids), vocab] for a fresh sequence: one forward over the prompt, or with
        ``steps`` one decode step a token (the path generation takes after the prompt)."""
        ids = self._check_ids(token_ids)
        if not steps:
            return self.decoder.forward(ids, self.decoder.new_cache()).astype(np.float32, copy=False)
        cache = self.decoder.new_cache()
        return np.concatenate([self.decoder.forward(ids[i:i + 1], cache) for i in range(ids.size)]).astype(
            np.float32, copy=False)

    def generate_full(self, token_ids: Sequence[int], max_new_tokens: int = 16, temperature: float = 0.0,
                      top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop_at_eos: bool = True,
                      on_token: Callable[[int], None] | None = None, min_p: float = 0.0,
                      repetition_penalty: float = 1.0) -> GenerationResult:
        """Generate after ``token_ids`` (sampling.SamplingParams' meanings; repetition_penalty over the prompt
        and the answer, as transformers'); ``on_token`` sees each token as it is chosen."""
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ConfigValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
        ids = self._check_ids(token_ids, max_new_tokens)
        sampler = Sampler(SamplingParams(temperature, top_k, top_p, seed, min_p=min_p,
                                         repetition_penalty=repetition_penalty), ids.tolist())
        eos = set(self.model_config.eos_token_ids) if stop_at_eos else set()
        cache = self.decoder.new_cache()
        out: list[int] = []
        reason = "length"
        t0 = time.perf_counter()
        logits = self.decoder.forward(ids, cache, last_only=True)[-1]  # [V]
        t1 = time.perf_counter()
        first = None
        while len(out) < max_new_tokens:
            token = sampler(logits)
            out.append(token)
            first = first or time.perf_counter()
            if on_token is not None:
                on_token(token)
            if token in eos:
                reason = "eos"
                break
            if len(out) == max_new_tokens:
                break
            logits = self.decoder.forward(np.array([token], np.int64), cache, last_only=True)[-1]
        t2 = time.perf_counter()
        decode_steps = max(len(out) - 1, 0)
        timings = {
            "prefill_tokens": int(ids.size), "prefill_s": t1 - t0,
            "prefill_tokens_per_s": ids.size / (t1 - t0) if t1 > t0 else None,
            "decode_tokens": decode_steps, "decode_s": t2 - t1,
            "decode_tokens_per_s": decode_steps / (t2 - t1) if decode_steps and t2 > t1 else None,
            "time_to_first_token_s": (first or t2) - t0,
        }
        return GenerationResult(ids.tolist(), out, reason, t1 - t0, t2 - t1, timings)

    def generate(self, token_ids: Sequence[int], max_new_tokens: int = 16, temperature: float = 0.0,
                 **kwargs) -> list[int]:
        """New token ids (list[int]) after ``token_ids``; stops at the model's eos."""
        return self.generate_full(token_ids, max_new_tokens, temperature, **kwargs).ids
