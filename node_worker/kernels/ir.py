"""LLVM IR pieces the per-format block readers share (llvmlite types, vector loads, the float16 scale)."""

from __future__ import annotations

from llvmlite import ir

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
