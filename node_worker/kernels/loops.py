"""The building blocks every kernel loop shares, in LLVM IR: the kernel loop registry (FORMATS), pointers into
arrays, loops whose accumulators stay in registers, the switch on a run-time format, tiles' row and output
pointers, the prefetch of rows ahead, and a vector's sum.

simd.py (float loops), isimd.py / iblock.py / isuper.py (integer loops) and rows8.py (dense matrices) build on
these; a new format's loops add a module to FORMATS and use them as they are.
"""

from __future__ import annotations

from importlib import import_module
from types import ModuleType

from llvmlite import ir
from numba import types
from numba.core import cgutils

from shm.formats.traits import LOOP_IDS

from .ir import F32, I8, I64, const, prefetch

# every loop's module (this package's module of the loop's name), in loop id order (shm/formats/traits.py)
FORMATS: dict[str, ModuleType] = {name: import_module(f"{__package__}.{name}") for name in LOOP_IDS}


def byte_ptr(context, builder, aryty, ary):
    return builder.bitcast(context.make_array(aryty)(context, builder, ary).data, I8.as_pointer())


def row_major(builder, ptr, t, width, i):
    """&ptr[t * width + i] for a float pointer."""
    return builder.gep(ptr, [builder.add(builder.mul(t, width), i)])


def step_groups(fmt) -> int:
    """32-groups a loop step reads: 1, or a super-block format's GROUPS (8 of 32 for 256), unrolled so that
    each group's position in its super-block (its nibble half, its scale's bits) is a constant."""
    return getattr(fmt, "GROUPS", 1)


def register_loop(builder, count, inits, step) -> list:
    """``for i in range(count): values = step(i, values)`` with the values (vectors) as SSA phis, so LLVM keeps
    them in registers where an alloca'd accumulator would go through memory; returns the final values."""
    entry = builder.basic_block
    loop_bb, body_bb, done_bb = (builder.append_basic_block(f"regloop.{s}") for s in ("head", "body", "done"))
    builder.branch(loop_bb)
    builder.position_at_end(loop_bb)
    i = builder.phi(I64)
    i.add_incoming(const(0), entry)
    values = [builder.phi(v.type) for v in inits]
    for phi, v in zip(values, inits):
        phi.add_incoming(v, entry)
    builder.cbranch(builder.icmp_unsigned("<", i, count), body_bb, done_bb)
    builder.position_at_end(body_bb)
    updated = step(i, values)
    for phi, v in zip(values, updated):
        phi.add_incoming(v, builder.basic_block)
    i.add_incoming(builder.add(i, const(1)), builder.basic_block)
    builder.branch(loop_bb)
    builder.position_at_end(done_bb)
    return values


def per_format(context, builder, kernels, fmt_type, fmt_value, emit, names=FORMATS, integer: bool = False) -> None:
    """emit(format module) for the format whose FORMATS index is the run-time value ``fmt_value``, one of
    ``names`` that the kernel set ``kernels`` (a KernelSetType) holds: its float loop, or (``integer``) its
    integer loop (others: nothing)."""
    index = context.cast(builder, fmt_value, fmt_type, types.int64)
    done = builder.append_basic_block("format.done")
    switch = builder.switch(index, done)
    for i, name in enumerate(FORMATS):
        if name not in names or not kernels.emits(name, integer):
            continue
        block = builder.append_basic_block(f"format.{name}")
        switch.add_case(const(i), block)
        builder.position_at_end(block)
        emit(FORMATS[name])
        builder.branch(done)
    builder.position_at_end(done)


def tile(context, builder, data, o, row_step, out, t0, col, NR: int, NT: int):
    """A tile of NR rows by NT tokens: (the rows' byte pointers, o + j row_step in ``data``; the token indices
    t0 + t; the destinations &out[t0 + t, col + j] as [NT][NR]). data, out: (numba type, value) pairs."""
    base = byte_ptr(context, builder, *data)
    rows = [builder.gep(base, [builder.add(o, builder.mul(row_step, const(j)))]) for j in range(NR)]
    outa = context.make_array(out[0])(context, builder, out[1])
    outp = builder.bitcast(outa.data, F32.as_pointer())
    width = builder.extract_value(outa.shape, 1)
    tok = [builder.add(t0, const(t)) for t in range(NT)]
    return rows, tok, [[row_major(builder, outp, t, width, builder.add(col, const(j))) for j in range(NR)]
                       for t in tok]


def reduce_sum(builder, vec):
    """The float sum of a <n x float>'s lanes."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(F32, [F32, vec.type]),
                                        f"llvm.vector.reduce.fadd.v{vec.type.count}f32")
    return builder.call(fn, [ir.Constant(F32, 0.0), vec])


PREFETCH_ROWS = 8  # dot4/axpy4 prefetch the rows this many rows further on (two calls ahead)


def prefetch_ahead(builder, fmt, rows, b, row_step=None) -> None:
    """Prefetch, for each row, loop step b's share of the row PREFETCH_ROWS rows further on (rows o1 - o0 bytes
    apart; stride BLOCK_BYTES, a row's bytes per loop step, so the loop over a row's blocks covers that row's
    values and scales; a step of a super-block format covers several cache lines, each prefetched).

    A row is 1-4 KiB: too short a stream for the hardware prefetcher to ramp up on, and four rows read side by
    side look like four streams. A prefetch never faults, so reading past the data's end is harmless. ``row_step``:
    the bytes from one row to the next, for a single row."""
    step = row_step or builder.sub(builder.ptrtoint(rows[1], I64), builder.ptrtoint(rows[0], I64))
    ahead = builder.add(builder.mul(step, const(PREFETCH_ROWS)), builder.mul(b, const(fmt.BLOCK_BYTES)))
    lines = -(-fmt.BLOCK_BYTES // 64) if step_groups(fmt) > 1 else 1
    for row in rows:
        for line in range(lines):
            prefetch(builder, builder.gep(row, [builder.add(ahead, const(64 * line))]))


def prefetch_tile(builder, fmt, rows, s, row_step=None) -> None:
    """Prefetch loop step s's share of the tile PREFETCH_ROWS rows further on, read as one run: the tile's rows
    lie row_step apart one after another (quad_super's and rows_dot's four rows of a matrix), so its bytes from the first
    row on are prefetched len(rows) x BLOCK_BYTES a step, each cache line of the run once. One row (the
    prefill tiles): simd.prefetch_ahead's lines, the same addresses.

    simd.prefetch_ahead takes each row's own BLOCK_BYTES a step: four runs of ceil(BLOCK_BYTES / 64) lines,
    BLOCK_BYTES apart (q6k: 16 prefetches a step for 840 bytes, here 14), and the run reads memory faster,
    with the same integers, float operations and bits. isimd's decode rows (q8, q4) take it too.
    """
    row_step = row_step or builder.sub(builder.ptrtoint(rows[1], I64), builder.ptrtoint(rows[0], I64))
    span = len(rows) * fmt.BLOCK_BYTES  # the tile's bytes a step
    ahead = builder.add(builder.mul(row_step, const(PREFETCH_ROWS)), builder.mul(s, const(span)))
    for line in range(-(-span // 64)):
        prefetch(builder, builder.gep(rows[0], [builder.add(ahead, const(64 * line))]))
