"""The scheduler's step on its own: a real ``KVCacheManager`` and hand-made runner outputs.

``schedule()`` decides the batch; the test plays the model runner by building the
``ModelRunnerOutput`` (the sampled tokens per request) and hands it to ``update_from_output()``.
Block size 4 throughout, so block arithmetic stays checkable by hand. After every request has
ended, the pool's free-block count is back at ``num_blocks``: a leaked block shows there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest
import xgrammar as xgr

from pagedserve.actors.actor import Actor
from pagedserve.actors.core.config import SchedulerConfig
from pagedserve.actors.core.request import Request, RequestStatus
from pagedserve.actors.core.scheduler import Scheduler
from pagedserve.actors.kv.kv_cache_manager import KVCacheManager
from pagedserve.actors.messages import GrammarReady
from pagedserve.actors.spec_decode.proposer import SpeculativeConfig
from pagedserve.actors.structured_output.request import StructuredOutputRequest
from pagedserve.gpu.batch import ModelRunnerOutput, SchedulerOutput
from pagedserve.gpu.sample.sampling_params import SamplingParams

BS = 4  # tokens per block
EOS = 2
TOKEN = 7  # what the stand-in runner samples unless told otherwise


def make(num_blocks: int = 16, *, max_num_seqs: int = 8, budget: int = 64,
         policy: str = "fcfs", spec: SpeculativeConfig | None = None, caching: bool = False,
         max_model_len: int = 256) -> tuple[Scheduler, KVCacheManager]:
    kv = KVCacheManager(num_blocks, BS, enable_caching=caching)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             policy=policy, speculative=spec)
    return Scheduler(config, kv, Actor(), max_model_len), kv


def req(rid: str, prompt: int | list[int], *, max_tokens: int | None = 16, priority: int = 0,
        arrival: float = 0.0, **params) -> Request:
    tokens = list(range(100, 100 + prompt)) if isinstance(prompt, int) else prompt
    return Request(rid, tokens, SamplingParams(temperature=0.0, max_tokens=max_tokens, **params),
                   asyncio.Queue(), eos_token_ids=frozenset({EOS}), priority=priority,
                   arrival_time=arrival)


def add(sched: Scheduler, *requests: Request) -> None:
    for r in requests:
        sched.add_request(r)


def step(sched: Scheduler, sampled: dict[str, list[int]] | None = None) -> SchedulerOutput:
    """One step; every request that samples gets ``sampled[id]``, else ``[TOKEN]``."""
    so = sched.schedule()
    sampled = sampled or {}
    out = ModelRunnerOutput({sr.req_id: sampled.get(sr.req_id, [TOKEN])
                             for sr in so.scheduled if sr.sample})
    sched.update_from_output(so, out)
    return so


def sizes(so: SchedulerOutput) -> dict[str, int]:
    return {sr.req_id: len(sr.token_ids) for sr in so.scheduled}


def outputs(r: Request) -> list[tuple[list[int], str | None]]:
    items = []
    while not r.output_queue.empty():
        o = r.output_queue.get_nowait()
        items.append((o.new_token_ids, o.finish_reason))
    return items


# -- budget and chunking --------------------------------------------------------------------


def test_a_long_prompt_is_chunked_by_the_budget_and_samples_only_at_its_end():
    sched, kv = make(budget=10)
    a = req("a", 25)
    add(sched, a)
    chunks = [step(sched).scheduled[0] for _ in range(3)]
    assert [(sr.num_computed_tokens, len(sr.token_ids)) for sr in chunks] == [
        (0, 10), (10, 10), (20, 5)]
    assert [sr.sample for sr in chunks] == [False, False, True]
    assert chunks[2].token_ids == a.prompt_token_ids[20:25]
    assert a.num_computed_tokens == 25 and a.output_token_ids == [TOKEN]
    assert len(chunks[2].block_ids) == 7  # ceil(25 / 4): no block for tokens not yet known
    decode = step(sched).scheduled[0]
    assert (decode.token_ids, decode.num_computed_tokens) == ([TOKEN], 25)


def test_running_requests_go_first_and_the_last_admission_takes_the_rest_of_the_budget():
    sched, kv = make(budget=10)
    a, b, c = req("a", 6), req("b", 7), req("c", 3)
    add(sched, a, b, c)
    assert sizes(step(sched)) == {"a": 6, "b": 4}  # c waits: the budget is spent
    so = step(sched)
    assert sizes(so) == {"a": 1, "b": 3, "c": 3}  # decode, rest of b, then c (7 of 10)
    assert [sr.sample for sr in so.scheduled] == [True, True, True]
    assert so.total_num_scheduled_tokens == 7


def test_max_num_seqs_holds_admissions_until_a_seat_frees():
    sched, kv = make(max_num_seqs=2)
    a, b, c = req("a", 4), req("b", 4), req("c", 4)
    add(sched, a, b, c)
    assert sizes(step(sched, {"a": [EOS]})) == {"a": 4, "b": 4}
    assert outputs(a) == [([EOS], "stop")]
    assert sizes(step(sched)) == {"b": 1, "c": 4}


def test_prefix_cache_hit_skips_the_cached_blocks_and_tells_the_runner_their_tokens():
    sched, kv = make(caching=True)
    prompt = list(range(100, 110))  # 10 tokens: blocks [0:4] and [4:8] full
    first = req("first", prompt)
    add(sched, first)
    step(sched)
    second = req("second", prompt)
    add(sched, second)
    sr = step(sched).scheduled[1]
    assert (sr.req_id, sr.num_computed_tokens, sr.token_ids) == ("second", 8, prompt[8:])
    assert sr.prefix_token_ids == prompt[:8]
    assert sr.block_ids[:2] == kv.get_block_ids("first")[:2]  # shared, not copied
    assert second.num_cached_tokens == 8
    sched.abort_request("first")
    sched.abort_request("second")
    assert kv.block_pool.get_num_free_blocks() == 16


# -- preemption -----------------------------------------------------------------------------


def test_out_of_blocks_preempts_the_latest_arrived_and_it_recomputes_from_the_front():
    sched, kv = make(num_blocks=4)
    a, b, c = req("a", 4), req("b", 4), req("c", 4)
    add(sched, a, b, c)
    step(sched)  # one block each; each now has a 5th token that needs a second block
    assert kv.block_pool.get_num_free_blocks() == 1
    so = step(sched, {"a": [EOS]})  # a takes the free block, b gets c's
    assert sizes(so) == {"a": 1, "b": 1}
    assert c.status == RequestStatus.PREEMPTED and sched.waiting.peek() is c
    assert (c.num_computed_tokens, c.num_preemptions, sched.num_preemptions) == (0, 1, 1)
    assert kv.get_block_ids("c") == [] and b.status == RequestStatus.RUNNING
    # a finished: its two blocks let c back in, recomputing its prompt and its output.
    sr = step(sched).scheduled[1]
    assert (sr.req_id, sr.num_computed_tokens, sr.token_ids) == ("c", 0, c.prompt_token_ids
                                                                  + [TOKEN])
    assert sr.sample and c.output_token_ids == [TOKEN, TOKEN]  # the recompute samples anew


def test_a_request_that_cannot_grow_preempts_itself_when_nobody_is_left_behind_it():
    sched, kv = make(num_blocks=2)
    b, c = req("b", 4), req("c", 4)
    add(sched, b, c)
    step(sched)
    so = step(sched)  # b needs a second block: c (latest) goes, and b takes its block
    assert sizes(so) == {"b": 1} and c.status == RequestStatus.PREEMPTED
    for _ in range(3):  # b's tokens 6 to 8 fill its second block
        assert sizes(step(sched)) == {"b": 1}
    so = sched.schedule()  # its 9th token needs a third block; the only one left to go is b
    assert so.scheduled == [] and b.status == RequestStatus.PREEMPTED
    assert [r.request_id for r in sched.waiting] == ["b", "c"]  # b in front again
    assert kv.block_pool.get_num_free_blocks() == 2 and sched.num_preemptions == 2


def test_a_step_that_preempted_admits_nobody_even_if_the_head_would_fit():
    sched, kv = make(num_blocks=5, policy="priority")
    a = req("a", 4, priority=0, arrival=1)
    b = req("b", 4, priority=0, arrival=2)
    c = req("c", 8, priority=1, arrival=3)  # two blocks
    add(sched, a, b, c)
    step(sched)
    add(sched, req("d", 2, priority=1, arrival=0.5))  # ahead of c in the queue
    so = step(sched)  # a takes the last free block; b's preempts c, which frees two
    assert sizes(so) == {"a": 1, "b": 1} and c.status == RequestStatus.PREEMPTED
    assert kv.block_pool.get_num_free_blocks() == 1  # d (one block) would fit: not this step
    assert [r.request_id for r in sched.waiting] == ["d", "c"]
    assert sizes(step(sched)) == {"a": 1, "b": 1, "d": 2}


# -- priority -------------------------------------------------------------------------------


def test_priority_preempts_the_worst_running_for_a_better_arrival_when_seats_are_full():
    sched, kv = make(max_num_seqs=2, policy="priority")
    a = req("a", 4, priority=1, arrival=1)
    b = req("b", 4, priority=2, arrival=2)
    add(sched, a, b)
    step(sched)
    add(sched, req("same", 4, priority=2, arrival=0))  # not strictly better than b: waits
    assert sizes(step(sched)) == {"a": 1, "b": 1}
    add(sched, req("best", 4, priority=0, arrival=3))
    so = step(sched)
    assert sizes(so) == {"a": 1, "best": 4} and b.status == RequestStatus.PREEMPTED
    assert [r.request_id for r in sched.waiting] == ["same", "b"]  # (2, 0) before (2, 2)
    assert [sr.req_id for sr in step(sched).scheduled] == ["best", "a"]  # running, best first


def test_priority_admits_in_priority_then_arrival_order():
    sched, kv = make(max_num_seqs=1, policy="priority")
    add(sched, req("late", 4, priority=1, arrival=1), req("early", 4, priority=1, arrival=0),
        req("urgent", 4, priority=-1, arrival=2))
    assert [sr.req_id for sr in sched.schedule().scheduled] == ["urgent"]
    assert [r.request_id for r in sched.waiting] == ["early", "late"]


# -- stopping -------------------------------------------------------------------------------


def test_length_limits_and_min_tokens():
    sched, kv = make(max_model_len=6)
    a = req("a", 4, max_tokens=2)
    b = req("b", 4, max_tokens=None)  # the context (6 tokens) ends it
    c = req("c", 4, min_tokens=2)  # EOS first is masked by the sampler; here it is not final
    add(sched, a, b, c)
    step(sched, {"c": [EOS]})
    assert c.status == RequestStatus.RUNNING
    step(sched)
    assert [outputs(r)[-1][1] for r in (a, b)] == ["length", "length"]
    assert c.status == RequestStatus.FINISHED_LENGTH  # also 6 tokens
    assert kv.block_pool.get_num_free_blocks() == 16 and not sched.has_unfinished_requests()


# -- grammar parking ------------------------------------------------------------------------


def _compiled_regex(regex: str) -> xgr.CompiledGrammar:
    info = xgr.TokenizerInfo(["a", "b", "c", "</s>"], stop_token_ids=[3])
    return xgr.GrammarCompiler(info).compile_regex(regex)


def _guided(rid: str) -> tuple[Request, concurrent.futures.Future]:
    compile_future: concurrent.futures.Future = concurrent.futures.Future()
    r = req(rid, 4)
    r.structured_output = StructuredOutputRequest(compile_future)
    return r, compile_future


async def grammar_ready(sched: Scheduler) -> GrammarReady:
    """The message the compile posts when it ends (it arrives on the loop's next turn; the
    timeout only turns a bug that never posts it into a failure instead of a hang)."""
    msg = await asyncio.wait_for(sched.mailbox.get(), timeout=60)
    assert isinstance(msg, GrammarReady)
    return msg


async def test_a_request_waits_for_its_grammar_while_others_run():
    sched, kv = make()
    g, compile_future = _guided("g")
    add(sched, g, other := req("other", 4))
    assert g.status == RequestStatus.WAITING_FOR_GRAMMAR
    assert sizes(step(sched)) == {"other": 4}
    compile_future.set_result(_compiled_regex("a+"))
    sched._handle(await grammar_ready(sched))  # the GrammarReady the compile posted
    so = sched.schedule()
    assert sizes(so) == {"other": 1, "g": 4} and so.structured_output_request_ids == {"g": 0}
    assert so.grammar_bitmask.tolist()[0][0] & 0b1111 == 0b0001  # only "a" may start
    sched.update_from_output(so, ModelRunnerOutput({"other": [TOKEN], "g": [0]}))
    assert sched.schedule().grammar_bitmask.tolist()[0][0] & 0b1111 == 0b1001  # "a" or end
    assert other.status == RequestStatus.RUNNING


async def test_a_failed_compile_fails_only_its_request():
    sched, kv = make()
    g, compile_future = _guided("g")
    add(sched, g)
    compile_future.set_exception(ValueError("unclosed bracket"))
    sched._handle(await grammar_ready(sched))
    assert g.status == RequestStatus.FINISHED_ERROR and "g" not in sched.requests
    item = g.output_queue.get_nowait()
    assert (item.finish_reason, item.error) == ("error", "unclosed bracket")
    assert sched.schedule().finished_req_ids == {"g"}


# -- abort in every state -------------------------------------------------------------------


def _abort_and_check(sched: Scheduler, kv: KVCacheManager, r: Request) -> None:
    sched.abort_request(r.request_id)
    assert r.status == RequestStatus.FINISHED_ABORTED
    assert r.request_id not in sched.requests and r not in sched.running
    assert r not in list(sched.waiting) and r.request_id not in sched.waiting_for_grammar
    assert r.request_id in sched.finished_req_ids  # the next step tells the runner
    sched.abort_request(r.request_id)  # a second abort is a no-op


async def test_abort_in_every_state_frees_every_block():
    sched, kv = make(num_blocks=4, budget=16)
    waiting, mid_prefill = req("waiting", 4), req("mid-prefill", 20)
    add(sched, mid_prefill, waiting)
    step(sched)  # mid-prefill has 16 of 20 computed; waiting was not admitted
    assert mid_prefill.num_computed_tokens == 16 and waiting.status == RequestStatus.WAITING
    assert mid_prefill.status == RequestStatus.RUNNING
    _abort_and_check(sched, kv, waiting)
    _abort_and_check(sched, kv, mid_prefill)
    assert kv.block_pool.get_num_free_blocks() == 4

    g, compile_future = _guided("parked")
    add(sched, g)
    _abort_and_check(sched, kv, g)
    compile_future.set_exception(ValueError("too late"))
    sched._handle(await grammar_ready(sched))  # GrammarReady for a request that is gone
    assert g.output_queue.empty() and g.status == RequestStatus.FINISHED_ABORTED

    decoding, victim = req("decoding", 8), req("victim", 8)
    add(sched, decoding, victim)
    step(sched)  # two blocks each
    step(sched)  # decoding's 9th token needs a third: victim (latest) goes
    assert victim.status == RequestStatus.PREEMPTED and kv.block_pool.get_num_free_blocks() == 1
    _abort_and_check(sched, kv, victim)
    _abort_and_check(sched, kv, decoding)
    sched.abort_request("never-seen")
    assert kv.block_pool.get_num_free_blocks() == 4 and not sched.has_unfinished_requests()


def test_abort_while_its_step_runs_drops_the_step_result():
    sched, kv = make(caching=True)
    a, b = req("a", 4), req("b", 4)
    add(sched, a, b)
    so = sched.schedule()
    sched.abort_request("a")  # the client left while the runner computed
    sched.update_from_output(so, ModelRunnerOutput({"a": [TOKEN], "b": [TOKEN]}))
    assert a.output_token_ids == [] and a.output_queue.empty()
    assert b.output_token_ids == [TOKEN] and a.num_computed_tokens == 0
    assert kv.block_pool.get_num_free_blocks() == 15  # b's one block
    assert sched.schedule().finished_req_ids == {"a"}
    sched.abort_request("b")
    assert kv.block_pool.get_num_free_blocks() == 16


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_many_requests_under_pressure_end_with_every_block_free(policy):
    sched, kv = make(num_blocks=6, budget=7, max_num_seqs=3, policy=policy, caching=True)
    requests = [req(f"r{i}", 3 + i % 5, max_tokens=4 + i % 3, priority=i % 2, arrival=i)
                for i in range(8)]
    add(sched, *requests)
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        so = step(sched)
        assert so.total_num_scheduled_tokens <= 7 and len(sched.running) <= 3
    assert all(len(r.output_token_ids) == r.sampling_params.max_tokens for r in requests)
    assert sched.num_preemptions > 0  # the pool really was short
    assert kv.block_pool.get_num_free_blocks() == 6
