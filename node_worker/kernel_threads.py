"""How numba's OpenMP threads wait between kernels: spin a while in the coordinator, sleep in node workers.

libgomp reads its wait settings once, when numba first launches a parallel kernel in the process, so this is
set on import (node_worker/kernels/common.py imports it before any kernel exists). A setting of the user's,
OMP_WAIT_POLICY or GOMP_SPINCOUNT, wins everywhere.

- The coordinator (and an in-process pool): GOMP_SPINCOUNT=SPIN_ROUNDS. A decode step launches some twenty
  kernels a few microseconds apart (attention's matrices, the MoE layer, the lm_head); a thread that went to
  sleep after each was woken by a futex that took 60-70 us on this 2-vCPU VM (an empty parallel loop: 70 us
  sleeping, 3 us spinning), and the small matrices' second thread started late (512 x 2048 Q4_K: 88 against
  43 us). 10 000 rounds is about 100 us by libgomp's own estimate (100 000 rounds a ms): the gaps of a
  decode step, and short beside a prefill's BLAS calls (OpenBLAS's threads sleep at once:
  coordinator/__init__.py).
- A node worker process: no spinning (GOMP_SPINCOUNT=0, worker_env). It is woken by its socket once per
  layer, and its spinning threads took the CPUs the coordinator's attention ran on next.

Measured on the Q4_K_M file (tools/vs_llama.py's model), 2 threads, decode step median ms, sleeping /
spinning 10 000, three alternating process pairs: 26.1 / 21.6, 27.0 / 22.0, 23.9 / 20.3; 64-token prefill
347 / 298, 358 / 314, 292 / 339 ms. With the workers spinning too, `strata bench --modes inproc,single,split`
read inproc 46.4 / 45.3 against 42.5 / 40.7 tok/s sleeping, but single and split no faster (0.87x inproc);
with the workers sleeping, single 41.1 / 43.4 against 36.6 / 39.3.
"""

from __future__ import annotations

import os

SPIN_ROUNDS = "10000"  # the coordinator's (about 100 us)
USER_SET = "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ

if not USER_SET:
    os.environ["GOMP_SPINCOUNT"] = SPIN_ROUNDS


def worker_env() -> dict[str, str]:
    """What a node worker's environment adds: its threads sleep at once unless the user chose otherwise."""
    return {} if USER_SET else {"GOMP_SPINCOUNT": "0"}
