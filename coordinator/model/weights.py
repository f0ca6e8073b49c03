"""The checkpoint's tensors, named and shape-checked per architecture.

Dense weights (attention, norms, router, shared and dense MLPs, embeddings)
become float32 arrays for the coordinator; routed experts become TensorRefs the
expert pools read their rows from. Every tensor is checked against the shape
the config implies before anything is computed, and a missing or misshaped one
is named in the error.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np

from shm.checkpoint import Checkpoint, CheckpointError
from shm.expert_source import ExpertRefs, TensorRef
from shm.progress import Progress

from .arch import family
from .model_config import ModelConfig, mtp_names


@dataclass
class MLPWeights:
    gate: np.ndarray  # [I, H]
    up: np.ndarray  # [I, H]
    down: np.ndarray  # [H, I]


@dataclass
class MLAWeights:
    """DeepSeek's multi-head latent attention (dn, dr, dv: qk_nope, qk_rope, v head dims; c: kv_lora_rank)."""

    q: np.ndarray | None  # [nh*(dn+dr), H] q_proj, when q_lora_rank is null
    q_a: np.ndarray | None  # [q_lora_rank, H]
    q_a_norm: np.ndarray | None  # [q_lora_rank]
    q_b: np.ndarray | None  # [nh*(dn+dr), q_lora_rank]
    kv_a: np.ndarray  # [c + dr, H] kv_a_proj_with_mqa: the latent, then the shared rope key
    kv_a_norm: np.ndarray  # [c]
    kv_b: np.ndarray  # [nh*(dn+dv), c]: per head, dn rows of W_uk then dv rows of W_uv
    w_uk: np.ndarray  # [nh, dn, c] kv_b's key rows (the absorbed decode's view)
    w_uv: np.ndarray  # [nh, dv, c] kv_b's value rows


@dataclass
class LinearAttnWeights:
    """One Gated DeltaNet layer (Qwen3-Next), its projections' rows put in q, k, v order at load (a transformers
    checkpoint interleaves them and z's per key head) and z apart, as llama.cpp's attn_qkv and attn_gate: a GGUF
    file may store the two in different types. Hk, Hv: key and value heads; dk, dv: their dims; C: conv channels
    (2 Hk dk + Hv dv)."""

    qkv: np.ndarray  # [C, H]: q's Hk*dk rows, k's, then v's Hv*dv (the conv's input)
    z: np.ndarray  # [Hv*dv, H]: the output gate's rows
    ba: np.ndarray  # [2 Hv, H]: b's rows (beta = sigmoid(b)), then a's (the decay's input)
    conv: np.ndarray  # [C, K] the depthwise causal conv's taps
    a_neg: np.ndarray  # [Hv] -exp(A_log): the decay per unit of softplus(a + dt_bias)
    dt_bias: np.ndarray  # [Hv]
    norm: np.ndarray  # [dv] the gated RMSNorm's weight (used as it is, not 1 + weight)
    out: np.ndarray  # [H, Hv*dv]


@dataclass
class LayerWeights:
    input_norm: np.ndarray  # [H]
    post_attn_norm: np.ndarray  # [H]
    q: np.ndarray | None  # [nh*hd, H] (None with MLA and in a Gated DeltaNet layer)
    k: np.ndarray | None  # [nkv*hd, H]
    v: np.ndarray | None  # [nkv*hd, H]
    o: np.ndarray | None  # [H, nh*hd] ([H, nh*dv] with MLA; None in a Gated DeltaNet layer)
    q_bias: np.ndarray | None  # [nh*hd]
    k_bias: np.ndarray | None  # [nkv*hd]
    v_bias: np.ndarray | None  # [nkv*hd]
    q_norm: np.ndarray | None  # [hd]
    k_norm: np.ndarray | None  # [hd]
    router: np.ndarray | None  # [E, H] (MoE layers)
    dense_mlp: MLPWeights | None  # dense layers
    shared_expert: MLPWeights | None  # qwen2_moe; deepseek_v3's shared_experts (n_shared_experts of them fused)
    shared_expert_gate: np.ndarray | None  # [1, H] (qwen2_moe)
    mla: MLAWeights | None = None  # deepseek_v3
    router_bias: np.ndarray | None = None  # [E] deepseek_v3's e_score_correction_bias (the choice only)
    q_gate: np.ndarray | None = None  # [nh*hd, H] qwen3_next: the rows of q_proj that gate attention's output
    linear: LinearAttnWeights | None = None  # qwen3_next's Gated DeltaNet layers (then q, k, v, o are None)


@dataclass
class MtpWeights:
    """DeepSeek-V3's multi-token-prediction module (GLM-4.5's nextn layer and Qwen3-Next's MTP layer alike): the two
    norms and the projection that join a hidden state with the next token's embedding, a decoder layer, and its
    head."""

    layer: LayerWeights  # a whole decoder layer, layer id num_layers (its routed experts in ModelWeights.experts)
    enorm: np.ndarray  # [H] on the next token's embedding (Qwen3-Next's pre_fc_norm_embedding)
    hnorm: np.ndarray  # [H] on the main model's hidden state (pre_fc_norm_hidden)
    eh_proj: np.ndarray  # [H, 2H]: [enorm(embedding) ; hnorm(hidden)] -> H (fc)
    head_norm: np.ndarray  # [H] shared_head.norm (mtp.norm)
    embed: np.ndarray  # [V, H] the layer's embed_tokens, or the model's (one array when they are equal)
    head: np.ndarray  # [V, H] shared_head.head, or the model's lm_head (one array when they are equal)


@dataclass
class ModelWeights:
    embed: np.ndarray  # [V, H]
    final_norm: np.ndarray  # [H]
    lm_head: np.ndarray  # [V, H] (the embedding when tied)
    layers: list[LayerWeights]
    experts: dict[tuple[int, int], ExpertRefs]  # (layer, expert) -> where its matrices are
    sources: "TensorSources" = field(default_factory=lambda: TensorSources())  # a dense array above -> its tensor
    mtp: MtpWeights | None = None  # the MTP layer where ModelConfig.mtp_layers says it runs


def _mla(cfg: ModelConfig, r: "_Reader", attn: str) -> MLAWeights:
    m, H, nh = cfg.mla, cfg.hidden_size, cfg.num_heads
    q_out = nh * m.qk_head_dim
    lora = m.q_lora_rank
    kv_b = r.get(f"{attn}.kv_b_proj.weight", (nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank))
    per_head = kv_b.reshape(nh, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
    return MLAWeights(
        q=r.optional(f"{attn}.q_proj.weight", (q_out, H), lora is None),
        q_a=r.optional(f"{attn}.q_a_proj.weight", (lora, H), lora is not None),
        q_a_norm=r.optional(f"{attn}.q_a_layernorm.weight", (lora,), lora is not None),
        q_b=r.optional(f"{attn}.q_b_proj.weight", (q_out, lora), lora is not None),
        kv_a=r.get(f"{attn}.kv_a_proj_with_mqa.weight", (m.kv_lora_rank + m.qk_rope_head_dim, H)),
        kv_a_norm=r.get(f"{attn}.kv_a_layernorm.weight", (m.kv_lora_rank,)),
        kv_b=kv_b,
        w_uk=np.ascontiguousarray(per_head[:, : m.qk_nope_head_dim]),
        w_uv=np.ascontiguousarray(per_head[:, m.qk_nope_head_dim :]),
    )


def _linear_attn(cfg: ModelConfig, r: "_Reader", prefix: str) -> LinearAttnWeights:
    """A Gated DeltaNet layer's tensors, the projections' rows regrouped from per key head to q, k, v and z."""
    lc, H = cfg.linear, cfg.hidden_size
    Hk, Hv, dk, dv = lc.key_heads, lc.value_heads, lc.key_head_dim, lc.value_head_dim
    rep = Hv // Hk  # value heads per key head
    if f"{prefix}.in_proj_qkvz.weight" in r.ckpt:  # transformers' checkpoint: [Hk, q dk | k dk | v rep dv | z rep dv]
        name = f"{prefix}.in_proj_qkvz.weight"
        qkvz = r.get(name, (2 * Hk * dk + 2 * Hv * dv, H))
        cut = per_group_rows(Hk, [dk, dk, rep * dv, rep * dv])
        qkv = r.take(qkvz, name, np.concatenate(cut[:3]))
        z = r.take(qkvz, name, cut[3])
        conv = r.get(f"{prefix}.conv1d.weight", (lc.conv_dim, 1, lc.conv_kernel))[:, 0]
        a_neg = -np.exp(r.get(f"{prefix}.A_log", (Hv,)))
    else:  # a GGUF file (model/arch/qwen3_next.py GGUF_TENSORS): q, k, v already regrouped, z apart, -exp(A_log)
        qkv = r.get(f"{prefix}.in_proj_qkv.weight", (lc.conv_dim, H))
        z = r.get(f"{prefix}.in_proj_z.weight", (Hv * dv, H))
        conv = r.get(f"{prefix}.conv1d.weight", (lc.conv_dim, lc.conv_kernel))
        a_neg = r.get(f"{prefix}.A_neg", (Hv,))
    name = f"{prefix}.in_proj_ba.weight"  # [Hk, b rep | a rep, H] in both forms
    b_rows, a_rows = per_group_rows(Hk, [rep, rep])
    ba = r.take(r.get(name, (2 * Hv, H)), name, np.concatenate([b_rows, a_rows]))
    return LinearAttnWeights(
        qkv=qkv, z=z, ba=ba, conv=np.ascontiguousarray(conv),
        a_neg=a_neg,
        dt_bias=r.get(f"{prefix}.dt_bias", (Hv,)),
        norm=r.get(f"{prefix}.norm.weight", (dv,)),
        out=r.get(f"{prefix}.out_proj.weight", (H, Hv * dv)),
    )


def per_group_rows(groups: int, widths: list[int]) -> list[np.ndarray]:
    """A tensor whose rows come in ``groups`` groups, each ``widths[0]`` rows of one kind, then ``widths[1]`` of the
    next, ...: per kind, the row numbers of its rows over every group, in order."""
    starts = np.cumsum([0, *widths])
    group = np.arange(groups)[:, None] * starts[-1]  # [groups, 1] each group's first row
    return [(group + lo + np.arange(n)).reshape(-1) for lo, n in zip(starts[:-1], widths)]


def _prefix(cfg: ModelConfig, ckpt: Checkpoint, layer: int) -> tuple[str, str]:
    """(layer prefix, MoE block prefix); the MTP layer's where the checkpoint holds it (mtp_names)."""
    names = mtp_names(cfg, ckpt.__contains__) if layer == cfg.num_layers else None
    base = names.layer if names is not None else f"model.layers.{layer}"
    return base, f"{base}.{family(cfg.arch).moe_block}"


@dataclass(frozen=True, eq=False)
class RowSource:
    """Where a dense array's values come from: tensor ``tensor`` of the checkpoint as float32 reads it, or only its
    rows ``rows`` in that order (a matrix the loader regrouped: Qwen3-Next's q and gate, its Gated DeltaNet's q, k, v
    and z). Each row of a stored format holds its own blocks, so such a matrix keeps the tensor's format and the
    file's bytes (its rows gathered), not a second rounding."""

    tensor: str
    rows: np.ndarray | None = None  # [R] the tensor's row numbers; None: every row, in order


class TensorSources:
    """Which checkpoint tensor (a RowSource) each array holds, keyed by the array itself: an entry keeps a weak
    reference, so a freed array's id, taken by a new array, never finds the freed one's tensor (the new one's bytes
    differ)."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref, RowSource]] = {}

    def set(self, w: np.ndarray, source: RowSource) -> None:
        self._by_id[id(w)] = (weakref.ref(w), source)

    def get(self, w: object) -> RowSource | None:
        """``w``'s source, None where it holds none (computed from a tensor, or None)."""
        entry = self._by_id.get(id(w))
        return entry[1] if entry is not None and entry[0]() is w else None

    def values(self) -> list[RowSource]:
        """The sources of the arrays still alive."""
        return [source for ref, source in self._by_id.values() if ref() is not None]


class _Reader:
    def __init__(self, ckpt: Checkpoint, progress: Progress | None = None):
        self.ckpt = ckpt
        self.progress = progress
        self.sources = TensorSources()  # array read, or rows taken from one -> its tensor

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.ckpt:
            raise CheckpointError(f"missing tensor {name!r}: expected shape {list(shape)}")
        w = self.ckpt.float32(name, shape)
        self.sources.set(w, RowSource(name))
        if self.progress is not None:
            self.progress.add(1)
        return w

    def take(self, w: np.ndarray, name: str, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` of tensor ``name`` (read as ``w``) as a matrix of their own, its source recorded."""
        out = np.ascontiguousarray(w[rows])
        self.sources.set(out, RowSource(name, rows))
        return out

    def optional(self, name: str, shape: tuple[int, ...], present: bool) -> np.ndarray | None:
        return self.get(name, shape) if present else None

    def norm(self, name: str, shape: tuple[int, ...], offset: float) -> np.ndarray:
        """A norm's weight as the product uses it: Qwen3-Next's zero-centred norms multiply by (1 + weight), so
        ``offset`` 1.0 is added once here."""
        w = self.get(name, shape)
        return w + np.float32(offset) if offset else w

    def expect(self, name: str, shape: tuple[int, ...]) -> None:
        """Check a tensor's presence, dtype and shape without reading it."""
        if name not in self.ckpt:
            raise CheckpointError(f"missing tensor {name!r}: expected shape {list(shape)}")
        self.ckpt.check_shape(name, shape)


def _q_proj(cfg: ModelConfig, r: _Reader, attn: str) -> tuple[np.ndarray, np.ndarray | None]:
    """(q [nh*hd, H], the output gate's rows [nh*hd, H] or None): Qwen3-Next's q_proj holds per head hd query
    rows then hd gate rows."""
    nh, hd, H = cfg.num_heads, cfg.head_dim, cfg.hidden_size
    name = f"{attn}.q_proj.weight"
    if not cfg.attn_output_gate:
        return r.get(name, (nh * hd, H)), None
    both = r.get(name, (nh * 2 * hd, H))
    q_rows, gate_rows = per_group_rows(nh, [hd, hd])
    return r.take(both, name, q_rows), r.take(both, name, gate_rows)


def _mlp(r: _Reader, prefix: str, inter: int, hidden: int) -> MLPWeights:
    return MLPWeights(
        gate=r.get(f"{prefix}.gate_proj.weight", (inter, hidden)),
        up=r.get(f"{prefix}.up_proj.weight", (inter, hidden)),
        down=r.get(f"{prefix}.down_proj.weight", (hidden, inter)),
    )


def expert_refs(cfg: ModelConfig, r: _Reader, layer: int) -> dict[int, ExpertRefs]:
    """Locate and check every routed expert of one layer (per-expert or fused tensors)."""
    _, moe = _prefix(cfg, r.ckpt, layer)
    H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    names = family(cfg.arch).expert_names
    stacked_gate = f"{moe}.experts.gate_proj"
    if stacked_gate in r.ckpt:
        # a GGUF file's ffn_{gate,up,down}_exps (shm/gguf_checkpoint.py): gate, up [E, I, H], down [E, H, I]
        stacked_up, stacked_down = f"{moe}.experts.up_proj", f"{moe}.experts.down_proj"
        r.expect(stacked_gate, (E, I, H))
        r.expect(stacked_up, (E, I, H))
        r.expect(stacked_down, (E, H, I))
        return {e: ExpertRefs(TensorRef(stacked_gate, e), TensorRef(stacked_up, e), TensorRef(stacked_down, e))
                for e in range(E)}
    fused_gate_up = f"{moe}.experts.gate_up_proj"
    if fused_gate_up in r.ckpt and f"{moe}.experts.0.{names[0]}.weight" not in r.ckpt:
        # transformers 5 layout: gate_up_proj [E, 2I, H], down_proj [E, H, I]
        fused_down = f"{moe}.experts.down_proj"
        r.expect(fused_gate_up, (E, 2 * I, H))
        r.expect(fused_down, (E, H, I))
        return {
            e: ExpertRefs(TensorRef(fused_gate_up, e, 0), TensorRef(fused_gate_up, e, I), TensorRef(fused_down, e, 0))
            for e in range(E)
        }
    refs = {}
    for e in range(E):
        gate, up, down = (f"{moe}.experts.{e}.{n}.weight" for n in names)
        r.expect(gate, (I, H))
        r.expect(up, (I, H))
        r.expect(down, (H, I))
        refs[e] = ExpertRefs(TensorRef(gate), TensorRef(up), TensorRef(down))
    return refs


def layer_experts(cfg: ModelConfig, ckpt: Checkpoint) -> dict[tuple[int, int], ExpertRefs]:
    """(layer, 0) -> the first routed expert's refs, for every MoE layer: where its matrices are and (through
    ckpt.info) their dtypes, read from the checkpoint's index alone, before any tensor (a layer's experts share
    their tensors' dtypes)."""
    r = _Reader(ckpt)
    return {(layer, 0): expert_refs(cfg, r, layer)[0] for layer in cfg.moe_layers}


def load_weights(cfg: ModelConfig, ckpt: Checkpoint) -> ModelWeights:
    dense = sum(1 for name in ckpt.names() if ".experts." not in name)  # what is read now (experts: by the nodes)
    progress = Progress(dense, "loading the non-expert weights", unit="tensors")
    try:
        return _load_weights(cfg, _Reader(ckpt, progress))
    finally:
        progress.finish()


def _load_weights(cfg: ModelConfig, r: _Reader) -> ModelWeights:
    ckpt = r.ckpt
    H, V, hd = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
    layers: list[LayerWeights] = []
    experts: dict[tuple[int, int], ExpertRefs] = {}
    offset = cfg.norm_offset  # qwen3_next's zero-centred norms: (1 + weight)
    for i in range(cfg.num_layers + cfg.mtp_layers):  # the MTP layer last, read as the others are
        base, moe = _prefix(cfg, ckpt, i)
        attn = f"{base}.self_attn"
        sparse = cfg.sparse_layers[i]
        shared = sparse and cfg.shared_expert_intermediate_size > 0
        if cfg.mla is not None:
            layers.append(
                LayerWeights(
                    input_norm=r.get(f"{base}.input_layernorm.weight", (H,)),
                    post_attn_norm=r.get(f"{base}.post_attention_layernorm.weight", (H,)),
                    q=None, k=None, v=None,
                    o=r.get(f"{attn}.o_proj.weight", (H, cfg.num_heads * cfg.mla.v_head_dim)),
                    q_bias=None, k_bias=None, v_bias=None, q_norm=None, k_norm=None,
                    router=r.optional(f"{moe}.gate.weight", (cfg.num_experts, H), sparse),
                    dense_mlp=None if sparse else _mlp(r, f"{base}.mlp", cfg.dense_intermediate_size, H),
                    shared_expert=_mlp(r, f"{moe}.shared_experts", cfg.shared_expert_intermediate_size, H)
                    if shared else None,
                    shared_expert_gate=None,
                    mla=_mla(cfg, r, attn),
                    router_bias=r.optional(f"{moe}.gate.e_score_correction_bias", (cfg.num_experts,),
                                           sparse and cfg.group_router.scoring == "sigmoid"),
                )
            )
            if sparse:
                for e, refs in expert_refs(cfg, r, i).items():
                    experts[(i, e)] = refs
            continue
        linear = cfg.is_linear(i)
        q, q_gate = (None, None) if linear else _q_proj(cfg, r, attn)
        layers.append(
            LayerWeights(
                input_norm=r.norm(f"{base}.input_layernorm.weight", (H,), offset),
                post_attn_norm=r.norm(f"{base}.post_attention_layernorm.weight", (H,), offset),
                q=q,
                k=None if linear else r.get(f"{attn}.k_proj.weight", (kv_out, H)),
                v=None if linear else r.get(f"{attn}.v_proj.weight", (kv_out, H)),
                o=None if linear else r.get(f"{attn}.o_proj.weight", (H, q_out)),
                q_bias=r.optional(f"{attn}.q_proj.bias", (q_out,), cfg.qkv_bias and not linear),
                k_bias=r.optional(f"{attn}.k_proj.bias", (kv_out,), cfg.qkv_bias and not linear),
                v_bias=r.optional(f"{attn}.v_proj.bias", (kv_out,), cfg.qkv_bias and not linear),
                q_norm=r.norm(f"{attn}.q_norm.weight", (hd,), offset) if cfg.qk_norm and not linear else None,
                k_norm=r.norm(f"{attn}.k_norm.weight", (hd,), offset) if cfg.qk_norm and not linear else None,
                router=r.optional(f"{moe}.gate.weight", (cfg.num_experts, H), sparse),
                dense_mlp=None if sparse else _mlp(r, f"{base}.mlp", cfg.dense_intermediate_size, H),
                shared_expert=_mlp(r, f"{moe}.shared_expert{'' if cfg.shared_expert_gate else 's'}",
                                   cfg.shared_expert_intermediate_size, H) if shared else None,
                shared_expert_gate=r.optional(f"{moe}.shared_expert_gate.weight", (1, H),
                                              shared and cfg.shared_expert_gate),
                router_bias=r.optional(f"{moe}.gate.e_score_correction_bias", (cfg.num_experts,),
                                       sparse and cfg.group_router is not None),  # glm4_moe
                q_gate=q_gate,
                linear=_linear_attn(cfg, r, f"{base}.linear_attn") if linear else None,
            )
        )
        if sparse:
            for e, refs in expert_refs(cfg, r, i).items():
                experts[(i, e)] = refs
    embed = r.get("model.embed_tokens.weight", (V, H))
    if "lm_head.weight" in ckpt:
        lm_head = r.get("lm_head.weight", (V, H))
    elif cfg.tie_word_embeddings:
        lm_head = embed
    else:
        raise CheckpointError(
            "missing tensor 'lm_head.weight': expected shape "
            f"{[V, H]} (config.json has tie_word_embeddings=false)"
        )
    mtp = _mtp(cfg, r, layers.pop(), embed, lm_head) if cfg.mtp_layers else None
    return ModelWeights(embed=embed, final_norm=r.norm("model.norm.weight", (H,), offset), lm_head=lm_head,
                        layers=layers, experts=experts, sources=r.sources, mtp=mtp)


def _mtp(cfg: ModelConfig, r: _Reader, layer: LayerWeights, embed: np.ndarray, lm_head: np.ndarray) -> MtpWeights:
    """The MTP layer's own tensors beside its decoder layer (mtp_names), its norms as the model's are (Qwen3-Next's
    1 + weight); its embedding and head are the model's where the checkpoint leaves them out or holds the same
    values (DeepSeek-V3 stores copies)."""
    H, V, n, offset = cfg.hidden_size, cfg.vocab_size, mtp_names(cfg, r.ckpt.__contains__), cfg.norm_offset

    def shared(name: str | None, main: np.ndarray) -> np.ndarray:
        if name is None or name not in r.ckpt:
            return main
        own = r.get(name, (V, H))
        return main if np.array_equal(own, main) else own

    return MtpWeights(layer=layer, enorm=r.norm(n.enorm, (H,), offset), hnorm=r.norm(n.hnorm, (H,), offset),
                      eh_proj=r.get(n.eh_proj, (H, 2 * H)), head_norm=r.norm(n.head_norm, (H,), offset),
                      embed=shared(n.embed, embed), head=shared(n.head, lm_head))
