"""The scheduler's request collections: order kept under removal from anywhere, in O(1)."""

from __future__ import annotations

import pytest

from pagedserve.actors.core.request_queue import RunningRequests, make_request_queue
from tests.actors.core.test_scheduler import req


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_removal_from_anywhere_keeps_the_order_of_the_rest(policy):
    q = make_request_queue(policy)
    rs = [req(f"r{i}", 3, priority=i % 3, arrival=float(i)) for i in range(8)]
    for r in rs:
        q.add(r)
    want = list(q)
    for gone in (want[0], want[3], want[-1]):  # the head, the middle, the tail
        q.remove(gone)
        want.remove(gone)
    assert list(q) == want and len(q) == len(want)
    assert q.peek() is want[0]
    q.prepend(preempted := req("back", 3, priority=-1))
    assert q.peek() is preempted
    assert [q.pop() for _ in range(len(q))] == [preempted, *want] and not q


def test_running_requests_pop_the_last_admitted_and_remove_any():
    running = RunningRequests()
    rs = [req(f"r{i}", 3, priority=3 - i) for i in range(4)]
    for r in rs:
        running.append(r)
    running.remove(rs[1])
    assert rs[1] not in running and list(running) == [rs[0], rs[2], rs[3]]
    assert running[-1] is rs[3] and running.pop() is rs[3]
    running.sort(key=lambda r: r.priority)
    assert list(running) == [rs[2], rs[0]] and len(running) == 2
