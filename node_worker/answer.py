"""A node worker's answer to one request of the data path, and its sleep until the next, in one compiled call.

After the layer's kernel (kernels/layer.py) the partial is in the pool segment; this publishes it (the
node's line: status, compute time, bytes, stamps, then the done sequence number with a release store) and
puts every one of numba's threads to sleep on the node's doorbell, ringing the coordinator's from inside
that sleep (shm/doorbell.team_futex_wait). No Python runs between the kernel and the sleep, so the kernel's
threads never spin on while the coordinator wakes to sum the partials, and the next layer's ring wakes the
whole team at once, its threads spinning (node_worker/kernel_threads.py) when the next kernel starts.

    line     [8] int64    the node's line of the segment (shm/pool_io.py: NODE_*)
    bell     uint32 word  the node's doorbell, slept on while it holds ``seen``
    ring     [16] uint32  the coordinator's doorbell line, word 0 rung
"""

from __future__ import annotations

import numpy as np
from numba import njit

from shm.doorbell import monotonic_ns, store_release, team_futex_wait
from shm.pool_io import NODE_BYTES, NODE_COMPUTE_NS, NODE_DONE, NODE_RECEIVED_NS, NODE_SENT_NS, NODE_STATUS, STATUS_OK

from .kernels.common import JIT
from .kernels.layer import layer_moe, sample_args


@njit(**JIT)
def compute_answer_sleep(ks, data, hidden, x, tokens, experts, weights, offsets, shapes, y,  # layer_moe's
                         line, seq, received_ns, started_ns, ring, bell_address, seen, timespec_address, threads):
    """Compute, publish and sleep; returns the layer's expert bytes, or layer_moe's -1 (nothing published,
    no sleep: the caller answers with the error)."""
    nbytes = layer_moe(ks, data, hidden, x, tokens, experts, weights, offsets, shapes, y)
    if nbytes < 0:
        return nbytes
    sent = monotonic_ns()
    line[NODE_STATUS] = STATUS_OK
    line[NODE_COMPUTE_NS] = sent - started_ns
    line[NODE_BYTES] = nbytes
    line[NODE_RECEIVED_NS] = received_ns
    line[NODE_SENT_NS] = sent
    store_release(line, NODE_DONE, np.int64(seq))
    team_futex_wait(bell_address, seen, timespec_address, threads, ring, 0)
    return nbytes


def warm_up(ks) -> None:
    """Compile (or load from the disk cache) the kernel set ``ks``'s call before the first request: one tiny
    layer (kernels/layer.py's sample), its sleep over at once."""
    bell = np.zeros(1, np.uint32)
    ring = np.zeros(16, np.uint32)
    line = np.zeros(8, np.int64)
    timespec = np.zeros(2, np.int64)
    compute_answer_sleep(*sample_args(ks), line, 1, 0, 0, ring, bell.ctypes.data, 1, timespec.ctypes.data, 1)
    assert line[NODE_DONE] == 1 and ring[0] == 1
