"""Rows of ``gguf_ops.gguf_q8_repack``'s panels back in the file's block layout, gathered by
index: a quantized embedding whose tied ``lm_head`` runs the int8 kernel keeps one copy of the
table (the panels) and de-quantizes only the looked-up rows from it.

The panel layout is ``csrc/gguf_q8_gemm.cpp``'s (see ``repack`` there): per panel of 16 rows
and per block, the rows' code bytes in 4-byte groups (row ``r``'s group ``g`` at
``g * 64 + r * 4``), then the 16 fp16 scales, then (Q4_1) the 16 fp16 minimums. The file's
block is the scale (and minimum) first, then the codes (llama.cpp's ``ggml-common.h``).
"""

from __future__ import annotations

import torch

from pagedserve.kernels.gguf_ops import GGUF_BLOCK_BYTES, Q8_PANEL_ROWS

# GGML type -> (code bytes per block, fp16 fields before the codes) of the types whose panels
# are laid out as above.
_LAYOUT = {2: (16, 1), 3: (16, 2), 8: (32, 1)}


def supported(qtype: int) -> bool:
    """Whether ``unpack_rows`` knows ``qtype``'s panel layout."""
    return qtype in _LAYOUT


def unpack_rows(packed: torch.Tensor, qtype: int, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` of the weights ``packed`` holds, as the file stores them.

    Args:
        packed: ``gguf_q8_repack``'s uint8 ``[padded_rows, row_bytes]``.
        qtype: its GGML type, one of ``supported``'s.
        index: ``[T]`` int64 row ids, each below the unpadded row count.

    Returns:
        uint8 ``[T, row_bytes]``, contiguous (``gguf_ops.gguf_dequantize`` takes it).

    Raises:
        ValueError: a type whose panel layout is not known here, or a ``packed`` not of its
            rows' shape.
    """
    if qtype not in _LAYOUT:
        raise ValueError(f"GGML type {qtype}: no known int8 panel layout to read rows from")
    code_bytes, fields = _LAYOUT[qtype]
    bb = GGUF_BLOCK_BYTES[qtype]
    if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] % bb \
            or packed.shape[0] % Q8_PANEL_ROWS:
        raise ValueError(f"packed must be uint8 [16 * p, blocks * {bb}], got "
                         f"{packed.dtype} {tuple(packed.shape)}")
    pr, nb = Q8_PANEL_ROWS, packed.shape[1] // bb
    panels = packed.view(-1, nb, pr * bb)[index // pr]  # [T, nb, 16 * bb]
    lane = (index % pr).view(-1, 1, 1, 1, 1)
    t = index.shape[0]
    groups = panels[:, :, : pr * code_bytes].reshape(t, nb, code_bytes // 4, pr, 4)
    pick = lane.expand(t, nb, code_bytes // 4, 1, 4)
    codes = groups.gather(3, pick).reshape(t, nb, code_bytes)
    heads = panels[:, :, pr * code_bytes:].reshape(t, nb, fields, pr, 2)
    pick = lane.expand(t, nb, fields, 1, 2)
    scales = heads.gather(3, pick).reshape(t, nb, fields * 2)
    return torch.cat((scales, codes), dim=2).reshape(t, nb * bb)
