"""Each rank reads only its slice of the checkpoint (safetensors' ``get_slice``: the other
ranks' rows are never read from disk), in transformers' names; ``loader.load_weights`` then
fuses and copies them as for one process.

The split of each tensor (Megatron-LM's, as vLLM's ``weight_loader``s do it):

- ``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``, ``up_proj`` (column-parallel): rows of
  the rank's heads / intermediate range, biases likewise;
- ``qkv_proj``, ``gate_up_proj`` stored fused (Phi-3): each part's rows as above, concatenated;
- a mixture of experts' ``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``: as the
  dense MLP's, over ``moe_intermediate_size`` (every expert on every rank, each a slice); the
  router (``mlp.gate``) whole;
- ``o_proj``, ``down_proj`` (row-parallel): columns; a ``down_proj`` bias only on the first
  rank (the all-reduce would add it ``tp`` times);
- ``embed_tokens``, ``lm_head``: the rank's vocabulary rows, zero-padded to ``V/tp``;
- norms: whole; layers of other stages, and the embedding / final norm / ``lm_head`` of
  stages that do not run them: not read.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import PretrainedConfig

from pagedserve.gpu.parallel.layout import RankLayout, _heads

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# Projection → the RankLayout range it is split by (heads are counted in rows of head_size).
_COLUMN = {"q_proj": "q_heads", "k_proj": "kv_heads", "v_proj": "kv_heads",
           "gate_proj": "intermediate", "up_proj": "intermediate"}
_ROW = {"o_proj": "q_heads", "down_proj": "intermediate"}
# Projections a checkpoint stores fused (Phi-3): each part split as its own projection.
_FUSED = {"qkv_proj": ("q_heads", "kv_heads", "kv_heads"),
          "gate_up_proj": ("intermediate", "intermediate")}

# What to read of one checkpoint tensor: ``None`` (not on this rank), or
# ``(dim, start, stop, padded_rows, zero)``: rows/columns ``[start, stop)`` of ``dim``, padded
# with zero rows to ``padded_rows`` (vocabulary), or all zeros (``zero``).
Plan = tuple[int, int, int, int | None, bool] | None


def shard_plan(config: PretrainedConfig,
               layout: RankLayout) -> Callable[[str, tuple], Plan | list[Plan]]:
    """``plan(name, shape)`` for this rank (``Plan`` says what it returns; a list of them for
    a fused checkpoint tensor, its parts' slices concatenated)."""
    _, _, head_size = _heads(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))

    def span(attr: str) -> tuple[int, int]:
        start, stop = getattr(layout, attr)
        unit = head_size if attr.endswith("heads") else 1
        return start * unit, stop * unit

    heads, kv_heads, _ = _heads(config)
    full = {"q_heads": heads * head_size, "kv_heads": kv_heads * head_size,
            "intermediate": config.intermediate_size}

    def part_rows(attr: str) -> int:
        return full[attr]

    def plan(name: str, shape: tuple) -> Plan | list[Plan]:
        m = _LAYER.match(name)
        if m:
            if not layout.layers[0] <= int(m.group(1)) < layout.layers[1]:
                return None
            proj = name.split(".")[-2]
            if ".mlp.experts." in name and proj in ("gate_proj", "up_proj", "down_proj"):
                return (0 if proj != "down_proj" else 1, *layout.moe_intermediate, None, False)
            if proj in _FUSED:  # the parts' rank rows, each from its offset in the tensor
                plans, offset = [], 0
                for attr in _FUSED[proj]:
                    start, stop = span(attr)
                    plans.append((0, offset + start, offset + stop, None, False))
                    offset += part_rows(attr)
                return plans
            if proj in _COLUMN:
                return (0, *span(_COLUMN[proj]), None, False)
            if proj in _ROW:
                if name.endswith(".bias"):  # added once, after the all-reduce
                    return (0, 0, shape[0], None, layout.tp_rank != 0)
                return (1, *span(_ROW[proj]), None, False)
            return (0, 0, shape[0], None, False)  # norms
        vocab = (0, *layout.vocab, layout.vocab_per_rank, False)
        if name == "model.embed_tokens.weight":
            wanted = layout.is_first_stage or (tied and layout.is_last_stage)
            return vocab if wanted else None
        if name == "lm_head.weight":
            return vocab if layout.is_last_stage else None
        if name == "model.norm.weight":
            return (0, 0, shape[0], None, False) if layout.is_last_stage else None
        return (0, 0, shape[0], None, False)

    return plan


def _take(tensor_slice, shape: tuple, plan: tuple) -> torch.Tensor:
    dim, start, stop, padded, zero = plan
    index = tuple(slice(start, stop) if d == dim else slice(None) for d in range(len(shape)))
    part = tensor_slice[index]
    if zero:
        part = torch.zeros_like(part)
    if padded is not None and part.shape[0] < padded:
        pad = torch.zeros((padded - part.shape[0], *part.shape[1:]), dtype=part.dtype)
        part = torch.cat((part, pad))
    return part


def read_shard(path: Path,
               plan: Callable[[str, tuple], Plan | list[Plan]]) -> dict[str, torch.Tensor]:
    """This rank's slices of every tensor of the directory's safetensors files.

    Raises:
        ValueError: the directory has no safetensors (``.bin`` checkpoints are not split).
    """
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"tensor/pipeline parallel loading reads safetensors; {path} has none")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                sl = st.get_slice(name)
                shape = tuple(sl.get_shape())
                p = plan(name, shape)
                if isinstance(p, list):
                    state[name] = torch.cat([_take(sl, shape, part) for part in p])
                elif p is not None:
                    state[name] = _take(sl, shape, p)
    return state

