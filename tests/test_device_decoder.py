"""The engine's GPU path run on the CPU (tests/device_standin.py: CuPy's stand-in, every kernel through
tests/cuda_emulator.py) against the CPU path: dense weights in their storage formats, the KV cache in bf16,
hot experts in their formats through the grouped kernels, MLA's kv_b kept once, and the memory planned,
checked and reported before anything is uploaded."""

from __future__ import annotations

import numpy as np
import pytest

import device_standin
from coordinator import Engine, EngineConfig
from coordinator.gpu import vram
from coordinator.gpu.weights import DeviceMatrix

PROMPT = [72, 101, 108, 108, 111, 44, 32, 119]


def _logits(model, **config):
    with Engine.open(model, EngineConfig(**config)) as eng:
        return eng.logits(PROMPT), eng.logits(PROMPT, steps=True), eng


def _close(got, want, tol):
    """Within ``tol`` of the logits' spread, and the same top token at every position."""
    scale = float(np.abs(want).max())
    assert np.abs(got - want).max() <= tol * scale, np.abs(got - want).max() / scale
    assert np.array_equal(got.argmax(-1), want.argmax(-1))


GEOMETRY = dict(hidden_size=256, moe_intermediate_size=256, dense_intermediate_size=256, head_dim=32,
                num_heads=4, num_kv_heads=2, vocab_size=320)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "glm4_moe"])
def test_the_device_path_matches_the_cpu_path(gpu, tiny_model, arch):
    """float32 on the device (dense f32, KV f32) equals the CPU path to float32 rounding; bf16 dense weights and
    a bf16 KV cache stay within bf16's rounding with the same top tokens, prompt and step by step."""
    extra = dict(first_k_dense_replace=1, n_group=2, topk_group=1) if arch != "qwen3_moe" else {}
    if arch == "deepseek_v3":
        extra.update(kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, q_lora_rank=64)
    model = tiny_model(arch=arch, **GEOMETRY, **extra)
    want, want_steps, _ = _logits(model, device="cpu", dense_dtype="f32")
    got, got_steps, eng = _logits(model, device="cuda", dense_dtype="f32", kv_dtype="f32")
    assert eng.decoder.backend.name == "cupy" and eng.gpu_memory is not None
    _close(got, want, 1e-5)
    _close(got_steps, want_steps, 1e-5)
    got, got_steps, eng = _logits(model, device="cuda", dense_dtype="bf16")
    assert isinstance(eng.decoder.w.lm_head, DeviceMatrix) and eng.decoder.w.lm_head.fmt == "bf16"
    assert eng.decoder.kv_dtype == "bf16"
    _close(got, want, 3e-2)
    _close(got_steps, want_steps, 3e-2)


def test_quantised_dense_weights_and_hot_experts_in_their_formats(gpu, tiny_model):
    """q8 dense matrices and q8 hot experts on the device: the same as the CPU path with those formats (its
    q8 dense matrices and experts multiplied as floats), within float32 rounding; the hot experts' bytes
    are their real size."""
    model = tiny_model(**GEOMETRY)
    cpu = dict(dense_dtype="q8", expert_dtype="q8", activations="f32")
    want, _, _ = _logits(model, device="cpu", **cpu)
    got, _, eng = _logits(model, device="cuda", kv_dtype="f32", gpu_experts=12, **cpu)
    assert eng.expert_report()["hit_rate"] > 0
    one = vram.expert_bytes(eng.model_config, ("q8", "q8", "q8"))
    assert eng.gpu_memory.hot_experts == 12 * one == eng.device_placement["bytes"]
    assert isinstance(eng.decoder.w.layers[0].o, DeviceMatrix) and eng.decoder.w.layers[0].o.fmt == "q8"
    _close(got, want, 1e-4)


def test_mla_keeps_kv_b_once(gpu, tiny_model):
    model = tiny_model(arch="deepseek_v3", **GEOMETRY, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                       v_head_dim=32)
    with Engine.open(model, EngineConfig(device="cuda", dense_dtype="bf16")) as eng:
        mla = eng.decoder.w.layers[0].mla
        assert mla.w_uk is None and mla.w_uv is None and isinstance(mla.kv_b, DeviceMatrix)


def test_a_model_larger_than_the_gpu_is_refused_before_loading(gpu, tiny_model, monkeypatch):
    model = tiny_model(**GEOMETRY)
    monkeypatch.setattr(device_standin, "FREE_BYTES", 1 << 20)
    gpu.cuda.runtime.memGetInfo = lambda: (1 << 20, 1 << 20)
    with pytest.raises(vram.VramError, match=r"needs .* GB and the GPU has 0\.00 GB free: dense"):
        Engine.open(model, EngineConfig(device="cuda"))


def test_an_allocation_that_fails_during_the_upload_is_refused_with_the_plan(gpu, tiny_model, monkeypatch):
    """The plan fitted, then the memory went elsewhere: the upload's failed allocation is a VramError naming
    the plan and what is free, and no worker or segment is left (the pool is not started yet)."""
    model = tiny_model(**GEOMETRY)
    real = gpu.asarray

    def full(a, *args, **kwargs):
        if isinstance(a, np.ndarray) and a.nbytes > 100_000:
            raise device_standin.OutOfMemory("out of memory allocating 327,680 bytes")
        return real(a, *args, **kwargs)

    monkeypatch.setattr(gpu, "asarray", full)
    with pytest.raises(vram.VramError, match=r"ran out of memory while the model was uploaded .*planned: dense"):
        Engine.open(model, EngineConfig(device="cuda", pool="process"))
    import psutil

    assert psutil.Process().children() == []


def test_gpu_expert_memory_fills_with_experts_at_their_real_size(gpu, tiny_model, tmp_path):
    """--gpu-expert-memory counts each hot expert in its device format: twice as many bf16 ones as f32."""
    model = tiny_model(**GEOMETRY)
    with Engine.open(model, EngineConfig(device="cpu")) as eng:
        eng.logits(PROMPT)
        profile = tmp_path / "p.json"
        eng.profile().save(profile)
    budget = (5 * vram.expert_bytes(eng.model_config, ("bf16",) * 3) + 1000) / 1e9  # GB, as the flag takes it
    counts = {}
    for dtype in ("bf16", "f32"):
        with Engine.open(model, EngineConfig(device="cuda", expert_dtype=dtype, expert_profile=str(profile),
                                             gpu_expert_memory=budget)) as eng:
            counts[dtype] = eng.device_placement["experts"]
    assert counts == {"bf16": 5, "f32": 2}
    with Engine.open(model, EngineConfig(device="cuda", expert_dtype="bf16", expert_profile=str(profile),
                                         gpu_expert_memory=budget)) as eng:
        rest = eng.gpu_memory.total - eng.gpu_memory.hot_experts  # dense, kv cache, scratch
        one = eng.gpu_memory.expert_bytes
    free = rest + 3 * one + one // 2
    gpu.cuda.runtime.memGetInfo = lambda: (free, free)
    with Engine.open(model, EngineConfig(device="cuda", expert_dtype="bf16", expert_profile=str(profile),
                                         gpu_expert_memory=1000.0)) as eng:
        assert eng.device_placement["experts"] == 3  # 1000 GB asked for: what the GPU has left holds 3


@pytest.mark.parametrize("source", ["BF16", "Q4_K_M"])
def test_the_planned_memory_is_what_is_uploaded(gpu, tiny_model, tmp_path, source):
    """The plan made from the index before loading counts the dense weights' bytes the upload then holds, a
    BF16 checkpoint's and a Q4_K_M file's (q4k and q6k matrices kept as the file has them)."""
    from gguf import GGMLQuantizationType as Q

    from coordinator.gpu import load
    from coordinator.gpu.weights import nbytes
    from gguf_writer import write_gguf

    model = tiny_model(**dict(GEOMETRY, num_heads=8), dtype="BF16")
    if source == "Q4_K_M":
        write_gguf(model, tmp_path / "m.gguf", experts=Q.Q4_K, down={0: Q.Q6_K}, dense=Q.Q4_K)
        model = tmp_path / "m.gguf"
    with Engine.open(model, EngineConfig(device="cuda")) as eng:
        planned = load.plan_memory(eng.model_config, eng.ckpt, eng.config, 0, {})
        assert planned.dense == eng.gpu_memory.dense == nbytes(eng.decoder.w)  # q, k, v: views of the fused
        assert ("q4k" in planned.dense_formats) == (source == "Q4_K_M")


def test_the_gpu_bench_runs_through(gpu, tmp_path):
    """tools/gpu_bench.py (what tools/gpu_check.sh's gpu_bench stage runs on a GPU) end to end on a tiny Q4_K_M file (the
    other two models take the same path from a BF16 checkpoint, as the tests above do): every figure the issue
    asks for is in its JSON."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import gpu_bench

    assert gpu_bench.main(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--tiny", "--tokens",
                           "2", "--prompt-tokens", "12", "--rounds", "1", "--only", "Q4_K_M"]) == 0
    report = json.loads((tmp_path / "out" / "gpu_bench.json").read_text())
    assert report["card"] == device_standin.NAME.decode() and len(report["models"]) == 1
    for m in report["models"]:
        assert m["decode_tokens_per_s"] > 0 and m["prefill_tokens_per_s"] > 0
        assert m["logits_vs_cpu"]["top1_agreement"] >= 0.9 and m["logits_vs_cpu"]["positions"] == 64
        assert m["gpu_memory"]["dense"] > 0 and m["gpu_memory"]["kv_cache"] > 0
        assert m["hot_experts_in_8_gb"]["bf16"] > m["hot_experts_in_8_gb"]["f32"]
        steps = m["process_pool_decode"]
        assert steps["eager"]["decode_tokens_per_s"] > 0 and steps["graph"]["graph_steps"] >= 2
        assert steps["graph"]["host_us_a_layer"] > 0 and steps["graph"]["pool_wait_ms_a_step"] > 0
    assert "q4k" in report["models"][0]["gpu_memory"]["dense_formats"]
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == ["deep-bf16", "qwen3-30b-a3b-4l-bf16",
                                                                       "qwen3-30b-a3b-4l-q4_k_m.gguf"]


def test_generate_and_bench_report_the_gpu_memory(gpu, tiny_model, tmp_path, capsys):
    """`strata generate` prints the GPU's memory by category, `strata bench --json` reports it."""
    import json

    from coordinator.cli.main import main

    model = tiny_model(**GEOMETRY)
    assert main(["generate", "--model", str(model), "-p", "Hi", "-n", "2", "--device", "cuda", "--pool",
                 "inproc", "--dense-dtype", "q8"]) == 0
    err = capsys.readouterr().err
    assert "GPU memory: dense" in err and " q8" in err and "kv cache" in err and "scratch" in err
    out = tmp_path / "r.json"
    assert main(["bench", "--model", str(model), "--modes", "inproc", "--device", "cuda", "--tokens", "2",
                 "--prompt-tokens", "4", "--rounds", "1", "--quality-positions", "0", "--json", str(out)]) == 0
    memory = json.loads(out.read_text())["modes"]["inproc"]["gpu_memory"]
    assert memory["dense"] > 0 and memory["kv_cache"] > 0 and memory["total"] == sum(
        memory[k] for k in ("dense", "hot_experts", "kv_cache", "scratch"))


def test_qwen3_next_is_planned_as_uploaded(gpu, tiny_model):
    """A BF16 Qwen3-Next checkpoint on the device: its regrouped matrices (q and the output gate from q_proj, the
    Gated DeltaNet's qkv, z and ba) keep the checkpoint's bf16, so the plan made from the index counts the bytes the
    upload holds; the kv cache's figure holds one sequence's Gated DeltaNet states, two buffers. The values are the
    checkpoint's: the logits are the CPU path's (a float32 cache) to float32 rounding."""
    from coordinator.gpu import load
    from coordinator.gpu.weights import nbytes

    model = tiny_model(arch="qwen3_next", dtype="BF16")
    want, want_steps, _ = _logits(model, device="cpu")
    got, got_steps, _ = _logits(model, device="cuda", kv_dtype="f32")
    _close(got, want, 1e-4)
    _close(got_steps, want_steps, 1e-4)
    with Engine.open(model, EngineConfig(device="cuda")) as eng:
        cfg, w = eng.model_config, eng.decoder.w
        planned = load.plan_memory(cfg, eng.ckpt, eng.config, 0, {})
        assert planned.dense == eng.gpu_memory.dense == nbytes(w)
        linear = next(lw.linear for lw in w.layers if lw.linear is not None)
        gated = next(lw for lw in w.layers if lw.linear is None)
        assert all(isinstance(m, DeviceMatrix) and m.fmt == "bf16" for m in (linear.qkv, linear.z, linear.ba, linear.out,
                                                                             gated.q_gate))
        assert planned.states == 2 * cfg.state_bytes_per_sequence > 0
        assert planned.kv == planned.kv_tokens * vram.kv_bytes_per_token(cfg, "bf16") + planned.states


def test_every_cuda_module_is_compiled_at_open_with_a_progress_line(gpu, tiny_model, monkeypatch, capsys):
    """Engine.open builds the five CUDA modules (device_ops, format_kernels, experts, compact, router) before any
    request, saying so on stderr once the build has taken PROGRESS_AFTER_S; a request then builds none."""
    from shm import progress

    monkeypatch.setattr(progress, "PROGRESS_AFTER_S", 0.0)  # a first run's NVRTC time, without waiting for it
    model = tiny_model(num_layers=2, **GEOMETRY)
    with device_standin.counting() as counts, Engine.open(model, EngineConfig(device="cuda", pool="inproc")) as eng:
        assert counts["module_compiles"] == counts["modules_made"] == 5
        eng.logits(PROMPT[:2])
        assert counts["module_compiles"] == counts["modules_made"] == 5  # nothing made or built by the request
    assert "compiling the CUDA kernels" in capsys.readouterr().err
