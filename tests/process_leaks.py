"""Finding the server and worker processes a test session left behind (issue 13: "no orphan
process after the suite").

Two ways a process is the session's: it descends from the pytest process (through
``/proc/<pid>/stat``'s parent field), or it carries ``SESSION_ENV`` in its environment, which
the session sets before any test runs and every ``pagedserve serve`` and spawned worker
inherits. The second finds an orphan too: a worker whose server died is re-parented to init
and descends from nobody here. Of those, a leak is a live (not zombie) ``pagedserve``
process, a ``multiprocessing`` spawn child (a parallel worker) or a Ray process (the ray
backend's local instance: gcs_server, raylet, agents, actors); multiprocessing's own
resource tracker, which lives until pytest exits, is not. Linux ``/proc`` only.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

SESSION_ENV = "PAGEDSERVE_TEST_SESSION"
PROC = Path("/proc")


@dataclass(slots=True)
class Proc:
    pid: int
    ppid: int
    state: str
    cmdline: str
    marked: bool  # carries SESSION_ENV=<this session>


def _read(pid: int, session: str) -> Proc | None:
    base = PROC / str(pid)
    try:
        fields = (base / "stat").read_text().rsplit(")", 1)[1].split()
        cmdline = (base / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        try:
            environ = (base / "environ").read_bytes().split(b"\0")
        except OSError:  # another user's process
            environ = []
    except (OSError, IndexError):  # gone meanwhile
        return None
    marked = f"{SESSION_ENV}={session}".encode() in environ
    return Proc(pid, int(fields[1]), fields[0], cmdline.strip(), marked)


def is_ray(p: Proc) -> bool:
    """One of Ray's processes: its gcs_server, raylet, agents and monitors (programs under the
    ``ray`` package) or a worker (which renames itself ``ray::<what it runs>``)."""
    return p.cmdline.startswith("ray::") or "site-packages/ray/" in p.cmdline


def _is_ours(p: Proc) -> bool:
    if p.state in ("Z", "X"):
        return False
    return "pagedserve" in p.cmdline or is_ray(p) or "--multiprocessing-fork" in p.cmdline and (
        "resource_tracker" not in p.cmdline)


def leaked(root: int, session: str) -> list[Proc]:
    """The live pagedserve servers and workers of this session other than ``root`` itself."""
    procs = [p for e in PROC.iterdir() if e.name.isdigit()
             if (p := _read(int(e.name), session)) is not None]
    children: dict[int, list[Proc]] = {}
    for p in procs:
        children.setdefault(p.ppid, []).append(p)
    descendants: set[int] = set()
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), []):
            if child.pid not in descendants:
                descendants.add(child.pid)
                stack.append(child.pid)
    return [p for p in procs if p.pid != root and (p.pid in descendants or p.marked)
            and _is_ours(p)]


def wait_none_leaked(root: int, session: str, timeout: float = 30.0) -> list[Proc]:
    """Until nothing is left (a server told to stop may still be exiting); what is left
    after ``timeout``, which only catches a leak."""
    deadline = time.monotonic() + timeout
    while (left := leaked(root, session)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def available() -> bool:
    return (PROC / str(os.getpid()) / "environ").exists()
