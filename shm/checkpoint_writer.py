"""Writing Hugging Face safetensors checkpoints (single file or shards with an index).

Used by ``strata make-model`` and the tests. The writer is a few lines over the
file format (8-byte header length, JSON header padded to 8 bytes, raw data) so
it can write BF16 from numpy, which has no such dtype.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from .checkpoint import INDEX_NAME, SINGLE_NAME
from .progress import Progress

TAGS = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2")}


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> BF16 bit patterns (uint16), rounding to nearest even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    return ((bits + rounding) >> 16).astype(np.uint16)


def encode(x: np.ndarray, tag: str) -> np.ndarray:
    """A float array in the storage form of ``tag``."""
    if tag == "BF16":
        return f32_to_bf16(x)
    return np.ascontiguousarray(x, dtype=TAGS[tag])


def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]], metadata: dict[str, str] | None = None) -> None:
    """tensors: name -> (dtype tag, array already in storage form)."""
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, (tag, arr) in tensors.items():
        header[name] = {"dtype": tag, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, arr in tensors.values():
            f.write(np.ascontiguousarray(arr).tobytes())


def save_checkpoint(out_dir: Path, tensors: dict[str, np.ndarray], dtype: str = "F32",
                    max_shard_bytes: int | None = None) -> list[Path]:
    """Write float tensors as ``dtype``; shards plus model.safetensors.index.json past max_shard_bytes."""
    if dtype not in TAGS:
        raise ValueError(f"dtype {dtype!r} not one of {', '.join(TAGS)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    encoded = {name: (dtype, encode(arr, dtype)) for name, arr in tensors.items()}
    shards: list[dict[str, tuple[str, np.ndarray]]] = [{}]
    size = 0
    for name, item in encoded.items():
        if max_shard_bytes and shards[-1] and size + item[1].nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = item
        size += item[1].nbytes
    total = sum(arr.nbytes for _, arr in encoded.values())
    if len(shards) == 1:
        path = out_dir / SINGLE_NAME
        write_safetensors(path, shards[0])
        return [path]
    progress = Progress(total, f"writing {out_dir}")
    paths, weight_map = [], {}
    for k, shard in enumerate(shards, 1):
        path = out_dir / f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(path, shard)
        progress.add(sum(arr.nbytes for _, arr in shard.values()))
        paths.append(path)
        weight_map.update({name: path.name for name in shard})
    progress.finish()
    (out_dir / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return paths
