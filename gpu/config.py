"""Engine settings that the device side needs (model, dtype, KV cache).

A field whose metadata has ``help`` is also a ``pagedserve serve`` flag (``server/engine_args.py``
builds the flags from these fields: name, default, type, help), so its default lives only here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from pagedserve.gpu.kv_connector.base import KVTransferConfig
from pagedserve.gpu.kv_connector.config import parse_kv_transfer_config
from pagedserve.gpu.lora.config import LoRAConfig
from pagedserve.gpu.pooling.pooling_params import PoolerConfig, parse_pooler_config

# The name the embedded default model is served under (here, not in the loader, so that the
# CLI can show it without importing torch).
EMBEDDED_SERVED_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
# vLLM's documented CPU default (``vllm/envs.py``: "default is 4 GiB"): 32 streams of ~400
# tokens of a 1.7B model in bfloat16 (196 KB a token) fit without queueing; pages become
# resident only as blocks are written.
DEFAULT_CPU_KV_CACHE_BYTES = 4 * 1024**3
# --kv-cache-dtype's values: vLLM's (``vllm/config/cache.py``), and int8 (cheaper to read on a
# CPU, which converts fp8 in software); gpu/kv_cache.cache_dtype maps them to torch dtypes.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
# vLLM's CPU budget, in GiB (``vllm/envs.py``); here too when --kv-cache-memory-bytes is not given.
CPU_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"


def default_cpu_kv_cache_bytes() -> int:
    """``$VLLM_CPU_KVCACHE_SPACE`` GiB (fractions allowed) when set, else 4 GiB.

    Raises:
        ValueError: the variable is not a positive number.
    """
    text = os.environ.get(CPU_KV_CACHE_ENV)
    if not text:
        return DEFAULT_CPU_KV_CACHE_BYTES
    try:
        gib = float(text)
    except ValueError:
        gib = -1.0
    if not gib > 0:
        raise ValueError(f"{CPU_KV_CACHE_ENV}={text!r}: expected a positive number of GiB")
    return int(gib * 1024**3)


@dataclass(slots=True)
class ModelConfig:
    """What to load and how."""

    model: str | None = field(default=None, metadata={
        "help": "same as the positional MODEL: a .gguf file, a Hugging Face folder or hub id",
        "default_text": "the embedded SmolLM2-135M-Instruct",
    })
    dtype: str = field(default="auto", metadata={
        "help": "activations, KV cache and weights not kept quantized (see --quantization); "
                "auto = bfloat16 on CUDA and on CPUs with AMX/AVX512-BF16, else float32",
        "choices": ("auto", "float32", "bfloat16", "float16"),
    })
    quantization: str | None = field(default=None, metadata={
        "help": "gguf: keep a .gguf model's Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K weights "
                "quantized and multiply them in place (CPU only; refused elsewhere and for "
                "non-GGUF models); none: de-quantize to --dtype at load",
        "choices": ("gguf", "none"), "aliases": ("-q",),
        "default_text": "gguf for a .gguf model on the CPU, else none",
    })
    cpu_linear_mode: str = field(default="auto", metadata={
        "help": "GGUF linears on the CPU: exact = float32 products of the de-quantized weights "
                "(greedy output equals transformers'); int8 = activations quantized to 8 bits "
                "per 32 values (256 against K-quants), integer products (faster, output "
                "differs: docs); auto = the faster per batch size as measured for this CPU "
                "tier, exact when --dtype float32 is given",
        "choices": ("exact", "int8", "auto"),
    })
    seed: int = field(default=0, metadata={"help": "global seed for requests without their own"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "context length in tokens (prompt + output); 4k = 4000, 4K = 4096",
        "human_int": True, "default_text": "the model's",
    })
    device: str | None = field(default=None, metadata={
        "help": "device", "choices": ("cpu", "cuda"), "default_text": "CUDA when present",
    })
    enforce_eager: bool = field(default=False, metadata={
        "help": "CUDA: run every step eagerly, no CUDA graphs for decode steps",
    })
    # --enable-lora's limits (``gpu/lora/config.py``; set from its flags): every rank's
    # runner wraps its projections with adapter slots. ``None``: no LoRA.
    lora: LoRAConfig | None = None
    runner: str = field(default="auto", metadata={
        "help": "generate: text generation; pooling: embeddings and scores (/v1/embeddings, "
                "/pooling, /score, /rerank; prefill only); auto = pooling for BertModel / "
                "BertForSequenceClassification checkpoints or with --convert, else generate",
        "choices": ("auto", "generate", "pooling"),
    })
    convert: str = field(default="auto", metadata={
        "help": "embed: serve a decoder (Llama, Qwen...) as an embedding model (final hidden "
                "states, last-token pooling unless --pooler-config says otherwise); implies "
                "--runner pooling",
        "choices": ("auto", "none", "embed"),
    })
    pooler_config: PoolerConfig | None = field(default=None, metadata={
        "help": 'pooling as JSON (vLLM\'s keys), e.g. \'{"pooling_type": "MEAN", "normalize": '
                'true, "dimensions": 256}\' (pooling_type: LAST, MEAN or CLS)',
        "parse": parse_pooler_config, "default_text": "the model's",
    })


@dataclass(slots=True)
class CacheConfig:
    """KV cache sizing. Exactly one budget applies: the override, else the device's budget."""

    block_size: int = field(default=16, metadata={
        "help": "tokens per KV block", "choices": (8, 16, 32, 64, 128),
    })
    kv_cache_memory_bytes: int | None = field(default=None, metadata={
        "help": "KV cache budget in bytes, e.g. 4G (on CUDA too, in place of "
                "--gpu-memory-utilization); on the CPU pages become resident as blocks are used",
        "human_int": True,
        "default_text": f"${CPU_KV_CACHE_ENV} GiB, else "
                        f"{DEFAULT_CPU_KV_CACHE_BYTES / 1024**3:g} GiB on the CPU",
    })
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "K/V cache storage: auto = the model's --dtype; fp8 (= fp8_e4m3), fp8_e5m2 or "
                "int8 = 8 bits per value plus a float32 scale per token and head (about 1.9x "
                "the tokens of bfloat16 per byte; greedy output may differ from auto's). int8 "
                "reads fastest on CPUs; the cpu and torch attention backends only",
        "choices": KV_CACHE_DTYPES,
    })
    gpu_memory_utilization: float = field(default=0.9, metadata={
        "help": "share of GPU memory the engine may use (CUDA; on the CPU it does nothing: "
                "--kv-cache-memory-bytes)",
    })
    # Tests also use it to force preemption.
    num_gpu_blocks_override: int | None = field(default=None, metadata={
        "help": "force this many KV blocks",
    })
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "share the KV blocks of common prompt prefixes",
    })
    prefix_caching_hash_algo: str = field(default="sha256", metadata={
        "help": "block hash for prefix caching (xxhash: 128-bit xxh3, faster)",
        "choices": ("sha256", "xxhash"),
    })
    # Here because both the scheduler (its connector half) and every rank's runner read it.
    kv_transfer_config: KVTransferConfig | None = field(default=None, metadata={
        "help": 'KV connector as JSON (vLLM\'s keys), e.g. \'{"kv_connector": '
                '"SharedStorageConnector", "kv_role": "kv_both", "kv_connector_extra_config": '
                '{"shared_storage_path": DIR}, "kv_load_failure_policy": "recompute", '
                '"kv_hold_timeout_s": 120}\' (kv_role: kv_producer, kv_consumer or kv_both)',
        "parse": parse_kv_transfer_config, "default_text": "off",
    })


@dataclass(slots=True)
class DraftModelConfig:
    """The draft model of ``--speculative-config '{"method": "draft_model", ...}'`` (the
    engine builds it from the scheduler's ``SpeculativeConfig``): what to load, and the most
    drafts per step and request."""

    model: str
    num_speculative_tokens: int


@dataclass(slots=True)
class ParallelConfig:
    """How the model is split across worker processes (vLLM's flag names): ``tp × pp`` ranks,
    one process each (``gpu/parallel/``, ``gpu/worker.py``). 1 × 1 runs in the server's
    process, as without these flags."""

    tensor_parallel_size: int = field(default=1, metadata={
        "help": "ranks each layer's heads, MLP and vocabulary are split across (must divide "
                "the attention heads; KV heads are replicated when it exceeds them)",
        "aliases": ("-tp",),
    })
    pipeline_parallel_size: int = field(default=1, metadata={
        "help": "stages the layers are split into, one rank group each",
        "aliases": ("-pp",),
    })
    distributed_executor_backend: str = field(default="mp", metadata={
        "help": "how the ranks are started: mp = spawned processes on this machine, ray = "
                "Ray actors (pip install 'pagedserve[ray]')",
        "choices": ("mp", "ray"),
    })

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size
