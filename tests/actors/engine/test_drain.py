"""AsyncEngine.drain on the tiny model: it waits for the scheduler to say it is idle, and
after its timeout it ends what is left with a shutdown error."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.actors.engine.async_engine import AsyncEngine
from pagedserve.actors.errors import EngineShuttingDown
from pagedserve.gpu.sample.sampling_params import SamplingParams
from tests.conftest import chat_prompt_ids, engine_config


async def test_drain_lets_requests_finish_then_ends_the_rest(tiny_model_dir):
    engine = await AsyncEngine.start(engine_config(tiny_model_dir))
    try:
        ids = chat_prompt_ids(tiny_model_dir, "Hi")
        await engine.drain(60)  # idle: answered, nothing to end

        short = await engine.add_request("short", ids, SamplingParams(
            temperature=0, max_tokens=20, ignore_eos=True))
        await engine.drain(600)  # returns once the request is done (else: aborted at 600 s)
        deltas = [d async for d in short]
        assert deltas[-1].finish_reason == "length" and deltas[-1].num_output_tokens == 20

        # Far longer than any machine manages in no time: the drain's timeout ends it.
        long = await engine.add_request("long", ids, SamplingParams(
            temperature=0, max_tokens=400, ignore_eos=True))
        await engine.drain(0)
        with pytest.raises(EngineShuttingDown, match="server shutting down"):
            async for _ in long:
                pass
        s = await engine.get_stats()
        assert s.scheduler.num_running == s.scheduler.num_waiting == 0
        assert s.kv_cache.num_free_blocks == s.kv_cache.num_blocks
    finally:
        await engine.shutdown()


async def test_a_drain_that_gave_up_leaves_the_scheduler_serving(tiny_model_dir):
    engine = await AsyncEngine.start(engine_config(tiny_model_dir))
    try:
        ids = chat_prompt_ids(tiny_model_dir, "Hi")
        long = await engine.add_request("long", ids, SamplingParams(
            temperature=0, max_tokens=400, ignore_eos=True))
        with pytest.raises(asyncio.TimeoutError):  # its NotifyWhenIdle reply is cancelled
            await asyncio.wait_for(engine.wait_idle(), 0)
        long.close()
        await asyncio.wait_for(engine.wait_idle(), 60)  # the scheduler answers a later one
    finally:
        await engine.shutdown()


async def test_a_drain_ends_the_requests_not_yet_started_at_once(tiny_model_dir):
    """Only running requests get the grace: one waiting for a seat (``max_num_seqs=1``) ends
    with the shutdown error while the running one goes on."""
    engine = await AsyncEngine.start(engine_config(tiny_model_dir, max_num_seqs=1))
    try:
        ids = chat_prompt_ids(tiny_model_dir, "Hi")
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        running = await engine.add_request("running", ids, params)
        first = await running.__anext__()
        assert first.token_ids
        waiting = await engine.add_request("waiting", ids, params)
        drain = asyncio.create_task(engine.drain(600))
        with pytest.raises(EngineShuttingDown, match="server shutting down"):
            async for _ in waiting:
                pass
        s = await engine.get_stats()
        assert s.scheduler.num_running == 1 and s.scheduler.num_waiting == 0
        assert not drain.done()
        running.close()  # the client leaves: the drain ends, long before its 600 s
        await asyncio.wait_for(drain, 60)
    finally:
        await engine.shutdown()
