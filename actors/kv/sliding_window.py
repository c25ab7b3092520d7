"""Blocks of a model whose every layer attends over a sliding window (Mistral v0.1, Phi-3):
the blocks a request's attention can no longer reach go back to the pool while it runs, and a
prefix-cache hit needs only the blocks of the last window (vLLM V1's ``SlidingWindowManager``
in ``vllm/v1/core/single_type_kv_cache_manager.py``; read to learn only).

A query at position ``p`` sees keys ``p - W + 1 .. p`` (transformers' rule). Once a request has
``num_computed_tokens`` = ``c`` tokens, every later query sits at ``c`` or after, so tokens
before ``c - W + 1`` are never read again and the whole blocks below them are released: their
place in the request's block list becomes the pool's ``null_block`` (the block table then
carries block 0's id there, which the attention kernels skip). A sequence so holds about
``W / block_size + 1`` blocks whatever its length, plus the step's chunk.

A released block keeps its prefix-cache hash in the free queue (its content is still right
for that exact prefix, since the hash chains the whole prefix) until it is handed out again.
Its parents may be gone by then, so the lookup scans from the right for the last run of
``ceil((W - 1) / block_size)`` cached blocks: the next token only reads those.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.actors.kv.block_pool import BlockPool, KVCacheBlock


class SlidingWindowBlocks:
    """Args:
    sliding_window: ``W`` in tokens, the same (or the largest) for every layer.
    block_size: tokens per block.
    pool: the pool that the released blocks return to and whose ``null_block`` replaces them.
    """

    def __init__(self, sliding_window: int, block_size: int, pool: BlockPool):
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.sliding_window = sliding_window
        self.block_size = block_size
        self.pool = pool
        # Cached blocks a hit must end with: those holding the W - 1 keys before the next token.
        self.hit_run = max(1, -(-(sliding_window - 1) // block_size))
        self.num_released_total = 0

    def release_passed(self, blocks: list[KVCacheBlock], num_computed_tokens: int) -> None:
        """Release the blocks wholly before the window of the request's next query (position
        ``num_computed_tokens``), in place: each becomes the null block. The released ones
        are a prefix of ``blocks``, so the walk back stops at the first null block."""
        first_needed = max(0, num_computed_tokens - self.sliding_window + 1)
        released = []
        for i in range(first_needed // self.block_size - 1, -1, -1):
            if blocks[i].is_null:
                break
            released.append(blocks[i])
            blocks[i] = self.pool.null_block
        if released:  # tail first, as a request's free: its parents stay cached longer
            self.pool.free_blocks(released)
            self.num_released_total += len(released)

    def longest_hit(self, block_hashes: Sequence[bytes]) -> list[KVCacheBlock]:
        """The longest prefix of ``block_hashes`` whose last ``hit_run`` blocks are all cached:
        null blocks up to the run, then the run's blocks; if no run is that long, the cached
        blocks from the start (fewer than ``hit_run``, as a plain lookup finds them)."""
        run: list[KVCacheBlock] = []
        for i in range(len(block_hashes) - 1, -1, -1):
            block = self.pool.get_cached_block(block_hashes[i])
            if block is None:
                run = []
                continue
            run.append(block)
            if len(run) == self.hit_run:
                return [self.pool.null_block] * i + run[::-1]
        return run[::-1]  # reached the start: a run from block 0, shorter than hit_run


def longest_resident_tokens(max_model_len: int, block_size: int, sliding_window: int | None,
                            max_num_batched_tokens: int) -> int:
    """Token slots one sequence may hold at once: ``max_model_len``, or with released blocks
    its window plus one step's tokens (``max_num_batched_tokens``) and the two part-filled
    blocks at its ends, if less. The engine refuses a KV cache smaller than this."""
    if sliding_window is None:
        return max_model_len
    return min(max_model_len, sliding_window + max_num_batched_tokens + 2 * block_size)
