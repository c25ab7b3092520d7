"""KV blocks and the pool that hands them out (vLLM V1's ``vllm/v1/core/block_pool.py`` and
``actors/kv/hashing.py``).

The free queue is a hand-written doubly linked list rather than a ``deque``: a block in the
middle must come out in O(1) when a prefix-cache hit revives it, and the list order doubles as
the LRU order of cached-but-unused blocks (evicted from the head).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class BlockEvents(Protocol):
    """What the pool tells whoever records its prefix-cache changes (``KVEventPublisher``,
    ``actors/kv/event_publisher.py``, for the data-parallel router)."""

    def stored(self, block_hash: bytes) -> None: ...

    def removed(self, block_hash: bytes) -> None: ...

    def cleared(self) -> None: ...


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One block of ``block_size`` token slots.

    Attributes:
        block_id: index into the KV cache tensors' first dimension.
        ref_cnt: requests holding the block; 0 means it sits in the free queue.
        block_hash: prefix-cache hash of a full block, else ``None``.
        is_null: the placeholder that stands in a block table for a block released because
            every layer's sliding window has passed it (``BlockPool.null_block``): never in
            the free queue, never counted, never hashed; the kernels never read it.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None
    is_null: bool = False


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks: ``popleft`` / ``append`` / ``remove`` all O(1)."""

    def __init__(self, blocks: list[KVCacheBlock]):
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)  # sentinels keep the edge cases out of the methods
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for b in blocks:
            prev.next_free, b.prev_free = b, prev
            prev = b
        prev.next_free, self._tail.prev_free = self._tail, prev

    def popleft(self) -> KVCacheBlock:
        """Take the least recently freed block. Raises ``IndexError`` when empty."""
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Block ids head to tail (tests and debugging)."""
        ids, b = [], self._head.next_free
        while b is not None and b is not self._tail:
            ids.append(b.block_id)
            b = b.next_free
        return ids


class BlockPool:
    """All KV blocks, with reference counts, the free queue and the prefix-cache index.

    A freed block keeps its hash and stays findable until it is handed out again: the free
    queue's head is the least recently used cached block, evicted first.

    ``kv_events``: when set (someone listens to this engine's KV events, the data-parallel
    router), every hash indexed, evicted or reset is recorded there; ``None`` costs nothing.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        # Blocks held by more than one request (prefix-cache hits in use by several, beams
        # forked from one parent): kept up to date on every ref-count change, O(1) to read.
        self.num_shared_blocks = 0
        self.kv_events: BlockEvents | None = None
        # vLLM reserves block 0 as its null block; ours only aliases block 0's id in the block
        # table (attention with a window never reads there), so it costs no block.
        self.null_block = KVCacheBlock(0, is_null=True)
        self.max_blocks_in_use = 0  # high-water mark of held blocks (admin stats)

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Index a block whose tokens are all known; a hash already indexed keeps its block."""
        if block.block_hash is None and block_hash not in self.cached_block_hash_to_block:
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block
            if self.kv_events is not None:
                self.kv_events.stored(block_hash)

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference to prefix-cache hits; an unused hit leaves the free queue (the null
        block is skipped)."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1
            if block.ref_cnt == 2:
                self.num_shared_blocks += 1
        self.max_blocks_in_use = max(self.max_blocks_in_use,
                                     self.num_blocks - self.get_num_free_blocks())

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self.cached_block_hash_to_block[block.block_hash]
            if self.kv_events is not None:
                self.kv_events.removed(block.block_hash)
            block.block_hash = None

    def reset_prefix_cache(self) -> int:
        """Forget every cached block nobody holds; returns how many were dropped."""
        dropped = [b for b in self.cached_block_hash_to_block.values() if b.ref_cnt == 0]
        for block in dropped:
            self._evict(block)
        if self.kv_events is not None and not self.cached_block_hash_to_block:
            self.kv_events.cleared()  # one event in place of a BlockRemoved per hash
        return len(dropped)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` free blocks (ref count 1 each).

        Raises:
            ValueError: fewer than ``n`` blocks are free (callers check first).
        """
        if n > self.get_num_free_blocks():
            raise ValueError(f"cannot get {n} blocks: {self.get_num_free_blocks()} free")
        out = []
        for _ in range(n):
            block = self.free_block_queue.popleft()
            self._evict(block)  # LRU: the head is the least recently used cached block
            block.ref_cnt = 1
            out.append(block)
        self.max_blocks_in_use = max(self.max_blocks_in_use,
                                     self.num_blocks - self.get_num_free_blocks())
        return out

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks nobody holds go back to the queue, in
        the order given (callers pass a request's blocks tail first). The null block is
        skipped."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 1:
                self.num_shared_blocks -= 1
            elif block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def get_usage(self) -> float:
        """Share of blocks in use, in [0, 1]."""
        return 1.0 - self.get_num_free_blocks() / self.num_blocks
