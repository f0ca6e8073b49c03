"""The GPU's CUDA sources, one .cu file a module (ops: device_ops' kernels; formats: format_kernels'; compact,
experts, router) and common.cuh, the helpers they share, shipped as package data.

    source(name) -> common.cuh, then <name>.cu: the text a RawModule hands NVRTC and tests/cuda_emulator.py
                    builds for the CPU (a module puts its own @NAME@ values or #defines in before it does)
    template(name) -> <name>.cu alone: a part a module repeats with its own values (formats_wrappers, a format)
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent


def source(name: str) -> str:
    return (HERE / "common.cuh").read_text() + "\n" + (HERE / f"{name}.cu").read_text()


def template(name: str) -> str:
    return (HERE / f"{name}.cu").read_text()
