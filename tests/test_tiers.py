"""The suite's tiers: ``./tools/test.sh --quick`` collects every test not marked slow, ``./tools/test.sh`` all of
them (tests/conftest.py marks the slow ones)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # two collections of the whole suite, in processes of their own


def collected(*args: str) -> set[str]:
    out = subprocess.run([str(REPO / "tools" / "test.sh"), *args, "-n", "0", "--collect-only", "-q", "-p", "no:cacheprovider"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return {line for line in out.stdout.splitlines() if "::" in line}


def test_the_quick_tier_is_the_suite_less_its_slow_tests():
    whole, quick = collected(), collected("--quick")
    marked = collected("-m", "slow")
    assert quick and marked and quick == whole - marked
    assert not {t for t in quick if t.startswith("tests/test_server.py")}  # a module marked slow
    first_run = {t.split("::")[1] for t in quick if t.startswith("tests/test_first_run.py")}
    assert "test_a_kernel_set_generates_its_own_formats_loops_alone" in first_run  # in-process: quick
    assert "test_an_interrupted_compile_keeps_the_units_it_finished" not in first_run  # marked slow itself
    assert not {t for t in quick if "test_device_decoder.py" in t}  # the gpu fixture: slow, marked by conftest
    assert {t for t in quick if t.startswith("tests/test_cuda_emulator.py")}
