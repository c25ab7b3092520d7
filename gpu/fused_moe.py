"""A sparse mixture-of-experts block's routing and its experts over one step's tokens.

``select_experts``: router logits → softmax (float32) → the top ``k`` experts of each token,
their probabilities optionally renormalised to sum to one (``norm_topk_prob``; Qwen3-MoE and
llama.cpp's ``qwen3moe`` renormalise, Qwen2-MoE does not).

``moe_grouped``: the CPU path (vLLM's fused-MoE idea, ``vllm/model_executor/layers/fused_moe/``,
in plain torch): the ``T * k`` (token, expert) pairs are sorted by expert id, so each *active*
expert runs one matmul pair over all of its rows at once (never a per-token loop, and no
expert that no token picked is read), then the rows are weighted by their routing
probability and scatter-added back to their tokens. How one expert multiplies its rows is a
callable, so float weights (``FusedMoE``) and GGUF blocks kept quantized
(``gguf_moe.GGUFFusedMoE``) share the routing, grouping and scatter.

On CUDA ``FusedMoE`` runs the Triton grouped GEMM (``kernels/fused_moe.py``) instead, with no
host synchronisation (a CUDA graph captures it).

Source: Shazeer et al., "Outrageously Large Neural Networks: the Sparsely-Gated
Mixture-of-Experts Layer" (2017); Qwen Team, "Qwen3 Technical Report" (2025).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.gpu.layer_ops import LayerOps, TorchLayerOps

# (expert id, its rows [n, H]) -> its output rows [n, H], before the routing weight.
ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]


def select_experts(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits`` ``[T, E]`` → ``(topk_weights [T, k] float32, topk_ids [T, k]
    int64)``: softmax in float32 over the experts, the ``k`` largest, divided by their sum
    when ``renormalize`` (as transformers' ``Qwen3MoeTopKRouter``)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_grouped(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                expert: ExpertFn) -> torch.Tensor:
    """Sum over each token's experts of ``weight * expert(e, x[token])``.

    Args:
        x: ``[T, H]`` hidden states (float32 or bfloat16).
        topk_weights: ``[T, k]`` float32 routing weights; topk_ids: ``[T, k]`` int64 ids.
        expert: multiplies one expert's rows (``ExpertFn``).

    Returns ``[T, H]`` in ``x``'s dtype (accumulated in float32 when ``x`` is narrower).
    """
    t, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # pairs grouped by expert, tokens ascending
    counts = torch.bincount(flat_ids, minlength=1).tolist()
    tokens = order // k  # the token of each sorted pair
    rows = x.index_select(0, tokens)  # [T*k, H]: each expert's rows one contiguous slice
    outs = torch.empty_like(rows)
    start = 0
    for e, n in enumerate(counts):
        if n:  # few ops per expert: on a loaded CPU each op's thread barrier costs
            outs[start:start + n] = expert(e, rows[start:start + n])
            start += n
    weighted = outs.float() * topk_weights.reshape(-1)[order, None]
    acc = torch.zeros((t, x.shape[1]), dtype=torch.float32, device=x.device)
    acc.index_add_(0, tokens, weighted)
    return acc.to(x.dtype)


class FusedMoE(nn.Module):
    """The experts of one layer as grouped float weights, named as transformers' v5
    ``Qwen3MoeExperts`` (the loader stacks a checkpoint's per-expert tensors into them):

    - ``gate_up_proj``: ``[E, 2I, H]`` (each expert's gate rows, then its up rows);
    - ``down_proj``: ``[E, H, I]``.

    Under tensor parallelism ``I`` is this rank's share of ``moe_intermediate_size`` (gate_up
    column-parallel, down row-parallel): the block's output is then a partial sum, which the
    caller all-reduces once.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, ops: LayerOps):
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.ops = ops
        self.packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def pack_weights(self) -> None:
        """bfloat16 on the CPU (``cpu_gemm.pack_linears`` calls it where ``can_pack``): each
        expert's two weights in oneDNN's layout, the grouped originals dropped (one copy).
        ``F.linear`` would re-lay-out an expert's weight at every call: ~30x slower at a
        decode's few rows (measured here, noisy)."""
        from pagedserve.gpu.cpu.gemm import pack_weight

        self.packed = [(pack_weight(self.gate_up_proj[e]), pack_weight(self.down_proj[e]))
                       for e in range(self.num_experts)]
        empty = torch.empty(0, dtype=self.gate_up_proj.dtype)
        self.gate_up_proj = nn.Parameter(empty, requires_grad=False)
        self.down_proj = nn.Parameter(empty, requires_grad=False)

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            from pagedserve.gpu.cpu.gemm import packed_linear

            gate_up, down = self.packed[e]
            return packed_linear(self.ops.silu_and_mul(packed_linear(rows, gate_up)), down)
        h = self.ops.silu_and_mul(F.linear(rows, self.gate_up_proj[e]))  # [n, 2I] → [n, I]
        return F.linear(h, self.down_proj[e])

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H]``, the routing of ``select_experts`` → ``[T, H]``."""
        if x.device.type == "cuda":
            from pagedserve.kernels.fused_moe import fused_moe

            return fused_moe(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)
        return moe_grouped(x, topk_weights, topk_ids, self.expert)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden}, intermediate={self.intermediate}"


def reference_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The plain per-token sum (tests' reference for ``moe_grouped`` and the Triton kernel):
    ``[T, H]`` in float32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for w, e in zip(topk_weights[t].tolist(), topk_ids[t].tolist(), strict=True):
            h = TorchLayerOps.silu_and_mul(x[t:t + 1].float() @ gate_up[e].float().T)
            out[t] += w * (h @ down[e].float().T)[0]
    return out
