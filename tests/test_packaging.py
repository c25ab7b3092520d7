"""The wheel installs one top-level package, ``pagedserve``, and nothing named ``server``,
``actors``, ``gpu`` or ``kernels`` (the last is Hugging Face's kernel-hub package); every
subpackage of the tree is in it (setup.py finds them: none is listed by hand)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


FOLDERS = ("server", "actors", "gpu", "kernels")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from a copy of the checkout's packaging files and code folders."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    src = tmp_path / "src"  # build from a copy: setuptools writes build/ into the source tree
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src)
    for pkg in FOLDERS:
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(wheels), str(src)], check=True)
    (built,) = wheels.glob("pagedserve-*.whl")
    return built


def test_wheel_holds_every_subpackage(wheel: Path) -> None:
    """Each folder of the tree with an ``__init__.py`` is a package of the wheel, with all its
    modules (``gpu/lora`` once shipped only in editable installs)."""
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {f"pagedserve/{p.relative_to(ROOT).as_posix()}" for folder in FOLDERS
               for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts
               and (p.parent / "__init__.py").exists()}
    assert "pagedserve/gpu/lora/__init__.py" in modules
    assert modules - names == set()


def test_wheel_installs_only_the_pagedserve_namespace(wheel: Path, tmp_path: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {
        "pagedserve"}
    # The package data the server and the kernel build read at run time.
    assert "pagedserve/server/static/chat.html" in names
    assert "pagedserve/kernels/csrc/cpu_ops.cpp" in names

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", str(target), str(wheel)], check=True)
    top = {p.name for p in target.iterdir() if not p.name.endswith(".dist-info")}
    assert top == {"pagedserve", "bin"}, top  # bin/: the console script, not a module
    assert (target / "bin" / "pagedserve").exists()
    assert not (target / "pagedserve" / "__init__.py").exists()  # a namespace package
    # The installed copy imports on its own, without the checkout on sys.path.
    out = subprocess.run(
        [sys.executable, "-I", "-c",
         "import sys; sys.path.insert(0, sys.argv[1]); import pagedserve.kernels.reference as r;"
         " print(r.__file__)", str(target)],
        check=True, capture_output=True, text=True, cwd=tmp_path,
    ).stdout
    assert out.strip().startswith(str(target / "pagedserve" / "kernels"))


def test_make_announces_each_install_phase(tmp_path: Path) -> None:
    """``make serve`` on a fresh clone spends ~3 minutes in pip: each install is announced by a
    phase line and none is silenced (``-q``); pip's progress bars only on a terminal. Read from
    ``make -n``, which prints the recipe without running it."""
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path)
    # Run under ``make test`` (CI), the parent's MAKEFLAGS/MAKELEVEL make the child print
    # "make[1]: Entering/Leaving directory" lines: a clean environment reads the recipe alone.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    out = subprocess.run(["make", "-n", "serve"], cwd=tmp_path, capture_output=True,
                         text=True, check=True, env=env).stdout.splitlines()
    installs = [i for i, line in enumerate(out) if " -m pip install " in line]
    assert len(installs) == 3
    for i in installs:
        assert " -q" not in out[i] and "--progress-bar off" in out[i]
        phase = next(line for line in reversed(out[:i]) if not line.startswith("#"))
        assert phase.startswith('echo "== [') and "/3] " in phase
    assert out[-1] == ".venv/bin/pagedserve serve "
    assert any("source .venv/bin/activate" in line for line in out[installs[-1]:])


def test_make_docs_installs_the_pinned_tools_and_builds_strict(tmp_path: Path) -> None:
    """``make docs`` puts docs/requirements.txt's pins into .venv (creating it if missing),
    then builds with ``--strict``: any warning fails it. Read from ``make -n``."""
    for name in ("Makefile", "pyproject.toml", "mkdocs.yml"):
        shutil.copy(ROOT / name, tmp_path)
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "requirements.txt", tmp_path / "docs")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    out = subprocess.run(["make", "-n", "docs"], cwd=tmp_path, capture_output=True,
                         text=True, check=True, env=env).stdout.splitlines()
    assert any(" -m pip install " in line and "-r docs/requirements.txt" in line for line in out)
    assert out[-1] == ".venv/bin/mkdocs build --strict"
    pins = (ROOT / "docs" / "requirements.txt").read_text().split()
    assert "mkdocs==1.6.1" in pins and any(p.startswith("mkdocs-material==") for p in pins)
