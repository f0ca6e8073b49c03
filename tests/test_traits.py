"""The format traits table (shm/formats/traits.py) is what every format-dependent site reads: the readers, the
kernels' loops and their capability tables, the lossless GGUF mapping, the config's choices and the CLI's."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from coordinator.config import DENSE_DTYPES, EXPERT_DTYPES
from node_worker.kernels import isimd, isuper, loops, rows, simd
from shm import formats, gguf_blocks
from shm.formats import traits

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("record", traits.TRAITS, ids=lambda t: t.name)
def test_each_record_matches_its_reader_and_its_loops(record):
    reader = formats.get(record.name)
    H = 1024  # a multiple of every block
    assert (reader.NAME, reader.BLOCK) == (record.name, record.block)
    assert reader.row_bytes(H) == H // record.block * record.block_bytes
    assert reader.row_bytes(H) / H == reader.BYTES_PER_WEIGHT == record.bytes_per_weight
    assert rows.FORMAT_IDS[record.name] == record.id
    loop = loops.FORMATS[record.name]
    assert loop.BLOCK_BYTES == record.block_bytes * max(1, 32 // record.block)  # one loop step's bytes
    assert (record.id in rows.BLOCK_INT, record.id in rows.SUPER_INT) == (record.integer == "block",
                                                                          record.integer == "super")
    assert (record.id in rows.STREAMS, record.id in rows.WIDE) == (record.streams, record.wide)
    assert (record.name in isimd.BLOCK_FORMATS, record.name in isuper.SUPER_FORMATS) == (
        record.integer == "block", record.integer == "super")


@pytest.mark.parametrize("record", [t for t in traits.TRAITS if t.ggml], ids=lambda t: t.name)
def test_a_file_format_holds_its_ggml_blocks_byte_for_byte(record):
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[record.ggml]]
    assert (block, size) == (record.block, record.block_bytes)
    assert not record.from_floats and record.name in formats.FILE_FORMATS


def test_the_lossless_mapping_and_the_choices_come_from_the_table():
    assert {t.name: n for t, n in gguf_blocks.LOSSLESS.items()} == traits.EXACT
    assert EXPERT_DTYPES == (formats.AUTO, *(t.name for t in traits.TRAITS if t.from_floats),
                             *(t.name for t in traits.TRAITS if not t.from_floats))
    assert set(DENSE_DTYPES) == {formats.AUTO} | {t.name for t in traits.TRAITS if t.from_floats}
    assert list(rows.FORMAT_IDS) == [t.name for t in traits.TRAITS] + [traits.BF16_PRODUCTS]
    assert list(loops.FORMATS) == list(rows.FORMAT_IDS)
    assert set(simd.WIDE_FORMATS) == set(traits.WIDE_LOOPS) and set(simd.STREAM_FORMATS) == set(traits.STREAM_LOOPS)


@pytest.mark.parametrize("checkpoint_dtype, chosen", [("BF16", "bf16"), ("F16", "f32"), ("F32", "f32"),
                                                       ("Q8_0", "q8"), ("Q4_K", "q4k"), ("IQ4_XS", "iq4xs")])
def test_auto_picks_the_format_that_holds_the_checkpoint_exactly(checkpoint_dtype, chosen):
    assert formats.resolve("auto", checkpoint_dtype, 1024).NAME == chosen


def test_auto_refuses_a_block_type_no_format_holds():
    with pytest.raises(formats.FormatError, match="Q5_0 blocks, which no store format holds exactly"):
        formats.resolve("auto", "Q5_0", 1024)


def test_bf16_products_take_bf16s_streams_and_wide_tiles_but_not_six_rows():
    assert rows.BF16DP in rows.STREAMS and rows.BF16DP in rows.WIDE and rows.BF16DP not in rows.SIX_ROWS


def test_no_site_probes_a_format_module_for_its_capabilities():
    """Capabilities are read from the records, never guessed from what a module defines (hasattr)."""
    hits = []
    for path in [*(REPO / "node_worker").rglob("*.py"), *(REPO / "shm").rglob("*.py"), *(REPO / "coordinator").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "hasattr" and len(node.args) == 2
                    and isinstance(node.args[1], ast.Constant) and node.args[1].value in {"igroup", "isuper", "GGML"}):
                hits.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert hits == []
