"""Which blocks each request holds, and the prefix cache that lets requests share them
(vLLM V1's ``vllm/v1/core/kv_cache_manager.py``, trimmed).

::

    request tokens: | prefix-cache hit | computed earlier | new this step | (future) |
    blocks held:    | shared, ref_cnt++ | ceil((computed + new) / block_size) blocks in all |

``get_computed_blocks`` finds the longest cached prefix of a request that is about to be
(re)admitted; ``allocate_slots`` takes those blocks plus fresh ones so that the computed and new
tokens fit, and indexes every block that this step fills, so a request admitted later, even in
the same step, can share it (within one forward pass every layer writes all K/V of the batch
before any attention reads them).

Beam search (the PagedAttention paper's showcase, section 4.4): ``fork`` gives a new beam its
parent's whole block table by reference (ref counts up, nothing copied). A block that a step is
about to write while someone else still holds it, the beam's last partial block, is copied
first (copy-on-write): ``allocate_slots`` takes a fresh block for it, drops its reference to the
shared one and queues ``(src, dst)`` for the runner, which copies the K/V before the forward
pass (``take_blocks_to_copy``). Full blocks stay shared for the beams' whole lives.

Sliding windows (``sliding_window``, when every layer of the model has one): blocks a running
request's attention can no longer reach are released as it goes, and prefix-cache hits follow
the window's rule (``actors/kv/sliding_window.py``).
"""

from __future__ import annotations

from pagedserve.actors.core.request import Request
from pagedserve.actors.kv.block_pool import BlockPool, KVCacheBlock
from pagedserve.actors.kv.hashing import HASH_FUNCTIONS, extend_block_hashes
from pagedserve.actors.kv.sliding_window import SlidingWindowBlocks


class KVCacheManager:
    """Args:
    num_blocks: blocks in the pool.
    block_size: tokens per block.
    enable_caching: automatic prefix caching on/off.
    hash_algo: ``sha256`` or ``xxhash`` (128-bit).
    sliding_window: the attention window in tokens when every layer has one (the model's
        ``kv_sliding_window``), so blocks before it are released; ``None``: all kept.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True,
        hash_algo: str = "sha256", sliding_window: int | None = None,
    ):
        if hash_algo not in HASH_FUNCTIONS:
            raise ValueError(f"unknown prefix-caching hash {hash_algo!r}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_fn = HASH_FUNCTIONS[hash_algo]
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Prefix-cache counters, in prompt tokens looked up / found.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Copy-on-write: ``(src, dst)`` block ids queued for the next step, and the count so far.
        self.blocks_to_copy: list[tuple[int, int]] = []
        self.num_copied_blocks_total = 0
        self.window = (SlidingWindowBlocks(sliding_window, block_size, self.block_pool)
                       if sliding_window is not None else None)

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def update_block_hashes(self, request: Request) -> None:
        """Hash the request's newly full blocks (prompt at arrival, then generated tokens)."""
        if self.enable_caching and request.num_tokens // self.block_size > len(request.block_hashes):
            extend_block_hashes(self.hash_fn, request.block_hashes, request.all_token_ids,
                                self.block_size, request.cache_salt,
                                request.lora_int_id)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of ``request``: the blocks and the tokens they hold.

        Capped so the last known token is always computed: its logits give the next token.
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        if self.window is not None:
            window_hits = self.window.longest_hit(request.block_hashes[:max_blocks])
            return window_hits, len(window_hits) * self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None, delay_cache: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``.

        Args:
            new_computed_blocks: prefix-cache hits from ``get_computed_blocks`` (admission only);
                their tokens count as computed, on top of ``request.num_computed_tokens``.
            delay_cache: index no block now (a KV connector is still to fill them: a block is
                shared only once its load succeeded, at the request's next allocation).

        Returns:
            The newly taken blocks (possibly none), or ``None`` when too few blocks are free;
            then nothing is taken.
        """
        hits = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if self.window is not None:  # before counting: what it releases is free for this step
            self.window.release_passed(blocks, request.num_computed_tokens)
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        total = num_computed + num_new_tokens
        needed = self.num_blocks_needed(total) - len(blocks) - len(hits)
        # Blocks this step writes into that another request (a beam's sibling) also holds.
        shared = [i for i in range(num_computed // self.block_size, len(blocks))
                  if blocks[i].ref_cnt > 1]
        # Hits nobody holds sit in the free queue: taking them uses up free blocks too.
        evictable_hits = sum(1 for b in hits if b.ref_cnt == 0 and not b.is_null)
        if (max(needed, 0) + evictable_hits + len(shared)
                > self.block_pool.get_num_free_blocks()):
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        for i in shared:
            self._copy_on_write(blocks, i)
        if hits:
            self.block_pool.touch(hits)
            blocks.extend(hits)
        new = self.block_pool.get_new_blocks(needed) if needed > 0 else []
        blocks.extend(new)
        if self.enable_caching and not delay_cache:
            self._cache_full_blocks(request, blocks, total)
        return new

    def _copy_on_write(self, blocks: list[KVCacheBlock], i: int) -> None:
        """Replace the shared ``blocks[i]`` by a private copy (the K/V copy is queued)."""
        src = blocks[i]
        (dst,) = self.block_pool.get_new_blocks(1)
        self.block_pool.free_blocks([src])  # others still hold it: it stays in use
        blocks[i] = dst
        self.blocks_to_copy.append((src.block_id, dst.block_id))
        self.num_copied_blocks_total += 1

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` (a new beam) ``parent``'s block table, shared: ref counts go up, no
        block is taken or copied until one of them writes into a shared one."""
        if child.request_id in self.req_to_blocks:
            raise ValueError(f"request {child.request_id!r} already holds blocks")
        blocks = self.req_to_blocks.get(parent.request_id, [])
        self.block_pool.touch(blocks)
        self.req_to_blocks[child.request_id] = list(blocks)

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        """The copy-on-write pairs queued since the last call, for the step being built."""
        pairs, self.blocks_to_copy = self.blocks_to_copy, []
        return pairs

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int):
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        for block, block_hash in zip(blocks[:num_full], request.block_hashes[:num_full]):
            if block.block_hash is None and not block.is_null:
                self.block_pool.cache_full_block(block, block_hash)

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def free(self, request: Request) -> None:
        """Release every block of the request, tail first: in the LRU free queue a chain's tail
        is then evicted before its parents, which other prompts are likelier to share."""
        self.free_blocks(self.req_to_blocks.pop(request.request_id, []))

    def detach(self, request_id: str) -> list[KVCacheBlock]:
        """Take the request's blocks out of its name, still in use: a KV transfer holds them past
        the request's end (``actors/kv/transfer.py``) and frees them with ``free_blocks``."""
        return self.req_to_blocks.pop(request_id, [])

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        self.block_pool.free_blocks(list(reversed(blocks)))

    def reset_prefix_cache(self) -> int:
        return self.block_pool.reset_prefix_cache()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def num_resident_blocks(self, request_id: str) -> int:
        """Blocks the request holds (released ones, null placeholders now, not counted)."""
        return sum(not b.is_null for b in self.req_to_blocks.get(request_id, []))

    @property
    def num_shared_blocks(self) -> int:
        """Blocks held by more than one request (shared prefixes, forked beams)."""
        return self.block_pool.num_shared_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that hold a prefix-cache hash (in use or evictable)."""
        return len(self.block_pool.cached_block_hash_to_block)

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()
