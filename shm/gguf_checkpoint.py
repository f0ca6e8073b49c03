"""A GGUF file (or split set) read as a Checkpoint: numpy shapes, storage views, under the names a caller gives.

The engine, the expert stores and the node workers read a model through one
interface (shm/checkpoint.py's Checkpoint: names, info, raw, float32, rows,
digest). This module gives it for a GGUF file, on top of shm/gguf_file.py:

    GgufCheckpoint(path, names)
        names(file)     {name: Stored or a Derived}: a model family's map from Hugging Face names to the file's
                        tensors (coordinator/model/arch/; routed experts stacked: model.layers.{i}.mlp.experts.
                        gate_proj [E, I, H], .up_proj [E, I, H], .down_proj [E, H, I]); None: every tensor under
                        its GGUF name, as the node workers read the experts their job names
    info.dtype          F32, F16 and BF16 as safetensors names them; a block type by its ggml name (Q8_0, Q4_K, ...)
    raw(name)           a view of the mapped file: float32 / float16 / uint16 (BF16) [numpy shape]; a block type as
                        uint8 [*shape[:-1], bytes of a row] (each row's blocks, as the file has them)
    float32(name)       dequantised exactly as gguf.quants reads it (rows a converter permuted put back: Stored's
                        heads; a tensor the file holds in parts put together: Derived)

Expert rows of a block type are handed to the stores as the file's bytes
(shm/expert_source.py), which repacks them without loss (shm/gguf_blocks.py)
when the store's format computes the same weights, so the node workers compute
with exactly the file's dequantised weights.

    gguf_path(path)         the .gguf file a model path names, or None (a Hugging Face folder)
    open_checkpoint(path)   a node worker's view: GgufCheckpoint under the file's names, or Checkpoint
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from .checkpoint import Checkpoint, CheckpointError, TensorInfo, check_shape, to_float32
from .gguf_file import GgufError, GgufFile

STORAGE = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}  # ggml float types -> numpy storage


def gguf_path(path: str | Path) -> Path | None:
    """The GGUF file a model path names: the path itself (file.gguf, or the first part of a split set), or the
    only first part inside a folder that has no config.json; None for a Hugging Face folder."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if not path.exists():
        if path.suffix == ".gguf":
            raise GgufError(f"{path}: no such file: give a GGUF file (.gguf) or a checkpoint folder (config.json and "
                            "safetensors)")
        return None  # a folder that is not there: load_model_config names it
    if not path.is_dir():
        raise GgufError(f"{path} is a file, not a model: give a checkpoint folder (config.json and safetensors) or "
                        "a GGUF file (.gguf)")
    if path.is_dir() and not (path / "config.json").exists():
        firsts = sorted(p for p in path.glob("*.gguf") if "-of-" not in p.name or "-00001-of-" in p.name)
        if len(firsts) > 1:
            raise GgufError(f"{path}: holds {len(firsts)} GGUF models ({', '.join(p.name for p in firsts)}); "
                            "give the file's path")
        if firsts:
            return firsts[0]
    return None


def open_checkpoint(path: str | Path) -> Checkpoint | GgufCheckpoint:
    """The checkpoint a path names, a GGUF file's tensors under their own names (a node worker's job names
    them so: no model family is needed to read them)."""
    gguf = gguf_path(path)
    return GgufCheckpoint(gguf) if gguf is not None else Checkpoint(path)


def block_geometry(dtype: str) -> tuple[int, int] | None:
    """(values, bytes) of one block of a ggml block type; None for F32, F16 and BF16."""
    if dtype in STORAGE:
        return None
    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType[dtype]]
    except KeyError:
        raise CheckpointError(f"tensor type {dtype} is not a ggml type") from None


def block_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Rows of a block type (uint8 [..., row bytes]) -> float32 [..., values], as gguf.quants reads them."""
    try:
        return np.asarray(quants.dequantize(np.ascontiguousarray(raw), GGMLQuantizationType[dtype]), np.float32)
    except NotImplementedError as exc:
        raise CheckpointError(f"ggml type {dtype} cannot be read here ({exc})") from exc


def unpermute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of convert_hf_to_gguf.py's LlamaModel.permute: q or k rows [heads * head_dim, H] back in
    Hugging Face's order (each head's two rotary halves apart, not interleaved)."""
    return np.ascontiguousarray(w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2)
                                .reshape(w.shape))


@dataclass(frozen=True)
class Stored:
    """A tensor the file holds, by its GGUF name; ``heads``: the converter permuted its q or k rows over these
    heads (LlamaModel.permute: each head's rotary halves interleaved for ggml's rope), put back on reading."""

    name: str
    heads: int | None = None


class Derived(Protocol):
    """A tensor the file holds in parts (``parts``: their GGUF names), put together in float32 on reading."""

    parts: tuple[str, ...]

    def shape(self, file: GgufFile) -> tuple[int, ...]: ...

    def float32(self, file: GgufFile) -> np.ndarray: ...


Names = Callable[[GgufFile], "dict[str, Stored | Derived]"]  # a family's names for a file's tensors


def own_names(file: GgufFile) -> dict[str, Stored | Derived]:
    """Every tensor under its GGUF name."""
    return {name: Stored(name) for name in file.tensors}


class GgufCheckpoint:
    def __init__(self, path: str | Path, names: Names | None = None):
        self.file = GgufFile(path)
        self.path = self.file.path
        self.dir = self.path.parent
        self.index = (names or own_names)(self.file)  # {name: the file's tensor, or the parts put together}
        self._infos: dict[str, TensorInfo] = {}
        for name, src in self.index.items():  # a type nothing here can read is named now, before any worker starts
            info = self.info(name)
            if info.dtype not in STORAGE:
                raw = self.raw(name)
                try:
                    block_float32(raw.reshape(-1, raw.shape[-1])[:1], info.dtype)
                except CheckpointError as exc:
                    raise GgufError(f"{info.file}: tensor {src.name} has type {info.dtype}: {exc}") from None

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def names(self) -> list[str]:
        return sorted(self.index)

    def _source(self, name: str) -> Stored | Derived:
        src = self.index.get(name)
        if src is None:
            raise CheckpointError(f"missing tensor {name!r} in {self.path}")
        return src

    def info(self, name: str) -> TensorInfo:
        info = self._infos.get(name)
        if info is None:
            src = self._source(name)
            if not isinstance(src, Stored):  # put together: float32, not in the file
                shape = src.shape(self.file)
                info = TensorInfo(name, "F32", shape, self.file.part(src.parts[0]), 0, 4 * math.prod(shape))
            else:
                part, t = self.file.tensors[src.name]
                info = TensorInfo(name, t.tensor_type.name, self.file.shape(src.name), part, int(t.data_offset),
                                  int(t.n_bytes))
            self._infos[name] = info
        return info

    def stored_type(self, name: str) -> str:
        """The type the file stores ``name`` in: a Derived tensor's parts' (so auto keeps it compact)."""
        src = self._source(name)
        return self.file.type_name(src.name if isinstance(src, Stored) else src.parts[0])

    def file_name(self, name: str) -> str:
        """The GGUF name of a tensor the file holds as it is read (a node worker's job names the experts so)."""
        src = self._source(name)
        if not isinstance(src, Stored) or src.heads is not None:
            raise CheckpointError(f"{self.path}: {name} is not read as the file stores it")
        return src.name

    def raw(self, name: str) -> np.ndarray:
        """Storage view (no copy): see the module's table."""
        info, src = self.info(name), self._source(name)
        if not isinstance(src, Stored):
            return src.float32(self.file)
        data = self.file.tensors[src.name][1].data
        if info.dtype in STORAGE:
            return data.view(STORAGE[info.dtype]).reshape(info.shape)
        values, nbytes = block_geometry(info.dtype)
        if info.shape[-1] % values:
            raise CheckpointError(f"{self.path}: tensor {name} ({info.dtype}) has rows of {info.shape[-1]} values, "
                                  f"not whole {values}-value blocks")
        return data.view(np.uint8).reshape(*info.shape[:-1], info.shape[-1] // values * nbytes)

    def float32(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """The tensor as float32 (permuted rows back in Hugging Face's order), in ``shape`` when given (a [1, H]
        gate that llama-quantize wrote as [H] read as [1, H])."""
        self.check_shape(name, shape)
        src = self._source(name)
        if not isinstance(src, Stored):
            out = src.float32(self.file)
        else:
            out = self.file.float32(src.name)
            out = out if src.heads is None else unpermute_qk(out, src.heads)
        return out if shape is None else out.reshape(shape)

    def check_shape(self, name: str, shape: tuple[int, ...] | None) -> None:
        """The tensor a float or block type of shape ``shape``, in either of the forms llama.cpp's tools write
        (checkpoint.ggml_dims); CheckpointError naming both shapes otherwise."""
        check_shape(self.info(name), shape, ggml=True)

    def stored_rows(self, name: str, rows: np.ndarray | None = None) -> np.ndarray | None:
        """A matrix's rows as the file stores them ([R, row bytes] of a block type; [R, K] of a float type) in the
        order float32 gives them (permuted rows put back), or only ``rows`` of them in that order; None for a
        tensor the file does not hold as rows (a Derived one)."""
        src = self._source(name)
        if not isinstance(src, Stored):
            return None
        raw = self.raw(name)
        raw = raw.reshape(raw.shape[0] if raw.ndim > 1 else 1, -1)
        if src.heads is not None:
            order = unpermute_qk(np.arange(raw.shape[0])[:, None], src.heads)[:, 0]
            rows = order if rows is None else order[rows]
        return raw if rows is None else raw[rows]

    def rows(self, name: str, start: int, stop: int, *, axis: int = 0) -> np.ndarray:
        info, src = self.info(name), self._source(name)
        if not isinstance(src, Stored) or src.heads is not None:  # put together or permuted: whole, then cut
            return np.ascontiguousarray(np.take(self.float32(name), range(start, stop), axis=axis))
        raw = self.raw(name)
        if info.dtype not in STORAGE and axis in (-1, raw.ndim - 1):
            raise CheckpointError(f"tensor {name} ({info.dtype}): its blocks run along the last axis; read whole rows")
        index = [slice(None)] * raw.ndim
        index[axis] = slice(start, stop)
        part = raw[tuple(index)]
        return to_float32(part, info.dtype) if info.dtype in STORAGE else block_float32(part, info.dtype)

    def digest(self) -> str:
        """Names the model: per part, its name, size, mtime and tensor table."""
        h = hashlib.sha256()
        for part in sorted({p for p, _ in self.file.tensors.values()} | {self.path}):
            stat = part.stat()
            h.update(f"{part.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
        h.update(json.dumps({n: [t.tensor_type.name, [int(x) for x in t.shape], int(t.data_offset)]
                             for n, (_, t) in sorted(self.file.tensors.items())}).encode())
        return h.hexdigest()[:16]

    def dtypes(self) -> set[str]:
        return {self.info(n).dtype for n in self.index}

    def close(self) -> None:
        self._infos.clear()
