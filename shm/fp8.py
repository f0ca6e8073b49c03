"""FP8 (e4m3fn) block-scaled weights, as DeepSeek-V3/R1's safetensors store them.

A quantised matrix ``W`` [rows, cols] is a tensor of dtype ``F8_E4M3`` (one
byte a weight) plus a companion ``<name>_scale_inv`` (float32) of shape
[ceil(rows / br), ceil(cols / bc)] for config.json's
``quantization_config.weight_block_size`` [br, bc] (128 x 128 in every
DeepSeek release): the weight is ``decode(code) * scale_inv[i // br, j // bc]``,
the last block of a row or column ragged when the size is not a multiple.

NumPy has no float8, so a code is decoded through a 256-entry float32 table
built from the e4m3fn definition (1 sign bit, 4 exponent bits with bias 7, 3
mantissa bits; exponent 0 is subnormal, m/8 * 2^-6; no infinities: only
0x7F and 0xFF are NaN; the largest value is 448). Every e4m3fn value is a
float32, so the table is exact, and the float32 product with the scale is the
one correctly rounded float32 of the exact product (4 + 24 significant bits).
That float32 array is the weight every consumer sees.

:class:`Fp8Matrix` is a window of such a matrix over the memory-mapped codes:
slicing it reads nothing, converting it (``np.asarray``) decodes only its
window, so a node worker dequantises only its own rows.
"""

from __future__ import annotations

import math

import numpy as np

DTYPE = "F8_E4M3"  # the safetensors dtype tag
SCALE_SUFFIX = "_scale_inv"
MAX = 448.0  # the largest finite e4m3fn value
DEFAULT_BLOCK = (128, 128)  # transformers' FineGrainedFP8Config default; DeepSeek's config.json names it


class Fp8Error(ValueError):
    """A quantization_config, or an FP8 tensor's scales, that cannot be read."""


def e4m3fn_values() -> np.ndarray:
    """float64 [256]: the value of every byte as e4m3fn (NaN for 0x7F and 0xFF), vectorised from the definition."""
    code = np.arange(256, dtype=np.int64)
    sign = np.where(code & 0x80, -1.0, 1.0)
    exp = (code >> 3) & 0xF
    man = (code & 0x7).astype(np.float64)
    magnitude = np.where(exp == 0, np.ldexp(man / 8.0, -6), np.ldexp(1.0 + man / 8.0, exp - 7))
    values = sign * magnitude
    values[(code & 0x7F) == 0x7F] = np.nan
    return values


E4M3FN = e4m3fn_values().astype(np.float32)  # exact: every e4m3fn value is a float32
E4M3FN.setflags(write=False)


def decode(codes: np.ndarray) -> np.ndarray:
    """uint8 codes (any shape, a memory-mapped view included) -> float32 values, one table look-up each."""
    return np.take(E4M3FN, np.asarray(codes, dtype=np.uint8))


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The scale matrix of a [rows, cols] matrix in blocks [br, bc]: ragged last blocks count as blocks."""
    return (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))


def dequantize(codes: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], row0: int = 0,
               col0: int = 0) -> np.ndarray:
    """float32 [r, c] weights of a window of codes [r, c] that starts at (row0, col0) in its matrix, whose
    whole scale matrix is ``scale_inv`` (float32 [ceil(rows/br), ceil(cols/bc)])."""
    codes = np.asarray(codes)
    if codes.ndim != 2:
        raise Fp8Error(f"an FP8 matrix window must be 2-D, not shape {list(codes.shape)}")
    r, c = codes.shape
    br, bc = block
    scale = np.asarray(scale_inv, dtype=np.float32)
    out = decode(codes)
    if r == 0 or c == 0:
        return out
    cols = scale[:, (col0 + np.arange(c)) // bc]  # [row blocks, c]: each column's scale, per row block
    for b in range(row0 // br, (row0 + r - 1) // br + 1):
        a, z = max(b * br, row0) - row0, min((b + 1) * br, row0 + r) - row0
        out[a:z] *= cols[b]
    return out


class Fp8Matrix:
    """A window of an FP8 matrix: its codes (a view of the file), the whole matrix's scales and block size,
    where the window starts. Basic slicing (steps of 1, integers) gives another window without reading;
    ``np.asarray(m)`` (``m.__array__``) gives the float32 weights of the window."""

    ndim = property(lambda self: len(self.shape))
    dtype = np.dtype(np.float32)  # what it converts to

    def __init__(self, codes: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], row0: int = 0,
                 col0: int = 0, drop: tuple[bool, bool] = (False, False)):
        self.codes, self.scale_inv, self.block = codes, scale_inv, block
        self.row0, self.col0, self.drop = row0, col0, drop

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(n for n, d in zip(self.codes.shape, self.drop) if not d)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key) -> "Fp8Matrix":
        keys = list(key) if isinstance(key, tuple) else [key]
        if any(k is Ellipsis for k in keys):
            at = keys.index(Ellipsis)
            keys[at:at + 1] = [slice(None)] * (self.ndim - len(keys) + 1)
        axes = [a for a in (0, 1) if not self.drop[a]]  # the axes the window still has, in order
        if len(keys) > len(axes):
            raise IndexError(f"too many indices for an FP8 matrix of shape {list(self.shape)}")
        starts, drop, index = [self.row0, self.col0], list(self.drop), [slice(None), slice(None)]
        for axis, k in zip(axes, keys):
            n = self.codes.shape[axis]
            if isinstance(k, (int, np.integer)):
                i = int(k) + n if k < 0 else int(k)
                if not 0 <= i < n:
                    raise IndexError(f"index {k} is out of bounds for axis {axis} of size {n}")
                k, drop[axis] = slice(i, i + 1), True
            if not isinstance(k, slice):
                raise TypeError(f"an FP8 matrix takes slices and integers, not {type(k).__name__}")
            a, z, step = k.indices(n)
            if step != 1:
                raise TypeError("an FP8 matrix takes slices with step 1 only")
            z = max(a, z)
            index[axis] = slice(a, z)
            starts[axis] += a
        return Fp8Matrix(self.codes[tuple(index)], self.scale_inv, self.block, starts[0], starts[1], tuple(drop))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = dequantize(self.codes, self.scale_inv, self.block, self.row0, self.col0)
        out = out[tuple(0 if d else slice(None) for d in self.drop)]
        return out if dtype is None else out.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return (f"Fp8Matrix(shape={list(self.shape)}, block={list(self.block)}, at=({self.row0}, {self.col0}))")


def block_size(quant: object, where: str = "config.json") -> tuple[int, int] | None:
    """The [br, bc] of config.json's ``quantization_config`` (None without one), or an Fp8Error naming what
    is not supported: a method other than fp8, a format other than e4m3, static activation scales (the
    engine computes its activations in float32; per-tensor input scales are not read), a block size that
    is not two positive integers."""
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise Fp8Error(f"{where}: quantization_config must be an object, not {type(quant).__name__}")
    method = quant.get("quant_method")
    if method is None:
        return None
    if method != "fp8":
        raise Fp8Error(f"{where}: quantization_config.quant_method {method!r} is not supported; expected 'fp8' "
                       "(block-scaled e4m3, as DeepSeek-V3/R1's checkpoints)")
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise Fp8Error(f"{where}: quantization_config.fmt {fmt!r} is not supported; expected 'e4m3' (float8 "
                       "e4m3fn, safetensors F8_E4M3)")
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise Fp8Error(f"{where}: quantization_config.activation_scheme {scheme!r} is not supported; expected "
                       "'dynamic'")
    size = quant.get("weight_block_size", list(DEFAULT_BLOCK))
    if (not isinstance(size, (list, tuple)) or len(size) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in size)):
        raise Fp8Error(f"{where}: quantization_config.weight_block_size {size!r} is not supported; expected "
                       "two positive integers [rows, columns] (DeepSeek's [128, 128]); per-tensor or "
                       "per-channel FP8 scales are not read")
    return int(size[0]), int(size[1])
