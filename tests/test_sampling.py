"""Sampling controls (penalties, min-p) and logprobs as pure functions, and the API's validation of them.

The references here are written independently, in plain Python float64 loops over a small vocabulary."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from coordinator.errors import ConfigValueError
from coordinator.model.ops import softmax
from coordinator.model.sampling import Sampler, SamplingParams, filtered_probs, penalized, top_logprobs
from coordinator.serving.api import ApiError, Limits, decode_request


def ref_penalized(logits, prompt, out, presence=0.0, frequency=0.0, repetition=1.0):
    res = []
    for i, x in enumerate(float(v) for v in logits):
        if i in prompt or i in out:
            x = x / repetition if x > 0 else x * repetition
        c = out.count(i)
        x -= frequency * c
        if c:
            x -= presence
        res.append(x)
    return res


def ref_log_softmax(logits):
    xs = [float(v) for v in logits]
    m = max(xs)
    lse = m + math.log(sum(math.exp(x - m) for x in xs))
    return [x - lse for x in xs]


def counts(ids, v):
    c = np.zeros(v, np.int64)
    for t in ids:
        c[t] += 1
    return c


# -- penalties ---------------------------------------------------------------


def test_presence_and_frequency_penalties_on_the_generated_counts():
    logits = np.array([1.5, -0.5, 0.0, 2.0, -3.0, 0.25], np.float32)
    prompt, out = [0, 1, 1], [3, 3, 3, 1, 5]  # the prompt's ids must not count for these two
    got = penalized(logits, SamplingParams(presence_penalty=0.7, frequency_penalty=0.3), counts(prompt, 6),
                    counts(out, 6))
    want = ref_penalized(logits, prompt, out, presence=0.7, frequency=0.3)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    assert got[0] == np.float32(1.5) and got[2] == 0.0 and got[4] == np.float32(-3.0)  # never generated: untouched
    assert got[3] == pytest.approx(2.0 - 0.7 - 3 * 0.3)
    # negative penalties encourage repeats
    got = penalized(logits, SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.5), counts(prompt, 6),
                    counts(out, 6))
    np.testing.assert_allclose(got, ref_penalized(logits, prompt, out, presence=-1.0, frequency=-0.5), atol=1e-12)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output():
    logits = np.array([1.5, -0.5, 0.0, 2.0, -3.0, 0.25, 4.0], np.float32)
    prompt, out = [0, 1], [4, 5, 5]
    got = penalized(logits, SamplingParams(repetition_penalty=2.0), counts(prompt, 7), counts(out, 7))
    np.testing.assert_allclose(got, ref_penalized(logits, prompt, out, repetition=2.0), rtol=0, atol=1e-12)
    assert list(got) == [0.75, -1.0, 0.0, 2.0, -6.0, 0.125, 4.0]
    # below 1 it favours the seen ids
    got = penalized(logits, SamplingParams(repetition_penalty=0.5), counts(prompt, 7), counts(out, 7))
    np.testing.assert_allclose(got, ref_penalized(logits, prompt, out, repetition=0.5), rtol=0, atol=1e-12)


def test_all_penalties_together_equal_the_reference_on_random_logits():
    rng = np.random.default_rng(5)
    v = 40
    for _ in range(20):
        logits = (rng.standard_normal(v) * 3).astype(np.float32)
        prompt = rng.integers(0, v, size=int(rng.integers(1, 10))).tolist()
        out = rng.integers(0, v, size=int(rng.integers(0, 15))).tolist()
        p = SamplingParams(presence_penalty=float(rng.uniform(-2, 2)), frequency_penalty=float(rng.uniform(-2, 2)),
                           repetition_penalty=float(rng.uniform(0.2, 5)))
        got = penalized(logits, p, counts(prompt, v), counts(out, v))
        want = ref_penalized(logits, prompt, out, p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-9)


def test_penalties_off_return_the_logits_untouched():
    logits = np.array([0.1, 2.0, -1.0], np.float32)
    assert penalized(logits, SamplingParams(), counts([0, 1], 3), counts([1, 1], 3)) is logits
    assert not SamplingParams(temperature=0.7, top_k=3, top_p=0.9, min_p=0.2).penalized
    for on in (dict(presence_penalty=0.1), dict(frequency_penalty=-0.1), dict(repetition_penalty=1.1)):
        assert SamplingParams(**on).penalized


# -- min-p ---------------------------------------------------------------------


@pytest.mark.parametrize("temperature, min_p, kept", [
    (1.0, 0.0, [0, 1, 2, 3]), (1.0, 0.3, [0, 1, 2]), (1.0, 0.6, [0, 1]), (1.0, 0.8, [0]), (1.0, 1.0, [0]),
    (2.0, 0.6, [0, 1, 2]),  # after temperature: sqrt flattens the ratios (0.87, 0.71, 0.5)
    (0.5, 0.3, [0, 1]),  # squares sharpen them (0.56, 0.25, 0.06)
])
def test_min_p_keeps_exactly_the_tokens_at_least_min_p_times_the_top(temperature, min_p, kept):
    probs = [0.4, 0.3, 0.2, 0.1]  # ratios to the top: 1, 0.75, 0.5, 0.25
    logits = np.log(np.array(probs))
    got = filtered_probs(logits, SamplingParams(temperature=temperature, min_p=min_p))
    assert list(np.flatnonzero(got)) == kept
    tempered = [p ** (1 / temperature) for p in probs]
    want = [t if i in kept else 0.0 for i, t in enumerate(tempered)]
    assert got == pytest.approx([w / sum(want) for w in want], rel=1e-12)


def test_min_p_on_random_logits_and_after_top_k():
    rng = np.random.default_rng(9)
    for _ in range(30):
        logits = rng.standard_normal(64) * 2
        t, m = float(rng.uniform(0.3, 2)), float(rng.uniform(0.01, 0.9))
        got = filtered_probs(logits, SamplingParams(temperature=t, min_p=m))
        p = [math.exp(x / t) for x in logits]
        keep = [i for i, x in enumerate(p) if x >= m * max(p)]
        assert list(np.flatnonzero(got)) == keep
        assert got.sum() == pytest.approx(1.0)
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    assert list(np.flatnonzero(filtered_probs(logits, SamplingParams(temperature=1.0, top_k=2, min_p=0.3)))) == [0, 1]
    assert list(np.flatnonzero(filtered_probs(logits, SamplingParams(temperature=1.0, top_k=3, min_p=0.6)))) == [0, 1]


# -- logprobs --------------------------------------------------------------------


def test_top_logprobs_equal_log_softmax_most_likely_first():
    rng = np.random.default_rng(3)
    for v, n in ((50, 5), (50, 0), (7, 20), (300, 20), (1, 1)):
        logits = (rng.standard_normal(v) * 4).astype(np.float32)
        ref = ref_log_softmax(logits)
        token = int(rng.integers(0, v))
        chosen, top = top_logprobs(logits, token, n)
        assert isinstance(chosen, float) and chosen == pytest.approx(ref[token], abs=1e-12)
        want = sorted(range(v), key=lambda i: (-ref[i], i))[:n]
        assert [i for i, _ in top] == want
        assert len(top) == min(n, v)
        for i, lp in top:
            assert isinstance(i, int) and isinstance(lp, float) and lp == pytest.approx(ref[i], abs=1e-12)
        assert all(a[1] >= b[1] for a, b in zip(top, top[1:]))


def test_top_logprobs_break_ties_by_id_and_ignore_temperature():
    logits = np.array([1.0, 3.0, 1.0, 3.0, 0.0, 3.0], np.float32)
    _, top = top_logprobs(logits, 4, 4)
    assert [i for i, _ in top] == [1, 3, 5, 0]
    assert top[0][1] == top[1][1] == top[2][1]


# -- the Sampler -------------------------------------------------------------------


def old_sampler_tokens(params: SamplingParams, steps: list[np.ndarray]) -> list[int]:
    """What the Sampler chose before penalties existed: argmax, or one rng.choice over filtered_probs a step."""
    rng = np.random.default_rng(params.seed)
    out = []
    for logits in steps:
        if params.temperature == 0:
            out.append(int(np.argmax(logits)))
        else:
            scaled = logits.astype(np.float64) / params.temperature
            if params.top_k and params.top_k < scaled.size:
                kth = np.partition(scaled, -params.top_k)[-params.top_k]
                scaled = np.where(scaled >= kth, scaled, -np.inf)
            probs = softmax(scaled)
            if params.top_p < 1.0:
                order = np.argsort(-probs, kind="stable")
                mass_before = np.cumsum(probs[order]) - probs[order]
                mask = np.zeros_like(probs, dtype=bool)
                mask[order[mass_before < params.top_p]] = True
                probs = np.where(mask, probs, 0.0)
                probs /= probs.sum()
            out.append(int(rng.choice(probs.size, p=probs)))
    return out


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, seed=11),
                                    SamplingParams(temperature=1.3, top_k=5, top_p=0.9, seed=2)])
def test_defaults_choose_what_the_sampler_chose_before(params):
    rng = np.random.default_rng(0)
    steps = [(rng.standard_normal(32) * 2).astype(np.float32) for _ in range(60)]
    sampler = Sampler(params, prompt_ids=[1, 2, 3])
    got = [sampler(x) for x in steps]
    assert got == old_sampler_tokens(params, steps)
    assert sampler.output_counts is None  # nothing kept when no penalty is on


def test_sampler_counts_prompt_and_chosen_ids_and_penalises_with_them():
    v = 12
    rng = np.random.default_rng(1)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.5)
    prompt = [3, 3, 7]
    sampler = Sampler(params, prompt_ids=prompt)
    chosen: list[int] = []
    for _ in range(25):
        logits = rng.standard_normal(v).astype(np.float32)
        token, adjusted = sampler.choose(logits)
        want = ref_penalized(logits, prompt, chosen, 0.5, 0.25, 1.5)
        np.testing.assert_allclose(adjusted, want, rtol=0, atol=1e-12)
        assert token == max(range(v), key=lambda i: want[i])  # greedy takes the penalised argmax
        chosen.append(token)
    assert sampler.output_counts.tolist() == counts(chosen, v).tolist()
    assert sampler.prompt_counts.tolist() == counts(prompt, v).tolist()


def test_greedy_under_a_huge_presence_penalty_never_repeats_while_the_vocabulary_allows():
    v = 9
    logits = np.linspace(0.0, 1.0, v).astype(np.float32)  # the same every step: plain greedy repeats id 8
    plain = Sampler(SamplingParams())
    assert [plain(logits) for _ in range(v)] == [v - 1] * v
    sampler = Sampler(SamplingParams(presence_penalty=1e6))
    got = [sampler(logits) for _ in range(v)]
    assert sorted(got) == list(range(v)) and got == list(range(v - 1, -1, -1))


# -- parameters and the API --------------------------------------------------------


@pytest.mark.parametrize("bad", [dict(min_p=-0.1), dict(min_p=1.5), dict(min_p=float("nan")),
                                 dict(presence_penalty=float("inf")), dict(frequency_penalty="1"),
                                 dict(repetition_penalty=0), dict(repetition_penalty=-1.0),
                                 dict(repetition_penalty=True)])
def test_sampling_params_refuse_bad_new_values(bad):
    with pytest.raises(ConfigValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def gen(**fields):
    return decode_request(json.dumps({"type": "generate", "id": "q", "prompt": "hi", **fields}).encode(), Limits())


def test_the_new_fields_default_to_off():
    req = gen()
    assert (req.min_p, req.presence_penalty, req.frequency_penalty, req.repetition_penalty, req.logprobs) == \
        (0.0, 0.0, 0.0, 1.0, None)


@pytest.mark.parametrize("field, value", [
    ("min_p", 0), ("min_p", 1), ("min_p", 0.05), ("presence_penalty", -2), ("presence_penalty", 2.0),
    ("frequency_penalty", -2.0), ("frequency_penalty", 2), ("repetition_penalty", 10), ("repetition_penalty", 1e-3),
    ("logprobs", 0), ("logprobs", 20), ("logprobs", None),
])
def test_the_new_fields_accept_their_range(field, value):
    assert getattr(gen(**{field: value}), field) == value


@pytest.mark.parametrize("field, value", [
    ("min_p", "0.1"), ("min_p", -0.01), ("min_p", 1.01), ("min_p", None), ("min_p", True), ("min_p", [0.1]),
    ("presence_penalty", -2.01), ("presence_penalty", 2.5), ("presence_penalty", "x"), ("presence_penalty", False),
    ("frequency_penalty", -3), ("frequency_penalty", 2.001), ("frequency_penalty", {}),
    ("repetition_penalty", 0), ("repetition_penalty", -1), ("repetition_penalty", 10.5),
    ("repetition_penalty", "2"),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", 1.5), ("logprobs", "3"), ("logprobs", True), ("logprobs", [1]),
])
def test_the_new_fields_refuse_wrong_types_and_ranges_naming_the_field(field, value):
    with pytest.raises(ApiError) as info:
        gen(**{field: value})
    assert info.value.code == "bad_request" and info.value.request_id == "q"
    assert f"'{field}'" in info.value.message


@pytest.mark.parametrize("field, text, where", [("min_p", "NaN", "[0.0, 1.0]"), ("presence_penalty", "Infinity", "2.0"),
                                                ("repetition_penalty", "-Infinity", "(0.0, 10.0]")])
def test_non_finite_numbers_are_refused_with_the_range(field, text, where):
    raw = ('{"type": "generate", "id": "q", "prompt": "hi", "%s": %s}' % (field, text)).encode()
    with pytest.raises(ApiError) as info:
        decode_request(raw, Limits())
    assert info.value.code == "bad_request" and f"'{field}'" in info.value.message and where in info.value.message


def test_logprobs_range_is_in_the_message():
    with pytest.raises(ApiError) as info:
        gen(logprobs=21)
    assert "between 0 and 20" in info.value.message and "21" in info.value.message
