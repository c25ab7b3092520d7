"""The rejection sampler on its own (``gpu/spec_decode/rejection_sampler.py``): with a draft
distribution ``q`` (not only a point mass) the first emitted token is distributed as the target ``p``;
greedy rows keep drafts while they equal the argmax. The model-level checks (n-gram drafts
on a real tiny Llama, 5,000 seeded samples) are in
``tests/actors/spec_decode/test_spec_sampling.py``."""

from __future__ import annotations

from collections import Counter

import torch

from pagedserve.gpu.sample.sampler import SampleRow
from pagedserve.gpu.sample.sampling_params import SamplingParams
from pagedserve.gpu.spec_decode.rejection_sampler import DraftedRequest, rejection_sample
from tests.actors.spec_decode.test_spec_sampling import chi_square_p

P = torch.tensor([0.5, 0.25, 0.15, 0.1])  # the target at the first drafted position
Q = torch.tensor([0.1, 0.2, 0.3, 0.4])  # the draft's distribution there: far from P


def _requests(n: int, params: SamplingParams, seed0: int) -> list[DraftedRequest]:
    reqs = []
    for i in range(n):
        gen = torch.Generator().manual_seed(seed0 + i)
        draft = int(torch.multinomial(Q, 1, generator=gen))
        rows = [SampleRow(params, gen, [], [], []) for _ in range(2)]
        reqs.append(DraftedRequest(rows, [draft], torch.stack([Q, Q])))
    return reqs


def test_a_draft_distribution_is_corrected_to_the_target():
    n = 6000
    logits = P.log().repeat(2 * n, 1)  # two rows per request: the draft's and the bonus
    out = rejection_sample(logits.clone(), _requests(n, SamplingParams(temperature=1.0), 0))
    got = Counter(v.token_ids[0] for v in out)
    want = Counter(dict(enumerate((P * n).round().long().tolist())))
    assert chi_square_p(got, want) > 1e-3
    # Accepted about sum(min(p, q)) of the time: 0.1 + 0.2 + 0.15 + 0.1.
    accepted = sum(len(v.token_ids) == 2 for v in out) / n
    assert abs(accepted - 0.55) < 0.025  # 4 standard deviations
    # Always accepting gives the draft's distribution instead: the test sees it.
    draft_only = Counter(dict(enumerate((Q * n).round().long().tolist())))
    assert chi_square_p(draft_only, want) < 1e-6


def test_greedy_rows_keep_drafts_while_they_are_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    rows = [SampleRow(SamplingParams(temperature=0.0), None, [], [], []) for _ in range(3)]
    (v,) = rejection_sample(logits.clone(), [DraftedRequest(rows, [1, 2])])
    assert v.token_ids == [1, 0]  # 1 is the argmax; 2 is not (0 is): 0 replaces it
    (v,) = rejection_sample(logits.clone(), [DraftedRequest(rows, [1, 0])])
    assert v.token_ids == [1, 0, 2]  # both kept, then the bonus
