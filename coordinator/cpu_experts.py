"""The CPU side's routed experts: how they are stored, which node holds which rows, and the pool that serves them.

``plan_cpu_experts`` gathers that into one CpuExpertSpec (experts, format, nodes, plan, digest), from which
``build_pool`` makes an in-process pool or a process pool (the node workers read ``worker_job``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from node_worker import NodeWorker
from node_worker.job import ExpertJob, NodeJob, WorkerJob, max_message_bytes
from shm import formats
from shm.checkpoint import Checkpoint
from shm.expert_store import HeapExpertStore
from shm.plan import DEFAULT_BLOCK, NodeShare, PoolPlan, make_plan, plan_to_dict, single_node_plan
from shm.topology import Node, select_nodes

from .config import EngineConfig
from .context import segment_layout
from .errors import ConfigValueError
from .model.model_config import ModelConfig
from .model.source import ModelSource
from .pool import ExpertPool, InprocPool


@dataclass(frozen=True, eq=False)
class CpuExpertSpec:
    experts: dict  # (layer, expert) -> the tensors of each routed expert the CPU side holds (weights.ExpertRefs)
    formats: formats.ExpertFormats  # how they are stored, per layer and matrix (parsed once, here)
    nodes: tuple[Node, ...]  # the nodes that hold them, as the topology reported them
    plan: PoolPlan  # which rows of each expert each node holds
    digest: str  # names this content: the model less the device's experts, in its formats (cpu_set_digest)

    @property
    def fmt(self) -> str:
        """The formats as their spec string: what crosses a boundary (the worker job, a segment's kind)."""
        return self.formats.spec


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


def build_plan(mcfg: ModelConfig, nodes: list[Node], stored: formats.ExpertFormats = formats.ExpertFormats.F32
               ) -> PoolPlan:
    """One slice per node, sized by the node's CPUs, cut on the experts' down-format blocks (at least 32 rows;
    256 for a GGUF file's K blocks, whose rows the nodes keep as they are); a single node holds whole experts."""
    sizes = [mcfg.moe_intermediate_size]
    if len(nodes) == 1:
        return single_node_plan(sizes, node=nodes[0].id, workers=len(nodes[0].cpus))
    block = max(DEFAULT_BLOCK, stored.down_block)
    return make_plan([NodeShare(n.id, len(n.cpus)) for n in nodes], sizes, block)


def expert_format(config: EngineConfig, mcfg: ModelConfig, ckpt: Checkpoint, experts: dict) -> formats.ExpertFormats:
    """How the CPU experts are stored (shm/formats' ExpertFormats): the setting for every matrix, or
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
        return formats.ExpertFormats((formats.resolve(config.expert_dtype, "F32", mcfg.hidden_size).NAME,) * 3)
    return formats.ExpertFormats.of_layers(triples)


def cpu_set_digest(ckpt: Checkpoint, device_set, fmt: str = "f32") -> str:
    """Names the CPU side's contents: the model, less the experts kept on the device, in its storage format."""
    if not device_set and fmt == "f32":
        return ckpt.digest()  # named by the checkpoint alone: f32 segments kept from earlier runs are reattached
    blob = (ckpt.digest() + repr(sorted(device_set)) + (f"/{fmt}" if fmt != "f32" else "")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def plan_cpu_experts(source: ModelSource, config: EngineConfig, experts: dict, nodes: list[Node],
                     device_set=(), stored: formats.ExpertFormats | None = None) -> CpuExpertSpec:
    """The CPU side of ``experts`` over ``nodes``: stored as the config says (``stored``: those formats when the
    caller has resolved them already), the plan cut on their blocks, named apart from a set less ``device_set``."""
    stored = stored or expert_format(config, source.config, source.checkpoint, experts)
    return CpuExpertSpec(experts, stored, tuple(nodes), build_plan(source.config, nodes, stored),
                         cpu_set_digest(source.checkpoint, device_set, stored.spec))


def build_inproc_pool(source: ModelSource, cpu: CpuExpertSpec, threads: int | None = None,
                      activations: str = EngineConfig.activations) -> InprocPool:
    """One NodeWorker per plan node in this process; threads default to the node's CPUs."""
    mcfg = source.config
    sized = {key: (refs, mcfg.moe_intermediate_size) for key, refs in cpu.experts.items()}
    cpus = {n.id: list(n.cpus) for n in cpu.nodes}
    workers = [
        NodeWorker(node, HeapExpertStore.from_checkpoint(source.checkpoint, cpu.plan, node, sized, cpu.fmt),
                   mcfg.hidden_size, threads=threads or max(1, len(cpus.get(node, []))), cpus=cpus.get(node),
                   activations=activations, num_experts=mcfg.num_experts)
        for node in cpu.plan.node_ids
    ]
    return InprocPool(cpu.plan, workers, cpu.nodes)


def worker_job(source: ModelSource, cpu: CpuExpertSpec, config: EngineConfig, max_tokens: int) -> WorkerJob:
    """What the node workers need to build their stores and serve (node_worker/job.py)."""
    mcfg = source.config
    return WorkerJob(
        model_dir=str(source.path.resolve()), model_digest=cpu.digest, hidden=mcfg.hidden_size,
        num_layers=mcfg.num_layers, num_experts=mcfg.num_experts, intermediate=mcfg.moe_intermediate_size,
        moe_layers=tuple(mcfg.moe_layers), plan=plan_to_dict(cpu.plan), max_tokens=max_tokens,
        max_message_bytes=max_message_bytes(max_tokens, mcfg.hidden_size),
        nodes=tuple(NodeJob(n.id, n.parent if n.virtual else n.id, tuple(n.cpus),
                            config.worker_threads or len(n.cpus), n.mem_free or 0) for n in cpu.nodes),
        experts=tuple(ExpertJob(l, e, mcfg.moe_intermediate_size, refs.renamed(source.checkpoint.file_name))
                      for (l, e), refs in sorted(cpu.experts.items())),  # the file's names: workers read no family
        spin_us=config.pool_spin_us, keep_shm=config.keep_shm, log_level=config.worker_log_level,
        expert_format=cpu.fmt, activations=config.activations,
    )


def build_pool(source: ModelSource, cpu: CpuExpertSpec, config: EngineConfig, max_seq_len: int,
               kernel_team: bool = False) -> ExpertPool:
    """The pool the config asks for. ``kernel_team``: the coordinator runs kernels of its own on the decode
    path (engine.runs_decode_kernels), so a process pool waits for the partials with numba's threads asleep
    beside it (node_worker/kernel_threads.py)."""
    if config.pool == "inproc":
        return build_inproc_pool(source, cpu, config.worker_threads, config.activations)
    from .pool.process import ProcessPool

    layout = segment_layout(source.config, max_seq_len, len(cpu.nodes), config.prefill_chunk)
    job = worker_job(source, cpu, config, layout.max_tokens)
    return ProcessPool(cpu.plan, list(cpu.nodes), job, config, kernel_team, layout.max_pairs)
