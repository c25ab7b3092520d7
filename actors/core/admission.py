"""Requests in: what an arrival passes before the scheduler holds it.

``AddRequest`` is refused when the id is taken by a live request (``DuplicateRequestId``) or
``--max-waiting-requests`` are already waiting (``EngineOverloaded``); the refusal answers the
request task's ``accepted`` future, so it becomes an HTTP error before any response starts.
An accepted request joins the waiting queue, or, when it is guided and its grammar is still
compiling, waits parked (``WAITING_FOR_GRAMMAR``, in no queue) while the others run: the
compile's end posts ``GrammarReady`` to the scheduler, and ``grammar_ready`` queues it then, or
fails it with the compile's error. Runs in the scheduler's task, on the scheduler's state.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pagedserve.actors.beam.group import BeamScheduler
from pagedserve.actors.beam.search import BeamSearch
from pagedserve.actors.core.request import Request, RequestOutput, RequestStatus
from pagedserve.actors.core.request_queue import RequestQueue
from pagedserve.actors.errors import DuplicateRequestId, EngineOverloaded
from pagedserve.actors.kv.kv_cache_manager import KVCacheManager
from pagedserve.actors.messages import AddRequest


class Admission:
    """Args:
    requests, waiting, beams, kv: the scheduler's (every live request by id, its waiting queue,
        its beam searches, its KV cache manager).
    max_waiting_requests: ``--max-waiting-requests``; ``None``: no limit.
    grammar_ready: posts ``GrammarReady(request_id)`` to the scheduler's mailbox.
    finish: the scheduler's ``_finish`` (a request whose grammar failed ends with its error).
    """

    def __init__(self, requests: dict[str, Request], waiting: RequestQueue,
                 beams: BeamScheduler, kv: KVCacheManager, max_waiting_requests: int | None,
                 grammar_ready: Callable[[str], None],
                 finish: Callable[[Request, RequestStatus], None]):
        self.requests = requests
        self.waiting = waiting
        self.beams = beams
        self.kv = kv
        self.max_waiting_requests = max_waiting_requests
        self.post_grammar_ready = grammar_ready
        self.finish = finish
        self.waiting_for_grammar: dict[str, Request] = {}  # guided, compile in flight

    def on_add(self, msg: AddRequest) -> None:
        """Accept or refuse ``msg.request``, and say which on ``msg.accepted`` (without one,
        a refusal goes to the request's queue as its error)."""
        request, accepted = msg.request, msg.accepted
        error: Exception | None = None
        limit = self.max_waiting_requests
        if request.request_id in self.requests:
            error = DuplicateRequestId(f"a request with id {request.request_id!r} is running")
        elif limit is not None and len(self.waiting) >= limit:
            error = EngineOverloaded(f"server overloaded: {len(self.waiting)} requests waiting")
        if accepted is not None and accepted.done():  # the request task was cancelled
            return
        if error is None:
            self.add(request, msg.beam_search)
        if accepted is not None and error is not None:
            accepted.set_exception(error)
        elif accepted is not None:
            accepted.set_result(None)
        elif error is not None:
            request.output_queue.put_nowait(RequestOutput([], "error", str(error)))

    def add(self, request: Request, beam_search: BeamSearch | None = None) -> None:
        """Queue ``request``; with ``beam_search``, as the root of that search's beams."""
        self.requests[request.request_id] = request
        if beam_search is not None:
            self.beams.add(request, beam_search)
        self.kv.update_block_hashes(request)
        guided = request.structured_output
        if guided is not None and not (guided.ready and guided.error is None):
            # Park it until its compile ends (GrammarReady); the others keep running.
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.waiting_for_grammar[request.request_id] = request
            guided.notify_when_ready(asyncio.get_running_loop(),
                                     lambda: self.post_grammar_ready(request.request_id))
            return
        self.waiting.add(request)

    def grammar_ready(self, request_id: str) -> None:
        """A parked request's compile ended: queue it, or fail it with the compile error."""
        request = self.waiting_for_grammar.get(request_id)
        if request is None:
            return  # aborted meanwhile
        error = request.structured_output.error  # type: ignore[union-attr]
        if error is not None:
            self.finish(request, RequestStatus.FINISHED_ERROR)
            request.output_queue.put_nowait(RequestOutput([], "error", error))
            return
        del self.waiting_for_grammar[request_id]
        request.status = RequestStatus.WAITING
        self.waiting.add(request)
