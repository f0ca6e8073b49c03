"""Tasks handed out one at a time: an atomic counter the threads of a parallel loop take the next task from.

numba's prange splits its range into one run of consecutive iterations a thread (static). Where the tasks
differ in size, as a prefill's expert groups do, one thread's run can hold more of the work than another's
and the others wait at the loop's end. numba's dynamic schedule (parallel_chunksize) cannot be used here: a
kernel that sets it is not kept in the disk cache (numba 0.68: set inside the kernel, "uses dynamic globals",
as a kernel that asked numba.get_num_threads and get_thread_id was; as a with-block, the save fails). So the
loop takes its tasks itself, knowing nothing of the threads:

    counter = np.zeros(1, np.int64)
    for _ in prange(n_tasks):                       # a thread's first iteration takes tasks until none is
        i = take(counter, 0)                        # left (0, 1, 2, ... across all the threads, each value
        while i < n_tasks:                          # once); its other iterations find none
            ...task i...
            i = take(counter, 0)
"""

from __future__ import annotations

from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def take(typingctx, counter, index):
    """counter[index] += 1 atomically (counter: int64 array); returns the value before."""
    sig = types.int64(counter, index)

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        index = context.cast(builder, args[1], signature.args[1], types.intp)
        ptr = cgutils.get_item_pointer(context, builder, signature.args[0], ary, [index])
        return builder.atomic_rmw("add", ptr, context.get_constant(types.int64, 1), "monotonic")

    return sig, codegen
