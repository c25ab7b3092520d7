"""Which model class serves a checkpoint: the config's ``architectures`` (transformers' class
names, as vLLM's ``ModelRegistry`` keys them), else its ``model_type`` (a GGUF file's
``general.architecture`` becomes the converted config's ``model_type``).

Anything else is refused in one line that names the architecture and the supported list.
Source: vLLM's ``vllm/model_executor/models/registry.py``.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from pagedserve.gpu.models.bert import BertForSequenceClassification, BertModel
from pagedserve.gpu.models.gemma2 import Gemma2ForCausalLM
from pagedserve.gpu.models.gemma3 import Gemma3ForCausalLM
from pagedserve.gpu.models.llama import LlamaForCausalLM
from pagedserve.gpu.models.qwen3 import Qwen3ForCausalLM
from pagedserve.gpu.models.sliding_window import config_window
from pagedserve.gpu.models.sliding_window import kv_sliding_window as kv_sliding_window

# transformers' architecture name -> (our class, the model_type it goes with).
ARCHITECTURES: dict[str, tuple[type[LlamaForCausalLM], str]] = {
    "LlamaForCausalLM": (LlamaForCausalLM, "llama"),
    "MistralForCausalLM": (LlamaForCausalLM, "mistral"),
    "Qwen2ForCausalLM": (LlamaForCausalLM, "qwen2"),
    "Qwen3ForCausalLM": (Qwen3ForCausalLM, "qwen3"),
    # Llama's layers with q/k/v and gate/up stored fused, our own layout (loader keeps them).
    "Phi3ForCausalLM": (LlamaForCausalLM, "phi3"),
    "Gemma2ForCausalLM": (Gemma2ForCausalLM, "gemma2"),
    # Gemma 3's text model (1B, 270M; a GGUF of any size: llama.cpp's file holds the text part).
    "Gemma3ForCausalLM": (Gemma3ForCausalLM, "gemma3_text"),
}
# Known architectures refused, with why and what to serve instead.
_REFUSED = {
    "Gemma3ForConditionalGeneration": (
        "Gemma 3 with its vision tower (4B and larger checkpoints) is not supported; serve a "
        "text-only Gemma3ForCausalLM checkpoint (gemma-3-1b, gemma-3-270m) or a GGUF of the "
        "model (llama.cpp's gemma3 file holds only the text part)"),
}
MODEL_TYPES = {model_type: cls for cls, model_type in ARCHITECTURES.values()}
# Encoders, served only by the pooling runner (``--runner pooling``; ``auto`` picks it).
POOLING_ARCHITECTURES: dict[str, type] = {
    "BertModel": BertModel,
    "BertForSequenceClassification": BertForSequenceClassification,
}


class UnsupportedArchitecture(ValueError):
    """The checkpoint's architecture has no model class here."""


def _pooling_architecture(config: PretrainedConfig) -> str | None:
    return next((a for a in getattr(config, "architectures", None) or ()
                 if a in POOLING_ARCHITECTURES), None)


def resolve_runner(config: PretrainedConfig, runner: str, convert: str) -> str:
    """``generate`` or ``pooling`` for ``--runner`` / ``--convert`` (vLLM's rules: ``auto``
    is pooling for an encoder checkpoint or when a conversion is asked for).

    Raises:
        UnsupportedArchitecture: an encoder asked to generate, or ``--convert embed`` with
            ``--runner generate``.
    """
    encoder = _pooling_architecture(config)
    if runner == "auto":
        return "pooling" if encoder or convert == "embed" else "generate"
    if runner == "generate" and encoder:
        raise UnsupportedArchitecture(
            f"{encoder} is a pooling model (an encoder without a language-model head): "
            f"serve it with --runner pooling (or --runner auto)")
    if runner == "generate" and convert == "embed":
        raise UnsupportedArchitecture("--convert embed makes a pooling model: use --runner "
                                      "pooling (or auto) with it")
    return runner


def model_class(config: PretrainedConfig) -> type[LlamaForCausalLM]:
    """The class that serves ``config``.

    Raises:
        UnsupportedArchitecture: neither its ``architectures`` nor its ``model_type`` is
            known (the message names both and the supported architectures), or it needs what
            is not built yet (partial rotary embeddings: Phi-4-mini; Gemma 3's vision model;
            bidirectional attention).
    """
    for arch in getattr(config, "architectures", None) or ():
        if arch in _REFUSED:
            raise UnsupportedArchitecture(f"architecture {arch}: {_REFUSED[arch]}")
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedArchitecture(
            "bidirectional attention (use_bidirectional_attention: an embedding model such as "
            "EmbeddingGemma) is not supported: this server generates text")
    partial = getattr(config, "partial_rotary_factor", 1.0)
    if partial not in (None, 1, 1.0):
        raise UnsupportedArchitecture(
            f"partial rotary embeddings (partial_rotary_factor {partial}) are not supported yet")
    encoder = _pooling_architecture(config)
    if encoder is not None:
        return POOLING_ARCHITECTURES[encoder]  # type: ignore[return-value]
    for arch in getattr(config, "architectures", None) or ():
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch][0]
    if config.model_type in MODEL_TYPES:
        return MODEL_TYPES[config.model_type]
    archs = ", ".join(getattr(config, "architectures", None) or ()) or "none given"
    raise UnsupportedArchitecture(
        f"architecture {archs} (model type '{config.model_type}') is not supported; "
        f"supported: {', '.join([*ARCHITECTURES, *POOLING_ARCHITECTURES])}")


# Config attributes that bound the context, as vLLM reads them (the smallest one present).
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                 "max_sequence_length", "max_seq_length", "seq_len")
# RoPE types whose configs already state the scaled length in max_position_embeddings.
_SCALED_ALREADY = (None, "default", "su", "longrope", "llama3")


def derived_max_model_len(config: PretrainedConfig) -> int:
    """The model's own context limit in tokens: the smallest of ``_CONTEXT_KEYS`` (2048 when
    the config has none), times the RoPE scaling ``factor`` for scalings that extend it
    (``linear``, ``dynamic``, ``yarn``: from its ``original_max_position_embeddings``), as
    vLLM's ``_get_and_verify_max_len`` (``vllm/config/model.py``) derives it. A Qwen2.5
    config with YaRN factor 4 over 32768 positions gives 131072. Capped to a sliding window
    (``unhonoured_sliding_window``) and to longrope's short range (``short_rope_limit``)."""
    lengths = [v for k in _CONTEXT_KEYS if isinstance(v := getattr(config, k, None), int)]
    derived = min(lengths) if lengths else 2048
    rope = (getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None)
            or {})
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type not in _SCALED_ALREADY and isinstance(rope.get("factor"), (int, float)):
        if rope_type == "yarn":
            derived = rope.get("original_max_position_embeddings") or derived
        derived = int(derived * rope["factor"])
    limits = [derived, unhonoured_sliding_window(config), short_rope_limit(config)]
    return min(v for v in limits if v is not None)


def short_rope_limit(config: PretrainedConfig) -> int | None:
    """``longrope`` (Phi-3 128k, Phi-3.5) switches from its short to its long factors past
    ``original_max_position_embeddings`` for the whole sequence, which a KV cache rotated at
    write time cannot follow: the tables use the short factors and the context stops there
    (None for any other RoPE)."""
    rope = (getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None)
            or {})
    if rope.get("rope_type", rope.get("type")) not in ("longrope", "su"):
        return None
    return (rope.get("original_max_position_embeddings")
            or getattr(config, "original_max_position_embeddings", None))


def unhonoured_sliding_window(config: PretrainedConfig) -> int | None:
    """The config's attention window in tokens (``sliding_window.config_window``: Mistral
    v0.1's 4096, Phi-3's 2047; Qwen2/3 only with ``use_sliding_window``) when the model class
    that serves it does not apply it (no ``honours_sliding_window``), else None. Such a
    model's context is capped to the window, as vLLM's ``--disable-sliding-window`` caps
    ``max_model_len``: within the window full and windowed attention are the same. Our
    Llama-family classes apply it per layer (``gpu/models/sliding_window.py``)."""
    window = config_window(config)
    if window is None:
        return None
    try:
        cls = model_class(config)
    except UnsupportedArchitecture:
        return window  # refused later, where the model is built
    return None if getattr(cls, "honours_sliding_window", False) else window
