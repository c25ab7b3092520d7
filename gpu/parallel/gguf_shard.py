"""One rank's share of a GGUF file's quantized blocks (``--quantization gguf`` under tensor /
pipeline parallelism), split as ``weights.py`` splits the de-quantized tensors.

A block row ``[row_bytes]`` uint8 holds one output row: ``in / 32`` blocks of 32 input elements
(``gguf_ops.GGUF_BLOCK_BYTES`` bytes each). So:

- column-parallel layers (``qkv_proj``'s q/k/v parts, ``gate_up_proj``'s gate/up parts, the
  vocabulary rows of ``lm_head``) take whole rows, and so whole blocks, always; the KV rows of
  a replicated KV head are copied to every rank that holds it, as in the dense path; the
  vocabulary is zero-padded to ``V/tp`` rows (an all-zero block de-quantizes to zeros);
- row-parallel layers (``o_proj``, ``down_proj``) take a range of each row's blocks, so the
  rank's input range must be a whole number of blocks: ``check_gguf_split`` refuses it at start.

The split itself is Megatron-LM's; vLLM shards GGUF weights the same way in its GGUF
``weight_loader`` (``vllm/model_executor/layers/quantization/gguf.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PretrainedConfig

from pagedserve.gpu.parallel.layout import RankLayout, _heads, check_layout
from pagedserve.kernels.gguf_ops import GGUF_BLOCK_BYTES, GGUF_BLOCK_SIZE, GGUF_BLOCK_WEIGHTS


def gguf_split_problem(config: PretrainedConfig, tp: int) -> str | None:
    """Why ``tp`` ranks would cut a GGUF block of a row-parallel layer (one clause), or
    ``None``: ``o_proj``'s (heads/tp × head_size) or ``down_proj``'s (intermediate/tp)
    per-rank input must be a multiple of the 32-element block."""
    heads, _, head_size = _heads(config)
    for layer, size in (("o_proj", heads // tp * head_size),
                        ("down_proj", config.intermediate_size // tp)):
        if size % GGUF_BLOCK_SIZE:
            return (f"cuts GGUF blocks under --quantization gguf: {layer}'s input per rank "
                    f"is {size} elements, not a multiple of the GGUF block size "
                    f"{GGUF_BLOCK_SIZE} (--quantization none splits it)")
    return None


def check_gguf_split(config: PretrainedConfig, tp: int) -> None:
    """Refuse, in one line naming the sizes that work, a tensor-parallel size whose
    row-parallel input ranges do not fall on GGUF block boundaries.

    Raises:
        ValueError: ``check_layout`` refuses ``tp`` with the GGUF rule.
    """
    check_layout(config, tp, 1, gguf_split_problem)


@dataclass(slots=True)
class CopiedBytes:
    """Bytes of block tensors copied out of a file while loading (what a rank read)."""

    total: int = 0


# Reads rows ``[r0, r1)`` and byte columns ``[c0, c1)`` of one fused part of a block tensor
# (``[part_rows, row_bytes]`` uint8, transformers' row order) as a new tensor: the only place
# bytes leave the file, so a rank copies its share and nothing more.
ReadPart = Callable[[slice, slice], torch.Tensor]


def part_rows(name: str, config: PretrainedConfig) -> list[int]:
    """The rows of each fused part of block tensor ``name`` (``qkv_proj``: q, k, v;
    ``gate_up_proj``: gate, up; any other: one part of unknown rows, ``[-1]``)."""
    heads, kv_heads, hs = _heads(config)
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "qkv_proj":
        return [heads * hs, kv_heads * hs, kv_heads * hs]
    if leaf == "gate_up_proj":
        return [config.intermediate_size] * 2
    return [-1]


def stacked_parts(read: Callable[[slice, slice], torch.Tensor], name: str,
                  config: PretrainedConfig, total_rows: int) -> list[tuple[int, ReadPart]]:
    """``rank_blocks``'s parts of one stacked tensor that ``read(rows, byte_cols)`` slices (a
    tensor already in memory, or a memory-mapped safetensors slice): part ``i`` is rows
    ``[offset_i, offset_i + rows_i)``."""
    sizes = part_rows(name, config)
    if sizes == [-1]:
        sizes = [total_rows]
    parts, offset = [], 0
    for rows in sizes:
        def part(r: slice, c: slice, base=offset) -> torch.Tensor:
            return read(slice(base + r.start, base + r.stop), c)
        parts.append((rows, part))
        offset += rows
    return parts


def rank_blocks(name: str, qtype: int, parts: list[tuple[int, ReadPart]],
                config: PretrainedConfig, layout: RankLayout) -> torch.Tensor | None:
    """This rank's ``[rows, row_bytes]`` share of block tensor ``name`` (``None``: not on this
    rank), read part by part through ``parts`` (``(rows, read)`` of each fused part, in
    order): only the stage's layers (and ``lm_head`` on the last stage), each the rows or
    blocks ``weights.shard_plan`` gives the de-quantized tensor.

    Raises:
        ValueError: a layer with no tensor-parallel split.
    """
    _, _, hs = _heads(config)
    q, kv, inter = layout.q_heads, layout.kv_heads, layout.intermediate
    whole = slice(None)
    if name == "lm_head":
        if not layout.is_last_stage:
            return None
        rows = parts[0][1](slice(*layout.vocab), whole)
        pad = layout.vocab_per_rank - rows.shape[0]
        return torch.cat((rows, rows.new_zeros(pad, rows.shape[1]))) if pad else rows
    if not layout.layers[0] <= int(name.split(".")[2]) < layout.layers[1]:
        return None
    leaf = name.rsplit(".", 1)[1]
    if leaf == "qkv_proj":
        spans = [(q[0] * hs, q[1] * hs), (kv[0] * hs, kv[1] * hs), (kv[0] * hs, kv[1] * hs)]
        return torch.cat([read(slice(*span), whole)
                          for (_, read), span in zip(parts, spans, strict=True)])
    if leaf == "gate_up_proj":
        return torch.cat([read(slice(*inter), whole) for _, read in parts])
    bb = GGUF_BLOCK_BYTES[qtype]
    if leaf == "o_proj":
        start, stop = q[0] * hs, q[1] * hs
    elif leaf == "down_proj":
        start, stop = inter
    else:
        raise ValueError(f"no tensor-parallel split for GGUF layer {name}")
    # Input elements [start, stop) of every row: whole blocks (check_gguf_split checks the
    # 32-element ones; a K-quant's 256-weight blocks are checked here, where its type is known).
    bw = GGUF_BLOCK_WEIGHTS[qtype]
    if start % bw or stop % bw:
        raise ValueError(f"{name}: this rank's inputs [{start}, {stop}) are not whole "
                         f"{bw}-weight blocks of its GGML type {qtype}; use a smaller "
                         f"--tensor-parallel-size")
    rows, read = parts[0]
    return read(slice(0, rows), slice(start // bw * bb, stop // bw * bb))


def gguf_part(data, n_head: int, unpermute: Callable[[torch.Tensor, int], torch.Tensor],
              copied: CopiedBytes) -> tuple[int, ReadPart]:
    """``(rows, read)`` of one GGUF tensor's ``data`` (``[rows, row_bytes]`` uint8, a view of
    the memory-mapped file): ``read`` copies only its slice out of the file and undoes
    llama.cpp's q/k interleave of ``n_head`` heads (0: none), which stays within a head, so
    a slice of whole heads unpermutes on its own (``unpermute(rows, heads)``)."""
    total = data.shape[0]

    def read(r: slice, c: slice) -> torch.Tensor:
        part = torch.from_numpy(np.array(data[r, c], dtype=np.uint8))  # a copy of the slice
        copied.total += part.numel()
        return unpermute(part, n_head * part.shape[0] // total) if n_head else part

    return total, read


def cached_rank_blocks(f, qtypes: dict[str, int], config: PretrainedConfig, layout: RankLayout,
                       copied: CopiedBytes) -> dict:
    """A rank's share of the blocks cached in safetensors file ``f`` (``safe_open``): each
    read a memory-mapped slice (``get_slice``), so the other ranks' bytes are not copied."""
    blocks = {}
    for name, qtype in qtypes.items():
        sl = f.get_slice(name)

        def read(r: slice, c: slice, sl=sl) -> torch.Tensor:
            part = sl[r, c]
            copied.total += part.numel()
            return part
        local = rank_blocks(name, qtype, stacked_parts(read, name, config, sl.get_shape()[0]),
                            config, layout)
        if local is not None:
            blocks[name] = (qtype, local.contiguous())
    return blocks


def shard_blocks(blocks: dict, config: PretrainedConfig, layout: RankLayout) -> dict:
    """``gguf_ranks.read_blocks``'s ``{name: (qtype, [out, row_bytes] uint8)}``, already in
    memory, cut to this rank's share (``rank_blocks``). The loader reads only the share from
    the file instead (``gguf_ranks.load_blocks`` with a layout); this is its reference.

    Raises:
        ValueError: as ``check_gguf_split``.
    """
    check_gguf_split(config, layout.tp_size)
    out = {}
    for name, (qtype, qweight) in blocks.items():
        def read(r: slice, c: slice, w=qweight) -> torch.Tensor:
            return w[r, c].clone()
        local = rank_blocks(name, qtype, stacked_parts(read, name, config, qweight.shape[0]),
                            config, layout)
        if local is not None:
            out[name] = (qtype, local.contiguous())
    return out
