"""Prefix-cache block hashes (vLLM V1's ``vllm/v1/core/kv_cache_utils.py``).

A full block's hash chains from its parent's: ``H(parent_hash, token_ids, extra_keys)``, so
equal hashes mean equal whole prefixes, not just equal blocks. ``H`` is collision-resistant
(sha256, or 128-bit xxh3 when speed matters more than adversarial resistance), never Python's
``hash``, which is 64-bit and seeded per process.

Extra keys are tagged (``("salt", value)``) and serialized with their tag, so different kinds of
extra key can never collide with each other or with token ids.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)
HashFn = Callable[[bytes], bytes]


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxhash128(data: bytes) -> bytes:
    import xxhash

    return xxhash.xxh3_128_digest(data)


HASH_FUNCTIONS: dict[str, HashFn] = {"sha256": _sha256, "xxhash": _xxhash128}

# The parent of a sequence's first block.
ROOT_HASH = BlockHash(b"pagedserve-prefix-cache-root")


def hash_block_tokens(
    hash_fn: HashFn, parent: BlockHash, token_ids: Sequence[int],
    extra_keys: tuple[tuple[str, str], ...] = (),
) -> BlockHash:
    """Hash of one full block.

    Args:
        hash_fn: sha256 or xxh3-128 over bytes.
        parent: the previous block's hash, or ``ROOT_HASH``.
        token_ids: the block's ``block_size`` token ids.
        extra_keys: tagged extras (e.g. ``(("salt", "tenant-a"),)``), first block only.
    """
    extras = json.dumps(extra_keys, separators=(",", ":")).encode() if extra_keys else b""
    body = struct.pack(f"<{len(token_ids)}q", *token_ids)
    # Lengths first: no two (parent, tokens, extras) triples serialize to the same bytes.
    header = struct.pack("<III", len(parent), len(body), len(extras))
    return BlockHash(hash_fn(header + parent + body + extras))


def extend_block_hashes(
    hash_fn: HashFn, block_hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
    cache_salt: str | None = None, lora_int_id: int | None = None,
) -> None:
    """Append the hashes of the full blocks of ``token_ids`` not hashed yet (incremental).

    ``lora_int_id``: the request's adapter; its K/V differ from the base model's and any
    other adapter's, so it keys the first block (and through the chain every block), as vLLM
    adds the LoRA id to the extra keys.
    """
    num_full = len(token_ids) // block_size
    first: tuple[tuple[str, str], ...] = ()
    if cache_salt is not None:
        first += (("salt", cache_salt),)
    if lora_int_id is not None:
        first += (("lora", str(lora_int_id)),)
    for i in range(len(block_hashes), num_full):
        parent = block_hashes[i - 1] if i else ROOT_HASH
        extra = first if i == 0 else ()
        block = token_ids[i * block_size : (i + 1) * block_size]
        block_hashes.append(hash_block_tokens(hash_fn, parent, block, extra))
