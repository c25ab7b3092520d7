"""Block pool, free queue and KV cache manager: allocation, ref counts, exhaustion, order."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.actors.core.request import Request
from pagedserve.actors.kv.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from pagedserve.actors.kv.kv_cache_manager import KVCacheManager
from pagedserve.gpu.sample.sampling_params import SamplingParams


def test_free_queue_popleft_remove_append():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.block_ids() == [0, 1, 2, 3, 4] and q.num_free_blocks == 5
    assert q.popleft().block_id == 0
    q.remove(blocks[2])  # from the middle
    assert q.block_ids() == [1, 3, 4] and q.num_free_blocks == 3
    q.append(blocks[0])
    q.append(blocks[2])
    assert q.block_ids() == [1, 3, 4, 0, 2]
    with pytest.raises(ValueError):
        q.remove(KVCacheBlock(9))  # never in the queue


def test_free_queue_empty_raises():
    q = FreeKVCacheBlockQueue([KVCacheBlock(0)])
    q.popleft()
    with pytest.raises(IndexError):
        q.popleft()
    assert q.num_free_blocks == 0


def test_pool_allocation_free_refcounts():
    pool = BlockPool(4)
    a = pool.get_new_blocks(3)
    assert [b.block_id for b in a] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in a) and pool.get_num_free_blocks() == 1
    assert pool.get_usage() == pytest.approx(0.75)
    pool.touch([a[0]])  # shared by a second holder
    assert a[0].ref_cnt == 2 and pool.num_shared_blocks == 1
    pool.free_blocks(a)
    assert a[0].ref_cnt == 1 and pool.get_num_free_blocks() == 3
    assert pool.num_shared_blocks == 0
    pool.free_blocks([a[0]])
    assert pool.get_num_free_blocks() == 4
    with pytest.raises(ValueError):
        pool.free_blocks([a[0]])  # freed more often than taken


def test_pool_exhaustion():
    pool = BlockPool(2)
    pool.get_new_blocks(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def _request(rid: str, n_prompt: int) -> Request:
    return Request(rid, list(range(n_prompt)), SamplingParams(), asyncio.Queue())


def test_manager_allocates_by_block_and_frees_tail_first():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    r = _request("a", 9)
    assert [b.block_id for b in kv.allocate_slots(r, 9)] == [0, 1, 2]  # ceil(9/4)
    r.num_computed_tokens = 9
    assert kv.allocate_slots(r, 2) == []  # slot 10 and 11 still fit in block 2
    r.num_computed_tokens = 11
    assert [b.block_id for b in kv.allocate_slots(r, 2)] == [3]
    assert kv.get_block_ids("a") == [0, 1, 2, 3]
    other = _request("b", 9)
    assert kv.allocate_slots(other, 9) is None  # 3 needed, 2 free: nothing taken
    assert kv.block_pool.get_num_free_blocks() == 2
    kv.free(r)
    # Tail first: the chain's last block is evicted before its parents.
    assert kv.block_pool.free_block_queue.block_ids() == [4, 5, 3, 2, 1, 0]
    assert kv.block_pool.get_num_free_blocks() == 6


def test_fork_shares_every_block_and_the_first_write_copies_only_the_partial_one():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = _request("p", 10)  # blocks: [4 tokens][4 tokens][2 tokens, partial]
    kv.allocate_slots(parent, 10)
    parent.num_computed_tokens = 10
    child = _request("c", 10)
    child.num_computed_tokens = 10
    kv.fork(parent, child)
    assert kv.get_block_ids("c") == kv.get_block_ids("p") == [0, 1, 2]
    assert kv.num_shared_blocks == 3 and kv.block_pool.get_num_free_blocks() == 5
    # The child writes token 11 into the shared partial block: it gets a copy of that block.
    assert kv.allocate_slots(child, 1) == []
    assert kv.get_block_ids("c") == [0, 1, 3]
    assert kv.take_blocks_to_copy() == [(2, 3)] and kv.take_blocks_to_copy() == []
    assert kv.num_shared_blocks == 2 and kv.num_copied_blocks_total == 1
    # The parent now holds block 2 alone: it writes in place, nothing is copied.
    assert kv.allocate_slots(parent, 1) == []
    assert kv.get_block_ids("p") == [0, 1, 2] and kv.take_blocks_to_copy() == []
    kv.free(child)
    assert kv.num_shared_blocks == 0 and kv.block_pool.get_num_free_blocks() == 5
    kv.free(parent)
    assert kv.block_pool.get_num_free_blocks() == 8


def test_fork_at_a_block_boundary_copies_nothing_and_a_copy_needs_a_free_block():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    parent = _request("p", 8)  # two full blocks
    kv.allocate_slots(parent, 8)
    parent.num_computed_tokens = 8
    child = _request("c", 8)
    child.num_computed_tokens = 8
    kv.fork(parent, child)
    assert [b.block_id for b in kv.allocate_slots(child, 1)] == [2]  # a fresh block, no copy
    assert kv.take_blocks_to_copy() == []
    child.num_computed_tokens = 9
    grandchild = _request("g", 9)
    grandchild.num_computed_tokens = 9
    kv.fork(child, grandchild)
    # Block 2 is shared and partial, and the pool is empty: no room for the copy, nothing taken.
    assert kv.allocate_slots(grandchild, 1) is None
    assert kv.get_block_ids("g") == [0, 1, 2] and kv.take_blocks_to_copy() == []
