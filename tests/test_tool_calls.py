"""Tool calls in the families' formats (coordinator/serving/tool_calls.py), checked against the families' real
chat templates under fixtures/chat_templates/: chatml_qwen3 (Qwen3), deepseek_v3 (DeepSeek-V3-0324),
deepseek_v31 (DeepSeek-V3.1), glm45 (GLM-4.5); each fixture's "source" says where its template came from.

What a template renders for an assistant's tool_calls parses back to those calls, whole and streamed in any
pieces, and the constraining grammars accept what the templates render and refuse a wrong name or arguments,
checked by llguidance on a byte-level tokenizer (markers as text, or as added tokens).
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import llguidance
import pytest

from coordinator.text.chat_template import ChatTemplate
from coordinator.text.tokenizer import byte_level_tokenizer
from coordinator.serving.tool_calls import (DEEPSEEK_V3, DEEPSEEK_V31, FORMATS, GLM45, QWEN, CallDelta, TextDelta,
                                            ToolCall, tool_format)

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"
FAMILIES = {"chatml_qwen3": QWEN, "deepseek_v3": DEEPSEEK_V3, "deepseek_v31": DEEPSEEK_V31, "glm45": GLM45}
NO_THINKING = {"enable_thinking": False}  # the generation prompt then closes the thinking block itself
EOS = "<|eos|>"


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8"))


def template(doc: dict) -> ChatTemplate:
    return ChatTemplate(doc["template"], doc["bos_token"] or "", doc["eos_token"] or "")


def tool_case(doc: dict) -> dict:
    """The fixture's case with tools whose conversation holds an assistant's tool_calls."""
    return next(c for c in doc["cases"] if c["tools"] and "expected" in c
                and any(m.get("tool_calls") for m in c["messages"]))


def reply(name: str, content="keep", calls=None) -> tuple[str, dict, list[dict]]:
    """What the real template renders as the assistant's tool-call turn (the text a model would write after the
    generation prompt, its end-of-turn token dropped), that message, and the tools. ``content``/``calls``
    replace the message's."""
    doc = fixture(name)
    case = tool_case(doc)
    messages = copy.deepcopy(case["messages"])
    at = next(i for i, m in enumerate(messages) if m.get("tool_calls"))
    message = messages[at]
    if content != "keep":
        message["content"] = content
    if calls is not None:
        message["tool_calls"] = calls
    chat = template(doc)
    prompt = chat.render(messages[:at], tools=case["tools"], add_generation_prompt=True, **NO_THINKING)
    whole = chat.render(messages[:at + 1], tools=case["tools"], add_generation_prompt=False, **NO_THINKING)
    assert whole.startswith(prompt)
    text = whole[len(prompt):]
    eos = doc["eos_token"] or ""
    return text.removesuffix(eos + "\n").removesuffix(eos), message, case["tools"]


def expected_calls(message: dict) -> list[ToolCall]:
    """The message's calls as parse() gives them: arguments as JSON text (JSON text passes through as is)."""
    out = []
    for call in message["tool_calls"]:
        arguments = call["function"]["arguments"]
        out.append(ToolCall(call["function"]["name"], arguments if isinstance(arguments, str)
                            else json.dumps(arguments, ensure_ascii=False)))
    return out


# -- the real templates --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_the_real_templates_render_tools_calls_and_results(name):
    doc = fixture(name)
    case = tool_case(doc)
    assert name == "chatml_qwen3" or "source" in doc
    conversation = case["messages"]
    assert any(m["role"] == "tool" for m in conversation)
    text = template(doc).render(conversation, tools=case["tools"], add_generation_prompt=True, **case["kwargs"])
    assert text == case["expected"]  # as transformers rendered it
    assert all(m["content"] in text for m in conversation if m["role"] == "tool")
    assert all(t["function"]["name"] in text for t in case["tools"]) or name.startswith("deepseek")  # no tool list
    assert all(marker in doc["template"] for marker in FORMATS[FAMILIES[name]].markers)


# -- which format ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,family", [*FAMILIES.items(), ("tools", QWEN), ("system_loops", None),
                                         ("alternate", None), ("generation_prompt", None)])
def test_the_format_from_the_templates_markers(name, family):
    found = tool_format(fixture(name)["template"])
    assert (found.name if found else None) == family


def test_formats_not_known_are_none():
    qwen3_coder = "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}<parameter=x>"
    assert tool_format(qwen3_coder) is None
    assert tool_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None


# -- parsing ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_what_the_template_renders_parses_back(name):
    text, message, tools = reply(name)
    content, calls = FORMATS[FAMILIES[name]].parse(text, tools)
    assert calls == expected_calls(message)
    assert content == ((message.get("content") or "").strip() or None)


@pytest.mark.parametrize("name", FAMILIES)
def test_calls_alone_parse_with_no_content(name):
    text, message, tools = reply(name, content="")
    assert FORMATS[FAMILIES[name]].parse(text, tools) == (None, expected_calls(message))


def test_qwen_tolerates_an_unclosed_last_call_whose_json_is_whole():
    q = FORMATS[QWEN]
    whole = '<tool_call>\n{"name": "f", "arguments": {"a": [1, "ü"]}}\n'
    assert q.parse("Ok.\n" + whole) == ("Ok.", [ToolCall("f", '{"a": [1, "ü"]}')])
    assert q.parse(whole[:-5]) == (whole[:-5].strip(), [])  # the JSON is cut short: content


def test_qwen_text_that_is_no_call_stays_content():
    q = FORMATS[QWEN]
    bad = '<tool_call>\n{"name": "f", "arguments": {\n</tool_call>'
    good = '<tool_call>\n{"name": "g", "arguments": "{\\"x\\": 1}"}\n</tool_call>'
    assert q.parse(f"A {bad}\n{good} B") == (f"A {bad}\n B", [ToolCall("g", '{"x": 1}')])
    assert q.parse('<tool_call>\n{"arguments": {}}\n</tool_call>') == ('<tool_call>\n{"arguments": {}}\n</tool_call>',
                                                                         [])
    assert q.parse("No calls <tool at all") == ("No calls <tool at all", [])
    assert q.parse("  \n") == (None, [])


def test_deepseek_reads_both_versions_and_an_unclosed_frame():
    v3, v31 = FORMATS[DEEPSEEK_V3], FORMATS[DEEPSEEK_V31]
    new = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"a\": 1}<｜tool▁call▁end｜>"
    old = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a\": 1}\n```<｜tool▁call▁end｜>"
    for fmt in (v3, v31):
        assert fmt.parse(new) == fmt.parse(old) == (None, [ToolCall("f", '{"a": 1}')])
    assert v3.parse(old + "<｜tool▁calls▁end｜> after") == ("after", [ToolCall("f", '{"a": 1}')])


def test_deepseek_a_broken_frame_is_content():
    v3 = FORMATS[DEEPSEEK_V3]
    assert v3.parse("x <｜tool▁calls▁begin｜> nothing") == ("x <｜tool▁calls▁begin｜> nothing", [])
    bad = "<｜tool▁call▁begin｜>f<｜tool▁sep｜>{oops<｜tool▁call▁end｜>"
    ok = "<｜tool▁call▁begin｜>g<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
    assert v3.parse(f"<｜tool▁calls▁begin｜>{bad}{ok}<｜tool▁calls▁end｜>") == (
        f"<｜tool▁calls▁begin｜>{bad}", [ToolCall("g", "{}")])


def test_glm_values_follow_the_tools_schema():
    text, _, tools = reply("glm45", content=None)
    _, typed = FORMATS[GLM45].parse(text, tools)
    _, untyped = FORMATS[GLM45].parse(text)
    assert json.loads(typed[0].arguments)["note"] == "42"  # a string in the schema: kept as written
    assert json.loads(untyped[0].arguments)["note"] == 42  # no schema: JSON where it parses, as vLLM reads it
    assert json.loads(typed[0].arguments)["hours"] == [6, 18] and json.loads(untyped[0].arguments)["city"] == "Zürich"


def test_glm_junk_in_a_call_is_content():
    glm = FORMATS[GLM45]
    junk = "<tool_call>f\n<arg_key>a</arg_key>\nstray<arg_value>1</arg_value>\n</tool_call>"
    assert glm.parse(junk) == (junk, [])
    assert glm.parse("<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>{\"b\": [1]}</arg_value>\n</tool_call>") == (
        None, [ToolCall("f", '{"a": {"b": [1]}}')])


# -- streaming -------------------------------------------------------------------------------------------------


def streamed(fmt, pieces, tools=None) -> tuple[str | None, list[ToolCall], list]:
    s = fmt.streamer(tools)
    deltas = [d for piece in pieces for d in s.push(piece)] + s.finish()
    content = "".join(d.text for d in deltas if isinstance(d, TextDelta))
    calls = [d for d in deltas if isinstance(d, CallDelta)]
    assert [d.index for d in calls] == list(range(len(calls)))
    return content or None, [d.call for d in calls], deltas


def chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def stream_texts() -> list[tuple[str, str, list | None]]:
    found = []
    for name, family in FAMILIES.items():
        for content in ("keep", "", "  Lead  \n\n"):  # DeepSeek's templates need a string content
            text, _, tools = reply(name, content=content)
            found.append((family, text, tools))
    found += [(QWEN, 'A\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n\nB <tool_call', None),
              (QWEN, 'x <tool_call>\n{"name": "f", "arguments": {\n</tool_call>y', None),
              (QWEN, '<tool_call>\n{"name": "f", "arguments": {}}', None),
              (DEEPSEEK_V3, "a<｜tool▁calls▁begin｜> <｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜>\n z", None),
              (DEEPSEEK_V31, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{\"a\"", None),
              (GLM45, "<tool_call>f\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n", None)]
    return found


@pytest.mark.parametrize("family,text,tools", stream_texts())
def test_streaming_in_any_pieces_matches_parse(family, text, tools):
    fmt = FORMATS[family]
    whole = fmt.parse(text, tools)
    assert streamed(fmt, list(text), tools)[:2] == whole
    rng = random.Random(len(text))
    for _ in range(20):
        assert streamed(fmt, chunks(text, rng), tools)[:2] == whole


def test_content_streams_as_it_comes_and_a_marker_is_held():
    s = FORMATS[QWEN].streamer()
    assert s.push("Sure, ") == [TextDelta("Sure,")]  # its trailing space waits for more content
    assert s.push("let me check.\n<tool") == [TextDelta(" let me check.")]
    assert s.push("_call>\n{\"name\": \"f\", ") == []
    assert s.push("\"arguments\": {}}\n</tool_call>") == [CallDelta(0, ToolCall("f", "{}"))]
    assert s.push("\n<tool_ca") == []
    assert s.finish() == [TextDelta("\n\n<tool_ca")]  # a marker never completed is content, after the newlines


def test_finish_gives_an_incomplete_call_back_as_content():
    s = FORMATS[GLM45].streamer()
    assert s.push("<tool_call>f\n<arg_key>a</arg_key>\n<arg_val") == []
    assert s.finish() == [TextDelta("<tool_call>f\n<arg_key>a</arg_key>\n<arg_val")]
    s = FORMATS[DEEPSEEK_V3].streamer()
    first = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
    assert s.push(first + "<｜tool▁call▁begin｜>g<｜tool▁sep｜>{") == [CallDelta(0, ToolCall("f", "{}"))]
    assert s.finish() == [TextDelta("<｜tool▁call▁begin｜>g<｜tool▁sep｜>{")]


# -- grammars --------------------------------------------------------------------------------------------------


def tokenizer(special: tuple[str, ...]) -> llguidance.LLTokenizer:
    """Byte-level: ids 0..255 the bytes, then an end-of-sequence token and ``special`` as added tokens."""
    return llguidance.LLTokenizer(byte_level_tokenizer([EOS, *special]).to_str(), eos_token=256)


def accepts(grammar: str, text: str, tok: llguidance.LLTokenizer) -> bool:
    """Whether the grammar takes exactly ``text``, token by token."""
    matcher = llguidance.LLMatcher(tok, llguidance.grammar_from("lark", grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(tok.tokenize_str(text)) and matcher.is_accepting()


def named(tools: list[dict], index: int = 0) -> dict:
    return {"type": "function", "function": {"name": tools[index]["function"]["name"]}}


def one_call(name: str) -> list[dict]:
    """The family fixture's first tool call alone."""
    return reply(name)[1]["tool_calls"][:1]


@pytest.mark.parametrize("as_tokens", [False, True], ids=["text", "tokens"])
@pytest.mark.parametrize("name", FAMILIES)
def test_grammars_are_valid_llguidance(name, as_tokens):
    fmt = FORMATS[FAMILIES[name]]
    tools = tool_case(fixture(name))["tools"]
    special = fmt.markers if as_tokens else ()
    for choice in ("required", named(tools), named(tools, 1)):
        grammar = llguidance.grammar_from("lark", fmt.grammar(tools, choice, special=special))
        assert llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer(special)) == (False, [])
        assert llguidance.LLMatcher.validate_grammar(grammar) == ""  # without a tokenizer too


@pytest.mark.parametrize("as_tokens", [False, True], ids=["text", "tokens"])
@pytest.mark.parametrize("name", FAMILIES)
def test_grammars_accept_what_the_template_renders(name, as_tokens):
    fmt = FORMATS[FAMILIES[name]]
    special = fmt.markers if as_tokens else ()
    tok = tokenizer(special)
    calls, _, tools = reply(name, content="")
    single, _, _ = reply(name, content="", calls=one_call(name))
    required = fmt.grammar(tools, "required", special=special)
    only = fmt.grammar(tools, named(tools), special=special)
    assert accepts(required, calls, tok) and accepts(required, single, tok)
    assert accepts(only, single, tok)
    assert not accepts(only, calls, tok)  # a named function: exactly one call
    assert not accepts(fmt.grammar(tools, named(tools, 1), special=special), single, tok)  # another function
    assert not accepts(required, "Sure. " + calls, tok)  # no content
    assert not accepts(required, "", tok)  # at least one call


@pytest.mark.parametrize("as_tokens", [False, True], ids=["text", "tokens"])
@pytest.mark.parametrize("name", FAMILIES)
def test_grammars_refuse_a_wrong_name_or_arguments(name, as_tokens):
    fmt = FORMATS[FAMILIES[name]]
    special = fmt.markers if as_tokens else ()
    tok = tokenizer(special)
    text, message, tools = reply(name, content="")
    grammar = fmt.grammar(tools, "required", special=special)
    first = message["tool_calls"][0]["function"]
    assert accepts(grammar, text, tok)
    assert not accepts(grammar, text.replace(first["name"], first["name"] + "x", 1), tok)
    wrong = {"get_weather": ('"Zürich"', "17"), "get_forecast": ("<arg_value>3<", "<arg_value>three<")}
    old, new = wrong[first["name"]]
    assert old in text
    assert not accepts(grammar, text.replace(old, new, 1), tok)  # arguments against the schema
    missing = {QWEN: '{"city": "Zürich"}', DEEPSEEK_V3: '{"city": "Zürich"}', DEEPSEEK_V31: '{"city": "Zürich"}',
               GLM45: "<arg_key>city</arg_key>\n<arg_value>Zürich</arg_value>\n"}[fmt.name]
    assert not accepts(grammar, text.replace(missing, "{}" if fmt.name != GLM45 else "", 1), tok)  # required key


@pytest.mark.parametrize("name", [n for n, family in FAMILIES.items() if family != GLM45])
def test_grammars_take_the_templates_separators_and_no_other_whitespace(name):
    """A call's JSON as the template writes it (", " and ": ") and nothing looser: a second blank, a newline inside
    the object or the compact form are refused, so a weak model cannot pad a call with whitespace."""
    fmt = FORMATS[FAMILIES[name]]
    tok = tokenizer(())
    text, _, tools = reply(name, content="", calls=one_call(name))
    grammar = fmt.grammar(tools, named(tools))
    assert '": ' in text and accepts(grammar, text, tok)
    for looser in (text.replace('": ', '":  ', 1), text.replace('": ', '":\n ', 1), text.replace('": ', '":', 1)):
        assert not accepts(grammar, looser, tok), looser


@pytest.mark.parametrize("as_tokens", [False, True], ids=["text", "tokens"])
def test_only_qwen_may_think_first(as_tokens):
    """With ``think`` (the prompt leaves the model to think), Qwen's grammar takes a thought before the calls;
    without it, none does."""
    for name, family in FAMILIES.items():
        fmt = FORMATS[family]
        special = fmt.markers if as_tokens else ()
        text, _, tools = reply(name, content="")
        grammar = fmt.grammar(tools, "required", special=special, think=True)
        thought = "<think>\nWeather first; </think is not the end.\n</think>\n\n" + text
        assert accepts(grammar, thought, tokenizer(special)) == (family == QWEN)
        assert not accepts(fmt.grammar(tools, "required", special=special), thought, tokenizer(special))
        assert accepts(fmt.grammar(tools, "required", special=special), text, tokenizer(special))
        if family == QWEN:
            twice = "<think>a</think>b</think>\n" + text
            assert not accepts(grammar, twice, tokenizer(special))  # the thought ends at its first </think>


def test_grammar_choices_that_cannot_be_met_are_errors():
    tools = tool_case(fixture("chatml_qwen3"))["tools"]
    with pytest.raises(ValueError, match="not among the tools"):
        FORMATS[QWEN].grammar(tools, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ValueError, match="no tool-call grammar"):
        FORMATS[QWEN].grammar(tools, "auto")
    with pytest.raises(ValueError, match="at least one"):
        FORMATS[GLM45].grammar([], "required")


def test_glm_grammar_writes_string_values_raw_and_the_rest_as_json():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "s": {"type": "string"}, "e": {"type": "string", "enum": ["c", "f"]}, "n": {"type": "number"}},
        "required": ["s", "e"]}}}, {"type": "function", "function": {"name": "free"}}]
    grammar = FORMATS[GLM45].grammar(tools, "required")
    tok = tokenizer(())

    def call(name, **values):
        pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in values.items())
        return f"\n<tool_call>{name}\n{pairs}</tool_call>"

    assert accepts(grammar, call("f", s="any <b>text</b>\n", e="c", n="2.5"), tok)
    assert accepts(grammar, call("f", s="", e="f") + call("free", x="1", y="two"), tok)
    assert not accepts(grammar, call("f", s="x", e='"c"'), tok)  # strings are raw, not JSON
    assert not accepts(grammar, call("f", s="x", e="c", n="many"), tok)
    assert not accepts(grammar, call("f", e="c", s="x"), tok)  # keys in the schema's order
