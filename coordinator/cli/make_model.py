"""Deterministic random checkpoints in the Hugging Face layout (``strata make-model``).

A preset fixes the geometry; ``--arch`` picks the architecture's config keys
and tensor names; ``--seed`` fixes every weight. The output is exactly what a
user's checkpoint directory holds: config.json, generation_config.json,
model.safetensors (or shards plus an index), tokenizer.json, and
tokenizer_config.json with a ChatML chat template (Qwen's), so that
`strata chat` and the HTTP API's chat work on it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from shm.checkpoint_writer import save_checkpoint
from shm.progress import Progress

from ..text.tokenizer import byte_level_tokenizer

ARCH_CLASS = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
              "deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
              "qwen3_next": "Qwen3NextForCausalLM"}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_ID = 256  # <|endoftext|>, right after the 256 byte tokens
# ChatML as Qwen2's tokenizer_config.json has it (no default system message): a turn ends at <|im_end|>
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@dataclass(frozen=True)
class Geometry:
    vocab_size: int = 320
    hidden_size: int = 64
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    num_experts: int = 8
    top_k: int = 2
    moe_intermediate_size: int = 80  # 2.5 blocks of 32: slices are uneven
    dense_intermediate_size: int = 128
    shared_expert_intermediate_size: int = 96  # qwen2_moe only
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    norm_topk_prob: bool | None = None  # None: the architecture's usual choice
    tie_word_embeddings: bool = False
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    # deepseek_v3 and glm4_moe: the sigmoid router's groups, shared experts (moe_intermediate_size each), and the
    # dense first layers (at most num_layers - 1, so that --layers N keeps one MoE layer)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 1
    first_k_dense_replace: int = 0
    # deepseek_v3's MLA (head_dim and num_kv_heads unused) and YaRN (None: plain rope)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    yarn_factor: float | None = None
    yarn_original_max_position_embeddings: int = 4096
    # glm4_moe (qwen3_next: 0.25)
    partial_rotary_factor: float = 0.5
    use_qk_norm: bool = False
    # qwen3_next's Gated DeltaNet layers: every full_attention_interval-th layer is attention, the others these
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    linear_conv_kernel_dim: int = 4
    full_attention_interval: int = 4
    # deepseek_v3 and glm4_moe: 1 writes the multi-token-prediction (nextn) layer, layer id num_layers; qwen3_next:
    # its MTP layer, mtp.layers.0 and mtp.{fc,pre_fc_norm_embedding,pre_fc_norm_hidden,norm}
    num_nextn_predict_layers: int = 0


def l3_bytes(sys_cpu: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int:
    """The last-level cache size as the kernel reports it (lscpu's L3 per instance); 32 MiB if unknown."""
    best = 0
    for idx in sys_cpu.glob("index*"):
        try:
            level = int((idx / "level").read_text())
            text = (idx / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        size = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
        if level >= 3 or best == 0:
            best = max(best, size) if level >= 3 else size
    return best or 32 << 20


def bench_small() -> Geometry:
    """Experts 8x the last-level cache (float32), in 4 layers of 16 experts, hidden 1024."""
    H, layers, experts = 1024, 4, 16
    per_row = layers * experts * 3 * H * 4  # bytes per intermediate row over all experts
    inter = max(256, -(-8 * l3_bytes() // per_row // 32) * 32)
    return Geometry(hidden_size=H, num_layers=layers, num_experts=experts, top_k=4, moe_intermediate_size=inter,
                    num_heads=8, num_kv_heads=4, head_dim=128, dense_intermediate_size=2048,
                    shared_expert_intermediate_size=1024)


PRESETS = {
    "tiny": lambda: Geometry(),
    "bench-small": bench_small,
    # real geometry; --layers N keeps it within memory
    "qwen3-30b-a3b": lambda: Geometry(vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32,
                                      num_kv_heads=4, head_dim=128, num_experts=128, top_k=8,
                                      moe_intermediate_size=768, dense_intermediate_size=6144,
                                      rope_theta=1e6, max_position_embeddings=40960),
    # many MoE layers of small experts: a decode step is mostly the pool's boundary, crossed 48 times a token
    "deep": lambda: Geometry(vocab_size=320, hidden_size=512, num_layers=48, num_heads=8, num_kv_heads=2,
                             head_dim=64, num_experts=32, top_k=4, moe_intermediate_size=256,
                             dense_intermediate_size=1024),
    "mixtral-8x7b": lambda: Geometry(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                                     head_dim=128, num_experts=8, top_k=2, moe_intermediate_size=14336,
                                     rms_norm_eps=1e-5, max_position_embeddings=32768),
    # deepseek-ai/DeepSeek-V3's config.json (BF16 weights; one MoE layer is 256 x 3 x 7168 x 2048: 22.5 GB in BF16)
    "deepseek-v3": lambda: Geometry(vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128,
                                    num_kv_heads=128, head_dim=192, num_experts=256, top_k=8, moe_intermediate_size=2048,
                                    dense_intermediate_size=18432, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                                    n_shared_experts=1, first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512,
                                    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, yarn_factor=40.0,
                                    yarn_original_max_position_embeddings=4096, norm_topk_prob=True,
                                    rope_theta=10000.0, max_position_embeddings=163840),
    # zai-org/GLM-4.5-Air's config.json
    "glm-4.5-air": lambda: Geometry(vocab_size=151552, hidden_size=4096, num_layers=46, num_heads=96, num_kv_heads=8,
                                    head_dim=128, num_experts=128, top_k=8, moe_intermediate_size=1408,
                                    dense_intermediate_size=10944, n_shared_experts=1, first_k_dense_replace=1,
                                    routed_scaling_factor=1.0, partial_rotary_factor=0.5, use_qk_norm=False,
                                    norm_topk_prob=True, rope_theta=1e6, rms_norm_eps=1e-5,
                                    max_position_embeddings=131072),
    # Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (--layers 4 keeps three Gated DeltaNet layers and one attention
    # layer; --experts fewer keeps it within a small machine's memory)
    "qwen3-next": lambda: Geometry(vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=16, num_kv_heads=2,
                                   head_dim=256, num_experts=512, top_k=10, moe_intermediate_size=512,
                                   dense_intermediate_size=5632, shared_expert_intermediate_size=512,
                                   norm_topk_prob=True, rope_theta=1e7, partial_rotary_factor=0.25,
                                   max_position_embeddings=262144, linear_num_key_heads=16,
                                   linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128),
}
PRESET_ARCH = {"qwen3-30b-a3b": "qwen3_moe", "mixtral-8x7b": "mixtral", "deepseek-v3": "deepseek_v3",
               "glm-4.5-air": "glm4_moe", "qwen3-next": "qwen3_next"}
GROUPED = ("deepseek_v3", "glm4_moe")  # the sigmoid router, shared experts, dense first layers
MTP_WRITTEN = (*GROUPED, "qwen3_next")  # the architectures num_nextn_predict_layers writes an MTP layer for


def _linear_shapes(g: Geometry) -> dict[str, tuple[int, ...]]:
    """qwen3_next's Gated DeltaNet tensors (linear_attn.NAME) and their shapes."""
    H, hk, hv = g.hidden_size, g.linear_num_key_heads, g.linear_num_value_heads
    key, value = hk * g.linear_key_head_dim, hv * g.linear_value_head_dim
    return {"in_proj_qkvz.weight": (2 * key + 2 * value, H), "in_proj_ba.weight": (2 * hv, H),
            "conv1d.weight": (2 * key + value, 1, g.linear_conv_kernel_dim), "dt_bias": (hv,), "A_log": (hv,),
            "norm.weight": (g.linear_value_head_dim,), "out_proj.weight": (H, value)}


def _is_linear(arch: str, g: Geometry, layer: int) -> bool:
    """Whether ``layer`` is a Gated DeltaNet layer; Qwen3-Next's MTP layer (layer id num_layers) is attention."""
    return arch == "qwen3_next" and layer < g.num_layers and (layer + 1) % g.full_attention_interval != 0


def parameter_count(arch: str, g: Geometry) -> int:
    H, hd = g.hidden_size, g.head_dim
    attn = H * hd * (2 * g.num_heads + 2 * g.num_kv_heads)
    if arch == "deepseek_v3":
        attn = sum(_mla_shapes(g)[n][0] * _mla_shapes(g)[n][1] for n in _mla_shapes(g) if len(_mla_shapes(g)[n]) == 2)
    if arch == "qwen3_next":
        attn += H * hd * g.num_heads  # q_proj's gate rows
    linear = sum(int(np.prod(shape)) for shape in _linear_shapes(g).values())
    per_layer = 0
    for i in range(g.num_layers):
        per_layer += (linear if _is_linear(arch, g, i) else attn) + 2 * H
        if _is_sparse(arch, g, i):
            per_layer += g.num_experts * (3 * H * g.moe_intermediate_size + H)
            if arch in ("qwen2_moe", "qwen3_next"):
                per_layer += 3 * H * g.shared_expert_intermediate_size + H
            if arch in GROUPED:
                per_layer += 3 * H * g.moe_intermediate_size * g.n_shared_experts
        else:
            per_layer += 3 * H * g.dense_intermediate_size
    return per_layer + g.vocab_size * H * (1 if g.tie_word_embeddings else 2) + H


class ModelTooLarge(ValueError):
    pass


def check_fits(arch: str, g: Geometry, dtype: str, out: Path) -> None:
    """Refuse, with the numbers, a model whose generation or file would not fit, before writing anything."""
    import shutil

    import psutil

    params = parameter_count(arch, g)
    file_bytes = params * {"F32": 4, "F16": 2, "BF16": 2}[dtype]
    work_bytes = params * 4 + file_bytes  # float32 arrays plus their encoded copy
    avail = psutil.virtual_memory().available
    disk = shutil.disk_usage(out if out.exists() else out.parent if out.parent.exists() else Path.cwd()).free
    gib = 2**30
    if work_bytes > avail:
        raise ModelTooLarge(f"{params / 1e9:.2f}B parameters need {work_bytes / gib:.1f} GiB of memory to build; "
                            f"{avail / gib:.1f} GiB is available. Use fewer --layers")
    if file_bytes > disk:
        raise ModelTooLarge(f"the checkpoint needs {file_bytes / gib:.1f} GiB of disk; {disk / gib:.1f} GiB is free")


def hf_config(arch: str, g: Geometry) -> dict:
    """config.json as transformers 4.x writes it for ``arch``."""
    cfg: dict = {
        "architectures": [ARCH_CLASS[arch]],
        "model_type": arch,
        "vocab_size": g.vocab_size,
        "hidden_size": g.hidden_size,
        "num_hidden_layers": g.num_layers,
        "num_attention_heads": g.num_heads,
        "num_key_value_heads": g.num_kv_heads,
        "head_dim": g.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": g.max_position_embeddings,
        "rms_norm_eps": g.rms_norm_eps,
        "rope_theta": g.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": g.tie_word_embeddings,
        "attention_dropout": 0.0,
        "num_experts_per_tok": g.top_k,
        "bos_token_id": None,
        "eos_token_id": EOS_ID,
        "torch_dtype": "float32",
    }
    if arch == "mixtral":
        cfg.update(num_local_experts=g.num_experts, intermediate_size=g.moe_intermediate_size,
                   sliding_window=None, router_aux_loss_coef=0.02)
        return cfg
    if arch in GROUPED:
        cfg.update(n_routed_experts=g.num_experts, moe_intermediate_size=g.moe_intermediate_size,
                   intermediate_size=g.dense_intermediate_size, n_group=g.n_group, topk_group=g.topk_group,
                   routed_scaling_factor=g.routed_scaling_factor, n_shared_experts=g.n_shared_experts,
                   first_k_dense_replace=_dense_layers(g), norm_topk_prob=g.norm_topk_prob is not False,
                   num_nextn_predict_layers=g.num_nextn_predict_layers)
    if arch == "deepseek_v3":
        del cfg["head_dim"]
        cfg.update(num_key_value_heads=g.num_heads, q_lora_rank=g.q_lora_rank, kv_lora_rank=g.kv_lora_rank,
                   qk_nope_head_dim=g.qk_nope_head_dim, qk_rope_head_dim=g.qk_rope_head_dim,
                   v_head_dim=g.v_head_dim, topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1,
                   attention_bias=False)
        if g.yarn_factor is not None:
            cfg["rope_scaling"] = {"type": "yarn", "factor": g.yarn_factor, "beta_fast": 32, "beta_slow": 1,
                                   "mscale": 1.0, "mscale_all_dim": 1.0,
                                   "original_max_position_embeddings": g.yarn_original_max_position_embeddings}
        return cfg
    if arch == "glm4_moe":
        cfg.update(attention_bias=True, use_qk_norm=g.use_qk_norm, partial_rotary_factor=g.partial_rotary_factor)
        return cfg
    norm = g.norm_topk_prob if g.norm_topk_prob is not None else arch in ("qwen3_moe", "qwen3_next")
    cfg.update(num_experts=g.num_experts, moe_intermediate_size=g.moe_intermediate_size,
               intermediate_size=g.dense_intermediate_size, decoder_sparse_step=g.decoder_sparse_step,
               mlp_only_layers=list(g.mlp_only_layers), norm_topk_prob=norm, use_sliding_window=False,
               sliding_window=None, max_window_layers=g.num_layers)
    if arch == "qwen3_moe":
        cfg["attention_bias"] = False
    if arch in ("qwen2_moe", "qwen3_next"):
        cfg["shared_expert_intermediate_size"] = g.shared_expert_intermediate_size
    if arch == "qwen3_next":
        cfg.update(attention_bias=False, partial_rotary_factor=g.partial_rotary_factor,
                   layer_types=["linear_attention" if _is_linear(arch, g, i) else "full_attention"
                                for i in range(g.num_layers)],
                   **{k: getattr(g, k) for k in ("linear_num_key_heads", "linear_num_value_heads",
                                                 "linear_key_head_dim", "linear_value_head_dim",
                                                 "linear_conv_kernel_dim")})
        for k in ("use_sliding_window", "sliding_window", "max_window_layers"):
            del cfg[k]
    return cfg


def _dense_layers(g: Geometry) -> int:
    """The dense first layers written: the geometry's, less any that would leave no MoE layer."""
    return max(0, min(g.first_k_dense_replace, g.num_layers - 1))


def _mla_shapes(g: Geometry) -> dict[str, tuple[int, ...]]:
    """deepseek_v3's attention tensors (self_attn.NAME.weight) and their shapes."""
    H, nh, qk = g.hidden_size, g.num_heads, g.qk_nope_head_dim + g.qk_rope_head_dim
    q = ({"q_a_proj": (g.q_lora_rank, H), "q_a_layernorm": (g.q_lora_rank,), "q_b_proj": (nh * qk, g.q_lora_rank)}
         if g.q_lora_rank else {"q_proj": (nh * qk, H)})
    return {**q, "kv_a_proj_with_mqa": (g.kv_lora_rank + g.qk_rope_head_dim, H),
            "kv_a_layernorm": (g.kv_lora_rank,),
            "kv_b_proj": (nh * (g.qk_nope_head_dim + g.v_head_dim), g.kv_lora_rank), "o_proj": (H, nh * g.v_head_dim)}


def _is_sparse(arch: str, g: Geometry, layer: int) -> bool:
    if arch == "mixtral":
        return True
    if arch in GROUPED:
        return layer >= _dense_layers(g)
    return layer not in g.mlp_only_layers and (layer + 1) % g.decoder_sparse_step == 0


def random_tensors(arch: str, g: Geometry, seed: int) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint, float32, drawn from one seeded generator."""
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * gain / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    centre = np.float32(1.0 if arch == "qwen3_next" else 0.0)  # qwen3_next's norms store weight - 1

    def linear_tensor(name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A Gated DeltaNet tensor: projections scaled as mat's, A_log as transformers draws it, dt_bias and the
        gated norm near 1."""
        if name == "A_log":
            return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
        if name in ("dt_bias", "norm.weight"):
            return norm(shape[0])
        if name == "conv1d.weight":
            return (0.5 * rng.standard_normal(shape)).astype(np.float32)
        return mat(*shape)

    H, hd = g.hidden_size, g.head_dim
    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": rng.standard_normal((g.vocab_size, H)).astype(np.float32)}
    nextn = g.num_nextn_predict_layers if arch in MTP_WRITTEN else 0
    progress = Progress(g.num_layers + nextn, "make-model: drawing the weights", unit="layers")
    for i in range(g.num_layers + nextn):  # the nextn layers after the others, each a whole decoder layer
        if i:
            progress.add(1)
        p = f"mtp.layers.{i - g.num_layers}" if arch == "qwen3_next" and i >= g.num_layers else f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = norm(H) - centre
        t[f"{p}.post_attention_layernorm.weight"] = norm(H) - centre
        a = f"{p}.self_attn"
        if _is_linear(arch, g, i):
            for n, shape in _linear_shapes(g).items():
                t[f"{p}.linear_attn.{n}"] = linear_tensor(n, shape)
        elif arch == "deepseek_v3":
            for n, shape in _mla_shapes(g).items():
                t[f"{a}.{n}.weight"] = mat(*shape) if len(shape) == 2 else norm(shape[0])
        else:
            t[f"{a}.q_proj.weight"] = mat(g.num_heads * hd * (2 if arch == "qwen3_next" else 1), H)
            t[f"{a}.k_proj.weight"] = mat(g.num_kv_heads * hd, H)
            t[f"{a}.v_proj.weight"] = mat(g.num_kv_heads * hd, H)
            t[f"{a}.o_proj.weight"] = mat(H, g.num_heads * hd)
        if arch in ("qwen2_moe", "glm4_moe"):
            for n, size in (("q", g.num_heads * hd), ("k", g.num_kv_heads * hd), ("v", g.num_kv_heads * hd)):
                t[f"{a}.{n}_proj.bias"] = (0.1 * rng.standard_normal(size)).astype(np.float32)
        if arch == "qwen3_moe" or arch == "glm4_moe" and g.use_qk_norm or arch == "qwen3_next" and \
                not _is_linear(arch, g, i):
            t[f"{a}.q_norm.weight"] = norm(hd) - centre
            t[f"{a}.k_norm.weight"] = norm(hd) - centre
        if not _is_sparse(arch, g, i):
            I = g.dense_intermediate_size
            t[f"{p}.mlp.gate_proj.weight"], t[f"{p}.mlp.up_proj.weight"] = mat(I, H), mat(I, H)
            t[f"{p}.mlp.down_proj.weight"] = mat(H, I)
            continue
        moe = f"{p}.block_sparse_moe" if arch == "mixtral" else f"{p}.mlp"
        t[f"{moe}.gate.weight"] = mat(g.num_experts, H, gain=3.0)  # peaked routing
        names = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        I = g.moe_intermediate_size
        for e in range(g.num_experts):
            t[f"{moe}.experts.{e}.{names[0]}.weight"] = mat(I, H)
            t[f"{moe}.experts.{e}.{names[1]}.weight"] = mat(I, H)
            t[f"{moe}.experts.{e}.{names[2]}.weight"] = mat(H, I)
        if arch in ("qwen2_moe", "qwen3_next"):
            S = g.shared_expert_intermediate_size
            t[f"{moe}.shared_expert.gate_proj.weight"], t[f"{moe}.shared_expert.up_proj.weight"] = mat(S, H), mat(S, H)
            t[f"{moe}.shared_expert.down_proj.weight"] = mat(H, S)
            t[f"{moe}.shared_expert_gate.weight"] = mat(1, H)
        if arch in GROUPED:
            t[f"{moe}.gate.e_score_correction_bias"] = (0.1 * rng.standard_normal(g.num_experts)).astype(np.float32)
            S = g.moe_intermediate_size * g.n_shared_experts
            t[f"{moe}.shared_experts.gate_proj.weight"], t[f"{moe}.shared_experts.up_proj.weight"] = mat(S, H), mat(S, H)
            t[f"{moe}.shared_experts.down_proj.weight"] = mat(H, S)
    t["model.norm.weight"] = norm(H) - centre
    if not g.tie_word_embeddings:
        # favour printable ASCII so the demo's (random) text is readable noise
        printable = np.zeros(g.vocab_size, bool)
        printable[32:127] = True
        t["lm_head.weight"] = mat(g.vocab_size, H) * np.where(printable, 1.0, 0.3).astype(np.float32)[:, None]
    for i in range(g.num_layers, g.num_layers + nextn):  # the MTP module's own tensors (DeepSeek-V3's names)
        if arch == "qwen3_next":  # Qwen3-Next's names, one set; its embedding and head are the model's
            t["mtp.pre_fc_norm_embedding.weight"] = norm(H) - centre
            t["mtp.pre_fc_norm_hidden.weight"] = norm(H) - centre
            t["mtp.fc.weight"] = mat(H, 2 * H)
            t["mtp.norm.weight"] = norm(H) - centre
            continue
        p = f"model.layers.{i}"
        t[f"{p}.enorm.weight"], t[f"{p}.hnorm.weight"] = norm(H), norm(H)
        t[f"{p}.eh_proj.weight"] = mat(H, 2 * H)
        t[f"{p}.shared_head.norm.weight"] = norm(H)
        if arch == "deepseek_v3":  # DeepSeek-V3's checkpoint stores copies of the embedding and head; GLM's none
            t[f"{p}.embed_tokens.weight"] = t["model.embed_tokens.weight"]
            t[f"{p}.shared_head.head.weight"] = t.get("lm_head.weight", t["model.embed_tokens.weight"])
    progress.add(1)
    progress.finish()
    return t


def make_model(out: str | Path, preset: str = "tiny", arch: str | None = None, seed: int = 0, *,
               dtype: str = "F32", max_shard_bytes: int | None = None, **overrides) -> Path:
    """Write a checkpoint directory; ``overrides`` replace Geometry fields."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")
    arch = arch or PRESET_ARCH.get(preset, "qwen3_moe")
    if arch not in ARCH_CLASS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {', '.join(ARCH_CLASS)}")
    g = replace(PRESETS[preset](), **overrides)
    check_fits(arch, g, dtype, Path(out))
    if g.vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {g.vocab_size} cannot hold the {256 + len(SPECIAL_TOKENS)} byte and special tokens")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(arch, g)
    cfg["torch_dtype"] = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[dtype]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS_ID], "do_sample": False}, indent=2))
    byte_level_tokenizer(SPECIAL_TOKENS).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None},
        indent=2))
    save_checkpoint(out, random_tensors(arch, g, seed), dtype=dtype, max_shard_bytes=max_shard_bytes)
    return out
