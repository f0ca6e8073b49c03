#!/usr/bin/env python
"""Render chat templates with Hugging Face transformers, as fixtures for tests/test_chat_template.py.

Run once with a Python that has transformers, jinja2 and tokenizers (NOT needed by the engine or its tests;
torch is not needed either), e.g.:

    python3 -m venv /tmp/hfenv && /tmp/hfenv/bin/pip install transformers jinja2 tokenizers
    /tmp/hfenv/bin/python tools/chat_template_fixtures.py [--out tests/fixtures/chat_templates]

For each template below it writes OUT/<name>.json:

    {"template", "bos_token", "eos_token", "transformers": version,
     "cases": [{"messages", "tools", "kwargs", "add_generation_prompt",
                "expected": rendered text | "error": {"type", "message"}}]}

where "expected" is tokenizer.apply_chat_template(messages, tools=..., add_generation_prompt=..., tokenize=False,
**kwargs) of a PreTrainedTokenizerFast built from a tiny `tokenizers` object with that chat_template and those
special tokens (none where the token is null), and "error" what it raised instead.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jinja2
import transformers
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "chat_templates"

# loops, conditionals, a system message folded into the first user turn, loopcontrols, namespace, dict, strftime_now
SYSTEM_LOOPS = """\
{% set ns = namespace(system='', turns=0) %}
{% if messages[0]['role'] == 'system' %}
    {% set ns.system = messages[0]['content'] %}
    {% set loop_messages = messages[1:] %}
{% else %}
    {% set loop_messages = messages %}
{% endif %}
{% for message in loop_messages %}
    {% if message['role'] == 'user' %}
        {% set ns.turns = ns.turns + 1 %}
[turn {{ ns.turns }}/{{ loop.length }}] USER: {% if loop.first and ns.system %}<<SYS>>{{ ns.system | trim }}<</SYS>> {% endif %}{{ message['content'] | trim }}
    {% elif message['role'] == 'assistant' %}
ASSISTANT: {{ message['content'] }}{% if not loop.last %} |{% endif %}

    {% else %}
        {% continue %}
    {% endif %}
    {% if message.get('stop') %}{% break %}{% endif %}
{% endfor %}
{% set meta = dict(turns=ns.turns, roles=loop_messages | map(attribute='role') | unique | list) %}
{{- '%' ~ strftime_now('%%') ~ ' ' ~ meta | tojson(sort_keys=True) }}
{% if add_generation_prompt %}ASSISTANT:{% endif %}"""

# tools in the system prompt, assistant tool calls (arguments as a dict or as a JSON string), tool results
TOOLS = """\
{%- if tools %}
<|system|>
{%- if messages[0].role == 'system' %}
{{ messages[0].content }}
{%- endif %}
You may call these functions:
{%- for tool in tools %}
{{ tool | tojson(indent=2, sort_keys=True) if loop.first else tool | tojson(separators=(',', ':')) }}
{%- endfor %}
Answer with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|end|>
{%- elif messages[0].role == 'system' %}
<|system|>{{ messages[0].content }}<|end|>
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
<|user|>{{ message.content }}<|end|>
    {%- elif message.role == 'assistant' %}
<|assistant|>{{ message.content or '' }}
        {%- for call in message.tool_calls or [] %}
            {%- set fn = call.function if call.function is defined else call %}
<tool_call>{"name": "{{ fn.name }}", "arguments": {{ fn.arguments if fn.arguments is string else fn.arguments | tojson }}}</tool_call>
        {%- endfor %}<|end|>
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}
<|tool|>
        {%- endif %}
<tool_response id="{{ message.tool_call_id | default('?') }}">{{ message.content | tojson(indent=2) }}</tool_response>
        {%- if loop.last or loop.nextitem.role != 'tool' %}<|end|>
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|assistant|>
{%- endif %}"""

# roles must alternate user/assistant after an optional system message, as Mistral's templates check
ALTERNATE = """\
{{ bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token }}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, got ' + message['role']) }}
    {%- endif %}
{%- endfor %}"""

# Llama 3 style headers: bos_token first, eos_token closing the conversation, add_generation_prompt, generation tag
GENERATION_PROMPT = """\
{{ bos_token }}
{% for message in messages %}
{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim }}{% endgeneration %}
{% else %}{{ message['content'] | trim }}{% endif %}
{{ '<|eot_id|>' }}
{% endfor %}
{% if add_generation_prompt %}
{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{% else %}
{{ eos_token }}
{% endif %}
{{ 'no bos' if bos_token is not defined else '' }}"""

# Qwen3's ChatML template (reasoning in <think>, enable_thinking, tools, the last user query found from the end)
CHATML_QWEN3 = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city — °C",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time",
                                         "parameters": {"type": "object", "properties": {}}}}
SYSTEM = {"role": "system", "content": "  You are terse.  "}
HI = {"role": "user", "content": "Hello there  "}
TOOL_CHAT = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Weather in Zürich and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
        {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21, \"sky\": \"☀\"}"},
    {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
]
CHAT = [HI, {"role": "assistant", "content": "Hi! <b>&</b>"}, {"role": "user", "content": "Tell me more."}]


def case(messages, tools=None, add_generation_prompt=True, **kwargs) -> dict:
    return {"messages": messages, "tools": tools, "kwargs": kwargs, "add_generation_prompt": add_generation_prompt}


TEMPLATES = {
    "system_loops": (SYSTEM_LOOPS, "<s>", "</s>", [
        case([SYSTEM, *CHAT]),
        case(CHAT, add_generation_prompt=False),
        case([SYSTEM, HI, {"role": "tool", "content": "skipped"}, {"role": "assistant", "content": "x", "stop": 1},
              {"role": "user", "content": "never shown"}]),
    ]),
    "tools": (TOOLS, "<s>", "</s>", [
        case(TOOL_CHAT, tools=[WEATHER, TIME]),
        case(TOOL_CHAT[1:3], tools=[WEATHER], add_generation_prompt=False),
        case([SYSTEM, HI]),
    ]),
    "alternate": (ALTERNATE, "<s>", "</s>", [
        case([SYSTEM, *CHAT]),
        case([*CHAT, {"role": "assistant", "content": "Sure."}]),
        case([HI, HI]),
        case([SYSTEM, {"role": "assistant", "content": "I start."}]),
        case([HI, {"role": "tool", "content": "?"}]),
    ]),
    "generation_prompt": (GENERATION_PROMPT, "<|begin_of_text|>", "<|end_of_text|>", [
        case([SYSTEM, *CHAT]),
        case([SYSTEM, *CHAT[:2]], add_generation_prompt=False),
    ]),
    "generation_prompt_no_bos": (GENERATION_PROMPT, None, "<|end_of_text|>", [
        case(CHAT[:1]),
    ]),
    "chatml_qwen3": (CHATML_QWEN3, None, "<|im_end|>", [
        case([SYSTEM, *CHAT]),
        case(CHAT, enable_thinking=False),
        case(CHAT, enable_thinking=True),
        case([HI, {"role": "assistant", "content": "Hi.", "reasoning_content": "A greeting."},
              {"role": "user", "content": "Again"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nOK"}],
             add_generation_prompt=False),
        case([HI, {"role": "assistant", "content": "Checking.", "reasoning": "Need weather."},
              {"role": "user", "content": "<tool_response>x</tool_response>"}], enable_thinking=False),
        case(TOOL_CHAT, tools=[WEATHER, TIME]),
    ]),
}


def tokenizer(template: str, bos: str | None, eos: str | None) -> PreTrainedTokenizerFast:
    vocab = {t: i for i, t in enumerate(["<unk>", *(t for t in (bos, eos) if t)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    specials = {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v}
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, **specials)


def render(tok: PreTrainedTokenizerFast, c: dict) -> dict:
    try:
        text = tok.apply_chat_template(c["messages"], tools=c["tools"],
                                       add_generation_prompt=c["add_generation_prompt"], tokenize=False, **c["kwargs"])
    except jinja2.exceptions.TemplateError as exc:
        return {**c, "error": {"type": type(exc).__name__, "message": str(exc)}}
    return {**c, "expected": text}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT, help="the folder to write (default %(default)s)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, (template, bos, eos, cases) in TEMPLATES.items():
        tok = tokenizer(template, bos, eos)
        doc = {"template": template, "bos_token": bos, "eos_token": eos, "transformers": transformers.__version__,
               "jinja2": jinja2.__version__, "cases": [render(tok, c) for c in cases]}
        (args.out / f"{name}.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        errors = sum("error" in c for c in doc["cases"])
        print(f"{name}: {len(cases)} cases ({errors} errors) -> {args.out / (name + '.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
