"""MTP drafts (DeepSeek-V3's and GLM-4.5's multi-token-prediction layer): its logits against a float64
reference of the paper's module, its cache's positions after drafts that did not stand, the same greedy tokens
with its drafts as without (in-process and split over two worker processes), and a GGUF file's nextn layer
read as the checkpoint's."""

from __future__ import annotations


import numpy as np
import pytest
from reference import MtpReference
from test_speculative import repetitive_requests, run

from coordinator.cli.make_model import make_model
from coordinator.config import EngineConfig
from coordinator.engine import Engine
from coordinator.model.step import StepBatch
from coordinator.errors import ConfigValueError
from coordinator.scheduler import MTP_CATCH_UP, Scheduler

ARCHS = ("deepseek_v3", "glm4_moe")
PROMPT = [72, 101, 108, 108, 111, 32, 116, 104, 101, 114, 101, 33, 32, 72, 105]


def mtp_model(path, arch: str, seed: int = 2, **geometry):
    """A tiny model of ``arch`` with its nextn layer (layer id num_layers, MoE)."""
    return make_model(path, arch=arch, seed=seed, num_nextn_predict_layers=1, **geometry)


def main_hidden(eng: Engine, ids: list[int]) -> np.ndarray:
    """The model's rows [T, H] after its final norm over ``ids`` (a fresh cache), as the scheduler hands them on."""
    out = eng.step(StepBatch([(np.asarray(ids, np.int64), eng.new_cache())], hidden=True, hidden_rows=frozenset({0})))
    return np.asarray(out.hidden[0])


@pytest.mark.parametrize("arch", ARCHS)
def test_mtp_logits_match_the_float64_reference(tmp_path, arch):
    """Every row's MTP logits (the model's hidden rows h_0..h_(T-1) with tokens t_1..t_T) within float32
    rounding of the float64 module; the hidden rows are the ones after the final norm (the model's own
    logits follow from them), and feeding the rows one at a time gives the logits of the whole pass."""
    model = mtp_model(tmp_path / arch, arch, q_lora_rank=24 if arch == "deepseek_v3" else None, n_group=4,
                      topk_group=2, routed_scaling_factor=2.5)
    ref = MtpReference(model)
    with Engine.open(model, EngineConfig(pool="inproc", activations="f32")) as eng:
        assert eng.has_mtp and eng.model_config.moe_layers[-1] == eng.model_config.num_layers
        ids = PROMPT
        h = main_hidden(eng, ids[:-1])  # [T, H]
        t = ref.t
        main = h.astype(np.float64) @ t["lm_head.weight"].T  # [T, V]: lm_head of the rows is the model's logits
        np.testing.assert_allclose(main, eng.logits(ids[:-1]), rtol=1e-4, atol=1e-4)
        got, _ = eng.decoder.forward_mtp([([h], np.asarray(ids[1:], np.int64), eng.new_mtp_cache())],
                                         last_only=False)
        cache = eng.new_mtp_cache()
        steps = [eng.mtp_step([([h[i:i + 1]], np.asarray(ids[i + 1:i + 2], np.int64), cache)])[0][0]
                 for i in range(len(h))]
    want = ref.logits(h, ids[1:])
    assert got[0].shape == want.shape == (len(ids) - 1, eng.model_config.vocab_size)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got[0], want, rtol=0, atol=2e-5 * scale)
    np.testing.assert_allclose(np.concatenate(steps), want, rtol=0, atol=2e-5 * scale)
    assert (np.argmax(got[0], -1) == np.argmax(want, -1)).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_mtp_drafts_is_greedy(tmp_path, arch):
    """In-process, several sequences decoded together: with MTP drafts the greedy tokens are the tokens without,
    and drafts were tried."""
    model = mtp_model(tmp_path / arch, arch)
    with Engine.open(model, EngineConfig(pool="inproc")) as eng:
        reqs = repetitive_requests(eng)
        plain, _ = run(eng, reqs)
        drafted, stats = run(eng, reqs, speculative="mtp", draft_max=4)
    assert drafted == plain
    assert stats["drafted_tokens"] > 0, stats


def check_draft_passes_are_fresh_passes(eng: Engine) -> list[int]:
    """One sequence decoded with MTP drafts (at most 3), its prompt prefilled 5 tokens a step: each draft pass that
    feeds the model's own rows gives, within float32 rounding, the logits that a fresh model pass and a fresh MTP
    pass over the whole history give (so nothing of the drafts that did not stand was kept), for at least 5 such
    passes, some drafts rejected. Returns each MTP pass's rows."""
    firsts = []  # per first pass of a step: (the ids up to the token just chosen, its last row's logits)
    rows = []  # each pass's rows
    sched = Scheduler(eng, lambda _c, _e: None, speculative="mtp", draft_max=3, prefill_chunk=5)
    seq = sched.add(b"c", repetitive_requests(eng, n=1, max_new=24)[0])
    step = eng.mtp_step

    def spy(batch):
        logits, hidden = step(batch)
        (_, tokens, cache), = batch
        rows.append(len(tokens))
        if cache.length == seq.cache.length:  # a first pass: the model's rows fed up to its cache's end
            firsts.append((seq.history[:cache.length + 1].copy(), logits[0][-1].copy()))
        return logits, hidden

    eng.mtp_step = spy
    while sched.busy:
        sched.step()
    assert sched.stats["drafted_tokens"] > sched.stats["accepted_drafts"]  # some drafts were rejected
    for ids, logits in firsts:
        h = main_hidden(eng, ids[:-1].tolist())
        want, _ = eng.decoder.forward_mtp([([h], ids[1:], eng.new_mtp_cache())])
        np.testing.assert_allclose(logits, want[0][-1], rtol=0, atol=1e-4 * np.abs(want[0]).max())
    assert len(firsts) >= 5 and len(seq.prompt_ids) > 10
    return rows


def test_mtp_cache_after_rejected_drafts_is_a_fresh_pass(tmp_path):
    """glm4_moe, random weights (drafts mostly fail): check_draft_passes_are_fresh_passes, the prompt fed chunk by
    chunk (no pass longer than a chunk)."""
    model = mtp_model(tmp_path / "m", "glm4_moe")
    with Engine.open(model, EngineConfig(pool="inproc", activations="f32")) as eng:
        assert max(check_draft_passes_are_fresh_passes(eng)) == 5


def test_a_long_pause_restarts_the_mtp_cache_a_few_positions_back(tmp_path):
    """A sequence that drafts nothing for MTP_CATCH_UP + 5 steps: its probe feeds the MTP layer the last
    MTP_CATCH_UP positions into a cache restarted at the first of them, not the whole pause; that pass's logits
    are the float64 module's over those positions alone, RoPE at their places in the text; the passes after it
    go on from there; the greedy tokens are the tokens without drafts."""
    model = mtp_model(tmp_path / "m", "deepseek_v3")
    ref = MtpReference(model)
    with Engine.open(model, EngineConfig(pool="inproc", activations="f32")) as eng:
        req = repetitive_requests(eng, n=1, max_new=40)[0]
        plain, _ = run(eng, [req])
        sched = Scheduler(eng, lambda _c, _e: None, speculative="mtp", draft_max=2)
        seq = sched.add(b"c", req)
        seq.drafts.pause = MTP_CATCH_UP + 5
        passes = []  # (the cache's start and length before it, rows fed, the ids up to its last row's, logits)
        step = eng.mtp_step

        def spy(batch):
            (_, tokens, cache), = batch
            before = (cache.start, cache.length)
            logits, hidden = step(batch)
            passes.append((before, len(tokens), seq.history[:cache.position + 1].copy(), logits[0][-1].copy()))
            return logits, hidden

        eng.mtp_step = spy
        while sched.busy:
            sched.step()
        restarted = [p for p in passes if p[0][0] > 0 and p[0][1] == 0]
        assert len(restarted) == 1, [p[:2] for p in passes]
        (start, _), rows, ids, logits = restarted[0]
        assert rows == MTP_CATCH_UP and start == len(ids) - 1 - MTP_CATCH_UP > len(seq.prompt_ids)
        assert max(n for (s, _), n, _, _ in passes if s == start) <= MTP_CATCH_UP  # no pass fed the whole pause
        h = main_hidden(eng, ids[:-1].tolist())[start:]  # the model's rows at positions start..
    want = ref.logits(h, ids[start + 1:].tolist(), start=start)[-1]
    np.testing.assert_allclose(logits, want, rtol=0, atol=2e-5 * np.abs(want).max())
    assert seq.out_ids == plain[req.id] and sched.stats["drafted_tokens"] > 0


def test_greedy_with_mtp_drafts_split_over_two_worker_processes(tmp_path):
    """deepseek_v3 split over two worker processes (the MTP layer's experts in the pool as any layer's): greedy
    with MTP drafts equals greedy without."""
    model = mtp_model(tmp_path / "m", "deepseek_v3", seed=3)
    with Engine.open(model, EngineConfig(pool="process", numa_split=True, nodes=2)) as eng:
        assert eng.has_mtp
        reqs = repetitive_requests(eng, n=3, max_new=32)
        plain, _ = run(eng, reqs)
        drafted, stats = run(eng, reqs, speculative="mtp")
    assert drafted == plain and stats["drafted_tokens"] > 0


def test_mtp_needs_the_layer_and_auto_falls_back_to_prompt_lookup(tmp_path):
    """A model without the nextn layer: speculative mtp is refused naming it, auto drafts by prompt lookup; with
    the layer auto takes MTP drafts."""
    plain_model = make_model(tmp_path / "plain", arch="deepseek_v3", seed=2)
    with pytest.raises(ConfigValueError, match="multi-token-prediction"):
        Engine.open(plain_model, EngineConfig(pool="inproc", speculative="mtp"))
    with Engine.open(plain_model, EngineConfig(pool="inproc")) as eng:
        assert not eng.has_mtp
        with pytest.raises(ConfigValueError, match="multi-token-prediction"):
            Scheduler(eng, lambda _c, _e: None, speculative="mtp")
        assert Scheduler(eng, lambda _c, _e: None, speculative="auto").speculative == "ngram"
    with Engine.open(mtp_model(tmp_path / "mtp", "deepseek_v3"), EngineConfig(pool="inproc")) as eng:
        assert Scheduler(eng, lambda _c, _e: None, speculative="auto").speculative == "mtp"


def check_device_drafts(model) -> None:
    """On the GPU path on the CPU (tests/device_standin.py), float32 weights and cache: the MTP logits within float32
    rounding of the CPU path's over the same hidden rows, and greedy with MTP drafts is greedy."""
    with Engine.open(model, EngineConfig(device="cpu", pool="inproc", activations="f32")) as eng:
        h = main_hidden(eng, PROMPT[:-1])
        want, _ = eng.decoder.forward_mtp([([h], np.asarray(PROMPT[1:], np.int64), eng.new_mtp_cache())],
                                          last_only=False)
    with Engine.open(model, EngineConfig(device="cuda", pool="inproc", activations="f32", dense_dtype="f32",
                                         kv_dtype="f32")) as eng:
        assert eng.decoder.backend.name == "cupy" and eng.has_mtp
        got, _ = eng.decoder.forward_mtp([([eng.decoder.xp.asarray(h)], np.asarray(PROMPT[1:], np.int64),
                                           eng.new_mtp_cache())], last_only=False)
        plain = eng.generate(PROMPT, max_new_tokens=16, stop_at_eos=False)
        drafted = eng.generate_full(PROMPT, max_new_tokens=16, stop_at_eos=False, speculative="mtp")
        assert drafted.ids == plain and drafted.timings["drafted_tokens"] > 0
    scale = np.abs(want[0]).max()
    np.testing.assert_allclose(np.asarray(got[0]), want[0], rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_device_path_drafts_as_the_cpu_path(gpu, tmp_path, arch):
    check_device_drafts(mtp_model(tmp_path / arch, arch))
