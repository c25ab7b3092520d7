"""Beam search, the decision of one round: which ``beam_width`` continuations live on, which
finished hypotheses are kept, and when the search is over.

The rules are those of transformers' ``generate(num_beams=k, do_sample=False)`` (its
vectorized ``_beam_search``), so that our output equals it on the same weights:

- each round, every live beam's cumulative logprob plus each next token's logprob scores a
  candidate; the best ``max(2, 1 + #eos) * k`` candidates are kept;
- a kept candidate that ends on EOS (or reaches ``max_tokens``) and ranks among the first ``k``
  becomes a finished hypothesis, scored ``cum_logprob / generated_len ** length_penalty``
  (EOS counted); the ``k`` best hypotheses so far are kept;
- the best ``k`` candidates that did not end go on as the next round's beams;
- the search ends when ``early_stopping`` is ``True`` and ``k`` hypotheses are finished, when no
  live beam can beat the worst finished one any more (``False``: judged at the current length;
  ``"never"`` with a positive penalty: at ``max_tokens``), or at ``max_tokens``;
- a width of 1 is greedy decoding (transformers does not beam-search then).

Scores are float32 as in transformers (a sum of two float32 values rounded to float32), so ties
and near-ties break the same way. Pure Python: the scheduler side (forking beams, sharing their
KV blocks) is ``actors/beam/group.py``. vLLM runs beam search in its serving layer
(``vllm/beam_search.py``, ``EngineClient.beam_search``) with its own length rule; we follow
transformers, the oracle.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, replace

NEG = -1.0e9  # transformers' "never pick this" offset


def f32(x: float) -> float:
    """``x`` rounded to float32 (what a float32 tensor would hold: ``±inf`` past its range)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # struct refuses what float32 arithmetic would make infinite
        return math.copysign(math.inf, x)


# |log(length ** penalty)| under which the float32 power is finite and not zero (e ** 87 is
# about 6e37, below float32's 3.4e38; e ** -87 is above its smallest normal, 1.2e-38).
_LOG_F32_RANGE = 87.0


def length_normalized(cum_logprob: float, length: int, length_penalty: float) -> float:
    """``cum_logprob / length ** length_penalty`` in float32, as transformers computes it, for
    any finite penalty: where the power would leave float32's range the division is done in
    log space and saturates (to ``-0.0`` past the top, ``-inf`` below the bottom) instead of
    raising ``OverflowError`` or ``ZeroDivisionError``.

    Args:
        cum_logprob: a sum of logprobs (<= 0).
        length: generated tokens, >= 1.
        length_penalty: any finite float.
    """
    log_denom = length_penalty * math.log(length)
    if abs(log_denom) < _LOG_F32_RANGE:  # the ordinary case: bit for bit transformers' rounding
        return f32(cum_logprob / f32(float(length) ** length_penalty))
    if cum_logprob == 0.0:
        return 0.0
    log_score = math.log(abs(cum_logprob)) - log_denom
    return -f32(math.exp(min(log_score, 709.0)))  # exp(709) is finite in float64; f32 → inf


@dataclass(slots=True)
class BeamSearchParams:
    """A beam-search request (vLLM's ``BeamSearchParams`` plus transformers' stopping rule).

    Attributes:
        beam_width: beams kept each round, and hypotheses returned (the request's ``n``).
        max_tokens: generated tokens at most (EOS included).
        length_penalty: exponent of the length that divides a hypothesis's cumulative logprob;
            > 0 favours longer outputs, < 0 shorter ones.
        early_stopping: ``True``: stop once ``beam_width`` hypotheses are finished; ``False``:
            stop once no beam can beat the worst of them at its current length; ``"never"``:
            judge that at ``max_tokens`` (exact for a positive penalty).
        ignore_eos: EOS is an ordinary token; every hypothesis runs to ``max_tokens``.
    """

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    ignore_eos: bool = False


@dataclass(slots=True)
class Beam:
    """A live beam: the id of the request that carries it, its generated tokens so far, and its
    cumulative logprob (float32)."""

    request_id: str
    token_ids: list[int]
    cum_logprob: float


@dataclass(slots=True)
class BeamHypothesis:
    """A candidate for the answer.

    Attributes:
        token_ids: generated tokens (ending on EOS when it finished there).
        cum_logprob: sum of their logprobs.
        score: ``cum_logprob / len(token_ids) ** length_penalty``, minus ``NEG`` multiples for
            entries that may not be picked.
        finished: a real hypothesis (else a placeholder or a disqualified candidate).
    """

    token_ids: list[int]
    cum_logprob: float
    score: float
    finished: bool


@dataclass(slots=True)
class Continuation:
    """One of the next round's beams: ``token_id`` appended to the beam ``parent``."""

    parent: str
    token_id: int
    cum_logprob: float


class BeamSearch:
    """The state of one beam search across rounds. ``step`` once per round."""

    def __init__(self, params: BeamSearchParams, eos_token_ids: frozenset[int]):
        if params.beam_width < 1 or params.max_tokens < 1:
            raise ValueError("beam search needs beam_width >= 1 and max_tokens >= 1")
        if not math.isfinite(params.length_penalty):
            raise ValueError(f"length_penalty must be finite, not {params.length_penalty}")
        if params.beam_width == 1:  # transformers decodes greedily then: the first end stops it
            params = replace(params, early_stopping=True)
        self.params = params
        self.eos = frozenset() if params.ignore_eos else eos_token_ids
        self.num_candidates = max(2, 1 + len(self.eos)) * params.beam_width
        self.hypotheses = [BeamHypothesis([], 0.0, NEG, False)
                           for _ in range(params.beam_width)]
        self.num_generated = 0
        self.improvable = True  # transformers' is_early_stop_heuristic_unsatisfied (sticky)
        self.done = False

    def step(self, beams: list[Beam], top: dict[str, list[tuple[int, float]]]
             ) -> list[Continuation]:
        """One round.

        Args:
            beams: the live beams, best first (the order the previous round returned).
            top: per beam's request id, its next token's best ``(token_id, logprob)`` pairs,
                at least ``num_candidates`` of them, best first.

        Returns:
            The next round's ``beam_width`` beams, best first; ``[]`` when the search is over
            (then ``results`` holds the answer).
        """
        k = self.params.beam_width
        cands = [(f32(b.cum_logprob + lp), i, tok)
                 for i, b in enumerate(beams) for tok, lp in top[b.request_id]]
        cands.sort(key=lambda c: -c[0])  # stable: ties keep beam order, then token rank
        cands = cands[: self.num_candidates]
        self.num_generated += 1
        at_max = self.num_generated >= self.params.max_tokens
        ended = [at_max or tok in self.eos for _, _, tok in cands]
        running = sorted(range(len(cands)),
                         key=lambda j: -(f32(cands[j][0] + NEG) if ended[j] else cands[j][0]))[:k]
        self._keep_finished(beams, cands, ended)
        best = cands[running[0]][0] if not ended[running[0]] else f32(cands[running[0]][0] + NEG)
        self._update_improvable(best)
        all_full = all(h.finished for h in self.hypotheses) and self.params.early_stopping is True
        if not self.improvable or all_full or all(ended):
            self.done = True
            return []
        return [Continuation(beams[cands[j][1]].request_id, cands[j][2], cands[j][0])
                for j in running]

    def _keep_finished(self, beams: list[Beam], cands: list[tuple[float, int, int]],
                       ended: list[bool]) -> None:
        """Merge this round's ended candidates among the first ``k`` into the ``k`` best
        hypotheses (transformers' ``_update_finished_beams``)."""
        k = self.params.beam_width
        full = all(h.finished for h in self.hypotheses) and self.params.early_stopping is True
        merged = list(self.hypotheses)
        for j, (cum, i, tok) in enumerate(cands):
            score = length_normalized(cum, self.num_generated, self.params.length_penalty)
            if full:
                score = f32(score + NEG)
            if not self.improvable:
                score = f32(score + NEG)
            just_finished = ended[j] and j < k
            if not just_finished:
                score = f32(score + NEG)
            merged.append(BeamHypothesis([*beams[i].token_ids, tok], cum, score, just_finished))
        merged.sort(key=lambda h: -h.score)
        self.hypotheses = merged[:k]

    def _update_improvable(self, best_running: float) -> None:
        """Can a live beam still beat the worst finished hypothesis? (transformers'
        ``_check_early_stop_heuristic``, evaluated after the round)."""
        p = self.params
        length = (p.max_tokens if p.early_stopping == "never" and p.length_penalty > 0.0
                  else self.num_generated)
        best_possible = length_normalized(best_running, length, p.length_penalty)
        worst = min(h.score for h in self.hypotheses)
        self.improvable = self.improvable and any(
            best_possible > (worst if h.finished else NEG) for h in self.hypotheses)

    def results(self) -> list[BeamHypothesis]:
        """The ``beam_width`` best hypotheses, best first (once ``done``)."""
        return list(self.hypotheses)

    def finish_reason(self, hypothesis: BeamHypothesis) -> str:
        """``stop`` for a hypothesis that ended on EOS, else ``length``."""
        ids = hypothesis.token_ids
        return "stop" if ids and ids[-1] in self.eos else "length"


@dataclass(slots=True)
class BeamSearchOutput:
    """The end of a beam search, on the root request's queue.

    Attributes:
        hypotheses: the ``beam_width`` best, best first.
        finish_reasons: per hypothesis, ``stop`` (ended on EOS) or ``length``.
    """

    hypotheses: list[BeamHypothesis]
    finish_reasons: list[str]
