"""Write the tiny random Llama as a GGUF file (gguf-py's writer and quantizers), with the
embedded SmolLM2 GGUF's tokenizer metadata (the same vocabulary), so ``--quantization gguf``
can be tested on a model small enough to split over ranks: 16-dim heads and a 128-wide MLP,
whose tp=2 row-parallel ranges are whole 32-element blocks.

The layers get different block types (Q8_0, Q4_0, Q4_1) so every kernel and block size is cut;
q/k rows are interleaved as llama.cpp's ``convert_hf_to_gguf.py`` writes them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType, GGUFWriter, quants
from safetensors.numpy import load_file

# transformers' tensor suffix → (GGUF name, block type); None: kept float32.
_LAYER = {
    "self_attn.q_proj.weight": ("attn_q", Q.Q8_0), "self_attn.k_proj.weight": ("attn_k", Q.Q8_0),
    "self_attn.v_proj.weight": ("attn_v", Q.Q8_0),
    "self_attn.o_proj.weight": ("attn_output", Q.Q4_0),
    "mlp.gate_proj.weight": ("ffn_gate", Q.Q4_1), "mlp.up_proj.weight": ("ffn_up", Q.Q4_1),
    "mlp.down_proj.weight": ("ffn_down", Q.Q8_0),
    "input_layernorm.weight": ("attn_norm", None),
    "post_attention_layernorm.weight": ("ffn_norm", None),
}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row interleave (what ``gguf_linear._unpermute`` undoes)."""
    rows = w.shape[0]
    return (w.reshape(n_head, 2, rows // n_head // 2, -1).swapaxes(1, 2).reshape(w.shape))


def _copy_tokenizer(src: Path, writer: GGUFWriter) -> None:
    for field in GGUFReader(str(src)).fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub)


# A ``_M``-like mix: q/k of one type and v of another in one fused module, gate and up
# different, down_proj F16 (no kernel: de-quantized for that tensor only).
MIXED = {"attn_q": Q.Q4_0, "attn_k": Q.Q4_0, "attn_v": Q.Q8_0, "attn_output": Q.Q4_1,
         "ffn_gate": Q.Q4_1, "ffn_up": Q.Q8_0, "ffn_down": Q.F16}


def write_tiny_gguf(model_dir: Path, tokenizer_gguf: Path, out: Path, config,
                    types: dict | None = None) -> Path:
    """``model_dir``'s float32 safetensors as ``out`` (a .gguf file); ``types``: GGUF short
    name -> block type, overriding ``_LAYER``'s (e.g. ``MIXED``)."""
    state = load_file(str(model_dir / "model.safetensors"))
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    w = GGUFWriter(str(out), "llama")
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(config.hidden_size // heads)
    w.add_rope_freq_base(float(getattr(config, "rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(config.vocab_size)
    _copy_tokenizer(tokenizer_gguf, w)

    def add(name: str, t: np.ndarray, qtype) -> None:
        t = np.ascontiguousarray(t, dtype=np.float32)
        if qtype is None:
            w.add_tensor(name, t)
        elif qtype == Q.F16:
            w.add_tensor(name, t.astype(np.float16))
        else:
            w.add_tensor(name, quants.quantize(t, qtype), raw_dtype=qtype)

    add("token_embd.weight", state["model.embed_tokens.weight"], Q.Q8_0)
    add("output_norm.weight", state["model.norm.weight"], None)
    for i in range(config.num_hidden_layers):
        for suffix, (short, qtype) in _LAYER.items():
            qtype = (types or {}).get(short, qtype)
            t = state[f"model.layers.{i}.{suffix}"]
            if short in ("attn_q", "attn_k"):
                t = _permute(t, heads if short == "attn_q" else kv_heads)
            add(f"blk.{i}.{short}.weight", t, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
