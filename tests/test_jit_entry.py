"""shm/jit_entry.py: a jitted function's entry point for one set of argument types, called without numba's
dispatch, and the decode rows of the packed matrices (coordinator/host/packed.py) that take it."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from numba import njit

from coordinator.host import ops as host_ops
from coordinator.host.packed import PackedMatrix, RowExactMatrix
from shm import formats
from shm.jit_entry import entry_point

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from kernel_bench import stored_rows  # noqa: E402  (random rows of a format: encoded, or a GGUF type's blocks)

rng = np.random.default_rng(7)


@njit
def _scaled_sum(x, k, out):
    for i in range(x.shape[0]):
        out[i] = x[i] * k


def test_the_entry_point_is_the_overload_for_the_arguments_types_and_computes_as_the_dispatcher_does():
    x, out, again = np.arange(5, dtype=np.float32), np.empty(5, np.float32), np.empty(5, np.float32)
    call = entry_point(_scaled_sum, (x, np.float32(3.0), out))  # compiled here: no call came first
    assert call is not _scaled_sum and call is next(iter(_scaled_sum.overloads.values())).entry_point
    call(x, np.float32(3.0), out)
    _scaled_sum(x, np.float32(3.0), again)
    assert np.array_equal(out, again) and np.array_equal(out, x * 3)
    assert entry_point(_scaled_sum, (x, np.float32(1.0), out)) is call  # the same types: the same overload


def test_a_packed_matrix_decode_row_is_the_bound_entry_points_and_the_products_result():
    """matmul_t of one float32 row binds the one-row loop's entry point (not the dispatcher) with the matrix's
    arguments, and gives the bits of the same loop through numba's dispatch (_product, T = 1)."""
    for fmt, int_act in (("f32", False), ("q8", True), ("q4k", True)):
        m = PackedMatrix(formats.get(fmt), stored_rows(formats.get(fmt), 64, 256, rng), (64, 256), int_act)
        x = rng.standard_normal((1, 256)).astype(np.float32)
        got = m.matmul_t(x)
        assert m._one_row is not None and type(m._one_row.func).__name__ == "builtin_function_or_method"
        assert np.array_equal(got, m._product(x, 1)) and np.array_equal(m.matmul_t(x), got)
    router = RowExactMatrix(rng.standard_normal((16, 256)).astype(np.float32))
    x = rng.standard_normal((1, 256)).astype(np.float32)
    got, want = router.matmul_t(x), np.empty((1, 16), np.float32)
    host_ops.linear_rows(x, router.wt, want)
    assert router._one_row is not None and np.array_equal(got, want)
