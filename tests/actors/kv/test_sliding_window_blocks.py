"""The KV cache manager with a sliding window on every layer: a running request's blocks
wholly before its next query's window go back to the pool (null placeholders in its block
list), so it holds about ``W / block_size + 1`` blocks whatever its length; prefix-cache hits
follow the window's rule (the last ``ceil((W - 1) / block_size)`` blocks must be cached);
freed, beams and preemption keep the counts straight."""

from __future__ import annotations

import asyncio

from pagedserve.actors.core.request import Request
from pagedserve.actors.kv.kv_cache_manager import KVCacheManager
from pagedserve.actors.kv.sliding_window import longest_resident_tokens
from pagedserve.gpu.sample.sampling_params import SamplingParams

BS, W = 4, 10  # a 10-token window over 4-token blocks: the next query reads 9 earlier keys


def _req(rid: str, tokens: list[int], kv: KVCacheManager) -> Request:
    r = Request(rid, tokens, SamplingParams(), asyncio.Queue())
    kv.update_block_hashes(r)
    return r


def _decode(kv: KVCacheManager, r: Request, token: int) -> None:
    """One decode step: the last token's K/V is written, then a new token appended."""
    assert kv.allocate_slots(r, 1) is not None
    r.num_computed_tokens += 1
    r.output_token_ids.append(token)
    kv.update_block_hashes(r)


def test_blocks_before_the_window_are_released_as_a_request_runs():
    kv = KVCacheManager(num_blocks=30, block_size=BS, sliding_window=W)
    r = _req("a", list(range(40)), kv)
    assert kv.allocate_slots(r, 40) is not None  # the whole prompt in one chunk
    assert kv.block_pool.get_num_free_blocks() == 30 - 10
    r.num_computed_tokens = 40
    _decode(kv, r, 99)  # next query at 40 reads 31..40: blocks 0..6 (tokens 0..27) go
    ids = kv.get_block_ids("a")
    assert ids[:7] == [0] * 7 and all(kv.req_to_blocks["a"][i].is_null for i in range(7))
    assert len(ids) == 11  # positions kept: the block table still indexes by position
    assert 30 - kv.block_pool.get_num_free_blocks() == 4  # 28..39 and 40's block
    for t in range(30):  # a long decode holds ceil(W / BS) + 1 blocks at most
        _decode(kv, r, t)
        assert 30 - kv.block_pool.get_num_free_blocks() <= -(-W // BS) + 1
    kv.free(r)
    assert kv.block_pool.get_num_free_blocks() == 30


def test_chunked_prefill_releases_between_chunks():
    kv = KVCacheManager(num_blocks=30, block_size=BS, sliding_window=W)
    r = _req("a", list(range(64)), kv)
    held = []
    for _ in range(8):  # chunks of 8
        assert kv.allocate_slots(r, 8) is not None
        r.num_computed_tokens += 8
        held.append(30 - kv.block_pool.get_num_free_blocks())
    # Chunk at c needs keys from c - 9: at most 2 blocks behind it plus its own 2.
    assert max(held) <= 5 and held[-1] < 64 // BS


def test_prefix_hit_needs_only_the_last_window_of_blocks():
    kv = KVCacheManager(num_blocks=40, block_size=BS, sliding_window=W)
    a = _req("a", list(range(40)), kv)
    assert kv.allocate_slots(a, 40) is not None
    a.num_computed_tokens = 40
    _decode(kv, a, 7)  # blocks 0..6 released, still cached (hashes kept in the free queue)
    kv.free(a)
    # Evict the released early blocks: another prompt takes most of the pool.
    filler = _req("f", [1000 + i for i in range(4 * 34)], kv)
    assert kv.allocate_slots(filler, 4 * 34) is not None
    kv.free(filler)
    b = _req("b", list(range(40)) + [5, 6, 7], kv)
    hits, n = kv.get_computed_blocks(b)
    real = [h for h in hits if not h.is_null]
    # A plain lookup stops at the evicted block 0; the window's rule hits all ten blocks,
    # of which the last ceil(9 / 4) = 3 are real (and still hold a's K/V).
    assert n == 40 and len(hits) == 10 and len(real) == 3
    assert [h.block_hash for h in real] == b.block_hashes[7:10]
    free_before = kv.block_pool.get_num_free_blocks()
    assert kv.allocate_slots(b, 3, hits) is not None
    assert free_before - kv.block_pool.get_num_free_blocks() == 3 + 1  # the hits, one new
    assert kv.get_block_ids("b")[:7] == [0] * 7
    kv.free(b)
    assert kv.block_pool.get_num_free_blocks() == 40


def test_a_short_prompt_hits_as_without_a_window():
    kv = KVCacheManager(num_blocks=20, block_size=BS, sliding_window=W)
    a = _req("a", list(range(9)), kv)
    assert kv.allocate_slots(a, 9) is not None
    a.num_computed_tokens = 9
    kv.free(a)
    b = _req("b", list(range(9)) + [3], kv)
    hits, n = kv.get_computed_blocks(b)
    assert n == 8 and not any(h.is_null for h in hits)  # two blocks from the start


def test_forked_beams_and_preemption_keep_counts():
    kv = KVCacheManager(num_blocks=30, block_size=BS, sliding_window=W)
    p = _req("p", list(range(30)), kv)
    assert kv.allocate_slots(p, 30) is not None
    p.num_computed_tokens = 30
    _decode(kv, p, 1)
    c = _req("c", list(range(30)), kv)
    kv.fork(p, c)  # null placeholders are shared too, never counted
    assert kv.get_block_ids("c") == kv.get_block_ids("p")
    kv.free(p)  # preempted: all its real blocks go, the child's stay
    assert 30 - kv.block_pool.get_num_free_blocks() == sum(
        not b.is_null for b in kv.req_to_blocks["c"])
    kv.free(c)
    assert kv.block_pool.get_num_free_blocks() == 30 and kv.block_pool.null_block.ref_cnt == 0


def test_a_window_bounds_what_one_sequence_must_fit():
    assert longest_resident_tokens(4096, 16, None, 2048) == 4096
    assert longest_resident_tokens(32768, 16, 4096, 2048) == 4096 + 2048 + 32
    assert longest_resident_tokens(1024, 16, 4096, 2048) == 1024
