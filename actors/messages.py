"""Messages between the request tasks, the scheduler actor and the executor actor: one union
per actor's mailbox (``SchedulerMessage``, ``ExecutorMessage``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve.actors.beam.search import BeamSearch
from pagedserve.actors.core.request import Request
from pagedserve.gpu.batch import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from pagedserve.actors.stats import StatsSnapshot


@dataclass(slots=True)
class AddRequest:
    """Request task → scheduler: queue a new request. ``accepted`` resolves once it is queued,
    or fails with ``EngineOverloaded`` / ``DuplicateRequestId``. With ``beam_search``, the
    request is the root of a beam search (``actors/beam/group.py``)."""

    request: Request
    accepted: asyncio.Future[None] | None = None
    beam_search: BeamSearch | None = None


@dataclass(slots=True)
class AbortRequest:
    """Request task → scheduler: the client went away (or a stop string matched); free the
    request's blocks before the next step."""

    request_id: str


@dataclass(slots=True)
class GrammarReady:
    """Grammar compile → scheduler: a request parked in ``WAITING_FOR_GRAMMAR`` can go on."""

    request_id: str


@dataclass(slots=True)
class AbortAll:
    """Shutdown → scheduler: end every request (their streams report ``reason``); with
    ``unstarted_only``, those still waiting that have no output yet (a drain's start: only
    running requests get its grace)."""

    reason: str
    unstarted_only: bool = False


@dataclass(slots=True)
class GetStats:
    """Anyone → scheduler: reply with a stats snapshot."""

    reply: asyncio.Future[StatsSnapshot]


@dataclass(slots=True)
class NotifyWhenIdle:
    """Drain → scheduler: resolve ``reply`` once nothing is running or waiting (at once if
    nothing is). A request parked for its grammar compile is not waiting yet: it does not
    count (as in ``Scheduler.has_unfinished_requests``)."""

    reply: asyncio.Future[None]


@dataclass(slots=True)
class ResetPrefixCache:
    """Admin → scheduler: forget cached blocks nobody holds; replies with how many."""

    reply: asyncio.Future[int]


@dataclass(slots=True)
class ExecuteModel:
    """Scheduler → executor: run one step; the reply carries the sampled tokens."""

    scheduler_output: SchedulerOutput
    reply: asyncio.Future[ModelRunnerOutput]


# What each actor's mailbox takes (``Actor[M]``); the scheduler matches on every member.
SchedulerMessage = (AddRequest | AbortRequest | GrammarReady | AbortAll | GetStats
                    | NotifyWhenIdle | ResetPrefixCache)
ExecutorMessage = ExecuteModel
