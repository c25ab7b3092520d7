"""Verify drafted tokens so the output keeps the target model's distribution, at any
temperature (speculative sampling: Leviathan et al. 2023, Chen et al. 2023; the idea of
vLLM's ``vllm/v1/sample/rejection_sampler.py``).

A request with ``k`` drafts ``d_1..d_k`` has ``k + 1`` logits rows from the verify step: row
``j`` is the target's next-token distribution ``p_j`` after the last sampled token and
``d_1..d_j``. Every row gets the whole sampling pipeline of plain decoding
(``gpu/sample/sampler.py``'s ``target_distribution``: logit bias, min_tokens, penalties over the
history *including the drafts before it*, temperature, min-p, top-k/top-p; the grammar bitmask
is applied per row before), so ``p_j`` is exactly what plain decoding would sample from had it
produced ``d_1..d_j``.

Then, position by position: draft ``d_j`` drawn from ``q_j`` is accepted with probability
``min(1, p_j(d_j) / q_j(d_j))``; at the first rejection the token is drawn from the residual
``max(0, p_j - q_j)`` normalized, and the request stops there; when all ``k`` pass, a bonus
token is drawn from ``p_{k+1}``. Each emitted token is then distributed as under ``p``.
Proposers whose drafts are a function of the context (n-gram lookup, a greedy draft model)
propose from a point mass: ``q_j(d_j) = 1``, so ``d_j`` is kept with probability ``p_j(d_j)``
and a rejection samples ``p_j`` with ``d_j`` removed.

Greedy rows need no randomness: a draft is kept while it equals the row's argmax, and the
argmax at the first mismatch (or after the last draft) is the extra token: the output equals
plain greedy decoding's.

Randomness: a seeded request draws, per step, ``k`` uniforms then one exponential-race noise
row (``sampler.exponential_race``) from its own generator, so the same seed gives the same
output run after run, whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedserve.gpu.batch import ModelRunnerOutput, ScheduledRequest
from pagedserve.gpu.sample.sampler import (
    SampleRow,
    TargetDistribution,
    TokenLogprobs,
    exponential_race,
    target_distribution,
    token_logprobs,
)

if TYPE_CHECKING:
    from pagedserve.gpu.spec_decode.draft_model import DraftModel


@dataclass(slots=True)
class DraftedRequest:
    """One request's share of a verify step.

    Attributes:
        rows: ``k + 1`` sampling rows; row ``j``'s ``output_ids`` end with the first ``j``
            drafts (penalties and min_tokens see them as plain decoding would).
        draft_ids: the ``k`` drafts.
        draft_probs: float32 ``[k, V]``, the distribution each draft was drawn from; ``None``
            for a point mass (n-gram, greedy draft model).
    """

    rows: list[SampleRow]
    draft_ids: list[int]
    draft_probs: torch.Tensor | None = None


@dataclass(slots=True)
class VerifiedTokens:
    """What a request emits: its accepted drafts and one more token (recovered or bonus), and
    their logprobs (as plain decoding reports them) when the request asked."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None


def acceptance_probability(p_target: float, q_draft: float) -> float:
    """``min(1, p / q)``: the chance a draft drawn with probability ``q`` is kept."""
    return 1.0 if p_target >= q_draft else p_target / q_draft


def rejection_sample(logits: torch.Tensor, reqs: list[DraftedRequest]) -> list[VerifiedTokens]:
    """Verify every request's drafts.

    Args:
        logits: float32 ``[sum(k_i + 1), V]``, each request's rows in order (modified in place).
        reqs: the requests, in the order of their rows.

    Returns:
        One ``VerifiedTokens`` per request: ``1 ..= k + 1`` tokens.
    """
    rows = [row for r in reqs for row in r.rows]
    target = target_distribution(logits, rows)
    argmax = target.argmax.tolist()
    random_pos = {row: j for j, row in enumerate(target.random_rows)}
    starts, start = [], 0
    for r in reqs:
        starts.append(start)
        start += len(r.rows)
    p_at_draft = _target_probs_of_drafts(target, reqs, starts, random_pos)
    tokens: list[list[int]] = []
    finals: list[torch.Tensor] = []  # the residual or bonus distribution of each random request
    final_gens: list[torch.Generator | None] = []
    final_of: dict[int, int] = {}
    for n, (r, s) in enumerate(zip(reqs, starts, strict=True)):
        k = len(r.draft_ids)
        if r.rows[0].params.greedy:
            accepted = 0
            while accepted < k and r.draft_ids[accepted] == argmax[s + accepted]:
                accepted += 1
            tokens.append([*r.draft_ids[:accepted], argmax[s + accepted]])
            continue
        gen = r.rows[0].generator
        device = logits.device if gen is None else gen.device
        uniforms = torch.rand(k, generator=gen, device=device).tolist()
        accepted = 0
        while accepted < k:
            q = 1.0 if r.draft_probs is None else float(r.draft_probs[accepted,
                                                                     r.draft_ids[accepted]])
            if uniforms[accepted] >= acceptance_probability(p_at_draft[n][accepted], q):
                break
            accepted += 1
        tokens.append(r.draft_ids[:accepted])
        p = target.probs[random_pos[s + accepted]]
        finals.append(p if accepted == k else _residual(p, r, accepted))
        final_gens.append(gen)
        final_of[n] = len(finals) - 1
    if finals:
        drawn = exponential_race(torch.stack(finals), final_gens).tolist()
        for n, i in final_of.items():
            tokens[n].append(drawn[i])
    return [VerifiedTokens(t, _logprobs(target, r, s, t))
            for r, s, t in zip(reqs, starts, tokens, strict=True)]


def _target_probs_of_drafts(target: TargetDistribution, reqs: list[DraftedRequest],
                            starts: list[int], random_pos: dict[int, int]) -> list[list[float]]:
    """``p_j(d_j)`` of every draft of every sampled request, in one gather (one device sync);
    ``[]`` for greedy requests."""
    rows, cols, counts = [], [], []
    for r, s in zip(reqs, starts, strict=True):
        if r.rows[0].params.greedy:
            counts.append(0)
            continue
        rows += [random_pos[s + j] for j in range(len(r.draft_ids))]
        cols += r.draft_ids
        counts.append(len(r.draft_ids))
    flat = target.probs[rows, cols].tolist() if rows else []
    out, i = [], 0
    for c in counts:
        out.append(flat[i:i + c])
        i += c
    return out


def _residual(p: torch.Tensor, r: DraftedRequest, j: int) -> torch.Tensor:
    """``max(0, p - q_j)`` (unnormalized: the race does not need it); for a point mass, ``p``
    without the rejected draft. Falls back to ``p`` where rounding leaves nothing."""
    if r.draft_probs is None:
        res = p.clone()
        res[r.draft_ids[j]] = 0.0
    else:
        res = (p - r.draft_probs[j]).clamp_(min=0.0)
    return torch.where(res.sum() > 0, res, p)


def _logprobs(target: TargetDistribution, r: DraftedRequest, start: int,
              tokens: list[int]) -> list[TokenLogprobs] | None:
    params = r.rows[0].params
    if params.logprobs is None:
        return None
    first = target.logprob_rows.index(start)  # a request's rows are consecutive
    return [token_logprobs(target.logprobs[first + j], t, params.logprobs,
                           params.logprob_token_ids) for j, t in enumerate(tokens)]


def verify_drafts(logits: torch.Tensor, reqs: list[ScheduledRequest],
                  row: Callable[[ScheduledRequest, int], SampleRow],
                  draft: DraftModel | None) -> ModelRunnerOutput:
    """Verify every request's drafts by rejection sampling: a request with k drafts has k + 1
    rows, row ``j`` processed with the first ``j`` drafts in its history (``row``, the
    runner's ``SamplingState.row``); it gets back its accepted drafts plus one token. Requests
    without drafts are the ``k = 0`` case: plain sampling of their one row. The draft model,
    if any, learns how many of its drafts were accepted."""
    drafted = [DraftedRequest([row(r, j) for j in range(len(r.spec_token_ids) + 1)],
                              r.spec_token_ids) for r in reqs]
    verified = rejection_sample(logits, drafted)
    if draft is not None:
        for r, v in zip(reqs, verified, strict=True):
            if r.spec_token_ids:
                draft.accepted(r, len(v.token_ids) - 1)
    return ModelRunnerOutput(
        {r.req_id: v.token_ids for r, v in zip(reqs, verified, strict=True)},
        {r.req_id: v.logprobs for r, v in zip(reqs, verified, strict=True)
         if v.logprobs is not None},
    )
