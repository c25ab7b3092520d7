"""The server process's OpenMP defaults are in the environment before torch loads libgomp, and
the user's own settings win. libgomp itself says what it read (``OMP_DISPLAY_ENV=VERBOSE``
prints its settings when it is loaded), so this checks the spin the threads really use."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.gpu.cpu.threads import OPENMP_DEFAULTS

PAGEDSERVE = Path(sys.executable).parent / "pagedserve"


def _libgomp_settings(**env: str) -> dict[str, str]:
    """What libgomp read in a fresh ``pagedserve serve`` that loads torch, then stops at its
    model (``--help`` no longer imports torch)."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("OMP_", "GOMP_", "KMP_"))}  # as a user who set none
    r = subprocess.run([str(PAGEDSERVE), "serve", "/nonexistent/absent.gguf"],
                       capture_output=True, text=True,
                       env={**base, "OMP_DISPLAY_ENV": "VERBOSE", **env}, timeout=300)
    assert r.returncode == 1 and "GGUF file not found" in r.stderr, r.stderr[-3000:]
    assert "OPENMP DISPLAY ENVIRONMENT BEGIN" in r.stderr, "torch (libgomp) was not loaded"
    return dict(re.findall(r"^\s+([A-Z_]+) = '([^']*)'", r.stderr, re.MULTILINE))


@pytest.mark.skipif(not PAGEDSERVE.exists(), reason="the console script is not installed")
def test_server_threads_spin_briefly_by_default():
    assert _libgomp_settings()["GOMP_SPINCOUNT"] == OPENMP_DEFAULTS["GOMP_SPINCOUNT"]


@pytest.mark.skipif(not PAGEDSERVE.exists(), reason="the console script is not installed")
def test_the_users_openmp_settings_win():
    assert _libgomp_settings(GOMP_SPINCOUNT="1234")["GOMP_SPINCOUNT"] == "1234"
    active = _libgomp_settings(OMP_WAIT_POLICY="ACTIVE")
    assert active["OMP_WAIT_POLICY"] == "ACTIVE"
    # libgomp's own spin for an active policy (minutes), not our bounded one.
    assert int(active["GOMP_SPINCOUNT"]) > int(OPENMP_DEFAULTS["GOMP_SPINCOUNT"])
