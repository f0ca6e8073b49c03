"""A GGUF file (or split set) read as a Checkpoint: Hugging Face names, numpy shapes, storage views.

The engine, the expert stores and the node workers read a model through one
interface (shm/checkpoint.py's Checkpoint: names, info, raw, float32, rows,
digest). This module gives it for a GGUF file, on top of shm/gguf_file.py:

    name            the Hugging Face name (routed experts stacked: model.layers.{i}.mlp.experts.gate_proj
                    [E, I, H], .up_proj [E, I, H], .down_proj [E, H, I])
    info.dtype      F32, F16 and BF16 as safetensors names them; a block type by its ggml name (Q8_0, Q4_K, ...)
    raw(name)       a view of the mapped file: float32 / float16 / uint16 (BF16) [numpy shape]; a block type as
                    uint8 [*shape[:-1], bytes of a row] (each row's blocks, as the file has them)
    float32(name)   dequantised exactly as gguf.quants reads it (a Mixtral file's q and k rows un-permuted:
                    the converter interleaves each head's rotary halves for ggml's rope; a deepseek2 file's
                    kv_b_proj put back together from attn_k_b and attn_v_b, which the converter split)

Expert rows of a block type are handed to the stores as the file's bytes
(shm/expert_source.py), which repacks them without loss (shm/gguf_blocks.py)
when the store's format computes the same weights, so the node workers compute
with exactly the file's dequantised weights.

    gguf_path(path)     the .gguf file a model path names, or None (a Hugging Face folder)
    open_checkpoint(path)   GgufCheckpoint or Checkpoint, whichever the path is
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

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


class GgufCheckpoint:
    def __init__(self, path: str | Path):
        self.file = GgufFile(path)
        self.path = self.file.path
        self.dir = self.path.parent
        self.index = self.file.hf_names()  # {Hugging Face name: GGUF name}
        self._infos: dict[str, TensorInfo] = {}
        for name in self.index:  # a type nothing here can read is named now, before any worker starts
            info = self.info(name)
            if info.dtype not in STORAGE:
                raw = self.raw(name)
                try:
                    block_float32(raw.reshape(-1, raw.shape[-1])[:1], info.dtype)
                except CheckpointError as exc:
                    raise GgufError(f"{info.file}: tensor {self.index[name]} has type {info.dtype}: {exc}") from None

    def config(self) -> dict:
        """config.json's keys, from the file's metadata."""
        return self.file.config()

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def names(self) -> list[str]:
        return sorted(self.index)

    def info(self, name: str) -> TensorInfo:
        info = self._infos.get(name)
        if info is None:
            gname = self.index.get(name)
            if gname is None:
                raise CheckpointError(f"missing tensor {name!r} in {self.path}")
            if gname in self.file.joined:  # deepseek2's kv_b_proj, put back together: float32, not in the file
                shape = self.file.shape(gname)
                part = self.file.tensors[self.file.joined[gname][0]][0]
                info = self._infos[name] = TensorInfo(name, "F32", shape, part, 0, 4 * shape[0] * shape[1])
                return info
            part, t = self.file.tensors[gname]
            info = self._infos[name] = TensorInfo(name, t.tensor_type.name, self.file.shape(gname), part,
                                                  int(t.data_offset), int(t.n_bytes))
        return info

    def raw(self, name: str) -> np.ndarray:
        """Storage view (no copy): see the module's table."""
        info = self.info(name)
        if self.index[name] in self.file.joined:
            return self.file.float32(self.index[name])
        data = self.file.tensors[self.index[name]][1].data
        if info.dtype in STORAGE:
            return data.view(STORAGE[info.dtype]).reshape(info.shape)
        values, nbytes = block_geometry(info.dtype)
        if info.shape[-1] % values:
            raise CheckpointError(f"{self.path}: tensor {name} ({info.dtype}) has rows of {info.shape[-1]} values, "
                                  f"not whole {values}-value blocks")
        return data.view(np.uint8).reshape(*info.shape[:-1], info.shape[-1] // values * nbytes)

    def float32(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """The tensor as float32 (a Mixtral file's q and k rows back in Hugging Face's order), in ``shape`` when
        given (a [1, H] gate that llama-quantize wrote as [H] read as [1, H])."""
        self.check_shape(name, shape)
        out = self.file.float32(self.index[name])
        return out if shape is None else out.reshape(shape)

    def check_shape(self, name: str, shape: tuple[int, ...] | None) -> None:
        """The tensor a float or block type of shape ``shape``, in either of the forms llama.cpp's tools write
        (checkpoint.ggml_dims); CheckpointError naming both shapes otherwise."""
        check_shape(self.info(name), shape, ggml=True)

    def stored_rows(self, name: str, rows: np.ndarray | None = None) -> np.ndarray | None:
        """A matrix's rows as the file stores them ([R, row bytes] of a block type; [R, K] of a float type) in the
        order float32 gives them (a Mixtral file's q and k un-permuted), or only ``rows`` of them in that order;
        None for a tensor the file does not hold as rows (deepseek2's kv_b_proj, put back together)."""
        gname = self.index[name]
        if gname in self.file.joined:
            return None
        raw = self.raw(name)
        raw = raw.reshape(raw.shape[0] if raw.ndim > 1 else 1, -1)
        order = self.file.row_order(gname)
        if order is not None:
            rows = order if rows is None else order[rows]
        return raw if rows is None else raw[rows]

    def rows(self, name: str, start: int, stop: int, *, axis: int = 0) -> np.ndarray:
        info = self.info(name)
        if self.file.qk_heads(self.index[name]) is not None or self.index[name] in self.file.joined:
            # permuted rows, or kv_b_proj put back together: whole, then cut
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
