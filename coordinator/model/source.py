"""ModelSource: a model's parts before its tensors are read (open_source).

A checkpoint folder or a GGUF file gives the same four things: the checkpoint (its tensor index), the
configuration, the tokenizer (None without one) and the chat template (None without one; a broken one is
named in ``chat_template_error`` and turns chat off, not the model). The command line opens the source first
to check a prompt before the weights load, then hands it to Engine.open, which reads it once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from shm.checkpoint import Checkpoint
from shm.gguf_checkpoint import GgufCheckpoint, gguf_path

from ..text.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from ..text.gguf_tokenizer import gguf_codec
from .arch import gguf_config, of_gguf
from .model_config import ModelConfig, attach_mtp, load_model_config, parse_model_config
from ..text.tokenizer import TextCodec

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class ModelSource:
    path: Path  # the folder or GGUF file, as given
    checkpoint: Checkpoint | GgufCheckpoint
    config: ModelConfig
    codec: TextCodec | None  # None: the model has no tokenizer (token ids only)
    chat_template: ChatTemplate | None = None  # the model's, when it has one that parses
    chat_template_error: str | None = None  # why the model's template cannot be used, when it is broken

    @property
    def gguf(self) -> bool:
        return isinstance(self.checkpoint, GgufCheckpoint)


def open_gguf(path: str | Path) -> GgufCheckpoint:
    """A GGUF file as a checkpoint under Hugging Face's names, by its family (model/arch/)."""
    return GgufCheckpoint(path, lambda f: of_gguf(f).gguf_names(f))


def open_source(model_path: str | Path) -> ModelSource:
    """The source of a model folder or GGUF file, its tensors not read yet; a missing or broken configuration
    is the first error named. A broken chat template is logged and kept as ``chat_template_error``."""
    path = Path(model_path)
    gguf = gguf_path(path)
    if gguf is None:
        config = load_model_config(path)  # first: a missing or broken config is the error to name
        codec = TextCodec.load(path)
        checkpoint: Checkpoint | GgufCheckpoint = Checkpoint(path)
        metadata = None
    else:
        checkpoint = open_gguf(gguf)
        config = parse_model_config(gguf_config(checkpoint.file), gguf.parent)
        codec = gguf_codec(checkpoint.file.metadata, gguf)
        metadata = checkpoint.file.metadata
    config = attach_mtp(config, lambda name: name in checkpoint)
    template, template_error = None, None
    try:
        template = load_chat_template(path, metadata)
    except ChatTemplateError as exc:
        template_error = str(exc)
        log.warning("%s: chat is off for this model", exc)
    return ModelSource(path, checkpoint, config, codec, template, template_error)
