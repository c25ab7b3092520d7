"""Fewer forward-pass threads while another process holds one of our cores, all of them again
when it lets go.

Why: every operator of a step is an OpenMP parallel region whose threads meet at a barrier, so
a step runs at the pace of its slowest thread. When a busy process shares a core with one of
them, that thread gets half the core in scheduler time slices of milliseconds, and the other
waits at each of the ~300 barriers of a step: one stream fell to 2 % of its quiet speed on a
2-core machine. One thread fewer, on the cores nobody else wants, runs at its full speed.

How: before each step (on the executor thread, which is the thread whose OpenMP settings count)
``tick`` looks at most every ``interval_s`` at ``/proc/stat``: the busy time of our CPUs minus
this process's own CPU time is what others took, in cores. Cores left = ``limit`` capped by
our CPUs minus the others' share; the thread count follows it, with hysteresis so a light
background (a load generator, a shell) does not flip it. Nothing here measures our own
speed, so a slow machine is not mistaken for a contended one.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from pagedserve.gpu import cpu_threads

log = structlog.get_logger(__name__)

# Give up a thread when the cores left fall this far below the thread count...
DROP_MARGIN = 0.35
# ...and take one back only when this close to a whole free core: with a busy-loop neighbour,
# N threads on N cores leave it ~0.5 core (the scheduler splits the shared core) and N - 1
# threads leave it the whole core, so neither state argues for the other.
RAISE_MARGIN = 0.15
_TICKS_PER_SECOND = 100  # /proc/stat's unit (USER_HZ, 100 on every Linux ABI we run on)
# user nice system idle iowait irq softirq steal: everything but idle and iowait is busy;
# steal (a hypervisor running another guest on our vCPU) is a neighbour too.
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)


def cpu_busy_seconds(cpus: set[int], stat_path: str | Path = "/proc/stat") -> float | None:
    """Seconds the CPUs in ``cpus`` have been busy since boot (``/proc/stat``'s ``cpuN``
    lines); None when the file is unreadable or names none of them."""
    try:
        text = Path(stat_path).read_text()
    except OSError:
        return None
    ticks, seen = 0, False
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or not name[3:].isdigit() or int(name[3:]) not in cpus:
            continue
        fields = rest.split()
        ticks += sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
        seen = True
    return ticks / _TICKS_PER_SECOND if seen else None


def choose_threads(current: int, limit: int, free_cores: float) -> int:
    """The thread count for ``free_cores`` cores left to us, from ``current`` threads, within
    ``1..limit``: fewer when ``free_cores`` falls ``DROP_MARGIN`` below the count, more only
    when whole cores are free again (``RAISE_MARGIN``)."""
    down = math.floor(free_cores + DROP_MARGIN)
    up = math.floor(free_cores + RAISE_MARGIN)
    if down < current:
        current = down
    elif up > current:
        current = up
    return min(limit, max(1, current))


@dataclass(slots=True)
class CpuSample:
    """One look at the CPUs: when, their busy time, and how much of it was ours."""

    wall: float  # time.monotonic(), seconds
    busy: float  # seconds our CPUs were busy since boot, everyone's work
    ours: float  # this process's CPU seconds, every thread


class ThreadGovernor:
    """Owns the forward pass's thread count on the thread that calls it (OpenMP's thread count
    is per calling thread; torch's ``set_num_threads`` sets it for the caller and for our C++
    kernels, which read ``omp_get_max_threads``)."""

    def __init__(self, limit: int, cpus: set[int] | None, set_threads: Callable[[int], None],
                 interval_s: float = 0.5, max_window_s: float = 2.0,
                 stat_path: str | Path = "/proc/stat") -> None:
        """``cpus=None`` fixes the count at ``limit`` (no adapting). A window longer than
        ``max_window_s`` (the server was idle) is not judged: it starts a fresh one."""
        self.limit = limit
        self.threads = limit
        self.cpus = cpus
        self.interval_s = interval_s
        self.max_window_s = max_window_s
        self.stat_path = stat_path
        self._set_threads = set_threads
        self._last: CpuSample | None = None
        set_threads(limit)

    @classmethod
    def start(cls) -> ThreadGovernor:
        """The server's governor: ``cpu_threads()`` at most; fixed when the user chose the
        count (``PAGEDSERVE_CPU_THREADS``), with one thread, or where ``/proc/stat`` is
        unreadable."""
        import torch

        limit = cpu_threads.cpu_threads()
        cpus = cpu_threads.affinity_cpus()
        adapt = (limit > 1 and not os.environ.get(cpu_threads.THREADS_ENV)
                 and cpu_busy_seconds(cpus) is not None)
        governor = cls(limit, cpus if adapt else None, torch.set_num_threads)
        log.info("cpu_threads", threads=limit, cpus=len(cpus),
                 quota=cpu_threads.cgroup_cpu_quota(), adaptive=adapt)
        return governor

    def tick(self) -> int:
        """Call before each step; returns the thread count the step runs with. Costs a clock
        read, and a read of ``/proc/stat`` every ``interval_s``."""
        if self.cpus is None:
            return self.threads
        now = time.monotonic()
        last = self._last
        if last is not None and now - last.wall < self.interval_s:
            return self.threads
        busy = cpu_busy_seconds(self.cpus, self.stat_path)
        if busy is None:
            return self.threads
        sample = CpuSample(now, busy, time.process_time())
        self._last = sample
        # After an idle spell the window says little about now: start a fresh one.
        if last is None or now - last.wall > self.max_window_s:
            return self.threads
        self.observe(last, sample)
        return self.threads

    def observe(self, before: CpuSample, after: CpuSample) -> None:
        """Decide from one window: others' cores = (CPU busy time - ours) / wall time."""
        wall = after.wall - before.wall
        if wall <= 0:
            return
        others = max(0.0, (after.busy - before.busy) - (after.ours - before.ours)) / wall
        free = min(float(self.limit), len(self.cpus or ()) - others)
        threads = choose_threads(self.threads, self.limit, free)
        log.debug("cpu_window", others_cores=round(others, 2), threads=threads)
        if threads != self.threads:
            log.info("cpu_threads_changed", threads=threads, was=self.threads,
                     others_cores=round(others, 2), free_cores=round(free, 2))
            self._set_threads(threads)
            self.threads = threads
