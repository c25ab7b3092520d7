"""mypy over the engine (``actors/``), in the suite: its mailboxes are typed (``Actor[M]``, one
message union per actor, ``match`` + ``assert_never`` in the scheduler) and the server's engine
is the ``EngineClient`` protocol, so a wrong message or an engine without a method is a type
error, found here rather than at run time.

mypy reads the code as installed: ``pagedserve.actors`` etc. are the top-level folders (the
wheel maps them), so the check runs over a tree of links that names them so. Settings are
pyproject.toml's ``[tool.mypy]``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("server", "actors", "gpu", "kernels")


@pytest.fixture(scope="module")
def mypy_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding ``pagedserve/<folder>`` links to the checkout's code folders."""
    root = tmp_path_factory.mktemp("mypy")
    (root / "pagedserve").mkdir()
    for folder in FOLDERS:
        (root / "pagedserve" / folder).symlink_to(ROOT / folder, target_is_directory=True)
    return root


def mypy(mypy_path: Path, *targets: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
         "--cache-dir", str(mypy_path / ".mypy_cache"), "--no-error-summary", *targets],
        capture_output=True, text=True, timeout=600, cwd=mypy_path,
        env={**os.environ, "MYPYPATH": str(mypy_path)})


def test_the_engine_type_checks_clean(mypy_path: Path) -> None:
    result = mypy(mypy_path, "-p", "pagedserve.actors")
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_wrong_message_or_an_unhandled_one_is_a_type_error(mypy_path: Path) -> None:
    """Sending the executor's message to the scheduler, and a handler of the scheduler's
    messages that forgets one, are both reported (``assert_never`` gets a leftover type)."""
    misuse = mypy_path / "misuse.py"
    misuse.write_text(textwrap.dedent("""
        from typing_extensions import assert_never

        from pagedserve.actors.core.scheduler import Scheduler
        from pagedserve.actors.messages import (
            AbortAll, AbortRequest, AddRequest, ExecuteModel, GetStats, GrammarReady,
            NotifyWhenIdle, SchedulerMessage)


        def send_wrong(scheduler: Scheduler, message: ExecuteModel) -> None:
            scheduler.send(message)


        def handle(msg: SchedulerMessage) -> None:
            match msg:
                case AddRequest() | AbortRequest() | GrammarReady() | AbortAll():
                    pass
                case GetStats() | NotifyWhenIdle():
                    pass
                case _:
                    assert_never(msg)  # ResetPrefixCache is left
    """).lstrip())
    result = mypy(mypy_path, str(misuse))
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert ('misuse.py:10: error: Argument 1 to "send" of "Actor" has incompatible type '
            '"ExecuteModel"; expected') in out, out
    assert 'misuse.py:20: error: Argument 1 to "assert_never" has incompatible type ' \
           '"ResetPrefixCache"' in out, out
