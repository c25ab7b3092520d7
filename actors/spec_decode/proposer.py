"""Speculative decoding's scheduler side: n-gram (prompt-lookup) drafts, or slots for a draft
model's.

A decode step is bound by reading the weights, not by arithmetic: scoring a handful of guessed
tokens costs about what scoring one does. The proposer guesses by finding the request's last
n tokens earlier in its prompt or output and proposing what followed them there (Saxena,
"Prompt Lookup Decoding", 2023; vLLM's ``vllm/v1/spec_decode/ngram_proposer.py``). The model
scores the last token and the drafts in one step, and the runner verifies them by rejection
sampling (``gpu/spec_decode/rejection_sampler.py``), which keeps the output distribution of plain
decoding at any temperature, with every sampling parameter (penalties, min_tokens, logprobs,
seeds, and the grammar: a guided request's bitmask has a row per drafted position,
``actors/structured_output/step.py``); greedy output is the one plain decoding gives.

With ``method: draft_model`` the scheduler only decides how many drafts a decode gets (the
same room rules) and hands the runner that many placeholder slots; the draft model, in the
runner, fills them before the verify pass (``gpu/spec_decode/draft_model.py``). Guided requests
get none there: their bitmask rows per drafted position are built here, before the drafts exist.

The scheduler's side is two calls: ``NgramProposer.propose`` gives a decode its drafts (the
step planner takes blocks for them only when they are free: a guess never preempts anyone),
and ``num_accepted`` reads how many of them the runner kept. ``num_computed_tokens`` advances by
the accepted drafts plus one; the K/V written for rejected drafts lies past it, in blocks the
request keeps, and is overwritten by the next step: rollback costs nothing.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable

from pagedserve.actors.core.request import Request
from pagedserve.actors.spec_decode.config import SpeculativeConfig, parse_speculative_config  # noqa: F401
from pagedserve.gpu.batch import ScheduledRequest


class NgramProposer:
    """Drafts for the scheduler's decodes (vLLM's ``NgramProposer``, without the Numba)."""

    __slots__ = ("config", "max_model_len", "is_beam", "seconds")

    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 is_beam: Callable[[str], bool]):
        self.config = config
        self.max_model_len = max_model_len
        self.is_beam = is_beam  # the beam package's: a beam gets no drafts
        self.seconds = 0.0  # spent proposing (the draft time of the stats)

    def enabled(self, num_running: int) -> bool:
        """Whether this step speculates at all (``disable_by_batch_size``)."""
        limit = self.config.disable_by_batch_size
        return limit is None or num_running <= limit

    def propose(self, request: Request, budget: int) -> list[int]:
        """n-gram drafts for a decode of ``request``, capped by ``budget`` (tokens the step has
        left after the decode itself), the output tokens still allowed and the context length;
        ``[]`` when nothing recurs or there is no room."""
        params = request.sampling_params
        if self.is_beam(request.request_id):  # a beam steps one token at a time, by its rules
            return []
        room = min(self.config.num_speculative_tokens, budget,
                   self.max_model_len - request.num_tokens - 1)
        if params.max_tokens is not None:  # the last sampled token is the +1 of the step
            room = min(room, params.max_tokens - len(request.output_token_ids) - 1)
        if room <= 0:
            return []
        start = time.perf_counter()
        drafts = self._drafts(request, room)
        self.seconds += time.perf_counter() - start
        return drafts

    def _drafts(self, request: Request, room: int) -> list[int]:
        return propose_ngram(request.all_token_ids, room, self.config.prompt_lookup_max,
                             self.config.prompt_lookup_min)


DRAFT_SLOT = 0  # a placeholder id the draft model overwrites


class DraftModelProposer(NgramProposer):
    """Draft slots for the runner's draft model: as many as the room allows (none for guided
    requests)."""

    __slots__ = ()

    def _drafts(self, request: Request, room: int) -> list[int]:
        return [] if request.structured_output is not None else [DRAFT_SLOT] * room


def make_proposer(config: SpeculativeConfig, max_model_len: int,
                  is_beam: Callable[[str], bool]) -> NgramProposer:
    if config.method == "draft_model":
        return DraftModelProposer(config, max_model_len, is_beam)
    return NgramProposer(config, max_model_len, is_beam)


def num_accepted(scheduled_request: ScheduledRequest, sampled: list[int] | None) -> int:
    """Drafts of ``sr`` the runner accepted: it returns the accepted ones plus one sampled
    token, so the K/V of the last token and of ``len(sampled) - 1`` drafts is valid."""
    return len(sampled) - 1 if scheduled_request.spec_token_ids and sampled else 0


def propose_ngram(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix of
    ``tokens`` (``n_max`` down to ``n_min`` tokens long); ``[]`` when none recurs.

    The search is ``bytes.rfind`` over the ids packed 4 bytes each (C speed, where a Python
    loop is far slower: ``loadtest/RESULTS.md``); a hit at an offset that is not a multiple
    of 4 straddles two ids and is skipped.
    """
    size = len(tokens)
    packed = array("i", tokens).tobytes()
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        pattern = packed[(size - n) * 4:]
        # The match must end before the last token: something has to follow it.
        end = (size - 1) * 4
        pos = packed.rfind(pattern, 0, end)
        while pos > 0 and pos % 4:
            pos = packed.rfind(pattern, 0, pos + len(pattern) - 1)
        if pos >= 0 and pos % 4 == 0:
            start = pos // 4
            return tokens[start + n:start + n + k]
    return []
