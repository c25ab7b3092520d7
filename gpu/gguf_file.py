"""A GGUF file opened in place: gguf-py's ``GGUFReader`` memory-maps it, so a tensor is a
numpy view of the file's bytes until something copies it.

Names are llama.cpp's for llama/mistral/qwen2 (``blk.N.attn_q`` ...; transformers'
``integrations/ggml.py`` maps them the same way); for the ``llama`` architecture the q/k rows
are interleaved (llama.cpp's ``convert_hf_to_gguf.py`` permutes them for its rotary layout,
transformers' ``LlamaTensorProcessor`` reverses it; qwen2 files are not permuted).
"""

from __future__ import annotations

import mmap
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import PretrainedConfig

# GGUF tensor name (after ``blk.{i}.``) -> (our module after ``model.layers.{i}.``, position
# in the fusion, parts of the fusion).
LAYER_TENSORS = {
    "attn_q": ("self_attn.qkv_proj", 0, 3), "attn_k": ("self_attn.qkv_proj", 1, 3),
    "attn_v": ("self_attn.qkv_proj", 2, 3), "attn_output": ("self_attn.o_proj", 0, 1),
    "ffn_gate": ("mlp.gate_up_proj", 0, 2), "ffn_up": ("mlp.gate_up_proj", 1, 2),
    "ffn_down": ("mlp.down_proj", 0, 1),
}
LAYER_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
# llama.cpp interleaves the rows of q and k for these architectures (its rotary layout).
PERMUTED_ARCHS = {"llama", "mistral"}


@dataclass(slots=True)
class GGUFFile:
    """``tensors``: gguf-py's ``ReaderTensor``s by name; ``tensor_bytes``: their bytes in the
    file (what "weights resident" is measured against)."""

    path: Path
    reader: object
    arch: str
    tensors: dict
    tensor_bytes: int

    def release_pages(self) -> None:
        """Drop the mapping's pages from this process's resident set (``MADV_DONTNEED``): the
        reads that copied or repacked tensors touched them; the views still in use fault back
        in from the page cache at their next read."""
        mm = getattr(self.reader.data, "_mmap", None)
        if mm is not None and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            mm.madvise(mmap.MADV_DONTNEED)


def open_gguf(path: Path) -> GGUFFile:
    """Raises ``ValueError`` (from gguf-py) for a file that is not GGUF."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    field = reader.fields.get("general.architecture")
    arch = bytes(field.parts[field.data[0]]).decode() if field is not None else ""
    tensors = {t.name: t for t in reader.tensors}
    return GGUFFile(path, reader, arch, tensors, sum(int(t.n_bytes) for t in tensors.values()))


def interleaved_heads(name: str, arch: str, config: PretrainedConfig) -> int:
    """The heads whose q/k rows llama.cpp interleaved in tensor ``name`` (0: none)."""
    if arch not in PERMUTED_ARCHS:
        return 0
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return {"attn_q": heads, "attn_k": kv_heads}.get(name.split(".")[-2], 0)


def rows_view(t) -> torch.Tensor:
    """Tensor ``t``'s bytes as uint8 ``[rows, row_bytes]``: a read-only view of the mapped
    file, no copy (the kernels only read it)."""
    data = t.data if t.data.dtype == np.uint8 else t.data.view(np.uint8)
    with warnings.catch_warnings():  # not writable: nothing writes to weights
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(data.reshape(int(t.shape[-1]) if len(t.shape) > 1 else 1, -1))


def in_features(t) -> int:
    """The input width of a 2-D GGUF tensor (its ``ne0``)."""
    return int(t.shape[0])


def out_features(t) -> int:
    return int(t.shape[1]) if len(t.shape) > 1 else 1


def dequantized(t, dtype: torch.dtype) -> torch.Tensor:
    """Tensor ``t``'s values as a new ``dtype`` tensor, ``[out, in]`` (1-D stays 1-D), through
    gguf-py's ``quants.dequantize`` (as transformers de-quantizes GGUF files).

    Raises:
        ValueError: a type gguf-py cannot de-quantize.
    """
    from gguf import quants

    try:
        values = quants.dequantize(np.asarray(t.data), t.tensor_type)
    except NotImplementedError as e:
        raise ValueError(f"GGUF tensor {t.name}: {e}") from e
    shape = (out_features(t), in_features(t)) if len(t.shape) > 1 else (in_features(t),)
    # a copy in any case: an F32 tensor's values are a view of the file
    return torch.from_numpy(np.ascontiguousarray(values).reshape(shape)).to(dtype, copy=True)
