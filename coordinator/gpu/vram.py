"""The device's memory by category, computed from the checkpoint's index before anything is uploaded.

    dense        every non-expert matrix and vector the device holds, in its storage format (storage.py)
    hot experts  the routed experts kept whole on the device, each at its real size in its format
    kv cache     max_seq_len tokens of one sequence over the attention layers, in the cache's dtype, and
                 that sequence's Gated DeltaNet states (Qwen3-Next: float32, two buffers)
    scratch      what a prefill chunk needs besides: its activations, the attention's scores over the
                 whole context, a dequantised tile of the widest matrix, MLA's dequantised kv_b
    decode steps the graph-ready steps' one buffer (arena.py), made at open for the largest step
                 (step_bytes of graph_steps.MAX_ROWS rows over the whole context)

``VramPlan.check`` refuses a plan larger than the free memory, with every category's figure;
``fit_experts`` says how many hot experts fit in a budget. The tensor list mirrors
coordinator/model/weights.py (tests/test_vram.py holds them equal on every architecture).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from ..errors import StrataError
from ..model.arch import family
from ..model.model_config import ModelConfig
from . import storage

GB = 1e9
# rows of a quantised matrix dequantised at once for a prefill's cuBLAS product (device/weights.py)
TILE_ROWS = 4096
ACTIVATION_COPIES = 8  # [T, width] float32 arrays a layer holds at once at its widest (x, h, q|k|v, gate, up, ...)


class VramError(StrataError):
    """The model does not fit the device's memory; the message gives each category's bytes and the free memory."""


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    matrix: bool  # read along its rows by the kernels (a stored format); else float32 (norms, biases, router)


def _mlp(prefix: str, inter: int, hidden: int) -> list[Tensor]:
    return [Tensor(f"{prefix}.gate_proj.weight", (inter, hidden), True),
            Tensor(f"{prefix}.up_proj.weight", (inter, hidden), True),
            Tensor(f"{prefix}.down_proj.weight", (hidden, inter), True)]


def _attention(cfg: ModelConfig, attn: str) -> list[Tensor]:
    H, hd, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    if cfg.mla is not None:
        m = cfg.mla
        q_out = nh * m.qk_head_dim
        q = ([Tensor(f"{attn}.q_proj.weight", (q_out, H), True)] if m.q_lora_rank is None else
             [Tensor(f"{attn}.q_a_proj.weight", (m.q_lora_rank, H), True),
              Tensor(f"{attn}.q_a_layernorm.weight", (m.q_lora_rank,), False),
              Tensor(f"{attn}.q_b_proj.weight", (q_out, m.q_lora_rank), True)])
        return q + [Tensor(f"{attn}.kv_a_proj_with_mqa.weight", (m.kv_lora_rank + m.qk_rope_head_dim, H), True),
                    Tensor(f"{attn}.kv_a_layernorm.weight", (m.kv_lora_rank,), False),
                    Tensor(f"{attn}.kv_b_proj.weight", (nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
                           True),
                    Tensor(f"{attn}.o_proj.weight", (H, nh * m.v_head_dim), True)]
    q_rows = 2 * nh * hd if cfg.attn_output_gate else nh * hd  # Qwen3-Next: a gate row per query row
    out = [Tensor(f"{attn}.q_proj.weight", (q_rows, H), True), Tensor(f"{attn}.k_proj.weight", (nkv * hd, H), True),
           Tensor(f"{attn}.v_proj.weight", (nkv * hd, H), True), Tensor(f"{attn}.o_proj.weight", (H, nh * hd), True)]
    if cfg.qkv_bias:
        out += [Tensor(f"{attn}.{p}_proj.bias", (n * hd,), False) for p, n in (("q", nh), ("k", nkv), ("v", nkv))]
    if cfg.qk_norm:
        out += [Tensor(f"{attn}.q_norm.weight", (hd,), False), Tensor(f"{attn}.k_norm.weight", (hd,), False)]
    return out


def _linear_attention(cfg: ModelConfig, prefix: str) -> list[Tensor]:
    """A Gated DeltaNet layer's tensors as a transformers checkpoint names them (Qwen3-Next)."""
    lc, H = cfg.linear, cfg.hidden_size
    Hk, Hv, dk, dv = lc.key_heads, lc.value_heads, lc.key_head_dim, lc.value_head_dim
    return [Tensor(f"{prefix}.in_proj_qkvz.weight", (2 * Hk * dk + 2 * Hv * dv, H), True),
            Tensor(f"{prefix}.in_proj_ba.weight", (2 * Hv, H), True),
            Tensor(f"{prefix}.conv1d.weight", (lc.conv_dim, 1, lc.conv_kernel), False),
            Tensor(f"{prefix}.A_log", (Hv,), False), Tensor(f"{prefix}.dt_bias", (Hv,), False),
            Tensor(f"{prefix}.norm.weight", (dv,), False), Tensor(f"{prefix}.out_proj.weight", (H, Hv * dv), True)]


def _layer_tensors(cfg: ModelConfig, i: int) -> list[Tensor]:
    """Layer i's non-expert tensors by checkpoint name."""
    H = cfg.hidden_size
    base = f"model.layers.{i}"
    moe = f"{base}.{family(cfg.arch).moe_block}"
    out = [Tensor(f"{base}.input_layernorm.weight", (H,), False),
           Tensor(f"{base}.post_attention_layernorm.weight", (H,), False)]
    out += (_linear_attention(cfg, f"{base}.linear_attn") if cfg.is_linear(i)
            else _attention(cfg, f"{base}.self_attn"))
    if not cfg.sparse_layers[i]:
        return out + _mlp(f"{base}.mlp", cfg.dense_intermediate_size, H)
    out.append(Tensor(f"{moe}.gate.weight", (cfg.num_experts, H), False))
    if cfg.group_router is not None and (cfg.mla is None or cfg.group_router.scoring == "sigmoid"):
        out.append(Tensor(f"{moe}.gate.e_score_correction_bias", (cfg.num_experts,), False))
    if cfg.shared_expert_intermediate_size > 0:
        gated = cfg.mla is None and cfg.shared_expert_gate
        out += _mlp(f"{moe}.shared_expert{'' if gated else 's'}", cfg.shared_expert_intermediate_size, H)
        if gated:
            out.append(Tensor(f"{moe}.shared_expert_gate.weight", (1, H), False))
    return out


def dense_tensors(cfg: ModelConfig) -> list[Tensor]:
    """Every non-expert tensor the device side holds, by checkpoint name (the embedding stays on the host;
    lm_head is counted when the embedding is tied too: the device holds its own copy). The MTP layer's
    (layer num_layers) are uploaded as float32 (Decoder._mtp_weights), so they count as such; its head is
    counted as the model's lm_head, which the checkpoints that ship one hold a copy of (weights._mtp)."""
    H = cfg.hidden_size
    out: list[Tensor] = []
    for i in range(cfg.num_layers):
        out += _layer_tensors(cfg, i)
    out.append(Tensor("model.norm.weight", (H,), False))
    out.append(Tensor("lm_head.weight", (cfg.vocab_size, H), True))
    if cfg.mtp_layers:
        L = cfg.num_layers
        mtp = _layer_tensors(cfg, L) + [Tensor(f"model.layers.{L}.enorm.weight", (H,), False),
                                        Tensor(f"model.layers.{L}.hnorm.weight", (H,), False),
                                        Tensor(f"model.layers.{L}.eh_proj.weight", (H, 2 * H), False),
                                        Tensor(f"model.layers.{L}.shared_head.norm.weight", (H,), False)]
        out += [dataclasses.replace(t, matrix=False) for t in mtp]
    return out


def tensor_bytes(t: Tensor, dtype: str, dense_dtype: str) -> tuple[int, str]:
    """(device bytes, storage format) of one tensor whose checkpoint type is ``dtype``."""
    if not t.matrix:
        n = 1
        for d in t.shape:
            n *= d
        return 4 * n, "f32"
    fmt = storage.matrix_format(dtype, dense_dtype, t.shape[1])
    return storage.matrix_bytes(fmt, *t.shape), fmt


def expert_bytes(cfg: ModelConfig, gate_up: tuple[str, str, str]) -> int:
    """Device bytes of one whole routed expert whose (gate, up, down) are stored as ``gate_up``'s formats."""
    H, inter = cfg.hidden_size, cfg.moe_intermediate_size
    g, u, d = gate_up
    return storage.matrix_bytes(g, inter, H) + storage.matrix_bytes(u, inter, H) + storage.matrix_bytes(d, H, inter)


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str) -> int:
    """Bytes of one cached token over all layers, the MTP layer's cache among them where the model has one
    (it drafts beside the model's): f32 4 a value, bf16 2."""
    layers = len(cfg.attention_layers) + cfg.mtp_layers
    return cfg.kv_bytes_per_token // max(1, len(cfg.attention_layers)) * layers // 4 * (2 if kv_dtype == "bf16" else 4)


def state_bytes(cfg: ModelConfig) -> int:
    """One sequence's Gated DeltaNet states on the device: float32, two buffers (linear_attention.DeviceLinearStates:
    a step reads one and writes the other); 0 without such layers."""
    return 2 * cfg.state_bytes_per_sequence


def scratch_bytes(cfg: ModelConfig, chunk: int, context: int, widest_row: int) -> int:
    """A prefill chunk's transient device memory (the module's table)."""
    H = cfg.hidden_size
    if cfg.mla is not None:
        m = cfg.mla
        width = max(H, cfg.num_heads * m.qk_head_dim, cfg.num_heads * (m.qk_nope_head_dim + m.v_head_dim))
        kv_b = 4 * cfg.num_heads * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank  # absorbed decode's
    else:
        width = max(H, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim)
        if cfg.linear is not None:  # a Gated DeltaNet layer's q, k, v and z rows
            width = max(width, cfg.linear.conv_dim + cfg.linear.value_heads * cfg.linear.value_head_dim)
        kv_b = 0
    inter = max(cfg.dense_intermediate_size if not all(cfg.sparse_layers) else 0,
                cfg.shared_expert_intermediate_size, cfg.moe_intermediate_size)
    activations = 4 * chunk * ACTIVATION_COPIES * max(width, inter)
    scores = 4 * cfg.num_heads * chunk * context
    tile = 4 * TILE_ROWS * widest_row
    logits = 4 * chunk * cfg.vocab_size
    return activations + scores + tile + kv_b + logits


STEP_SLACK = 64 * 256  # the step arena's rounding: up to 64 arrays live at once, each up to 256 bytes over


def step_terms(cfg: ModelConfig, rows: int, context: int, nodes: int = 8) -> dict:
    """step_bytes' parts in float32 values: ``kept`` (every layer's residual rows), one layer's ``attention``
    (of which ``attention_scratch``: the split-K partials or MLA's), its ``moe`` and ``dense`` MLP, and lm_head's
    ``logits``."""
    T, H = rows, cfg.hidden_size
    nh = cfg.num_heads
    if cfg.mla is not None:
        from .ops import mla_max_splits

        m = cfg.mla
        c, dr, dn, dv = m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim
        q_width = nh * m.qk_head_dim
        scratch = T * nh * c + T * nh * mla_max_splits(nh, context, c, dr) * (c + 2)  # q_lat, the partials
        attention = (T * ((m.q_lora_rank or 0) + 2 * q_width + 2 * (c + dr) + nh * dv + H)  # projections, roped
                     + T * nh * (c + dr)  # the absorbed queries
                     + scratch + T * nh * c)  # out_lat where kv_b is compact (read as it lies, never widened)
    else:
        from .ops import gqa_max_splits

        hd = cfg.head_dim
        scratch = T * nh * gqa_max_splits(context) * (hd + 2)  # the split-K partials and their (max, sum)
        attention = T * ((nh + 2 * cfg.num_kv_heads) * hd * 2 + 2 * nh * hd + H) + scratch  # qkv, q and k roped
    k, E = cfg.top_k, cfg.num_experts
    inter = max(cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size)
    moe = (T * (E + 2 * k) + 2 * (3 * T * k + 2) + 2 * E  # router logits, packed pairs, the split, its marks
           + 3 * T * k * inter + T * H  # the hot experts' rows
           + 3 * T * inter + T * H  # the shared experts'
           + nodes * T * H + T * H)  # the pool's partials, the sum
    dense = 3 * T * cfg.dense_intermediate_size if not all(cfg.sparse_layers) else 0
    return {"kept": 4 * T * H, "attention": attention, "attention_scratch": scratch, "moe": moe, "dense": dense,
            "logits": T * cfg.vocab_size}


def step_bytes(cfg: ModelConfig, rows: int, context: int, nodes: int = 8) -> int:
    """A graph-ready decode step's peak device memory for ``rows`` rows over caches of ``context`` tokens
    (coordinator/gpu/arena.py: the step's arrays planned by lifetimes, so one layer's transients at a time):
    what every layer keeps (the residual rows) and the largest of one layer's attention, its MoE or dense MLP,
    and lm_head's logits. ``nodes``: the pool's partials, one [rows, H] a node (8 covers every machine here)."""
    t = step_terms(cfg, rows, context, nodes)
    return 4 * (t["kept"] + max(t["attention"], t["moe"], t["dense"], t["logits"])) + STEP_SLACK


@dataclass(frozen=True)
class VramPlan:
    """What the device will hold, in bytes by category, before any of it is uploaded."""

    dense: int
    hot_experts: int
    kv: int
    scratch: int
    experts: int  # hot experts counted in hot_experts
    expert_bytes: int  # one of them, at its real size
    kv_tokens: int
    dense_formats: str  # "288 q4k, 49 q6k, 97 f32"
    states: int = 0  # of kv: one sequence's Gated DeltaNet states
    step: int = 0  # the graph-ready decode steps' buffer (0 where steps are eager)

    @property
    def total(self) -> int:
        return self.dense + self.hot_experts + self.kv + self.scratch + self.step

    def categories(self) -> dict[str, int]:
        return {"dense": self.dense, "hot experts": self.hot_experts, "kv cache": self.kv, "scratch": self.scratch,
                "decode steps": self.step}

    def describe(self) -> str:
        parts = [f"dense {self.dense / GB:.2f} GB ({self.dense_formats})",
                 f"hot experts {self.hot_experts / GB:.2f} GB ({self.experts} x {self.expert_bytes / 1e6:.1f} MB)",
                 f"kv cache {self.kv / GB:.2f} GB ({self.kv_tokens} tokens"
                 + (f", {self.states / 1e6:.1f} MB of Gated DeltaNet state)" if self.states else ")"),
                 f"scratch {self.scratch / GB:.2f} GB"] + ([f"decode steps {self.step / GB:.2f} GB"] if self.step else [])
        return ", ".join(parts) + f"; total {self.total / GB:.2f} GB"

    def check(self, free: int) -> None:
        """Refuse (VramError, every figure named) when the plan needs more than ``free`` bytes."""
        if self.total > free:
            raise VramError(f"the device side needs {self.total / GB:.2f} GB and the GPU has {free / GB:.2f} GB free: "
                            f"{self.describe()}. Lower --ctx-size (the kv cache), --gpu-experts or "
                            "--gpu-expert-memory, or keep the dense weights smaller (--dense-dtype q8 or q4)")

    def as_dict(self) -> dict:
        return {**{k.replace(" ", "_"): v for k, v in self.categories().items()}, "total": self.total,
                "experts": self.experts, "expert_bytes": self.expert_bytes, "kv_tokens": self.kv_tokens,
                "dense_formats": self.dense_formats}


def plan(cfg: ModelConfig, dtype_of: Callable[[str], str], dense_dtype: str, kv_dtype: str, kv_tokens: int,
         prefill_chunk: int, expert_formats: tuple[str, str, str] | None = None, experts: int = 0,
         step_rows: int = 0) -> VramPlan:
    """The device's memory for ``cfg`` whose tensors' checkpoint types ``dtype_of(name)`` gives (the index
    alone), with ``experts`` hot experts stored as ``expert_formats`` (gate, up, down); ``step_rows``: the
    largest graph-ready decode step (0: steps are eager)."""
    dense, counts, widest = 0, {}, cfg.hidden_size
    for t in dense_tensors(cfg):
        nbytes, fmt = tensor_bytes(t, dtype_of(t.name) if t.matrix else "F32", dense_dtype)
        dense += nbytes
        counts[fmt] = counts.get(fmt, 0) + 1
        if t.matrix and fmt != "f32":
            widest = max(widest, t.shape[1])
    one = expert_bytes(cfg, expert_formats) if expert_formats else 0
    chunk = min(prefill_chunk, kv_tokens)
    return VramPlan(dense, experts * one, kv_tokens * kv_bytes_per_token(cfg, kv_dtype) + state_bytes(cfg),
                    scratch_bytes(cfg, chunk, kv_tokens, widest), experts, one, kv_tokens,
                    ", ".join(f"{n} {f}" for f, n in sorted(counts.items(), key=lambda kv: -kv[1])),
                    state_bytes(cfg), step_bytes(cfg, step_rows, kv_tokens) if step_rows else 0)


def fit_experts(budget: int, one: int) -> int:
    """How many experts of ``one`` bytes fit in ``budget`` bytes."""
    return max(0, budget // one) if one else 0
