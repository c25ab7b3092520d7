"""KV cache tensors: size the block pool from a memory budget and allocate per-layer caches.

Bytes per block for a standard transformer: ``2 (K and V) * block_size * num_kv_heads *
head_size * dtype_bytes * num_layers`` (vLLM's ``vllm/v1/kv_cache_interface.py``); with an 8-bit
``--kv-cache-dtype`` each (token, head) row is ``head_size`` bytes plus its 4-byte scale
(``kernels/kv_quant.py``).
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from pagedserve.gpu.config import KV_CACHE_DTYPES, CacheConfig, default_cpu_kv_cache_bytes
from pagedserve.gpu.cpu.memory import lazy_zeros
from pagedserve.kernels import kv_quant

# ``--kv-cache-dtype`` names (vLLM's, and int8) of the 8-bit caches; ``auto`` is the model's.
_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                 "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}


def cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the K/V cache tensors are stored in for ``--kv-cache-dtype name``.

    Raises:
        ValueError: ``name`` is not one of ``config.KV_CACHE_DTYPES``.
    """
    if name == "auto":
        return model_dtype
    if name not in _CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name!r}: choose from {', '.join(KV_CACHE_DTYPES)}")
    return _CACHE_DTYPES[name]


def kv_shape(config: PretrainedConfig) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_size)`` of the model."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_size = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_size


def bytes_per_block(config: PretrainedConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block across all layers, K and V, for caches of ``dtype`` (scales of an
    8-bit cache included)."""
    layers, kv_heads, head_size = kv_shape(config)
    row_bytes = kv_quant.row_elems(head_size, dtype) * dtype.itemsize
    return 2 * block_size * kv_heads * row_bytes * layers


def needs_profiling(cache: CacheConfig) -> bool:
    """Only the CUDA budget (``gpu_memory_utilization``) depends on the activations' peak."""
    return cache.num_gpu_blocks_override is None and cache.kv_cache_memory_bytes is None


def num_blocks_for(
    config: PretrainedConfig, cache: CacheConfig, dtype: torch.dtype, device: torch.device,
    model_bytes: int, activation_bytes: int | None = None, extra_bytes_per_block: int = 0,
) -> int:
    """How many blocks the budget holds, with caches of ``dtype`` (``cache_dtype``), each block
    also costing ``extra_bytes_per_block`` (a draft model's K/V in the same block layout,
    ``gpu/spec_decode/draft_model.py``).

    CPU: ``kv_cache_memory_bytes`` (default ``$VLLM_CPU_KVCACHE_SPACE`` GiB, else 4 GiB, as vLLM).
    CUDA: ``gpu_memory_utilization`` of the
    device's memory, minus what torch holds now (the weights), the peak of the largest step
    (``activation_bytes``, from the runner's profiling pass; a quarter of the weights if not
    profiled) and what others hold (the CUDA context, other processes), as vLLM sizes it.
    """
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    per_block = bytes_per_block(config, cache.block_size, dtype) + extra_bytes_per_block
    if cache.kv_cache_memory_bytes is not None:
        budget = cache.kv_cache_memory_bytes
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        not_torch = max(total - free - torch.cuda.memory_reserved(device), 0)
        if activation_bytes is None:
            activation_bytes = model_bytes // 4
        budget = (int(total * cache.gpu_memory_utilization) - torch.cuda.memory_allocated(device)
                  - activation_bytes - not_torch)
    else:
        budget = default_cpu_kv_cache_bytes()
    return max(budget // per_block, 0)


def allocate_kv_caches(
    config: PretrainedConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, ``(key_cache, value_cache)``, each ``[num_blocks, block_size, Hkv, D]`` in
    ``dtype`` (``D + 4`` for an 8-bit dtype: codes and scale, ``kernels/kv_quant.py``).

    Zero-filled so padded reads in the torch backend never meet NaN garbage. On the CPU the
    zeros are the kernel's (``memory.lazy_zeros``): a block's pages become resident when it is
    first written, not at start.
    """
    layers, kv_heads, head_size = kv_shape(config)
    shape = (num_blocks, block_size, kv_heads, kv_quant.row_elems(head_size, dtype))
    if device.type == "cpu":
        return [(lazy_zeros(shape, dtype), lazy_zeros(shape, dtype)) for _ in range(layers)]
    return [
        (torch.zeros(shape, dtype=dtype, device=device),
         torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(layers)
    ]


def copy_blocks(kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                pairs: list[tuple[int, int]]) -> None:
    """Copy whole blocks ``src → dst`` in every layer's K and V cache, in place.

    Copy-on-write for beam search: a beam about to write into a block its siblings share gets
    a private copy first (``KVCacheManager.allocate_slots``). ``dst`` blocks are fresh, never a
    ``src`` of the same call, so the order of the pairs does not matter.
    """
    if not pairs:
        return
    device = kv_caches[0][0].device
    src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=device)
    dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=device)
    for key_cache, value_cache in kv_caches:
        key_cache[dst] = key_cache[src]
        value_cache[dst] = value_cache[src]
