"""Building the model a runner serves: its config and context length, the attention backend
and layer ops, then the weights, read in place from a GGUF file or from a Hugging Face folder
(a rank's share under parallelism), kept quantized or packed where that runs faster.

``ModelRunner.load`` calls ``build_model`` once; the runner then wraps LoRA adapters around
the final linears and adds the pooling head (``gpu/model_runner.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch
from transformers import PretrainedConfig

from pagedserve.gpu import gguf_load, kv_cache, loader
from pagedserve.gpu.attention import AttentionBackend, get_attention_backend
from pagedserve.gpu.config import CacheConfig, ModelConfig
from pagedserve.gpu.cpu import gemm as cpu_gemm
from pagedserve.gpu.cpu import memory
from pagedserve.gpu.dtype_choice import pick_linear_plan, pick_quantization
from pagedserve.gpu.layer_ops import get_layer_ops
from pagedserve.gpu.models import registry
from pagedserve.gpu.models.llama import LlamaForCausalLM
from pagedserve.gpu.models.rope import longrope_factors
from pagedserve.gpu.parallel import gguf_ranks
from pagedserve.gpu.parallel import weights as parallel_weights
from pagedserve.gpu.parallel.comm import ParallelContext
from pagedserve.kernels import cpu_ops

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class BuiltModel:
    """What ``build_model`` made.

    Attributes:
        runner: ``generate``, or ``pooling`` (``--runner``, resolved for the model).
        quantization: ``gguf`` when the file's quantized blocks are kept, else ``None``.
        gguf_weights: the weights read from a GGUF file in place, else ``None``.
        model_bytes: the bytes the weights take (the KV budget's share is what is left).
    """

    hf_config: PretrainedConfig
    max_model_len: int
    runner: str
    attn_backend: AttentionBackend
    model: LlamaForCausalLM
    quantization: str | None
    gguf_weights: gguf_load.GGUFWeights | None
    model_bytes: int


def build_model(resolved: loader.ResolvedModel, mc: ModelConfig, cache_config: CacheConfig,
                parallel: ParallelContext | None, device: torch.device, dtype: torch.dtype,
                kv_dtype: torch.dtype, quantization_flag: str | None) -> BuiltModel:
    """Config, attention backend and layer ops, then the model with its weights (quantized
    or packed where that runs faster).

    Raises:
        loader.ModelLoadError: a context longer than a sliding window we do not apply.
        ValueError: a ``--kv-cache-dtype`` the attention backend cannot read.
    """
    hf_config = loader.load_config(resolved.path)
    max_model_len = mc.max_model_len or registry.derived_max_model_len(hf_config)
    runner = registry.resolve_runner(hf_config, mc.runner, mc.convert)
    window = registry.unhonoured_sliding_window(hf_config)
    if window is not None and max_model_len > window:
        raise loader.ModelLoadError(
            f"--max-model-len {max_model_len} is longer than the model's sliding "
            f"window ({window} tokens), which pagedserve's attention does not apply yet: "
            f"use --max-model-len {window} or less (outputs are exact within it)")
    if (factors := longrope_factors(hf_config, max_model_len)) is not None:
        log.info("longrope_factors", factors=factors, max_model_len=max_model_len)
    attn_backend = get_attention_backend(device, dtype)
    ops = get_layer_ops(attn_backend.name, dtype)
    layout = None if parallel is None else parallel.layout
    quantization = pick_quantization(quantization_flag, resolved, device, dtype)
    plan = pick_linear_plan(mc, dtype) if quantization == "gguf" else None
    gguf_weights = None
    # The file read in place by one process or a pipeline stage (no tensor split).
    if resolved.gguf_file is not None and (layout is None or layout.tp_size == 1):
        model, gguf_weights = gguf_load.load_gguf_model(
            resolved.gguf_file, hf_config, attn_backend, max_model_len, ops,
            device, dtype, plan, parallel)
    else:
        model = _load_folder(resolved, hf_config, attn_backend, max_model_len, ops, device,
                             dtype, parallel, plan)
    if plan is not None:
        log.info("gguf_linear_paths", cpu_linear_mode=plan.mode, tier=plan.tier,
                 isa=cpu_ops.isa_level(), bands=plan.describe(),
                 file=str(resolved.gguf_file))
    model_bytes = memory.weights_bytes(model)
    if cpu_gemm.can_pack(dtype, device):
        cpu_gemm.pack_linears(model)
    return BuiltModel(hf_config, max_model_len, runner, attn_backend, model, quantization,
                      gguf_weights, model_bytes)


def _load_folder(resolved: loader.ResolvedModel, hf_config: PretrainedConfig,
                 attn_backend: AttentionBackend, max_model_len: int, ops, device: torch.device,
                 dtype: torch.dtype, parallel: ParallelContext | None,
                 plan) -> LlamaForCausalLM:
    """A Hugging Face folder's weights (a rank's share under parallelism); a GGUF's
    tensor-parallel rank reads them from transformers' de-quantized copy and its blocks
    from the file (``parallel/gguf_ranks.py``)."""
    layout = None if parallel is None else parallel.layout
    folder = resolved.path if resolved.gguf_file is None else loader.convert_gguf(
        resolved.gguf_file)
    cls = registry.model_class(hf_config)
    model = cls.build(hf_config, attn_backend, max_model_len, ops, device, dtype, parallel)
    shard = None if layout is None else parallel_weights.read_shard(
        folder, parallel_weights.shard_plan(hf_config, layout))
    loader.load_weights(model, folder, shard)
    if plan is not None:
        swapped = gguf_ranks.quantize_model(model, resolved.gguf_file, hf_config,
                                            layout, cache_dir=folder, plan=plan)
        log.info("gguf_quantized_linears", modules=swapped, file=str(resolved.gguf_file))
    return model


def eos_token_ids(path, hf_config: PretrainedConfig) -> list[int]:
    """EOS ids from the generation config (may list several), else the model config."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    return [] if eos is None else list(eos) if isinstance(eos, list | tuple) else [eos]
