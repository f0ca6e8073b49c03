"""Which loops a compiled kernel holds: a compile-time argument, so a model compiles only its own formats' loops.

Every kernel entry (layer.layer_moe, dense.*, rows8.matmul_*) takes a KernelSet first. Its numba type carries
the loop names (simd.FORMATS: the storage formats, and bf16dp for bf16 rows by bf16 activations) and whether
the integer loops are wanted (EngineConfig.activations q8 or bf16); the intrinsics read the type when they
generate code and emit a format's loop only where the set holds it, so a kernel compiled for f32 and one for
q4k + q6k are two specialisations of the same functions, each cached on its own (numba keys its cache by the
argument types). The value itself holds nothing at run time.

A kernel reached with a format outside its set computes nothing for it: the set is made from the same
format names the caller then passes (NodeWorker's store, the packed dense matrices), never guessed apart.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable

from llvmlite import ir
from numba.core import types
from numba.extending import NativeValue, intrinsic, models, register_model, typeof_impl, unbox

from shm.jit import finished_units

from .isimd import INT_FORMATS
from .loops import FORMATS


@dataclass(frozen=True)
class KernelSet:
    """The loops a kernel is compiled with: ``loops`` (FORMATS names, in FORMATS order) and ``int_act`` (the
    integer loops of those that have them: INT_FORMATS). Build it with ``of``."""

    loops: tuple[str, ...]
    int_act: bool

    @classmethod
    def of(cls, loops: Iterable[str], int_act: bool) -> KernelSet:
        """The set of these loop names (any order, repeats allowed), ``int_act`` kept only where one of them has
        integer loops: f32 and bf16 alone compile the same either way, so they make one set."""
        names = set(loops)
        unknown = names - set(FORMATS)
        if unknown:
            raise ValueError(f"no kernel loop named {', '.join(sorted(unknown))} (known: {', '.join(FORMATS)})")
        ordered = tuple(name for name in FORMATS if name in names)
        return cls(ordered, bool(int_act) and any(name in INT_FORMATS for name in ordered))

    @classmethod
    def everything(cls, int_act: bool = True) -> KernelSet:
        """Every loop (the test suite's and `strata warm-up --all`'s: one compile serves any model)."""
        return cls.of(FORMATS, int_act)

    def __contains__(self, name: str) -> bool:
        return name in self.loops

    def covers(self, other: KernelSet) -> bool:
        """Whether this set runs ``other``'s formats as ``other`` would: every loop of it compiled here, in the same
        activation mode (a set with int_act takes the integer loops wherever it has them)."""
        return set(other.loops) <= set(self.loops) and self.int_act == other.int_act

    @property
    def label(self) -> str:
        """For people: "q4k, q6k; int8 activations"."""
        return ", ".join(self.loops) + ("; int8 activations" if self.int_act else "")

    @property
    def tag(self) -> str:
        """For file names and command lines: "q4k-q6k.i8" (from_tag reads it back)."""
        return "-".join(self.loops) + (".i8" if self.int_act else "")

    @classmethod
    def from_tag(cls, tag: str) -> KernelSet:
        loops, int_act = (tag[:-3], True) if tag.endswith(".i8") else (tag, False)
        return cls.of(loops.split("-"), int_act)


def loop_name(format_name: str, bf16_products: bool) -> str:
    """The kernels' loop that takes a matrix stored in shm format ``format_name``: its own, or bf16dp for bf16
    rows by bf16 activations (EngineConfig.activations bf16)."""
    return "bf16dp" if bf16_products and format_name == "bf16" else format_name


def for_formats(format_names: Iterable[str], activations: str) -> KernelSet:
    """The kernel set for matrices stored in these shm formats, with EngineConfig.activations ``activations``
    (q8 and bf16: the integer loops; bf16: bf16 rows by bf16 activations too)."""
    bf16_products = activations == "bf16"
    return KernelSet.of((loop_name(n, bf16_products) for n in format_names), activations in ("q8", "bf16"))


def compiled_cover(need: KernelSet) -> KernelSet:
    """The set to run ``need``'s formats with: ``need`` itself where this build compiled it, or where no compiled
    experts set covers it (it is then compiled); else the smallest compiled set that covers it. So one compile of
    every loop (KernelSet.everything(), as the test suite makes) serves every model after it, each format
    compiled once rather than once per mix of formats."""
    tags = finished_units("experts")
    if need.tag in tags:
        return need
    compiled = []
    for tag in tags:
        try:
            compiled.append(KernelSet.from_tag(tag))
        except ValueError:  # a marker of a loop this build no longer has: not a set it can load
            continue
    return min((s for s in compiled if s.covers(need)), key=lambda s: (len(s.loops), s.tag), default=need)


class KernelSetType(types.Type):
    """The numba type of a KernelSet: its loops and int_act are the type's, so each set compiles apart."""

    def __init__(self, loops: tuple[str, ...], int_act: bool):
        self.loops, self.int_act = tuple(loops), bool(int_act)
        super().__init__(name=f"KernelSet({'+'.join(self.loops)}{', int8' if self.int_act else ''})")

    def emits(self, name: str, integer: bool = False) -> bool:
        """Whether a kernel of this set holds format ``name``'s loop: its float loop, or (``integer``) its integer
        one, which only a set with int_act holds."""
        return name in self.loops and (self.int_act or not integer)


@functools.lru_cache(maxsize=None)
def _kernel_set_type(loops: tuple[str, ...], int_act: bool) -> KernelSetType:
    return KernelSetType(loops, int_act)


@typeof_impl.register(KernelSet)
def _typeof_kernel_set(value: KernelSet, context) -> KernelSetType:
    """The set's type, made once: every kernel call types its KernelSet argument, and a numba type's
    construction (its name, the interning lookup) costs a few microseconds a call."""
    return _kernel_set_type(value.loops, value.int_act)


register_model(KernelSetType)(models.OpaqueModel)  # nothing at run time: a null pointer


@unbox(KernelSetType)
def _unbox_kernel_set(typ, obj, c):
    return NativeValue(c.context.get_dummy_value())


@intrinsic
def int_products(typingctx, kernels):
    """Whether ``kernels`` (a KernelSet) takes the integer loops: a constant of the compiled code."""
    if not isinstance(kernels, KernelSetType):
        return None

    def codegen(context, builder, signature, args):
        return ir.Constant(ir.IntType(1), int(kernels.int_act))

    return types.boolean(kernels), codegen
