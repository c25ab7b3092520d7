"""A noisy neighbour for ``bench_serving.py --noisy-neighbour``: one busy-loop process pinned to
one CPU beside the server, as another tenant's job on a shared host or a container that shares
its cores, and the summary of what the server kept of its quiet throughput.

A busy loop is the worst neighbour for threads that wait for each other: it never sleeps, so
the scheduler splits its core in time slices of milliseconds with whichever server thread lands
there (``gpu/cpu/thread_governor.py`` says what pagedserve does about it).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

_LOOP = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


def default_cpu() -> int:
    """The last CPU this process may use (CPU 1 on a 2-core machine, as the issue's runs)."""
    return max(os.sched_getaffinity(0))


@contextmanager
def busy_neighbour(cpu: int) -> Iterator[subprocess.Popen]:
    """Run one busy loop pinned to ``cpu`` (it pins itself) for the ``with`` block; it is
    killed on the way out, whatever happened inside."""
    proc = subprocess.Popen([sys.executable, "-c", _LOOP, str(cpu)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def kept(results: list[dict]) -> list[dict]:
    """Per concurrency level: median output tok/s quiet and beside the neighbour over the
    rounds, and the share kept (``noisy / quiet``). ``results`` carry ``neighbour``
    (``"quiet"`` or ``"busy"``) and ``max_concurrency``."""
    rows = []
    for level in sorted({r["max_concurrency"] for r in results}):
        tput = {side: [r["output_throughput"] for r in results
                       if r["max_concurrency"] == level and r.get("neighbour") == side]
                for side in ("quiet", "busy")}
        if not tput["quiet"] or not tput["busy"]:
            continue
        quiet, busy = statistics.median(tput["quiet"]), statistics.median(tput["busy"])
        rows.append({"max_concurrency": level, "rounds": len(tput["busy"]),
                     "quiet_tok_s": round(quiet, 2), "busy_tok_s": round(busy, 2),
                     "kept": round(busy / quiet, 3) if quiet else None})
    return rows
