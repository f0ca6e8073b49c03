"""Expert storage formats: how one row of an expert matrix is laid out in a node's store.

Every expert matrix is stored as rows: gate and up [R, H] (H weights along the
hidden axis), down [H, R] (W_down's columns of the node's slice: R weights
along the intermediate axis, padded with zeros to whole blocks). Every
format's blocks run along the row, so the plan's slices (multiples of 32 rows)
fall on block boundaries, and H must be a multiple of the format's block.

    f32    4 bytes a weight: float32, as today                         (f32.py)
    bf16   2 bytes a weight: bfloat16, the top half of a float32       (bf16.py)
    q8     1.0625 bytes a weight: int8 values, one f16 scale per 32     (q8.py)
    q4     0.5625 bytes a weight: 4-bit values, one f16 scale per 32    (q4.py)

and a GGUF file's block types kept as the file has them (blocks of 256 along
the row; filled only by copying the file's rows, never quantised from floats):

    q4k    0.5625 bytes a weight: Q4_K                                 (q4k.py)
    q5k    0.6875 bytes a weight: Q5_K                                 (q5k.py)
    q6k    0.8203 bytes a weight: Q6_K                                 (q6k.py)
    iq4xs  0.5313 bytes a weight: IQ4_XS                               (iq4xs.py)

Each format's record (name, id, block, bytes, GGUF type, loops) is traits.py's; its module (its reader) has
TRAITS, NAME, BLOCK, ``row_bytes(H)``, ``encode_into(dest, src)``
(float32 rows -> stored rows, at fill) and ``decode_into(dest, src)`` (stored
rows -> float32, exactly the weights the kernels compute with). Stored rows are
an array [R, row_bytes(H)] of uint8 (float32 and uint16 views for f32, bf16).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar
from types import ModuleType

import numpy as np

from importlib import import_module

from . import traits
from .traits import TRAITS

READERS: dict[str, ModuleType] = {t.name: import_module(f"{__name__}.{t.name}") for t in TRAITS}  # name -> reader
FORMATS: dict[str, ModuleType] = {t.name: READERS[t.name] for t in TRAITS if t.from_floats}  # made from floats too
FILE_FORMATS: dict[str, ModuleType] = {t.name: READERS[t.name] for t in TRAITS if not t.from_floats}  # a file's
f32 = READERS["f32"]
AUTO = "auto"


class FormatError(ValueError):
    """An expert format that does not exist or does not fit the model."""


def get(name: str) -> ModuleType:
    try:
        return FORMATS.get(name) or FILE_FORMATS[name]
    except KeyError:
        raise FormatError(f"expert format {name!r} is not known; expected one of "
                          f"{', '.join([*FORMATS, *FILE_FORMATS])}") from None


def resolve(name: str, checkpoint_dtype: str, hidden: int) -> ModuleType:
    """The format to store experts in. ``auto`` keeps the checkpoint's weights exactly in the fewest bytes:
    bf16 for a BF16 checkpoint, f32 for F16 and F32 ones (bf16 would round F16's mantissa), q8, q4, q4k,
    q5k, q6k and iq4xs for a GGUF file's Q8_0, Q4_0, Q4_K, Q5_K, Q6_K and IQ4_XS blocks (shm/gguf_blocks.py);
    another GGUF block type needs a chosen format. A file format (q4k, ...) holds only its own GGUF type."""
    if name == AUTO:
        from ..checkpoint import is_block_dtype

        # a float type: the format that holds it exactly (F16 widens to f32; FP8 is held as f32 too)
        name = traits.EXACT.get(checkpoint_dtype, None if is_block_dtype(checkpoint_dtype) else "f32")
        if name is None:
            raise FormatError(f"the experts are {checkpoint_dtype} blocks, which no store format holds exactly yet: "
                              f"choose --expert-dtype ({', '.join(FORMATS)}) to convert them (a second rounding)")
    fmt = get(name)
    if name in FILE_FORMATS and checkpoint_dtype != fmt.GGML:
        raise FormatError(f"expert format {name} holds a GGUF file's {fmt.GGML} blocks as they are; these experts "
                          f"are {checkpoint_dtype}: choose one of {', '.join(FORMATS)} (or auto)")
    if hidden % fmt.BLOCK:
        raise FormatError(f"expert format {name} stores blocks of {fmt.BLOCK} weights along the hidden axis; "
                          f"this model's hidden size {hidden} is not a multiple of {fmt.BLOCK}")
    return fmt


Triple = tuple[str, str, str]  # the formats of an expert's (gate, up, down)


@dataclass(frozen=True)
class ExpertFormats:
    """How every MoE layer's expert matrices are stored: one (gate, up, down) triple of format names for all
    layers, with the layers that differ listed (a GGUF file keeps each tensor's own type: a Q4_K_M file has
    Q6_K down matrices in some layers). Written as a spec string, in the worker job and the segment's kind:

        q8                              every matrix q8
        q4k/q4k/q6k                     every layer: gate q4k, up q4k, down q6k
        q4k/q4k/q4k;0=q4k/q4k/q6k;7=... the first triple, but layer 0 (and 7, ...) as given
    """

    default: Triple
    layers: tuple[tuple[int, Triple], ...] = ()  # (layer, triple) where it differs from the default, by layer

    F32: ClassVar["ExpertFormats"]  # every matrix f32 (set below)

    @classmethod
    def parse(cls, spec: str) -> "ExpertFormats":
        def triple(text: str) -> Triple:
            names = text.split("/")
            if len(names) == 1:
                names *= 3
            if len(names) != 3:
                raise FormatError(f"expert formats {spec!r}: {text!r} is not one format or gate/up/down formats")
            for n in names:
                get(n)
            return tuple(names)  # type: ignore[return-value]

        head, *rest = str(spec).split(";")
        layers = []
        for item in rest:
            layer, _, text = item.partition("=")
            if not layer.isdigit():
                raise FormatError(f"expert formats {spec!r}: {item!r} is not layer=formats")
            layers.append((int(layer), triple(text)))
        return cls(triple(head), tuple(sorted(layers)))

    @classmethod
    def of_layers(cls, triples: dict[int, Triple]) -> "ExpertFormats":
        """The triples of every layer, the most common one (the first of equals) as the default."""
        counts: dict[Triple, int] = {}
        for t in triples.values():
            counts[t] = counts.get(t, 0) + 1
        default = max(counts, key=counts.get) if counts else ("f32",) * 3
        return cls(default, tuple(sorted((l, t) for l, t in triples.items() if t != default)))

    @property
    def spec(self) -> str:
        def text(t: Triple) -> str:
            return t[0] if t[0] == t[1] == t[2] else "/".join(t)

        return ";".join([text(self.default), *(f"{l}={text(t)}" for l, t in self.layers)])

    def of(self, layer: int) -> Triple:
        return dict(self.layers).get(layer, self.default)

    @property
    def names(self) -> list[str]:
        return sorted({n for t in (self.default, *(t for _, t in self.layers)) for n in t})

    @property
    def down_block(self) -> int:
        """The largest block along W_down's rows: the plan cuts the intermediate axis on it."""
        return max(get(t[2]).BLOCK for t in (self.default, *(t for _, t in self.layers)))


ExpertFormats.F32 = ExpertFormats(("f32", "f32", "f32"))


def down_width(fmt: ModuleType, rows: int) -> int:
    """Weights in a stored row of W_down [H, R]: R rounded up to whole blocks (a slice that ends in a partial
    block, the last node's when the intermediate size is not a multiple of 32, is padded with zero weights,
    which the kernels multiply by zeros past R)."""
    return -(-rows // fmt.BLOCK) * fmt.BLOCK


def stored_view(fmt: ModuleType, raw: np.ndarray, rows: int, hidden: int) -> np.ndarray:
    """Bytes of a stored matrix -> its array view: [R, H] float32 (f32), [R, H] uint16 (bf16), [R, row_bytes] uint8."""
    return raw.view(fmt.STORED_DTYPE).reshape(rows, fmt.row_bytes(hidden) // np.dtype(fmt.STORED_DTYPE).itemsize)


def decoded(fmt: ModuleType, stored: np.ndarray) -> np.ndarray:
    """Stored rows -> float32 [R, H] (a view for f32, a new array otherwise)."""
    if fmt is f32:
        return stored
    out = np.empty((stored.shape[0], fmt.hidden_of(stored.shape[1])), np.float32)
    fmt.decode_into(out, stored)
    return out
