"""The coordinator's packed dense matrices sit in memory advised for transparent huge pages (shm/huge_pages.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from coordinator.host.packed import PackedMatrix
from shm import formats
from shm.huge_pages import HUGE_PAGE, advised_copy, advised_empty

pytestmark = [
    pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="no /proc/self/smaps (not Linux)"),
    pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage").exists(),
                       reason="a kernel without transparent huge pages: the advice does not exist"),
]


def vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds ``address`` in this process ("hg": advised MADV_HUGEPAGE)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def test_large_arrays_start_on_a_huge_page_advised_for_huge_pages():
    a = advised_empty(3 * HUGE_PAGE + 5)
    assert a.dtype == np.uint8 and a.shape == (3 * HUGE_PAGE + 5,) and a.flags.writeable
    assert a.ctypes.data % HUGE_PAGE == 0
    assert "hg" in vm_flags(a.ctypes.data) and "hg" in vm_flags(a.ctypes.data + a.nbytes - 1)
    assert "sh" not in vm_flags(a.ctypes.data)  # private: shared anonymous memory would follow shmem_enabled
    assert a.base is not None and advised_empty(HUGE_PAGE - 1).base is None  # under one huge page: np.empty's
    src = np.random.default_rng(0).standard_normal((600, 1024)).astype(np.float32)
    copy = advised_copy(src)
    assert np.array_equal(copy.view(np.float32).reshape(src.shape), src)
    assert "hg" in vm_flags(copy.ctypes.data)


def test_packed_matrices_are_in_advised_memory_and_unchanged():
    w = (np.random.default_rng(1).standard_normal((1024, 2048)) * 0.02).astype(np.float32)
    packed = PackedMatrix.encode(w, formats.get("q8"))
    assert packed.data.nbytes >= HUGE_PAGE and "hg" in vm_flags(packed.data.ctypes.data)
    x = np.random.default_rng(2).standard_normal((3, 2048)).astype(np.float32)
    np.testing.assert_allclose(x @ packed.T, x @ packed.decoded().T, rtol=1e-4, atol=1e-4)
