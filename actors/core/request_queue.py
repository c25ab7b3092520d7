"""The scheduler's request collections, each with O(1) removal so that an abort costs the same
however many requests there are (200 clients leaving at once must not cost 200 list scans
before the next step).

The waiting queue under each scheduling policy (vLLM V1's
``vllm/v1/core/sched/request_queue.py``): FCFS is an ordered dict used as a deque with removal
by key; priority is a heap keyed by ``(priority, arrival_time)``, lower first, whose removals
are lazy (skipped when they reach the top). ``RunningRequests`` is the running list, in
admission order.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from pagedserve.actors.core.request import Request

POLICIES = ("fcfs", "priority")


class FCFSRequestQueue:
    """Arrival order; a preempted request goes back to the front. Requests are keys (they hash
    by identity), so ``remove`` is O(1)."""

    def __init__(self) -> None:
        self._q: OrderedDict[Request, None] = OrderedDict()

    def add(self, request: Request) -> None:
        self._q[request] = None

    def prepend(self, request: Request) -> None:
        """A preempted request goes back to the front."""
        self._q[request] = None
        self._q.move_to_end(request, last=False)

    def peek(self) -> Request:
        return next(iter(self._q))

    def pop(self) -> Request:
        return self._q.popitem(last=False)[0]

    def remove(self, request: Request) -> None:
        del self._q[request]

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityRequestQueue:
    """Min-heap on ``(priority, arrival_time)``; a preempted request keeps its place by key.
    ``remove`` only marks the request (O(1)); marked entries are dropped as they reach the
    top, and skipped when iterating."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._tie = itertools.count()
        self._removed: set[Request] = set()

    def add(self, request: Request) -> None:
        heapq.heappush(
            self._heap, (request.priority, request.arrival_time, next(self._tie), request)
        )

    prepend = add

    def _drop_removed_top(self) -> None:
        while self._heap and self._heap[0][3] in self._removed:
            self._removed.discard(heapq.heappop(self._heap)[3])

    def peek(self) -> Request:
        self._drop_removed_top()
        return self._heap[0][3]

    def pop(self) -> Request:
        self._drop_removed_top()
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        """``request`` must be in the queue (the scheduler knows it is: it is waiting)."""
        self._removed.add(request)

    def __len__(self) -> int:
        return len(self._heap) - len(self._removed)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap) if e[3] not in self._removed)


class RunningRequests:
    """The running requests in admission order (or best first, once ``sort``-ed under the
    priority policy): ``append``, ``pop`` of the last (the preemption victim), ``remove`` and
    membership are O(1); the list-like rest is what ``StepPlanner`` uses."""

    def __init__(self) -> None:
        self._d: OrderedDict[Request, None] = OrderedDict()

    def append(self, request: Request) -> None:
        self._d[request] = None

    def pop(self) -> Request:
        return self._d.popitem(last=True)[0]

    def remove(self, request: Request) -> None:
        del self._d[request]

    def sort(self, key: Callable[[Request], Any]) -> None:
        ordered = sorted(self._d, key=key)
        self._d = OrderedDict.fromkeys(ordered)

    def __getitem__(self, index: int) -> Request:
        if index == -1:
            return next(reversed(self._d))
        return list(self._d)[index]

    def __contains__(self, request: object) -> bool:
        return request in self._d

    def __len__(self) -> int:
        return len(self._d)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._d)


RequestQueue = FCFSRequestQueue | PriorityRequestQueue  # the waiting queue, by policy


def make_request_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}; choose one of {POLICIES}")
