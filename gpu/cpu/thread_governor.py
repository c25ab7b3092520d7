"""Fewer forward-pass threads while another process holds one of our cores, all of them again
when it lets go.

Why: every operator of a step is an OpenMP parallel region whose threads meet at a barrier, so
a step runs at the pace of its slowest thread. When a busy process shares a core with one of
them, that thread gets half the core in scheduler time slices of milliseconds, and the other
waits at each of the ~300 barriers of a step: one stream fell to 2 % of its quiet speed on a
2-core machine. One thread fewer, on the cores nobody else wants, runs at its full speed.

How: before each step (on the executor thread, which is the thread whose OpenMP settings count)
``tick`` looks at most every ``interval_s``: the busy time of our CPUs (``/proc/stat``) minus
the CPU time of the server's own processes (``own_cpu_seconds``: this process, every thread,
and its children, from ``/proc/<pid>/stat``, in the same USER_HZ ticks) is what others took in
that window, in cores. Nothing here measures our own speed, so a slow machine is not mistaken
for a contended one.

Why it judges several windows, not one: a window is short (0.5 s, 100 ticks on 2 CPUs) and
others' time arrives in lumps: a shell command, a cron job, a kernel worker, a burst of
hypervisor steal puts 0.3-0.4 of a core into one window and nothing into the next (measured on
a 2-core VM beside one stream and its load generator: others read 0.00-0.08 per window, and a
short command run elsewhere put 0.32-0.44 into single windows; the one-window governor this
replaced went 2 -> 1 -> 2 threads within two seconds on each above 0.35).
``/proc/stat`` also samples at the scheduler tick while a process's time is its exact run time
rounded, so the two differ by a few ticks either way. So the count changes only when each of
the last ``CONFIRM_WINDOWS`` windows, taken at the current count, argues for it (``choose_threads``
with hysteresis between ``DROP_MARGIN`` and ``RAISE_MARGIN``). And a neighbour can exist only
while we use every core (steal when the host cannot give a VM all its vCPUs): with fewer
threads they vanish, and a naive governor takes the thread back and loses it again. A thread
taken back therefore waits ``hold`` seconds after the drop, and a drop that undoes a raise
within ``REGRET_S`` doubles that hold (up to ``MAX_HOLD_S``): a retry every minute at worst.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from pagedserve.gpu.cpu import threads as cpu_threads

log = structlog.get_logger(__name__)

# Give up a thread when the cores left fall this far below the thread count...
DROP_MARGIN = 0.35
# ...and take one back only when this close to a whole free core: with a busy-loop neighbour,
# N threads on N cores leave it ~0.5 core (the scheduler splits the shared core) and N - 1
# threads leave it the whole core, so neither state argues for the other.
RAISE_MARGIN = 0.15
# Windows in a row (at the current count) that must all argue for a change.
CONFIRM_WINDOWS = 3
# After a drop, seconds before a thread may come back; doubled by each drop that undoes a raise
# younger than REGRET_S, up to MAX_HOLD_S; a drop long after the last raise resets it.
HOLD_S = 3.0
REGRET_S = 10.0
MAX_HOLD_S = 60.0
_TICKS_PER_SECOND = 100  # /proc's unit (USER_HZ, 100 on every Linux ABI we run on)
# user nice system idle iowait irq softirq steal: everything but idle and iowait is busy;
# steal (a hypervisor running another guest on our vCPU) is a neighbour too.
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
# /proc/<pid>/stat after the ")" that ends the command name: utime stime cutime cstime.
_OWN_FIELDS = (11, 12, 13, 14)


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


def own_cpu_seconds(pid: str = "self", proc: str | Path = "/proc") -> float | None:
    """CPU seconds of process ``pid`` and everything it started: for it and each live
    descendant (``task/*/children``), utime + stime (its threads, the live and the ended) +
    cutime + cstime (its children already reaped), so a child's time stays counted when it
    exits. USER_HZ ticks, as ``/proc/stat``. None when ``pid``'s own stat is unreadable; a
    descendant that exits while being read counts 0 this once."""
    root = Path(proc)
    own = _process_ticks(root / pid)
    if own is None:
        return None
    ticks, todo, seen = own, _children(root / pid), set()
    while todo:
        child = todo.pop()
        if child in seen:
            continue
        seen.add(child)
        ticks += _process_ticks(root / child) or 0
        todo += _children(root / child)
    return ticks / _TICKS_PER_SECOND


def _process_ticks(folder: Path) -> int | None:
    try:
        fields = (folder / "stat").read_text().rpartition(")")[2].split()
        return sum(int(fields[i]) for i in _OWN_FIELDS)
    except (OSError, ValueError, IndexError):
        return None


def _children(folder: Path) -> list[str]:
    """Pids of the children of every thread of the process in ``folder``."""
    try:
        tasks = list((folder / "task").iterdir())
    except OSError:
        return []
    pids: list[str] = []
    for task in tasks:
        try:
            pids += (task / "children").read_text().split()
        except OSError:
            pass
    return pids


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

    wall: float  # the governor's clock (time.monotonic()), seconds
    busy: float  # seconds our CPUs were busy since boot, everyone's work
    ours: float  # CPU seconds of the server's processes (own_cpu_seconds), every thread


class ThreadGovernor:
    """Owns the forward pass's thread count on the thread that calls it (OpenMP's thread count
    is per calling thread; torch's ``set_num_threads`` sets it for the caller and for our C++
    kernels, which read ``omp_get_max_threads``)."""

    def __init__(self, limit: int, cpus: set[int] | None, set_threads: Callable[[int], None],
                 interval_s: float = 0.5, max_window_s: float = 2.0,
                 stat_path: str | Path = "/proc/stat",
                 own_seconds: Callable[[], float | None] = own_cpu_seconds,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``cpus=None`` fixes the count at ``limit`` (no adapting). A window longer than
        ``max_window_s`` (the server was idle) is not judged, and forgets the windows before
        it. ``own_seconds``: the server's CPU seconds (None: unreadable); ``clock``: seconds."""
        self.limit = limit
        self.threads = limit
        self.cpus = cpus
        self.interval_s = interval_s
        self.max_window_s = max_window_s
        self.stat_path = stat_path
        self.hold_s = HOLD_S
        self._set_threads = set_threads
        self._own_seconds = own_seconds
        self._clock = clock
        self._last: CpuSample | None = None
        self._others: deque[float] = deque(maxlen=CONFIRM_WINDOWS)  # cores, at self.threads
        self._dropped_at = -math.inf
        self._raised_at = -math.inf
        set_threads(limit)

    @classmethod
    def start(cls) -> ThreadGovernor:
        """The server's governor: ``cpu_threads()`` at most; fixed when the user chose the
        count (``PAGEDSERVE_CPU_THREADS``), with one thread, or where ``/proc`` is
        unreadable."""
        import torch

        limit = cpu_threads.cpu_threads()
        cpus = cpu_threads.affinity_cpus()
        adapt = (limit > 1 and not os.environ.get(cpu_threads.THREADS_ENV)
                 and cpu_busy_seconds(cpus) is not None and own_cpu_seconds() is not None)
        governor = cls(limit, cpus if adapt else None, torch.set_num_threads)
        log.info("cpu_threads", threads=limit, cpus=len(cpus),
                 quota=cpu_threads.cgroup_cpu_quota(), adaptive=adapt)
        return governor

    def tick(self) -> int:
        """Call before each step; returns the thread count the step runs with. Costs a clock
        read, and every ``interval_s`` a read of ``/proc/stat`` and of our processes' stat."""
        if self.cpus is None:
            return self.threads
        now = self._clock()
        last = self._last
        if last is not None and now - last.wall < self.interval_s:
            return self.threads
        busy = cpu_busy_seconds(self.cpus, self.stat_path)
        ours = self._own_seconds()
        if busy is None or ours is None:
            return self.threads
        sample = CpuSample(now, busy, ours)
        self._last = sample
        # After an idle spell the windows say little about now: start afresh.
        if last is None or now - last.wall > self.max_window_s:
            self._others.clear()
            return self.threads
        self.observe(last, sample)
        return self.threads

    def observe(self, before: CpuSample, after: CpuSample) -> None:
        """Record one window (others' cores = (CPU busy time - ours) / wall time), then
        change the count if the last ``CONFIRM_WINDOWS`` windows all argue for it."""
        wall = after.wall - before.wall
        if wall <= 0:
            return
        others = max(0.0, (after.busy - before.busy) - (after.ours - before.ours)) / wall
        self._others.append(others)
        log.debug("cpu_window", others_cores=round(others, 2), threads=self.threads)
        if len(self._others) == CONFIRM_WINDOWS:
            self._decide(after.wall)

    def _decide(self, now: float) -> None:
        """Fewer threads when even the quietest recent window calls for it, more when even
        the busiest does and the hold since the last drop has passed."""
        cores = float(len(self.cpus or ()))
        fewest, most = min(self._others), max(self._others)
        threads = choose_threads(self.threads, self.limit, min(self.limit, cores - fewest))
        judged = fewest
        if threads >= self.threads:
            threads = choose_threads(self.threads, self.limit, min(self.limit, cores - most))
            judged = most
            if threads <= self.threads or now - self._dropped_at < self.hold_s:
                return
            self._raised_at = now
        else:
            # A drop soon after a raise: what we saw at fewer threads was not the whole story.
            regret = now - self._raised_at < REGRET_S
            self.hold_s = min(MAX_HOLD_S, 2 * self.hold_s) if regret else HOLD_S
            self._dropped_at = now
        log.info("cpu_threads_changed", threads=threads, was=self.threads,
                 others_cores=round(judged, 2), free_cores=round(cores - judged, 2),
                 hold_s=self.hold_s)
        self._set_threads(threads)
        self.threads = threads
        self._others.clear()  # the next decision is judged at the new count
