"""The batch-layout contract: requests are ordered decodes, decodes with drafts, prefill chunks;
the layout counts each segment; the backends' decode/prefill split follows from it; a batch out
of order is refused rather than attended wrongly."""

from __future__ import annotations

import pytest
import torch

from pagedserve.gpu.batch import BatchLayout, ScheduledRequest, Segment, order_batch
from pagedserve.gpu.sample.sampling_params import SamplingParams
from pagedserve.gpu.step_inputs import prepare_inputs


def _req(req_id: str, tokens: list[int], computed: int, blocks: list[int], sample=True,
         drafts=()) -> ScheduledRequest:
    return ScheduledRequest(req_id, tokens, computed, blocks, SamplingParams(0.0), sample,
                            spec_token_ids=list(drafts))


def _mixed() -> list[ScheduledRequest]:
    """In scheduling order: a prefill chunk, a decode with 2 drafts, a decode, a one-token chunk
    that samples nothing (a decode for attention), a whole prompt."""
    return [
        _req("chunk", [5, 6, 7], 4, [0, 1], sample=False),
        _req("spec", [8], 6, [2, 3, 9], drafts=[9, 10]),
        _req("dec", [11], 9, [4, 5, 6]),
        _req("one", [12], 3, [7], sample=False),
        _req("prompt", [13, 14], 0, [8]),
    ]


def test_segments_and_batch_order():
    reqs = _mixed()
    assert [r.segment for r in reqs] == [Segment.PREFILL, Segment.SPEC_DECODE, Segment.DECODE,
                                         Segment.DECODE, Segment.PREFILL]
    assert [r.is_decode for r in reqs] == [False, False, True, True, False]
    ordered = order_batch(reqs)  # stable: each segment keeps its scheduling order
    assert [r.req_id for r in ordered] == ["dec", "one", "spec", "chunk", "prompt"]
    layout = BatchLayout.of(ordered)
    assert layout == BatchLayout(num_decodes=2, num_spec_decodes=1, num_spec_decode_tokens=3,
                                 num_prefills=2, num_prefill_tokens=5)
    assert layout.num_reqs == 5
    assert layout.decode_split(multi_query_decode=False) == (2, 2)
    assert layout.decode_split(multi_query_decode=True) == (3, 5)


def test_unordered_batch_is_refused():
    with pytest.raises(ValueError, match="'dec'.*order_batch"):
        BatchLayout.of(_mixed()[1:3])  # a decode after a decode with drafts
    with pytest.raises(ValueError, match="order"):
        prepare_inputs(_mixed(), block_size=4, device=torch.device("cpu"))


def test_prepare_inputs_flattens_in_batch_order():
    step = prepare_inputs(order_batch(_mixed()), block_size=4, device=torch.device("cpu"))
    assert step.input_ids.tolist() == [11, 12, 8, 9, 10, 5, 6, 7, 13, 14]
    assert step.positions.tolist() == [9, 3, 6, 7, 8, 4, 5, 6, 0, 1]
    # dec at 9 in its third block, one at 3, spec's 6..8 across two blocks, chunk's 4..6, the
    # prompt's 0..1.
    assert step.attn.slot_mapping.tolist() == [6 * 4 + 1, 7 * 4 + 3, 3 * 4 + 2, 3 * 4 + 3, 9 * 4,
                                               1 * 4, 1 * 4 + 1, 1 * 4 + 2, 8 * 4, 8 * 4 + 1]
    assert step.attn.query_start_loc.tolist() == [0, 1, 2, 5, 8, 10]
    assert step.attn.seq_lens.tolist() == [10, 4, 9, 7, 2]
    assert step.attn.block_table.tolist() == [[4, 5, 6], [7, 0, 0], [2, 3, 9], [0, 1, 0],
                                              [8, 0, 0]]
    # Sampled rows: dec's token, spec's token and both drafts, the prompt's last token.
    assert step.logits_indices.tolist() == [0, 2, 3, 4, 9]
    assert step.layout == BatchLayout.of(order_batch(_mixed()))
    assert (step.attn.max_query_len, step.attn.max_seq_len) == (3, 10)


def test_prompt_logprob_rows_follow_the_sampled_rows():
    """A chunk that wants prompt logprobs adds its prompt rows after every sampled row (so the
    sampled ones keep their places); its last row's target is the token after the chunk."""
    from pagedserve.gpu.sample.prompt_logprobs import PromptLogprobsWanted, split_logits, targets

    dec = _req("dec", [11], 9, [4, 5, 6])
    mid = _req("mid", [5, 6, 7], 4, [0, 1], sample=False)  # tokens 4..6 of a 10-token prompt
    mid.num_prompt_tokens, mid.prompt_logprobs = 10, PromptLogprobsWanted(2, 29)
    end = _req("end", [13, 14, 15], 0, [8])  # a whole 3-token prompt: rows 0 and 1 only
    end.num_prompt_tokens, end.prompt_logprobs = 3, PromptLogprobsWanted(0, None)
    reqs = order_batch([mid, dec, end])
    assert targets(mid) == [6, 7, 29] and targets(end) == [14, 15]
    inputs = prepare_inputs(reqs, 4, torch.device("cpu"))
    # dec samples at row 0, end at row 6; then mid's rows 1..3 and end's rows 4, 5.
    assert inputs.logits_indices.tolist() == [0, 6, 1, 2, 3, 4, 5]
    logits = torch.randn(7, 32)
    sampled, chunks = split_logits(logits, reqs, num_sample_rows=2)
    assert torch.equal(sampled, logits[:2])
    assert chunks["mid"].start == 5 and len(chunks["mid"].entries) == 3
    lp = logits[2].log_softmax(-1)
    first = chunks["mid"].entries[0]
    assert first.logprob == pytest.approx(float(lp[6]))
    assert first.top_ids == lp.topk(2).indices.tolist()
    assert chunks["end"].start == 1 and [e.top_ids for e in chunks["end"].entries] == [[], []]
