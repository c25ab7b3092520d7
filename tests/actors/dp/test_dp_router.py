"""KV events from a real block pool and the data-parallel router's policies over them: the
hashes are the engines' own (a ``KVCacheManager`` per engine, its ``KVEventPublisher`` feeding
the router), so a prompt the router matches is one the engine would hit."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.actors.core.request import Request
from pagedserve.actors.dp.router import (
    PREFIX_LOAD_THRESHOLD,
    PROMPT_TOKENS_PER_REQUEST,
    DPRouter,
    NoEngineLeft,
)
from pagedserve.actors.kv.event_publisher import KVEventPublisher
from pagedserve.actors.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineLoad,
    KVEventBatch,
)
from pagedserve.actors.kv.kv_cache_manager import KVCacheManager
from pagedserve.gpu.sample.sampling_params import SamplingParams

BS = 4  # tokens per block


class Engine:
    """One engine's KV side: its manager, and its publisher wired to ``sinks``."""

    def __init__(self, index: int, *sinks, num_blocks: int = 64, salt_algo: str = "sha256"):
        self.kv = KVCacheManager(num_blocks, BS, True, salt_algo)
        self.events = KVEventPublisher(self.kv.block_pool, index)
        for sink in sinks:
            self.events.add_sink(sink)
        self.n = 0

    def run(self, tokens: list[int], salt: str | None = None, free: bool = True) -> Request:
        """Admit and prefill a prompt as the scheduler does, then flush the step's events."""
        self.n += 1
        r = Request(f"r{self.n}", tokens, SamplingParams(), asyncio.Queue(), cache_salt=salt)
        self.kv.update_block_hashes(r)
        hits, _ = self.kv.get_computed_blocks(r)
        assert self.kv.allocate_slots(r, len(tokens) - len(hits) * BS, hits) is not None
        if free:
            self.kv.free(r)
        self.events.flush(0, 0)
        return r


def test_events_follow_the_pool_stored_evicted_cleared():
    batches: list[KVEventBatch] = []
    eng = Engine(3, batches.append, num_blocks=4)
    r = eng.run(list(range(10)))  # two full blocks and a partial one
    assert batches[0].engine_index == 3
    assert batches[0].events == [EngineLoad(0, 0), BlockStored(list(r.block_hashes))]
    eng.events.flush(0, 0)
    assert len(batches) == 1  # nothing new, load unchanged: nothing sent
    r2 = eng.run(list(range(100, 116)))  # four blocks: the pool's LRU evicts the first ones
    events = batches[1].events
    assert isinstance(events[0], BlockRemoved) and set(events[0].block_hashes) == set(
        r.block_hashes)
    assert events[1] == BlockStored(list(r2.block_hashes))
    eng.events.flush(2, 5)
    assert batches[2].events == [EngineLoad(2, 5)]
    assert eng.kv.reset_prefix_cache() == 4
    eng.events.flush(2, 5)
    assert batches[3].events == [AllBlocksCleared()]


def test_no_sink_no_recording():
    kv = KVCacheManager(8, BS)
    publisher = KVEventPublisher(kv.block_pool)
    assert kv.block_pool.kv_events is None  # the pool skips every hook
    publisher.flush(1, 1)  # and a flush is a no-op
    assert publisher._events == []


def test_prefix_routes_to_the_engine_holding_the_longest_leading_run():
    router = DPRouter(3, "prefix", BS)
    engines = [Engine(k, router.on_kv_events) for k in range(3)]
    system = list(range(1000, 1012))  # three blocks
    engines[1].run(system[:8])  # two blocks of it
    engines[2].run(system + [7, 7, 7, 7])  # all three, and one more
    prompt = system + [5, 5, 5, 5, 5]
    d = router.route(prompt)
    assert (d.engine, d.matched_blocks, d.reason) == (2, 3, "prefix")
    # The engine would find exactly those blocks.
    r = Request("x", prompt, SamplingParams(), asyncio.Queue())
    engines[2].kv.update_block_hashes(r)
    assert engines[2].kv.get_computed_blocks(r)[1] == 3 * BS
    # Another salt is another prefix: nobody holds it, so the lightest engine gets it.
    d = router.route(prompt, cache_salt="tenant-b")
    assert d.matched_blocks == 0 and d.reason == "load" and d.engine != 2


def test_prefix_gives_way_to_load_past_the_threshold():
    router = DPRouter(2, "prefix", BS)
    engines = [Engine(k, router.on_kv_events) for k in range(2)]
    engines[0].run(list(range(8)))
    engines[0].events.flush(PREFIX_LOAD_THRESHOLD, 0)
    d = router.route(list(range(9)))
    assert (d.engine, d.reason, d.loads) == (0, "prefix", [PREFIX_LOAD_THRESHOLD, 0])
    engines[0].events.flush(PREFIX_LOAD_THRESHOLD + 1, 0)  # now one past the threshold
    d = router.route(list(range(9)))
    assert (d.engine, d.reason, d.matched_blocks) == (1, "load", 0)


def test_least_load_round_robin_and_failed_engines():
    router = DPRouter(3, "least-load", BS)
    engines = [Engine(k, router.on_kv_events) for k in range(3)]
    engines[0].events.flush(3, 1)
    engines[1].events.flush(1, 0)
    engines[2].events.flush(2, 2)
    assert router.route([1, 2, 3]).engine == 1
    assert router.engines[1].load == 2  # counted on it at once, before its next EngineLoad
    assert router.route([1, 2, 3]).engine == 1  # 2 is still the lightest (tie → fewer sent)
    assert router.route([1, 2, 3]).engine in (0, 1)

    rr = DPRouter(3, "round-robin", BS)
    assert [rr.route([1]).engine for _ in range(4)] == [0, 1, 2, 0]
    rr.mark_failed(2, "gone")
    assert [rr.route([1]).engine for _ in range(3)] == [1, 0, 1]
    rr.mark_failed(0, "gone")
    rr.mark_failed(1, "gone")
    with pytest.raises(NoEngineLeft):
        rr.route([1])


def test_idle_ties_spread_requests_arriving_one_by_one():
    router = DPRouter(2, "prefix", BS)
    engines = [Engine(k, router.on_kv_events) for k in range(2)]
    chosen = []
    for c in range(4):  # four unrelated prompts, each finished before the next arrives
        d = router.route([c] * 8)
        engines[d.engine].run([c] * 8)
        chosen.append(d.engine)
    assert sorted(chosen) == [0, 0, 1, 1]
    for c in range(4):  # each follow-up goes where its prefix is
        assert router.route([c] * 8 + [9]).engine == chosen[c]


def test_a_failed_engine_forgets_its_cache_and_is_skipped():
    router = DPRouter(2, "prefix", BS)
    engines = [Engine(k, router.on_kv_events) for k in range(2)]
    engines[1].run(list(range(8)))
    router.mark_failed(1, "worker died")
    d = router.route(list(range(9)))
    assert d.engine == 0 and d.loads[1] == -1


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="routing policy"):
        DPRouter(2, "random")
    with pytest.raises(ValueError, match="at least one"):
        DPRouter(0)


async def test_a_real_engine_pushes_its_load_and_blocks(tiny_model_dir):
    """Through a real engine: a one-step request (max_tokens=1) is seen arriving and leaving,
    so the count the router adds when it sends a request does not stick; its prompt blocks
    arrive as stored hashes, and a reset clears them."""
    from pagedserve.actors.engine.async_engine import AsyncEngine
    from tests.conftest import engine_config

    engine = await AsyncEngine.start(engine_config(tiny_model_dir))
    try:
        router = DPRouter(1, "prefix", 16)
        batches: list[KVEventBatch] = []
        engine.add_kv_event_sink(router.on_kv_events)
        engine.add_kv_event_sink(batches.append)
        prompt = list(range(100, 140))  # two full blocks
        for max_tokens in (3, 1):  # the one-step request second: a push is owed to it
            d = router.route(prompt)
            assert router.engines[0].load == 1
            async for _ in engine.generate(f"r{max_tokens}", prompt,
                                           SamplingParams(temperature=0, max_tokens=max_tokens)):
                pass
            await engine.wait_idle()
            assert router.engines[0].load == 0
        assert d.matched_blocks == 2  # the second time, both blocks were known cached
        assert router.engines[0].cached == set(router.prompt_hashes(prompt))
        assert any(EngineLoad(0, 1) in b.events for b in batches)  # pushed on arrival
        assert await engine.reset_prefix_cache() > 0
        await engine.wait_idle()  # answered after the reset's loop turn has flushed
        assert router.engines[0].cached == set()
    finally:
        await engine.shutdown()


def test_a_short_shared_prefix_does_not_pull_a_burst_to_its_holder():
    """A chat template's system prompt is a block or two that every request shares: the
    engine that served the first request holds it, and must not draw the next ones while the
    other engine is lighter. A long match still does."""
    router = DPRouter(2, "prefix", BS)
    engines = [Engine(k, router.on_kv_events) for k in range(2)]
    engines[0].run(list(range(4)))  # one block: the "system prompt"
    engines[0].events.flush(1, 0)  # and it still runs that first request
    chosen = [router.route(list(range(4)) + [100 + i] * 12).engine for i in range(6)]
    assert chosen == [1, 0, 1, 0, 1, 0]  # 4 of 16 tokens matched: balanced by load
    d = router.route(list(range(4)) + [7] * 3)  # 4 of 7 tokens cached on engine 0
    assert (d.engine, d.reason, d.matched_blocks) == (0, "prefix", 1)


def test_the_fronts_count_replaces_the_lagging_pushed_one():
    """An ``EngineLoad`` sent before a routed request reached the engine says 0; the front's
    own count (requests sent, not finished) is what the router compares; among equal counts,
    the engine with fewer prompt tokens still to prefill wins."""
    router = DPRouter(2, "least-load", BS)
    engines = [Engine(k, router.on_kv_events) for k in range(2)]
    engines[0].events.flush(0, 0)  # stale: the engine has not seen its 3 requests yet
    engines[1].events.flush(2, 0)
    router.count_from_front(0, 3, 300)
    router.count_from_front(1, 2, 0)
    d = router.route([1] * 40)
    assert (d.engine, d.loads) == (1, [3, 2])
    assert (router.engines[1].load, router.engines[1].unanswered_tokens) == (3, 40)
    router.count_from_front(1, 3, 50)  # equal counts: fewer tokens to prefill wins
    assert router.route([1] * 40).engine == 1
    router.count_from_front(1, 3, 400)
    assert router.route([1] * 40).engine == 0


def _front_counted_router(policy: str) -> DPRouter:
    """Two idle engines whose load the front counts (so the score has its token figure)."""
    router = DPRouter(2, policy, BS)
    for k in range(2):
        router.count_from_front(k, 0, 0)
    return router


# The prompt lengths of loadgen's opening burst at 32 streams (seed 0, SmolLM2's chat template),
# in the order its requests are numbered.
LOADGEN_BURST = [329, 316, 114, 116, 123, 115, 114, 416, 85, 282, 125, 264, 126, 450, 284, 348,
                 449, 435, 250, 431, 130, 338, 94, 87, 99, 106, 345, 300, 109, 320, 120, 224]


def test_loadgen_s_burst_splits_its_prefill_within_3_percent_of_even():
    """The whole burst arrives before any prompt is answered. With a request weighing 256
    tokens its count still outweighed its tokens and the heavier engine got 4.7 % over half
    (3,898 / 3,546); the run's TTFT p99 is that engine's last first token."""
    for policy in ("least-load", "prefix"):
        router = _front_counted_router(policy)
        for k, n in enumerate(LOADGEN_BURST):
            router.route([k + 1] * n)
        tokens = [v.unanswered_tokens for v in router.engines]
        assert sum(tokens) == sum(LOADGEN_BURST)
        assert max(tokens) <= 1.03 * sum(tokens) / 2, (policy, tokens)


def test_a_burst_splits_its_prompt_tokens_not_only_its_requests():
    """Four prompts arrive before any finishes: long, short, short, long. Counting requests
    alone sends both long ones to engine 0 (800 tokens to prefill against 80), and the burst's
    last first token waits for that prefill. The score weighs the tokens still to prefill."""
    long, short = 400, 40
    for policy in ("least-load", "prefix"):
        router = _front_counted_router(policy)
        chosen = [router.route([k] * n).engine for k, n in enumerate((long, short, short, long))]
        tokens = [v.unanswered_tokens for v in router.engines]
        assert chosen == [0, 1, 1, 1] and tokens == [400, 480], policy
        assert [v.load for v in router.engines] == [1, 3]
        assert router.engines[1].score == 3 + 480 / PROMPT_TOKENS_PER_REQUEST
    # Without the front's count there is no token figure: the pushed counts alone decide.
    router = DPRouter(2, "least-load", BS)
    assert [router.route([k] * n).engine for k, n in enumerate((long, short, short, long))] == \
        [0, 1, 0, 1]
