"""Random PEFT LoRA adapters for tests, and the transformers + peft oracle (float32)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_dir: Path, out: Path, seed: int, rank: int = 8, alpha: int = 16,
                 targets: list[str] | None = None, use_rslora: bool = False,
                 std: float = 0.05, **extra) -> Path:
    """A rank-``rank`` adapter of the model in ``base_dir`` with random A *and* B (PEFT
    starts B at zero: the delta would be nothing), saved by PEFT's ``save_pretrained``."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets or ALL_MODULES,
                     lora_dropout=0.0, use_rslora=use_rslora, task_type="CAUSAL_LM", **extra)
    model = get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, std)
    model.save_pretrained(out)
    return out


@lru_cache(maxsize=4)
def _peft_model(base_dir: str, adapter_dir: str):
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()


def peft_greedy(base_dir: Path, adapter_dir: Path, prompt_ids: list[int],
                max_new_tokens: int) -> list[int]:
    """The oracle: ``PeftModel`` over the float32 base, greedy ``generate``'s new tokens."""
    model = _peft_model(str(base_dir), str(adapter_dir))
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt_ids]),
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt_ids):].tolist()
