"""How numba's OpenMP threads wait: spin a while after each kernel, and sleep on the pool's doorbells together.

libgomp reads its wait settings once, when numba first launches a parallel kernel in the process, so this is
set before the first kernel (Engine.open calls settle with engine.runs_decode_kernels): the first engine opened
in a process chooses (strata bench's modes share the first one's), and a process that opens none spins
SPIN_ROUNDS where its entry point set it (shm/threads_env.py). A setting of the user's, OMP_WAIT_POLICY or
GOMP_SPINCOUNT, wins everywhere.

- A coordinator that launches kernels itself on the decode path (an in-process pool's MoE layers, or the dense
  matrices kept quantised on a CPU device side): GOMP_SPINCOUNT=SPIN_ROUNDS (settle, at the first
  Engine.open). A decode step launches some twenty kernels a few microseconds apart (attention's matrices,
  the MoE layer, the lm_head); a thread that went to sleep after each would be woken by a futex, which costs
  many times a spinning thread's wake, and the small matrices' second thread would start late. 10 000
  rounds is about 100 us by libgomp's own estimate (100 000 rounds a ms): the gaps of a decode step, and
  short beside a prefill's BLAS calls (OpenBLAS's threads sleep at once: shm/threads_env.py).
- A coordinator whose experts are in worker processes and whose dense matrices are float32 (BLAS): no
  spinning. Its few kernels gain nothing from it, and its spinning thread would take a CPU from the worker it
  has just woken.
- A node worker process whose experts are in an integer format (q8, q4, a GGUF file's blocks): SPIN_ROUNDS
  too (worker_env), and it waits for the next layer with its whole team asleep on its doorbell (team_size;
  shm/doorbell.wait_ring_team), as a coordinator with kernels of its own waits for the partials
  (ProcessPool.kernel_team): one ring wakes every thread at once and the layer's kernel finds them awake. The
  worker's answer, its sleep and the coordinator's ring follow the kernel in the same compiled call
  (node_worker/answer.py), so its threads stop spinning before the coordinator wakes. With GOMP_SPINCOUNT=0
  the second thread would come one libgomp wake late for each layer.
- A node worker whose experts are all f32 or bf16 (MEMORY_BOUND): its threads sleep at once, the worker
  alone on its doorbell. Its layer reads at memory speed, which one thread nearly reaches alone, so a team
  gains no compute, while waking a team of two costs more on the way to the worker: with as many CPUs as
  threads the worker's second thread waits for the CPU the coordinator rang from.
"""

from __future__ import annotations

import os
import threading

from shm import formats
from shm.threads_env import SPIN_ROUNDS, USER_SET

_settled = False


def settle(coordinator_kernels: bool) -> str | None:
    """This process's spin, chosen once (the first call; before its first kernel), unless the user set one:
    SPIN_ROUNDS when the coordinator launches kernels on the decode path, else 0. Returns the setting."""
    global _settled
    if not _settled and not USER_SET:
        os.environ["GOMP_SPINCOUNT"] = SPIN_ROUNDS if coordinator_kernels else "0"
    _settled = True
    return os.environ.get("GOMP_SPINCOUNT")


MEMORY_BOUND = ("f32", "bf16")  # expert formats whose layer reads at memory speed with one thread as well


def worker_env(stored: formats.ExpertFormats) -> dict[str, str]:
    """What a node worker's environment adds, unless the user chose: for experts in an integer format its
    threads spin SPIN_ROUNDS after a kernel and sleep as a team between layers (team_size); for experts all in
    MEMORY_BOUND formats they sleep at once (GOMP_SPINCOUNT=0), the worker alone on its doorbell."""
    if USER_SET:
        return {}
    return {"GOMP_SPINCOUNT": "0" if set(stored.names) <= set(MEMORY_BOUND) else SPIN_ROUNDS}


def spinning() -> bool:
    """Whether numba's threads spin after a kernel in this process (GOMP_SPINCOUNT as settle or the user left it,
    no passive wait policy), so that the next kernel finds them awake."""
    return os.environ.get("GOMP_SPINCOUNT") != "0" and os.environ.get("OMP_WAIT_POLICY", "").lower() != "passive"


def team_size() -> int:
    """How many of numba's threads should sleep on a doorbell with the caller: all of this thread's team when
    they spin after a kernel (else they would spin on while the process waits, on CPUs another process needs,
    and wake one by one for the next kernel), else the caller alone."""
    if not spinning():
        return 1
    import numba

    return numba.get_num_threads()


_SET = threading.local()  # .threads: the numba thread count use() last set on this thread (gone with the thread)


def use(threads: int) -> None:
    """numba's thread count on the calling thread (numba keeps one a thread) set to ``threads``, skipped where
    this function set it so already: numba.set_num_threads costs about a microsecond, and a decode step asks
    for its node's team at every MoE layer. Every setter of the project's goes through here (a node's layer
    arguments, its STREAM read, the host's MoE block), so what it remembers is what numba holds."""
    if getattr(_SET, "threads", None) != threads:
        import numba

        numba.set_num_threads(threads)
        _SET.threads = threads
