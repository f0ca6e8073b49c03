"""Qwen3-Next's MTP layer as a draft source: a checkpoint's mtp.* tensors read as layer id num_layers (an
attention layer whose routed experts sit in the pool), its logits against a float64 reference of the module, the
same greedy tokens with its drafts as without (in-process and split over two worker processes), the MTP cache
and the model's Gated DeltaNet states after drafts that did not stand, and a GGUF file's nextn layer (as
llama.cpp's converter writes Qwen3-Next's) read as the checkpoint's."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
from reference import Qwen3NextMtpReference, load_tensors
from safetensors.numpy import load_file, save_file
from test_mtp import PROMPT, check_device_drafts, check_draft_passes_are_fresh_passes, main_hidden
from test_speculative import repetitive_requests, run

from coordinator.cli.make_model import make_model
from coordinator.config import EngineConfig
from coordinator.engine import Engine
from coordinator.model.model_config import attach_mtp, load_model_config, parse_model_config
from coordinator.model.weights import load_weights
from coordinator.scheduler import Scheduler
from shm.checkpoint import Checkpoint
from coordinator.model.arch import gguf_config
from coordinator.model.source import open_gguf

FIXTURES = Path(__file__).parent / "fixtures"


def mtp_model(path, seed: int = 2, **geometry):
    """A tiny Qwen3-Next (three Gated DeltaNet layers, one attention layer) with its MTP layer."""
    return make_model(path, arch="qwen3_next", seed=seed, num_nextn_predict_layers=1, **geometry)


def test_the_mtp_tensors_are_read_as_an_attention_layer_after_the_others(tmp_path):
    """mtp.layers.0 runs as layer id 4, attention and MoE; fc and the three norms (1 + the stored weight, as every
    Qwen3-Next norm) are the module's, its embedding and head the model's own arrays; without the tensors no MTP
    layer is attached."""
    model = mtp_model(tmp_path / "m")
    cfg = load_model_config(model)
    ckpt = Checkpoint(model)
    try:
        cfg = attach_mtp(cfg, ckpt.__contains__)
        w = load_weights(cfg, ckpt)
    finally:
        ckpt.close()
    t = load_tensors(model)
    assert cfg.mtp_layers == 1 and cfg.num_layers == 4 and cfg.mtp_chains_normed
    assert cfg.linear_layers == (True, True, True, False, False) and cfg.moe_layers == [0, 1, 2, 3, 4]
    assert cfg.attention_layers == [3]  # the model's own cache holds no MTP keys
    assert w.mtp.layer.linear is None and w.mtp.layer.q_gate is not None and len(w.layers) == 4
    assert w.experts[(4, 0)].gate.name == "mtp.layers.0.mlp.experts.0.gate_proj.weight"
    np.testing.assert_array_equal(w.mtp.eh_proj, t["mtp.fc.weight"].astype(np.float32))
    for got, name in ((w.mtp.enorm, "mtp.pre_fc_norm_embedding.weight"),
                      (w.mtp.hnorm, "mtp.pre_fc_norm_hidden.weight"), (w.mtp.head_norm, "mtp.norm.weight"),
                      (w.mtp.layer.input_norm, "mtp.layers.0.input_layernorm.weight")):
        np.testing.assert_array_equal(got, t[name].astype(np.float32) + np.float32(1))
    assert w.mtp.embed is w.embed and w.mtp.head is w.lm_head
    plain = make_model(tmp_path / "plain", arch="qwen3_next", seed=2)
    assert attach_mtp(load_model_config(plain), lambda name: name in load_tensors(plain)).mtp_layers == 0


def test_mtp_logits_match_the_float64_reference(tmp_path):
    """The hidden rows handed on are the model's after its final norm (lm_head of them is its logits), every row's
    MTP logits over them are within float32 rounding of the float64 module's, whether fed in one pass or a row at a
    time, and the rows chained into the next draft are the MTP layer's after mtp.norm (as vLLM and SGLang chain
    Qwen3-Next's)."""
    model = mtp_model(tmp_path / "m")
    ref = Qwen3NextMtpReference(model)
    with Engine.open(model, EngineConfig(pool="inproc", activations="f32")) as eng:
        assert eng.has_mtp
        h = main_hidden(eng, PROMPT[:-1])  # [T, H]
        np.testing.assert_allclose(h.astype(np.float64) @ ref.t["lm_head.weight"].T, eng.logits(PROMPT[:-1]),
                                   rtol=1e-4, atol=1e-4)
        got, chained = eng.decoder.forward_mtp([([h], np.asarray(PROMPT[1:], np.int64), eng.new_mtp_cache())],
                                               last_only=False)
        cache = eng.new_mtp_cache()
        steps = [eng.mtp_step([([h[i:i + 1]], np.asarray(PROMPT[i + 1:i + 2], np.int64), cache)])[0][0]
                 for i in range(len(h))]
    want = ref.logits(h, PROMPT[1:])
    np.testing.assert_allclose(np.asarray(chained[0], np.float64) @ ref.t["lm_head.weight"].T, got[0], rtol=1e-4,
                               atol=1e-4)  # the rows chained into the next draft are those after mtp.norm
    assert got[0].shape == want.shape == (len(PROMPT) - 1, eng.model_config.vocab_size)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got[0], want, rtol=0, atol=2e-5 * scale)
    np.testing.assert_allclose(np.concatenate(steps), want, rtol=0, atol=2e-5 * scale)
    assert (np.argmax(got[0], -1) == np.argmax(want, -1)).all()


def test_greedy_with_mtp_drafts_is_greedy(tmp_path):
    """In-process, several sequences decoded together: with MTP drafts (auto picks them) the greedy tokens are the
    tokens without, and drafts were tried and refused, so the Gated DeltaNet states were rewound."""
    model = mtp_model(tmp_path / "m")
    with Engine.open(model, EngineConfig(pool="inproc")) as eng:
        assert Scheduler(eng, lambda _c, _e: None, speculative="auto").speculative == "mtp"
        reqs = repetitive_requests(eng)
        plain, _ = run(eng, reqs)
        drafted, stats = run(eng, reqs, speculative="mtp", draft_max=4)
    assert drafted == plain
    assert stats["drafted_tokens"] > stats["accepted_drafts"], stats


def test_greedy_with_mtp_drafts_split_over_two_worker_processes(tmp_path):
    """Split over two worker processes (the MTP layer's experts cut across them as any layer's): greedy with MTP
    drafts equals greedy without."""
    model = mtp_model(tmp_path / "m", seed=3)
    with Engine.open(model, EngineConfig(pool="process", numa_split=True, nodes=2)) as eng:
        assert eng.has_mtp and eng.model_config.moe_layers[-1] == eng.model_config.num_layers
        reqs = repetitive_requests(eng, n=3, max_new=32)
        plain, _ = run(eng, reqs)
        drafted, stats = run(eng, reqs, speculative="mtp")
    assert drafted == plain and stats["drafted_tokens"] > 0


def test_after_rejected_drafts_the_mtp_pass_is_a_fresh_pass(tmp_path):
    """test_mtp's check on Qwen3-Next: neither the model's Gated DeltaNet states and keys nor the MTP cache kept
    anything of the drafts that did not stand."""
    with Engine.open(mtp_model(tmp_path / "m"), EngineConfig(pool="inproc", activations="f32")) as eng:
        check_draft_passes_are_fresh_passes(eng)


def with_mtp_layer(tmp_path) -> tuple[Path, Path]:
    """(a checkpoint, a GGUF file): the qwen3_next_basic fixture and llama.cpp's converter's file of it, with one MTP
    layer added, its decoder layer a copy of layer 3 (the attention layer) and its module's tensors drawn. The
    checkpoint holds them as mtp.*; the file as the converter writes Qwen3-Next's (conversion/qwen.py's
    _QwenMtpMixin): blk.4.* beside blk.4.nextn.{eh_proj,enorm,hnorm,shared_head_norm}, its norms plus 1,
    block_count 5, nextn_predict_layers 1 and one more False in recurrent_layers."""
    hf, path = tmp_path / "hf", tmp_path / "mtp.gguf"
    hf.mkdir()
    shutil.copy(FIXTURES / "hf" / "qwen3_next_basic" / "config.json", hf)
    tensors = load_file(str(FIXTURES / "hf" / "qwen3_next_basic" / "model.safetensors"))
    rng = np.random.default_rng(5)
    H = json.loads((hf / "config.json").read_text())["hidden_size"]
    module = {"fc": (rng.standard_normal((H, 2 * H)) / np.sqrt(2 * H)).astype(np.float32),
              **{n: (0.1 * rng.standard_normal(H)).astype(np.float32)
                 for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}}
    layer = {n[len("model.layers.3."):]: t for n, t in tensors.items() if n.startswith("model.layers.3.")}
    tensors.update({f"mtp.layers.0.{n}": t for n, t in layer.items()})
    tensors.update({f"mtp.{n}.weight": t for n, t in module.items()})
    save_file(tensors, str(hf / "model.safetensors"))

    reader = gguf.GGUFReader(FIXTURES / "gguf" / "qwen3_next_basic.gguf")
    w = gguf.GGUFWriter(str(path), "qwen3next")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        if field.name == "qwen3next.block_count":
            value += 1
        if field.name == "qwen3next.attention.recurrent_layers":
            value = [*value, False]
        w.add_key_value(field.name, value, field.types[0],
                        sub_type=field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    w.add_nextn_predict_layers(1)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data))
        if t.name.startswith("blk.3."):
            w.add_tensor("blk.4." + t.name[len("blk.3."):], np.array(t.data))
    one = np.float32(1)
    for gname, hname in (("eh_proj", "fc"), ("enorm", "pre_fc_norm_embedding"), ("hnorm", "pre_fc_norm_hidden"),
                         ("shared_head_norm", "norm")):
        w.add_tensor(f"blk.4.nextn.{gname}.weight", module[hname] if hname == "fc" else module[hname] + one)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf, path


def test_a_gguf_files_nextn_layer_is_the_checkpoints_mtp_layer(tmp_path):
    """The file's blk.4.nextn.* and blk.4.* load as the checkpoint's mtp.* (the norms' 1 + weight held in the file,
    added to the checkpoint's at load), and on the file greedy with MTP drafts is greedy without."""
    hf, path = with_mtp_layer(tmp_path)
    ck, gk = Checkpoint(hf), open_gguf(path)
    try:
        cfg = attach_mtp(load_model_config(hf), ck.__contains__)
        gcfg = attach_mtp(parse_model_config(gguf_config(gk.file)), gk.__contains__)
        want, got = load_weights(cfg, ck), load_weights(gcfg, gk)
    finally:
        ck.close()
        gk.close()
    assert gcfg == dataclasses.replace(cfg, norm_offset=0.0)  # the file's metadata: four layers and the MTP layer
    for f in ("enorm", "hnorm", "eh_proj", "head_norm"):
        np.testing.assert_array_equal(getattr(got.mtp, f), getattr(want.mtp, f), err_msg=f)
    for f in ("input_norm", "post_attn_norm", "q", "q_gate", "k", "v", "o", "q_norm", "k_norm", "router"):
        np.testing.assert_array_equal(getattr(got.mtp.layer, f), getattr(want.mtp.layer, f), err_msg=f)
    assert got.mtp.head is got.lm_head and got.mtp.embed is got.embed
    prompt = [72, 101, 108, 108, 111, 32, 116, 104, 101, 114, 101]
    with Engine.open(path, EngineConfig(pool="inproc")) as eng:
        assert eng.has_mtp and eng.model_config.mtp_chains_normed
        plain = eng.generate(prompt, max_new_tokens=16, stop_at_eos=False)
        drafted = eng.generate_full(prompt, max_new_tokens=16, stop_at_eos=False, speculative="mtp")
    assert drafted.ids == plain and drafted.timings["drafted_tokens"] > 0


def test_the_device_path_drafts_as_the_cpu_path(gpu, tmp_path):
    """Qwen3-Next's MTP layer on the GPU path on the CPU (the Gated DeltaNet kernel emulated): test_mtp's check."""
    check_device_drafts(mtp_model(tmp_path / "m"))
