#!/usr/bin/env python
"""Render real tool-calling chat templates with Hugging Face transformers, as fixtures for tests/test_tool_calls.py.

Writes OUT/deepseek_v3.json, OUT/deepseek_v31.json and OUT/glm45.json in the format of
tools/chat_template_fixtures.py (whose helpers it uses), plus a "source" field naming where each template was
transcribed from. Run it, like that script, with a Python that has transformers, jinja2 and tokenizers (NOT needed
by the engine or its tests), e.g.:

    python3 -m venv /tmp/hfenv && /tmp/hfenv/bin/pip install transformers jinja2 tokenizers
    /tmp/hfenv/bin/python tools/tool_template_fixtures.py [--out tests/fixtures/chat_templates]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jinja2
import transformers

# chat_template_fixtures.py sits beside this script; make it importable however this script is started
sys.path.insert(0, str(Path(__file__).resolve().parent))
from chat_template_fixtures import CHAT, HI, OUT, SYSTEM, TIME, WEATHER, case, render, tokenizer  # noqa: E402

# The templates, verbatim (raw strings: a '\n' below is the two characters of a Jinja string escape).

# deepseek-ai/DeepSeek-V3-0324: arguments concatenated as JSON text inside a ```json fence, tool outputs in
# <｜tool▁outputs▁begin｜>, a system prompt before the first turn
DEEPSEEK_V3_SOURCE = ("deepseek-ai/DeepSeek-V3-0324 tokenizer_config.json chat_template, transcribed from the "
                      "tokenizer.chat_template of unsloth/DeepSeek-V3-0324-GGUF (printed in a public llama-cpp-python "
                      "log; its Jinja '\\n' escapes written there as newlines, here as tokenizer_config.json "
                      "writes them)")
DEEPSEEK_V3 = r"""{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true, is_last_user=false) %}{%- for message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}{%- else %}{% set ns.system_prompt = ns.system_prompt + '\n\n' + message['content'] %}{%- endif %}{%- endif %}{%- endfor %}{{ bos_token }}{{ ns.system_prompt }}{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{%- set ns.is_first = false -%}{%- set ns.is_last_user = true -%}{{'<｜User｜>' + message['content'] + '<｜Assistant｜>'}}{%- endif %}{%- if message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] is not none %}{%- set ns.is_last_user = false -%}{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{%- endif %}{%- set ns.is_first = false %}{%- set ns.is_tool = false -%}{%- set ns.is_output_first = true %}{%- for tool in message['tool_calls'] %}{%- if not ns.is_first %}{%- if message['content'] is none %}{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{%- else %}{{message['content'] + '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{%- endif %}{%- set ns.is_first = true -%}{%- else %}{{'\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{%- endif %}{%- endfor %}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- if message['role'] == 'assistant' and (message['tool_calls'] is not defined or message['tool_calls'] is none)%}{%- set ns.is_last_user = false -%}{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}{%- else %}{% set content = message['content'] %}{{content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}{%- if message['role'] == 'tool' %}{%- set ns.is_last_user = false -%}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- set ns.is_output_first = false %}{%- else %}{{'\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}{% if add_generation_prompt and not ns.is_last_user and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}"""

# deepseek-ai/DeepSeek-V3.1: no fence or type, the thinking switch (thinking / enable_thinking) with </think>
DEEPSEEK_V31_SOURCE = ("deepseek-ai/DeepSeek-V3.1 chat template as llama.cpp stores it: ggml-org/llama.cpp "
                       "models/templates/deepseek-ai-DeepSeek-V3.1.jinja "
                       "(commit 0374c5b6e4c19370262d93e2c3f2a98c9af9fe1f)")
DEEPSEEK_V31 = r"""{% if not add_generation_prompt is defined -%}
  {%- set add_generation_prompt = false -%}
{%- endif -%}
{%- if not thinking is defined -%}
  {%- if enable_thinking is defined -%}
    {%- set thinking = enable_thinking -%}
    {%- else -%}
    {%- set thinking = false -%}
  {%- endif -%}
{%- endif -%}
{%- set ns = namespace(is_first=false, is_tool=false, system_prompt='', is_first_sp=true, is_last_user=false) -%}
{%- for message in messages -%}
  {%- if message['role'] == 'system' -%}
    {%- if ns.is_first_sp -%}
      {%- set ns.system_prompt = ns.system_prompt + message['content'] -%}
      {%- set ns.is_first_sp = false -%}
      {%- else -%}
      {%- set ns.system_prompt = ns.system_prompt + '

' + message['content'] -%}
    {%- endif -%}
  {%- endif -%}
{%- endfor -%}{{ bos_token }}{{ ns.system_prompt }}
{%- for message in messages -%}
  {%- if message['role'] == 'user' -%}
    {%- set ns.is_tool = false -%}
    {%- set ns.is_first = false -%}
    {%- set ns.is_last_user = true -%}{{'<｜User｜>' + message['content']}}
  {%- endif -%}
  {%- if message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] is not none -%}
    {%- if ns.is_last_user -%}{{'<｜Assistant｜></think>'}}
    {%- endif -%}
    {%- set ns.is_last_user = false -%}
    {%- set ns.is_first = false -%}
    {%- set ns.is_tool = false -%}
    {%- for tool in message['tool_calls'] -%}
      {%- if not ns.is_first -%}
        {%- if message['content'] is none -%}{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}
          {%- else -%}{{message['content'] + '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}
        {%- endif -%}
        {%- set ns.is_first = true -%}
        {%- else -%}{{'<｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}
      {%- endif -%}
    {%- endfor -%}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}
  {%- endif -%}
  {%- if message['role'] == 'assistant' and (message['tool_calls'] is not defined or message['tool_calls'] is none) -%}
    {%- if ns.is_last_user -%}{{'<｜Assistant｜>'}}
      {%- if message['prefix'] is defined and message['prefix'] and thinking -%}{{'<think>'}}
        {%- else -%}{{'</think>'}}
      {%- endif -%}
    {%- endif -%}
    {%- set ns.is_last_user = false -%}
    {%- if ns.is_tool -%}{{message['content'] + '<｜end▁of▁sentence｜>'}}
      {%- set ns.is_tool = false -%}
      {%- else -%}
      {%- set content = message['content'] -%}
      {%- if '</think>' in content -%}
        {%- set content = content.split('</think>', 1)[1] -%}
      {%- endif -%}{{content + '<｜end▁of▁sentence｜>'}}
    {%- endif -%}
  {%- endif -%}
  {%- if message['role'] == 'tool' -%}
    {%- set ns.is_last_user = false -%}
    {%- set ns.is_tool = true -%}{{'<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and ns.is_last_user and not ns.is_tool -%}{{'<｜Assistant｜>'}}
  {%- if not thinking -%}{{'</think>'}}
    {%- else -%}{{'<think>'}}
  {%- endif -%}
{%- endif %}"""

# zai-org/GLM-4.5: tool calls as <tool_call>name <arg_key>/<arg_value> pairs, /nothink, <|observation|> results
GLM45_SOURCE = ("zai-org/GLM-4.5 chat_template.jinja, transcribed from the chat template llama-server printed for a "
                "GLM-4.5-Air GGUF in public logs (length-checked against two of them)")
GLM45 = r"""[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}
{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}
</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}
<arg_key>{arg-key-1}</arg_key>
<arg_value>{arg-value-1}</arg_value>
<arg_key>{arg-key-2}</arg_key>
<arg_value>{arg-value-2}</arg_value>
...
</tool_call>{%- endif -%}
{%- macro visible_text(content) -%}
    {%- if content is string -%}
        {{- content }}
    {%- elif content is iterable and content is not mapping -%}
        {%- for item in content -%}
            {%- if item is mapping and item.type == 'text' -%}
                {{- item.text }}
            {%- elif item is string -%}
                {{- item }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{- content }}
    {%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(last_user_index=-1) %}
{%- for m in messages %}
    {%- if m.role == 'user' %}
        {% set ns.last_user_index = loop.index0 -%}
    {%- endif %}
{%- endfor %}
{% for m in messages %}
{%- if m.role == 'user' -%}<|user|>
{% set content = visible_text(m.content) %}{{ content }}
{{- '/nothink' if (enable_thinking is defined and not enable_thinking and not content.endswith("/nothink")) else '' -}}
{%- elif m.role == 'assistant' -%}
<|assistant|>
{%- set reasoning_content = '' %}
{%- set content = visible_text(m.content) %}
{%- if m.reasoning_content is string %}
    {%- set reasoning_content = m.reasoning_content %}
{%- else %}
    {%- if '</think>' in content %}
        {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
        {%- set content = content.split('</think>')[-1].lstrip('\n') %}
    {%- endif %}
{%- endif %}
{%- if loop.index0 > ns.last_user_index and reasoning_content -%}
{{ '\n<think>' + reasoning_content.strip() +  '</think>'}}
{%- else -%}
{{ '\n<think></think>' }}
{%- endif -%}
{%- if content.strip() -%}
{{ '\n' + content.strip() }}
{%- endif -%}
{% if m.tool_calls %}
{% for tc in m.tool_calls %}
{%- if tc.function %}
    {%- set tc = tc.function %}
{%- endif %}
{{ '\n<tool_call>' + tc.name }}
{% set _args = tc.arguments %}
{% for k, v in _args.items() %}
<arg_key>{{ k }}</arg_key>
<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>
{% endfor %}
</tool_call>{% endfor %}
{% endif %}
{%- elif m.role == 'tool' -%}
{%- if m.content is string -%}
{%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
    {{- '<|observation|>' }}
{%- endif %}
{{- '\n<tool_response>\n' }}
{{- m.content }}
{{- '\n</tool_response>' }}
{%- else -%}
<|observation|>{% for tr in m.content %}

<tool_response>
{{ tr.output if tr.output is defined else tr }}
</tool_response>{% endfor -%}
{% endif -%}
{%- elif m.role == 'system' -%}
<|system|>
{{ visible_text(m.content) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    <|assistant|>{{- '\n<think></think>' if (enable_thinking is defined and not enable_thinking) else '' -}}
{%- endif -%}"""

# a tool whose arguments have every JSON type (GLM-4.5 writes strings bare and the rest as JSON)
FORECAST = {"type": "function", "function": {
    "name": "get_forecast", "description": "The forecast for some days",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "note": {"type": "string"}, "hours": {"type": "array", "items": {"type": "integer"}}},
        "required": ["city", "days"]}}}


def string_call_chat(content: str | None) -> list[dict]:
    """Arguments as JSON text, as the OpenAI API sends them (DeepSeek's templates concatenate them as strings)."""
    return [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Zürich and the time?"},
        {"role": "assistant", "content": content, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Zürich\"}"}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21, \"sky\": \"☀\"}"},
        {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
        {"role": "assistant", "content": "21 °C and sunny; it is noon."},
    ]


# arguments as dicts, which GLM-4.5's template iterates with .items()
GLM_CHAT = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Forecast for Zürich?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_forecast", "arguments": {
            "city": "Zürich", "days": 3, "metric": True, "note": "42", "hours": [6, 18]}}},
        {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"},
    {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
]

DS_BOS, DS_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

# name: (template, bos_token, eos_token, source, cases)
TEMPLATES = {
    "deepseek_v3": (DEEPSEEK_V3, DS_BOS, DS_EOS, DEEPSEEK_V3_SOURCE, [
        case([SYSTEM, *CHAT]),
        case(string_call_chat(""), tools=[WEATHER, TIME]),
        case(string_call_chat("Checking.")[1:3], tools=[WEATHER, TIME], add_generation_prompt=False),
        case(string_call_chat(None)[1:3], tools=[WEATHER, TIME], add_generation_prompt=False),
    ]),
    "deepseek_v31": (DEEPSEEK_V31, DS_BOS, DS_EOS, DEEPSEEK_V31_SOURCE, [
        case([SYSTEM, *CHAT]),
        case([SYSTEM, *CHAT], thinking=True),
        case(string_call_chat(""), tools=[WEATHER, TIME]),
        case(string_call_chat("Checking.")[1:3], tools=[WEATHER, TIME], add_generation_prompt=False),
    ]),
    "glm45": (GLM45, None, "<|endoftext|>", GLM45_SOURCE, [
        case([SYSTEM, *CHAT]),
        case([HI, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nOK"},
              {"role": "user", "content": "Again"}], enable_thinking=False),
        case(GLM_CHAT, tools=[FORECAST, TIME]),
        case(GLM_CHAT[1:3], tools=[FORECAST, TIME], add_generation_prompt=False),
    ]),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT, help="the folder to write (default %(default)s)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, (template, bos, eos, source, cases) in TEMPLATES.items():
        tok = tokenizer(template, bos, eos)
        doc = {"template": template, "bos_token": bos, "eos_token": eos, "source": source,
               "transformers": transformers.__version__, "jinja2": jinja2.__version__,
               "cases": [render(tok, c) for c in cases]}
        (args.out / f"{name}.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        errors = sum("error" in c for c in doc["cases"])
        print(f"{name}: {len(cases)} cases ({errors} errors) -> {args.out / (name + '.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
