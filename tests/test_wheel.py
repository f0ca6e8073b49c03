"""The project as a wheel, installed outside the source tree: every package and module of the tree in it, every
third-party module the code imports among its declared dependencies, and `strata make-model` then `strata generate`
run from the installed copy, not from the checkout."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from source_imports import PACKAGES, imports, project_modules

pytestmark = pytest.mark.slow  # a wheel built and installed into a fresh venv

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = {"cupy", "cupyx", "torch", "transformers", "matplotlib"}  # imported where present ([gpu], [plot], tools only)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel pip builds from a copy of the tree's project files (a build/ folder left in the checkout by an
    earlier build would lend it files the configuration leaves out)."""
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dist")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in PACKAGES:
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(src)], check=True,
                   stdout=subprocess.DEVNULL)
    (path,) = out.glob("strata_numa-*.whl")
    return path


def tree_modules() -> set[str]:
    return {str(p.relative_to(ROOT)) for p in project_modules().values()}


def test_the_wheel_holds_every_module_of_the_tree(wheel):
    with zipfile.ZipFile(wheel) as z:
        held = {n for n in z.namelist() if n.endswith(".py")}
        cuda = {n for n in z.namelist() if n.endswith((".cu", ".cuh"))}
    assert tree_modules() <= held, sorted(tree_modules() - held)
    sources = {str(p.relative_to(ROOT)) for p in (ROOT / "coordinator" / "gpu" / "kernels").glob("*.cu*")}
    assert sources and sources <= cuda, sorted(sources - cuda)  # NVRTC reads them at open


def test_every_third_party_import_is_a_declared_dependency(wheel):
    """Each top-level module the code imports that is neither the project's nor the standard library's comes from
    a distribution the wheel requires."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        requires = {re.split(r"[ ;<>=!\[]", line.split(":", 1)[1].strip())[0].lower().replace("_", "-")
                    for line in z.read(meta).decode().splitlines() if line.startswith("Requires-Dist:")
                    and "extra ==" not in line}
    imported: set[str] = set()
    for path in project_modules().values():
        imported |= {i.module.split(".")[0] for i in imports(path) if not i.relative}
    third_party = imported - set(sys.stdlib_module_names) - set(PACKAGES) - OPTIONAL
    dists = importlib.metadata.packages_distributions()
    missing = {m: dists.get(m) for m in third_party
               if not {d.lower().replace("_", "-") for d in dists.get(m, [])} & requires}
    assert not missing, missing


def test_strata_runs_from_the_installed_wheel(wheel, tmp_path):
    """A fresh venv outside the tree with the wheel installed (its dependencies taken from this interpreter's
    site-packages through a .pth, not downloaded again): make-model and generate run, from the wheel's copy."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # appended after the venv's own
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", str(wheel)],
                   check=True, stdout=subprocess.DEVNULL)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    where = subprocess.run([str(py), "-c", "import coordinator.gpu.backend, coordinator.host.backend, shm, node_worker; print(coordinator.__file__)"],
                           cwd=tmp_path, env=env, check=True, capture_output=True, text=True).stdout.strip()
    assert Path(where).is_relative_to(site), where  # the wheel's copy, not the checkout
    run = dict(cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    made = subprocess.run([str(venv / "bin" / "strata"), "make-model", "--out", str(tmp_path / "tiny"), "-q"], **run)
    assert made.returncode == 0, made.stderr
    out = subprocess.run([str(venv / "bin" / "strata"), "generate", "-m", str(tmp_path / "tiny"), "--prompt-ids",
                          "72,101", "-n", "4", "--json", "-q"], **run)
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["ids"]) == 4
