"""The package list, found rather than written: every folder with an ``__init__.py`` under
the design card's four code folders installs as ``pagedserve.<folder>...`` (pyproject.toml maps
``pagedserve.<folder>`` to ``<folder>/`` and holds everything else). A new subpackage ships
without an edit here; a listed one once went missing (``gpu/lora``) and worked only because
the development install is editable."""

from setuptools import find_packages, setup

FOLDERS = ("server", "actors", "gpu", "kernels")

setup(packages=[f"pagedserve.{name}" for name in find_packages(
    include=[pattern for folder in FOLDERS for pattern in (folder, f"{folder}.*")])])
