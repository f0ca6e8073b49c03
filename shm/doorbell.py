"""Waking another process through a word of shared memory: atomics and the Linux futex.

A doorbell is a 32-bit counter in a shared mapping. The ringer bumps it
atomically and wakes whoever sleeps on it; a sleeper reads the count, checks
its condition, and sleeps only while the count is still what it read (so a ring
between the check and the sleep is never lost). Both sides may spin on the
condition first (``spin_s``), giving the CPU to a thread ready to run on it
at each round (``spin_pause``); sleeping is a futex wait on the word, woken by
the kernel directly, a round trip between two processes an order of magnitude
faster than a ZeroMQ ipc one.

The loads and stores of the sequence numbers that say "the data is written"
are acquire/release atomics (LLVM's, through numba), so the data written
before a release store is seen by the reader of that store on any CPU, not
only on x86's ordered stores.

A process whose compiled kernels run on numba's OpenMP threads can sleep on a
doorbell with all of them (``wait_ring_team``): each thread of the team waits
on the word itself, so one ring wakes them together, and the kernel launched
next finds its threads awake instead of waking each from libgomp's own sleep
one after the other (a futex wake of an idle vCPU is slow). Compiled code can
sleep that way too (``team_futex_wait``, which can ring another doorbell first
from inside the team's sleep) and read the monotonic clock (``monotonic_ns``):
node_worker/answer.py answers a layer and sleeps in one call.
"""

from __future__ import annotations

import ctypes
import os
import platform
import time

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .jit import CACHED

# -- atomics on int64 and uint32 words of a NumPy array ------------------------------------------------------


def _element_ptr(context, builder, aryty, ary, index):
    a = context.make_array(aryty)(context, builder, ary)
    return builder.gep(a.data, [index])


@intrinsic
def _load_acquire(typingctx, ary, index):
    sig = ary.dtype(ary, types.intp)

    def codegen(context, builder, signature, args):
        ptr = _element_ptr(context, builder, signature.args[0], args[0], args[1])
        return builder.load_atomic(ptr, "acquire", signature.args[0].dtype.bitwidth // 8)

    return sig, codegen


@intrinsic
def _store_release(typingctx, ary, index, value):
    sig = types.void(ary, types.intp, ary.dtype)

    def codegen(context, builder, signature, args):
        ptr = _element_ptr(context, builder, signature.args[0], args[0], args[1])
        builder.store_atomic(args[2], ptr, "release", signature.args[0].dtype.bitwidth // 8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _fetch_add(typingctx, ary, index, value):
    sig = ary.dtype(ary, types.intp, ary.dtype)

    def codegen(context, builder, signature, args):
        ptr = _element_ptr(context, builder, signature.args[0], args[0], args[1])
        return builder.atomic_rmw("add", ptr, args[2], "seq_cst")

    return sig, codegen


@njit(**CACHED)
def load_acquire(ary, index):
    return _load_acquire(ary, index)


@njit(**CACHED)
def store_release(ary, index, value):
    _store_release(ary, index, value)


@njit(**CACHED)
def fetch_add(ary, index, value):
    return _fetch_add(ary, index, value)


def warm_up() -> None:
    """Compile (or load) the atomics for the array types the pool uses."""
    for dtype in (np.int64, np.uint32):
        a = np.zeros(2, dtype)
        store_release(a, 0, a.dtype.type(1))
        fetch_add(a, 1, a.dtype.type(1))
        assert load_acquire(a, 0) == 1 and a[1] == 1
    words = np.zeros(1, np.uint32)
    futex_wait_team(word_address(words, 0), 1, 0.0, 2)  # compiled now: returns at once (the word is not 1)
    monotonic_ns()


# -- futex ---------------------------------------------------------------------------------------------------

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "ppc64le": 221, "s390x": 238}.get(platform.machine())
FUTEX_WAIT, FUTEX_WAKE = 0, 1  # not the _PRIVATE forms: the word is shared between processes
NO_RING = np.zeros(0, np.uint32)  # team_futex_wait's ring_words when it rings nothing
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _libc_call(builder, name: str, args: list) -> ir.Value:
    """A call of libc's ``name`` (taking and returning 64-bit integers) by name: resolved in the process when
    the compiled code is loaded, so that code can be cached."""
    i64 = ir.IntType(64)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i64, [i64], var_arg=True), name)
    return builder.call(fn, args)


@intrinsic
def _futex_syscall(typingctx, address, op, value, timespec):
    """syscall(SYS_futex, address, op, value, timespec, 0, 0) from compiled code."""
    sig = types.int64(types.intp, types.intp, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        return _libc_call(builder, "syscall", [i64(_SYS_FUTEX or -1), *args, i64(0), i64(0)])

    return sig, codegen


@intrinsic
def _monotonic_ns(typingctx):
    """clock_gettime(CLOCK_MONOTONIC) in nanoseconds from compiled code: time.monotonic_ns()'s clock."""
    sig = types.int64()

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        ts = cgutils.alloca_once(builder, ir.ArrayType(i64, 2))
        _libc_call(builder, "clock_gettime", [i64(1), builder.ptrtoint(ts, i64)])  # CLOCK_MONOTONIC
        sec = builder.load(builder.gep(ts, [ir.IntType(32)(0), ir.IntType(32)(0)]))
        nsec = builder.load(builder.gep(ts, [ir.IntType(32)(0), ir.IntType(32)(1)]))
        return builder.add(builder.mul(sec, i64(1_000_000_000)), nsec)

    return sig, codegen


@njit(**CACHED)
def monotonic_ns() -> int:
    return _monotonic_ns()


@njit(parallel=True, **CACHED)
def team_futex_wait(address, expected, timespec_address, threads, ring_words, ring_index):
    """futex_wait_team from compiled code: each of ``threads`` numba threads sleeps on ``address`` while it holds
    ``expected``, at most the timespec at ``timespec_address``; first, from inside the team's wait (so that
    whoever it wakes finds this process's threads asleep, not spinning on the CPUs it needs), doorbell
    ``ring_words[ring_index]`` is rung unless ``ring_words`` is empty."""
    for i in prange(threads):  # one iteration a thread of the team: each sleeps on the word itself
        if i == 0 and ring_words.size:
            _fetch_add(ring_words, ring_index, np.uint32(1))
            _futex_syscall(ring_words.ctypes.data + 4 * ring_index, FUTEX_WAKE, 1 << 30, 0)
        _futex_syscall(address, FUTEX_WAIT, expected, timespec_address)


# -- the same on words named by address (compiled code that holds no array: a CUDA stream's host function) -----


@intrinsic
def _word_at(typingctx, address, like):
    """The word of ``like``'s type at ``address`` as a pointer (inttoptr)."""
    sig = types.CPointer(like.dtype)(types.intp, like)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


@intrinsic
def _load_acquire_ptr(typingctx, ptr):
    sig = ptr.dtype(ptr)

    def codegen(context, builder, signature, args):
        return builder.load_atomic(args[0], "acquire", signature.args[0].dtype.bitwidth // 8)

    return sig, codegen


@intrinsic
def _store_release_ptr(typingctx, ptr, value):
    sig = types.void(ptr, ptr.dtype)

    def codegen(context, builder, signature, args):
        builder.store_atomic(args[1], args[0], "release", signature.args[0].dtype.bitwidth // 8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _fetch_add_ptr(typingctx, ptr, value):
    sig = ptr.dtype(ptr, ptr.dtype)

    def codegen(context, builder, signature, args):
        return builder.atomic_rmw("add", args[0], args[1], "seq_cst")

    return sig, codegen


@intrinsic
def _sched_yield(typingctx):
    sig = types.int64()

    def codegen(context, builder, signature, args):
        return _libc_call(builder, "sched_yield", [ir.IntType(64)(0)])  # the declaration takes one fixed word

    return sig, codegen


@intrinsic
def _poll(typingctx, fds_address, nfds, timeout_ms):
    """poll(fds, nfds, timeout) from compiled code."""
    sig = types.int64(types.intp, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        return _libc_call(builder, "poll", list(args))

    return sig, codegen


@intrinsic
def _pointer_value(typingctx, ptr):
    sig = types.intp(ptr)

    def codegen(context, builder, signature, args):
        return builder.ptrtoint(args[0], ir.IntType(64))

    return sig, codegen


@njit(**CACHED)
def pointer_value(ptr):
    """A pointer (a cfunc's ``void *`` argument) as an integer address."""
    return _pointer_value(ptr)


_I64, _U32 = np.zeros(1, np.int64), np.zeros(1, np.uint32)  # the types _word_at takes


@njit(**CACHED)
def load_acquire_at(address):
    """The int64 at ``address``, an acquire load."""
    return _load_acquire_ptr(_word_at(address, _I64))


@njit(**CACHED)
def store_release_at(address, value):
    """Store int64 ``value`` at ``address``, a release store."""
    _store_release_ptr(_word_at(address, _I64), np.int64(value))


@njit(**CACHED)
def bell_count_at(address):
    """The count of the doorbell (uint32) at ``address``, an acquire load."""
    return np.int64(_load_acquire_ptr(_word_at(address, _U32)))


@njit(**CACHED)
def ring_at(address):
    """Bump the doorbell at ``address`` and wake its sleepers (``ring`` by address)."""
    _fetch_add_ptr(_word_at(address, _U32), np.uint32(1))
    _futex_syscall(address, FUTEX_WAKE, 1 << 30, 0)


@njit(**CACHED)
def futex_wait_at(address, expected, timespec_address):
    """Sleep while the doorbell at ``address`` still counts ``expected``, at most the timespec's time."""
    _futex_syscall(address, FUTEX_WAIT, expected, timespec_address)


@njit(**CACHED)
def yield_cpu():
    """sched_yield from compiled code (spin_pause's)."""
    _sched_yield()


@njit(**CACHED)
def any_readable(pollfds_address, nfds):
    """Whether any of ``nfds`` struct pollfd at ``pollfds_address`` (events POLLIN) is readable now: a pidfd
    is when its process has ended."""
    return nfds > 0 and _poll(pollfds_address, nfds, 0) > 0


def futex_available() -> bool:
    return _SYS_FUTEX is not None


def word_address(words: np.ndarray, index: int) -> int:
    """The address of uint32 ``words[index]`` (the array must stay mapped while it is used)."""
    return words.ctypes.data + 4 * index


def futex_wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleep while the uint32 at ``address`` equals ``expected``, at most ``timeout_s`` (the GIL is released).
    Returns on a wake, a changed value, a signal or the timeout alike: the caller checks its condition."""
    if _SYS_FUTEX is None:
        time.sleep(min(timeout_s, 0.0005))  # no futex on this platform: a short nap
        return
    ts = timespec(timeout_s)
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), FUTEX_WAIT, ctypes.c_uint32(expected & 0xFFFFFFFF),
                  ctypes.c_void_p(ts.ctypes.data), None, 0)


def timespec(timeout_s: float) -> np.ndarray:
    """A struct timespec for the futex calls."""
    return np.array([int(timeout_s), int((timeout_s % 1) * 1e9)], np.int64)


def futex_wait_team(address: int, expected: int, timeout_s: float, threads: int) -> None:
    """``futex_wait`` on every one of ``threads`` numba threads at once (the calling thread among them: set
    numba's thread count to the kernels' first), each returning on a wake, a changed value or the timeout."""
    if _SYS_FUTEX is None or threads <= 1:
        futex_wait(address, expected, timeout_s)
        return
    team_futex_wait(address, expected & 0xFFFFFFFF, timespec(timeout_s).ctypes.data, threads, NO_RING, 0)


def futex_wake(address: int, count: int = 1 << 30) -> None:
    if _SYS_FUTEX is not None:
        _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), FUTEX_WAKE, count, None, None, 0)


def spin_pause() -> None:
    """One round of a spinning wait: the CPU goes to a thread that is ready to run on it, else the call returns
    at once (sched_yield). Where the processes share CPUs (the coordinator and a worker's team of two on 2
    CPUs), a side that spins without it holds a CPU the other side's thread needs until the scheduler takes
    it away (README, "The process boundary")."""
    os.sched_yield()


def spin_until(seconds: float, ready) -> bool:
    """Spin up to ``seconds`` until ``ready()`` is true, a spin_pause each round; whether it became true."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        if ready():
            return True
        spin_pause()
    return False


def ring(words: np.ndarray, index: int) -> None:
    """Bump doorbell ``words[index]`` and wake its sleepers."""
    fetch_add(words, index, np.uint32(1))
    futex_wake(word_address(words, index))


def wait_ring(words: np.ndarray, index: int, seen: int, timeout_s: float) -> None:
    """Sleep until doorbell ``words[index]`` moves past ``seen`` (a count read before checking), or the timeout."""
    futex_wait(word_address(words, index), seen, timeout_s)


def wait_ring_team(words: np.ndarray, index: int, seen: int, timeout_s: float, threads: int) -> None:
    """``wait_ring`` with all ``threads`` of numba's team asleep on the doorbell, woken by one ring."""
    futex_wait_team(word_address(words, index), seen, timeout_s, threads)


__all__ = ["fetch_add", "futex_available", "load_acquire", "ring", "spin_pause", "spin_until", "store_release",
           "wait_ring", "wait_ring_team", "warm_up"]
