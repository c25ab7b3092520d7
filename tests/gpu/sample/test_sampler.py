"""The sampler's fast paths equal their definitions: top-k/top-p from each row's largest logits
(``apply_top_k_top_p``) masks exactly what a full sort of the vocabulary masks, in every row,
including rows whose top-p mass reaches past every candidate count (the sort runs for those);
the exponential race draws from the given probabilities, reproducibly per seeded generator."""

from __future__ import annotations

import pytest
import torch

from pagedserve.gpu.sample import sampler

VOCAB = 49152  # SmolLM2's: the candidate counts are small beside it, as in serving


def _rows(n: int, seed: int = 0) -> torch.Tensor:
    """Random logits ``[n, VOCAB]``, peaked like a chat model's, no ties."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, VOCAB, generator=g) * 4


@pytest.mark.parametrize("top_k,top_p", [
    ([5, 50, 3000, 0, 0, 0, 40, 0], [1.0, 1.0, 1.0, 0.5, 0.9, 0.999, 0.9, 1.0]),
    ([0, 0], [0.9, 0.95]),
    ([7, 7], [1.0, 1.0]),
])
def test_top_k_top_p_equals_the_full_sort(top_k, top_p):
    logits = _rows(len(top_k))
    k, p = torch.tensor(top_k), torch.tensor(top_p)
    got = sampler.apply_top_k_top_p(logits, k, p)
    vocab_k = torch.where(k > 0, k, VOCAB)
    want = sampler._sorted_top_k_top_p(logits, vocab_k, p)
    for i, (ki, pi) in enumerate(zip(top_k, top_p)):
        if ki <= 0 and pi >= 1.0:  # asked for neither: untouched
            want[i] = logits[i]
    assert torch.equal(got.isinf(), want.isinf())
    assert torch.equal(got, want)
    kept = (~got.isinf()).sum(-1).tolist()
    for ki, n in zip(top_k, kept):
        assert n >= 1 and (ki <= 0 or n <= ki)


def test_flat_rows_fall_back_to_the_sort():
    """A nearly flat row needs most of the vocabulary for 0.99 of its mass: past both candidate
    counts, so it is sorted; a peaked row beside it is decided from its top 128."""
    logits = _rows(2)
    logits[0] *= 1e-3
    k, p = torch.tensor([0, 0]), torch.tensor([0.99, 0.5])
    got = sampler.apply_top_k_top_p(logits, k, p)
    want = sampler._sorted_top_k_top_p(logits, torch.full((2,), VOCAB), p)
    assert torch.equal(got, want)
    kept = (~got.isinf()).sum(-1)
    assert kept[0] > sampler.TOP_P_CANDIDATES[-1] and kept[1] < sampler.TOP_P_CANDIDATES[0]


def test_no_filter_returns_the_logits_unchanged():
    logits = _rows(3)
    got = sampler.apply_top_k_top_p(logits, torch.zeros(3, dtype=torch.long), torch.ones(3))
    assert got is logits


def test_exponential_race_draws_from_the_distribution():
    probs = torch.zeros(20000, 8)
    probs[:, :3] = torch.tensor([0.5, 0.3, 0.2])
    drawn = sampler.exponential_race(probs, [None] * len(probs))
    freq = torch.bincount(drawn, minlength=8).float() / len(probs)
    assert freq[3:].sum() == 0  # zero probability: never drawn
    torch.testing.assert_close(freq[:3], torch.tensor([0.5, 0.3, 0.2]), atol=0.02, rtol=0)


def test_exponential_race_seeded_rows_repeat_and_unseeded_rows_vary():
    probs = torch.full((3, 1000), 1.0)

    def draw():
        gens = [torch.Generator().manual_seed(7), None, torch.Generator().manual_seed(8)]
        return sampler.exponential_race(probs, gens).tolist()

    runs = [draw() for _ in range(4)]
    assert all(r[0] == runs[0][0] and r[2] == runs[0][2] for r in runs)
    assert len({r[1] for r in runs}) > 1  # the global RNG moves on (4 draws of 1,000 tokens)
