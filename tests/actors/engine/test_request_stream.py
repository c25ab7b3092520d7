"""RequestStream on the tiny model: every way a request ends leaves the scheduler with no
blocks held, and reports the end to the stat loggers exactly once."""

from __future__ import annotations

import asyncio
import gc

import pytest
import pytest_asyncio

from pagedserve.actors.engine.async_engine import AsyncEngine
from pagedserve.actors.engine.request_stream import StreamState, close_all
from pagedserve.actors.stats import RequestUpdate, StepStats
from pagedserve.gpu.sample.sampling_params import SamplingParams
from tests.conftest import chat_prompt_ids, engine_config


class Ends:
    """A stat logger that keeps the finish reasons it is told."""

    def __init__(self) -> None:
        self.reasons: list[str] = []

    def record_step(self, step: StepStats) -> None:
        pass

    def record_request(self, update: RequestUpdate) -> None:
        if update.finish_reason is not None:
            self.reasons.append(update.finish_reason)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engine(tiny_model_dir):
    engine = await AsyncEngine.start(engine_config(tiny_model_dir, num_blocks=64))
    yield engine
    await engine.shutdown()


@pytest.fixture
def ends(engine):
    logger = Ends()
    engine.add_stat_logger(logger)
    yield logger
    engine.stat_loggers.remove(logger)


async def assert_no_block_held(engine: AsyncEngine) -> None:
    # The stats query reaches the scheduler after any AbortRequest sent before it.
    s = await engine.get_stats()
    assert s.scheduler.num_running == s.scheduler.num_waiting == 0, s.scheduler
    assert s.kv_cache.num_free_blocks == s.kv_cache.num_blocks


def params(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


async def test_scheduler_ends_it_and_closing_after_does_nothing(engine, ends, tiny_model_dir):
    ids = chat_prompt_ids(tiny_model_dir, "Hi")
    stream = await engine.add_request("done", ids, params(5))
    deltas = [d async for d in stream]
    assert deltas[-1].finish_reason == "length" and deltas[-1].num_output_tokens == 5
    assert stream.state is StreamState.FINISHED
    close_all([stream, stream])
    await stream.aclose()
    assert stream.state is StreamState.FINISHED and ends.reasons == ["length"]
    await assert_no_block_held(engine)


async def test_stop_string_aborts_in_the_scheduler_but_reports_stop(engine, ends,
                                                                      tiny_model_dir):
    ids = chat_prompt_ids(tiny_model_dir, "Tell me a story")
    full = "".join([d.text async for d in engine.generate("full", ids, params(30))])
    stream = await engine.add_request("cut", ids, params(30, stop=[full[8:11]]))
    deltas = [d async for d in stream]
    assert deltas[-1].finish_reason == "stop"
    assert stream.state is StreamState.ABORTED  # the scheduler was told to let go
    stream.close()
    assert ends.reasons == ["length", "stop"]
    await assert_no_block_held(engine)


async def test_closed_mid_stream_aborts_once(engine, ends, tiny_model_dir):
    ids = chat_prompt_ids(tiny_model_dir, "Hi")
    stream = await engine.add_request("closed", ids, params(400))
    first = await stream.__anext__()
    assert first.finish_reason is None
    await stream.aclose()
    stream.close()
    assert stream.state is StreamState.ABORTED and ends.reasons == ["abort"]
    assert [d async for d in stream] == []  # nothing more after a close
    await assert_no_block_held(engine)


async def test_reader_cancelled_while_waiting_aborts(engine, ends, tiny_model_dir):
    ids = chat_prompt_ids(tiny_model_dir, "Hi")
    stream = await engine.add_request("cancelled", ids, params(400))
    got: list[int] = []

    async def read() -> None:
        async for d in stream:
            got.append(len(d.token_ids))

    task = asyncio.create_task(read())
    while not got:  # reading has started
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert stream.state is StreamState.ABORTED and ends.reasons == ["abort"]
    await assert_no_block_held(engine)


async def test_dropped_unread_frees_the_blocks(engine, ends, tiny_model_dir):
    ids = chat_prompt_ids(tiny_model_dir, "Hi")
    stream = await engine.add_request("dropped", ids, params(400))
    del stream
    gc.collect()
    assert ends.reasons == ["abort"]
    await assert_no_block_held(engine)
