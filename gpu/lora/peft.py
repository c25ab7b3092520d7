"""PEFT LoRA adapters on disk: ``adapter_config.json`` + ``adapter_model.safetensors``.

``check_adapter`` validates a folder against the base model without reading any weights
(the config and the safetensors header): what ``/v1/load_lora_adapter`` and ``--lora-modules``
refuse with a message. ``read_adapter`` loads the weights, ``scaling`` folded into ``B``:
``y = x W^T + scaling * (x A^T) B^T`` with ``scaling = lora_alpha / r`` (Hu et al., "LoRA",
2021) or ``lora_alpha / sqrt(r)`` with ``use_rslora`` (Kalajdzievski, "rsLoRA", 2023), per
module after PEFT's ``rank_pattern``/``alpha_pattern``. Under tensor/pipeline parallelism each
rank keeps its share (``parallel/weights.shard_plan``): a column-parallel projection's ``B``
rows, a row-parallel one's ``A`` columns (their partial deltas are summed by the layer's
all-reduce, as its base output is).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import PretrainedConfig

from pagedserve.gpu.lora.config import TARGET_MODULES

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT's saved names)
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\."
                  r"(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served; ``status``: the HTTP status it maps to."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(slots=True)
class AdapterWeights:
    """One adapter's weights on one rank: ``(layer, peft module) -> (A [r, in], B [out, r])``,
    ``B`` scaled; ``rank``: the largest ``r``."""

    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    rank: int

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


def module_shapes(config: PretrainedConfig) -> dict[str, tuple[int, int]]:
    """``peft module -> (in_features, out_features)`` of the full model's projections."""
    h, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    d = getattr(config, "head_dim", None) or h // heads
    return {"q_proj": (h, heads * d), "k_proj": (h, kv * d), "v_proj": (h, kv * d),
            "o_proj": (heads * d, h), "gate_proj": (h, inter), "up_proj": (h, inter),
            "down_proj": (inter, h)}


def _read_config(folder: Path) -> dict:
    if not folder.is_dir():
        raise LoRAAdapterError(f"LoRA adapter folder {str(folder)!r} does not exist", 404)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise LoRAAdapterError(f"LoRA adapter folder {str(folder)!r} has no {name} "
                                   "(PEFT's save_pretrained writes both)", 404)
    try:
        cfg = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"{folder / CONFIG_FILE}: not readable JSON ({e})") from e
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"{folder}: peft_type {cfg.get('peft_type')!r}; only LORA")
    unsupported = {"use_dora": bool(cfg.get("use_dora")),
                   "modules_to_save": bool(cfg.get("modules_to_save")),
                   "bias": cfg.get("bias", "none") not in (None, "none")}
    for key, bad in unsupported.items():
        if bad:
            raise LoRAAdapterError(f"{folder}: {key}={cfg[key]!r} is not supported "
                                   "(plain LoRA on the projections only)")
    return cfg


def _pattern(patterns: dict, module: str, default):
    """PEFT's ``get_pattern_key``: the value of the pattern that matches ``module``'s name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _header(folder: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(folder / WEIGHTS_FILE, framework="pt") as st:
        return {k: tuple(st.get_slice(k).get_shape()) for k in st.keys()}


def check_adapter(folder: str | Path, config: PretrainedConfig, max_rank: int) -> int:
    """Validate an adapter folder for the base model ``config``; returns its largest rank.

    Raises:
        LoRAAdapterError: missing folder or files (404), a rank over ``max_rank``, a target
            module the model lacks (or only an embedding / lm_head), weights whose shapes do
            not fit the model, unsupported PEFT options (400).
    """
    folder = Path(folder)
    cfg = _read_config(folder)
    targets = cfg.get("target_modules") or []
    if isinstance(targets, list):
        lacking = sorted(set(targets) - set(TARGET_MODULES))
        if lacking:
            raise LoRAAdapterError(
                f"LoRA adapter {str(folder)!r} targets {', '.join(lacking)}, which the model "
                f"lacks or pagedserve cannot adapt; supported: {', '.join(TARGET_MODULES)}")
    shapes = module_shapes(config)
    rank = 0
    for key, shape in _header(folder).items():
        m = _KEY.match(key)
        if m is None or m.group(3) not in TARGET_MODULES:
            raise LoRAAdapterError(f"LoRA adapter {str(folder)!r}: tensor {key!r} adapts a "
                                   f"module pagedserve cannot; supported: "
                                   f"{', '.join(TARGET_MODULES)}")
        layer, module, ab = int(m.group(1)), m.group(3), m.group(4)
        fan_in, fan_out = shapes[module]
        if layer >= config.num_hidden_layers or len(shape) != 2 or (
                shape[1] != fan_in if ab == "A" else shape[0] != fan_out):
            raise LoRAAdapterError(f"LoRA adapter {str(folder)!r}: {key} has shape "
                                   f"{list(shape)}, which does not fit this model "
                                   f"({module}: {fan_in} in, {fan_out} out, "
                                   f"{config.num_hidden_layers} layers)")
        rank = max(rank, shape[0] if ab == "A" else shape[1])
    if rank > max_rank:
        raise LoRAAdapterError(f"LoRA adapter {str(folder)!r} has rank {rank}, more than "
                               f"--max-lora-rank {max_rank}")
    if rank == 0:
        raise LoRAAdapterError(f"LoRA adapter {str(folder)!r} has no LoRA weights")
    return rank


def scaling(cfg: dict, module_name: str, rank: int) -> float:
    """PEFT's ``LoraLayer.scaling`` for the module of that full name and rank."""
    alpha = _pattern(cfg.get("alpha_pattern") or {}, module_name, cfg.get("lora_alpha", 8))
    return alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank


def read_adapter(folder: str | Path, config: PretrainedConfig, dtype: torch.dtype,
                 plan=None) -> AdapterWeights:
    """The adapter's weights (``check_adapter`` first), in ``dtype``, on the CPU.

    ``plan``: this rank's ``parallel.weights.shard_plan`` (``None``: the whole model).
    """
    folder = Path(folder)
    cfg = _read_config(folder)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(folder / WEIGHTS_FILE, framework="pt") as st:
        for key in st.keys():
            m = _KEY.match(key)
            if m is None:
                raise LoRAAdapterError(f"{folder}: unexpected tensor {key!r}")
            layer, part, module, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
            pairs.setdefault((layer, f"{part}.{module}"), {})[ab] = st.get_tensor(key)
    modules, rank = {}, 0
    for (layer, name), ab in pairs.items():
        a, b = ab["A"].float(), ab["B"].float()
        full = f"model.layers.{layer}.{name}"
        b = b * scaling(cfg, full, a.shape[0])  # in float32, then cast: one rounding
        if plan is not None:
            p = plan(full + ".weight", (b.shape[0], a.shape[1]))
            if p is None:  # another pipeline stage's layer
                continue
            dim, start, stop = p[0], p[1], p[2]
            a, b = (a, b[start:stop]) if dim == 0 else (a[:, start:stop], b)
        modules[(layer, name.split(".")[1])] = (a.to(dtype).contiguous(),
                                                b.to(dtype).contiguous())
        rank = max(rank, a.shape[0])
    return AdapterWeights(modules, rank)
