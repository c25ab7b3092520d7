"""The runner's adapters: an LRU of loaded adapters and the ``--max-loras`` slots a step uses.

After vLLM's ``LRUCacheWorkerLoRAManager`` (``vllm/lora/worker_manager.py``) and S-LoRA's
split of adapter memory: adapters a step needs are copied into the layers' slots (the device
side; ``--max-loras`` of them), loaded from disk into an LRU of ``--max-cpu-loras`` when not
held. Each ``ScheduledRequest`` carries its ``LoRARequest`` with the folder, so every rank
(tensor/pipeline parallel) loads its share on its own, on first use.
"""

from __future__ import annotations

from collections import OrderedDict

import structlog
import torch
from torch import nn
from transformers import PretrainedConfig

from pagedserve.gpu.batch import ScheduledRequest
from pagedserve.gpu.lora.config import FUSED_PARTS, LoRAConfig
from pagedserve.gpu.lora.layers import LoRALinear, LoRAStep, LoRAStepHolder
from pagedserve.gpu.lora.peft import AdapterWeights, module_shapes, read_adapter
from pagedserve.gpu.lora.request import LoRARequest

log = structlog.get_logger(__name__)
_OWNER = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp",
          "down_proj": "mlp"}


def lora_kernel(device: torch.device, model_dtype: torch.dtype, config: LoRAConfig) -> str:
    """The delta's implementation, picked once (``kernels/lora_ops``): Triton's BGMV on CUDA;
    on the CPU our C++ BGMV when activations and adapters share float32 or bfloat16 (one
    pass per row: at decode sizes a few microseconds where torch's per-adapter matmuls cost
    milliseconds of op overhead); else torch's segmented matmuls (``punica.sgmv_add``)."""
    from pagedserve.kernels import lora_ops

    if device.type == "cuda":
        return "triton"
    if lora_ops.cpu_supported(model_dtype, lora_dtype(config, model_dtype)):
        return "cpu"
    return "torch"


def lora_dtype(config: LoRAConfig, model_dtype: torch.dtype) -> torch.dtype:
    return model_dtype if config.lora_dtype == "auto" else getattr(torch, config.lora_dtype)


class LoRAManager:
    """Wraps the model's projections in ``LoRALinear`` and fills their slots per step.

    Args:
        model: a Llama-family model (``gpu/models/llama.py``), loaded.
        config: the LoRA limits.
        hf_config: the full model's config (adapters are checked and split against it).
        plan: this rank's ``parallel.weights.shard_plan``, ``None`` in one process.
    """

    def __init__(self, model: nn.Module, config: LoRAConfig, hf_config: PretrainedConfig,
                 dtype: torch.dtype, device: torch.device, plan=None, kernel: str = "torch"):
        self.config, self.hf_config, self.plan = config, hf_config, plan
        self.dtype, self.device = lora_dtype(config, dtype), device
        self.holder = LoRAStepHolder(kernel=kernel)
        log.info("lora_enabled", kernel=kernel, max_loras=config.max_loras,
                 max_lora_rank=config.max_lora_rank, max_cpu_loras=config.cpu_capacity,
                 dtype=str(self.dtype).removeprefix("torch."))
        self.layers: dict[tuple[int, str], LoRALinear] = self._wrap(model)
        self.cpu: OrderedDict[int, AdapterWeights] = OrderedDict()  # lora_int_id -> weights
        self.slots: list[int | None] = [None] * config.max_loras  # lora_int_id per slot
        self._slot_lru: list[int] = list(range(config.max_loras))  # least recent first

    def _wrap(self, model: nn.Module) -> dict[tuple[int, str], LoRALinear]:
        outs = {k: v[1] for k, v in module_shapes(model.kv_config).items()}  # rank's share
        m, layers = model.model, {}
        for i in range(m.first_layer, m.end_layer):
            for fused, parts in FUSED_PARTS.items():
                owner = getattr(m.layers[i], _OWNER[fused])
                base = getattr(owner, fused, None)
                if base is None:  # e.g. an MoE block has no gate_up_proj
                    continue
                wrapped = LoRALinear(base, [outs[p] for p in parts], self.config.max_loras,
                                     self.config.max_lora_rank, self.dtype, self.device,
                                     self.holder)
                setattr(owner, fused, wrapped)
                layers[(i, fused)] = wrapped
        return layers

    def _weights(self, lora: LoRARequest) -> AdapterWeights:
        """The adapter's weights from the LRU, else read from its folder (evicting the least
        recently used past ``--max-cpu-loras``)."""
        if lora.lora_int_id in self.cpu:
            self.cpu.move_to_end(lora.lora_int_id)
            return self.cpu[lora.lora_int_id]
        weights = read_adapter(lora.lora_path, self.hf_config, self.dtype, self.plan)
        self.cpu[lora.lora_int_id] = weights
        while len(self.cpu) > self.config.cpu_capacity:
            evicted, _ = self.cpu.popitem(last=False)
            log.info("lora_evicted", lora_int_id=evicted, kept=len(self.cpu))
        log.info("lora_loaded", name=lora.lora_name, lora_int_id=lora.lora_int_id,
                 rank=weights.rank, mib=round(weights.nbytes / 2**20, 2))
        return weights

    def _activate(self, lora: LoRARequest, pinned: set[int]) -> int:
        """The slot holding ``lora``, filling the least recently used slot not ``pinned``."""
        if lora.lora_int_id in self.slots:
            slot = self.slots.index(lora.lora_int_id)
        else:
            slot = next(s for s in self._slot_lru if s not in pinned)
            weights = self._weights(lora)
            for (layer, fused), linear in self.layers.items():
                linear.set_slot(slot, [weights.modules.get((layer, p))
                                       for p in FUSED_PARTS[fused]])
            self.slots[slot] = lora.lora_int_id
        self._slot_lru.remove(slot)
        self._slot_lru.append(slot)
        return slot

    def set_step(self, reqs: list[ScheduledRequest]) -> None:
        """Map this step's token rows (``reqs`` in batch order, as ``prepare_inputs`` lays
        them out) to slots. Raises ``ValueError`` past ``--max-loras`` distinct adapters (the
        scheduler never builds such a step)."""
        distinct = {r.lora_request.lora_int_id for r in reqs if r.lora_request is not None}
        if not distinct:
            self.holder.step = None
            return
        if len(distinct) > self.config.max_loras:
            raise ValueError(f"{len(distinct)} adapters in one step, more than --max-loras "
                             f"{self.config.max_loras}")
        pinned: set[int] = set()
        slots, rows, start = [], {}, 0
        for r in reqs:
            n = r.num_step_tokens
            slot = -1
            if r.lora_request is not None:
                slot = self._activate(r.lora_request, pinned)
                pinned.add(slot)
                rows.setdefault(slot, []).extend(range(start, start + n))
            slots.extend([slot] * n)
            start += n
        self.holder.step = LoRAStep(
            torch.tensor(slots, dtype=torch.int32, device=self.device),
            [(slot, _rows(idx, self.device)) for slot, idx in rows.items()])

    def clear_step(self) -> None:
        self.holder.step = None


def _rows(idx: list[int], device: torch.device):
    """A slice when the rows are contiguous (the common case), else an index tensor."""
    if idx[-1] - idx[0] + 1 == len(idx):
        return slice(idx[0], idx[-1] + 1)
    return torch.tensor(idx, dtype=torch.int64, device=device)
