"""Which blocks each request holds (vLLM V1's ``vllm/v1/core/kv_cache_manager.py``, trimmed).

::

    request tokens:  | computed (cached K/V) | new this step | (future) |
    blocks held:     | ceil((computed + new) / block_size) blocks     |

``allocate_slots`` grows a request's block list so its computed plus new tokens fit.
"""

from __future__ import annotations

from actors.block_pool import BlockPool, KVCacheBlock
from actors.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Prefix-cache counters, in tokens (filled once prefix caching lands).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``.

        Returns:
            The newly taken blocks (possibly none), or ``None`` when too few blocks are free;
            then nothing is taken.
        """
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        needed = self.num_blocks_needed(request.num_computed_tokens + num_new_tokens) - len(blocks)
        if needed <= 0:
            return []
        if needed > self.block_pool.get_num_free_blocks():
            return None
        new = self.block_pool.get_new_blocks(needed)
        blocks.extend(new)
        return new

    def free(self, request: Request) -> None:
        """Release every block of the request, tail first (LRU keeps chain heads longest)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(list(reversed(blocks)))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that hold a prefix-cache hash (in use or evictable)."""
        return sum(1 for b in self.block_pool.blocks if b.block_hash is not None)

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()
