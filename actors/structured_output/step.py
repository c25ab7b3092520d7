"""Guided requests in the scheduler's step: the batch's grammar bitmask, and each sampled
token fed to its request's matcher (the compile side is ``actors/structured_output/manager.py``).
"""

from __future__ import annotations

import structlog
import torch
import xgrammar as xgr

from pagedserve.actors.core.request import Request, RequestStatus
from pagedserve.gpu.batch import ScheduledRequest

log = structlog.get_logger(__name__)


def grammar_bitmask(
    scheduled: list[ScheduledRequest], requests: dict[str, Request]
) -> tuple[torch.Tensor | None, dict[str, int]]:
    """The batch's bitmask: one row per guided request that samples this step (``k + 1``
    consecutive rows for one with ``k`` drafts: the grammar's state after each draft), and the
    first row of each request id. ``(None, {})`` when there is none (unguided batches build
    nothing)."""
    guided = [(scheduled_request, structured_output) for scheduled_request in scheduled
              if scheduled_request.sample and (
                  structured_output := requests[scheduled_request.req_id].structured_output)
              is not None]
    if not guided:
        return None, {}
    num_rows = sum(len(scheduled_request.spec_token_ids) + 1 for scheduled_request, _ in guided)
    bitmask = xgr.allocate_token_bitmask(num_rows, guided[0][1].vocab_size)
    first: dict[str, int] = {}
    row = 0
    for scheduled_request, structured_output in guided:
        first[scheduled_request.req_id] = row
        _fill_rows(structured_output.matcher, bitmask, row, scheduled_request.spec_token_ids)
        row += len(scheduled_request.spec_token_ids) + 1
    return bitmask, first


def _fill_rows(matcher: xgr.GrammarMatcher, bitmask: torch.Tensor, row: int,
               drafts: list[int]) -> None:
    """Rows ``row .. row + len(drafts)``: the mask now and after each draft (speculative
    decoding; vLLM's ``StructuredOutputManager.grammar_bitmask`` does the same), then roll the
    matcher back. Past a draft the grammar refuses (or one that completes it) the rows stay
    all-allowed: the refused draft is masked in the row before, so it is rejected there and
    the later rows are never used."""
    matcher.fill_next_token_bitmask(bitmask, row)
    advanced = 0
    for j, token in enumerate(drafts, start=1):
        if matcher.is_terminated() or not matcher.accept_token(token):
            break
        advanced += 1
        if matcher.is_terminated():
            break
        matcher.fill_next_token_bitmask(bitmask, row + j)
    if advanced:
        matcher.rollback(advanced)


def advance(request: Request, new_token_ids: list[int]) -> RequestStatus | None:
    """Feed a guided request's sampled tokens to its matcher.

    Returns ``FINISHED_STOPPED`` when the grammar is complete (the matcher accepted a stop
    token), ``FINISHED_ERROR`` if a token was refused (cannot happen with the bitmask applied),
    else ``None``. Unguided requests: ``None``.
    """
    structured_output = request.structured_output
    if structured_output is None:
        return None
    matcher = structured_output.matcher
    for token in new_token_ids:
        if not matcher.accept_token(token):
            log.error("grammar_rejected_token", request_id=request.request_id, token=token)
            return RequestStatus.FINISHED_ERROR
        if matcher.is_terminated():
            return RequestStatus.FINISHED_STOPPED
    return None
