"""Token sampling from a batch of logits: greedy, temperature, top-k, top-p, per-request seeds.

Random rows use the exponential-race trick (``argmax(p / q)``, ``q ~ Exp(1)``), which equals
sampling from ``p`` and lets each seeded row draw its noise from its own generator, as vLLM's
``vllm/v1/sample/ops/topk_topp_sampler.py`` does.
"""

from __future__ import annotations

import torch

from gpu.sampling_params import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits ``[B, V]`` outside each row's top-k (k ``[B]``, 0 = off) and top-p mass."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Drop a token when the mass before it already reaches top_p (the first always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """Pick one token per row.

    Args:
        logits: ``[B, V]`` float32.
        params: one ``SamplingParams`` per row.
        generators: per-row generator for seeded requests, else ``None`` (global RNG).

    Returns:
        ``[B]`` int64 token ids.
    """
    greedy = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if not random_rows:
        return greedy
    idx = torch.tensor(random_rows, device=logits.device)
    sub = logits[idx]
    temp = torch.tensor([params[i].temperature for i in random_rows], device=logits.device)
    sub = sub / temp[:, None]
    top_k = torch.tensor([params[i].top_k for i in random_rows], device=logits.device)
    top_p = torch.tensor([params[i].top_p for i in random_rows], device=logits.device)
    if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
        sub = apply_top_k_top_p(sub, top_k, top_p)
    probs = sub.softmax(dim=-1)
    noise = torch.empty_like(probs)
    for row, i in enumerate(random_rows):
        noise[row].exponential_(generator=generators[i])
    greedy[idx] = (probs / noise).argmax(dim=-1)
    return greedy
