"""A jitted function's compiled entry point for one set of argument types: calls that skip numba's dispatch.

numba's dispatcher types every argument of every call (typeof) and looks the types up among its compiled
overloads before it runs the code: half of a small matrix's one-row product (docs/benchmarks.md, "Kernel calls
through their entry point"), where a decode step calls the dense kernels some twenty times a token. A caller
whose arguments keep their types (a packed matrix's one-row product: its own arrays bound, a float32
C-contiguous row in and out) takes the entry point once and calls it directly. What costs is the kernel set's
type (kernel_set.KernelSet, typed in Python) and the count of arguments: a call of arrays and scalars alone is
typed in C, as fast as the entry point (host/ops.py's loops keep the dispatcher).

    entry_point(dispatcher, args) -> callable      the compiled code for args' types (loaded from numba's disk
                                                   cache or compiled, as a first call would); call it with
                                                   arguments of exactly those types
    entry_point(dispatcher, args, literal=(i, ...))
                                                   args[i] typed as its literal value: the code compiled for that
                                                   value alone, numba pruning the branches it rules out (a
                                                   matrix's loop kind in coordinator/host/blocks.py)
"""

from __future__ import annotations


from numba.core import types


def entry_point(dispatcher, args: tuple, literal: tuple = ()):
    """The entry point of ``dispatcher``'s overload for the types of ``args`` (Dispatcher.compile returns it,
    compiling or loading it first where this process has not yet); the positions in ``literal`` typed as their
    values."""
    return dispatcher.compile(tuple(types.literal(a) if i in literal else dispatcher.typeof_pyval(a)
                                    for i, a in enumerate(args)))
