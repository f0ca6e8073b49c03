"""A GGUF file (or a split set) read as llama.cpp's own reader (the ``gguf`` package) parses it, checked for
what every model needs, with no model family's knowledge: the families (coordinator/model/arch/) turn its
metadata into config.json keys and its tensor names into Hugging Face names.

    GgufFile(path)          path: file.gguf, or the first of name-00001-of-0000N.gguf; a truncated file, a
                            missing part or a tensor in two parts is a GgufError naming the file
        .arch               general.architecture ("qwen3moe", "llama", "deepseek2", ...)
        .metadata           {key: value}; .meta(key) reads "<arch>.<key>", .integer(key) checks it an integer
        .tensors            {GGUF name: (its part, gguf ReaderTensor)}
        .shape(name)        numpy order (the reverse of ggml's ne)
        .float32(name)      the tensor dequantised (gguf.quants), numpy order

shm/gguf_checkpoint.py reads it as a Checkpoint for the engine (under a family's names) and the node workers
(under the file's own names)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, quants

SPLIT = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")

GATING_FUNCS = {1: "softmax", 2: "sigmoid"}  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE (3: sqrtsoftplus)


class GgufError(ValueError):
    """A GGUF file the engine cannot use; the message names the file, and the tensor and type where one is at fault."""


def part_paths(path: str | Path) -> list[Path]:
    """Every part of a split file, given its first (name-00001-of-0000N.gguf); [path] otherwise."""
    path = Path(path)
    if not path.is_file():
        raise GgufError(f"{path}: no such file")
    m = SPLIT.match(path.name)
    if m is None:
        return [path]
    if int(m["index"]) != 1:
        raise GgufError(f"{path}: part {int(m['index'])} of a split file; give the first part (-00001-of-...)")
    count = int(m["count"])
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise GgufError(f"{path}: split in {count} parts, missing {', '.join(missing)}")
    return parts


def metadata_value(field):
    """A metadata field as a Python value (str, number, bool or list); a float32 as the shortest decimal that
    reads back to it (1e-06, not 9.99999997e-07: the value the converter was given)."""
    value = field.contents()
    if isinstance(value, float) and field.types and field.types[0] == GGUFValueType.FLOAT32:
        return float(str(np.float32(value)))
    return value


class GgufFile:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.metadata: dict[str, object] = {}
        self.tensors: dict[str, tuple[Path, object]] = {}  # GGUF name -> (its file, gguf ReaderTensor)
        for part in part_paths(path):
            try:
                reader = GGUFReader(part)
            except (ValueError, IndexError, OSError) as exc:
                raise GgufError(f"{part}: not a readable GGUF file ({exc}); truncated or not GGUF?") from exc
            for key, field in reader.fields.items():
                if not key.startswith("GGUF."):
                    self.metadata.setdefault(key, metadata_value(field))
            for t in reader.tensors:
                if t.name in self.tensors:
                    raise GgufError(f"{part}: tensor {t.name} is also in {self.tensors[t.name][0].name}")
                if t.data.nbytes != t.n_bytes:  # the mapping ended before the tensor did
                    raise GgufError(f"{part}: tensor {t.name} ({t.tensor_type.name}) needs {t.n_bytes} bytes, the "
                                    f"file holds {t.data.nbytes}: truncated")
                self.tensors[t.name] = (part, t)
        self.arch = str(self.metadata.get("general.architecture", ""))

    @property
    def num_layers(self) -> int:
        """The decoder layers the engine runs: block_count less the multi-token-prediction layers some
        converters append (nextn_predict_layers)."""
        return self.integer("block_count") - self.integer("nextn_predict_layers", 0)

    def meta(self, key: str, default: object = ...) -> object:
        """The architecture's metadata ``key`` (``<arch>.<key>``); ``default`` where absent, else GgufError."""
        full = f"{self.arch}.{key}"
        if full in self.metadata:
            return self.metadata[full]
        if default is ...:
            raise GgufError(f"{self.path}: metadata {full} is missing")
        return default

    def holds(self, key: str) -> bool:
        return f"{self.arch}.{key}" in self.metadata

    def integer(self, key: str, default: object = ...) -> int:
        """meta(key) checked to be an integer (a bool is not one)."""
        value = self.meta(key, default)
        if value is None and default is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise GgufError(f"{self.path}: metadata {self.arch}.{key} is {value!r}; expected an integer")
        return value

    def vocab_size(self) -> int:
        """vocab_size, else the tokenizer's token count, else the embedding's rows."""
        vocab = self.meta("vocab_size", None)
        if vocab is None:
            tokens = self.metadata.get("tokenizer.ggml.tokens")
            vocab = len(tokens) if tokens is not None else self.shape("token_embd.weight")[0]
        return int(vocab)

    def gating(self, default: str) -> str:
        """expert_gating_func by llama.cpp's names ("softmax", "sigmoid"); ``default`` where absent."""
        func = self.meta("expert_gating_func", None)
        if func is None:
            return default
        if func not in GATING_FUNCS:
            raise GgufError(f"{self.path}: metadata {self.arch}.expert_gating_func is {func!r}; supported: "
                            + ", ".join(f"{k} ({v})" for k, v in GATING_FUNCS.items()))
        return GATING_FUNCS[func]

    def token_ids(self) -> dict:
        """config.json's bos_token_id and eos_token_id where the tokenizer's metadata has them."""
        return {hf: int(self.metadata[key]) for key, hf in (("tokenizer.ggml.bos_token_id", "bos_token_id"),
                                                             ("tokenizer.ggml.eos_token_id", "eos_token_id"))
                if key in self.metadata}

    def has_layer_tensor(self, suffix: str) -> bool:
        """Whether some layer has a tensor blk.N.<suffix> (".attn_q.bias")."""
        return any(name.startswith("blk.") and name.endswith(suffix) for name in self.tensors)

    def refuse(self, key: str, why: str) -> None:
        """GgufError naming ``key`` and ``why`` where the metadata has ``key``."""
        if self.holds(key):
            raise GgufError(f"{self.path}: metadata {self.arch}.{key} = {self.meta(key)!r}: {why}")

    def shape(self, name: str) -> tuple[int, ...]:
        """Numpy order: ggml's ne reversed ([E, I, H] for ffn_gate_exps)."""
        return tuple(int(n) for n in reversed(self.tensor(name).shape))

    def type_name(self, name: str) -> str:
        return self.tensor(name).tensor_type.name

    def part(self, name: str) -> Path:
        """The file (of a split set) that holds tensor ``name``."""
        self.tensor(name)
        return self.tensors[name][0]

    def float32(self, name: str) -> np.ndarray:
        """The whole tensor, dequantised exactly as gguf.quants reads it, in numpy order."""
        t = self.tensor(name)
        try:
            out = quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as exc:
            raise GgufError(f"{self.tensors[name][0]}: tensor {name} has type {t.tensor_type.name}, which cannot be "
                            f"read ({exc})") from exc
        return np.asarray(out, np.float32).reshape(self.shape(name))

    def tensor(self, name: str):
        """The gguf package's ReaderTensor of ``name``; GgufError where the file has none."""
        if name not in self.tensors:
            raise GgufError(f"{self.path}: no tensor {name}")
        return self.tensors[name][1]
