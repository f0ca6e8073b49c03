"""Tool calls through `strata serve --http` and the openai client, on the families' real chat templates.

A tiny random-weight model per template (Qwen3's, DeepSeek-V3's, GLM-4.5's, from tests/fixtures/chat_templates):
``tool_choice`` "required" and a named function hold the model to the family's call format (constrained
decoding), so even random weights write calls, and the server parses them back into ``tool_calls``, streamed
and not. The calls' arguments match the tools' schemas; a reply that carries the calls back renders.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest

from coordinator.cli.make_model import make_model
from served import start_server, stop_server

pytestmark = pytest.mark.slow  # `strata serve` processes over HTTP

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"enum": ["Paris", "Zürich", "Tokyo"]},
                                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                          "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                      "parameters": {"type": "object", "properties": {},
                                                     "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# Thinking off (Qwen3's and GLM-4.5's templates then close an empty thought): random weights would think to the limit.
QUIET = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}


@pytest.fixture(scope="module", params=["chatml_qwen3", "deepseek_v3", "glm45"])
def family(request, tmp_path_factory):
    """(template fixture name, openai client) of a server on a tiny model with that family's template."""
    fixture = json.loads((FIXTURES / f"{request.param}.json").read_text())
    model = make_model(tmp_path_factory.mktemp("tools") / request.param, seed=1)
    config = {"chat_template": fixture["template"], "eos_token": fixture.get("eos_token")}
    if fixture.get("bos_token"):
        config["bos_token"] = fixture["bos_token"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    s = start_server(model, tmp_path_factory.mktemp("tools-logs"), "--http", "127.0.0.1:0", "--served-model-name", "m")
    yield request.param, openai.OpenAI(base_url=s.http_url + "/v1", api_key="x", max_retries=0, timeout=120)
    assert stop_server(s) == 0, s.stderr()


def check_calls(calls, names=tuple(SCHEMAS)) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_makes_parsed_calls(family):
    """"required" with parallel_tool_calls false: one call each (random weights would go on adding calls);
    with the default, at least one call, every complete one parsed whatever ended the reply."""
    _, client = family
    r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required", n=3,
                                       parallel_tool_calls=False, temperature=1.0, seed=5, max_tokens=300, **QUIET)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        check_calls(choice.message.tool_calls)
        assert len(choice.message.tool_calls) == 1
    r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required", n=3,
                                       temperature=1.0, seed=6, max_tokens=400, **QUIET)
    for choice in r.choices:
        assert choice.finish_reason in ("tool_calls", "length"), choice
        check_calls(choice.message.tool_calls)


def test_a_named_function_streamed_equals_whole(family):
    """The streamed deltas put together (as the openai client's users do) are the one-document answer's calls."""
    _, client = family
    kw = dict(model="m", messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=1.0, seed=11, max_tokens=300,
              **QUIET)
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    check_calls(whole.message.tool_calls, names=("get_weather",))
    assert len(whole.message.tool_calls) == 1
    calls: dict[int, dict] = {}
    finish = None
    for c in client.chat.completions.create(stream=True, **kw):
        for d in c.choices[0].delta.tool_calls or []:
            got = calls.setdefault(d.index, {"name": "", "arguments": ""})
            got["name"] += d.function.name or ""
            got["arguments"] += d.function.arguments or ""
        finish = c.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(v["name"], json.loads(v["arguments"])) for _, v in sorted(calls.items())] == \
        [(whole.message.tool_calls[0].function.name, json.loads(whole.message.tool_calls[0].function.arguments))]


def test_a_named_call_holds_no_free_whitespace(family):
    """Random weights at temperature 1 on a named function, four seeds: each reply is its call alone, and the tokens
    it takes less its arguments' JSON are the same for all four, but for GLM's one optional newline before the call
    (the byte tokenizer's tokens are bytes): the grammar leaves no blank to pad with, only the separators the
    template writes. With unbounded whitespace such a model spent 160 tokens inside one call."""
    _, client = family
    rest = set()
    for seed in range(4):
        r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=1.0,
                                           seed=21 + seed, max_tokens=400, **QUIET)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        check_calls([call], names=("get_weather",))
        arguments = json.dumps(json.loads(call.function.arguments), ensure_ascii=False)
        rest.add(r.usage.completion_tokens - len(arguments.encode()))
    assert max(rest) - min(rest) <= 1, rest


def test_the_calls_go_back_into_the_conversation(family):
    """The assistant's calls and the tools' answers, sent back as the next request's messages, render and get
    an answer (content null on the calling message, as the openai client sends it)."""
    _, client = family
    first = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=1.0, seed=2, max_tokens=300,
                                           **QUIET).choices[0].message
    calls = [c.model_dump() for c in first.tool_calls]
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": calls}]
    messages += [{"role": "tool", "tool_call_id": c["id"], "content": "{\"temp\": 21}"} for c in calls]
    r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 20


def test_tool_choice_errors_name_the_field(family):
    _, client = family
    for kw in (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
               dict(tool_choice="required"),
               dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})):
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model="m", messages=ASK, max_tokens=4, **kw)
        assert exc.value.body["param"] in ("tool_choice", "response_format"), exc.value.body
    r = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=4,
                                       temperature=0)
    assert r.choices[0].message.tool_calls is None
