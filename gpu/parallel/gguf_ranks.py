"""A tensor/pipeline-parallel rank's GGUF layers: its share of the file's blocks copied out
(``gguf_shard.rank_blocks``), swapped into a model whose float weights it read from the
de-quantized Hugging Face folder (``loader.convert_gguf``; ``parallel/weights.py``).

One process reads the file in place instead (``gpu/gguf_load.py``); a rank copies only its
share of each tensor, with q/k rows un-interleaved and fused parts stacked, and may cache the
whole set of blocks as safetensors beside the converted folder (``load_blocks``).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import structlog
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import PretrainedConfig

from pagedserve.gpu.cpu import linear_bands
from pagedserve.gpu.gguf_file import interleaved_heads, layer_tensors, open_gguf
from pagedserve.gpu.gguf_linear import GGUFLinear, quantized_part, unpermute
from pagedserve.gpu.parallel.gguf_shard import (
    CopiedBytes,
    cached_rank_blocks,
    check_gguf_split,
    gguf_part,
    rank_blocks,
    stacked_parts,
)
from pagedserve.gpu.parallel.layout import RankLayout
from pagedserve.kernels import gguf_ops

log = structlog.get_logger(__name__)

# Where load_blocks caches a file's blocks; the version changes with what read_blocks returns.
BLOCKS_CACHE = "gguf_blocks-v1.safetensors"


def read_blocks(gguf_file: Path, config: PretrainedConfig, layout: RankLayout | None = None,
                copied: CopiedBytes | None = None) -> tuple[dict, list[str]]:
    """The file's quantized linears by our module name: ``{name: (GGML type, [out, row_bytes]
    uint8 rows in transformers' order, fused parts stacked)}``, and the names left de-quantized
    (a type we have no kernel for, or parts of one fused module with different types).
    ``layout``: only that rank's share is copied out of the file (``gguf_shard.rank_blocks``);
    ``copied`` counts the bytes copied."""
    f = open_gguf(gguf_file)
    copied = copied if copied is not None else CopiedBytes()
    groups: dict[str, list] = {}
    names = layer_tensors(f.arch)
    for name, t in f.tensors.items():
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in names \
                and parts[3] == "weight":
            target, pos, count = names[parts[2]]
            groups.setdefault(f"model.layers.{parts[1]}.{target}", [None] * count)[pos] = t
    lm_head = f.tensors.get("output.weight") or f.tensors.get("token_embd.weight")
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
        reads = [gguf_part(t.data, interleaved_heads(t.name, f.arch, config), unpermute, copied)
                 for t in parts]
        if len(reads) == 1 and target != "lm_head":  # one tensor, fused (phi3): its parts
            reads = stacked_parts(reads[0][1], target, config, reads[0][0])
        if layout is None:
            rows = [read(slice(0, n), slice(None)) for n, read in reads]
            blocks[target] = (qtype, torch.cat(rows) if len(rows) > 1 else rows[0])
        elif (local := rank_blocks(target, qtype, reads, config, layout)) is not None:
            blocks[target] = (qtype, local)
    return blocks, kept


def load_blocks(gguf_file: Path, config: PretrainedConfig, cache_dir: Path | None = None,
                layout: RankLayout | None = None,
                copied: CopiedBytes | None = None) -> tuple[dict, list[str]]:
    """``read_blocks``, cached as safetensors in ``cache_dir`` (the file's converted folder).
    A rank (``layout``) copies only its share, from the cache where it exists (else from the
    GGUF file, and writes no cache: that would read every block); ``copied`` counts the bytes
    copied.

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
                   layout: RankLayout, cache_dir: Path | None = None,
                   plan: linear_bands.LinearPlan | None = None) -> int:
    """Swap the rank's ``nn.Linear``s for one-part ``GGUFLinear``s holding its share of
    ``gguf_file``'s blocks, in place (``load_blocks``). ``plan``: the mode (None: exact).
    Returns how many modules were swapped.

    Raises:
        ValueError: a row-parallel split would cut a block (``check_gguf_split``).
    """
    plan = plan or linear_bands.exact_plan()
    copied = CopiedBytes()
    blocks, kept = load_blocks(gguf_file, config, cache_dir, layout, copied)
    log.info("gguf_blocks_read", bytes=copied.total, rank=layout.rank)
    modules = dict(model.named_modules())
    swapped = 0
    for target, (qtype, qweight) in blocks.items():
        module = modules.get(target)
        if not isinstance(module, nn.Linear) or qweight.shape[0] != module.out_features:
            kept.append(target)
            continue
        part = quantized_part(qweight, qtype, module.in_features, plan.path)
        bias = None if module.bias is None else module.bias.detach()
        parent, _, leaf = target.rpartition(".")
        setattr(modules[parent] if parent else model, leaf,
                GGUFLinear([part], module.in_features, bias, plan))
        swapped += 1
    if kept:
        log.info("gguf_linears_dequantized", modules=len(kept), first=kept[0],
                 reason="a type with no kernel, or mixed within a fused module (ranks)")
    return swapped
