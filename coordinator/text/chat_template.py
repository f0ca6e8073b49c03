"""A model's chat template: its Jinja source rendered as transformers' ``apply_chat_template(tokenize=False)``
renders it (transformers/utils/chat_template_utils.py: ``_compile_jinja_template``, ``render_jinja_template``).

The same sandbox (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loopcontrols, the ``generation``
tag rendered as its body), the same names (raise_exception, strftime_now, tojson without HTML escaping, dict,
namespace refusing underscore names), the same variables (messages, tools, documents, add_generation_prompt,
bos_token and eos_token where the model has them, then the caller's extras such as enable_thinking), and the
same clean-up of the messages (keys whose value is None dropped, plain JSON types only, a message's reasoning
also under ``reasoning_content`` and ``thinking``). One departure: touching an unsafe attribute
(``''.__class__``) is an error at once, not an undefined value that renders as nothing.

Where ``load_chat_template`` finds it:
    a model folder      chat_template.jinja, else tokenizer_config.json's ``chat_template`` (a string, or a list of
                        {"name", "template"}: "default", or the only one); bos_token and eos_token from
                        tokenizer_config.json (else special_tokens_map.json), a string or {"content": ...}
    a GGUF file         its metadata's ``tokenizer.chat_template``, bos and eos from ``tokenizer.ggml.bos_token_id``
                        and ``eos_token_id`` through ``tokenizer.ggml.tokens``; else the folder's files as above
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, is_dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..errors import StrataError

log = logging.getLogger(__name__)

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' order: the first is the standard


class ChatTemplateError(StrataError):
    """The chat template raised (raise_exception), or could not be parsed or rendered; the message says why."""


class _Generation(jinja2.ext.Extension):
    """transformers' ``{% generation %}...{% endgeneration %}`` (it marks the assistant's text for training
    masks): the body rendered in a call block, as transformers renders it without a tracker."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _TemplateDict:
    """``dict`` in a template: builds dicts, and nothing reachable through attributes."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace`` in a template, refusing underscore-prefixed attributes."""

    def __init__(*args, **kwargs):  # jinja's signature trick: namespace(self=...) still works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}.")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _Sandbox(ImmutableSandboxedEnvironment):
    """The one departure from transformers: an unsafe attribute (``''.__class__``) is an error at once, where
    jinja's sandbox gives an undefined value that renders as nothing and fails only when used."""

    def unsafe_undefined(self, obj, attribute):
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe.")


def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_TemplateNamespace)
    return env


_ENV = _environment()


def _plain(value: Any) -> Any:
    """What the template may see: JSON types rebuilt (subclasses stripped), anything else a "<type>" placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for kind in (str, bool, int, float):
        if isinstance(value, kind):
            return kind(value) if kind is not str else str.__str__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    if is_dataclass(value) and not isinstance(value, type):
        return {f: _plain(getattr(value, f)) for f in value.__dataclass_fields__}
    if callable(getattr(value, "model_dump", None)):  # pydantic models (the openai client's messages)
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _messages(messages) -> list[dict]:
    """transformers' clean-up: keys whose value is None dropped, plain types, reasoning under its aliases."""
    out = []
    for message in _plain(list(messages)):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"chat messages should be dicts, got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template, compiled once (a syntax error is a ChatTemplateError here)."""

    source: str
    bos_token: str = ""
    eos_token: str = ""
    _compiled: jinja2.Template = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        try:
            compiled = _ENV.from_string(self.source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"chat template syntax error, line {exc.lineno}: {exc.message}") from None
        object.__setattr__(self, "_compiled", compiled)

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True, tools: list | None = None,
               **extra) -> str:
        """The conversation as the prompt text; ``extra``: more template variables (enable_thinking=False, ...)."""
        if not messages:
            raise ChatTemplateError("cannot apply the chat template to an empty conversation")
        if tools is not None and not all(isinstance(t, Mapping) for t in tools):
            raise ChatTemplateError("tools should be JSON schemas (dicts)")
        specials = {name: token for name, token in (("bos_token", self.bos_token), ("eos_token", self.eos_token))
                    if token}  # as transformers' special_tokens_map: absent, not empty, when the model has none
        variables = _plain({"documents": None, **specials, **extra})
        try:
            return self._compiled.render(messages=_messages(messages), tools=_plain(tools),
                                         add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.SecurityError as exc:
            raise ChatTemplateError(f"chat template refused: {exc}") from None
        except jinja2.exceptions.TemplateError as exc:  # raise_exception's message as the template wrote it
            raise ChatTemplateError(str(exc) or type(exc).__name__) from None
        except Exception as exc:  # noqa: BLE001 - the template's own mistakes (a str + None, a bad index, ...)
            raise ChatTemplateError(f"chat template could not render: {type(exc).__name__}: {exc}") from None


def turn_end_id(template: ChatTemplate, codec) -> int | None:
    """The id of the template's eos_token (ChatML's <|im_end|>), which ends an assistant's turn even where the
    model's config does not list it among its eos ids; None when the template has none or the vocabulary lacks
    it."""
    if not template.eos_token or codec is None:
        return None
    return codec.tokenizer.token_to_id(template.eos_token)


def _token(value) -> str:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _read_json(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ChatTemplateError(f"{path}: cannot be read as JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise ChatTemplateError(f"{path}: expected a JSON object")
    return doc


def _make(source: str, origin: Path | str, bos: str, eos: str) -> ChatTemplate:
    if not isinstance(source, str):
        raise ChatTemplateError(f"{origin}: the chat template is not a string")
    try:
        return ChatTemplate(source, bos, eos)
    except ChatTemplateError as exc:
        raise ChatTemplateError(f"{origin}: {exc}") from None


def _pick(templates: list, origin: Path) -> str:
    """A named-list chat_template's "default" template, or its only one."""
    named = {t.get("name"): t.get("template") for t in templates if isinstance(t, dict)}
    if len(named) != len(templates):
        raise ChatTemplateError(f"{origin}: chat_template is a list, but not of {{'name', 'template'}} objects")
    if "default" in named:
        return named["default"]
    if len(named) == 1:
        return next(iter(named.values()))
    raise ChatTemplateError(f"{origin}: {len(named)} chat templates ({', '.join(map(str, named))}) and none named "
                            "'default'")


def _from_folder(folder: Path) -> ChatTemplate | None:
    config_path = folder / TOKENIZER_CONFIG
    config = _read_json(config_path) if config_path.is_file() else {}
    tokens_path = folder / SPECIAL_TOKENS_MAP
    tokens = {**(_read_json(tokens_path) if tokens_path.is_file() else {}), **config}
    bos, eos = _token(tokens.get("bos_token")), _token(tokens.get("eos_token"))
    jinja_path = folder / TEMPLATE_FILE
    if jinja_path.is_file():  # as transformers loads it: the file wins over the config's key
        try:
            source = jinja_path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ChatTemplateError(f"{jinja_path}: cannot be read: {exc}") from None
        return _make(source, jinja_path, bos, eos)
    source = config.get("chat_template")
    if source is None:
        return None
    if isinstance(source, list):
        source = _pick(source, config_path)
    return _make(source, config_path, bos, eos)


def _gguf_metadata(path: Path) -> dict:
    from gguf import GGUFReader

    from shm.gguf_file import metadata_value, part_paths

    reader = GGUFReader(part_paths(path)[0])  # gguf-split keeps the metadata in the first part
    return {key: metadata_value(f) for key, f in reader.fields.items() if key.startswith("tokenizer.")}


def _from_gguf(metadata: dict, path: Path) -> ChatTemplate | None:
    source = metadata.get("tokenizer.chat_template")
    if source is None:
        return None
    tokens = metadata.get("tokenizer.ggml.tokens") or []

    def token(key: str) -> str:
        i = metadata.get(key)
        return str(tokens[i]) if isinstance(i, int) and 0 <= i < len(tokens) else ""

    return _make(source, f"{path} (tokenizer.chat_template)", token("tokenizer.ggml.bos_token_id"),
                 token("tokenizer.ggml.eos_token_id"))


def load_chat_template(model_path, gguf_metadata: dict | None = None) -> ChatTemplate | None:
    """The chat template of a model folder or GGUF file (``gguf_metadata``: the file's metadata when the caller
    has read it already); None when the model has none. ChatTemplateError names the file whose template is
    broken."""
    from shm.gguf_checkpoint import gguf_path

    path = Path(model_path)
    gguf = gguf_path(path)
    if gguf is None:
        return _from_folder(path)
    found = _from_gguf(gguf_metadata if gguf_metadata is not None else _gguf_metadata(gguf), gguf)
    return found if found is not None else _from_folder(gguf.parent)  # as the tokenizer: the files beside it
