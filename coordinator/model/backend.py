"""The backend protocol: what the network asks of the side it runs on, chosen once when an engine opens.

The decoder calls ``backend.rms_norm(...)``, ``backend.gqa_attention(...)``, ``backend.route(...)`` and never asks
which side it is on (vLLM's ``CustomOp`` resolves its forward in ``__init__`` the same way). This base class is the
reference: model/ops.py's forms on NumPy arrays, kept as what the others are tested against. Two backends extend
it, each in its own package, and import this one, never each other:

    coordinator/host/backend.py   HostBackend: the coordinator's compiled loops (numba) where the shapes allow
    coordinator/gpu/backend.py    GpuBackend: CuPy arrays, the CUDA kernels, weights in their storage formats,
                                  page-locked staging, the experts' side stream, graph-ready decode steps

At open a backend says what its side needs before anything is read (``check_memory``), which routed experts it
keeps beside the network (``place``) and puts the weights there (``load``): the engine's open is wiring around
those. Besides the numerics, a backend says where the network's arrays live (``xp``, ``upload``, ``to_host``), how the
pool's rows travel (``rows_to_host``, ``partials_buffer``, ``to_device``, ``side_stream``), and what a GPU adds
(``fuse_qkv``, ``kv_b_heads``, ``linear_states``, ``graph_runner``); the host's answers are the trivial ones here.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import numpy as np

from . import ops
from .xp import to_host


@dataclass(frozen=True)
class Placement:
    """The routed experts kept beside the network, chosen at open before anything is read."""

    experts: frozenset  # (layer, e)
    chosen: str  # how they were chosen
    one_expert: int  # bytes of one where they are kept (a GPU's: the largest layer's, in its formats)
    formats: dict = field(default_factory=dict)  # a GPU's: MoE layer -> its hot experts' (gate, up, down) formats
    memory: object = None  # a GPU's memory plan (coordinator/gpu/vram.py's VramPlan), checked against its free memory


@dataclass(frozen=True)
class Loaded:
    """What a backend put where the network runs at open."""

    experts: object  # the experts kept beside it: a backend's own (their ``run``) or (layer, e) -> MLPWeights
    weights: object = None  # the dense weights placed in their storage formats (a GPU's), or None: the host's own
    dense_format: str = "f32"  # how the dense matrices are stored, for the reports
    dense_kernels: list = field(default_factory=list)  # the host's packed dense matrices' kernel sets, warmed at open
    memory: object = None  # a GPU's memory plan with what was uploaded


class WholeExperts:
    """Routed experts the device side keeps whole in float32, (layer, e) -> MLPWeights: what a backend without
    its own expert kernels runs (the NumPy side's hot experts), an expert at a time."""

    def __init__(self, experts: dict, backend: "Backend"):
        self.experts = {k: backend.upload(v) for k, v in experts.items()}
        self.backend = backend

    def keys(self):
        return list(self.experts)

    def run(self, i: int, x, tokens: np.ndarray, experts: np.ndarray, weights: np.ndarray):
        """Layer i's share [T, H] of x [T, H] for the pairs (tokens, experts, weights) [P], experts in ascending
        order, a pair's tokens in order within each."""
        xp, b = self.backend.xp, self.backend
        order = np.argsort(experts, kind="stable")  # pairs grouped by expert, token order kept within each
        ids, starts = np.unique(experts[order], return_index=True)
        ends = np.append(starts[1:], order.size)
        tokens_dev = xp.asarray(tokens[order])  # [P_dev] one upload per layer, not per expert
        weights_dev = xp.asarray(weights[order])[:, None]  # [P_dev, 1]
        y = xp.zeros_like(x)  # [T, H]
        for e, a, z in zip(ids.tolist(), starts.tolist(), ends.tolist()):
            t = tokens_dev[a:z]  # the tokens routed to expert e, each once
            mlp = self.experts[(i, e)]
            y[t] += weights_dev[a:z] * b.swiglu_mlp(x[t], mlp.gate, mlp.up, mlp.down)
        return y


class Backend:
    """The reference backend: NumPy arrays and model/ops.py's forms (see the module docstring)."""

    name = "numpy"  # what the engine's reports call it
    xp = np  # the module of the network's arrays
    gpu = False  # whether a GPU holds them (the KV cache's bf16, the GPU's memory plan)
    _partials: np.ndarray | None = None  # the host's reused partials buffer (partials_buffer)

    # -- at open ----------------------------------------------------------------------------------------------
    def check_memory(self, mcfg, config, nodes: list) -> None:
        """Refuse, naming the figures, a context the side cannot hold, before anything is read."""

    def place(self, mcfg, ckpt, config) -> Placement:
        raise NotImplementedError(f"the {self.name} backend does not load models")

    def load(self, weights, placement: Placement, ckpt, mcfg, config, compile_missing) -> Loaded:
        """The dense weights and the placed experts where the network runs (``compile_missing``: the engine's
        compiler of kernel units this build lacks)."""
        raise NotImplementedError(f"the {self.name} backend does not load models")

    # -- where arrays live ------------------------------------------------------------------------------------
    def upload(self, obj):
        """A weights dataclass (nested), list, dict or array with every host array moved to this backend's side."""
        return obj

    def to_host(self, a) -> np.ndarray:
        return to_host(a)

    def place_weights(self, weights, placed=None):
        """The model's dense weights where the network runs: ``placed`` (the same, already there in their storage
        formats) where given; the host keeps its own."""
        return weights

    def device_experts(self, experts):
        """The routed experts kept beside the network: a backend's own (their ``run``) as they are, a dict of
        whole float32 experts as WholeExperts."""
        return experts if hasattr(experts, "run") else WholeExperts(experts or {}, self)

    def attention_block(self, cfg, layer: int, lw):
        """One call for layer ``layer``'s attention half at one token (the host's: host/blocks.py), or None: the
        decoder makes the separate calls."""
        return None

    def moe_block(self, cfg, experts, norm, stats, last: bool):
        """One call for an MoE layer's half at one token whose router's pairs the attention block made (the
        host's: host/blocks.py), from the pool's ``experts`` (ExpertPool.row_experts; None: the pool takes the
        layer): the experts, the residual add and ``norm`` after it (the next layer's input norm, or the final
        norm where ``last``), the pairs counted into ``stats`` (RoutingStats); or None: the separate calls."""
        return None

    def fuse_qkv(self, lw):
        """(the layer, its q, k and v as one matrix (decoder.FusedQKV) or None): the host keeps three matrices."""
        return lw, None

    def kv_b_heads(self, kv_b, nh: int, dn: int, dv: int, c: int):
        """MLA's (W_uk [nh, dn, c], W_uv [nh, dv, c]): views of kv_b's rows."""
        heads = kv_b.reshape(nh, dn + dv, c)  # [nh, dn+dv, c]
        return heads[:, :dn], heads[:, dn:]

    # -- the pool's traffic ---------------------------------------------------------------------------------
    def rows_to_host(self, a) -> np.ndarray:
        """Rows [T, H] for the pool, on the host and complete on return."""
        return np.ascontiguousarray(a)

    def partials_buffer(self, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        """A reused host array [T, H] the pool sums the nodes' partials into."""
        n = math.prod(shape)  # not np.prod: a decode step asks for it every layer
        if self._partials is None or self._partials.size < n or self._partials.dtype != np.dtype(dtype):
            self._partials = np.empty(max(n, 1 << 16), dtype)
        return self._partials[:n].reshape(shape)

    def to_device(self, host: np.ndarray):
        """The partials buffer where the network runs (here it is)."""
        return host

    def side_stream(self):
        """A context in which the device experts' work is queued apart from the pool's wait (here: in order)."""
        return contextlib.nullcontext()

    def join_side(self) -> None:
        """The network's later work after what side_stream queued (here: nothing to wait for)."""

    # -- numerics: model/ops.py's reference forms -----------------------------------------------------------
    def rms_norm(self, x, weight, eps: float):
        return ops.rms_norm(x, weight, eps)

    def add_rms_norm(self, h, delta, weight, eps: float):
        total = h + delta
        return total, self.rms_norm(total, weight, eps)

    def norm_rope(self, x, weight, eps: float, cos, sin):
        return self.apply_rope(self.rms_norm(x, weight, eps) if weight is not None else x, cos, sin)

    def apply_rope(self, x, cos, sin):
        return ops.apply_rope(x, cos, sin)

    def apply_rope_interleaved(self, x, cos, sin):
        return ops.apply_rope_interleaved(x, cos, sin)

    def swiglu_mlp(self, x, gate, up, down):
        return ops.swiglu_mlp(x, gate, up, down)

    def sigmoid(self, x):
        return ops.sigmoid(x)

    def widen(self, a):
        return ops.widen(a)

    def masked_softmax(self, scores, mask, scale: float):
        return ops.masked_softmax(scores, mask, scale)

    def gqa_attention(self, q, k, v, mask):
        """q [T, nh, hd], k/v [S, nkv, hd], mask [T, S] -> [T, nh*hd] (ops.gqa_attention)."""
        return ops.gqa_attention(q, k, v, mask, self.widen, self.masked_softmax)

    def mla_attention(self, rows: ops.MlaRows, k_nope, v, mask, scale: float):
        """rows' queries over the latents expanded through kv_b: k_nope [S, nh, dn], v [S, nh, dv]."""
        return ops.mla_attention(rows, k_nope, v, mask, scale, self.widen, self.masked_softmax)

    def mla_attention_absorbed(self, rows: ops.MlaRows, w_uk, w_uv, mask, scale: float):
        """rows' queries over their cached latents without expanding them (ops.mla_attention_absorbed)."""
        widened = ops.MlaRows(rows.q_nope, rows.q_rope, self.widen(rows.latent), self.widen(rows.k_rope))
        return ops.mla_attention_absorbed(widened, w_uk, w_uv, mask, scale)

    def route(self, logits, bias, spec: ops.RouterSpec) -> tuple[np.ndarray, np.ndarray]:
        """The router's choice by ``spec`` from logits [T, E] (bias [E] or None): (ids [T, k] int64,
        weights [T, k] float32) on the host, where the pair bookkeeping runs."""
        return ops.route(logits, bias, spec)

    # -- what a GPU adds ------------------------------------------------------------------------------------
    def to_bf16(self, x, out):
        raise NotImplementedError(f"the {self.name} backend keeps float32 caches")

    def linear_states(self, lc, layers: list[int]):
        """The Gated DeltaNet layers' states of one sequence kept together (a GPU's), or None: each layer keeps
        its own in the cache (linear_attention.LinearState)."""
        return None

    def linear_step(self, seqs, lengths: list[int]):
        """A step's Gated DeltaNet tables (a GPU's one kernel a layer), or None: the layers run in model/."""
        return None

    def linear_layer(self, lw, cfg, x, i: int, step, bounds):
        raise NotImplementedError(f"the {self.name} backend runs Gated DeltaNet layers in model/")

    def graph_runner(self, decoder, context: int | None, capture: bool, step_buffer: int):
        """What runs small decode steps as CUDA graphs around the decoder's forward, or None (always here)."""
        return None
