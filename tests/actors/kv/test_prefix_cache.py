"""Hash chain and prefix-cache bookkeeping of the KV cache manager, and the engine's greedy
outputs with caching on equal to those with it off."""

from __future__ import annotations

import asyncio
import random
import uuid

from pagedserve.actors.core.request import Request
from pagedserve.actors.engine.async_engine import AsyncEngine
from pagedserve.actors.kv.hashing import (
    HASH_FUNCTIONS,
    ROOT_HASH,
    extend_block_hashes,
    hash_block_tokens,
)
from pagedserve.actors.kv.kv_cache_manager import KVCacheManager
from pagedserve.gpu.sample.sampling_params import SamplingParams
from tests.conftest import engine_config

SHA = HASH_FUNCTIONS["sha256"]


def test_hash_chain_depends_on_parent_tokens_and_tagged_extras():
    a = hash_block_tokens(SHA, ROOT_HASH, [1, 2, 3, 4])
    assert a == hash_block_tokens(SHA, ROOT_HASH, [1, 2, 3, 4]) and len(a) == 32
    assert a != hash_block_tokens(SHA, ROOT_HASH, [1, 2, 3, 5])
    child = hash_block_tokens(SHA, a, [5, 6, 7, 8])
    assert child != hash_block_tokens(SHA, ROOT_HASH, [5, 6, 7, 8])  # same block, other prefix
    salted = hash_block_tokens(SHA, ROOT_HASH, [1, 2, 3, 4], (("salt", "x"),))
    assert salted not in (a, hash_block_tokens(SHA, ROOT_HASH, [1, 2, 3, 4], (("salt", "y"),)))
    assert len(hash_block_tokens(HASH_FUNCTIONS["xxhash"], ROOT_HASH, [1, 2])) == 16  # 128-bit


def test_hashes_are_incremental():
    tokens = list(range(50))
    whole: list[bytes] = []
    extend_block_hashes(SHA, whole, tokens, 16)
    step: list[bytes] = []
    for n in range(1, 51):
        extend_block_hashes(SHA, step, tokens[:n], 16)
    assert step == whole and len(whole) == 3  # 50 tokens: three full blocks


def _req(rid: str, tokens: list[int], kv: KVCacheManager, salt: str | None = None) -> Request:
    r = Request(rid, tokens, SamplingParams(), asyncio.Queue(), cache_salt=salt)
    kv.update_block_hashes(r)
    return r


def _admit(kv: KVCacheManager, r: Request) -> int:
    hits, n = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - n, hits) is not None
    r.num_computed_tokens = r.num_tokens
    return n


def test_identical_prompt_hits_all_full_blocks_but_the_last_token():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    prompt = list(range(100, 116))  # exactly 4 full blocks
    first = _req("a", prompt, kv)
    assert _admit(kv, first) == 0
    second = _req("b", prompt, kv)
    # the block holding the last token is recomputed, so 3 of 4 blocks hit
    assert _admit(kv, second) == 12
    assert kv.get_block_ids("b")[:3] == kv.get_block_ids("a")[:3]
    assert kv.get_block_ids("b")[3] != kv.get_block_ids("a")[3]
    assert [kv.block_pool.blocks[i].ref_cnt for i in kv.get_block_ids("a")] == [2, 2, 2, 1]
    one_past = _req("c", prompt + [7], kv)  # one token past the boundary: all 4 blocks hit
    assert _admit(kv, one_past) == 16


def test_salt_isolates_and_freed_blocks_stay_cached_until_evicted_lru():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = _req("a", list(range(9)), kv, salt="t1")  # 3 blocks, 2 full and cached
    _admit(kv, a)
    assert _admit(kv, _req("b", list(range(9)), kv, salt="t2")) == 0
    kv.free(a)
    assert kv.num_cached_blocks == 4  # a's two full blocks and b's two
    # b still holds its 3 blocks; a's 3 are free, its chain tail queued before its head
    free = kv.block_pool.free_block_queue.block_ids()
    a_blocks = [0, 1, 2]
    assert [i for i in free if i in a_blocks] == [2, 1, 0]
    assert _admit(kv, _req("c", list(range(9)), kv, salt="t1")) == 8  # revived from the queue
    kv.reset_prefix_cache()
    assert kv.num_cached_blocks == 4  # held blocks keep their hashes


def test_eviction_takes_least_recently_used_first():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    old, new = _req("old", [1, 2, 9], kv), _req("new", [3, 4, 9], kv)
    _admit(kv, old)
    kv.free(old)
    _admit(kv, new)
    kv.free(new)
    assert kv.num_cached_blocks == 2
    big = _req("big", [7, 7, 7, 7, 7], kv)  # needs 3 blocks: evicts old's cached block first
    _admit(kv, big)
    kv.free(big)
    assert kv.get_computed_blocks(_req("y", [1, 2, 9], kv))[1] == 0  # old's block was evicted
    assert _admit(kv, _req("x", [3, 4, 9], kv)) == 2  # new's block survived


def test_caching_disabled_never_hits():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    _admit(kv, _req("a", list(range(12)), kv))
    assert _admit(kv, _req("b", list(range(12)), kv)) == 0 and kv.num_cached_blocks == 0


async def _run_all(engine: AsyncEngine, prompts: list[list[int]], max_tokens: int,
                   stop: list[str] | None = None) -> list[list[int]]:
    async def one(ids: list[int]) -> list[int]:
        out: list[int] = []
        params = SamplingParams(temperature=0, max_tokens=max_tokens, stop=stop or [])
        async for d in engine.generate(uuid.uuid4().hex, ids, params):
            out.extend(d.token_ids)
        return out

    return list(await asyncio.gather(*(one(p) for p in prompts)))


def _shared_prefix_workload(seed: int = 0) -> list[list[int]]:
    """~200 prompts over a few shared prefixes: ending on a block boundary, one past it, one
    short of it, prompts that are prefixes of others, and exact duplicates."""
    rng = random.Random(seed)
    bases = [[rng.randrange(100, 40000) for _ in range(80)] for _ in range(4)]
    prompts = []
    for base in bases:
        for cut in (16, 17, 15, 32, 33, 48, 64, 80):
            prompts.append(base[:cut])
            prompts.append(base[:cut] + [rng.randrange(100, 40000) for _ in range(rng.randrange(1, 20))])
    prompts += [list(p) for p in prompts[:40]]  # duplicates, to hit fully cached prompts
    rng.shuffle(prompts)
    return prompts * 2


async def test_caching_is_transparent_for_hundreds_of_requests(tiny_model_dir):
    prompts = _shared_prefix_workload()
    assert len(prompts) >= 200
    outputs = {}
    for caching in (False, True):
        cfg = engine_config(tiny_model_dir, num_blocks=400)
        cfg.cache.enable_prefix_caching = caching
        engine = await AsyncEngine.start(cfg)
        try:
            # a warm-up that ends on a stop string leaves cached blocks behind
            warm = await _run_all(engine, prompts[:1], 30)
            stop_text = engine.tokenizer.decode(warm[0][5:7])
            await _run_all(engine, prompts[:1], 30, stop=[stop_text])
            outputs[caching] = await _run_all(engine, prompts, 6)
            s = await engine.get_stats()
        finally:
            await engine.shutdown()
        assert s.kv_cache.num_free_blocks == s.kv_cache.num_blocks
        if caching:
            assert s.kv_cache.prefix_cache_hits > 0.5 * s.kv_cache.prefix_cache_queries
        else:
            assert s.kv_cache.prefix_cache_hits == 0
    for off, on in zip(outputs[False], outputs[True]):
        assert off == on
