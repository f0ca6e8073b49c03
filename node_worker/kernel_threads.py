"""How numba's OpenMP threads wait: spin a while after each kernel, and sleep on the pool's doorbells together.

libgomp reads its wait settings once, when numba first launches a parallel kernel in the process, so this is
set before the first kernel (node_worker/kernels/common.py imports this module; Engine.open calls settle with
engine.runs_decode_kernels): the first engine opened in a process chooses (strata bench's modes share the
first one's), and a process that opens none spins SPIN_ROUNDS. A setting of the user's, OMP_WAIT_POLICY or
GOMP_SPINCOUNT, wins everywhere.

- A coordinator that launches kernels itself on the decode path (an in-process pool's MoE layers, or the dense
  matrices kept quantised on a CPU device side): GOMP_SPINCOUNT=SPIN_ROUNDS (settle, at the first
  Engine.open). A decode step launches some twenty kernels a few microseconds apart (attention's matrices,
  the MoE layer, the lm_head); a thread that went to sleep after each was woken by a futex that took 60-70 us
  on this 2-vCPU VM (an empty parallel loop: 70 us sleeping, 3 us spinning), and the small matrices' second
  thread started late (512 x 2048 Q4_K: 88 against 43 us). 10 000 rounds is about 100 us by libgomp's own
  estimate (100 000 rounds a ms): the gaps of a decode step, and short beside a prefill's BLAS calls
  (OpenBLAS's threads sleep at once: coordinator/__init__.py).
- A coordinator whose experts are in worker processes and whose dense matrices are float32 (BLAS): no
  spinning. Its few kernels gain nothing from it, and its spinning thread took a CPU from the worker it had
  just woken (`--preset deep`, f32, single: 18.5 / 18.7 tok/s spinning against 20.6 / 19.6 sleeping, the
  worker's compute a layer 487 against 357-405 us).
- A node worker process whose experts are in an integer format (q8, q4, a GGUF file's blocks): SPIN_ROUNDS
  too (worker_env), and it waits for the next layer with its whole team asleep on its doorbell (team_size;
  shm/doorbell.wait_ring_team), as a coordinator with kernels of its own waits for the partials
  (ProcessPool.kernel_team): one ring wakes every thread at once and the layer's kernel finds them awake. The
  worker's answer, its sleep and the coordinator's ring follow the kernel in the same compiled call
  (node_worker/answer.py), so its threads stop spinning before the coordinator wakes. Before (GOMP_SPINCOUNT=0,
  the second thread one libgomp wake late for each layer), measured with `strata bench --modes
  inproc,single,split --nodes 2 --rounds 2 --tokens 32 --prompt-tokens 64 --device cpu --quality-positions 0
  --expert-dtype q4 --dense-dtype q4 -m` the Qwen3-MoE geometry (4 layers), runs alternating with the code
  before: single's worker compute a layer 718 / 692 / 686 us against in-process 626 / 600 / 610 (+15 / +15
  / +12 %) before, 639 / 622 / 641 against 608 / 600 / 611 (+5 / +4 / +5 %) now; the layer's wall 894 / 896
  / 895 -> 857 / 776 / 866 us. With `--expert-dtype q4` (dense float32: the coordinator waits alone) compute
  +8 / +7 % -> +3 / +2 %, the wall 869 / 839 -> 833 / 891 us.
- A node worker whose experts are all f32 or bf16 (MEMORY_BOUND): its threads sleep at once, the worker
  alone on its doorbell. Its layer reads at memory speed, which one thread nearly reaches alone, so its
  compute was within 4 % of in-process either way (bf16 1912 / 1936 against 1870 / 1865 us; f32 2241 / 2162
  against 2256 / 2117), while waking a team of two cost 50-80 us a layer more on the way to the worker (f32:
  overhead 269 / 273 -> 327 / 333 us, decode 0.99 / 0.95 -> 0.90 / 0.92x in-process): on 2 vCPUs the
  worker's second thread waits for the CPU the coordinator rang from.

Measured on the Q4_K_M file (tools/vs_llama.py's model), 2 threads, decode step median ms, sleeping /
spinning 10 000, three alternating process pairs: 26.1 / 21.6, 27.0 / 22.0, 23.9 / 20.3; 64-token prefill
347 / 298, 358 / 314, 292 / 339 ms.
"""

from __future__ import annotations

import os

from shm import formats

SPIN_ROUNDS = "10000"  # the coordinator's (about 100 us)
USER_SET = "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ

_settled = False

if not USER_SET:
    os.environ["GOMP_SPINCOUNT"] = SPIN_ROUNDS


def settle(coordinator_kernels: bool) -> str | None:
    """This process's spin, chosen once (the first call; before its first kernel), unless the user set one:
    SPIN_ROUNDS when the coordinator launches kernels on the decode path, else 0. Returns the setting."""
    global _settled
    if not _settled and not USER_SET:
        os.environ["GOMP_SPINCOUNT"] = SPIN_ROUNDS if coordinator_kernels else "0"
    _settled = True
    return os.environ.get("GOMP_SPINCOUNT")


MEMORY_BOUND = ("f32", "bf16")  # expert formats whose layer reads at memory speed with one thread as well


def worker_env(expert_format: str) -> dict[str, str]:
    """What a node worker's environment adds, unless the user chose: for experts in an integer format its
    threads spin SPIN_ROUNDS after a kernel and sleep as a team between layers (team_size); for experts all in
    MEMORY_BOUND formats they sleep at once (GOMP_SPINCOUNT=0), the worker alone on its doorbell."""
    if USER_SET:
        return {}
    spec = formats.ExpertFormats.parse(expert_format)
    names = {n for triple in (spec.default, *(t for _, t in spec.layers)) for n in triple}
    return {"GOMP_SPINCOUNT": "0" if names <= set(MEMORY_BOUND) else SPIN_ROUNDS}


def team_size() -> int:
    """How many of numba's threads should sleep on a doorbell with the caller: all of this thread's team when
    they spin after a kernel (else they would spin on while the process waits, on CPUs another process needs,
    and wake one by one for the next kernel), else the caller alone."""
    if os.environ.get("GOMP_SPINCOUNT") == "0" or os.environ.get("OMP_WAIT_POLICY", "").lower() == "passive":
        return 1
    import numba

    return numba.get_num_threads()
