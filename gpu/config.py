"""Engine settings that the device side needs (model, dtype, KV cache)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_CPU_KV_CACHE_BYTES = 2 * 1024**3  # 2 GiB: ~2,900 blocks of SmolLM2-135M in float32


@dataclass(slots=True)
class ModelConfig:
    """What to load and how.

    Attributes:
        model: ``.gguf`` file, local Hugging Face directory, hub id, or ``None`` for the
            embedded SmolLM2-135M-Instruct.
        dtype: ``auto``, ``float32``, ``bfloat16`` or ``float16``.
        max_model_len: context limit in tokens (prompt + output); ``None`` = the model's.
        seed: global seed for requests without their own.
        device: ``cuda`` or ``cpu``; ``None`` picks CUDA when present.
        enforce_eager: on CUDA, run every step eagerly (no CUDA graphs for decode steps).
        quantization: ``gguf`` keeps a GGUF model's Q4_0/Q4_1/Q8_0 weights quantized (CPU);
            ``none`` de-quantizes them at load; ``None`` = ``gguf`` for a GGUF model on a CPU
            whose kernels build, else ``none``.
    """

    model: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    device: str | None = None
    enforce_eager: bool = False
    quantization: str | None = None


@dataclass(slots=True)
class CacheConfig:
    """KV cache sizing. Exactly one budget applies: the override, else the device's budget.

    Attributes:
        block_size: tokens per KV block.
        kv_cache_memory_bytes: KV budget on the CPU (bytes).
        gpu_memory_utilization: share of GPU memory the engine may use on CUDA.
        num_gpu_blocks_override: force this many blocks (tests use it to force preemption).
        enable_prefix_caching: share the KV blocks of common prompt prefixes.
        prefix_caching_hash_algo: ``sha256`` or ``xxhash`` (128-bit) block hashes.
    """

    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
