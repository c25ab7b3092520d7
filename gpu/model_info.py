"""``ModelInfo``: what the engine needs to know of the model once a runner has loaded it (the
scheduler's limits, the KV pool's size, what ``/admin/stats`` and ``/v1/models`` report)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.gpu.pooling.pooling_runner import PoolingInfo


@dataclass(slots=True)
class ModelInfo:
    """What the engine needs to know once the model is loaded."""

    served_name: str
    path: str
    max_model_len: int
    num_blocks: int
    block_size: int
    dtype: str
    device: str
    eos_token_ids: list[int]
    load_seconds: float
    vocab_size: int
    attention_backend: str = "torch"
    quantization: str = "none"  # "gguf" when the file's quantized blocks are kept
    source: str = ""  # what was loaded: the .gguf file, else the Hugging Face folder
    kv_cache_bytes: int = 0  # the K and V tensors allocated (a draft model's included)
    kv_cache_dtype: str = ""  # what the K/V blocks are stored in (``--kv-cache-dtype``)
    # Tensor/pipeline parallel: per rank, what it holds and its pid (``RankLayout.describe``).
    parallel_layout: list[dict] | None = None
    cpu_linear_paths: list[dict] | None = None  # GGUF linears: path per batch band
    weights_resident: dict | None = None  # a GGUF's weights: form and bytes (``ModelRunner``)
    runner: str = "generate"  # or "pooling" (``--runner``): prefill-only requests, pooled
    pooling: PoolingInfo | None = None  # the pooling model's settings (``--runner pooling``)
    # Every layer's window (the largest), when blocks before it may be released
    # (``ModelRunner.kv_sliding_window``); None: every block stays.
    kv_sliding_window: int | None = None
