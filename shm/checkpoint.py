"""Memory-mapped reading of Hugging Face safetensors checkpoints.

A checkpoint directory holds one ``model.safetensors`` or several shards named
by ``model.safetensors.index.json``. Every file is mapped once, read-only; a
tensor is a numpy view into the mapping, so taking a row slice reads only
those rows' pages. Conversion to float32 happens on the slice, never on the
whole file.

We parse the safetensors header ourselves instead of using
``safetensors.safe_open``: its numpy backend has no BF16 (numpy has no such
dtype) and it returns whole tensors, where the node workers need row slices.
The format is an 8-byte little-endian header length, a JSON header, then the
raw little-endian data.

FP8 tensors (``F8_E4M3`` with a ``<name>_scale_inv`` companion and config.json's
``quantization_config``, as DeepSeek-V3/R1 store them) are checked when the
checkpoint is opened and dequantised when read (shm/fp8.py): ``raw`` gives an
:class:`~shm.fp8.Fp8Matrix` window that converts to float32, so every reader
sees the float32 weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from . import fp8

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024

# safetensors dtype tag -> numpy storage dtype (BF16 is stored as raw uint16)
STORAGE_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
    fp8.DTYPE: np.dtype("u1"),  # float8 e4m3fn codes, dequantised with their block scales when read
}
FLOAT_DTYPES = ("F32", "F16", "BF16", fp8.DTYPE)


class CheckpointError(Exception):
    """A checkpoint file or tensor is missing, damaged or not what was expected."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors tag: "F32", "F16", "BF16", ...
    shape: tuple[int, ...]
    file: Path
    offset: int  # absolute byte offset in the file
    nbytes: int


def bf16_to_f32(raw_u16: np.ndarray) -> np.ndarray:
    """BF16 bit patterns (uint16) -> float32, exactly (BF16 is the top half of F32)."""
    return (raw_u16.astype(np.uint32) << 16).view(np.float32)


def to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """A raw storage view of a float tensor -> contiguous float32.

    F32 that is already contiguous comes back as the same read-only view of the
    file mapping (no copy); everything else is converted into a new array.
    """
    if dtype == "BF16":
        return bf16_to_f32(raw)
    if dtype in ("F32", "F16", "F64"):
        return np.ascontiguousarray(raw, dtype=np.float32)
    if dtype == fp8.DTYPE:
        if not isinstance(raw, fp8.Fp8Matrix):
            raise CheckpointError("F8_E4M3 codes need their block scales: read them through Checkpoint.raw")
        return np.ascontiguousarray(np.asarray(raw), dtype=np.float32)
    raise CheckpointError(f"dtype {dtype} is not a float type (expected one of {', '.join(FLOAT_DTYPES)})")


class SafetensorsFile:
    """One safetensors file, mapped read-only; tensors are views into the map."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot open: {exc.strerror}") from exc
        try:
            size = os.fstat(fd).st_size
            if size < 8:
                raise CheckpointError(f"{self.path}: {size} bytes is too short for a safetensors file")
            self._map = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self.size = size
        self.tensors, self.metadata = self._parse_header()

    def _parse_header(self) -> tuple[dict[str, TensorInfo], dict]:
        (header_len,) = struct.unpack("<Q", self._map[:8])
        if header_len > min(MAX_HEADER_BYTES, self.size - 8):
            raise CheckpointError(
                f"{self.path}: header length {header_len} exceeds the file ({self.size} bytes); "
                "the file is truncated or not safetensors"
            )
        try:
            header = json.loads(bytes(self._map[8 : 8 + header_len]))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{self.path}: header is not valid JSON: {exc}") from exc
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: header is not a JSON object")
        metadata = header.pop("__metadata__", {}) or {}
        data_start = 8 + header_len
        data_len = self.size - data_start
        tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            tensors[name] = self._tensor_info(name, entry, data_start, data_len)
        return tensors, metadata

    def _tensor_info(self, name: str, entry: object, data_start: int, data_len: int) -> TensorInfo:
        where = f"{self.path}: tensor {name!r}"
        try:
            dtype = entry["dtype"]  # type: ignore[index]
            shape = tuple(int(d) for d in entry["shape"])  # type: ignore[index]
            begin, end = (int(v) for v in entry["data_offsets"])  # type: ignore[index]
        except (TypeError, KeyError, ValueError) as exc:
            raise CheckpointError(f"{where}: malformed header entry {entry!r}") from exc
        if dtype not in STORAGE_DTYPES:
            raise CheckpointError(f"{where}: unsupported dtype {dtype}")
        if any(d < 0 for d in shape):
            raise CheckpointError(f"{where}: negative dimension in shape {shape}")
        expected = int(np.prod(shape, dtype=np.int64)) * STORAGE_DTYPES[dtype].itemsize
        if not 0 <= begin <= end <= data_len or end - begin != expected:
            raise CheckpointError(
                f"{where}: data_offsets [{begin}, {end}) do not hold {dtype}{list(shape)} "
                f"({expected} bytes) inside the {data_len}-byte data section; the file is truncated or damaged"
            )
        return TensorInfo(name, dtype, shape, self.path, data_start + begin, expected)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's storage as a read-only view (no copy)."""
        info = self.tensors[name]
        dt = STORAGE_DTYPES[info.dtype]
        count = info.nbytes // dt.itemsize
        return np.frombuffer(self._map, dtype=dt, count=count, offset=info.offset).reshape(info.shape)

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:
            # numpy views still reference the map; it is released with them.
            log.debug("keeping %s mapped: views still alive", self.path)


class Checkpoint:
    """All safetensors files of a checkpoint directory, as one name -> tensor table."""

    def __init__(self, model_dir: str | os.PathLike):
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.dir}: not a directory")
        self.files: dict[Path, SafetensorsFile] = {}
        self.index: dict[str, Path] = {}
        for path in self._shard_paths():
            st = SafetensorsFile(path)
            self.files[path] = st
            for name in st.tensors:
                if name in self.index:
                    raise CheckpointError(f"tensor {name!r} is stored twice: in {self.index[name]} and {path}")
                self.index[name] = path
        self._check_index_agrees()
        self.fp8_block: tuple[int, int] | None = None
        self._check_fp8()

    def _check_fp8(self) -> None:
        """Every F8_E4M3 tensor a matrix with its ``_scale_inv`` of the block grid config.json's
        quantization_config names; refused here, naming the file and tensor, before any worker starts."""
        quantised = sorted(n for n in self.index if self.info(n).dtype == fp8.DTYPE)
        if not quantised:
            return
        config = self.dir / "config.json"
        try:
            quant = json.loads(config.read_text()).get("quantization_config") if config.is_file() else None
        except (OSError, json.JSONDecodeError, AttributeError) as exc:
            raise CheckpointError(f"{config}: cannot read its quantization_config: {exc}") from None
        first = self.info(quantised[0])
        try:
            block = fp8.block_size(quant, str(config))
        except fp8.Fp8Error as exc:
            raise CheckpointError(f"{exc} (the checkpoint holds F8_E4M3 tensors: {first.file}: "
                                  f"{first.name!r})") from None
        if block is None:
            raise CheckpointError(f"{first.file}: tensor {first.name!r} is F8_E4M3, but {config} has no fp8 "
                                  "quantization_config (its weight_block_size gives the scales' blocks)")
        for name in quantised:
            info = self.info(name)
            scale_name = name + fp8.SCALE_SUFFIX
            where = f"{info.file}: tensor {name!r}"
            if len(info.shape) != 2:
                raise CheckpointError(f"{where} is F8_E4M3 with shape {list(info.shape)}; only matrices (2-D) "
                                      "are read as block-scaled FP8")
            if scale_name not in self.index:
                raise CheckpointError(f"{where} is F8_E4M3 but its scales {scale_name!r} are in no file of "
                                      f"{self.dir}")
            scale = self.info(scale_name)
            want = fp8.scale_shape(info.shape, block)
            if scale.dtype not in ("F32", "BF16", "F16") or tuple(scale.shape) != want:
                raise CheckpointError(
                    f"{scale.file}: tensor {scale_name!r} is {scale.dtype}{list(scale.shape)}; the scales of "
                    f"{name!r} {list(info.shape)} in blocks {list(block)} are float {list(want)}")
        self.fp8_block = block

    def _shard_paths(self) -> list[Path]:
        index_path = self.dir / INDEX_NAME
        if index_path.exists():
            weight_map = self._read_index(index_path)
            shards = sorted(set(weight_map.values()))
            missing = [s for s in shards if not (self.dir / s).is_file()]
            if missing:
                raise CheckpointError(f"{index_path}: names shard(s) that do not exist: {', '.join(missing)}")
            self._weight_map = weight_map
            return [self.dir / s for s in shards]
        self._weight_map = None
        paths = sorted(self.dir.glob("*.safetensors"))
        if not paths:
            raise CheckpointError(f"{self.dir}: no *.safetensors file and no {INDEX_NAME}")
        return paths

    @staticmethod
    def _read_index(index_path: Path) -> dict[str, str]:
        try:
            doc = json.loads(index_path.read_text())
            weight_map = doc["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index_path}: not a valid index (needs a 'weight_map' object): {exc}") from exc
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index_path}: 'weight_map' must map tensor names to file names")
        return weight_map

    def _check_index_agrees(self) -> None:
        if self._weight_map is None:
            return
        for name, shard in self._weight_map.items():
            actual = self.index.get(name)
            if actual is None:
                raise CheckpointError(f"{INDEX_NAME} lists tensor {name!r} in {shard}, but no shard holds it")
            if actual.name != shard:
                raise CheckpointError(f"{INDEX_NAME} lists tensor {name!r} in {shard}, but it is in {actual.name}")

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def names(self) -> list[str]:
        """The tensors, less the FP8 scales (read with the weight they scale)."""
        return sorted(n for n in self.index if not self._is_fp8_scale(n))

    def _is_fp8_scale(self, name: str) -> bool:
        weight = name[: -len(fp8.SCALE_SUFFIX)]
        return name.endswith(fp8.SCALE_SUFFIX) and weight in self.index and self.info(weight).dtype == fp8.DTYPE

    def info(self, name: str) -> TensorInfo:
        path = self.index.get(name)
        if path is None:
            raise CheckpointError(f"missing tensor {name!r} in {self.dir}")
        return self.files[path].tensors[name]

    def stored_type(self, name: str) -> str:
        """The type the files store ``name`` in (GgufCheckpoint's twin)."""
        return self.info(name).dtype

    def file_name(self, name: str) -> str:
        """The name the files hold ``name`` under: itself (GgufCheckpoint's twin)."""
        self.info(name)
        return name

    def raw(self, name: str) -> np.ndarray | fp8.Fp8Matrix:
        """Storage view (no copy) of a tensor; for an F8_E4M3 matrix, an Fp8Matrix over its codes (slices read
        nothing; ``np.asarray`` of one gives its float32 weights, the block scales applied)."""
        info = self.info(name)
        codes = self.files[self.index[name]].raw(name)
        if info.dtype != fp8.DTYPE:
            return codes
        scale_name = name + fp8.SCALE_SUFFIX
        scale = to_float32(self.raw(scale_name), self.info(scale_name).dtype)
        return fp8.Fp8Matrix(codes, scale, self.fp8_block)

    def float32(self, name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        """The whole tensor as float32 (a view for F32 files), its shape checked when given."""
        info = self.info(name)
        check_shape(info, shape)
        return to_float32(self.raw(name), info.dtype)

    def check_shape(self, name: str, shape: tuple[int, ...]) -> None:
        """The tensor's dtype a float type and its shape ``shape``, or CheckpointError naming both."""
        check_shape(self.info(name), shape)

    def stored_rows(self, name: str, rows: np.ndarray | None = None) -> np.ndarray | None:
        """A matrix's rows as stored ([R, K] of its dtype), or only ``rows`` of them in that order; None for an
        FP8 matrix (its rows are scaled per block)."""
        if self.info(name).dtype == fp8.DTYPE:
            return None
        raw = self.raw(name)
        return raw if rows is None else raw[rows]

    def rows(self, name: str, start: int, stop: int, *, axis: int = 0) -> np.ndarray:
        """Rows [start, stop) along ``axis`` as contiguous float32; reads only those rows."""
        info = self.info(name)
        raw = self.raw(name)
        index = [slice(None)] * raw.ndim
        index[axis] = slice(start, stop)
        return to_float32(raw[tuple(index)], info.dtype)

    def digest(self) -> str:
        """Names the model: config.json's bytes and, per file, its name, size, mtime and header."""
        h = hashlib.sha256()
        config = self.dir / "config.json"
        if config.is_file():
            h.update(config.read_bytes())
        for path, st in sorted(self.files.items()):
            stat = path.stat()
            h.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
            h.update(json.dumps({n: [t.dtype, t.shape, t.offset] for n, t in sorted(st.tensors.items())}).encode())
        return h.hexdigest()[:16]

    def dtypes(self) -> set[str]:
        return {self.info(n).dtype for n in self.index}

    def close(self) -> None:
        for st in self.files.values():
            st.close()


def is_block_dtype(dtype: str) -> bool:
    """A ggml block type (Q8_0, Q4_K, ...): a GGUF file's quantised tensor (shm/gguf_checkpoint.py)."""
    t = GGMLQuantizationType.__members__.get(dtype)
    return t is not None and GGML_QUANT_SIZES[t][0] > 1


def ggml_dims(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape as ggml writes it (ggml_n_dims: its trailing sizes of 1 dropped, here leading in numpy's order):
    llama-quantize writes a [1, H] tensor as [H]."""
    shape = tuple(int(n) for n in shape)
    while len(shape) > 1 and shape[0] == 1:
        shape = shape[1:]
    return shape


def check_shape(info: TensorInfo, shape: tuple[int, ...] | None, ggml: bool = False) -> None:
    """``info`` a float or block type of shape ``shape``; ``ggml``: a GGUF file's tensor, whose sizes of 1 in front
    llama.cpp's tools may have dropped or kept (ggml_dims), so either form is that shape."""
    if info.dtype not in FLOAT_DTYPES and not is_block_dtype(info.dtype):
        raise CheckpointError(
            f"tensor {info.name!r} has dtype {info.dtype}; expected one of {', '.join(FLOAT_DTYPES)} "
            "(or a ggml block type in a GGUF file)"
        )
    if shape is None or tuple(info.shape) == tuple(shape):
        return
    if not ggml or ggml_dims(info.shape) != ggml_dims(shape):
        raise CheckpointError(f"tensor {info.name!r} has shape {list(info.shape)}; expected {list(shape)}")
