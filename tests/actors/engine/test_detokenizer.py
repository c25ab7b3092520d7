"""Incremental detokenization: no half characters, stop strings across tokens, held-back text."""

from __future__ import annotations

import pytest

from pagedserve.actors.engine.detokenizer import IncrementalDetokenizer
from pagedserve.gpu.sample.sampling_params import SamplingParams
from tests.conftest import hf_tokenizer


@pytest.fixture(scope="module")
def tok(default_model_dir):
    return hf_tokenizer(str(default_model_dir))


def _run(tok, text: str, stop: list[str], step: int = 1) -> tuple[list[str], IncrementalDetokenizer]:
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, tok.encode("Hello", add_special_tokens=False),
                               SamplingParams(stop=stop))
    deltas = []
    for i in range(0, len(ids), step):
        last = i + step >= len(ids)
        deltas.append(d.update(ids[i : i + step], final=last))
        if d.stop_reason:
            break
    return deltas, d


def test_multibyte_characters_never_split(tok):
    text = "héllo 🌊 世界 done"
    deltas, _ = _run(tok, text, [])
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # the wave emoji spans several tokens: some deltas must be empty while it is incomplete
    assert "" in deltas


def test_stop_string_across_tokens_is_cut_and_never_sent(tok):
    deltas, d = _run(tok, "The answer is 42. END OF STORY and more", ["END OF"])
    assert "".join(deltas) == "The answer is 42. "
    assert d.stop_reason == "stop"
    assert not any("END" in x for x in deltas)


def test_partial_stop_prefix_is_held_then_released(tok):
    # "EN" looks like the start of "END" until "ough" arrives; nothing may be lost.
    deltas, d = _run(tok, "ENough said", ["END"])
    assert "".join(deltas) == "ENough said" and d.stop_reason is None


def test_earliest_of_several_stops_wins(tok):
    deltas, _ = _run(tok, "alpha beta gamma delta", ["delta", "beta"], step=3)
    assert "".join(deltas) == "alpha "
