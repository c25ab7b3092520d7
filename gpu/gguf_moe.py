"""A mixture of experts kept as a GGUF file's quantized blocks (``--quantization gguf``).

llama.cpp stores one layer's experts as three 3-D tensors, ``ffn_gate_exps`` and
``ffn_up_exps`` (GGUF dims ``(H, I, E)``: numpy ``[E, I, row_bytes]``) and ``ffn_down_exps``
(``(I, H, E)``: ``[E, H, row_bytes]``), expert-major, so expert ``e``'s rows are one
contiguous ``[rows, row_bytes]`` slice: a view of the mapped file, multiplied in place by the
same kernels as every other GGUF linear (``gguf_linear.LinearPart``: ``exact`` reads the
file's rows, ``int8`` the expert's repacked panels). Nothing is de-quantized; the routing,
grouping by expert and scatter-add are ``fused_moe.moe_grouped``'s, shared with the float
experts.

Source: llama.cpp's ``convert_hf_to_gguf.py`` (``Qwen3MoeModel``: experts stacked on a new
leading axis) and ``src/llama-model.cpp`` (``ffn_*_exps`` shapes).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.gpu.fused_moe import moe_grouped
from pagedserve.gpu.gguf_linear import LinearPart
from pagedserve.gpu.layer_ops import LayerOps


class GGUFFusedMoE(nn.Module):
    """One layer's experts, each its three GGUF parts.

    Args:
        gate, up: per expert, a part of ``I`` rows over ``H`` inputs; down: per expert, ``H``
            rows over ``I`` inputs (``gguf_linear.quantized_part``).
        hidden, intermediate: ``H`` and ``I``.

    ``forward(x, topk_weights, topk_ids)`` as ``fused_moe.FusedMoE``'s: ``[T, H]`` float32
    or bfloat16 → ``[T, H]`` in the same dtype.
    """

    def __init__(self, gate: list[LinearPart], up: list[LinearPart], down: list[LinearPart],
                 hidden: int, intermediate: int, ops: LayerOps):
        super().__init__()
        if not (len(gate) == len(up) == len(down)) or not gate:
            raise ValueError("every expert needs its gate, up and down parts")
        self.gate, self.up, self.down = gate, up, down
        self.num_experts, self.hidden, self.intermediate = len(gate), hidden, intermediate
        self.ops = ops
        for i, p in enumerate(self.expert_parts):  # counted as the model's tensors (memory.py)
            self.register_buffer(f"part{i}", p.weight, persistent=False)

    @property
    def expert_parts(self) -> list[LinearPart]:
        return [*self.gate, *self.up, *self.down]

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        n = rows.shape[0]
        gate_up = torch.empty((n, 2 * self.intermediate), dtype=rows.dtype)
        gate_up[:, :self.intermediate] = self.gate[e].run(rows)
        gate_up[:, self.intermediate:] = self.up[e].run(rows)
        return self.down[e].run(self.ops.silu_and_mul(gate_up))  # [n, I] → [n, H]

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        return moe_grouped(x, topk_weights, topk_ids, self.expert)

    def extra_repr(self) -> str:
        kinds = {f"{p.path}:{p.qtype}" for p in self.expert_parts}
        return f"experts={self.num_experts}, hidden={self.hidden}, " \
               f"intermediate={self.intermediate}, parts={sorted(kinds)}"
