"""The Scheduler in-process (no sockets): continuous batching equals solo greedy runs, limits, cancel, stop strings."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from coordinator.cli.make_model import EOS_ID, make_model
from coordinator.config import EngineConfig
from coordinator.engine import Engine
from coordinator.errors import StepInterrupted
from coordinator.serving.api import ApiError, Limits, decode_request
from coordinator.scheduler import Scheduler
from coordinator.model.step import StepBatch

MAX_STEPS = 500  # every loop over steps is bounded by this

PROMPTS = ["Hello", "The quick brown fox", "abc", "zz top", "1234567", "a", "Once upon a time, there was", "MoE!"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    model = make_model(tmp_path_factory.mktemp("sched") / "m", seed=0)
    eng = Engine.open(model, EngineConfig(pool="inproc"))
    yield eng
    eng.close()


class Recorder:
    """Scheduler(emit=...) target: every (client, event) in order."""

    def __init__(self):
        self.events: list[tuple[bytes, dict]] = []

    def __call__(self, client: bytes, ev: dict) -> None:
        self.events.append((client, ev))

    def of(self, rid: str, client: bytes | None = None) -> list[dict]:
        return [ev for c, ev in self.events if ev.get("id") == rid and (client is None or c == client)]

    def final(self, rid: str, client: bytes | None = None) -> dict:
        finals = [ev for ev in self.of(rid, client) if ev["type"] == "final"]
        assert len(finals) == 1, f"{rid}: {len(finals)} final events"
        return finals[0]

    def streamed(self, rid: str) -> str:
        return "".join(ev["text"] for ev in self.of(rid) if ev["type"] == "token")


def request(limits: Limits = Limits(), **doc):
    return decode_request(json.dumps({"type": "generate", **doc}).encode(), limits)


def run_to_end(sched: Scheduler) -> int:
    for n in range(MAX_STEPS):
        if not sched.busy:
            return n
        sched.step()
    raise AssertionError(f"scheduler still busy after {MAX_STEPS} steps")


def solo(engine, prompt: str, n: int) -> list[int]:
    return engine.generate(engine.encode(prompt), n, temperature=0.0, stop_at_eos=True)


def check_final(engine, ev: dict, prompt: str, n: int) -> None:
    want = solo(engine, prompt, n)
    assert ev["ids"] == want
    if want and want[-1] == EOS_ID:
        assert ev["finish_reason"] == "eos"
    else:
        assert ev["finish_reason"] == "length" and len(want) == n
    assert ev["text"] == engine.decode(want)
    assert ev["usage"] == {"prompt_tokens": len(engine.encode(prompt)), "completion_tokens": len(want)}


# -- batching equals solo ----------------------------------------------------


def test_eight_requests_at_once_equal_solo_runs(engine):
    rec = Recorder()
    sched = Scheduler(engine, emit=rec, max_active=8, max_queued=32)
    lengths = [6 + (i * 5) % 7 for i in range(len(PROMPTS))]  # 6..12, mixed
    assert min(lengths) == 6 and max(lengths) == 12
    for i, (p, n) in enumerate(zip(PROMPTS, lengths)):
        sched.add(b"c", request(id=f"r{i}", prompt=p, max_new_tokens=n))
    sched.step()
    assert len(sched.active) == 8  # all admitted (prefilled together) in the first step
    run_to_end(sched)
    assert sched.all() == []
    for i, (p, n) in enumerate(zip(PROMPTS, lengths)):
        ev = rec.final(f"r{i}")
        check_final(engine, ev, p, n)
        assert rec.streamed(f"r{i}") == ev["text"]
    assert sched.stats["completed"] == 8 and sched.stats["requests"] == 8


def test_request_added_mid_decode_joins_next_step_and_equals_solo(engine):
    rec = Recorder()
    sched = Scheduler(engine, emit=rec)
    early = [("r0", PROMPTS[0], 12), ("r1", PROMPTS[1], 10), ("r2", PROMPTS[6], 12)]
    for rid, p, n in early:
        sched.add(b"c", request(id=rid, prompt=p, max_new_tokens=n))
    for _ in range(4):
        sched.step()
    assert len(sched.active) == 3 and all(not rec.of(rid) or rec.of(rid)[-1]["type"] == "token" for rid, *_ in early)
    sched.add(b"c", request(id="late", prompt=PROMPTS[3], max_new_tokens=9))
    assert [s.req.id for s in sched.queue] == ["late"]
    before = len(rec.of("late"))
    sched.step()
    assert sched.queue == type(sched.queue)()  # admitted right away
    assert "late" in [s.req.id for s in sched.active]
    assert len(rec.of("late")) == before + 1 and rec.of("late")[-1]["type"] == "token"  # first token this step
    run_to_end(sched)
    for rid, p, n in early + [("late", PROMPTS[3], 9)]:
        check_final(engine, rec.final(rid), p, n)


def test_max_active_bounds_each_step_and_all_finish(engine):
    rec = Recorder()
    sched = Scheduler(engine, emit=rec, max_active=2, max_queued=8)
    for i in range(5):
        sched.add(b"c", request(id=f"r{i}", prompt=PROMPTS[i], max_new_tokens=6))
    seen_active = []
    for _ in range(MAX_STEPS):
        if not sched.busy:
            break
        sched.step()
        seen_active.append(len(sched.active))
        assert len(sched.active) <= 2
    assert not sched.busy
    assert max(seen_active) == 2
    for i in range(5):
        check_final(engine, rec.final(f"r{i}"), PROMPTS[i], 6)


# -- admission errors --------------------------------------------------------


def test_queue_full_is_busy(engine):
    sched = Scheduler(engine, emit=Recorder(), max_active=1, max_queued=2)
    sched.add(b"c", request(id="a", prompt="x", max_new_tokens=4))
    sched.add(b"c", request(id="b", prompt="y", max_new_tokens=4))
    with pytest.raises(ApiError) as info:
        sched.add(b"c", request(id="c", prompt="z", max_new_tokens=4))
    assert info.value.code == "busy" and info.value.request_id == "c"
    assert sched.stats["busy_rejections"] == 1
    assert [s.req.id for s in sched.all()] == ["a", "b"]
    sched.step()  # "a" admitted: one queue slot free again
    sched.add(b"c", request(id="c", prompt="z", max_new_tokens=4))
    run_to_end(sched)


def test_duplicate_in_flight_id_is_refused(engine):
    sched = Scheduler(engine, emit=Recorder())
    sched.add(b"c", request(id="a", prompt="x", max_new_tokens=4))
    with pytest.raises(ApiError) as info:
        sched.add(b"c", request(id="a", prompt="y", max_new_tokens=4))
    assert info.value.code == "bad_request"
    sched.add(b"other", request(id="a", prompt="y", max_new_tokens=4))  # same id, other client: fine
    run_to_end(sched)


def test_max_new_tokens_over_the_limit_is_too_long(engine):
    with pytest.raises(ApiError) as info:
        request(Limits(max_new_tokens=16), id="a", prompt="x", max_new_tokens=17)
    assert info.value.code == "too_long" and "max_new_tokens" in info.value.message
    assert request(Limits(max_new_tokens=16), id="a", prompt="x", max_new_tokens=16).max_new_tokens == 16
    # within the API limit but past the model's sequence length: the scheduler says too_long too
    sched = Scheduler(engine, emit=Recorder())
    n = engine.max_seq_len
    with pytest.raises(ApiError) as info:
        sched.add(b"c", request(Limits(max_new_tokens=n), id="a", prompt="abcd", max_new_tokens=n))
    assert info.value.code == "too_long"
    assert sched.all() == []


@pytest.mark.parametrize("bad", [[1, 2, 320], [-1], [10**6]])
def test_out_of_vocab_prompt_id_is_bad_request(engine, bad):
    assert engine.model_config.vocab_size == 320
    sched = Scheduler(engine, emit=Recorder())
    req = request(id="a", prompt_ids=bad, max_new_tokens=4)  # the API does not know the vocabulary
    with pytest.raises(ApiError) as info:
        sched.add(b"c", req)
    assert info.value.code == "bad_request" and "vocabulary" in info.value.message
    assert sched.all() == [] and sched.stats["requests"] == 0


def test_prompt_ids_request_equals_solo(engine):
    rec = Recorder()
    sched = Scheduler(engine, emit=rec)
    ids = [72, 105, 33, 300, 7]
    sched.add(b"c", request(id="a", prompt_ids=ids, max_new_tokens=8))
    run_to_end(sched)
    ev = rec.final("a")
    assert ev["ids"] == engine.generate(ids, 8)
    assert ev["usage"] == {"prompt_tokens": 5, "completion_tokens": len(ev["ids"])}


# -- cancel and drop ---------------------------------------------------------


def test_cancel_mid_stream(engine):
    rec = Recorder()
    sched = Scheduler(engine, emit=rec)
    sched.add(b"c", request(id="long", prompt=PROMPTS[1], max_new_tokens=200))
    sched.add(b"c", request(id="other", prompt=PROMPTS[2], max_new_tokens=10))
    for _ in range(3):
        sched.step()
    assert [ev["type"] for ev in rec.of("long")] == ["token"] * 3
    assert sched.cancel(b"c", "long") is True
    evs = rec.of("long")
    assert evs[-1]["type"] == "final" and evs[-1]["finish_reason"] == "cancelled"
    assert evs[-1]["ids"] == solo(engine, PROMPTS[1], 200)[:3]
    assert evs[-1]["usage"]["completion_tokens"] == 3
    assert "long" not in [s.req.id for s in sched.all()]
    count = len(evs)
    run_to_end(sched)
    assert len(rec.of("long")) == count  # nothing more for it
    check_final(engine, rec.final("other"), PROMPTS[2], 10)
    assert sched.cancel(b"c", "long") is False
    assert sched.stats["cancelled"] == 1


def test_cancel_needs_the_same_client(engine):
    rec = Recorder()
    sched = Scheduler(engine, emit=rec)
    sched.add(b"c", request(id="a", prompt="x", max_new_tokens=5))
    assert sched.cancel(b"intruder", "a") is False
    run_to_end(sched)
    assert rec.final("a")["finish_reason"] in ("length", "eos")


def test_drop_client_frees_its_sequences(engine):
    rec = Recorder()
    sched = Scheduler(engine, emit=rec, max_active=2)
    sched.add(b"gone", request(id="g1", prompt=PROMPTS[0], max_new_tokens=50))
    sched.add(b"stay", request(id="s1", prompt=PROMPTS[1], max_new_tokens=8))
    sched.add(b"gone", request(id="g2", prompt=PROMPTS[2], max_new_tokens=50))  # still queued
    sched.step()
    sched.step()
    assert sched.drop_client(b"gone") == 2
    assert all(s.client != b"gone" for s in sched.all())
    assert [s.req.id for s in sched.all()] == ["s1"]
    count = len([1 for c, _ in rec.events if c == b"gone"])
    run_to_end(sched)
    assert len([1 for c, _ in rec.events if c == b"gone"]) == count
    assert not any(ev["type"] == "final" for c, ev in rec.events if c == b"gone")
    check_final(engine, rec.final("s1"), PROMPTS[1], 8)
    assert sched.drop_client(b"gone") == 0


# -- stop strings ------------------------------------------------------------


def stop_cases(engine):
    """(prompt, stop, greedy text) with the stop string taken from the greedy text itself."""
    cases = []
    for p in PROMPTS[:4]:
        text = engine.decode(solo(engine, p, 30))
        for start, size in ((3, 1), (5, 2), (8, 3), (12, 4)):
            cases.append((p, text[start:start + size], text))
    return cases


def test_stop_strings_cut_the_text_and_never_leak(engine):
    cases = stop_cases(engine)
    rec = Recorder()
    sched = Scheduler(engine, emit=rec, max_active=len(cases), max_queued=len(cases))
    for i, (p, stop, _) in enumerate(cases):
        sched.add(b"c", request(id=f"s{i}", prompt=p, max_new_tokens=30, stop=["\x00never", stop]))
    run_to_end(sched)
    for i, (p, stop, text) in enumerate(cases):
        cut = text.find(stop)
        assert cut >= 0
        ev = rec.final(f"s{i}")
        assert ev["finish_reason"] == "stop", (p, stop)
        assert ev["text"] == text[:cut]
        assert rec.streamed(f"s{i}") == ev["text"], (p, stop)  # no part of the stop string went out
        greedy = solo(engine, p, 30)
        n = next(k for k in range(1, 31) if stop in engine.decode(greedy[:k]))
        assert ev["ids"] == greedy[:n]  # generation ended at the token completing the stop string
        assert ev["usage"]["completion_tokens"] == n


def test_stop_string_partial_match_is_released(engine):
    """Text held back as a possible stop prefix goes out once it cannot be one."""
    text = engine.decode(solo(engine, PROMPTS[0], 20))
    stop = text[4] + "\x01"  # starts like the text at 4, never completes
    rec = Recorder()
    sched = Scheduler(engine, emit=rec)
    sched.add(b"c", request(id="a", prompt=PROMPTS[0], max_new_tokens=20, stop=stop))
    run_to_end(sched)
    ev = rec.final("a")
    assert ev["finish_reason"] == "length" and ev["text"] == text
    assert rec.streamed("a") == text


def test_non_streaming_request_sends_only_the_final(engine):
    rec = Recorder()
    sched = Scheduler(engine, emit=rec)
    sched.add(b"c", request(id="a", prompt=PROMPTS[0], max_new_tokens=7, stream=False))
    run_to_end(sched)
    assert [ev["type"] for ev in rec.of("a")] == ["final"]
    check_final(engine, rec.final("a"), PROMPTS[0], 7)


def test_engine_failure_reports_each_sequence_once(engine, monkeypatch):
    """A step that fails in the decode pass ends each active sequence with exactly one 'engine' error."""
    rec = Recorder()
    sched = Scheduler(engine, emit=rec)
    real = engine.decoder.forward
    calls = []

    def failing(batch, step=None):
        calls.append(len(batch.seqs))
        if len(calls) == 2:  # the first decode pass (step 2), right after the step that prefilled the admitted ones
            raise RuntimeError("boom")
        return real(batch, step)

    monkeypatch.setattr(engine.decoder, "forward", failing)
    sched.add(b"c", request(id="a", prompt="abc", max_new_tokens=8))
    sched.add(b"c", request(id="b", prompt="xyz", max_new_tokens=8))
    sched.step()  # one forward per step: the prefill (and the first tokens)
    with pytest.raises(RuntimeError):
        sched.step()
    assert sched.active == [] and sched.stats["errors"] == 1
    for rid in ("a", "b"):
        errors = [ev for ev in rec.of(rid) if ev["type"] == "error"]
        assert [e["code"] for e in errors] == ["engine"], (rid, errors)


# -- the batched forward -----------------------------------------------------


def test_the_last_layer_carries_on_with_each_sequences_last_row_alone(engine, monkeypatch):
    """With last_only the last layer's attention takes each sequence's last query alone (every row's keys and
    values still cached) and its MoE routes only those rows, as llama.cpp's inp_out_ids; the logits equal the
    full forward's last rows, and the caches grow by every token."""
    dec = engine.decoder
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 320, size=n).astype(np.int64) for n in (5, 1, 6)]
    full = [dec.forward(StepBatch.of(p, dec.new_cache(), every_row=True)).logits[0][-1:] for p in prompts]
    routed = []  # rows each MoE layer routed
    real = dec._route

    def spy(i, lw, x, made=None):
        routed.append((i, x.shape[0]))
        return real(i, lw, x, made)

    monkeypatch.setattr(dec, "_route", spy)
    caches = [dec.new_cache() for _ in prompts]
    got = dec.forward(StepBatch(list(zip(prompts, caches)))).logits
    moe = [i for i in range(dec.cfg.num_layers) if dec.cfg.sparse_layers[i]]
    assert moe and moe[-1] == dec.cfg.num_layers - 1
    assert routed == [(i, 12) for i in moe[:-1]] + [(moe[-1], 3)]
    assert [c.length for c in caches] == [5, 1, 6]
    for g, w in zip(got, full):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=0)
    routed.clear()
    dec.forward(StepBatch(list(zip(prompts, [dec.new_cache() for _ in prompts])), all_rows=frozenset({0, 1, 2})))
    assert routed == [(i, 12) for i in moe]  # every row when every row's logits are asked for

def test_forward_batch_equals_separate_forwards(engine):
    dec = engine.decoder
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 320, size=n).astype(np.int64) for n in (3, 7, 1)]
    solo_caches = [dec.new_cache() for _ in prompts]
    want = [dec.forward(StepBatch.of(ids, c, every_row=True)).logits[0] for ids, c in zip(prompts, solo_caches)]
    batch_caches = [dec.new_cache() for _ in prompts]
    got = dec.forward(StepBatch(list(zip(prompts, batch_caches)), all_rows=frozenset({0, 1, 2}))).logits
    assert [g.shape for g in got] == [w.shape for w in want] == [(3, 320), (7, 320), (1, 320)]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=0)
    last = dec.forward(StepBatch([(p, dec.new_cache()) for p in prompts])).logits  # last_only default
    for g, w in zip(last, want):
        np.testing.assert_allclose(g, w[-1:], atol=1e-5, rtol=0)
    # one more token each on top of the caches: the batch still agrees with the solo caches
    nxt = [np.array([int(np.argmax(w[-1]))], np.int64) for w in want]
    want2 = [dec.forward(StepBatch.of(t, c, every_row=True)).logits[0] for t, c in zip(nxt, solo_caches)]
    got2 = dec.forward(StepBatch(list(zip(nxt, batch_caches)))).logits
    assert [c.length for c in batch_caches] == [4, 8, 2]
    for g, w in zip(got2, want2):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=0)


# -- chunked prefill ---------------------------------------------------------

LONG = "Once upon a time, in a land of mixtures of experts, " * 3  # 156 tokens: many chunks of 16


class ForwardSpy:
    """Stands in for decoder.forward: per call, the prompt tokens each sequence in it gets (by request id)."""

    def __init__(self, engine, sched: Scheduler, monkeypatch, fail_at: int | None = None, exc: Exception | None = None):
        self.real = engine.decoder.forward
        self.sched = sched
        self.calls: list[dict[str, int]] = []
        self.fail_at, self.exc = fail_at, exc
        monkeypatch.setattr(engine.decoder, "forward", self)

    def __call__(self, batch, step=None):
        seqs = batch.seqs
        by_cache = {id(s.cache): s for s in self.sched.all()}
        if not all(id(cache) in by_cache for _, cache in seqs):  # a solo run (check_final): not the scheduler's
            return self.real(batch, step)
        prefill = {}
        for ids, cache in seqs:
            s = by_cache[id(cache)]
            if cache.length < len(s.prompt_ids):  # a prompt chunk, not a decode token
                assert cache.length + len(ids) <= len(s.prompt_ids)
                prefill[s.req.id] = len(ids)
            else:
                assert len(ids) == 1
        self.calls.append(prefill)
        if self.fail_at == len(self.calls):
            raise self.exc
        return self.real(batch, step)


def test_chunked_prefill_keeps_decode_going_and_equals_solo(engine, monkeypatch):
    rec = Recorder()
    sched = Scheduler(engine, emit=rec, prefill_chunk=16)
    spy = ForwardSpy(engine, sched, monkeypatch)
    n_long = len(engine.encode(LONG))
    assert n_long > 8 * 16
    sched.add(b"c", request(id="short", prompt=PROMPTS[0], max_new_tokens=30))
    sched.step()
    assert [ev["type"] for ev in rec.of("short")] == ["token"]
    sched.add(b"c", request(id="long", prompt=LONG, max_new_tokens=6))
    prefill_steps = 0
    for _ in range(MAX_STEPS):
        if not sched.busy:
            break
        calls, short_before, long_before = len(spy.calls), len(rec.of("short")), len(rec.of("long"))
        sched.step()
        assert len(spy.calls) == calls + 1  # one forward per step
        if "long" in spy.calls[-1]:
            prefill_steps += 1
            # decode is not blocked: the short request got its next token in this very step
            assert [ev["type"] for ev in rec.of("short")[short_before:]] == ["token"]
            prefilled = sum(c.get("long", 0) for c in spy.calls)
            assert len(rec.of("long")) == long_before + (prefilled == n_long)  # first token once the prompt is in
    assert not sched.busy
    assert max(sum(c.values()) for c in spy.calls) == 16  # never more than the bound in one step
    assert sum(c.get("long", 0) for c in spy.calls) == n_long
    assert prefill_steps == -(-n_long // 16)
    check_final(engine, rec.final("short"), PROMPTS[0], 30)
    check_final(engine, rec.final("long"), LONG, 6)
    assert rec.streamed("long") == rec.final("long")["text"]
    assert sched.stats["prefill_tokens"] == n_long + len(engine.encode(PROMPTS[0]))


def test_prefill_chunk_larger_than_the_prompt_prefills_it_in_one_step(engine, monkeypatch):
    rec = Recorder()
    n_long, n_other = len(engine.encode(LONG)), len(engine.encode(PROMPTS[6]))
    assert n_other > 10
    sched = Scheduler(engine, emit=rec, prefill_chunk=n_long + 10)
    spy = ForwardSpy(engine, sched, monkeypatch)
    sched.add(b"c", request(id="long", prompt=LONG, max_new_tokens=7))
    sched.add(b"c", request(id="other", prompt=PROMPTS[6], max_new_tokens=8))
    sched.step()
    assert spy.calls == [{"long": n_long, "other": 10}]  # the whole prompt, then the rest of the bound
    assert [ev["type"] for ev in rec.of("long")] == ["token"] and rec.of("other") == []
    assert [s.req.id for s in sched.active] == ["long"] and [s.req.id for s in sched.prefilling] == ["other"]
    sched.step()
    assert spy.calls[1] == {"other": n_other - 10}
    assert [ev["type"] for ev in rec.of("other")] == ["token"]
    run_to_end(sched)
    check_final(engine, rec.final("long"), LONG, 7)
    check_final(engine, rec.final("other"), PROMPTS[6], 8)


def test_engine_failure_during_chunked_prefill_reports_each_sequence_once(engine, monkeypatch):
    rec = Recorder()
    sched = Scheduler(engine, emit=rec, prefill_chunk=16)
    spy = ForwardSpy(engine, sched, monkeypatch, fail_at=4, exc=RuntimeError("boom"))
    sched.add(b"c", request(id="short", prompt=PROMPTS[0], max_new_tokens=30))
    sched.step()
    sched.add(b"c", request(id="long", prompt=LONG, max_new_tokens=6))
    sched.add(b"c", request(id="next", prompt=PROMPTS[1], max_new_tokens=6))  # admitted, waits for its first chunk
    sched.step()
    sched.step()
    with pytest.raises(RuntimeError):
        sched.step()
    assert spy.calls[1:] == [{"long": 16}] * 3  # it failed in the middle of the long prompt's prefill
    assert not sched.busy and sched.all() == [] and sched.prefilling == [] and sched.active == []
    assert sched.stats["errors"] == 1
    for rid in ("short", "long", "next"):
        errors = [ev for ev in rec.of(rid) if ev["type"] == "error"]
        assert [e["code"] for e in errors] == ["engine"] and "boom" in errors[0]["message"], (rid, errors)
        assert rec.of(rid)[-1] is errors[0] and not any(ev["type"] == "final" for ev in rec.of(rid))
    assert [ev["type"] for ev in rec.of("short")] == ["token"] * 3 + ["error"]


def test_step_interrupted_emits_nothing_and_keeps_the_sequences(engine, monkeypatch):
    rec = Recorder()
    sched = Scheduler(engine, emit=rec, max_active=2, prefill_chunk=16)
    ForwardSpy(engine, sched, monkeypatch, fail_at=3, exc=StepInterrupted("the server is stopping"))
    sched.add(b"c", request(id="short", prompt=PROMPTS[0], max_new_tokens=30))
    sched.step()
    sched.add(b"c", request(id="long", prompt=LONG, max_new_tokens=6))
    sched.add(b"d", request(id="queued", prompt=PROMPTS[2], max_new_tokens=6))  # over max_active: stays queued
    sched.step()
    events = list(rec.events)
    where = ([s.req.id for s in sched.queue], [s.req.id for s in sched.prefilling], [s.req.id for s in sched.active])
    assert where == (["queued"], ["long"], ["short"])
    assert sched.prefilling[0].prefilled == 16
    with pytest.raises(StepInterrupted):
        sched.step()
    assert rec.events == events  # nothing emitted
    assert ([s.req.id for s in sched.queue], [s.req.id for s in sched.prefilling],
            [s.req.id for s in sched.active]) == where
    assert sched.prefilling[0].prefilled == 16 and sched.stats["errors"] == 0
    sched.fail_all("shutdown", "the server is shutting down")
    for rid in ("short", "long", "queued"):
        new = [ev for c, ev in rec.events[len(events):] if ev["id"] == rid]
        assert [(ev["type"], ev["code"]) for ev in new] == [("error", "shutdown")], rid
    assert len(rec.events) == len(events) + 3
    assert not sched.busy and sched.all() == []


# -- deadlines and prompts that cannot be tokenised (issue 11) ------------------


def test_deadline_ends_a_sequence_with_its_text_so_far(engine):
    rec = Recorder()
    sched = Scheduler(engine, rec)
    sched.add(b"c", request(id="late", prompt=PROMPTS[0], max_new_tokens=50, deadline_s=2.0), arrived=100.0)
    sched.add(b"c", request(id="free", prompt=PROMPTS[1], max_new_tokens=5))
    for _ in range(3):
        sched.step()
    assert sched.expire(101.9) == 0
    assert sched.expire(102.0) == 1
    late = rec.final("late")
    assert late["finish_reason"] == "deadline" and late["ids"] == solo(engine, PROMPTS[0], len(late["ids"]))
    assert 0 < len(late["ids"]) < 50 and late["text"] == engine.decode(late["ids"])
    run_to_end(sched)
    check_final(engine, rec.final("free"), PROMPTS[1], 5)


def test_a_prompt_the_tokenizer_refuses_is_bad_request(engine, monkeypatch):
    sched = Scheduler(engine, Recorder())

    def refuse(text):
        raise Exception("tokenizer failure")  # tokenizers raises plain Exceptions

    monkeypatch.setattr(engine, "encode", refuse)
    with pytest.raises(ApiError) as info:
        sched.add(b"c", request(id="t", prompt="abc"))
    assert info.value.code == "bad_request" and "tokenizer failure" in info.value.message
    assert not sched.busy


def test_given_ids_are_used_without_tokenising(engine, monkeypatch):
    rec = Recorder()
    sched = Scheduler(engine, rec)
    ids = engine.encode(PROMPTS[2])
    monkeypatch.setattr(engine, "encode", lambda text: pytest.fail("tokenised on the serving loop"))
    sched.add(b"c", request(id="pre", prompt=PROMPTS[2], max_new_tokens=4), ids=ids)
    run_to_end(sched)
    monkeypatch.undo()
    check_final(engine, rec.final("pre"), PROMPTS[2], 4)


# -- sampling controls and logprobs (issue 17's prerequisite) -------------------


def reference_greedy(engine, prompt_ids: list[int], n: int, presence: float = 0.0, frequency: float = 0.0,
                     repetition: float = 1.0, given: list[int] | None = None) -> tuple[list[int], list[list[float]]]:
    """An independent reference: one decode step at a time through the decoder, the penalties and the
    log-softmax in float64 Python. Greedy (first index on ties), or teacher-forced on ``given`` ids.
    Returns the ids and, per id, the log-softmax of the penalised logits it was chosen from."""
    dec = engine.decoder
    cache = dec.new_cache()
    logits = dec.forward(StepBatch.of(np.asarray(prompt_ids, np.int64), cache)).logits[0][-1]
    eos = set(engine.model_config.eos_token_ids)
    seen_prompt = set(prompt_ids)
    out: list[int] = []
    lps: list[list[float]] = []
    while len(out) < (n if given is None else len(given)):
        pen = []
        for i, x in enumerate(float(v) for v in logits):
            if i in seen_prompt or i in out:
                x = x / repetition if x > 0 else x * repetition
            c = out.count(i)
            pen.append(x - frequency * c - (presence if c else 0.0))
        m = max(pen)
        lse = m + math.log(sum(math.exp(x - m) for x in pen))
        lps.append([x - lse for x in pen])
        tok = pen.index(m) if given is None else given[len(out)]
        out.append(tok)
        if given is None and tok in eos:
            break
        logits = dec.forward(StepBatch.of(np.array([tok], np.int64), cache)).logits[0][-1]
    return out, lps


def has_repeats(ids: list[int]) -> bool:
    return len(set(ids)) < len(ids)


@pytest.mark.parametrize("penalties", [dict(presence_penalty=1.5, frequency_penalty=0.5), dict(repetition_penalty=3.0),
                                       dict(presence_penalty=-0.5, frequency_penalty=0.25, repetition_penalty=1.3)])
def test_penalties_steer_greedy_decoding_as_the_reference(engine, penalties):
    rec = Recorder()
    sched = Scheduler(engine, emit=rec)
    prompts = [PROMPTS[0], PROMPTS[5], PROMPTS[6]]
    for i, p in enumerate(prompts):
        sched.add(b"c", request(id=f"p{i}", prompt=p, max_new_tokens=24, **penalties))
    run_to_end(sched)
    for i, p in enumerate(prompts):
        plain = solo(engine, p, 24)
        assert has_repeats(plain)  # so the penalties have something to act on
        want, _ = reference_greedy(engine, engine.encode(p), 24, penalties.get("presence_penalty", 0.0),
                                   penalties.get("frequency_penalty", 0.0), penalties.get("repetition_penalty", 1.0))
        ev = rec.final(f"p{i}")
        assert ev["ids"] == want, (p, penalties)
        assert ev["ids"] != plain, (p, penalties)
        assert ev["text"] == engine.decode(ev["ids"]) and "logprobs" not in ev


def test_a_huge_presence_penalty_never_repeats_a_token(engine):
    rec = Recorder()
    sched = Scheduler(engine, emit=rec)
    n = 60
    assert n < engine.model_config.vocab_size
    for i, p in enumerate(PROMPTS[:4]):  # past the API's range: the scheduler takes any finite penalty
        sched.add(b"c", dataclasses.replace(request(id=f"h{i}", prompt=p, max_new_tokens=n), presence_penalty=1e6))
    run_to_end(sched)
    for i, p in enumerate(PROMPTS[:4]):
        ids = rec.final(f"h{i}")["ids"]
        assert len(ids) == n or ids[-1] == EOS_ID
        assert not has_repeats(ids), p
        assert has_repeats(solo(engine, p, len(ids)))


def test_explicit_defaults_change_nothing_greedy_or_seeded(engine):
    defaults = dict(min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logprobs=None)
    rec = Recorder()
    sched = Scheduler(engine, emit=rec)
    for i, p in enumerate(PROMPTS[:3]):
        sched.add(b"c", request(id=f"g{i}", prompt=p, max_new_tokens=12, **defaults))
        sched.add(b"c", request(id=f"s{i}", prompt=p, max_new_tokens=12, temperature=0.9, top_p=0.95, seed=7 + i,
                                **defaults))
        sched.add(b"c", request(id=f"o{i}", prompt=p, max_new_tokens=12, temperature=0.9, top_p=0.95, seed=7 + i))
    run_to_end(sched)
    for i, p in enumerate(PROMPTS[:3]):
        check_final(engine, rec.final(f"g{i}"), p, 12)
        sampled = engine.generate(engine.encode(p), 12, temperature=0.9, top_p=0.95, seed=7 + i, stop_at_eos=True)
        assert rec.final(f"s{i}")["ids"] == rec.final(f"o{i}")["ids"] == sampled
        for rid in (f"g{i}", f"s{i}", f"o{i}"):
            assert all("logprobs" not in ev for ev in rec.of(rid))


@pytest.mark.parametrize("penalties", [{}, dict(presence_penalty=0.8, repetition_penalty=1.5)])
def test_greedy_logprobs_equal_the_reference_and_the_chosen_is_the_most_likely(engine, penalties):
    rec = Recorder()
    sched = Scheduler(engine, emit=rec)
    for i, p in enumerate(PROMPTS[:3]):
        sched.add(b"c", request(id=f"l{i}", prompt=p, max_new_tokens=10, logprobs=5, **penalties))
    sched.add(b"c", request(id="zero", prompt=PROMPTS[3], max_new_tokens=4, logprobs=0, **penalties))
    run_to_end(sched)
    for i, p in enumerate(PROMPTS[:3]):
        ev = rec.final(f"l{i}")
        _, ref = reference_greedy(engine, engine.encode(p), 10, penalties.get("presence_penalty", 0.0),
                                  0.0, penalties.get("repetition_penalty", 1.0), given=ev["ids"])
        assert [e["id"] for e in ev["logprobs"]] == ev["ids"]
        for entry, lp in zip(ev["logprobs"], ref):
            top = entry["top"]
            assert len(top) == 5
            assert entry["logprob"] == max(t["logprob"] for t in top) and top[0]["id"] == entry["id"]
            assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
            assert [t["id"] for t in top] == sorted(range(len(lp)), key=lambda j: -lp[j])[:5]
            assert entry["logprob"] == pytest.approx(lp[entry["id"]], abs=1e-4)
            for t in top:
                assert t["logprob"] == pytest.approx(lp[t["id"]], abs=1e-4)
                assert t["token"] == engine.decode([t["id"]])
            assert entry["token"] == engine.decode([entry["id"]])
            assert sum(math.exp(t["logprob"]) for t in top) <= 1 + 1e-9
    zero = rec.final("zero")
    assert len(zero["logprobs"]) == len(zero["ids"]) and all(e["top"] == [] for e in zero["logprobs"])


def test_sampled_logprobs_are_taken_before_temperature_and_the_filters(engine):
    rec = Recorder()
    sched = Scheduler(engine, emit=rec)
    sched.add(b"c", request(id="t", prompt=PROMPTS[1], max_new_tokens=10, temperature=0.6, top_k=20, min_p=0.05,
                            seed=3, logprobs=3))
    run_to_end(sched)
    ev = rec.final("t")
    _, ref = reference_greedy(engine, engine.encode(PROMPTS[1]), 10, given=ev["ids"])
    assert len(ev["logprobs"]) == len(ev["ids"]) == len(ref)
    for entry, lp in zip(ev["logprobs"], ref):
        assert entry["logprob"] == pytest.approx(lp[entry["id"]], abs=1e-4)  # the raw logits' log-softmax
        assert [t["id"] for t in entry["top"]] == sorted(range(len(lp)), key=lambda j: -lp[j])[:3]


def check_stream(engine, rec: Recorder, rid: str, logprobs: bool) -> list[dict]:
    """Token events' ids (and logprobs) put together are the start of the final's; returns the token events."""
    final = rec.final(rid)
    tokens = [ev for ev in rec.of(rid) if ev["type"] == "token"]
    ids = [i for ev in tokens for i in ev["ids"]]
    assert all(ev["ids"] for ev in tokens)
    assert ids == final["ids"][:len(ids)]
    if logprobs:
        assert all(len(ev["logprobs"]) == len(ev["ids"]) for ev in tokens)
        assert [e for ev in tokens for e in ev["logprobs"]] == final["logprobs"][:len(ids)]
        assert [e["id"] for e in final["logprobs"]] == final["ids"]
    else:
        assert all("logprobs" not in ev for ev in tokens + [final])
    return tokens


@pytest.mark.parametrize("logprobs", [None, 2])
def test_streamed_ids_are_every_id_since_the_last_token_event(engine, logprobs):
    rec = Recorder()
    cases = stop_cases(engine)
    sched = Scheduler(engine, emit=rec, max_active=len(cases) + 9, max_queued=len(cases) + 9)
    for i, (p, stop, _) in enumerate(cases):
        sched.add(b"c", request(id=f"s{i}", prompt=p, max_new_tokens=30, stop=stop, logprobs=logprobs))
    for i, p in enumerate(PROMPTS):
        sched.add(b"c", request(id=f"n{i}", prompt=p, max_new_tokens=3 + 5 * i, logprobs=logprobs))
    held = engine.decode(solo(engine, PROMPTS[0], 20))
    sched.add(b"c", request(id="held", prompt=PROMPTS[0], max_new_tokens=20, stop=held[4] + "\x01",
                            logprobs=logprobs))
    run_to_end(sched)
    for i in range(len(cases)):
        check_stream(engine, rec, f"s{i}", logprobs is not None)
    for i in range(len(PROMPTS)):
        tokens = check_stream(engine, rec, f"n{i}", logprobs is not None)
        final = rec.final(f"n{i}")
        ids, text = [], ""
        for ev in tokens:  # without stop strings each event's text is exactly what its ids add
            ids += ev["ids"]
            text += ev["text"]
            assert engine.decode(ids) == text
        assert text == final["text"] and engine.decode(ids) == final["text"]  # what is left out adds no text
        assert final["ids"][len(ids):] in ([], [EOS_ID])
    tokens = check_stream(engine, rec, "held", logprobs is not None)
    assert rec.final("held")["finish_reason"] == "length"
    assert [i for ev in tokens for i in ev["ids"]] == rec.final("held")["ids"]  # all released in the end
    assert max(len(ev["ids"]) for ev in tokens) >= 2  # the held-back character went out with the next id


def test_cancelled_request_with_logprobs_has_one_entry_per_id(engine):
    rec = Recorder()
    sched = Scheduler(engine, emit=rec)
    sched.add(b"c", request(id="x", prompt=PROMPTS[1], max_new_tokens=100, logprobs=1))
    for _ in range(4):
        sched.step()
    assert sched.cancel(b"c", "x")
    final = rec.final("x")
    assert final["finish_reason"] == "cancelled" and len(final["ids"]) == 4
    assert [e["id"] for e in final["logprobs"]] == final["ids"] and all(len(e["top"]) == 1 for e in final["logprobs"])
    check_stream(engine, rec, "x", True)


def test_logprobs_token_text_is_empty_without_a_tokenizer(engine, monkeypatch):
    monkeypatch.setattr(engine, "source", dataclasses.replace(engine.source, codec=None))
    rec = Recorder()
    sched = Scheduler(engine, emit=rec)
    ids = [72, 105, 33]
    sched.add(b"c", request(id="a", prompt_ids=ids, max_new_tokens=5, logprobs=2))
    run_to_end(sched)
    final = rec.final("a")
    assert final["ids"] == engine.generate(ids, 5)
    assert [ev["type"] for ev in rec.of("a")] == ["final"]  # no text, so no token events
    assert len(final["logprobs"]) == len(final["ids"])
    assert all(e["token"] == "" and [t["token"] for t in e["top"]] == ["", ""] for e in final["logprobs"])


def test_prompt_logprobs_over_chunked_prefill_equal_the_engines_logits(engine):
    """prompt_logprobs on a prompt prefilled in chunks of 3, batched with a request that asks none: each prompt
    token after the first gets the log-softmax of the engine's logits at the position before (raw, whatever
    the penalties), the first a null logprob; the other request and the completion are as without it."""
    rec = Recorder()
    sched = Scheduler(engine, emit=rec, prefill_chunk=3)
    ids = engine.encode("The quick brown fox jumps")
    sched.add(b"c", request(id="scored", prompt_ids=ids, max_new_tokens=3, prompt_logprobs=2,
                            repetition_penalty=1.5))
    sched.add(b"c", request(id="plain", prompt_ids=ids, max_new_tokens=3))
    run_to_end(sched)
    entries = rec.final("scored")["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0]["logprob"] is None and entries[0]["id"] == ids[0]
    logits = engine.logits(ids).astype(np.float64)
    lp = logits - logits.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    for j, e in enumerate(entries[1:]):
        assert e["id"] == ids[j + 1] and abs(e["logprob"] - lp[j, ids[j + 1]]) < 1e-5
        assert [t["id"] for t in e["top"]] == list(np.argsort(-lp[j], kind="stable")[:2])
    assert "prompt_logprobs" not in rec.final("plain")
    assert rec.final("plain")["ids"] == engine.generate(ids, 3, temperature=0.0, stop_at_eos=False)[:len(
        rec.final("plain")["ids"])]
