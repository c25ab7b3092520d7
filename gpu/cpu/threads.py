"""How many CPU threads the forward pass may use, and how they wait for each other.

Two facts decide it, both read from the process, never from the machine's core count:

- the CPUs this process may run on (``os.sched_getaffinity``: ``taskset``, cpusets, Kubernetes
  static CPU manager);
- the cgroup's CPU quota (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``:
  ``docker --cpus``, Kubernetes CPU limits), the lowest along the cgroup's path to the root.

And one environment default: torch's intra-op pool and our C++ kernels (``kernels/csrc``) share
one libgomp, whose idle threads spin for ``GOMP_SPINCOUNT`` iterations (300,000 unless set,
several milliseconds) before they sleep. A spinning thread on a core another process wants is
what turns a noisy neighbour into a collapse; the bounded spin below covers the few
microseconds between two operators of a step and sleeps through anything longer. libgomp reads
it once, when torch loads it, so ``openmp_defaults`` must go into the environment before
``import torch`` (``server/cli.py`` does it first thing); this module imports nothing heavy.

After Go's ``automaxprocs`` and the JVM's container support (quota / period, rounded down).
The run-time side, fewer threads while another process holds a core, is
``gpu/cpu/thread_governor.py``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

THREADS_ENV = "PAGEDSERVE_CPU_THREADS"

# Read by libgomp at load. 20,000 PAUSE iterations are ~0.2-0.5 ms on current x86 cores.
OPENMP_DEFAULTS: dict[str, str] = {"GOMP_SPINCOUNT": "20000"}


def openmp_defaults(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ones of ``OPENMP_DEFAULTS`` to add to ``environ`` (default ``os.environ``): those
    the user has not set, theirs always win. The server does
    ``os.environ.update(openmp_defaults())`` before anything loads torch.

    A user-set ``OMP_WAIT_POLICY`` wins too: libgomp derives the spin from it unless
    ``GOMP_SPINCOUNT`` is set, so we add nothing then.
    """
    env = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" in env:
        return {}
    return {k: v for k, v in OPENMP_DEFAULTS.items() if k not in env}


def affinity_cpus() -> set[int]:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def cgroup_cpu_quota(proc_cgroup: str | Path = "/proc/self/cgroup",
                     cgroup_root: str | Path = "/sys/fs/cgroup") -> float | None:
    """Cores this process's cgroup may use on average (quota / period), the lowest limit on
    the path from its cgroup up to the root; None when nothing limits it or nothing is
    readable. v2 (``0::/path`` in ``proc_cgroup``) is read first, then v1's ``cpu``
    controller."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    root = Path(cgroup_root)
    limits: list[float] = []
    for line in lines:
        hier, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hier == "0" and controllers == "":
            limits += _walk(root, path, _v2_limit)
        elif "cpu" in controllers.split(","):
            mount = next((root / name for name in (controllers, "cpu", "cpu,cpuacct")
                          if (root / name).is_dir()), None)
            if mount is not None:
                limits += _walk(mount, path, _v1_limit)
    return min(limits) if limits else None


def _walk(mount: Path, path: str, read) -> list[float]:
    """Limits found in ``mount/path`` and each of its parents up to ``mount``. Inside a
    container the cgroup namespace shows ``/`` and the mount is the container's own cgroup."""
    found = []
    parts = [p for p in path.strip("/").split("/") if p]
    for depth in range(len(parts), -1, -1):
        limit = read(mount.joinpath(*parts[:depth]))
        if limit is not None:
            found.append(limit)
    return found


def _v2_limit(folder: Path) -> float | None:
    """``cpu.max`` is ``"$MAX $PERIOD"``, ``max`` meaning no limit (microseconds)."""
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max" or int(period) <= 0:
        return None
    return int(quota) / int(period)


def _v1_limit(folder: Path) -> float | None:
    """``cpu.cfs_quota_us`` is -1 without a limit; the period is ``cpu.cfs_period_us``."""
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    if quota <= 0 or period <= 0:
        return None
    return quota / period


def available_cpus(cpus: set[int] | None = None, quota: float | None = None) -> int:
    """Whole cores the process can count on: its CPUs, capped by the quota rounded down (a
    1.5-core quota guarantees one; a second thread would spend the rest of each period
    throttled, stalling the whole step), never below 1."""
    count = len(affinity_cpus() if cpus is None else cpus)
    if quota is not None:
        count = min(count, math.floor(quota))
    return max(1, count)


def cpu_threads() -> int:
    """Threads for the forward pass: ``PAGEDSERVE_CPU_THREADS``, else ``available_cpus()``.

    The event loop (HTTP, SSE, detokenizing) shares a core with one of them; it is light
    enough that on a quiet 2-core machine 2 threads beat 1 end to end: 122 against 72 output
    tok/s at 8 streams, 203 against 140 at 32 (loadgen workload, bfloat16). When another
    process takes a core, ``gpu/cpu/thread_governor.py`` uses fewer.

    Raises ``ValueError`` for a ``PAGEDSERVE_CPU_THREADS`` that is not a positive integer.
    """
    env = os.environ.get(THREADS_ENV)
    if env:
        try:
            n = int(env)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"{THREADS_ENV}={env!r}: give a positive number of threads")
        return n
    return available_cpus(quota=cgroup_cpu_quota())
