"""KV blocks: the block pool, the cache manager, prefix hashes, KV events and transfers."""
