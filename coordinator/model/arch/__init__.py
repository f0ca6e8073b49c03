"""The model families, one file each (as llama.cpp's src/models/): a family's config.json parsing, its tensors'
names, its multi-token-prediction layer and its ``strata make-model`` presets and weights (base.Family). Every
module of this package but base.py is a family file, found rather than listed: adding a family is adding a file
that defines FAMILY (or FAMILIES), a base.Family."""

from __future__ import annotations

import importlib
import pkgutil

from ...errors import ModelConfigError
from .base import Family


def _found() -> dict[str, Family]:
    found: dict[str, Family] = {}
    for module in sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "base"):
        mod = importlib.import_module(f"{__name__}.{module}")
        for family in getattr(mod, "FAMILIES", None) or (mod.FAMILY,):
            found[family.name] = family
    return found


FAMILIES: dict[str, Family] = _found()  # name (ModelConfig.arch) -> its family
BY_CLASS = {cls: f for f in FAMILIES.values() for cls in (f.hf_class, *f.hf_aliases)}  # transformers class -> family
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
