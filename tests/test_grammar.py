"""Constrained decoding (coordinator/text/grammar.py): the text always stays inside the grammar.

Random-weight models wander anywhere the vocabulary lets them, so they are the hard case: every sampled text
must parse and match its schema, and end where the grammar lets it (the model's eos), not at the length limit.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from coordinator.cli.make_model import make_model
from coordinator.config import EngineConfig
from coordinator.engine import Engine
from coordinator.text.grammar import GrammarError, GrammarSpec
from coordinator.request import ApiError, GenerateRequest
from coordinator.scheduler import Scheduler, generate
from coordinator.serving.api import decode_request
from coordinator.request import Limits

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
        "score": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": -9, "maximum": 9}]},
    },
    "required": ["name", "age", "tags", "ok", "score"],
    "additionalProperties": False,
}
MAX_TOKENS = 200  # above the longest text SCHEMA allows, in byte tokens (a character is at most 4; escapes 6)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    eng = Engine.open(make_model(tmp_path_factory.mktemp("grammar") / "m", seed=3), EngineConfig(pool="inproc"))
    yield eng
    eng.close()


def run_all(engine, requests: list[GenerateRequest]) -> dict[str, dict]:
    """Every request through one Scheduler (batched as served) -> its final or error event, by id."""
    events: dict[str, dict] = {}

    def emit(_client, ev):
        if ev["type"] in ("final", "error"):
            events[ev["id"]] = ev

    sched = Scheduler(engine, emit, max_active=16, max_queued=len(requests))
    for r in requests:
        sched.add(b"c", r)
    while sched.busy:
        sched.step()
    return events


def test_json_schema_holds_on_100_random_generations(engine):
    spec = GrammarSpec.json_schema(SCHEMA)
    reqs = [GenerateRequest(id=f"r{i}", prompt_ids=(1 + i % 50, 7), max_new_tokens=MAX_TOKENS, temperature=1.0,
                            seed=i, grammar=spec, stream=False) for i in range(100)]
    events = run_all(engine, reqs)
    lengths = []
    for r in reqs:
        ev = events[r.id]
        assert ev["type"] == "final" and ev["finish_reason"] == "eos", ev
        doc = json.loads(ev["text"])
        jsonschema.validate(doc, SCHEMA)
        assert list(doc) == list(SCHEMA["properties"])  # in the schema's order, as OpenAI writes them
        lengths.append(len(ev["ids"]))
    assert len({events[r.id]["text"] for r in reqs}) > 50  # sampled: the texts differ, the schema holds them all


def test_without_grammar_the_same_sampling_is_not_json(engine):
    """The control: the same requests without the grammar do not make JSON (so the test above tests it)."""
    reqs = [GenerateRequest(id=f"r{i}", prompt_ids=(1 + i % 50, 7), max_new_tokens=40, temperature=1.0, seed=i,
                            stream=False) for i in range(10)]
    events = run_all(engine, reqs)

    def parses(text: str) -> bool:
        try:
            json.loads(text)
            return True
        except ValueError:
            return False

    assert not any(parses(events[r.id]["text"]) for r in reqs)


def test_json_object_greedy(engine):
    res = generate(engine, GenerateRequest(id="g", prompt_ids=(5, 9, 11), max_new_tokens=MAX_TOKENS,
                                           grammar=GrammarSpec("json_object"), stream=False))
    if res.finish_reason == "eos":
        assert isinstance(json.loads(res.text), dict)
    else:  # greedy may loop inside an open string; what was made is still a prefix of an object
        assert res.finish_reason == "length" and res.text.startswith("{")


def test_regex_and_lark(engine):
    reqs = [GenerateRequest(id=f"x{i}", prompt_ids=(3, i + 1), max_new_tokens=20, temperature=1.0, seed=i,
                            grammar=GrammarSpec("regex", r"(yes|no|maybe [0-9]{1,2})"), stream=False)
            for i in range(20)]
    reqs += [GenerateRequest(id=f"l{i}", prompt_ids=(4, i + 1), max_new_tokens=40, temperature=1.0, seed=i,
                             grammar=GrammarSpec("lark", 'start: "call(" NAME ("," NAME)? ")"\nNAME: /[a-z]{1,5}/'),
                             stream=False) for i in range(20)]
    events = run_all(engine, reqs)
    for r in reqs:
        ev = events[r.id]
        assert ev["finish_reason"] == "eos", ev
        pattern = r"yes|no|maybe [0-9]{1,2}" if r.id[0] == "x" else r"call\([a-z]{1,5}(,[a-z]{1,5})?\)"
        assert re.fullmatch(pattern, ev["text"]), ev["text"]


def test_the_mask_is_exactly_the_grammar(engine):
    """Brute force on the byte vocabulary: at each step of a 1-3 digit number the allowed tokens are the digit
    bytes (while fewer than 3 are made) and the end ids (once one is)."""
    ends = set(engine.model_config.eos_token_ids) | {17}
    c = engine.grammars.constraint(GrammarSpec("regex", "[0-9]{1,3}"), ends)
    digits = {engine.encode(str(d))[0] for d in range(10)}
    for made in range(4):
        allowed = set(np.flatnonzero(c.allowed()).tolist())
        want = (digits if made < 3 else set()) | (ends if made >= 1 else set())
        assert allowed == want, made
        if made < 3:
            c.accept(engine.encode(str(made + 4))[0])


def test_logprobs_are_the_models_not_the_masks(engine):
    """logprobs report the model's distribution (before the grammar's mask): equal to an unconstrained run's
    where the grammar let the greedy token through."""
    free = generate(engine, GenerateRequest(id="f", prompt_ids=(5, 6), max_new_tokens=1, logprobs=3, stream=False))
    tok = free.ids[0]
    text = engine.decode([tok])
    spec = GrammarSpec("regex", re.escape(text) + "x*")
    events = run_all(engine, [GenerateRequest(id="a", prompt_ids=(5, 6), max_new_tokens=1, logprobs=3, stream=False,
                                              grammar=spec),
                              GenerateRequest(id="b", prompt_ids=(5, 6), max_new_tokens=1, logprobs=3, stream=False)])
    assert events["a"]["ids"] == [tok]
    assert events["a"]["logprobs"] == events["b"]["logprobs"]


def test_bad_grammars_are_refused_by_name(engine):
    limits = Limits()
    with pytest.raises(ApiError, match="grammar"):
        decode_request(json.dumps({"type": "generate", "id": "a", "prompt": "x", "grammar": {"type": "ebnf"}}), limits)
    with pytest.raises(ApiError, match="schema"):
        decode_request(json.dumps({"type": "generate", "id": "a", "prompt": "x",
                                   "grammar": {"type": "json_schema", "schema": "no"}}), limits)
    with pytest.raises(ApiError, match="unknown"):
        decode_request(json.dumps({"type": "generate", "id": "a", "prompt": "x",
                                   "grammar": {"type": "regex", "pattern": "a", "x": 1}}), limits)
    sched = Scheduler(engine, lambda *_: None)
    with pytest.raises(ApiError, match="cannot be compiled") as exc:
        sched.add(b"c", GenerateRequest(id="b", prompt_ids=(1,), grammar=GrammarSpec("lark", "start: (")))
    assert exc.value.code == "bad_request"
    with pytest.raises(GrammarError):
        engine.grammars.compile(GrammarSpec("json_schema", json.dumps({"type": "nonsense"})))
    assert not sched.busy


def test_a_grammar_that_fails_mid_sequence_ends_that_sequence_alone(engine, monkeypatch):
    """A sequence whose grammar errs gets an error event; its batch neighbours finish normally."""
    events: dict[str, dict] = {}
    sched = Scheduler(engine, lambda _c, ev: events.__setitem__(ev["id"], ev) if ev["type"] != "token" else None)
    bad = sched.add(b"c", GenerateRequest(id="bad", prompt_ids=(1, 2), max_new_tokens=8, stream=False,
                                          grammar=GrammarSpec("regex", "[a-z]+")))
    sched.add(b"c", GenerateRequest(id="good", prompt_ids=(1, 2), max_new_tokens=8, stream=False))

    def broken():
        raise GrammarError("the grammar reached an error: injected")

    monkeypatch.setattr(bad.sampler.constraint, "allowed", broken)
    while sched.busy:
        sched.step()
    assert events["bad"]["type"] == "error" and "injected" in events["bad"]["message"]
    assert events["good"]["type"] == "final" and len(events["good"]["ids"]) == 8
