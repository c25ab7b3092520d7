"""Linear layers with oneDNN pre-packed weights, for bfloat16 on x86 CPUs.

``F.linear`` on a bfloat16 CPU tensor reaches oneDNN (AMX or AVX512-BF16 kernels) but hands it
a plain row-major weight, which oneDNN re-lays-out into its blocked format on every call: at
decode batch sizes (1-32 rows) that re-layout costs more than the multiply
(``loadtest/RESULTS.md``). Packing once after loading is
what vLLM's CPU path does (``dispatch_cpu_unquantized_gemm`` in
``vllm/model_executor/layers/utils.py``); here through torch's own ``mkldnn`` ops, the ones
inductor uses when it freezes a bfloat16 model.

Outputs equal ``F.linear``'s at decode batch sizes and most prefill sizes; at a few large row
counts oneDNN tiles the two layouts differently and a few outputs differ by one bfloat16 step.
Float32 keeps ``F.linear``: the greedy-parity tests compare it with transformers, and packing
would change the kernel under them.
"""

from __future__ import annotations

import torch
from torch import nn

# oneDNN picks its blocking for this many rows; any row count works, the hint only tunes.
# 32 measured best across 1-512 rows on SmolLM2's shapes (decode batches and prefill chunks).
PACK_BATCH_HINT = 32


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """True for bfloat16 on a CPU whose oneDNN has native bfloat16 (AVX512-BF16 or AMX)."""
    return (
        device.type == "cpu" and dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` pre-packed for oneDNN.

    Args:
        linear: the loaded layer; its weight ``[out, in]`` bfloat16 is packed (a copy; the
            caller drops the original unless something else, e.g. a tied embedding, keeps it).

    Input ``[..., in]`` bfloat16 → ``[..., out]`` bfloat16.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().contiguous()
        # Plain attributes, not parameters: the packed layout is opaque to state_dict users.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=onednn"


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` bfloat16 in oneDNN's blocked layout (a copy), for
    ``packed_linear``."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(),
                                                   PACK_BATCH_HINT)


def packed_linear(rows: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``rows`` ``[n, in]`` bfloat16 times a ``pack_weight`` ``[out, in]`` → ``[n, out]``."""
    return torch.ops.mkldnn._linear_pointwise(rows.contiguous(), packed, None, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` under ``model`` by a ``PackedLinear``, and pack every
    module that can pack itself (``pack_weights``: a mixture of experts' grouped weights,
    ``fused_moe.FusedMoE``); returns how many linears."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    for m in list(model.modules()):
        if hasattr(m, "pack_weights"):
            m.pack_weights()
    return len(targets)
