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
from dataclasses import replace
from pathlib import Path

import numpy as np

from shm.checkpoint_writer import save_checkpoint
from shm.progress import Progress

from ..model.arch import PRESETS as ARCH_PRESETS
from ..model.arch import family
from ..model.arch.base import Draw, Geometry, swiglu
from ..text.tokenizer import byte_level_tokenizer

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_ID = 256  # <|endoftext|>, right after the 256 byte tokens
# ChatML as Qwen2's tokenizer_config.json has it (no default system message): a turn ends at <|im_end|>
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


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
    # many MoE layers of small experts: a decode step is mostly the pool's boundary, crossed 48 times a token
    "deep": lambda: Geometry(vocab_size=320, hidden_size=512, num_layers=48, num_heads=8, num_kv_heads=2,
                             head_dim=64, num_experts=32, top_k=4, moe_intermediate_size=256,
                             dense_intermediate_size=1024),
    **{name: geometry for name, (_, geometry) in ARCH_PRESETS.items()},  # real geometries, each its family's
}
PRESET_ARCH = {name: f.name for name, (f, _) in ARCH_PRESETS.items()}
DEFAULT_ARCH = "qwen3_moe"  # a preset of no family's


def parameter_count(arch: str, g: Geometry) -> int:
    """Every weight the checkpoint of ``g`` holds (its MTP layers' too), counted from the tensors' shapes."""
    return sum(int(np.prod(t.shape)) for t in random_tensors(arch, g, 0, shapes_only=True).values())


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
    """config.json as transformers 4.x writes it for ``arch``: the keys every family writes alike, then its own."""
    f = family(arch)
    cfg: dict = {
        "architectures": [f.hf_class],
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
    return f.hf_config(g, cfg)


def random_tensors(arch: str, g: Geometry, seed: int, shapes_only: bool = False) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint, float32, drawn from one seeded generator: the embedding, each layer's norms,
    token mixer and MLP or MoE block (the family's), the final norm and head, the family's MTP layers after the
    others. ``shapes_only``: no values (read-only zero views), for a parameter count."""
    f, draw = family(arch), Draw(seed, shapes_only)
    H, c = g.hidden_size, f.norm_centre
    embed = draw.rng.standard_normal((g.vocab_size, H)).astype(np.float32) if not shapes_only else \
        np.broadcast_to(np.float32(0), (g.vocab_size, H))
    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": embed}
    nextn = g.num_nextn_predict_layers if f.mtp else 0
    progress = None if shapes_only else Progress(g.num_layers + nextn, "make-model: drawing the weights",
                                                 unit="layers")
    for i in range(g.num_layers + nextn):  # the nextn layers after the others, each a whole decoder layer
        if i and progress is not None:
            progress.add(1)
        p = f.layer_prefix(g, i)
        t[f"{p}.input_layernorm.weight"] = draw.norm(H, c)
        t[f"{p}.post_attention_layernorm.weight"] = draw.norm(H, c)
        t.update(f.attention_tensors(draw, g, i, p))
        if f.is_sparse(g, i):
            t.update(f.moe_tensors(draw, g, f"{p}.{f.moe_block}"))
        else:
            t.update(swiglu(draw, f"{p}.mlp", g.dense_intermediate_size, H))
    t["model.norm.weight"] = draw.norm(H, c)
    if not g.tie_word_embeddings:
        head = draw.mat(g.vocab_size, H)
        if not shapes_only:  # favour printable ASCII so the demo's (random) text is readable noise
            printable = np.zeros(g.vocab_size, bool)
            printable[32:127] = True
            head = head * np.where(printable, 1.0, 0.3).astype(np.float32)[:, None]
        t["lm_head.weight"] = head
    for i in range(g.num_layers, g.num_layers + nextn):  # the MTP module's own tensors
        t.update(f.mtp_tensors(draw, g, t, i))
    if progress is not None:
        progress.add(1)
        progress.finish()
    return t


def make_model(out: str | Path, preset: str = "tiny", arch: str | None = None, seed: int = 0, *,
               dtype: str = "F32", max_shard_bytes: int | None = None, **overrides) -> Path:
    """Write a checkpoint directory; ``overrides`` replace Geometry fields."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {', '.join(PRESETS)}")
    arch = arch or PRESET_ARCH.get(preset, DEFAULT_ARCH)
    family(arch)  # an unknown one refused, naming the known
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
