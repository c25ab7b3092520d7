"""A GGUF file opened in place: gguf-py's ``GGUFReader`` memory-maps it, so a tensor is a
numpy view of the file's bytes until something copies it.

Names are llama.cpp's for llama/mistral/qwen2/qwen3/gemma2/gemma3/phi3/qwen3moe (``blk.N.attn_q`` ...;
transformers' ``integrations/ggml.py`` maps them the same way); for the ``llama``
architecture the q/k rows are interleaved (llama.cpp's ``convert_hf_to_gguf.py`` permutes
them for its rotary layout, transformers' ``LlamaTensorProcessor`` reverses it; qwen2, gemma
and phi3 files are not permuted). Gemma files store their norm weights plus one
(``NORM_SHIFT``). A ``phi3`` file keeps the checkpoint's fusions: ``attn_qkv`` (q, k, v rows)
and ``ffn_up`` (gate then up rows), and its longrope factors as ``rope_factors_long`` /
``rope_factors_short`` tensors (``phi3_config_fields``).
"""

from __future__ import annotations

import math
import mmap
import struct
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

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
# Gemma's four norms per layer (llama.cpp's ``ffn_norm`` is its norm before the MLP there).
GEMMA_LAYER_NORMS = {"attn_norm": "input_layernorm", "post_attention_norm":
                     "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                     "post_ffw_norm": "post_feedforward_layernorm"}
# Norms over each head of q and k (Qwen3), after ``model.layers.{i}.self_attn.``.
HEAD_NORMS = {"attn_q_norm": "q_norm", "attn_k_norm": "k_norm"}
# phi3's own: one tensor per fused module (``stacked_parts`` splits it for the ranks).
PHI3_TENSORS = {"attn_qkv": ("self_attn.qkv_proj", 0, 1), "ffn_up": ("mlp.gate_up_proj", 0, 1)}
# The ``general.architecture``s whose tensors these names cover.
READ_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "qwen3moe")
# A mixture of experts' tensors (after ``blk.{i}.``): the router, ``[E, H]`` rows (usually
# F32), and the experts stacked on a leading axis (``gguf_moe.py``).
MOE_ROUTER = "ffn_gate_inp"
MOE_EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
# llama.cpp's converter stores Gemma's zero-centred norm weights plus one (the ``1 + w`` its
# kernels then skip); our Gemma norms take transformers' form, so the one comes off on load.
NORM_SHIFT = {"gemma2": 1.0, "gemma3": 1.0}
# llama.cpp interleaves the rows of q and k for these architectures (its rotary layout).
PERMUTED_ARCHS = {"llama", "mistral"}


def layer_tensors(arch: str) -> dict[str, tuple[str, int, int]]:
    """``LAYER_TENSORS`` as architecture ``arch`` names them (phi3: ``attn_qkv`` and a fused
    ``ffn_up``; its separate ``attn_q/k/v``, which llama.cpp also reads, stay)."""
    return {**LAYER_TENSORS, **PHI3_TENSORS} if arch == "phi3" else LAYER_TENSORS


def layer_linears(arch: str, tensors: dict, i: int) -> dict[str, tuple[str, ...]]:
    """Layer ``i``'s linear modules (after ``model.layers.{i}.``) and the GGUF tensors (after
    ``blk.{i}.``) that make each, in fusion order."""
    fused = f"blk.{i}.attn_qkv.weight" in tensors
    return {"self_attn.qkv_proj": ("attn_qkv",) if fused else ("attn_q", "attn_k", "attn_v"),
            "self_attn.o_proj": ("attn_output",),
            "mlp.gate_up_proj": ("ffn_up",) if arch == "phi3" else ("ffn_gate", "ffn_up"),
            "mlp.down_proj": ("ffn_down",)}


@dataclass(slots=True)
class GGUFFile:
    """``tensors``: gguf-py's ``ReaderTensor``s by name; ``tensor_bytes``: their bytes in the
    file (what "weights resident" is measured against); ``metadata``: the scalar metadata
    values by key (strings, numbers, booleans; no arrays: the vocabulary is not read)."""

    path: Path
    reader: object
    arch: str
    tensors: dict
    tensor_bytes: int
    metadata: dict = field(default_factory=dict)

    def release_pages(self) -> None:
        """Drop the mapping's pages from this process's resident set (``MADV_DONTNEED``): the
        reads that copied or repacked tensors touched them; the views still in use fault back
        in from the page cache at their next read."""
        mm = getattr(self.reader.data, "_mmap", None)
        if mm is not None and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            mm.madvise(mmap.MADV_DONTNEED)


def open_gguf(path: Path) -> GGUFFile:
    """The file's tensors, mapped. Its header is read by ``_read_index`` (gguf-py's
    ``GGUFReader`` spends seconds building objects for the ~100k tokenizer strings of every
    file, which our loading never reads: the tokenizer comes from the metadata folder); a file
    that index cannot read goes through ``GGUFReader``.

    Raises ``ValueError`` (from gguf-py) for a file that is not GGUF.
    """
    try:
        arch, tensors, data, metadata = _read_index(path)
        reader = SimpleNamespace(data=data)
    except (ValueError, struct.error, OSError):
        from gguf import GGUFReader, GGUFValueType

        reader = GGUFReader(str(path))
        metadata = {k: f.contents() for k, f in reader.fields.items()  # GGUF.*: the header's
                    if f.types and f.types[0] != GGUFValueType.ARRAY and not k.startswith("GGUF.")}
        arch = metadata.get("general.architecture", "")
        tensors = {t.name: t for t in reader.tensors}
    return GGUFFile(path, reader, arch, tensors, sum(int(t.n_bytes) for t in tensors.values()),
                    metadata)


# GGUF metadata value types (gguf-py's GGUFValueType) -> bytes of one scalar; 8: string, 9: array.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_ITEM_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
                "I16": np.int16, "I32": np.int32, "I64": np.int64}


def _read_index(path: Path):
    """(architecture, ``{name: gguf.ReaderTensor}``, the file's ``np.memmap``, the scalar
    metadata ``{key: value}``) from a little-endian GGUF v2/v3 header (llama.cpp's ``gguf.h``
    layout), skipping every array (the vocabulary). The tensors' ``data`` are views of the
    mapping shaped as ``GGUFReader`` shapes them (bytes for block types).

    Raises:
        ValueError: not such a file (the caller falls back to ``GGUFReader``).
    """
    from gguf import GGMLQuantizationType

    data = np.memmap(path, mode="r")
    buf = data._mmap  # the mmap itself: struct reads without numpy per field
    if bytes(buf[:4]) != b"GGUF" or struct.unpack_from("<I", buf, 4)[0] not in (2, 3):
        raise ValueError(f"{path}: not a little-endian GGUF v2/v3 file")
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    pos, metadata = 24, {}

    def string(at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, at)
        return bytes(buf[at + 8:at + 8 + n]).decode("utf-8", "replace"), at + 8 + n

    def skip(vtype: int, at: int) -> int:
        if vtype in _SCALAR_BYTES:
            return at + _SCALAR_BYTES[vtype]
        if vtype == 8:
            return at + 8 + struct.unpack_from("<Q", buf, at)[0]
        if vtype != 9:
            raise ValueError(f"{path}: unknown GGUF value type {vtype}")
        etype, count = struct.unpack_from("<IQ", buf, at)
        at += 12
        if etype in _SCALAR_BYTES:
            return at + count * _SCALAR_BYTES[etype]
        for _ in range(count):  # strings (the vocabulary), or nested arrays
            at = skip(etype, at)
        return at

    for _ in range(n_kv):
        key, pos = string(pos)
        (vtype,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if vtype == 8:
            metadata[key], pos = string(pos)
        elif vtype in _SCALAR_FORMATS:
            (metadata[key],) = struct.unpack_from(_SCALAR_FORMATS[vtype], buf, pos)
            pos += _SCALAR_BYTES[vtype]
        else:
            pos = skip(vtype, pos)
    arch, alignment = metadata.get("general.architecture", ""), metadata.get(
        "general.alignment", 32)
    infos = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        qtype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos.append((name, dims, GGMLQuantizationType(qtype), offset))
    start = -(-pos // alignment) * alignment
    return arch, _tensor_views(path, data, infos, start), data, metadata


def _tensor_views(path: Path, data: np.memmap, infos: list, start: int) -> dict:
    """``{name: gguf.ReaderTensor}`` over the mapping, each tensor's ``data`` shaped as
    ``GGUFReader`` shapes it (bytes for block types), from the header's ``(name, dims, type,
    offset)`` entries and the data section's ``start``."""
    from gguf import GGML_QUANT_SIZES, ReaderTensor
    from gguf.quants import quant_shape_to_byte_shape

    tensors = {}
    for name, dims, qtype, offset in infos:
        n_elems = int(np.prod(dims))
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_bytes = n_elems * type_size // block
        np_dims = tuple(reversed(dims))
        at = start + offset
        if at + n_bytes > data.shape[0] or name in tensors:
            raise ValueError(f"{path}: tensor {name} is out of the file or repeated")
        item = _ITEM_DTYPES.get(qtype.name)
        if item is None:  # block types: bytes, [..., row_bytes]
            view = data[at:at + n_bytes].reshape(quant_shape_to_byte_shape(np_dims, qtype))
        else:
            view = data[at:at + n_bytes].view(item).reshape(np_dims)
        tensors[name] = ReaderTensor(name=name, tensor_type=qtype,
                                     shape=np.array(dims, dtype=np.uint64), n_elements=n_elems,
                                     n_bytes=n_bytes, data_offset=at, data=view, field=None)
    return tensors


def layer_norms(arch: str) -> dict[str, str]:
    """GGUF norm name (after ``blk.{i}.``) -> our module (after ``model.layers.{i}.``)."""
    return GEMMA_LAYER_NORMS if arch in ("gemma2", "gemma3") else LAYER_NORMS


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


def expert_rows(t) -> torch.Tensor:
    """3-D block tensor ``t`` (GGUF dims ``(in, out, E)``) as uint8 ``[E, out, row_bytes]``: a
    read-only view of the mapped file, expert ``e``'s rows the contiguous ``[e]``."""
    data = t.data if t.data.dtype == np.uint8 else t.data.view(np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(data.reshape(int(t.shape[2]), int(t.shape[1]), -1))


def in_features(t) -> int:
    """The input width of a 2-D GGUF tensor (its ``ne0``)."""
    return int(t.shape[0])


def out_features(t) -> int:
    return int(t.shape[1]) if len(t.shape) > 1 else 1


def dequantized(t, dtype: torch.dtype) -> torch.Tensor:
    """Tensor ``t``'s values as a new ``dtype`` tensor, ``[out, in]`` (1-D stays 1-D, 3-D
    experts ``[E, out, in]``), through
    gguf-py's ``quants.dequantize`` (as transformers de-quantizes GGUF files).

    Raises:
        ValueError: a type gguf-py cannot de-quantize.
    """
    from gguf import quants

    try:
        values = quants.dequantize(np.asarray(t.data), t.tensor_type)
    except NotImplementedError as e:
        raise ValueError(f"GGUF tensor {t.name}: {e}") from e
    shape = tuple(int(d) for d in reversed(t.shape))  # numpy's order of GGUF's dims
    # a copy in any case: an F32 tensor's values are a view of the file
    return torch.from_numpy(np.ascontiguousarray(values).reshape(shape)).to(dtype, copy=True)


def config_from_file(path: Path, config: PretrainedConfig) -> dict:
    """What transformers' GGUF config misses and the file says, as config fields: its
    tensors' (``config_from_tensors``) and, for Gemma and Phi-3, its metadata's
    (``gemma_config``, ``phi3_config_fields``)."""
    fields = config_from_tensors(path, config)
    if config.model_type in ("gemma2", "gemma3_text"):
        fields.update(gemma_config(path, {**config.to_dict(), **fields}))
    if config.model_type == "phi3":
        fields.update(phi3_config_fields(open_gguf(path), config))
    return fields


# llama.cpp's layer counts of the 27B Gemmas, whose query_pre_attn_scalar is hidden / heads
# rather than the head size (its ``f_attention_scale``; no metadata key carries it).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def gemma_config(path: Path, config: dict) -> dict:
    """The Gemma fields transformers' GGUF mapping drops, from the file's metadata as
    llama.cpp reads it: the soft-caps (``{arch}.attn_logit_softcapping``,
    ``final_logit_softcapping``; absent: the config's defaults), ``query_pre_attn_scalar``
    (llama.cpp's rule by layer count), and Gemma 3's global RoPE scaling
    (``rope.scaling.type`` / ``factor``) and local base (``rope.freq_base_swa``, else
    llama.cpp's 10000); and ``<end_of_turn>`` as an EOS id beside the file's EOS (an
    instruction-tuned Gemma ends its turn with it: llama.cpp counts it as end of generation,
    Google's generation config lists it)."""
    from transformers.integrations.gguf.reader import read_gguf_metadata

    meta, _ = read_gguf_metadata(str(path), ("tokenizer.ggml.tokens",))
    arch = meta.get("general.architecture", "")
    fields = {}
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if f"{arch}.{key}" in meta:
            fields[key] = float(meta[f"{arch}.{key}"]) or None  # 0: none
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // heads
    big = config["num_hidden_layers"] == _GEMMA_27B_LAYERS.get(arch)
    fields["query_pre_attn_scalar"] = hidden // heads if big else head_dim
    if arch == "gemma3":
        rope = {k: dict(v) for k, v in (config.get("rope_parameters") or {}).items()}
        full = rope.setdefault("full_attention", {"rope_type": "default"})
        kind, factor = meta.get(f"{arch}.rope.scaling.type"), meta.get(
            f"{arch}.rope.scaling.factor")
        if kind not in (None, "none") and factor:
            full.update(rope_type=kind, factor=float(factor))
        local = rope.setdefault("sliding_attention", {"rope_type": "default"})
        local["rope_theta"] = float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0))
        fields["rope_parameters"] = rope
    tokens, eos = meta.get("tokenizer.ggml.tokens") or [], meta.get("tokenizer.ggml.eos_token_id")
    if "<end_of_turn>" in tokens and eos is not None:
        fields["eos_token_id"] = sorted({int(eos), tokens.index("<end_of_turn>")})
    return fields


def config_from_tensors(path: Path, config: PretrainedConfig) -> dict:
    """What transformers' GGUF config misses and the file's tensors say, as config fields:

    - ``rope_freq_factors`` (``[head_dim / 2]`` floats): ``rope_freqs.weight``, llama.cpp's
      converter's form of Llama 3.x's ``llama3`` RoPE scaling (per-frequency divisors of the
      inverse frequencies; no metadata key says so);
    - ``head_dim``: from ``attn_q``'s rows when they are not ``hidden / heads`` heads (Qwen3's
      128 at sizes where that differs; transformers maps no ``attention.key_length``);
    - ``moe_intermediate_size``: the experts' width, from ``ffn_gate_exps`` (transformers'
      ``qwen3moe`` config maps no ``expert_feed_forward_length``).
    """
    f = open_gguf(path)
    fields = {}
    t = f.tensors.get("rope_freqs.weight")
    if t is not None:
        fields["rope_freq_factors"] = dequantized(t, torch.float32).tolist()
    q, heads = f.tensors.get("blk.0.attn_q.weight"), getattr(config, "num_attention_heads", 0)
    if q is not None and heads and out_features(q) % heads == 0:
        head_dim = out_features(q) // heads
        if head_dim != (getattr(config, "head_dim", None) or config.hidden_size // heads):
            fields["head_dim"] = head_dim
    exps = f.tensors.get(f"blk.0.{MOE_EXPERTS[0]}.weight")
    if exps is not None and len(exps.shape) == 3:
        fields["moe_intermediate_size"] = int(exps.shape[1])
    return fields


def phi3_config_fields(f: GGUFFile, config: PretrainedConfig) -> dict:
    """A ``phi3`` file's RoPE and window as Phi3Config fields (transformers' GGUF mapping reads
    none of them), from the keys and tensors llama.cpp's ``convert_hf_to_gguf.py`` writes:

    - ``original_max_position_embeddings``: ``phi3.rope.scaling.original_context_length``;
    - ``partial_rotary_factor``: ``phi3.rope.dimension_count`` over the head size
      (Phi-4-mini: 96 of 128);
    - ``rope_parameters``: ``longrope`` with ``rope_factors_long`` / ``rope_factors_short``
      when the file has them, and ``phi3.rope.scaling.attn_factor`` as ``attention_factor``
      where it is not the one transformers derives from the lengths;
    - ``sliding_window``: ``phi3.attention.sliding_window`` (0, Phi-4's: none).
    """
    meta = f.metadata
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.setdefault("rope_theta", float(meta.get("phi3.rope.freq_base", 10000.0)))
    fields: dict = {"sliding_window": int(meta.get("phi3.attention.sliding_window", 0)) or None}
    original = meta.get("phi3.rope.scaling.original_context_length")
    if original is not None:
        fields["original_max_position_embeddings"] = int(original)
    dims = meta.get("phi3.rope.dimension_count")
    if dims is not None and int(dims) != head:
        fields["partial_rotary_factor"] = params["partial_rotary_factor"] = int(dims) / head
    long, short = f.tensors.get("rope_factors_long.weight"), f.tensors.get(
        "rope_factors_short.weight")
    if long is not None and short is not None and original is not None:
        params.update(rope_type="longrope", original_max_position_embeddings=int(original),
                      long_factor=dequantized(long, torch.float32).tolist(),
                      short_factor=dequantized(short, torch.float32).tolist())
        params.pop("type", None)
        attn = meta.get("phi3.rope.scaling.attn_factor")
        scale = config.max_position_embeddings / int(original)
        derived = math.sqrt(1 + math.log(scale) / math.log(int(original))) if scale > 1 else 1.0
        if attn is not None and abs(attn - derived) > 1e-5 * derived:
            params["attention_factor"] = float(attn)
    fields["rope_parameters"] = params
    return fields
