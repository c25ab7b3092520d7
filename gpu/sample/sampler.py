"""Token sampling from a batch of logits (vLLM V1's ``vllm/v1/sample/sampler.py`` order):

logit bias → min_tokens (mask EOS and stop ids) → penalties (repetition, frequency,
presence) → temperature → [logprobs taken here] → min-p → top-k/top-p → sample.

Random rows use the exponential-race trick (``argmax(p / q)``, ``q ~ Exp(1)``), which equals
sampling from ``p`` and lets each seeded row draw its noise from its own generator, as vLLM's
``vllm/v1/sample/ops/topk_topp_sampler.py`` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.gpu.sample.sampling_params import SamplingParams


@dataclass(slots=True)
class SampleRow:
    """One row of the batch to sample.

    Attributes:
        params: the request's sampling parameters.
        generator: its RNG when seeded, else ``None`` (global RNG).
        prompt_ids, output_ids: tokens so far (read only when penalties are on).
        stop_ids: EOS and stop token ids, masked while ``min_tokens`` is not reached.
    """

    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: list[int]
    output_ids: list[int]
    stop_ids: list[int]


@dataclass(slots=True)
class TokenLogprobs:
    """The sampled token's log-probability and the top alternatives (ids, descending)."""

    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


# Candidates per row tried before a full sort of the vocabulary: a sort of 49,152 logits took
# ~5 ms of CPU a row on a 2-core Zen 5 (torch's CPU sort), topk(128) ~0.1 ms
# (loadtest/RESULTS.md); top-p's cutoff lies inside the first 128 for most rows of a chat
# model, inside 2,048 for nearly all others.
TOP_P_CANDIDATES = (128, 2048)


def _sorted_top_k_top_p(logits: torch.Tensor, k: torch.Tensor,
                        top_p: torch.Tensor) -> torch.Tensor:
    """The definition, by a full sort: mask logits ``[R, V]`` outside each row's top ``k``
    (``[R]``, 1..V) and outside the top-p mass of what is left."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Drop a token when the mass before it already reaches top_p (the first always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _top_k_top_p_of_candidates(logits: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor,
                               n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``_sorted_top_k_top_p`` from each row's ``n`` largest logits only. Returns the masked
    rows ``[R, V]`` and which rows it decided (``[R]`` bool): those whose kept tokens end
    inside the candidates (``k <= n``, or the last candidate already dropped: the kept set is
    a prefix, ``mass_before`` never decreases). The probabilities are the sort's: softmax over
    the top ``k``, or over the whole row when ``k`` is the vocabulary."""
    vals, idx = logits.topk(n, dim=-1)  # descending
    ranks = torch.arange(n, device=logits.device)[None, :]
    drop = ranks >= k[:, None]
    top = vals[:, :1]
    weights = (vals - top).exp().masked_fill(drop, 0.0)
    whole = k >= logits.shape[-1]
    norm = weights.sum(-1, keepdim=True)
    if bool(whole.any()):  # top-p alone: the whole row's mass (one pass over it)
        norm = torch.where(whole[:, None], (logits - top).exp().sum(-1, keepdim=True), norm)
    probs = weights / norm
    drop |= probs.cumsum(dim=-1) - probs >= top_p[:, None]
    decided = (k <= n) | drop[:, -1]
    out = torch.full_like(logits, float("-inf")).scatter_(-1, idx, vals.masked_fill(drop,
                                                                                 float("-inf")))
    return out, decided


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits ``[B, V]`` outside each row's top-k (k ``[B]``, ≤ 0 = off) and top-p mass
    (``top_p`` ``[B]``, ≥ 1 = off); rows with neither are returned as they are.

    Equal to sorting each row (``_sorted_top_k_top_p``, the definition) but from its largest
    ``TOP_P_CANDIDATES`` logits where the kept tokens end among them (always, with a top-k
    within them); only the rows whose top-p mass reaches past 2,048 tokens are sorted."""
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    active = ((k < vocab) | (top_p < 1.0)).nonzero().flatten()
    if not active.numel():
        return logits
    out = logits.clone()
    todo, k, top_p = active, k[active], top_p[active]
    for n in TOP_P_CANDIDATES:
        n = min(vocab, max(n, int(k.masked_fill(k >= vocab, 0).max())))
        masked, decided = _top_k_top_p_of_candidates(logits[todo], k, top_p, n)
        out[todo[decided]] = masked[decided]
        left = ~decided
        todo, k, top_p = todo[left], k[left], top_p[left]
        if not todo.numel():
            return out
    out[todo] = _sorted_top_k_top_p(logits[todo], k, top_p)
    return out


def _process_row(logits: torch.Tensor, row: SampleRow) -> None:
    """Bias, min_tokens and penalties for one row ``[V]``, in place."""
    p = row.params
    device = logits.device
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias.keys()), device=device)
        logits.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), device=device))
    if p.min_tokens and len(row.output_ids) < p.min_tokens and row.stop_ids:
        logits[torch.tensor(row.stop_ids, device=device)] = float("-inf")
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.output_ids)), device=device)
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                       vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and row.output_ids:
        counts = torch.bincount(torch.tensor(row.output_ids, device=device),
                                minlength=logits.shape[0])[: logits.shape[0]].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _needs_processing(p: SamplingParams) -> bool:
    return bool(p.logit_bias or p.min_tokens or p.needs_history)


def token_logprobs(lp_row: torch.Tensor, token: int, k: int,
                   chosen: list[int] | None = None) -> TokenLogprobs:
    """``token``'s log-probability in ``lp_row`` ``[V]``, its rank and the top ``k`` (or,
    given ``chosen``, those ids' entries: vLLM's ``logprob_token_ids``)."""
    value = lp_row[token]
    rank = int((lp_row > value).sum()) + 1
    if chosen:
        return TokenLogprobs(float(value), rank, list(chosen),
                             lp_row[torch.tensor(chosen, device=lp_row.device)].tolist())
    top = lp_row.topk(k) if k > 0 else None
    return TokenLogprobs(
        logprob=float(value), rank=rank,
        top_ids=top.indices.tolist() if top is not None else [],
        top_logprobs=top.values.tolist() if top is not None else [],
    )


@dataclass(slots=True)
class TargetDistribution:
    """Each row's next-token distribution once every sampling parameter is applied: what
    ``sample`` draws from, and what the rejection sampler (``gpu/spec_decode/rejection_sampler.py``)
    verifies drafts against, so both paths share one copy of the processing.

    Attributes:
        argmax: int64 ``[B]``, the most likely token of each processed row (greedy rows' pick).
        random_rows: the rows that sample (temperature > 0), ascending.
        probs: float32 ``[len(random_rows), V]``, their probabilities after temperature,
            min-p and top-k/top-p (zeros outside); ``None`` when no row samples.
        logprob_rows: the rows that asked for logprobs, ascending.
        logprobs: ``[len(logprob_rows), V]`` log-softmax before the min-p/top-k/top-p filters
            (what ``SamplingParams.logprobs`` documents); ``None`` when none asked.
    """

    argmax: torch.Tensor
    random_rows: list[int]
    probs: torch.Tensor | None
    logprob_rows: list[int]
    logprobs: torch.Tensor | None


def target_distribution(logits: torch.Tensor, rows: list[SampleRow]) -> TargetDistribution:
    """Apply bias, min_tokens, penalties, temperature, then (sampled rows) min-p and
    top-k/top-p to ``logits`` ``[B, V]`` float32 (modified in place), one ``SampleRow`` each."""
    params = [r.params for r in rows]
    for i, row in enumerate(rows):
        if _needs_processing(row.params):
            _process_row(logits[i], row)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    scaled = None  # the random rows after temperature, [len(random_rows), V]
    if random_rows:
        temp = torch.tensor([params[i].temperature for i in random_rows], device=logits.device)
        if len(random_rows) == len(rows):  # every row samples: in place, no gather copies
            scaled = logits.div_(temp[:, None])
        else:
            idx = torch.tensor(random_rows, device=logits.device)
            scaled = logits[idx] / temp[:, None]
            logits[idx] = scaled
    want_lp = [i for i, p in enumerate(params) if p.logprobs is not None]
    logprobs = logits[want_lp].log_softmax(dim=-1) if want_lp else None
    probs = _filtered_probs(scaled, [params[i] for i in random_rows]) if random_rows \
        else None
    return TargetDistribution(logits.argmax(dim=-1), random_rows, probs, want_lp, logprobs)


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> SamplerOutput:
    """Pick one token per row.

    Args:
        logits: ``[B, V]`` float32 (modified in place).
        rows: one ``SampleRow`` per logits row.

    Returns:
        Token ids ``[B]`` and, for rows that asked, their logprobs.
    """
    target = target_distribution(logits, rows)
    tokens = target.argmax
    if target.random_rows:
        idx = torch.tensor(target.random_rows, device=logits.device)
        tokens[idx] = exponential_race(target.probs,
                                       [rows[i].generator for i in target.random_rows])
    token_list = tokens.tolist()
    out_lp: list[TokenLogprobs | None] = [None] * len(rows)
    for j, i in enumerate(target.logprob_rows):
        p = rows[i].params
        out_lp[i] = token_logprobs(target.logprobs[j], token_list[i], p.logprobs or 0,
                                   p.logprob_token_ids)
    return SamplerOutput(token_list, out_lp)


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Probabilities ``[R, V]`` of temperature-scaled ``logits`` after min-p and top-k/top-p
    (each only when some row asked for it: decided from the parameters, no tensor sync)."""
    device = logits.device
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device)
        probs = logits.softmax(dim=-1)
        keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(~keep, float("-inf"))
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        top_k = torch.tensor([p.top_k for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        logits = apply_top_k_top_p(logits, top_k, top_p)
    return logits.softmax(dim=-1)


def exponential_race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One draw per row of ``probs`` ``[R, V]`` (unnormalized is fine: ``argmax(p / q)``,
    ``q ~ Exp(1)``), row ``i``'s noise from ``generators[i]`` (``None``: the global RNG)."""
    noise = torch.empty_like(probs)
    for i, gen in enumerate(generators):
        noise[i].exponential_(generator=gen)
    return (probs / noise).argmax(dim=-1)
