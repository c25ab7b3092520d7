"""Resident memory: the CPU KV pool's pages become resident only when written, a float32 GGUF
model keeps one copy of its linear weights (the blocks), and the KV budget reads vLLM's
``VLLM_CPU_KVCACHE_SPACE``."""

from __future__ import annotations

import pytest
import torch

from pagedserve.gpu import kv_cache, loader
from pagedserve.gpu.attention import get_attention_backend
from pagedserve.gpu.config import DEFAULT_CPU_KV_CACHE_BYTES, CacheConfig
from pagedserve.gpu.cpu import memory

CPU = torch.device("cpu")


def test_lazy_zeros_are_zero_and_resident_only_where_written():
    t = memory.lazy_zeros((64, 16, 4, 64), torch.float32)  # 1 MiB: 64 blocks of 16 KiB
    assert t.data_ptr() % 4096 == 0 and t.is_contiguous()
    assert memory.tensor_resident_bytes(t) == 0
    t[3] = 1.0  # one block written
    assert memory.tensor_resident_bytes(t) == 16 * 1024
    # Zeros elsewhere (reading maps the kernel's shared zero page, which mincore reports).
    assert t[3].eq(1).all() and t.sum() == t[3].numel()


def test_the_cpu_kv_pool_is_lazy_and_sized_from_vllms_variable(tiny_model_dir, monkeypatch):
    config = loader.load_config(tiny_model_dir)
    caches = kv_cache.allocate_kv_caches(config, 32, 16, torch.float32, CPU)
    assert all(memory.tensor_resident_bytes(t) == 0 for kv in caches for t in kv)
    per_block = kv_cache.bytes_per_block(config, 16, torch.float32)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    budget = kv_cache.num_blocks_for(config, CacheConfig(), torch.float32, CPU, 0)
    assert budget == DEFAULT_CPU_KV_CACHE_BYTES // per_block
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.5")
    assert kv_cache.num_blocks_for(config, CacheConfig(), torch.float32, CPU, 0) \
        == 2**29 // per_block
    explicit = CacheConfig(kv_cache_memory_bytes=2**20)  # the flag wins over the variable
    assert kv_cache.num_blocks_for(config, explicit, torch.float32, CPU, 0) == 2**20 // per_block
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "lots")
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE"):
        kv_cache.num_blocks_for(config, CacheConfig(), torch.float32, CPU, 0)


def test_a_gguf_model_keeps_one_copy_of_its_weights():
    """Read in place, the embedded model's weights are the file's tensor bytes (within 1.1x:
    norms, RoPE tables), in either mode and either dtype."""
    from pagedserve.gpu import gguf_load
    from pagedserve.gpu.cpu import linear_bands
    from pagedserve.gpu.layer_ops import get_layer_ops

    resolved = loader.resolve_model(None)
    config = loader.load_config(resolved.path)
    for dtype in (torch.float32, torch.bfloat16):
        backend = get_attention_backend(CPU, dtype)
        for path in ("exact", "int8"):
            plan = linear_bands.LinearPlan(path, ((linear_bands.ALL, path),))
            model, w = gguf_load.load_gguf_model(resolved.gguf_file, config, backend, 64,
                                                 get_layer_ops(backend.name, dtype), CPU,
                                                 dtype, plan)
            assert memory.weights_bytes(model) == w.quantized + w.float
            assert w.quantized + w.float <= 1.1 * w.file_tensor_bytes, (dtype, path)
            assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
            down = model.model.layers[0].mlp.down_proj
            y = down(torch.randn(3, down.in_features, dtype=dtype))
            assert y.shape == (3, down.out_features) and torch.isfinite(y).all()


def test_the_breakdown_adds_up():
    model = torch.nn.Linear(256, 256)
    kv = [(memory.lazy_zeros((8, 16, 2, 64), torch.float32),
           memory.lazy_zeros((8, 16, 2, 64), torch.float32))]
    kv[0][0][0] = 1.0
    b = memory.resident_breakdown(model, kv)
    assert b.weights == (256 * 256 + 256) * 4
    assert b.kv_reserved == 2 * 8 * 16 * 2 * 64 * 4 and 0 < b.kv_resident < b.kv_reserved
    assert b.rss is not None and b.other == b.rss - b.weights - b.kv_resident
    assert b.as_log()["kv_reserved_mib"] == round(b.kv_reserved / 2**20, 1)
