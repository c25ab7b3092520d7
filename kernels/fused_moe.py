"""Triton fused mixture of experts for CUDA: one grouped GEMM per projection over the step's
(token, expert) pairs sorted by expert (vLLM's ``fused_moe_kernel`` and
``moe_align_block_size``, ``vllm/model_executor/layers/fused_moe/``, rewritten small).

``moe_align_block_size`` sorts the ``T * k`` pairs by expert id and pads each expert's run to
a multiple of ``BLOCK_M``, so every ``BLOCK_M`` tile of rows belongs to one expert; it is
all torch on the device with static shapes (no host sync: a CUDA graph captures it). The
kernel then multiplies each tile by its expert's weights ``[N, K]``; padded rows (id
``T * k``) are masked. ``fused_moe`` runs gate_up (rows of ``x``), SiLU-and-mul, down
(weighted by the routing probability), and sums each token's ``k`` rows.

Reference: ``gpu.fused_moe.reference_moe`` (tests run this under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, sorted_ids_ptr, expert_ids_ptr, weights_ptr,
    num_pairs, n, k, stride_am, stride_be, stride_bn, stride_cm,
    A_ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:  # a tile past the last expert's padded run
        return
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = pairs < num_pairs
    a_rows = tl.where(row_ok, pairs, 0) // A_ROW_DIV  # x's token, or the pair's own row
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [M, K]
        b = tl.load(b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None],
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)  # [K, N]
        if DOT_FP32:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=PRECISION)
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)
        acc = acc * w[:, None]
    tl.store(c_ptr + pairs[:, None] * stride_cm + offs_n[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int,
                         block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_ids, expert_ids)`` for ``topk_ids`` ``[T, k]``: ``sorted_ids`` int32
    ``[T*k + E*(block_m - 1)]`` rounded up to ``block_m``, the pair indices (``t * k + j``)
    grouped by expert, each expert's run padded with ``T * k`` to a multiple of ``block_m``;
    ``expert_ids`` int32, one per tile of ``block_m`` rows, ``-1`` past the last run."""
    flat = topk_ids.reshape(-1).long()
    pairs = flat.numel()
    size = -(-(pairs + num_experts * (block_m - 1)) // block_m) * block_m
    # not bincount: on CUDA it reads the max id back to the host (no graph could capture it)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    start = torch.cumsum(counts, 0) - counts  # each expert's first sorted pair
    dest = (padded_end - padded)[expert_of] + torch.arange(pairs, device=flat.device) \
        - start[expert_of]
    sorted_ids = torch.full((size,), pairs, dtype=torch.int32, device=flat.device)
    sorted_ids[dest] = order.to(torch.int32)
    tiles = torch.arange(size // block_m, device=flat.device) * block_m
    expert_ids = torch.searchsorted(padded_end, tiles, right=True).to(torch.int32)
    expert_ids = torch.where(tiles < padded_end[-1], expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, sorted_ids, expert_ids,
                  weights, num_pairs: int, a_row_div: int, block_m: int) -> None:
    """``out[pair] = a[pair // a_row_div] @ w[expert(pair)].T`` (times the pair's weight when
    ``weights`` is given) for every real pair."""
    n, k = w.shape[1], w.shape[2]
    dot_fp32 = a.dtype == torch.bfloat16 and a.device.type != "cuda"  # the interpreter's bf16
    precision = "ieee" if a.dtype == torch.float32 or dot_fp32 else "tf32"
    block_n, block_k = 32, 32
    grid = (expert_ids.shape[0], triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a, w, out, sorted_ids, expert_ids, weights if weights is not None else out,
        num_pairs, n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_ROW_DIV=a_row_div, MUL_WEIGHT=weights is not None, PRECISION=precision,
        DOT_FP32=dot_fp32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              block_m: int = 16) -> torch.Tensor:
    """The experts' output for ``x`` ``[T, H]`` (float32, float16 or bfloat16) routed by
    ``topk_weights`` ``[T, k]`` float32 / ``topk_ids`` ``[T, k]``: ``gate_up`` ``[E, 2I, H]``,
    ``down`` ``[E, H, I]`` contiguous in ``x``'s dtype. Returns ``[T, H]`` in ``x``'s dtype
    (the ``k`` rows of a token summed in float32)."""
    t, top_k = topk_ids.shape
    num_experts, two_i, hidden = gate_up.shape
    if t == 0:
        return torch.zeros_like(x)
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    pairs = t * top_k
    sorted_ids, expert_ids = moe_align_block_size(topk_ids, num_experts, block_m)
    h = torch.empty((pairs, two_i), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, gate_up, h, sorted_ids, expert_ids, None, pairs, top_k, block_m)
    gate, up = h.chunk(2, dim=-1)
    act = (F.silu(gate.float()) * up.float()).to(x.dtype).contiguous()  # [pairs, I]
    out = torch.empty((pairs, hidden), dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    _grouped_gemm(act, down, out, sorted_ids, expert_ids, weights, pairs, 1, block_m)
    return out.view(t, top_k, hidden).sum(dim=1).to(x.dtype)
