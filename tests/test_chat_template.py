"""Chat templates (issue 17): rendered as transformers renders them, found where transformers and llama.cpp look.

The fixtures under fixtures/chat_templates/ hold what transformers' apply_chat_template(tokenize=False) made of
each template and conversation (tools/chat_template_fixtures.py wrote them; transformers is not needed here).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import gguf
import pytest
from gguf import GGMLQuantizationType as Q

import gguf_writer
from coordinator.config import EngineConfig
from coordinator.engine import Engine
from coordinator.errors import StrataError
from coordinator.text.tokenizer import TextCodec
from coordinator.text.chat_template import ChatTemplate, ChatTemplateError, load_chat_template

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"
CASES = [(f.stem, i) for f in sorted(FIXTURES.glob("*.json")) for i in range(len(json.loads(f.read_text())["cases"]))]
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("name,index", CASES, ids=[f"{n}-{i}" for n, i in CASES])
def test_renders_as_transformers(name, index):
    doc = json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8"))
    case = doc["cases"][index]
    template = ChatTemplate(doc["template"], doc["bos_token"] or "", doc["eos_token"] or "")
    messages = copy.deepcopy(case["messages"])

    def render():
        return template.render(messages, tools=case["tools"], add_generation_prompt=case["add_generation_prompt"],
                               **case["kwargs"])

    if "error" in case:
        with pytest.raises(ChatTemplateError) as exc:
            render()
        assert str(exc.value) == case["error"]["message"]
    else:
        assert render() == case["expected"]
    assert messages == case["messages"]  # the caller's messages untouched (None keys, reasoning aliases)


def test_fixtures_cover_the_brief():
    names = {n for n, _ in CASES}
    assert {"system_loops", "tools", "alternate", "generation_prompt", "chatml_qwen3"} <= names
    assert len(CASES) >= 15


@pytest.mark.parametrize("source", ["{{ ''.__class__ }}", "{{ messages.__class__.__mro__ }}",
                                    "{{ messages.append(1) }}", "{% set ns = namespace(_x=1) %}",
                                    "{{ cycler.__init__.__globals__ }}"])
def test_the_sandbox_refuses(source):
    with pytest.raises(ChatTemplateError, match="unsafe|underscore"):
        ChatTemplate(source).render(HI)


def test_errors_are_chat_template_errors():
    assert issubclass(ChatTemplateError, StrataError)
    with pytest.raises(ChatTemplateError, match="syntax error, line 2"):
        ChatTemplate("ok\n{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="could not render: TypeError"):
        ChatTemplate("{{ messages[0].content + 1 }}").render(HI)
    with pytest.raises(ChatTemplateError, match="empty conversation"):
        ChatTemplate(CHATML).render([])
    t = ChatTemplate(CHATML)
    assert t.render(HI) == t.render(HI) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ChatTemplate("{{ strftime_now('%%|x') }}").render(HI) == "%|x"


# -- where the template is found --------------------------------------------------------------------------------


def folder(tmp_path, config=None, jinja=None, tokens=None) -> Path:
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    if config is not None:
        (d / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (d / "chat_template.jinja").write_text(jinja)
    if tokens is not None:
        (d / "special_tokens_map.json").write_text(json.dumps(tokens))
    return d


def test_folder_tokenizer_config_string(tmp_path):
    d = folder(tmp_path, {"chat_template": CHATML, "bos_token": {"content": "<s>", "lstrip": False,
                                                                "__type": "AddedToken"}, "eos_token": "</s>"})
    assert load_chat_template(d) == ChatTemplate(CHATML, "<s>", "</s>")


def test_folder_named_templates(tmp_path):
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": CHATML}]
    assert load_chat_template(folder(tmp_path, {"chat_template": named})).source == CHATML
    assert load_chat_template(folder(tmp_path, {"chat_template": named[:1]})).source == "T"
    with pytest.raises(ChatTemplateError, match="none named 'default'"):
        load_chat_template(folder(tmp_path, {"chat_template": [named[0], {"name": "rag", "template": "R"}]}))


def test_folder_jinja_file_wins_and_tokens_from_the_map(tmp_path):
    d = folder(tmp_path, {"chat_template": "old", "eos_token": "<e>"}, jinja=CHATML, tokens={"bos_token": "<b>"})
    assert load_chat_template(d) == ChatTemplate(CHATML, "<b>", "<e>")


def test_folder_without_a_template(tmp_path, tiny_model):
    model = tiny_model()
    (model / "tokenizer_config.json").unlink()  # make-model's ChatML template
    assert load_chat_template(model) is None
    assert load_chat_template(folder(tmp_path, {"eos_token": "</s>"})) is None


def test_a_broken_template_names_its_file(tmp_path):
    d = folder(tmp_path, jinja="{% if %}")
    with pytest.raises(ChatTemplateError, match=r"chat_template\.jinja: chat template syntax error"):
        load_chat_template(d)


def test_a_broken_template_turns_chat_off_not_the_model(tiny_model):
    model = tiny_model()
    (model / "chat_template.jinja").write_text("{% for %}")
    with Engine.open(model, EngineConfig(pool="inproc")) as engine:
        assert engine.chat_template is None
        assert "chat_template.jinja: chat template syntax error" in engine.chat_template_error
        assert len(engine.generate(engine.encode("Hello"), 3, temperature=0.0)) == 3


def metadata_gguf(path: Path, template: str | None) -> Path:
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_token_list(["<unk>", "<|endoftext|>", "<|im_end|>", "a"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if template is not None:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_metadata(tmp_path):
    path = metadata_gguf(tmp_path / "m.gguf", CHATML)
    assert load_chat_template(path) == ChatTemplate(CHATML, "<|endoftext|>", "<|im_end|>")
    meta = {"tokenizer.chat_template": "X", "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.eos_token_id": 0}
    assert load_chat_template(path, meta) == ChatTemplate("X", "", "a")  # the metadata the engine has read
    (tmp_path / "bare").mkdir()
    bare = metadata_gguf(tmp_path / "bare" / "m.gguf", None)
    assert load_chat_template(bare) is None
    (bare.parent / "chat_template.jinja").write_text("beside")  # as the tokenizer: the files beside the file
    assert load_chat_template(bare.parent).source == "beside"


def test_the_engine_has_the_template(tmp_path, tiny_model, monkeypatch):
    model = tiny_model()
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    with Engine.open(model, EngineConfig(pool="inproc")) as engine:
        assert engine.chat_template == ChatTemplate(CHATML, "", "<|im_end|>")

    def with_template(w, tok, *args, **kwargs):
        add_tokenizer(w, tok, *args, **kwargs)
        w.add_chat_template("{{ messages[0].content }}")
        w.add_eos_token_id(tok.token_to_id("<|im_end|>"))

    add_tokenizer = gguf_writer.add_tokenizer
    monkeypatch.setattr(gguf_writer, "add_tokenizer", with_template)
    path = tmp_path / "g" / "m.gguf"
    path.parent.mkdir()
    gguf_writer.write_gguf(model, path, experts=Q.F32, tokenizer=TextCodec.load(model).tokenizer)
    with Engine.open(path, EngineConfig(pool="inproc")) as engine:
        assert engine.chat_template == ChatTemplate("{{ messages[0].content }}", "", "<|im_end|>")
        assert engine.chat_template.render(HI) == "hi"
