"""The run-time thread count: others' CPU time read from a ``/proc/stat``-format file, and the
decisions it leads to (one thread fewer while a neighbour holds a core, all back after)."""

from __future__ import annotations

import pytest

from pagedserve.gpu.thread_governor import (
    CpuSample,
    ThreadGovernor,
    choose_threads,
    cpu_busy_seconds,
)

# user nice system idle iowait irq softirq steal guest guest_nice, in 1/100 s
STAT = """cpu  300 0 100 5000 20 10 10 60 0 0
cpu0 100 0 50 2500 10 5 5 40 0 0
cpu1 200 0 50 2500 10 5 5 20 0 0
intr 12345 0 0
ctxt 999
"""


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


def _window(before: CpuSample, seconds: float, busy_cores: float, our_cores: float):
    return CpuSample(before.wall + seconds, before.busy + busy_cores * seconds,
                     before.ours + our_cores * seconds)


def test_a_busy_neighbour_takes_a_thread_and_gives_it_back():
    applied: list[int] = []
    governor = ThreadGovernor(2, {0, 1}, applied.append)
    assert (governor.threads, applied) == (2, [2])
    t0 = CpuSample(wall=100.0, busy=50.0, ours=10.0)
    # Both cores busy, 1.5 of them ours: a neighbour took half a core.
    t1 = _window(t0, 0.5, busy_cores=2.0, our_cores=1.5)
    governor.observe(t0, t1)
    assert (governor.threads, applied) == (1, [2, 1])
    # One thread on the free core, the neighbour on its own: nothing changes.
    t2 = _window(t1, 0.5, busy_cores=2.0, our_cores=1.0)
    governor.observe(t1, t2)
    assert (governor.threads, applied) == (1, [2, 1])
    # The neighbour left.
    t3 = _window(t2, 0.5, busy_cores=1.05, our_cores=1.0)
    governor.observe(t2, t3)
    assert (governor.threads, applied) == (2, [2, 1, 2])


def test_our_own_load_is_not_a_neighbour():
    applied: list[int] = []
    governor = ThreadGovernor(2, {0, 1}, applied.append)
    t0 = CpuSample(wall=0.0, busy=0.0, ours=0.0)
    governor.observe(t0, _window(t0, 1.0, busy_cores=2.0, our_cores=2.0))
    assert (governor.threads, applied) == (2, [2])


def test_a_fixed_governor_never_changes_the_count(tmp_path):
    applied: list[int] = []
    governor = ThreadGovernor(3, None, applied.append)
    assert [governor.tick() for _ in range(3)] == [3, 3, 3]
    assert applied == [3]


def test_tick_judges_each_window_of_the_stat_file_it_is_given(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text(STAT)
    applied: list[int] = []
    governor = ThreadGovernor(2, {0, 1}, applied.append, interval_s=0.0, max_window_s=3600.0,
                              stat_path=stat)
    assert governor.tick() == 2  # the first look only starts a window
    # Others ran 1000 s on cpu0 since (far more than this process could have in the window).
    stat.write_text(STAT.replace("cpu0 100 0", "cpu0 100100 0"))
    assert governor.tick() == 1
    assert governor.tick() == 2  # nobody else ran since
    stat.unlink()  # unreadable later on: the count stays as it was
    assert governor.tick() == 2
    assert applied == [2, 1, 2]
