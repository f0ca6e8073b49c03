"""The STREAM-style read (node_worker/membw.py): its sum is the array's, and its loop is vectorised with
independent accumulators (how fast it reads is the bench's to say: `strata bench` prints NumPy's sum beside it)."""

from __future__ import annotations

import numpy as np
from numba import njit

from node_worker import membw


def test_the_read_sums_every_value_of_every_chunk():
    """Two threads' chunks, the last one short and ending off a loop step: the exact sum of small integers."""
    n = membw.CHUNK + 3 * membw.STEP + 17
    data = (np.arange(n) % 7).astype(np.float32)
    assert membw.read(data) == float(data.astype(np.int64).sum())
    assert membw.read(data[:membw.STEP - 1]) == float(data[:membw.STEP - 1].astype(np.int64).sum())  # no step


@njit
def _block(data, n):
    return membw.block_sum(data, 0, n)


def test_a_chunk_is_read_by_independent_vector_accumulators():
    """block_sum's loop adds whole vectors into ACCUMULATORS separate registers (not one scalar chain): its
    machine code adds packed floats (vaddps) in at least that many distinct vector registers."""
    import re

    data = np.ones(4 * membw.STEP, np.float32)
    assert _block(data, data.size) == data.size
    assert _block(data, data.size - 1) == data.size - membw.STEP  # the last, partial step is the caller's
    asm = _block.inspect_asm(_block.signatures[0])
    adds = re.findall(r"vaddps\s+[^\n]*?%?([xyz]mm\d+)\s*$", asm, re.M)
    assert len(set(adds)) >= membw.ACCUMULATORS, adds
