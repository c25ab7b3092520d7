"""Layers that keep a GGUF file's quantized weights (``--quantization gguf``).

A CPU decode step reads every weight once, so its speed is the bytes it reads: SmolLM2-135M's
Q4_1/Q8_0 file is 96 MB per step where the de-quantized bfloat16 weights are 270 MB. A
``GGUFLinear`` is a list of *parts*, one per GGUF tensor of the module (``qkv_proj`` = q, k, v;
``gate_up_proj`` = gate, up), each multiplied by its own kernel into its slice of the output:
the parts of a ``_M`` file's module may have different types (Q4_K q/k, Q6_K v), and no
concatenation copy of the weights is needed. A part holds ONE form of its weights:

- ``exact``: the file's rows (a view of the memory-mapped file), ``gguf_ops.gguf_linear``;
- ``int8``: the int8 kernel's panels (``gguf_ops.gguf_q8_repack``), ``gguf_ops.gguf_q8_linear``;
- ``float``: a type no kernel multiplies (F16, BF16, or a quantized type not yet in
  ``gguf_ops.GGUF_TYPES``), de-quantized, ``F.linear``.

``GGUFEmbedding`` keeps ``token_embd`` quantized and de-quantizes only the looked-up rows; a
tied ``lm_head`` is a ``GGUFLinear`` over the same tensor (one copy).

vLLM keeps GGUF weights quantized the same way (``vllm/model_executor/layers/quantization/
gguf.py``); the tensor names and llama.cpp's q/k row permutation are those of transformers'
``modeling_gguf_pytorch_utils.py`` and llama.cpp's ``convert_hf_to_gguf.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.gpu.cpu import linear_bands
from pagedserve.kernels import cpu_ops, gguf_ops

PART_PATHS = ("exact", "int8", "float")


def supported(device: torch.device) -> bool:
    """Quantized linears run on the CPU through our C++ kernels."""
    return device.type == "cpu" and cpu_ops.load() is not None


@dataclass(slots=True)
class LinearPart:
    """One GGUF tensor's share of a module's output rows.

    ``weight``: by ``path``, uint8 ``[out, row_bytes]`` file rows (``exact``), uint8 panels
    ``[ceil(out / 16) * 16, packed row_bytes]`` (``int8``) or ``[out, in]`` in the model dtype
    (``float``). ``qtype``: its GGML type id (``float``: the file's, for the log).
    ``interleaved_heads``: > 0 when the rows are in llama.cpp's q/k interleave of that many
    heads (the file's order, kept to avoid a copy): the output is un-interleaved instead.
    """

    path: str
    weight: torch.Tensor
    qtype: int
    out_features: int
    interleaved_heads: int = 0

    def run(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` ``[T, in]`` → ``[T, out_features]`` in the part's row order."""
        if self.path == "exact":
            return gguf_ops.gguf_linear(rows, self.weight, self.qtype)
        if self.path == "int8":
            return gguf_ops.gguf_q8_linear(rows, self.weight, self.qtype, self.out_features)
        return F.linear(rows, self.weight)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes


def quantized_part(rows: torch.Tensor, qtype: int, in_features: int, path: str,
                   interleaved_heads: int = 0) -> LinearPart:
    """A part over GGUF ``rows`` (uint8 ``[out, row_bytes]``, ``gguf_ops.GGUF_TYPES``) for the
    plan's ``path``: ``int8`` repacks them (the panels replace the rows: one copy), unless the
    int8 kernel has no such type, which then runs ``exact``. ``int8`` needs the rows in the
    model's order (``interleaved_heads`` 0: the panels are not un-interleaved on output)."""
    out = rows.shape[0]
    if path == "int8" and not interleaved_heads:
        try:
            packed = gguf_ops.gguf_q8_repack(rows.contiguous(), qtype, in_features)
            return LinearPart("int8", packed, qtype, out)
        except ValueError:
            pass  # no int8 kernel for this type: the exact one reads the rows
    return LinearPart("exact", rows.contiguous(), qtype, out, interleaved_heads)


class GGUFLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` the stacked rows of ``parts``, each read by its path.

    Args:
        parts: in output order; their ``out_features`` sum to the layer's.
        in_features: K, a multiple of the types' block sizes.
        bias: float ``[out]`` in the model dtype, or None.
        plan: the mode the parts were made for (``/admin/stats``); None: exact.

    Input ``[..., in]`` float32 or bfloat16 → ``[..., out]`` in the same dtype. Float32 costs
    what bfloat16 does (both kernels multiply in float32 or int8; only the output is rounded),
    so a model's ``lm_head`` passes float32 for unrounded logits (``float32_out_free``).
    """

    float32_out_free = True

    def __init__(self, parts: list[LinearPart], in_features: int,
                 bias: torch.Tensor | None = None, plan: linear_bands.LinearPlan | None = None):
        super().__init__()
        if not parts:
            raise ValueError("a GGUFLinear needs at least one part")
        self.parts = parts
        for i, p in enumerate(parts):  # buffers: the model's tensors count them (memory.py)
            self.register_buffer(f"part{i}", p.weight, persistent=False)
        self.plan = plan or linear_bands.exact_plan()
        self.in_features = in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.starts = [sum(p.out_features for p in parts[:i]) for i in range(len(parts))]
        # One part in the model's row order: its output is the layer's, no copy.
        self._single = len(parts) == 1 and not parts[0].interleaved_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self._single:
            y = self.parts[0].run(rows)
        else:
            t = rows.shape[0]
            y = torch.empty((t, self.out_features), dtype=x.dtype, device=x.device)
            for part, start in zip(self.parts, self.starts, strict=True):
                out, got = y[:, start:start + part.out_features], part.run(rows)
                if h := part.interleaved_heads:
                    # file row (head, i, j) of (H, D/2, 2) is the model's (head, j, i)
                    out.view(t, h, 2, -1).copy_(got.view(t, h, -1, 2).transpose(2, 3))
                else:
                    out.copy_(got)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        parts = ", ".join(f"{p.path}:{p.qtype}x{p.out_features}" for p in self.parts)
        return f"in={self.in_features}, parts=[{parts}]"


class GGUFEmbedding(nn.Module):
    """Token embeddings kept as GGUF blocks: a lookup gathers the ids' rows and de-quantizes
    only those (``gguf_ops.gguf_dequantize``).

    Args:
        part: ``exact`` (file rows) or ``int8`` (panels, shared with a tied ``lm_head``; read
            back by ``gguf_ops.gguf_q8_dequantize_rows``) over ``[vocab, row_bytes]``.
        embedding_dim: the hidden size.
        dtype: of the output.

    ``forward(ids)``: int64 ``[...]`` → ``[..., embedding_dim]`` in ``dtype``.
    Raises ``IndexError`` for an id outside the vocabulary.
    """

    def __init__(self, part: LinearPart, embedding_dim: int, dtype: torch.dtype):
        super().__init__()
        if part.path not in ("exact", "int8"):
            raise ValueError(f"a GGUFEmbedding reads blocks, not a {part.path} part")
        self.part, self.embedding_dim, self.dtype = part, embedding_dim, dtype
        self.register_buffer("table", part.weight, persistent=False)
        self.num_embeddings = part.out_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id outside the vocabulary of {self.num_embeddings}")
        if self.part.path == "int8":
            values = gguf_ops.gguf_q8_dequantize_rows(self.part.weight, self.part.qtype,
                                                      self.embedding_dim, flat)
        else:
            rows = self.part.weight.index_select(0, flat)
            values = gguf_ops.gguf_dequantize(rows, self.part.qtype, self.embedding_dim)
        return values.to(self.dtype).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.part.path}:{self.part.qtype}"


def linear_paths(model: nn.Module) -> list[dict] | None:
    """The bands the model's GGUF layers run (``/admin/stats``), None when none are kept.
    ``tier``: the kernel tier the bands were chosen for; ``isa``: what runs
    (``cpu_ops.isa_level()``, e.g. ``avx512_vnni``: the int8 path's VNNI loop)."""
    layer = next((m for m in model.modules() if isinstance(m, GGUFLinear)), None)
    if layer is None:
        return None
    return [{"mode": layer.plan.mode, "tier": layer.plan.tier, "isa": cpu_ops.isa_level(),
             **band} for band in layer.plan.describe()]


def weights_kind(model: nn.Module, dtype: torch.dtype) -> str:
    """What the model's weights are held as, in words (the ``memory`` line, ``/admin/stats``):
    the path of its GGUF layers (``linear_paths``), else ``dtype``."""
    name = str(dtype).removeprefix("torch.")
    paths = linear_paths(model)
    if not paths:
        return name
    form = ("int8 panels (the blocks repacked)" if paths[0]["path"] == "int8"
            else "the file's blocks, mapped in place")
    return f"GGUF: {form}; norms and de-quantized fallbacks in {name}"


def gguf_parts(model: nn.Module) -> list[LinearPart]:
    """Every part of the model's GGUF layers, embedding and experts (``expert_parts``:
    ``gguf_moe.GGUFFusedMoE``), each tensor once (a tied ``lm_head`` and the embedding share
    one)."""
    seen: dict[int, LinearPart] = {}
    for m in model.modules():
        for part in (m.parts if isinstance(m, GGUFLinear) else
                     [m.part] if isinstance(m, GGUFEmbedding) else
                     getattr(m, "expert_parts", [])):
            seen.setdefault(id(part.weight), part)
    return list(seen.values())


def unpermute(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row interleave: GGUF row ``(h, i, j)`` of ``(n_head, D/2, 2)`` is
    transformers' row ``(h, j, i)`` of ``(n_head, 2, D/2)``; a copy. ``rows`` ``[n, ...]``."""
    n = rows.shape[0]
    return (rows.reshape(n_head, n // n_head // 2, 2, -1).transpose(1, 2)
            .reshape(rows.shape).contiguous())
