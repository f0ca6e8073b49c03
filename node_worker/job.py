"""WorkerJob: everything a node worker needs to build its store and serve, as one typed document.

The coordinator builds it (coordinator/engine.py), the pool writes it once as
JSON into its private 0700 folder, and each worker process reads it
(``python -m node_worker --job FILE --node N --identity ID --parent-pid PID``:
only what differs between incarnations travels on the command line). JSON
written by ``to_json`` and read by ``from_json``, nowhere else; reading checks
every field's type and names the one at fault.

    WorkerJob
      model_dir, model_digest          the checkpoint and the digest of its CPU side
      hidden, num_layers, num_experts, intermediate, moe_layers
      plan                             the pool plan (shm.plan.plan_to_dict)
      max_tokens, max_message_bytes    per-request bounds the worker enforces
      endpoint                         the pool's ipc:// ROUTER endpoint
      spin_us, keep_shm, log_level     settings from EngineConfig
      expert_format                    how the segment stores the experts (shm/formats)
      nodes: [NodeJob]                 per node: cpus, threads, real node of its memory, free bytes
      experts: [ExpertJob]             per (layer, expert): intermediate size, gate/up/down tensor refs
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

from shm.expert_source import ExpertRefs, TensorRef

MESSAGE_SLACK_BYTES = 1 << 20  # room beside X and Y in the largest message


class JobError(ValueError):
    """A job file that is not a WorkerJob; the message names the field."""


@dataclass(frozen=True)
class NodeJob:
    node: int
    local_node: int  # the real node whose memory it uses (a virtual node's parent)
    cpus: tuple[int, ...]
    threads: int
    node_free: int = 0  # bytes free on the node at planning time; 0 = unknown

    @classmethod
    def from_dict(cls, d) -> "NodeJob":
        if not isinstance(d, dict):
            raise JobError(f"a node entry must be an object, got {type(d).__name__}")
        return cls(_typed(d, "node", int), _typed(d, "local_node", int), tuple(_int_list(d, "cpus")),
                   _typed(d, "threads", int), _typed(d, "node_free", int))


@dataclass(frozen=True)
class ExpertJob:
    layer: int
    expert: int
    intermediate: int
    refs: ExpertRefs

    def to_dict(self) -> dict:
        return {"layer": self.layer, "expert": self.expert, "intermediate": self.intermediate,
                "refs": {k: asdict(getattr(self.refs, k)) for k in ("gate", "up", "down")}}

    @classmethod
    def from_dict(cls, d) -> "ExpertJob":
        if not isinstance(d, dict):
            raise JobError(f"an expert entry must be an object, got {type(d).__name__}")
        refs = d.get("refs")
        if not isinstance(refs, dict) or set(refs) != {"gate", "up", "down"}:
            raise JobError(f"expert entry {d!r}: 'refs' must hold gate, up and down")
        try:
            made = {k: TensorRef(**v) for k, v in refs.items()}
        except TypeError as exc:
            raise JobError(f"expert entry {d!r}: {exc}") from None
        return cls(_typed(d, "layer", int), _typed(d, "expert", int), _typed(d, "intermediate", int),
                   ExpertRefs(made["gate"], made["up"], made["down"]))


@dataclass(frozen=True)
class WorkerJob:
    model_dir: str
    model_digest: str
    hidden: int
    num_layers: int
    num_experts: int
    intermediate: int
    moe_layers: tuple[int, ...]
    plan: dict
    max_tokens: int
    max_message_bytes: int
    nodes: tuple[NodeJob, ...]
    experts: tuple[ExpertJob, ...]
    endpoint: str = ""  # set by the pool once its socket is bound
    spin_us: float = 0.0
    keep_shm: bool = False
    log_level: str = "WARNING"
    expert_format: str = "f32"  # shm/formats: how the experts are stored in the segment
    activations: str = "q8"  # EngineConfig.activations: integer dot products in decode, or float32
    pool_io: str = ""  # the pool's data-path segment (shm/pool_io.py), set by the pool

    def node(self, node: int) -> NodeJob:
        for n in self.nodes:
            if n.node == node:
                return n
        raise JobError(f"node {node} is not in this job (nodes {[n.node for n in self.nodes]})")

    def expert_map(self) -> dict[tuple[int, int], tuple[ExpertRefs, int]]:
        """(layer, expert) -> (its tensor refs, its intermediate size), as the node store takes it."""
        return {(e.layer, e.expert): (e.refs, e.intermediate) for e in self.experts}

    def to_json(self) -> str:
        doc = {f.name: getattr(self, f.name) for f in fields(self)}
        doc["nodes"] = [asdict(n) for n in self.nodes]
        doc["experts"] = [e.to_dict() for e in self.experts]
        return json.dumps(doc)

    @classmethod
    def from_json(cls, text: str) -> "WorkerJob":
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise JobError(f"the job is not JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise JobError("the job must be a JSON object")
        missing = sorted({f.name for f in fields(cls)} - set(doc))
        if missing:
            raise JobError(f"the job lacks {', '.join(missing)}")
        nodes = tuple(NodeJob.from_dict(n) for n in _list(doc, "nodes"))
        return cls(
            model_dir=_typed(doc, "model_dir", str), model_digest=_typed(doc, "model_digest", str),
            hidden=_typed(doc, "hidden", int), num_layers=_typed(doc, "num_layers", int),
            num_experts=_typed(doc, "num_experts", int), intermediate=_typed(doc, "intermediate", int),
            moe_layers=tuple(_int_list(doc, "moe_layers")), plan=_typed(doc, "plan", dict),
            max_tokens=_typed(doc, "max_tokens", int), max_message_bytes=_typed(doc, "max_message_bytes", int),
            nodes=nodes, experts=tuple(ExpertJob.from_dict(e) for e in _list(doc, "experts")),
            endpoint=_typed(doc, "endpoint", str), spin_us=float(_typed(doc, "spin_us", (int, float))),
            keep_shm=_typed(doc, "keep_shm", bool), log_level=_typed(doc, "log_level", str),
            expert_format=_typed(doc, "expert_format", str), pool_io=_typed(doc, "pool_io", str),
            activations=_typed(doc, "activations", str),
        )


def max_message_bytes(max_tokens: int, hidden: int) -> int:
    """The largest message either side sends: X or Y of ``max_tokens`` float32 rows, twice, and slack."""
    return max_tokens * hidden * 4 * 2 + MESSAGE_SLACK_BYTES


def _typed(doc: dict, key: str, kind):
    v = doc.get(key)
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise JobError(f"job field {key!r} must be {names}, got {type(v).__name__}")
    return v


def _list(doc: dict, key: str) -> list:
    return _typed(doc, key, list)


def _int_list(doc: dict, key: str) -> list[int]:
    items = _list(doc, key)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        raise JobError(f"job field {key!r} must be a list of integers")
    return items
