"""The wheel installs one top-level package, ``pagedserve``, and nothing named ``server``,
``actors``, ``gpu`` or ``kernels`` (the last is Hugging Face's kernel-hub package)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_installs_only_the_pagedserve_namespace(tmp_path: Path) -> None:
    src = tmp_path / "src"  # build from a copy: setuptools writes build/ into the source tree
    src.mkdir()
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copy(ROOT / "README.md", src)
    for pkg in ("server", "actors", "gpu", "kernels"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(wheels), str(src)], check=True)
    (wheel,) = wheels.glob("pagedserve-*.whl")
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
