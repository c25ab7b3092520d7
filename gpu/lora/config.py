"""LoRA settings, named as vLLM's flags (``vllm/config/lora.py``).

A field whose metadata has ``help`` is a ``pagedserve serve`` flag (``server/engine_args.py``).
The adapters to serve at start (``--lora-modules``) are the HTTP layer's
(``server/lora_modules.py``): the engine learns of an adapter from the requests that use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# PEFT's names for the projections an adapter may target, and our fused module holding each
# (its part index): q/k/v are one ``qkv_proj``, gate/up one ``gate_up_proj``.
TARGET_MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
# Our fused module -> its parts in output order.
FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",),
}
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's --max-lora-rank choices


@dataclass(slots=True)
class LoRAConfig:
    """How many adapters a step mixes and the runners hold."""

    enable_lora: bool = field(default=False, metadata={
        "help": "serve LoRA adapters (--lora-modules, or loaded at run time with "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1); a request picks one by `model`",
    })
    max_loras: int = field(default=1, metadata={
        "help": "distinct adapters in one step at most (requests for another wait)",
    })
    max_lora_rank: int = field(default=16, metadata={
        "help": "largest adapter rank accepted", "choices": LORA_RANKS,
    })
    max_cpu_loras: int | None = field(default=None, metadata={
        "help": "adapters kept loaded in memory (least recently used evicted, reloaded "
                "from disk when asked again); at least --max-loras",
        "default_text": "--max-loras",
    })
    lora_dtype: str = field(default="auto", metadata={
        "help": "dtype of the adapter weights: auto = the model's --dtype",
        "choices": ("auto", "float32", "bfloat16", "float16"),
    })

    @property
    def cpu_capacity(self) -> int:
        """``max_cpu_loras``, never below ``max_loras``."""
        return max(self.max_cpu_loras or self.max_loras, self.max_loras)

    def check(self) -> None:
        """Raises ``ValueError`` on limits that cannot work."""
        if self.max_loras < 1:
            raise ValueError(f"--max-loras {self.max_loras}: must be at least 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras {self.max_cpu_loras} must be at least "
                             f"--max-loras {self.max_loras}")
