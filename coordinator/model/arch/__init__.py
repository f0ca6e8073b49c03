"""The model families, one file each (as llama.cpp's src/models/): a family's config.json parsing, its tensors'
names, its GGUF files' metadata and names, its multi-token-prediction layer and its ``strata make-model`` presets
and weights (base.Family). Every module of this package but base.py and gguf.py (what the families share) is a
family file, found rather than listed: adding a family is adding a file that defines FAMILY (or FAMILIES), a
base.Family."""

from __future__ import annotations

import importlib
import pkgutil

from shm.gguf_file import GgufError, GgufFile

from ...errors import ModelConfigError
from .base import Family

SHARED = ("base", "gguf")  # the modules that are not a family's


def _found() -> dict[str, Family]:
    found: dict[str, Family] = {}
    for module in sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name not in SHARED):
        mod = importlib.import_module(f"{__name__}.{module}")
        for family in getattr(mod, "FAMILIES", None) or (mod.FAMILY,):
            found[family.name] = family
    return found


FAMILIES: dict[str, Family] = _found()  # name (ModelConfig.arch) -> its family
BY_CLASS = {cls: f for f in FAMILIES.values() for cls in (f.hf_class, *f.hf_aliases)}  # transformers class -> family


def _by_gguf() -> dict[str, Family]:
    """GGUF general.architecture -> the family that reads it; two families claiming one (a family derived from
    another keeps its gguf_arch unless it sets its own or "") is an error."""
    by: dict[str, Family] = {}
    for f in FAMILIES.values():
        if f.gguf_arch in by:
            raise TypeError(f"families {by[f.gguf_arch].name} and {f.name} both read GGUF architecture "
                            f"{f.gguf_arch!r}: set gguf_arch on one")
        if f.gguf_arch:
            by[f.gguf_arch] = f
    return by


BY_GGUF = _by_gguf()
PRESETS = {name: (f, geometry) for f in FAMILIES.values() for name, geometry in f.presets.items()}  # make-model's


def family(name: str) -> Family:
    """The family named ``name`` (ModelConfig.arch)."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown architecture {name!r}; expected one of {', '.join(FAMILIES)}") from None


def of_config(cfg: dict) -> Family:
    """The family config.json's ``architectures`` names."""
    archs = cfg.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise ModelConfigError(
            f"config.json: field 'architectures' is {archs!r}; expected a list naming one of {', '.join(BY_CLASS)}")
    if archs[0] not in BY_CLASS:
        raise ModelConfigError(
            f"config.json: architecture '{archs[0]}' is not supported; expected one of {', '.join(BY_CLASS)}")
    return BY_CLASS[archs[0]]


def of_gguf(f: GgufFile) -> Family:
    """The family that reads GGUF file ``f`` (its general.architecture)."""
    if f.arch not in BY_GGUF:
        raise GgufError(f"{f.path}: architecture {f.arch!r} is not supported; expected one of {', '.join(BY_GGUF)}")
    return BY_GGUF[f.arch]


def gguf_config(f: GgufFile) -> dict:
    """config.json's keys from GGUF file ``f``'s metadata, by its family."""
    return of_gguf(f).gguf_config(f)
