"""Prompt logprobs through the scheduler: what each prefill chunk asks of the runner, how the
chunks add up on the request, the prefix cache skipped for such a request, and a recompute
after preemption that adds no duplicate. The test plays the runner with ``targets``, the
function the real runner uses, and marks each entry with its target token."""

from __future__ import annotations

import asyncio

from pagedserve.actors.core.request import Request
from pagedserve.gpu.batch import ModelRunnerOutput, SchedulerOutput
from pagedserve.gpu.sample.prompt_logprobs import PromptLogprobsChunk, targets
from pagedserve.gpu.sample.sampler import TokenLogprobs
from tests.actors.core.test_scheduler import TOKEN, add, make, req


def run_step(sched) -> SchedulerOutput:
    """One step; the stand-in runner's prompt logprob for token ``t`` is ``-t``."""
    so = sched.schedule()
    chunks = {}
    for sr in so.scheduled:
        ids = targets(sr)
        if ids:
            chunks[sr.req_id] = PromptLogprobsChunk(
                sr.num_computed_tokens + 1, [TokenLogprobs(-t, 1, [], []) for t in ids])
    sampled = {sr.req_id: [TOKEN] for sr in so.scheduled if sr.sample}
    sched.update_from_output(so, ModelRunnerOutput(sampled, {}, chunks))
    return so


def test_chunks_carry_the_next_prompt_token_and_add_up_to_every_prompt_token():
    sched, _ = make(budget=4, caching=True)
    a = req("a", 10, prompt_logprobs=1)
    add(sched, a)
    wanted = [run_step(sched).scheduled[0].prompt_logprobs for _ in range(3)]
    assert [w.next_token_id for w in wanted] == [a.prompt_token_ids[4], a.prompt_token_ids[8],
                                                  None]
    out = a.output_queue.get_nowait()
    assert [lp.logprob for lp in out.prompt_logprobs] == [-t for t in a.prompt_token_ids[1:]]
    assert run_step(sched).scheduled[0].prompt_logprobs is None  # a decode asks nothing
    assert a.output_queue.get_nowait().prompt_logprobs is None  # sent once, with the first


def test_a_request_wanting_prompt_logprobs_takes_no_prefix_cache_hit():
    sched, _ = make(budget=64, caching=True)
    add(sched, req("a", 12))
    run_step(sched)
    plain, wanting = req("b", 12), req("c", 12, prompt_logprobs=0)
    add(sched, plain, wanting)
    so = run_step(sched)
    computed = {sr.req_id: sr.num_computed_tokens for sr in so.scheduled}
    assert computed["b"] == 8 and computed["c"] == 0
    assert plain.output_queue.get_nowait().num_cached_tokens == 8
    first = wanting.output_queue.get_nowait()
    assert first.num_cached_tokens == 0 and len(first.prompt_logprobs) == 11


def test_a_recomputed_chunk_adds_only_what_is_missing():
    r = Request("r", list(range(10, 20)), req("x", 1).sampling_params, asyncio.Queue())
    entry = [TokenLogprobs(float(-t), 1, [], []) for t in range(11, 20)]
    r.add_prompt_logprobs(PromptLogprobsChunk(1, entry[:4]))  # tokens 1..4
    r.add_prompt_logprobs(PromptLogprobsChunk(1, entry[:2]))  # recomputed after preemption
    r.add_prompt_logprobs(PromptLogprobsChunk(3, entry[2:6]))  # overlaps by two
    r.add_prompt_logprobs(PromptLogprobsChunk(7, entry[6:]))
    assert [lp.logprob for lp in r.prompt_logprobs] == [float(-t) for t in range(11, 20)]
