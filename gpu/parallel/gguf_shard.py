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

import torch
from transformers import PretrainedConfig

from pagedserve.gpu.parallel.layout import RankLayout, _heads
from pagedserve.kernels.gguf_ops import GGUF_BLOCK_BYTES, GGUF_BLOCK_SIZE


def check_gguf_split(config: PretrainedConfig, tp: int) -> None:
    """Refuse, in one line, a tensor-parallel size whose row-parallel input ranges do not fall
    on GGUF block boundaries (``check_layout`` first: ``tp`` divides heads and MLP).

    Raises:
        ValueError: ``o_proj``'s (heads/tp × head_size) or ``down_proj``'s (intermediate/tp)
            per-rank input is not a multiple of the 32-element block.
    """
    heads, _, head_size = _heads(config)
    for layer, size in (("o_proj", heads // tp * head_size),
                        ("down_proj", config.intermediate_size // tp)):
        if size % GGUF_BLOCK_SIZE:
            raise ValueError(
                f"--quantization gguf with --tensor-parallel-size {tp}: {layer}'s input per "
                f"rank is {size} elements, not a multiple of the GGUF block size "
                f"{GGUF_BLOCK_SIZE}; use a smaller --tensor-parallel-size or --quantization none")


def _rows(qweight: torch.Tensor, parts: list[tuple[int, int, int]]) -> torch.Tensor:
    """Rows ``[start, stop)`` of each stacked part ``(part_rows, start, stop)``, in order."""
    out, offset = [], 0
    for part_rows, start, stop in parts:
        out.append(qweight[offset + start:offset + stop])
        offset += part_rows
    return torch.cat(out) if len(out) > 1 else out[0].clone()


def _column_blocks(qweight: torch.Tensor, qtype: int, start: int, stop: int) -> torch.Tensor:
    """Input elements ``[start, stop)`` of every row: whole blocks (``check_gguf_split``)."""
    bb = GGUF_BLOCK_BYTES[qtype]
    return qweight[:, start // GGUF_BLOCK_SIZE * bb:stop // GGUF_BLOCK_SIZE * bb].contiguous()


def shard_blocks(blocks: dict, config: PretrainedConfig, layout: RankLayout) -> dict:
    """``gguf_linear.load_blocks``'s ``{name: (qtype, [out, row_bytes] uint8)}`` cut to this
    rank's share: only the stage's layers (and ``lm_head`` on the last stage), each the rows
    or blocks ``weights.shard_plan`` gives the de-quantized tensor.

    Raises:
        ValueError: as ``check_gguf_split``.
    """
    check_gguf_split(config, layout.tp_size)
    heads, kv_heads, hs = _heads(config)
    q, kv = layout.q_heads, layout.kv_heads
    inter = layout.intermediate
    out = {}
    for name, (qtype, qweight) in blocks.items():
        if name == "lm_head":
            if not layout.is_last_stage:
                continue
            rows = qweight[layout.vocab[0]:layout.vocab[1]]
            pad = layout.vocab_per_rank - rows.shape[0]
            out[name] = (qtype, torch.cat((rows, rows.new_zeros(pad, rows.shape[1])))
                         if pad else rows.clone())
            continue
        index = int(name.split(".")[2])
        if not layout.layers[0] <= index < layout.layers[1]:
            continue
        leaf = name.rsplit(".", 1)[1]
        if leaf == "qkv_proj":
            local = _rows(qweight, [(heads * hs, q[0] * hs, q[1] * hs),
                                    (kv_heads * hs, kv[0] * hs, kv[1] * hs),
                                    (kv_heads * hs, kv[0] * hs, kv[1] * hs)])
        elif leaf == "gate_up_proj":
            n = config.intermediate_size
            local = _rows(qweight, [(n, *inter), (n, *inter)])
        elif leaf == "o_proj":
            local = _column_blocks(qweight, qtype, q[0] * hs, q[1] * hs)
        elif leaf == "down_proj":
            local = _column_blocks(qweight, qtype, *inter)
        else:
            raise ValueError(f"no tensor-parallel split for GGUF layer {name}")
        out[name] = (qtype, local)
    return out
