"""n-gram proposals and the ``--speculative-config`` parser (``actors/spec_decode/proposer.py``);
the engine-level checks (greedy parity, exact stops) are in ``tests/server/test_spec_decode.py``."""

from __future__ import annotations

import pytest

from pagedserve.actors.spec_decode.proposer import (
    SpeculativeConfig,
    parse_speculative_config,
    propose_ngram,
)


def test_propose_ngram_takes_the_longest_latest_match():
    assert propose_ngram([1, 2, 3, 4, 5, 1, 2, 3], 3, 4, 2) == [4, 5, 1]
    assert propose_ngram([9, 1, 2, 9, 1, 2, 5, 1, 2], 2, 3, 2) == [5, 1]  # latest 2-gram
    assert propose_ngram([1, 2, 3, 4, 5, 6], 3, 4, 2) == []  # nothing recurs
    assert propose_ngram([7, 7, 7, 7], 5, 4, 2) == [7]  # what follows, at most
    # 256 then 1 pack to bytes that contain 1's packing at an odd offset: never a match.
    assert propose_ngram([256, 1, 0, 0, 1], 2, 2, 1) == [0, 0]
    assert propose_ngram([5], 3, 4, 1) == []


def test_parse_speculative_config():
    assert parse_speculative_config('{"num_speculative_tokens": 5}') == SpeculativeConfig(
        num_speculative_tokens=5)
    assert parse_speculative_config(
        '{"method": "draft_model", "model": "m", "num_speculative_tokens": 2}'
    ) == SpeculativeConfig(method="draft_model", model="m", num_speculative_tokens=2)
    for bad, why in [('{"method": "eagle"}', "'ngram' or 'draft_model'"), ("[1]", "object"),
                     ('{"method": "draft_model"}', "'model'"),
                     ('{"method": "ngram", "model": "m"}', "'model'"),
                     ('{"num_speculative_tokens": 0}', ">= 1"), ("{oops", "not JSON"),
                     ('{"prompt_lookup_min": 5}', "prompt_lookup_min >"),
                     ('{"draft_model": "x"}', "unknown keys"),
                     ('{"disable_by_batch_size": 0}', "disable_by_batch_size")]:
        with pytest.raises(ValueError, match=why.replace("(", r"\(")):
            parse_speculative_config(bad)
