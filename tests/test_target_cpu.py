"""Kernels compiled for a CPU other than the host's (numba's NUMBA_CPU_NAME and NUMBA_CPU_FEATURES, as for a
portable cache): they take the instructions of the CPU they are compiled for, not the host's. Before, an
AVX-512 host compiling for haswell emitted AVX-512 intrinsics into haswell code and LLVM stopped the process
("Cannot select")."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from numba.core import config

from node_worker.kernels.common import KernelTargetError, check_target, target_features

pytestmark = pytest.mark.slow  # kernels compiled cold for other CPUs, in processes of their own

ROOT = Path(__file__).resolve().parents[1]
HASWELL = "+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+f16c,+fma,+lzcnt,+movbe,+popcnt,+sse,+sse2,+sse3,+sse4.1," \
          "+sse4.2,+ssse3"  # the issue's AVX2 host: no AVX-512

# In the child: the choices the kernels made, and an integer-dot q8 decode and a bf16 prefill tile against float64.
CHILD = """
import json, numpy as np
from node_worker.kernels import bf16dp, idot, simd
from node_worker.kernels.activations import quantize_reference
from coordinator.host.packed import PackedMatrix
from shm import formats
rng = np.random.default_rng(0)
w = rng.standard_normal((64, 256)).astype(np.float32)
x = rng.standard_normal((5, 256)).astype(np.float32)
q8 = PackedMatrix.encode(w, formats.get("q8"), int_act=True)
xq, xd, _ = quantize_reference(x[:1])
want = (xq.reshape(1, 8, 32) * xd[..., None].astype(np.float64)).reshape(1, 256) @ q8.decoded().astype(np.float64).T
bf = PackedMatrix.encode(w, formats.get("bf16"))
want_bf = x.astype(np.float64) @ bf.decoded().astype(np.float64).T
error = lambda got, want: float(np.abs(got - want).max() / np.abs(want).max())
from node_worker.kernels import target_summary
print(json.dumps({"summary": target_summary(), "wide_tiles": simd.WIDE_TILES, "native_bf16": bf16dp.NATIVE,
                  "lowering": idot.host_lowering(),
                  "q8_error": error(x[:1] @ q8.T, want), "bf16_error": error(x @ bf.T, want_bf)}))
"""


def _run_child(tmp_path, cpu: str, features: str | None) -> subprocess.CompletedProcess:
    env = {**os.environ, "NUMBA_CPU_NAME": cpu, "NUMBA_CACHE_DIR": str(tmp_path)}
    env.pop("NUMBA_CPU_FEATURES", None)
    if features is not None:
        env["NUMBA_CPU_FEATURES"] = features  # generic: numba takes none
    return subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="haswell is an x86 CPU")
def test_kernels_compiled_for_an_avx2_cpu_take_its_instructions(tmp_path):
    done = _run_child(tmp_path, "haswell", HASWELL)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert (got["wide_tiles"], got["native_bf16"], got["lowering"]) == (False, False, "avx2")
    assert got["summary"] == ("kernels compiled for haswell (NUMBA_CPU_NAME): 256-bit tiles, vdpbf16ps no, "
                              "integer dots avx2")  # what strata bench prints
    assert got["q8_error"] <= 2e-6 and got["bf16_error"] <= 2e-6


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="F16C is an x86 feature")
def test_a_target_without_f16c_is_refused_with_what_to_set(tmp_path):
    """NUMBA_CPU_NAME=generic (numba's portable cache): a clear error, where LLVM stopped the process."""
    done = _run_child(tmp_path, "generic", None)
    assert done.returncode == 1 and "LLVM ERROR" not in done.stderr
    assert "KernelTargetError" in done.stderr and "without F16C" in done.stderr and "NUMBA_CPU_NAME" in done.stderr
    with pytest.raises(KernelTargetError, match="F16C"):
        check_target(frozenset({"avx2", "fma"}), "x86_64")
    check_target(frozenset({"avx2", "fma", "f16c"}), "x86_64")
    check_target(frozenset(), "aarch64")


def test_target_features_are_numbas_for_the_kernels(monkeypatch):
    monkeypatch.setattr(config, "CPU_FEATURES", "+avx2,-avx512f,+fma")
    assert target_features() == {"avx2", "fma"}  # only the features named with "+"
    monkeypatch.setattr(config, "CPU_FEATURES", "")
    assert target_features() == frozenset()  # NUMBA_CPU_NAME=generic
    monkeypatch.setattr(config, "CPU_FEATURES", None)
    from llvmlite import binding as llvm
    assert target_features() == {name for name, on in llvm.get_host_cpu_features().items() if on}
