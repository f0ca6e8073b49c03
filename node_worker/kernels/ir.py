"""LLVM IR pieces the per-format block readers share (llvmlite types, vector loads, the float16 scale)."""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils

LANES = 32  # one block: every format's row is read 32 values at a time
F32 = ir.FloatType()
I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
VF = ir.VectorType(F32, LANES)  # <32 x float>


def const(value: int) -> ir.Constant:
    return ir.Constant(I64, value)


def vec_load(builder: ir.IRBuilder, ptr: ir.Value, vty: ir.Type) -> ir.Value:
    """A vector of type ``vty`` from the byte pointer ``ptr`` (no alignment assumed)."""
    return builder.load(builder.bitcast(ptr, vty.as_pointer()), align=1)


def half_scale(builder: ir.IRBuilder, row: ir.Value, values_bytes: ir.Value, b: ir.Value) -> ir.Value:
    """float32 of the float16 scale of block b; the row's scales follow its values_bytes of values."""
    scales = builder.bitcast(builder.gep(row, [values_bytes]), I16.as_pointer())
    bits = builder.load(builder.gep(scales, [b]), align=1)
    return builder.fpext(builder.bitcast(bits, ir.HalfType()), F32)


EXACT = ("nnan",)  # a flag that allows no contraction: the fastmath pass leaves flagged operations as they are


def splat(builder: ir.IRBuilder, value: ir.Value, vty: ir.VectorType = VF) -> ir.Value:
    """<n x value>."""
    one = builder.insert_element(ir.Constant(vty, ir.Undefined), value, ir.Constant(I32, 0))
    return builder.shuffle_vector(one, ir.Constant(vty, ir.Undefined),
                                  ir.Constant(ir.VectorType(I32, vty.count), [0] * vty.count))


def prefetch(builder: ir.IRBuilder, address: ir.Value) -> None:
    """Prefetch the cache line at ``address`` (an i8 pointer) for reading, into all caches (a prefetch never
    faults: an address past the data's end is harmless)."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [I8.as_pointer(), I32, I32,
                                                                                           I32]), "llvm.prefetch.p0i8")
    builder.call(fn, [address, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])  # read, all caches, data


def byte_at(builder: ir.IRBuilder, ptr: ir.Value, index: ir.Value) -> ir.Value:
    """The unsigned byte ptr[index] as an i32."""
    return builder.zext(builder.load(builder.gep(ptr, [index]), align=1), I32)


def half_at(builder: ir.IRBuilder, ptr: ir.Value) -> ir.Value:
    """float32 of the float16 at the byte pointer ptr."""
    bits = builder.load(builder.bitcast(ptr, I16.as_pointer()), align=1)
    return builder.fpext(builder.bitcast(bits, ir.HalfType()), F32)


def super_block(builder: ir.IRBuilder, row: ir.Value, s: ir.Value, super_bytes: int) -> ir.Value:
    """The byte pointer of super-block s of a row (the formats in super-blocks of 256: 8 groups of 32)."""
    return builder.gep(row, [builder.mul(s, const(super_bytes))])


def k_scale_min(builder: ir.IRBuilder, scales: ir.Value, j: int) -> tuple[ir.Value, ir.Value]:
    """(sc[j], m[j]) as i32 for a constant group j: the 6-bit pairs packed in 12 bytes as Q4_K and Q5_K pack
    them (shm/formats/q4k.py)."""
    i32 = lambda v: ir.Constant(I32, v)  # noqa: E731
    at = lambda k: byte_at(builder, scales, const(k))  # noqa: E731
    if j < 4:
        return builder.and_(at(j), i32(63)), builder.and_(at(j + 4), i32(63))
    c = at(j + 4)
    sc = builder.or_(builder.and_(c, i32(15)), builder.shl(builder.lshr(at(j - 4), i32(6)), i32(4)))
    m = builder.or_(builder.lshr(c, i32(4)), builder.shl(builder.lshr(at(j), i32(6)), i32(4)))
    return sc, m
