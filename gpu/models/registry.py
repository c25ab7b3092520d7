"""Which model class serves a checkpoint: the config's ``architectures`` (transformers' class
names, as vLLM's ``ModelRegistry`` keys them), else its ``model_type`` (a GGUF file's
``general.architecture`` becomes the converted config's ``model_type``).

Anything else is refused in one line that names the architecture and the supported list.
Source: vLLM's ``vllm/model_executor/models/registry.py``.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from pagedserve.gpu.models.llama import LlamaForCausalLM
from pagedserve.gpu.models.qwen3 import Qwen3ForCausalLM

# transformers' architecture name -> (our class, the model_type it goes with).
ARCHITECTURES: dict[str, tuple[type[LlamaForCausalLM], str]] = {
    "LlamaForCausalLM": (LlamaForCausalLM, "llama"),
    "MistralForCausalLM": (LlamaForCausalLM, "mistral"),
    "Qwen2ForCausalLM": (LlamaForCausalLM, "qwen2"),
    "Qwen3ForCausalLM": (Qwen3ForCausalLM, "qwen3"),
}
MODEL_TYPES = {model_type: cls for cls, model_type in ARCHITECTURES.values()}


class UnsupportedArchitecture(ValueError):
    """The checkpoint's architecture has no model class here."""


def model_class(config: PretrainedConfig) -> type[LlamaForCausalLM]:
    """The class that serves ``config``.

    Raises:
        UnsupportedArchitecture: neither its ``architectures`` nor its ``model_type`` is
            known; the message names both and the supported architectures.
    """
    for arch in getattr(config, "architectures", None) or ():
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch][0]
    if config.model_type in MODEL_TYPES:
        return MODEL_TYPES[config.model_type]
    archs = ", ".join(getattr(config, "architectures", None) or ()) or "none given"
    raise UnsupportedArchitecture(
        f"architecture {archs} (model type '{config.model_type}') is not supported; "
        f"supported: {', '.join(ARCHITECTURES)}")
