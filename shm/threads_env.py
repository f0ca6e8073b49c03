"""The thread settings of a strata process, which its entry point sets (``apply``) before NumPy or numba load.

- OPENBLAS_THREAD_TIMEOUT=4: OpenBLAS's idle threads spin for 2**28 rounds after each call (its default) on
  the CPUs that numba's kernels take next, slowing the MoE layer that follows the attention's BLAS calls;
  2**4 rounds (the least OpenBLAS takes) puts them to sleep at once. OpenBLAS reads it when NumPy loads it.
- GOMP_SPINCOUNT=SPIN_ROUNDS: numba's OpenMP threads spin a while after each kernel; libgomp reads it when
  the first parallel kernel runs, and node_worker/kernel_threads.py settles it per process before that.

A setting of the user's wins: ``USER_SET`` records, when this module is first imported, whether the user
chose libgomp's wait (OMP_WAIT_POLICY or GOMP_SPINCOUNT). The entry points call ``apply`` first thing: the
``strata`` command (coordinator/cli/entry.py), the kernel compile (python -m coordinator.warmup) and the
node workers (node_worker/proc.py). Importing the packages sets nothing; a program that uses the library
calls ``apply`` before it imports NumPy to run as the command does.
"""

from __future__ import annotations

import os

SPIN_ROUNDS = "10000"  # libgomp's rounds after a kernel (about 100 us by its own estimate)
OPENBLAS_TIMEOUT = "4"  # OpenBLAS's least: its idle threads sleep at once
USER_SET = "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ


def apply() -> dict[str, str]:
    """Set this process's thread variables where the user has not; returns the ones set now."""
    wanted = {"OPENBLAS_THREAD_TIMEOUT": OPENBLAS_TIMEOUT}
    if not USER_SET:
        wanted["GOMP_SPINCOUNT"] = SPIN_ROUNDS
    set_now = {name: value for name, value in wanted.items() if name not in os.environ}
    os.environ.update(set_now)
    return set_now
