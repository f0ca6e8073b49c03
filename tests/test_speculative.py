"""Speculative decoding (coordinator/speculative.py, Sampler.choose's draft, Scheduler._verify): the same
tokens as plain greedy decoding, the same distribution when sampling, drafts that stand counted, and a
sequence whose drafts never stand soon stops drafting."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator import scheduler as scheduler_module
from coordinator.cli.make_model import make_model
from coordinator.config import EngineConfig
from coordinator.engine import Engine
from coordinator.model.sampling import Sampler, filtered_probs
from coordinator.model.sampling_params import SamplingParams
from coordinator.request import GenerateRequest
from coordinator.scheduler import Scheduler
from coordinator.model.step import StepBatch
from coordinator.speculative import (MAX_PAUSE, DraftHistory, DraftLength, NgramIndex, StepCosts, best_length,
                                     expected_tokens)

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "glm4_moe")
# chi-square critical values at significance 0.001 (a true test fails once in a thousand runs), by degrees of
# freedom: scipy.stats.chi2.ppf(0.999, df)
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266, 7: 24.322}


def reference_draft(ids: list[int], k: int, max_n: int = 4, min_n: int = 2) -> list[int]:
    """Prompt lookup written plainly: the longest suffix (max_n..min_n) seen earlier, its latest occurrence."""
    for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
        suffix = ids[len(ids) - n:]
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start:start + n] == suffix:
                return ids[start + n:start + n + k]
    return []


def test_prompt_lookup_equals_the_plain_search():
    """NgramIndex against the search written plainly: a fresh index on each list, and one index asked again as its
    list grows by one to three ids a step (its maps brought up to date, not rebuilt); with a window, an occurrence
    that starts before it is not found."""
    rng = np.random.default_rng(0)
    for trial in range(400):
        ids = rng.integers(0, 2 + trial % 5, size=rng.integers(1, 40)).tolist()  # small alphabets: many matches
        k = int(rng.integers(1, 6))
        assert NgramIndex().draft(np.array(ids, np.int64), k) == reference_draft(ids, k), ids
    for trial in range(40):
        ids = rng.integers(0, 2 + trial % 4, size=200)
        index, L = NgramIndex(), 0
        while L < ids.size:
            L += int(rng.integers(1, 4))
            assert index.draft(ids[:L], 3) == reference_draft(ids[:L].tolist(), 3), (trial, L)
    assert NgramIndex().draft(np.array([1, 2, 3, 9, 1, 2, 3], np.int64), 3) == [9, 1, 2]
    assert NgramIndex().draft(np.array([5, 6, 7, 8], np.int64), 3) == []
    far = np.array([1, 2, 7, 5, 5, 5, 5, 5, 1, 2], np.int64)  # (1, 2) last seen 8 ids back
    assert NgramIndex(window=10).draft(far, 2) == [7, 5] and NgramIndex(window=9).draft(far, 2) == []


def test_draft_length_adapts_and_pauses():
    always = DraftLength(4)
    for _ in range(10):
        always.update(always.next(), always.k)
    assert always.next() == 4 and always.accepted == always.drafted
    never = DraftLength(4)
    tried = 0
    steps = 2000
    for _ in range(steps):
        k = never.next()
        tried += k
        never.update(k, 0)
    assert tried <= steps // MAX_PAUSE + 20  # about one draft row every MAX_PAUSE steps once it gives up
    back = DraftLength(4)
    for _ in range(5):
        back.update(back.next() or 1, 0)
    while back.next() == 0:
        pass
    back.update(1, 1)
    assert back.pause == 0 and back.next() > 0 and back.pause_len == 1  # a hit that pays ends the backing off


def test_a_new_sequence_starts_where_the_last_one_left_off():
    """DraftHistory: after a sequence whose drafts never stood, the next one tries no draft for as long as the last
    one ended up pausing (not the ramp 1, 2, 4, ... again); after one whose drafts stood, the next drafts at once;
    after one whose drafts stood at times, the next one's pauses start from 1; a sequence that tried nothing
    leaves the history as it was."""
    history = DraftHistory()
    assert history.start(4).next() == DraftLength(4).next() > 0  # nothing learnt yet: the prior's count
    never = history.start(4)
    for _ in range(1000):
        never.update(never.next(), 0)
    history.keep(never)
    assert never.pause_len == MAX_PAUSE
    successor = history.start(4)
    quiet = 0
    while successor.next() == 0:
        quiet += 1
    assert quiet >= MAX_PAUSE - 1  # a fresh DraftLength tries drafts on its first step
    history.keep(DraftLength(4))  # tried nothing
    assert history.start(4).next() == 0
    always = history.start(4)
    for _ in range(200):
        always.update(always.next(), always.k)
    history.keep(always)
    assert history.start(4).next() == 4
    spells = history.start(4)  # drafts that stood at first, then a long spell of misses
    spells.update(spells.next(), 1)
    for _ in range(500):
        spells.update(spells.next(), 0)
    history.keep(spells)
    assert spells.pause_len == MAX_PAUSE and history.pause_len == 1  # its pauses start from 1 again


def test_expected_tokens_and_best_length_against_enumeration():
    """expected_tokens against the mean over every accept/reject pattern's probability; best_length against the
    rate of every count."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        acc = rng.uniform(0, 1, 6).tolist()
        k = int(rng.integers(0, 7))
        want = 0.0
        for bits in range(1 << k):  # bit j: draft j + 1's outcome; the step keeps the leading run of ones, plus one
            p, run, broken = 1.0, 0, False
            for j in range(k):
                ok = bits >> j & 1
                p *= acc[j] if ok else 1 - acc[j]
                if ok and not broken:
                    run += 1
                else:
                    broken = True
            want += p * (run + 1)
        assert expected_tokens(acc, k) == pytest.approx(want, rel=1e-12)
        ratio = float(rng.uniform(0, 1))
        rates = [expected_tokens(acc, j) / (1 + ratio * j) for j in range(7)]
        assert rates[best_length(acc, ratio, 6)] == pytest.approx(max(rates), rel=1e-9)
    # the trained MTP head's profile (first two drafts nearly always stand, the third seldom): two drafts pay at
    # an in-process step's cost ratio; free drafts: all of them; worthless drafts: none
    profile = [0.96, 0.99, 0.29, 0.8]
    assert best_length(profile, 0.37, 4) == 2
    assert best_length(profile, 0.0, 4) == 4
    assert best_length([0.1] * 4, 0.37, 4) == 0


def test_draft_length_follows_the_acceptance_of_each_position():
    """A sequence whose first two drafts stand and third never does settles on two drafts at ratio 0.37 (a third
    tried again now and then, as its estimate drifts back), and on one when the second stops standing."""
    d = DraftLength(4)

    def last_counts(stand: int) -> list[int]:  # 60 steps whose first ``stand`` drafts stand: the last 20 counts
        ks = []
        for _ in range(60):
            ks.append(d.next(0.37))
            d.update(ks[-1], min(ks[-1], stand))
        return ks[-20:]

    ks = last_counts(2)
    assert ks.count(2) >= 17 and set(ks) <= {2, 3}
    ks = last_counts(1)
    assert ks.count(1) >= 17 and set(ks) <= {1, 2}


def test_a_position_given_up_after_misses_is_tried_again():
    """The trained MTP head's profile, drawn at random (draft 1 stands 99% of the time, draft 2 after it 80%,
    draft 3 25%): at ratio 0.43 two drafts pay most (2.77 tokens for 1.86 steps' time against 1.99 for 1.43), and
    the count settles there most of the time, though runs of misses on draft 2 make one draft look better for a
    while; acceptance of each position follows its true rate."""
    rng = np.random.default_rng(0)
    truth = [0.99, 0.8, 0.25, 0.25]
    assert best_length(truth, 0.43, 4) == 2
    d = DraftLength(4)
    ks = []
    for _ in range(3000):
        k = d.next(0.43)
        took = 0
        while took < k and rng.random() < truth[took]:
            took += 1
        d.update(k, took)
        ks.append(k)
    counts = np.bincount(ks[500:], minlength=5)
    assert counts[2] > 0.6 * counts.sum() and counts[1] > 0, counts  # mostly two, one after runs of misses


def test_step_costs_fit_the_forward_and_the_drafts():
    """Steps of 1..5 rows costing 2 ms + 0.5 ms a row (with 5% noise) and drafts of 0.3 ms each: the fit finds
    them, and the ratio is (0.5 + 0.3) / (2 + 0.5) for one sequence, (0.5 + 0.3) / (1 + 0.5) for two."""
    rng = np.random.default_rng(1)
    costs = StepCosts()
    assert costs.ratio(1) == StepCosts.PRIOR_RATIO  # nothing measured yet
    for _ in range(200):
        rows = int(rng.integers(1, 6))
        costs.forward(rows, (2e-3 + 0.5e-3 * rows) * rng.uniform(0.95, 1.05))
        costs.drafts(rows - 1, 0.3e-3 * (rows - 1))
    assert costs.fixed == pytest.approx(2e-3, rel=0.1) and costs.per_row == pytest.approx(0.5e-3, rel=0.1)
    assert costs.per_draft == pytest.approx(0.3e-3, rel=1e-6)
    assert costs.ratio(1) == pytest.approx(0.8 / 2.5, rel=0.1)
    assert costs.ratio(2) == pytest.approx(0.8 / 1.5, rel=0.1)
    slope = costs.per_row
    for _ in range(200):  # the machine slows down twice over while the rows stop varying: the slope is kept (but
        costs.forward(3, 2 * (2e-3 + 0.5e-3 * 3))  # for the one pair across the change), the fixed part follows
    assert costs.per_row == pytest.approx(slope, rel=0.25)
    assert costs.fixed + 3 * costs.per_row == pytest.approx(2 * (2e-3 + 1.5e-3), rel=1e-3)


@pytest.mark.parametrize("draft", [0, 2, 5])
def test_a_draft_leaves_the_sampled_distribution_as_it_was(draft):
    """Sampler.choose with a draft: the token's distribution is filtered_probs' (chi-square, significance 0.001),
    the draft taken with its own probability."""
    logits = np.array([2.0, 1.5, 1.0, 0.2, -0.5, -1.0, 0.7, 0.1], np.float32)
    params = SamplingParams(temperature=0.9, seed=1)
    want = filtered_probs(logits, params)
    sampler = Sampler(params)
    n = 20000
    counts = np.bincount([sampler.choose(logits, draft)[0] for _ in range(n)], minlength=logits.size)
    chi2 = float(((counts - n * want) ** 2 / (n * want)).sum())
    assert chi2 < CHI2_999[7], (counts / n, want)


def run(eng, requests, **kwargs) -> tuple[dict[str, list[int]], dict]:
    """Requests through one Scheduler to their ends -> (generated ids by request id, the scheduler's stats)."""
    out: dict[str, list[int]] = {}

    def emit(_client, ev):
        if ev["type"] == "final":
            out[ev["id"]] = ev["ids"]

    sched = Scheduler(eng, emit, max_active=8, max_queued=len(requests), **kwargs)
    for r in requests:
        sched.add(b"c", r)
    while sched.busy:
        sched.step()
    return out, sched.stats


def repetitive_requests(eng, n: int = 4, max_new: int = 48) -> list[GenerateRequest]:
    text = "the cat sat on the mat. the cat sat on the mat. the cat"
    return [GenerateRequest(id=f"r{i}", prompt_ids=tuple(eng.encode(text)[i:]), max_new_tokens=max_new,
                            stream=False) for i in range(n)]


@pytest.fixture
def prior_costs(monkeypatch):
    """A draft's cost held at its prior ratio to a plain step, for the tests whose subject is what drafts do, not
    whether they pay: measured step times on a loaded host can make drafting pause for a whole run (a run of the
    full suite drafted nothing once)."""
    monkeypatch.setattr(StepCosts, "ratio", lambda self, sequences: StepCosts.PRIOR_RATIO)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_drafts_is_greedy(tmp_path, arch, prior_costs):
    """Every architecture, in-process: with prompt-lookup drafts the greedy tokens of several sequences decoded
    together are the tokens without, and drafts were tried and taken."""
    model = make_model(tmp_path / arch, arch=arch, seed=2)
    with Engine.open(model, EngineConfig(pool="inproc")) as eng:
        reqs = repetitive_requests(eng)
        plain, _ = run(eng, reqs)
        drafted, stats = run(eng, reqs, speculative="ngram", draft_max=4)
    assert drafted == plain
    assert stats["drafted_tokens"] > 0 and stats["accepted_drafts"] > 0, stats


def test_rejected_drafts_rewind_qwen3_next_states(tmp_path, prior_costs):
    """Qwen3-Next's Gated DeltaNet states advance over every drafted token and go back (KVCache.truncate) to the
    last one that stood: with drafts both taken and refused, split over two worker processes, the greedy tokens
    are those without drafts."""
    model = make_model(tmp_path / "m", arch="qwen3_next", seed=2)
    with Engine.open(model, EngineConfig(pool="process", numa_split=True, nodes=2)) as eng:
        reqs = repetitive_requests(eng, n=3, max_new=96)
        plain, _ = run(eng, reqs)
        drafted, stats = run(eng, reqs, speculative="ngram", draft_max=4)
    assert drafted == plain
    assert 0 < stats["accepted_drafts"] < stats["drafted_tokens"], stats


def test_a_truncated_qwen3_next_cache_is_the_cache_that_never_took_the_drafts(tmp_path):
    """A step over 5 drafts then truncate to keep 2 leaves the cache (keys, values and Gated DeltaNet states) as a
    step over those 2 did: the next token's logits agree within float32 rounding (the rows were computed in a batch
    of 5 rather than 2), and differ from the untruncated cache's by far more."""
    model = make_model(tmp_path / "m", arch="qwen3_next", seed=2)
    prompt, drafts, nxt = np.arange(40, 110), np.array([7, 9, 11, 13, 15]), np.array([21])
    with Engine.open(model, EngineConfig(pool="inproc")) as eng:
        rolled, kept, whole = eng.new_cache(), eng.new_cache(), eng.new_cache()
        for cache, step in ((rolled, drafts), (kept, drafts[:2]), (whole, drafts)):
            eng.step(StepBatch([(prompt, cache)])).logits
            eng.step(StepBatch([(step, cache)], all_rows=frozenset({0}))).logits
        rolled.truncate(prompt.size + 2)
        after = [eng.step(StepBatch([(nxt, cache)])).logits[0] for cache in (rolled, kept, whole)]
    scale = np.abs(after[1]).max()
    assert np.abs(after[0] - after[1]).max() < 1e-5 * scale
    assert np.abs(after[2] - after[1]).max() > 1e-2 * scale


def test_greedy_with_drafts_split_over_two_worker_processes(tmp_path):
    model = make_model(tmp_path / "m", seed=3)
    with Engine.open(model, EngineConfig(pool="process", numa_split=True, nodes=2)) as eng:
        reqs = repetitive_requests(eng, n=3, max_new=32)
        plain, _ = run(eng, reqs)
        drafted, stats = run(eng, reqs, speculative="ngram")
    assert drafted == plain and stats["accepted_drafts"] > 0


def test_stops_and_the_length_limit_hold_within_a_step(tmp_path):
    """A stop string, an eos id or max_new_tokens met in the middle of the drafts ends the sequence there, as
    without drafts."""
    model = make_model(tmp_path / "m", seed=2)
    with Engine.open(model, EngineConfig(pool="inproc")) as eng:
        base = repetitive_requests(eng, n=2, max_new=40)
        plain, _ = run(eng, base)
        text = eng.decode(plain["r0"])
        stop = text[len(text) // 2:len(text) // 2 + 3]
        stop_token = plain["r1"][len(plain["r1"]) // 2]
        reqs = [GenerateRequest(id="s", prompt_ids=base[0].prompt_ids, max_new_tokens=40, stop=(stop,), stream=False),
                GenerateRequest(id="t", prompt_ids=base[1].prompt_ids, max_new_tokens=40,
                                stop_token_ids=(stop_token,), stream=False),
                GenerateRequest(id="n", prompt_ids=base[0].prompt_ids, max_new_tokens=7, stream=False)]
        assert run(eng, reqs, speculative="ngram")[0] == run(eng, reqs)[0]


def test_sampling_with_drafts_keeps_the_models_distribution(tmp_path, monkeypatch):
    """The first two sampled tokens (top_k 2, so at most 4 outcomes), the second chosen with a fixed token
    drafted: the outcomes' frequencies match the model's own probabilities (chi-square, significance 0.001)."""
    model = make_model(tmp_path / "m", seed=4)
    with Engine.open(model, EngineConfig(pool="inproc")) as eng:
        prompt = tuple(eng.encode("hello there"))
        first = eng.logits(list(prompt))[-1]
        params = SamplingParams(temperature=1.0, top_k=2)
        p1 = filtered_probs(first, params)
        want = {}
        for t1 in np.flatnonzero(p1):
            if int(t1) in eng.model_config.eos_token_ids:  # the sequence ends there
                want[(int(t1),)] = p1[t1]
                continue
            p2 = filtered_probs(eng.logits([*prompt, int(t1)])[-1], params)
            for t2 in np.flatnonzero(p2):
                want[(int(t1), int(t2))] = p1[t1] * p2[t2]
        draft = max(want, key=want.get)[1]  # a likely second token: drafted at every step, often taken
        monkeypatch.setattr(scheduler_module.NgramIndex, "draft", lambda self, ids, k: [draft] * k)
        n = 3000
        reqs = [GenerateRequest(id=f"r{i}", prompt_ids=prompt, max_new_tokens=3, temperature=1.0, top_k=2, seed=i,
                                stream=False) for i in range(n)]  # the second token is chosen with a draft
        got, stats = run(eng, reqs, speculative="ngram", draft_max=1)
    assert stats["accepted_drafts"] > 0
    counts = {key: 0 for key in want}
    for ids in got.values():
        counts[tuple(ids[:2])] += 1
    chi2 = sum((counts[key] - n * p) ** 2 / (n * p) for key, p in want.items())
    assert chi2 < CHI2_999[len(want) - 1], (counts, want)


def test_a_server_with_drafts_streams_the_greedy_tokens_of_concurrent_requests(serve, serve_engine):
    """`strata serve --speculative ngram`, eight concurrent streamed requests with repetitive prompts: each one's
    streamed text and final ids equal the engine's own greedy ones, and the server counts drafts that stood."""
    import threading

    from coordinator.serving.client import Client

    s = serve("--speculative", "ngram", "--draft-max", "3")
    text = "ab ab ab cd cd ef ef ef ab ab"
    prompts = [serve_engine.encode(text)[i:] for i in range(8)]
    results: dict[int, tuple[str, list[int]]] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            with Client(s.address, timeout=30) as c:
                gen = c.generate(prompts[i], max_new_tokens=24)
                results[i] = ("".join(gen), gen.final["ids"])
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for i, (streamed, ids) in results.items():
        want = serve_engine.generate(prompts[i], 24, temperature=0.0)
        assert ids == want, i
        assert streamed == serve_engine.decode(want)
    with Client(s.address, timeout=10) as c:
        stats = c.stats()
    assert stats["accepted_drafts"] > 0 and stats["drafted_tokens"] >= stats["accepted_drafts"]
    from coordinator.serving.http import prometheus

    text = prometheus(stats, {}, 0).splitlines()
    assert f"strata_spec_accepted_tokens_total {float(stats['accepted_drafts'])}" in text


def test_drafts_with_a_grammar_and_logprobs(tmp_path):
    """A grammar-constrained request and one asking for logprobs: the same tokens with drafts as without, the
    logprobs the same to float32 rounding (the rows are computed in other batch shapes)."""
    from coordinator.text.grammar import GrammarSpec

    model = make_model(tmp_path / "m", seed=2)
    with Engine.open(model, EngineConfig(pool="inproc")) as eng:
        base = repetitive_requests(eng, n=2, max_new=40)
        reqs = [GenerateRequest(id="g", prompt_ids=base[0].prompt_ids, max_new_tokens=40, stream=False,
                                grammar=GrammarSpec("regex", "[a-z .]{1,40}")),
                GenerateRequest(id="l", prompt_ids=base[1].prompt_ids, max_new_tokens=40, stream=False, logprobs=2)]
        events: dict[str, dict[str, dict]] = {}
        for mode in ("off", "ngram"):
            got: dict[str, dict] = {}
            sched = Scheduler(eng, lambda _c, ev, got=got: got.__setitem__(ev["id"], ev) if ev["type"] == "final"
                              else None, speculative=mode)
            for r in reqs:
                sched.add(b"c", r)
            while sched.busy:
                sched.step()
            events[mode] = got
            if mode == "ngram":
                assert sched.stats["accepted_drafts"] > 0
    for rid in ("g", "l"):
        assert events["ngram"][rid]["ids"] == events["off"][rid]["ids"], rid
    assert all(ch in "abcdefghijklmnopqrstuvwxyz ." for ch in events["ngram"]["g"]["text"])
    got = [e["logprob"] for e in events["ngram"]["l"]["logprobs"]]
    want = [e["logprob"] for e in events["off"]["l"]["logprobs"]]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
