"""Tool calls in the model families' own formats: which format a chat template renders, the calls in a model's
text (whole, or streamed as it comes), and an llguidance Lark grammar under which the model can write only calls.

The formats, as each family's chat template renders an assistant's ``tool_calls`` (ARGS: a JSON object):

    qwen          Qwen3, Qwen2.5, Hermes; calls joined by a newline:
                      <tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>
    deepseek_v3   DeepSeek-V3, R1; calls joined by a newline inside <｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>:
                      <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>
    deepseek_v31  DeepSeek-V3.1; the same frame, calls not separated (either DeepSeek format reads both forms):
                      <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>
    glm45         GLM-4.5; each call after a newline, a string VALUE written raw, any other as JSON:
                      <tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n...</tool_call>

A call's arguments come back as JSON object text, as the OpenAI API returns ``function.arguments``; text that does
not parse as a call stays content. Everything here is pure: no model, tokenizer or server.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass

QWEN, DEEPSEEK_V3, DEEPSEEK_V31, GLM45 = "qwen", "deepseek_v3", "deepseek_v31", "glm45"

TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
THINK, THINK_END = "<think>", "</think>"
DS_CALLS, DS_CALL, DS_SEP = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>"
DS_CALL_END, DS_CALLS_END = "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"
ARG_KEY, ARG_KEY_END, ARG_VALUE, ARG_VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"

_DS_V3_BODY = re.compile(r"([^\n]*)\n```json\n(.*)\n```\s*", re.S)  # after the separator: NAME, then fenced ARGS
_GLM_PAIR = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
# llguidance's options for a call's JSON: keywords it does not implement skipped instead of failing (lenient); the
# separators the templates' tojson writes (", " and ": ", Python's) and no other whitespace, so a model writes a call
# as it saw calls in training and cannot pad one with blanks until its token budget is spent
_CALL_JSON = {"lenient": True, "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON object text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class TextDelta:
    """Streamed content text."""

    text: str


@dataclass(frozen=True)
class CallDelta:
    """A whole tool call, the index-th of the reply."""

    index: int
    call: ToolCall


Delta = TextDelta | CallDelta


@dataclass(frozen=True)
class _Step:
    """What the text from a call marker on turned out to be: ``used`` characters read, which were ``call``, or
    content when ``text``, or neither (frame markers); ``inside``: still within the format's call frame."""

    used: int
    call: ToolCall | None = None
    text: bool = False
    inside: bool = False


class ToolFormat:
    """A family's tool-call format. ``markers``: the strings of its frame, which a model's tokenizer may hold as
    single added tokens (see ``grammar``)."""

    name: str
    markers: tuple[str, ...]
    opener: str  # where tool-call text starts
    arguments_as_text = False  # the template writes an earlier call's arguments as JSON text (else as an object)

    def parse(self, text: str, tools: list[dict] | None = None) -> tuple[str | None, list[ToolCall]]:
        """The content outside the calls (stripped; None when empty) and the calls, in order. ``tools``: the
        request's tools, whose schemas tell a string argument from JSON where the format does not (GLM)."""
        streamer = self.streamer(tools)
        deltas = streamer.push(text) + streamer.finish()
        content = "".join(d.text for d in deltas if isinstance(d, TextDelta))
        return content or None, [d.call for d in deltas if isinstance(d, CallDelta)]

    def streamer(self, tools: list[dict] | None = None) -> ToolCallStreamer:
        """A parser for text that arrives in pieces; what it emits adds up to ``parse`` of the whole text."""
        return ToolCallStreamer(self, _parameters(tools or []))

    def grammar(self, tools: list[dict], choice, *, special: Collection[str] = (), think: bool = False,
                parallel: bool = True) -> str:
        """An llguidance Lark grammar accepting exactly: for ``choice`` "required", one or more calls of the given
        tools (exactly one without ``parallel``: OpenAI's parallel_tool_calls false); for ``{"type": "function",
        "function": {"name": N}}``, one call of N; each call's arguments as its
        ``function.parameters`` schema allows, separated as the template separates them (Qwen's may follow a
        <think>...</think> block when ``think``: the prompt leaves the model to think). ``special``: the
        tokenizer's added tokens; llguidance matches an added ``<...>``
        token only as a token, so markers among them are written as token references."""
        functions, single = _chosen(tools, choice)
        return self._grammar(functions, single or not parallel, _Markers(frozenset(special)), think)

    def _scan(self, text: str, first: bool, final: bool, parameters: dict) -> _Step | None:
        """What ``text`` (starting at ``opener`` when ``first``, else inside the frame) holds next; None when
        that is not yet known (``final``: no more text comes, so always known)."""
        raise NotImplementedError

    def _grammar(self, functions: list[tuple[str, dict]], single: bool, mark: _Markers, think: bool) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"ToolFormat({self.name})"


class _Hermes(ToolFormat):
    """Qwen3, Qwen2.5, Hermes: one JSON object per <tool_call> block."""

    name = QWEN
    markers = (TOOL_CALL, TOOL_CALL_END, THINK, THINK_END)
    opener = TOOL_CALL

    def _scan(self, text, first, final, parameters):
        return _closed_call(text, final, TOOL_CALL_END, _hermes_call)

    def _grammar(self, functions, single, mark, think):
        calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": params},
                  "required": ["name", "arguments"], "additionalProperties": False} for name, params in functions]
        thought, thought_terminals = mark.until(THINK_END, "THOUGHT")
        return "\n".join([
            f"start: {'think? ' if think else ''}call" + ("" if single else ' ("\\n" call)*'),
            f'think: {mark(THINK)} {thought} "\\n"*',  # a thinking model may reason first
            f'call: {mark(TOOL_CALL)} "\\n" body "\\n" {mark(TOOL_CALL_END)}',
            f"body: {_json(calls[0] if single else {'anyOf': calls})}",
            *thought_terminals])


class _DeepSeek(ToolFormat):
    """DeepSeek-V3 (and R1) with ``function<sep>NAME`` and fenced JSON, or V3.1 with ``NAME<sep>ARGS``."""

    markers = (DS_CALLS, DS_CALL, DS_SEP, DS_CALL_END, DS_CALLS_END)
    opener = DS_CALLS
    arguments_as_text = True  # its templates concatenate them to strings

    def __init__(self, v31: bool):
        self.v31 = v31
        self.name = DEEPSEEK_V31 if v31 else DEEPSEEK_V3

    def _scan(self, text, first, final, parameters):
        start = len(DS_CALLS) if first else 0
        at = len(text) - len(text[start:].lstrip())  # calls may be separated by a newline
        rest = text[at:]
        if rest.startswith(DS_CALL):
            end = text.find(DS_CALL_END, at + len(DS_CALL))
            if end < 0 and not final:
                return None
            body = text[at + len(DS_CALL):end] if end >= 0 else text[at + len(DS_CALL):]
            used = end + len(DS_CALL_END) if end >= 0 else len(text)
            call = _deepseek_call(body)
            return _Step(used, call, text=call is None, inside=True)
        if rest.startswith(DS_CALLS_END):
            return _Step(at + len(DS_CALLS_END))
        if not final and (DS_CALL.startswith(rest) or DS_CALLS_END.startswith(rest)):
            return None
        return _Step(at, text=True)  # the frame ends here: what follows is content

    def _grammar(self, functions, single, mark, think):
        between = "" if self.v31 else '"\\n" '  # V3's template puts a newline between calls, V3.1's nothing
        lines = [f"start: {mark(DS_CALLS)} call" + ("" if single else f" ({between}call)*") + f" {mark(DS_CALLS_END)}",
                 f"call: {mark(DS_CALL)} ({_alternatives(len(functions))}) {mark(DS_CALL_END)}"]
        for i, (name, params) in enumerate(functions):
            if self.v31:
                lines.append(f"f{i}: {_text(name)} {mark(DS_SEP)} {_json(params)}")
            else:
                fence = _text(name + "\n```json\n")
                lines.append(f'f{i}: "function" {mark(DS_SEP)} {fence} {_json(params)} "\\n```"')
        return "\n".join(lines)


class _Glm(ToolFormat):
    """GLM-4.5: the name, then each argument as an <arg_key>/<arg_value> pair."""

    name = GLM45
    markers = (TOOL_CALL, TOOL_CALL_END, ARG_KEY, ARG_KEY_END, ARG_VALUE, ARG_VALUE_END)
    opener = TOOL_CALL

    def _scan(self, text, first, final, parameters):
        return _closed_call(text, final, TOOL_CALL_END, lambda body: _glm_call(body, parameters))

    def _grammar(self, functions, single, mark, think):
        value_text, value_terminals = mark.until(ARG_VALUE_END, "VALUE")
        key_text, key_terminals = mark.until(ARG_KEY_END, "KEY")
        lines = ['start: "\\n"? call' + ("" if single else ' ("\\n" call)*'),
                 f"call: {mark(TOOL_CALL)} ({_alternatives(len(functions))}) {mark(TOOL_CALL_END)}",
                 f'any_pair: {mark(ARG_KEY)} {key_text} "\\n" {mark(ARG_VALUE)} {value_text} "\\n"',
                 *value_terminals, *key_terminals]
        for i, (name, params) in enumerate(functions):
            head = _text(name + "\n")
            properties = params.get("properties")
            if not isinstance(properties, Mapping):  # no declared keys: any pairs, their values as text
                lines.append(f"f{i}: {head} any_pair*")
                continue
            required = set(params.get("required") or ())
            pairs = []
            for j, (key, schema) in enumerate(properties.items()):  # in the schema's order, as models write them
                value = _glm_value_rule(schema, value_text, mark)
                lines.append(f'p{i}_{j}: {mark(ARG_KEY)} {_text(key)} {mark(ARG_KEY_END)} "\\n" '
                             f'{mark(ARG_VALUE)} {value} "\\n"')
                pairs.append(f"p{i}_{j}" + ("" if key in required else "?"))
            lines.append(f"f{i}: {head} {' '.join(pairs)}".rstrip())
        return "\n".join(lines)


FORMATS = {f.name: f for f in (_Hermes(), _DeepSeek(v31=False), _DeepSeek(v31=True), _Glm())}


def tool_format(template_source: str) -> ToolFormat | None:
    """The tool-call format a chat template renders, from its markers; None when it renders none we know
    (Qwen3-Coder's ``<function=...>`` XML inside <tool_call> among them)."""
    if DS_CALLS in template_source:
        return FORMATS[DEEPSEEK_V3 if "```json" in template_source else DEEPSEEK_V31]
    if ARG_KEY in template_source:
        return FORMATS[GLM45]
    if TOOL_CALL in template_source and "<function=" not in template_source:
        return FORMATS[QWEN]
    return None


def leaves_thinking(template_source: str, prompt: str) -> bool:
    """Whether a rendered prompt leaves the model to think first: its template thinks (it knows <think>) and the
    prompt does not end with a closed thought (Qwen3's enable_thinking false writes an empty one)."""
    return THINK in template_source and not prompt.rstrip().endswith(THINK_END)


class ToolCallStreamer:
    """Parses a reply as it streams: content before a call goes out as it comes, text that may begin a call
    marker is held until known (as a stop string is), and each call goes out whole once complete. Content
    adds up to ``parse``'s: leading and trailing whitespace is never sent, inner whitespace once more content
    follows."""

    def __init__(self, fmt: ToolFormat, parameters: dict):
        self._fmt, self._parameters = fmt, parameters
        self._text = ""  # read, not yet decided
        self._inside = self._first = False
        self._held = ""  # whitespace after the content sent so far
        self._started = False
        self._calls = 0

    def push(self, text: str) -> list[Delta]:
        """What ``text``, following what came before, settles."""
        self._text += text
        return self._run(final=False)

    def finish(self) -> list[Delta]:
        """The rest: held text as content, and a trailing call that never closed as a call only if it parses."""
        return self._run(final=True)

    def _run(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        while True:
            if not self._inside:
                at = self._text.find(self._fmt.opener)
                if at < 0:
                    cut = len(self._text) - (0 if final else _marker_prefix(self._text, self._fmt.opener))
                    self._content(self._text[:cut], out)
                    self._text = self._text[cut:]
                    return out
                self._content(self._text[:at], out)
                self._text, self._inside, self._first = self._text[at:], True, True
            step = self._fmt._scan(self._text, self._first, final, self._parameters)
            if step is None:
                return out
            if step.call is not None:
                out.append(CallDelta(self._calls, step.call))
                self._calls += 1
            elif step.text:
                self._content(self._text[:step.used], out)
            self._text, self._inside, self._first = self._text[step.used:], step.inside, False

    def _content(self, text: str, out: list[Delta]) -> None:
        text = self._held + text
        if not self._started:
            text = text.lstrip()
        body = text.rstrip()
        self._held = text[len(body):]
        if body:
            out.append(TextDelta(body))
            self._started = True


def _marker_prefix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (and is not all of it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _closed_call(text: str, final: bool, close: str, parse) -> _Step | None:
    """A call from <tool_call> (where ``text`` starts) to ``close``; at the end of the text an unclosed one counts
    if its body parses."""
    end = text.find(close, len(TOOL_CALL))
    if end < 0 and not final:
        return None
    used = end + len(close) if end >= 0 else len(text)
    call = parse(text[len(TOOL_CALL):end] if end >= 0 else text[len(TOOL_CALL):])
    return _Step(used, call, text=call is None)


def _arguments(value) -> str | None:
    """A call's arguments as JSON object text, from a dict or from JSON text holding one; None otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _hermes_call(body: str) -> ToolCall | None:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return None
    arguments = _arguments(call.get("arguments"))
    return ToolCall(call["name"], arguments) if arguments is not None else None


def _deepseek_call(body: str) -> ToolCall | None:
    head, sep, rest = body.partition(DS_SEP)
    if not sep:
        return None
    fenced = _DS_V3_BODY.fullmatch(rest)
    name, arguments = (fenced.group(1), fenced.group(2)) if fenced else (head, rest)
    name, arguments = name.strip(), _arguments(arguments)
    return ToolCall(name, arguments) if name and arguments is not None else None


def _glm_call(body: str, parameters: dict) -> ToolCall | None:
    at = body.find(ARG_KEY)
    at = len(body) if at < 0 else at
    name = body[:at].strip()
    if not name or any(c in name for c in "<>\n"):
        return None
    properties = parameters.get(name, {}).get("properties")
    properties = properties if isinstance(properties, Mapping) else {}
    arguments = {}
    while body[at:].strip():
        pair = _GLM_PAIR.match(body, at)
        if pair is None:
            return None
        key = pair.group(1).strip()
        arguments[key] = _glm_value(pair.group(2), properties.get(key))
        at = pair.end()
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _glm_value(raw: str, schema) -> object:
    """An <arg_value>: itself where the schema allows only strings, else its JSON value if it is JSON (as vLLM's
    glm4_moe parser reads it)."""
    if _string_only(schema):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def _string_only(schema) -> bool:
    """Whether a property's schema allows strings alone (type string, or an enum/const of strings)."""
    if not isinstance(schema, Mapping):
        return False
    if "type" in schema:
        return schema["type"] == "string"
    values = schema["enum"] if isinstance(schema.get("enum"), list) else [schema["const"]] if "const" in schema else []
    return bool(values) and all(isinstance(v, str) for v in values)


def _may_be_string(schema) -> bool:
    """Whether a property's schema lets a string through (which GLM's template writes raw, unquoted)."""
    if not isinstance(schema, Mapping):
        return True
    kind = schema.get("type")
    if isinstance(kind, list):
        return "string" in kind
    if kind is not None:
        return kind == "string"
    branches = [b for key in ("anyOf", "oneOf") for b in schema.get(key) or ()]
    if branches:
        return any(_may_be_string(b) for b in branches)
    values = schema["enum"] if isinstance(schema.get("enum"), list) else [schema["const"]] if "const" in schema else None
    return values is None or any(isinstance(v, str) for v in values)


def _glm_value_rule(schema, value_text: str, mark: _Markers) -> str:
    """An <arg_value>'s content and its closing marker, as the template writes the schema's values."""
    close = mark(ARG_VALUE_END)
    if _string_only(schema):
        values = schema.get("enum") if isinstance(schema.get("enum"), list) else \
            [schema["const"]] if "const" in schema else None
        return f"({' | '.join(_text(str(v)) for v in values)}) {close}" if values else value_text
    if _may_be_string(schema):  # strings raw, the rest as JSON: any text
        return value_text
    return f"{_json(schema)} {close}"


def _parameters(tools: list[dict]) -> dict[str, dict]:
    """Each function tool's name and its parameters schema ({"type": "object"} when it gives none)."""
    found = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, Mapping) and tool.get("type", "function") == "function" \
            else None
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            params = function.get("parameters")
            found[function["name"]] = dict(params) if isinstance(params, Mapping) else {"type": "object"}
    return found


def _chosen(tools: list[dict], choice) -> tuple[list[tuple[str, dict]], bool]:
    """The functions a tool_choice allows, and whether it asks for exactly one call."""
    functions = list(_parameters(tools).items())
    if choice == "required":
        if not functions:
            raise ValueError('tool_choice "required" needs at least one function tool')
        return functions, False
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        picked = [f for f in functions if f[0] == name]
        if not picked:
            raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools")
        return picked, True
    raise ValueError(f"no tool-call grammar for tool_choice {choice!r}")


def _text(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def _alternatives(count: int) -> str:
    """The per-function rules f0 | f1 | ..."""
    return " | ".join(f"f{i}" for i in range(count))


@dataclass(frozen=True)
class _Markers:
    """How a grammar writes markers: as token references (Lark's ``<...>``, the shape every marker has) where the
    tokenizer holds them as added tokens, else as text."""

    special: frozenset[str]

    def __call__(self, marker: str) -> str:
        return marker if marker in self.special else _text(marker)

    def until(self, close: str, name: str) -> tuple[str, list[str]]:
        """A rule fragment for any text without ``close``, then ``close``, and the terminals it needs. As text
        the closing marker belongs to the same terminal, since llguidance's lexer cannot give back what a lexeme
        took."""
        if close in self.special:  # a text lexeme ends where the token comes
            return f"{name}_TEXT {close}", [f"{name}_TEXT: /(?s:.*)/"]
        return name, [f"{name}: {name}_TEXT {_text(close)}",
                      f"{name}_TEXT: /(?s:.*)/ & ~/(?s:.*){_regex_literal(close)}(?s:.*)/"]


def _json(schema) -> str:
    """An inline JSON-schema rule (llguidance's ``%json``) with _CALL_JSON's options."""
    if isinstance(schema, Mapping):
        schema = {**schema, "x-guidance": {**_CALL_JSON, **(schema.get("x-guidance") or {})}}
    return "%json " + json.dumps(schema, ensure_ascii=False)


def _regex_literal(text: str) -> str:
    """``text`` matched literally inside a Lark /regex/."""
    return re.escape(text).replace("/", "\\/")
