"""One record per storage format: what every site that depends on a format reads (llama.cpp's type_traits).

    name         the format's name: --expert-dtype / --dense-dtype, ExpertFormats' spec strings, a segment's kind
    id           its number in the kernels' tables (an expert's SHAPE format columns, the loops' switch); fixed
    block        weights a block along the row (1: none; the plan's slices and the hidden size are multiples)
    block_bytes  a block's bytes, its scales included
    ggml         the GGUF block type it holds byte for byte (None: it is made from float weights)
    exact_from   the checkpoint types it stores exactly, which ``auto`` picks it for (F16 widens to f32 exactly)
    integer      its integer-product loop with int8 activations: "block" (per 32: isimd.py, iblock.py),
                 "super" (super-blocks of 256: isuper.py), or None (float loops only)
    streams      one token's four rows are read as four streams (simd.dot4s), not prefetched (bf16)
    wide         four or six rows a tile on hosts with 512-bit vectors (simd.dot4r4, dot6r4)

Adding a format is one record here, its reader (shm/formats/<name>.py: row_bytes, encode_into, decode_into
and the layout drawing) and its dot product (node_worker/kernels/<name>.py: the loops' block or group
readers); the kernels' tables, the CLI's choices and ``auto``'s choice follow from the record.

The kernels also have a loop that is not a storage format: BF16_PRODUCTS (bf16dp), bf16 rows by bf16
activations, numbered after the formats (LOOP_IDS).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FormatTraits:
    name: str
    id: int
    block: int
    block_bytes: int
    ggml: str | None = None
    exact_from: tuple[str, ...] = ()
    integer: str | None = None
    streams: bool = False
    wide: bool = False

    @property
    def from_floats(self) -> bool:
        """Whether float weights are converted to it (a file format holds only its GGUF type's blocks)."""
        return self.ggml is None

    @property
    def bytes_per_weight(self) -> float:
        return self.block_bytes / self.block


TRAITS: tuple[FormatTraits, ...] = (
    FormatTraits("f32", 0, 1, 4, exact_from=("F32", "F16"), wide=True),
    FormatTraits("bf16", 1, 1, 2, exact_from=("BF16",), streams=True, wide=True),
    FormatTraits("q8", 2, 32, 34, exact_from=("Q8_0",), integer="block"),
    FormatTraits("q4", 3, 32, 18, exact_from=("Q4_0",), integer="block"),
    FormatTraits("q4k", 4, 256, 144, ggml="Q4_K", exact_from=("Q4_K",), integer="super"),
    FormatTraits("q5k", 5, 256, 176, ggml="Q5_K", exact_from=("Q5_K",), integer="super"),
    FormatTraits("q6k", 6, 256, 210, ggml="Q6_K", exact_from=("Q6_K",), integer="super"),
    FormatTraits("iq4xs", 7, 256, 136, ggml="IQ4_XS", exact_from=("IQ4_XS",), integer="super"),
)
BY_NAME: dict[str, FormatTraits] = {t.name: t for t in TRAITS}

BF16_PRODUCTS = "bf16dp"  # the kernels' loop for bf16 rows by bf16 activations (EngineConfig.activations bf16)
LOOP_IDS: dict[str, int] = {**{t.name: t.id for t in TRAITS}, BF16_PRODUCTS: len(TRAITS)}  # every kernel loop
STREAM_LOOPS = tuple(t.name for t in TRAITS if t.streams) + (BF16_PRODUCTS,)  # bf16dp reads bf16's rows
WIDE_LOOPS = tuple(t.name for t in TRAITS if t.wide) + (BF16_PRODUCTS,)
BLOCK_INT_LOOPS = tuple(t.name for t in TRAITS if t.integer == "block")
SUPER_INT_LOOPS = tuple(t.name for t in TRAITS if t.integer == "super")
INT_LOOPS = BLOCK_INT_LOOPS + SUPER_INT_LOOPS
EXACT: dict[str, str] = {dtype: t.name for t in TRAITS for dtype in t.exact_from}  # checkpoint type -> format

assert [t.id for t in TRAITS] == list(range(len(TRAITS))), "ids number the records in order"
