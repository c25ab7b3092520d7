"""Linear layers that keep a GGUF file's quantized weights (``--quantization gguf``).

A CPU decode step reads every weight once, so its speed is the bytes it reads: SmolLM2-135M's
Q4_1/Q8_0 file is 96 MB per step where the de-quantized bfloat16 weights are 270 MB. Layers
whose GGUF tensors are Q4_0, Q4_1 or Q8_0 keep the file's blocks and multiply through
``kernels.gguf_ops.gguf_linear``; other types (K-quants, F16) stay de-quantized as loaded. The
embedding lookup keeps its de-quantized table (one row per token), while a tied ``lm_head``
multiplies by the quantized ``token_embd`` (a fifth of the model's bytes).

vLLM keeps GGUF weights quantized the same way (``vllm/model_executor/layers/quantization/
gguf.py``); the tensor names and llama.cpp's q/k row permutation are those of transformers'
``integrations/ggml.py`` and llama.cpp's ``convert_hf_to_gguf.py``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import structlog
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import PretrainedConfig

from pagedserve.gpu import linear_bands
from pagedserve.gpu.parallel.gguf_shard import (
    CopiedBytes,
    cached_rank_blocks,
    check_gguf_split,
    gguf_part,
    rank_blocks,
)
from pagedserve.gpu.parallel.layout import RankLayout
from pagedserve.kernels import cpu_ops, gguf_ops

log = structlog.get_logger(__name__)

# GGUF tensor name (after ``blk.{i}.``) -> our module path (after ``model.layers.{i}.``), and
# the fused module each belongs to with its position in the fusion.
_LAYER_TENSORS = {
    "attn_q": ("self_attn.qkv_proj", 0), "attn_k": ("self_attn.qkv_proj", 1),
    "attn_v": ("self_attn.qkv_proj", 2), "attn_output": ("self_attn.o_proj", 0),
    "ffn_gate": ("mlp.gate_up_proj", 0), "ffn_up": ("mlp.gate_up_proj", 1),
    "ffn_down": ("mlp.down_proj", 0),
}
_PARTS = {"self_attn.qkv_proj": 3, "mlp.gate_up_proj": 2}
# Where load_blocks caches a file's blocks; the version changes with what read_blocks returns.
BLOCKS_CACHE = "gguf_blocks-v1.safetensors"
# A bfloat16 model's batches of more rows than this go to the de-quantized copy (oneDNN) in
# the exact mode.
BF16_MAX_KERNEL_ROWS = linear_bands.BF16_MAX_KERNEL_ROWS
# llama.cpp interleaves the rows of q and k for these architectures (its rotary layout).
_PERMUTED_ARCHS = {"llama", "mistral"}


def supported(device: torch.device) -> bool:
    """Quantized linears run on the CPU through our C++ kernels."""
    return device.type == "cpu" and cpu_ops.load() is not None


class GGUFLinear(nn.Module):
    """``y = x @ W.T + b`` reading ``W`` as GGUF blocks, by the path ``plan`` names for the
    call's row count (``linear_bands.py``): ``exact`` through ``gguf_ops.gguf_linear``,
    ``int8`` through ``gguf_ops.gguf_q8_linear`` (on a repacked copy of the blocks), ``dense``
    through the de-quantized layer (oneDNN; several times faster than our float32 kernel above
    4 rows in a bfloat16 model, ``loadtest/RESULTS.md``).

    Args:
        dense: the loaded ``nn.Linear``: its bias is used on every path; its weight is kept
            only where a band runs dense (a float32 model's exact mode never does: one copy of
            the weights, the blocks; 0.43 GB of SmolLM2-135M's float32 linears freed).
        qweight: ``[out, in / 32 * block_bytes]`` uint8, rows in transformers' order.
        qtype: GGML type id (``gguf_ops.GGUF_TYPES``).
        plan: the bands; None = ``linear_bands.exact_plan`` for the weight's dtype (today's).

    Input ``[..., in]`` float32 or bfloat16 → ``[..., out]`` in the same dtype.
    """

    def __init__(self, dense: nn.Linear, qweight: torch.Tensor, qtype: int,
                 plan: linear_bands.LinearPlan | None = None):
        super().__init__()
        self.plan = plan or linear_bands.exact_plan(dense.weight.dtype)
        bands = self.plan.bands
        # The rows up to which the blocks are read (above: dense), as before the plan.
        self.max_rows = next((bands[i - 1][0] for i, (_, p) in enumerate(bands)
                              if p == "dense" and i > 0), sys.maxsize)
        self.dense = dense if self.plan.uses("dense") else None
        self.bias = dense.bias
        self.qweight, self.qtype = qweight.contiguous(), qtype
        self.in_features, self.out_features = dense.in_features, dense.out_features
        self.packed = (gguf_ops.gguf_q8_repack(self.qweight, qtype, self.in_features)
                       if self.plan.uses("int8") else None)
        self._only = bands[0][1] if len(bands) == 1 else None  # one band: no lookup per call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        path = self._only or self.plan.path_for(x.numel() // self.in_features)
        if path == "dense":
            return self.dense(x)
        if path == "int8":
            y = gguf_ops.gguf_q8_linear(x, self.packed, self.qtype, self.out_features)
        else:
            y = gguf_ops.gguf_linear(x, self.qweight, self.qtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"qtype={self.qtype}, bands={self.plan.describe()}"


def linear_paths(model: nn.Module) -> list[dict] | None:
    """The bands the model's GGUF layers run (``/admin/stats``), None when none are kept.
    ``tier``: the kernel tier the bands were chosen for; ``isa``: what runs
    (``cpu_ops.isa_level()``, e.g. ``avx512_vnni``: the int8 path's VNNI loop)."""
    layer = next((m for m in model.modules() if isinstance(m, GGUFLinear)), None)
    if layer is None:
        return None
    return [{"mode": layer.plan.mode, "tier": layer.plan.tier, "isa": cpu_ops.isa_level(),
             **band} for band in layer.plan.describe()]


def _unpermute(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row interleave: GGUF row ``(h, i, j)`` of ``(n_head, D/2, 2)`` is
    transformers' row ``(h, j, i)`` of ``(n_head, 2, D/2)``."""
    n = rows.shape[0]
    return (rows.reshape(n_head, n // n_head // 2, 2, -1).transpose(1, 2)
            .reshape(n, -1).contiguous())


def _read(path: Path):
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    field = reader.fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    return arch, {t.name: t for t in reader.tensors}


def _interleaved_heads(name: str, arch: str, heads: int, kv_heads: int) -> int:
    """The heads whose q/k rows llama.cpp interleaved in tensor ``name`` (0: none)."""
    short = name.split(".")[-2]
    return {"attn_q": heads, "attn_k": kv_heads}.get(short, 0) if arch in _PERMUTED_ARCHS else 0


def read_blocks(gguf_file: Path, config: PretrainedConfig, layout: RankLayout | None = None,
                copied: CopiedBytes | None = None) -> tuple[dict, list[str]]:
    """The file's quantized linears by our module name: ``{name: (GGML type, [out, row_bytes]
    uint8 rows in transformers' order, fused parts stacked)}``, and the names left de-quantized
    (a type we have no kernel for, or parts of one fused module with different types).
    ``layout``: only that rank's share is copied out of the file (``gguf_shard.rank_blocks``);
    ``copied`` counts the bytes copied."""
    arch, tensors = _read(gguf_file)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    copied = copied if copied is not None else CopiedBytes()
    groups: dict[str, list] = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
            target, pos = _LAYER_TENSORS[parts[2]]
            groups.setdefault(f"model.layers.{parts[1]}.{target}", [None] * _PARTS.get(
                target, 1))[pos] = t
    lm_head = tensors.get("output.weight") or tensors.get("token_embd.weight")
    if lm_head is not None:
        groups["lm_head"] = [lm_head]
    blocks, kept = {}, []
    for target, parts in groups.items():
        qtypes = {int(t.tensor_type) for t in parts if t is not None}
        if (None in parts or len(qtypes) != 1
                or qtypes & gguf_ops.GGUF_TYPES.keys() != qtypes):
            kept.append(target)
            continue
        qtype = qtypes.pop()
        reads = [gguf_part(t.data, _interleaved_heads(t.name, arch, heads, kv_heads),
                           _unpermute, copied) for t in parts]
        if layout is None:
            rows = [read(slice(0, n), slice(None)) for n, read in reads]
            blocks[target] = (qtype, torch.cat(rows) if len(rows) > 1 else rows[0])
        elif (local := rank_blocks(target, qtype, reads, config, layout)) is not None:
            blocks[target] = (qtype, local)
    return blocks, kept


def load_blocks(gguf_file: Path, config: PretrainedConfig, cache_dir: Path | None = None,
                layout: RankLayout | None = None,
                copied: CopiedBytes | None = None) -> tuple[dict, list[str]]:
    """``read_blocks``, cached as safetensors in ``cache_dir`` (the file's converted folder):
    parsing the GGUF is a noticeable share of every start, reading the cache a small fraction
    of it (``loadtest/RESULTS.md``). A tensor/pipeline-parallel rank (``layout``) copies only
    its share, from the cache where it exists (else from the GGUF file, and writes no cache:
    that would read every block); ``copied`` counts the bytes copied.

    Raises:
        ValueError: with ``layout``, a split that cuts a block (``check_gguf_split``).
    """
    copied = copied if copied is not None else CopiedBytes()
    if layout is not None:
        check_gguf_split(config, layout.tp_size)
    cached = cache_dir / BLOCKS_CACHE if cache_dir is not None else None
    if cached is not None and cached.exists():
        with safe_open(cached, framework="pt") as f:
            meta = f.metadata()
            qtypes = json.loads(meta["qtypes"])
            if layout is not None:
                return cached_rank_blocks(f, qtypes, config, layout, copied), json.loads(
                    meta["kept"])
            return ({name: (qtype, f.get_tensor(name)) for name, qtype in qtypes.items()},
                    json.loads(meta["kept"]))
    blocks, kept = read_blocks(gguf_file, config, layout, copied)
    if cached is not None and layout is None:
        # Written beside and renamed: a crash or a concurrent start never leaves half a file.
        fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=cached.parent)
        os.close(fd)
        try:
            save_file({name: rows for name, (_, rows) in blocks.items()}, tmp, metadata={
                "qtypes": json.dumps({name: qtype for name, (qtype, _) in blocks.items()}),
                "kept": json.dumps(kept)})
            os.replace(tmp, cached)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return blocks, kept


def quantize_model(model: nn.Module, gguf_file: Path, config: PretrainedConfig,
                   cache_dir: Path | None = None, layout: RankLayout | None = None,
                   plan: linear_bands.LinearPlan | None = None) -> int:
    """Swap ``model``'s linears for ``GGUFLinear``s holding ``gguf_file``'s blocks, in place
    (``load_blocks``; ``cache_dir`` as there). ``layout``: a tensor/pipeline-parallel rank's
    ``RankLayout``, whose share of the blocks it keeps (``parallel/gguf_shard.py``; raises
    ``ValueError`` where a row-parallel split would cut a block). ``plan``: the paths per batch
    band (``linear_bands.plan_for``; None: the exact mode). Returns how many modules were
    swapped."""
    copied = CopiedBytes()
    blocks, kept = load_blocks(gguf_file, config, cache_dir, layout, copied)
    log.info("gguf_blocks_read", bytes=copied.total,
             rank=None if layout is None else layout.rank)
    modules = dict(model.named_modules())
    swapped = 0
    for target, (qtype, qweight) in blocks.items():
        module = modules.get(target)
        if not isinstance(module, nn.Linear) or qweight.shape[0] != module.out_features:
            kept.append(target)
            continue
        parent, _, leaf = target.rpartition(".")
        layer = GGUFLinear(module, qweight, qtype, plan)
        setattr(modules[parent] if parent else model, leaf, layer)
        swapped += 1
    if plan is not None:
        log.info("gguf_linear_paths", cpu_linear_mode=plan.mode, tier=plan.tier,
                 isa=cpu_ops.isa_level(), bands=plan.describe())
    if kept:
        log.info("gguf_linears_dequantized", modules=len(kept), first=kept[0],
                 reason="type not Q4_0/Q4_1/Q8_0 or mixed within a fused module")
    return swapped
