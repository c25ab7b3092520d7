"""The run-time thread count: others' CPU time (a ``/proc/stat``-format file's busy ticks less the
server's own processes' CPU time, from ``/proc/<pid>/stat`` files) and the decisions it leads to:
one thread fewer while a neighbour holds a core, all back after, never a flap on noise.

The machine is synthetic (``FakeMachine``: the stat file, our CPU seconds, the clock move only
when a test says), so nothing here depends on how fast or how loaded the test machine is."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pagedserve.gpu.cpu import thread_governor as tg
from pagedserve.gpu.cpu.thread_governor import (
    ThreadGovernor,
    choose_threads,
    cpu_busy_seconds,
    own_cpu_seconds,
)

# user nice system idle iowait irq softirq steal guest guest_nice, in 1/100 s
STAT = """cpu  300 0 100 5000 20 10 10 60 0 0
cpu0 100 0 50 2500 10 5 5 40 0 0
cpu1 200 0 50 2500 10 5 5 20 0 0
intr 12345 0 0
ctxt 999
"""
WINDOW_S = 0.5  # the governor's interval_s in these tests


def test_busy_seconds_count_everything_but_idle_and_iowait(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text(STAT)
    assert cpu_busy_seconds({0}, stat) == pytest.approx(2.0)  # 100 + 50 + 5 + 5 + 40 (steal)
    assert cpu_busy_seconds({1}, stat) == pytest.approx(2.8)
    assert cpu_busy_seconds({0, 1}, stat) == pytest.approx(4.8)
    assert cpu_busy_seconds({7}, stat) is None
    assert cpu_busy_seconds({0}, tmp_path / "missing") is None


@pytest.mark.parametrize(("current", "limit", "free", "want"), [
    (2, 2, 2.0, 2),   # quiet
    (2, 2, 1.8, 2),   # a light background (a load generator) keeps both threads
    (2, 2, 1.5, 1),   # a busy loop shares a core with one of them: give it up
    (1, 2, 1.0, 1),   # ... which leaves the neighbour its whole core: stay
    (1, 2, 1.8, 1),   # hysteresis: not back on a partly free core
    (1, 2, 1.9, 2),   # the neighbour is gone
    (2, 2, 0.0, 1),   # never below one thread
    (4, 4, 9.0, 4),   # never above the limit
    (8, 8, 6.0, 6),   # two cores taken of eight
    (6, 8, 7.9, 8),
])
def test_choose_threads(current, limit, free, want):
    assert choose_threads(current, limit, free) == want


# --- our own processes' CPU time, from /proc/<pid>/stat files -----------------------------

def _stat_line(pid: int, comm: str, utime: int, stime: int, cutime: int = 0,
               cstime: int = 0) -> str:
    """A ``/proc/<pid>/stat`` line: utime stime cutime cstime are fields 14-17, in ticks."""
    return (f"{pid} ({comm}) S 1 {pid} {pid} 0 -1 4194304 100 0 0 0 "
            f"{utime} {stime} {cutime} {cstime} 20 0 8 0 12345 0 0\n")


def _process(proc: Path, name: str, line: str, children: dict[int, str]) -> None:
    """``proc/name``: its stat and one ``task/<tid>/children`` file per thread."""
    (proc / name).mkdir(parents=True)
    (proc / name / "stat").write_text(line)
    for tid, kids in children.items():
        (proc / name / "task" / str(tid)).mkdir(parents=True)
        (proc / name / "task" / str(tid) / "children").write_text(kids)


def test_own_time_is_this_process_and_every_descendant(tmp_path):
    proc = tmp_path / "proc"
    # The server (a command name with a ") " in it), two threads, one of which started a
    # worker; the worker has a child of its own and has reaped one (its cutime/cstime).
    _process(proc, "self", _stat_line(100, "pagedserve) (x", 150, 30, cutime=7, cstime=3),
             {100: "", 101: "200 300"})
    _process(proc, "200", _stat_line(200, "worker", 40, 10, cutime=5, cstime=5), {200: "201 "})
    _process(proc, "201", _stat_line(201, "helper", 20, 0), {201: ""})
    # 300 exited between the listing and the read: counts nothing this once.
    assert own_cpu_seconds(proc=proc) == pytest.approx((190 + 60 + 20) / 100)
    assert own_cpu_seconds("200", proc) == pytest.approx(0.8)
    assert own_cpu_seconds("400", proc) is None


def test_own_time_counts_a_real_child_alive_and_after_it_exits():
    """A child's CPU is the server's while it runs (its ``/proc/<pid>/stat``) and after it is
    reaped (our cutime/cstime): never a neighbour. States, not durations: the child spins
    until its own CPU clock says 0.3 s, reports, and waits for us."""
    code = ("import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.3:\n"
            "    pass\nprint(time.process_time(), flush=True)\nsys.stdin.read()\n")
    before, mine = own_cpu_seconds(), time.process_time()
    assert before is not None
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        child_cpu = float(child.stdout.readline())
        alive = own_cpu_seconds()
        ours = time.process_time() - mine
    finally:
        child.stdin.close()
        child.wait()
    reaped = own_cpu_seconds()
    # /proc truncates each of utime, stime, cutime, cstime to a tick: a few ticks either way.
    assert alive - before == pytest.approx(child_cpu + ours, abs=0.06)
    assert reaped - before >= child_cpu + ours - 0.06


# --- the governor on a synthetic machine ----------------------------------------------------

class FakeMachine:
    """Two CPUs as the governor sees them: a ``/proc/stat`` file rewritten after each stretch
    of time, our processes' exact CPU seconds, and a clock. Like the real file, the busy ticks
    are sampled: each write is off by up to ``jitter`` ticks per CPU from the exact time."""

    def __init__(self, path: Path, jitter: int = 3, seed: int = 0) -> None:
        self.path = path
        self.now = 1000.0
        self.ours = 0.0  # seconds, every process of the server
        self._busy = [0.0, 0.0]  # exact seconds: user + system
        self._steal = [0.0, 0.0]
        self._idle = [0.0, 0.0]
        self._shown = [0, 0]  # busy ticks last written (the file never goes back)
        self._jitter = jitter
        self._rng = random.Random(seed)
        self._write()

    def run(self, seconds: float, ours: float, others: float = 0.0, steal: float = 0.0) -> None:
        """``seconds`` pass: our processes use ``ours`` cores, other processes ``others``,
        the hypervisor steals ``steal``; spread evenly over both CPUs."""
        self.now += seconds
        self.ours += ours * seconds
        for cpu in (0, 1):
            self._busy[cpu] += (ours + others) / 2 * seconds
            self._steal[cpu] += steal / 2 * seconds
            self._idle[cpu] += max(0.0, 1 - (ours + others + steal) / 2) * seconds
        self._write()

    def _write(self) -> None:
        lines = []
        for cpu in (0, 1):
            noise = self._rng.randint(-self._jitter, self._jitter)
            busy = max(self._shown[cpu], int(self._busy[cpu] * 100) + noise)
            self._shown[cpu] = busy
            user, system = busy - busy // 10, busy // 10
            idle, steal = int(self._idle[cpu] * 100), int(self._steal[cpu] * 100)
            lines.append(f"cpu{cpu} {user} 0 {system} {idle} 0 0 0 {steal} 0 0")
        self.path.write_text("cpu  0 0 0 0 0 0 0 0 0 0\n" + "\n".join(lines) + "\nctxt 1\n")


Load = Callable[[int, int], tuple[float, float, float]]  # (threads, window) -> cores


def _governor(tmp_path: Path, **machine) -> tuple[ThreadGovernor, FakeMachine, list[int]]:
    m = FakeMachine(tmp_path / "stat", **machine)
    applied: list[int] = []
    governor = ThreadGovernor(2, {0, 1}, applied.append, interval_s=WINDOW_S,
                              stat_path=m.path, own_seconds=lambda: m.ours,
                              clock=lambda: m.now)
    governor.tick()  # the first look only starts a window
    return governor, m, applied


def _windows(governor: ThreadGovernor, m: FakeMachine, n: int, load: Load) -> list[int]:
    """``n`` windows of ``load`` (cores of ours, others, steal, given our thread count and the
    window's index); the thread count after each."""
    counts = []
    for i in range(n):
        ours, others, steal = load(governor.threads, i)
        m.run(WINDOW_S, ours, others, steal)
        counts.append(governor.tick())
    return counts


def _ours(threads: int) -> float:
    """Our cores on a quiet machine: the forward threads, a little less between steps, plus
    the event loop and a tokenizer worker process of ours."""
    return min(2.0, 0.9 * threads + 0.1)


def _quiet(threads: int, i: int) -> tuple[float, float, float]:
    return _ours(threads), 0.03, 0.0  # the load generator


def _busy_loop(threads: int, i: int) -> tuple[float, float, float]:
    """A busy loop on one core: with 2 threads the scheduler splits that core with one of
    ours; with 1 thread it has the core to itself."""
    return (1.5, 0.5, 0.0) if threads == 2 else (1.0, 1.0, 0.0)


def test_a_quiet_machine_with_our_own_load_and_tick_noise_keeps_every_thread(tmp_path):
    """100 s of one stream: our processes keep both CPUs busy, /proc/stat's ticks are off by a
    few either way, and every 7th window a short command elsewhere puts 0.45 of a core into
    that one window (0.32-0.44 measured on a 2-core VM; the one-window governor flapped on
    each)."""
    governor, m, applied = _governor(tmp_path)

    def load(threads: int, i: int) -> tuple[float, float, float]:
        ours, others, _ = _quiet(threads, i)
        return ours, (0.45 if i % 7 == 3 else others), 0.0

    assert _windows(governor, m, 200, load) == [2] * 200
    assert applied == [2]


def test_a_sustained_neighbour_takes_a_thread(tmp_path):
    governor, m, applied = _governor(tmp_path)
    counts = _windows(governor, m, 40, _busy_loop)
    assert counts[:tg.CONFIRM_WINDOWS - 1] == [2] * (tg.CONFIRM_WINDOWS - 1)
    assert counts[tg.CONFIRM_WINDOWS - 1:] == [1] * (41 - tg.CONFIRM_WINDOWS)
    assert applied == [2, 1]


def test_the_thread_comes_back_when_the_neighbour_leaves(tmp_path):
    governor, m, applied = _governor(tmp_path)
    _windows(governor, m, 20, _busy_loop)
    counts = _windows(governor, m, 40, _quiet)
    back = counts.index(2)
    # No sooner than CONFIRM_WINDOWS quiet windows, no later than the hold after the drop.
    assert tg.CONFIRM_WINDOWS - 1 <= back <= tg.HOLD_S / WINDOW_S + tg.CONFIRM_WINDOWS
    assert counts[back:] == [2] * (40 - back)
    assert applied == [2, 1, 2]


def test_a_one_window_blip_changes_nothing(tmp_path):
    governor, m, applied = _governor(tmp_path)
    # Both cores taken for most of one window (a short parallel command), quiet around it...
    counts = _windows(governor, m, 20, lambda t, i: (0.4, 1.6, 0.0) if i == 5 else _quiet(t, i))
    assert counts == [2] * 20
    # ... and, beside a busy loop, one window where it paused.
    _windows(governor, m, 20, _busy_loop)
    assert governor.threads == 1
    counts = _windows(governor, m, 20,
                      lambda t, i: _quiet(t, i) if i == 10 else _busy_loop(t, i))
    assert counts == [1] * 20
    assert applied == [2, 1]


def test_steal_that_only_our_second_thread_draws_backs_off_instead_of_flapping(tmp_path):
    """A VM whose host cannot give it both vCPUs: with 2 threads half a core is stolen, with
    1 nothing is. Each retry of the second thread fails, so each waits twice as long."""
    governor, m, applied = _governor(tmp_path)
    counts = _windows(governor, m, 240,  # 120 s
                      lambda t, i: (1.5, 0.03, 0.5) if t == 2 else (1.0, 0.03, 0.0))
    changes = [i for i in range(1, 240) if counts[i] != counts[i - 1]]
    raises = [i for i in changes if counts[i] == 2]
    assert len(changes) <= 12  # the one-window governor changed every window or two
    gaps = [later - earlier for earlier, later in zip(raises, raises[1:], strict=False)]
    assert len(gaps) >= 3 and gaps == sorted(set(gaps))  # each retry waits longer
    assert governor.hold_s == tg.MAX_HOLD_S
    assert len([i for i in changes if i >= 120]) <= 2  # the last minute: one retry at most
    assert applied[-1] == counts[-1]


def test_an_idle_spell_forgets_the_windows_before_it(tmp_path):
    governor, m, applied = _governor(tmp_path)
    _windows(governor, m, tg.CONFIRM_WINDOWS - 1, _busy_loop)
    m.run(30.0, 0.0, 1.0)  # the server idle, no ticks; a long window is not judged
    governor.tick()
    counts = _windows(governor, m, tg.CONFIRM_WINDOWS - 1, _busy_loop)
    assert counts == [2] * (tg.CONFIRM_WINDOWS - 1)  # the windows before the spell are gone
    assert _windows(governor, m, 1, _busy_loop) == [1]


def test_unreadable_sources_leave_the_count_as_it_was(tmp_path):
    governor, m, applied = _governor(tmp_path)
    _windows(governor, m, 10, _busy_loop)
    m.path.unlink()
    assert [governor.tick() for _ in range(3)] == [1, 1, 1]
    blind = ThreadGovernor(2, {0, 1}, applied.append, interval_s=0.0, stat_path=m.path,
                           own_seconds=lambda: None, clock=lambda: m.now)
    m.run(WINDOW_S, 1.0, 1.0)
    assert [blind.tick() for _ in range(5)] == [2] * 5
    assert applied == [2, 1, 2]  # the second governor's start


def test_a_fixed_governor_never_changes_the_count():
    applied: list[int] = []
    governor = ThreadGovernor(3, None, applied.append)
    assert [governor.tick() for _ in range(3)] == [3, 3, 3]
    assert applied == [3]
