"""The beam-search decision (``actors/beam/search.py``) against transformers' own beam search,
fed the logprobs of the same tiny model (50 tokens, so EOS ends many hypotheses)."""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedserve.actors.beam.search import Beam, BeamSearch, BeamSearchParams

EOS = 2


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls: one thread is fastest, and on a loaded machine by far."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@lru_cache(maxsize=1)
def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=50, bos_token_id=1, eos_token_id=EOS, pad_token_id=EOS,
        initializer_range=0.3,
    )
    return LlamaForCausalLM(config).eval()


def _search(prompt: list[int], params: BeamSearchParams) -> list[list[int]]:
    """Run the search with each beam's logprobs from the model, one request id per beam."""
    search = BeamSearch(params, frozenset({EOS}))
    beams = [Beam("root", [], 0.0)]
    forks = 0
    while True:
        top = {}
        for b in beams:
            with torch.no_grad():
                logits = _model()(torch.tensor([prompt + b.token_ids])).logits[0, -1]
            best = logits.float().log_softmax(-1).topk(search.num_candidates)
            top[b.request_id] = list(zip(best.indices.tolist(), best.values.tolist()))
        conts = search.step(beams, top)
        if not conts:
            return [h.token_ids for h in search.results()]
        tokens = {b.request_id: b.token_ids for b in beams}
        beams = []
        for c in conts:
            forks += 1
            beams.append(Beam(f"beam{forks}", [*tokens[c.parent], c.token_id], c.cum_logprob))


def _hf(prompt: list[int], params: BeamSearchParams) -> list[list[int]]:
    with torch.no_grad():
        out = _model().generate(
            torch.tensor([prompt]), num_beams=params.beam_width, do_sample=False,
            num_return_sequences=params.beam_width, max_new_tokens=params.max_tokens,
            length_penalty=params.length_penalty, early_stopping=params.early_stopping,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    rows = out[:, len(prompt):].tolist()
    return [row[: row.index(EOS) + 1] if EOS in row else row for row in rows]


@pytest.mark.parametrize("trial", range(12))
def test_the_search_equals_transformers_beam_search(trial):
    g = torch.Generator().manual_seed(trial)
    prompt = torch.randint(3, 50, (1 + trial % 5,), generator=g).tolist()
    params = BeamSearchParams(
        beam_width=[1, 2, 3, 4][trial % 4], max_tokens=12,
        length_penalty=[1.0, 0.0, 2.0, -1.0][trial % 4 if trial < 8 else 3 - trial % 4],
        early_stopping=[False, True, "never"][trial % 3],
    )
    assert _search(prompt, params) == _hf(prompt, params)


def test_hypotheses_that_end_on_eos_say_stop_and_the_others_length():
    search = BeamSearch(BeamSearchParams(2, 1), frozenset({EOS}))
    assert search.step([Beam("r", [], 0.0)], {"r": [(EOS, -0.1), (7, -0.5), (8, -3.0),
                                                     (9, -4.0)]}) == []
    hyps = search.results()
    assert [h.token_ids for h in hyps] == [[EOS], [7]]
    assert [search.finish_reason(h) for h in hyps] == ["stop", "length"]
    with pytest.raises(ValueError):
        BeamSearch(BeamSearchParams(0, 4), frozenset())


@pytest.mark.parametrize("penalty", [1000.0, -1000.0, 1e308, -1e308])
def test_an_extreme_length_penalty_ranks_by_length_without_overflow(penalty):
    """``length ** penalty`` past float32 (it raised ``OverflowError`` / ``ZeroDivisionError``
    inside the scheduler's loop): the score saturates, so a huge positive penalty prefers the
    longer hypothesis and a huge negative one the shorter, whatever their logprobs."""
    search = BeamSearch(BeamSearchParams(2, 3, length_penalty=penalty), frozenset({EOS}))
    beams = [Beam("r", [], 0.0)]
    top = [(EOS, -0.1), (7, -0.2), (8, -3.0), (9, -4.0)]  # [EOS] finishes first, at length 1
    while True:  # the longer ones finish later and worse in logprob, at lengths 2 and 3
        conts = search.step(beams, {b.request_id: top for b in beams})
        if not conts:
            break
        tokens = {b.request_id: b.token_ids for b in beams}
        beams = [Beam(f"{c.parent}.{c.token_id}", [*tokens[c.parent], c.token_id],
                      c.cum_logprob) for c in conts]
        top = [(EOS, -5.0), (10, -6.0), (11, -7.0), (12, -8.0)]
    best = search.results()[0]
    assert best.finished
    assert (len(best.token_ids) > 1) == (penalty > 0), [h.token_ids for h in search.results()]
    with pytest.raises(ValueError, match="finite"):
        BeamSearch(BeamSearchParams(2, 3, length_penalty=float("-inf")), frozenset())
