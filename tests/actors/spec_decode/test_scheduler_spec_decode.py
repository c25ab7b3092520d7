"""The scheduler with n-gram speculative decoding: which decodes get drafts and how many, what
the blocks and the budget allow, and what the runner's accepted drafts do to a request.
Helpers and conventions (block size 4, hand-made runner outputs) as in ``test_scheduler``."""

from __future__ import annotations

from pagedserve.actors.core.request import RequestStatus
from pagedserve.actors.spec_decode.proposer import SpeculativeConfig
from pagedserve.gpu.batch import ModelRunnerOutput
from tests.actors.core.test_scheduler import EOS, add, make, outputs, req, sizes, step

NGRAM = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2, prompt_lookup_min=1)


def test_drafts_accepted_advance_the_request_and_rejected_ones_roll_back():
    sched, kv = make(spec=NGRAM)
    a = req("a", [5, 6, 7, 8, 5, 6])
    add(sched, a)
    step(sched)  # the prompt; samples 7: "6 7" recurs, followed by 8 5 6
    so = sched.schedule()
    sr = so.scheduled[0]
    assert (sr.token_ids, sr.spec_token_ids, sr.num_computed_tokens) == ([7], [8, 5, 6], 6)
    assert so.total_num_scheduled_tokens == 4 and len(sr.block_ids) == 3  # room for 10 tokens
    # The runner accepts the first draft (8) and samples 9 where the second (5) was.
    sched.update_from_output(so, ModelRunnerOutput({"a": [8, 9]}))
    assert a.output_token_ids == [7, 8, 9] and a.num_computed_tokens == 8
    assert (sched.num_draft_tokens, sched.num_accepted_tokens) == (3, 1)
    sd = sched.stats().scheduler.spec_decode
    assert (sd.num_drafts, sd.drafted_per_pos, sd.accepted_per_pos) == (1, [1, 1, 1], [1, 0, 0])
    assert sd.acceptance_rate_per_pos == [1.0, 0.0, 0.0] and sd.mean_acceptance_length == 2.0
    assert outputs(a) == [([7], None), ([8, 9], None)]
    sr = sched.schedule().scheduled[0]  # positions 8, 9 held drafts 5, 6: overwritten now
    assert (sr.token_ids, sr.num_computed_tokens, sr.spec_token_ids) == ([9], 8, [])
    assert len(sr.block_ids) == 3  # the drafts' block is kept, not freed and retaken


def test_drafts_stop_short_of_max_tokens():
    sched, kv = make(spec=NGRAM)
    a = req("a", [5, 6, 7, 8, 5, 6], max_tokens=3)
    add(sched, a)
    step(sched)
    so = sched.schedule()
    assert so.scheduled[0].spec_token_ids == [8]  # 7 sampled + 1 draft + 1 bonus = 3 tokens
    sched.update_from_output(so, ModelRunnerOutput({"a": [8, 9]}))
    assert outputs(a)[-1] == ([8, 9], "length") and a.output_token_ids == [7, 8, 9]
    assert kv.block_pool.get_num_free_blocks() == 16


def test_drafts_share_the_step_budget_and_leave_none_for_admissions():
    sched, kv = make(spec=NGRAM, budget=3)
    c = req("c", [5, 6, 7, 8, 5, 6])
    add(sched, c)
    assert sizes(step(sched)) == {"c": 3} and sizes(step(sched)) == {"c": 3}
    add(sched, req("d", 2))
    so = sched.schedule()  # the decode takes 1 of 3: two drafts fill the rest, d waits
    assert sizes(so) == {"c": 1} and so.scheduled[0].spec_token_ids == [8, 5]
    assert so.total_num_scheduled_tokens == 3


def test_drafts_count_against_the_budget_of_the_running_requests_after_them():
    sched, kv = make(spec=NGRAM, budget=6)
    c, e = req("c", [5, 6, 7, 8, 5, 6]), req("e", 20)
    add(sched, c, e)
    step(sched)  # c's prompt takes the whole budget
    step(sched, {"c": [8, 5, 6, 7]})  # 1 + 3 drafts, all accepted; e admitted with the 2 left
    so = sched.schedule()  # "6 7" recurs again: 8 5 6
    assert [(sr.req_id, len(sr.token_ids), sr.spec_token_ids) for sr in so.scheduled] == [
        ("c", 1, [8, 5, 6]), ("e", 2, [])]
    assert so.total_num_scheduled_tokens == 6


def test_drafts_never_preempt_and_are_dropped_when_their_blocks_are_short():
    sched, kv = make(num_blocks=3, spec=NGRAM)
    a = req("a", [5, 6, 7, 8, 5, 6])  # two blocks; the decode at position 6 fits the second
    b = req("b", 3)  # one block; its decode at position 3 fits it
    add(sched, a, b)
    step(sched, {"a": [7]})
    so = sched.schedule()  # a's drafts need a third block: none is free, b is not touched
    assert [(sr.req_id, sr.spec_token_ids) for sr in so.scheduled] == [("a", []), ("b", [])]
    assert sched.num_preemptions == 0 and b.status == RequestStatus.RUNNING


def test_a_stop_among_accepted_drafts_ends_the_output_there():
    sched, kv = make(spec=NGRAM, caching=True)
    a = req("a", [5, 6, EOS, 8, 5])
    add(sched, a)
    step(sched, {"a": [6]})  # "5 6" recurs: the drafts are EOS 8 5
    so = sched.schedule()
    assert so.scheduled[0].spec_token_ids == [EOS, 8, 5]
    sched.update_from_output(so, ModelRunnerOutput({"a": [EOS, 8, 5, 9]}))  # all accepted
    assert a.output_token_ids == [6, EOS] and a.status == RequestStatus.FINISHED_STOPPED
    assert outputs(a)[-1] == ([EOS], "stop")
    assert kv.block_pool.get_num_free_blocks() == 16


def test_no_drafts_while_the_batch_is_larger_than_disable_by_batch_size():
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2,
                             prompt_lookup_min=1, disable_by_batch_size=1)
    sched, kv = make(spec=spec)
    add(sched, req("a", [5, 6, 7, 8, 5, 6]), req("b", [5, 6, 7, 8, 5, 6]))
    step(sched)
    assert [sr.spec_token_ids for sr in sched.schedule().scheduled] == [[], []]
    sched.abort_request("b")
    assert sched.schedule().scheduled[0].spec_token_ids == [8, 5, 6]
