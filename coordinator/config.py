"""EngineConfig and where its values come from.

One frozen dataclass. CLI flags and ``STRATA_*`` environment variables map onto
it with the precedence flag > variable > default; ``ENV_VARS`` is the one place
the variables are declared.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Callable, Mapping

from shm import formats

from .errors import ConfigValueError
from .speculative import DEFAULT_DRAFT_MAX
from .speculative import MODES as SPECULATIVE_MODES

POOLS = ("inproc", "process")
EXPERT_DTYPES = (formats.AUTO, *formats.FORMATS, *formats.FILE_FORMATS)  # the last: a GGUF file's own blocks
DENSE_DTYPES = (formats.AUTO, *formats.FORMATS)  # auto: a GGUF file's quantised matrices as it has them
# node_worker/kernels/activations.py: int8 per block of 32 (bf16: and bf16 rows by activations rounded to bf16,
# node_worker/kernels/bf16dp.py), or float32 as they are
ACTIVATIONS = ("q8", "bf16", "f32")
KV_DTYPES = ("auto", "f32", "bf16")  # auto: bf16 on a GPU, f32 on the host
LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")  # names logging.basicConfig takes


@dataclass(frozen=True)
class EngineConfig:
    pool: str = "inproc"  # "inproc": experts run in this process; "process": one node worker process per node
    numa_split: bool = False  # cut every CPU expert by rows across the nodes
    nodes: int | None = None  # nodes in split mode (virtual when the machine has fewer); None = all
    route_tail_skip: float = 0.0  # drop routed experts whose weight is below this; 0 = off
    max_seq_len: int | None = None  # refuse longer sequences; None = the model's max_position_embeddings
    pool_node: int = 0  # the node that holds whole experts when not split
    worker_threads: int | None = None  # threads per node worker; None = the node's CPUs
    pool_spin_us: float = 0.0  # how long a waiting side polls before it blocks
    keep_shm: bool = False  # leave the segments in /dev/shm at exit, for a fast restart
    worker_start_timeout: float = 600.0  # seconds a node worker may take to load and say hello
    device: str = "auto"  # "auto" | "cpu" | "cuda": where the coordinator's device side runs
    expert_profile: str | None = None  # path of a frozen expert profile (strata profile)
    gpu_experts: int | None = None  # keep this many experts whole on the device (hottest, or per layer by index)
    gpu_expert_memory: float | None = None  # or as many of the hottest as fit in this many GB
    worker_hang_timeout: float | None = None  # seconds a node worker may stay silent on a layer; None = derived
    worker_restart_window: float = 30.0  # a second worker death within this many seconds is not restarted at once
    prefill_chunk: int = 512  # prompt tokens prefilled per serving step, interleaved with decode steps
    worker_log_level: str = "WARNING"  # logging level of the node worker processes (a LOG_LEVELS name)
    # how CPU experts are stored: auto (as the file has them) | f32 | bf16 | q8 | q4 | q4k | q5k | q6k | iq4xs
    expert_dtype: str = "auto"
    # the device side's dense matrices: auto (the file's own: a GGUF file's quantised ones as the file has them;
    # on a GPU BF16, F16 and FP8 ones as bf16, on the host float32) | f32 | bf16 | q8 | q4
    dense_dtype: str = "auto"
    kv_dtype: str = "auto"  # the KV cache's values: auto (bf16 on a GPU, f32 on the host) | f32 | bf16 (GPU only)
    # dot products with quantised weights: "q8" multiplies them in integers by the activations quantised to int8
    # (as llama.cpp does): per block of 32 for q8 and q4, per super-block of 256 for the K types and IQ4_XS;
    # bf16 rows by the float32 activations, exactly. "bf16": the same, and bf16 rows by the activations rounded
    # to bf16 (llama.cpp's BF16 arithmetic: vdpbf16ps on AVX-512 BF16). "f32" widens the weights to float (the
    # reference)
    activations: str = "q8"
    # batch-invariant numerics: every row of a step summed in an order fixed by the row alone (never by the rows
    # beside it), so a sequence's logits are the same bits alone, batched, with drafts or prefilled in chunks
    # (greedy output with drafts is greedy output without); off: BLAS on decoded tiles and the chunked linear
    # attention where they are faster for many rows
    batch_invariant: bool = True
    # speculative decoding (coordinator/speculative.py): off | ngram (prompt lookup) | mtp (the model's MTP layer)
    # | auto (mtp where the model has the layer, else ngram); draft_max: drafts tried per step at most
    speculative: str = "off"
    draft_max: int = DEFAULT_DRAFT_MAX
    # graph-ready decode steps on a GPU with the process pool (docs/gpu.md): the routing split on the device, the pool
    # rung and waited from the CUDA stream, the step's memory from a buffer per batch bucket; off: every step eager
    graph: bool = True
    # graph-ready steps captured as CUDA graphs, one a step's shape, replayed from its second step; off: queued
    # launch by launch every step (graph-ready still)
    graph_capture: bool = True

    def __post_init__(self):
        if self.pool not in POOLS:
            raise ConfigValueError(f"pool {self.pool!r} is not known; expected one of {', '.join(POOLS)}")
        if not isinstance(self.numa_split, bool):
            raise ConfigValueError(f"numa_split must be True or False, got {self.numa_split!r}")
        if self.nodes is not None and (not isinstance(self.nodes, int) or isinstance(self.nodes, bool) or self.nodes < 1):
            raise ConfigValueError(f"nodes must be a positive integer or None, got {self.nodes!r}")
        if self.nodes not in (None, 1) and not self.numa_split:
            raise ConfigValueError(f"nodes={self.nodes} needs numa_split=True (without it one node holds every expert)")
        if not isinstance(self.route_tail_skip, (int, float)) or not 0 <= self.route_tail_skip < 1:
            raise ConfigValueError(f"route_tail_skip must be in [0, 1), got {self.route_tail_skip!r}")
        if not isinstance(self.pool_node, int) or self.pool_node < 0:
            raise ConfigValueError(f"pool_node must be a node number >= 0, got {self.pool_node!r}")
        if self.numa_split and self.pool_node != 0:
            raise ConfigValueError("pool_node selects the one node of non-split mode; it cannot be set with numa_split")
        if self.worker_threads is not None and (not isinstance(self.worker_threads, int) or self.worker_threads < 1):
            raise ConfigValueError(f"worker_threads must be a positive integer or None, got {self.worker_threads!r}")
        if not isinstance(self.pool_spin_us, (int, float)) or self.pool_spin_us < 0:
            raise ConfigValueError(f"pool_spin_us must be >= 0, got {self.pool_spin_us!r}")
        if not isinstance(self.worker_start_timeout, (int, float)) or self.worker_start_timeout <= 0:
            raise ConfigValueError(f"worker_start_timeout must be > 0 seconds, got {self.worker_start_timeout!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.gpu_experts is not None and (not isinstance(self.gpu_experts, int) or self.gpu_experts < 0):
            raise ConfigValueError(f"gpu_experts must be an integer >= 0, got {self.gpu_experts!r}")
        if self.gpu_expert_memory is not None and (not isinstance(self.gpu_expert_memory, (int, float))
                                                   or self.gpu_expert_memory < 0):
            raise ConfigValueError(f"gpu_expert_memory must be a number of GB >= 0, got {self.gpu_expert_memory!r}")
        if self.gpu_experts is not None and self.gpu_expert_memory is not None:
            raise ConfigValueError("give gpu_experts or gpu_expert_memory, not both")
        if self.gpu_expert_memory is not None and self.expert_profile is None:
            raise ConfigValueError("gpu_expert_memory places the hottest experts: it needs expert_profile")
        if self.worker_hang_timeout is not None and (not isinstance(self.worker_hang_timeout, (int, float))
                                                     or not self.worker_hang_timeout > 0):
            raise ConfigValueError(f"worker_hang_timeout must be > 0 seconds or None, got {self.worker_hang_timeout!r}")
        if not isinstance(self.worker_restart_window, (int, float)) or not self.worker_restart_window >= 0:
            raise ConfigValueError(f"worker_restart_window must be >= 0 seconds, got {self.worker_restart_window!r}")
        if not isinstance(self.prefill_chunk, int) or isinstance(self.prefill_chunk, bool) or self.prefill_chunk < 1:
            raise ConfigValueError(f"prefill_chunk must be a positive number of tokens, got {self.prefill_chunk!r}")
        if self.max_seq_len is not None and (not isinstance(self.max_seq_len, int) or self.max_seq_len < 1):
            raise ConfigValueError(f"max_seq_len must be a positive integer or None, got {self.max_seq_len!r}")
        if self.expert_dtype not in EXPERT_DTYPES:
            raise ConfigValueError(f"expert_dtype must be one of {', '.join(EXPERT_DTYPES)}, got {self.expert_dtype!r}")
        if self.dense_dtype not in DENSE_DTYPES:
            raise ConfigValueError(f"dense_dtype must be one of {', '.join(DENSE_DTYPES)}, got {self.dense_dtype!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.activations not in ACTIVATIONS:
            raise ConfigValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {self.activations!r}")
        if not isinstance(self.batch_invariant, bool):
            raise ConfigValueError(f"batch_invariant must be True or False, got {self.batch_invariant!r}")
        if self.speculative not in SPECULATIVE_MODES:
            raise ConfigValueError(f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, "
                                   f"got {self.speculative!r}")
        if not isinstance(self.draft_max, int) or isinstance(self.draft_max, bool) or not 1 <= self.draft_max <= 16:
            raise ConfigValueError(f"draft_max must be an integer in [1, 16], got {self.draft_max!r}")
        if self.worker_log_level not in LOG_LEVELS:
            raise ConfigValueError(f"worker_log_level must be one of {', '.join(LOG_LEVELS)}, "
                                   f"got {self.worker_log_level!r}")


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{text!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def parse_optional_int(text: str) -> int | None:
    return None if text.strip() in ("", "auto") else int(text)


def parse_optional_float(text: str) -> float | None:
    return None if text.strip() in ("", "auto") else float(text)


def parse_log_level(text: str) -> str:
    return text.strip().upper()


# field -> (environment variable, parser of its text)
ENV_VARS: dict[str, tuple[str, Callable[[str], object]]] = {
    "pool": ("STRATA_POOL", str),
    "numa_split": ("STRATA_NUMA_SPLIT", parse_bool),
    "nodes": ("STRATA_NODES", parse_optional_int),
    "route_tail_skip": ("STRATA_ROUTE_TAIL_SKIP", float),
    "max_seq_len": ("STRATA_MAX_SEQ_LEN", parse_optional_int),
    "pool_node": ("STRATA_POOL_NODE", int),
    "worker_threads": ("STRATA_WORKER_THREADS", parse_optional_int),
    "pool_spin_us": ("STRATA_POOL_SPIN_US", float),
    "keep_shm": ("STRATA_KEEP_SHM", parse_bool),
    "worker_start_timeout": ("STRATA_WORKER_START_TIMEOUT", float),
    "device": ("STRATA_DEVICE", str),
    "expert_profile": ("STRATA_EXPERT_PROFILE", str),
    "gpu_experts": ("STRATA_GPU_EXPERTS", parse_optional_int),
    "gpu_expert_memory": ("STRATA_GPU_EXPERT_MEMORY", float),
    "worker_hang_timeout": ("STRATA_WORKER_HANG_TIMEOUT", parse_optional_float),
    "worker_restart_window": ("STRATA_WORKER_RESTART_WINDOW", float),
    "prefill_chunk": ("STRATA_PREFILL_CHUNK", int),
    "worker_log_level": ("STRATA_WORKER_LOG", parse_log_level),
    "expert_dtype": ("STRATA_EXPERT_DTYPE", str),
    "dense_dtype": ("STRATA_DENSE_DTYPE", str),
    "kv_dtype": ("STRATA_KV_DTYPE", str),
    "activations": ("STRATA_ACTIVATIONS", str),
    "batch_invariant": ("STRATA_BATCH_INVARIANT", parse_bool),
    "speculative": ("STRATA_SPECULATIVE", str),
    "draft_max": ("STRATA_DRAFT_MAX", int),
    "graph": ("STRATA_GRAPH", parse_bool),
    "graph_capture": ("STRATA_GRAPH_CAPTURE", parse_bool),
}

API_KEY_VAR = "STRATA_API_KEY"  # ``strata serve --http``: the Bearer key /v1/* requires (--api-key), not the engine's


def resolve_api_key(flag: str | None = None, environ: Mapping[str, str] | None = None) -> str | None:
    """The Bearer key ``strata serve --http`` asks for: --api-key over STRATA_API_KEY; None: no key."""
    environ = os.environ if environ is None else environ
    return flag or environ.get(API_KEY_VAR) or None


def _parse_env(var: str, parse: Callable[[str], object], environ: Mapping[str, str]) -> object:
    try:
        return parse(environ[var])
    except ValueError as exc:
        raise ConfigValueError(f"{var}={environ[var]!r}: {exc}") from None


def resolve_config(
    flags: Mapping[str, object] | None = None, environ: Mapping[str, str] | None = None,
    defaults: Mapping[str, object] | None = None,
) -> tuple[EngineConfig, dict[str, str]]:
    """Build the effective config; returns it and, per field, where its value came from."""
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    environ = os.environ if environ is None else environ
    values: dict[str, object] = {}
    sources: dict[str, str] = {}
    for f in dataclasses.fields(EngineConfig):
        var, parse = ENV_VARS[f.name]
        if f.name in flags:
            values[f.name], sources[f.name] = flags[f.name], "flag"
        elif var in environ:
            values[f.name], sources[f.name] = _parse_env(var, parse, environ), f"env {var}"
        elif defaults and f.name in defaults:
            values[f.name], sources[f.name] = defaults[f.name], "default (command line)"
        else:
            sources[f.name] = "default"
    unknown = sorted(set(flags) - {f.name for f in dataclasses.fields(EngineConfig)})
    if unknown:
        raise ConfigValueError(f"unknown config field(s): {', '.join(unknown)}")
    return EngineConfig(**values), sources  # type: ignore[arg-type]
