"""Write the tiny random Llama as a GGUF file (gguf-py's writer and quantizers), with the
embedded SmolLM2 GGUF's tokenizer metadata (the same vocabulary), so ``--quantization gguf``
can be tested on a model small enough to split over ranks: 16-dim heads and a 128-wide MLP,
whose tp=2 row-parallel ranges are whole 32-element blocks.

The layers get different block types (Q8_0, Q4_0, Q4_1) so every kernel and block size is cut;
q/k rows are interleaved as llama.cpp's ``convert_hf_to_gguf.py`` writes them.

A Qwen3-MoE is written as llama.cpp's ``qwen3moe``: each layer's router as ``ffn_gate_inp``
(float32, as llama.cpp keeps it) and its experts stacked into 3-D ``ffn_gate_exps`` /
``ffn_up_exps`` ``[E, I, H]`` and ``ffn_down_exps`` ``[E, H, I]``, quantized row by row
(``EXPERTS``' types).
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


# A phi3 file keeps the checkpoint's fusions (llama.cpp's converter maps qkv_proj to attn_qkv
# and gate_up_proj to ffn_up), its rows not interleaved.
_PHI3_LAYER = {
    "self_attn.qkv_proj.weight": ("attn_qkv", Q.Q8_0),
    "self_attn.o_proj.weight": ("attn_output", Q.Q4_0),
    "mlp.gate_up_proj.weight": ("ffn_up", Q.Q4_1), "mlp.down_proj.weight": ("ffn_down", Q.Q8_0),
    "input_layernorm.weight": ("attn_norm", None),
    "post_attention_layernorm.weight": ("ffn_norm", None),
}
LAYER_SHORTS = tuple(short for short, _ in [*_LAYER.values(), *_PHI3_LAYER.values()])
# A mixture of experts' 3-D tensors: GGUF name -> (transformers' per-expert name, type).
EXPERTS = {"ffn_gate_exps": ("gate_proj", Q.Q8_0), "ffn_up_exps": ("up_proj", Q.Q4_1),
           "ffn_down_exps": ("down_proj", Q.Q4_0)}
# Gemma's norms (llama.cpp's names; ``ffn_norm`` is the one before the MLP there), all of
# them written plus one as llama.cpp's converter does (its kernels skip Gemma's ``1 + w``).
_GEMMA_NORMS = {
    "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "post_attention_norm",
    "pre_feedforward_layernorm.weight": "ffn_norm",
    "post_feedforward_layernorm.weight": "post_ffw_norm",
}
_ARCHS = {"qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe", "gemma2": "gemma2",
          "gemma3_text": "gemma3", "phi3": "phi3"}
# Qwen2's q/k/v biases, float32 as llama.cpp's converter keeps 1-D tensors.
_BIASES = {"self_attn.q_proj.bias": "attn_q", "self_attn.k_proj.bias": "attn_k",
           "self_attn.v_proj.bias": "attn_v"}


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


# A K-quant mix as llama.cpp's Q4_K_M / Q5_K_M files have them, with the legacy types its
# fallback uses (Q5_0, Q5_1) in the same modules: q/k/v of three types, gate/up of two.
KQUANT = {"attn_q": Q.Q4_K, "attn_k": Q.Q5_K, "attn_v": Q.Q6_K, "attn_output": Q.Q5_0,
          "ffn_gate": Q.Q4_K, "ffn_up": Q.Q5_1, "ffn_down": Q.Q6_K}
_F16 = np.float16


def _pack_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """6-bit scales and minimums ``[B, 8]`` as Q4_K / Q5_K's 12 bytes ``[B, 12]``."""
    s = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    s[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    s[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    s[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return s


def kquantize(t: np.ndarray, qtype) -> np.ndarray:
    """``[n, k]`` float32 (k a multiple of 256) as Q4_K, Q5_K or Q6_K blocks ``[n, row_bytes]``
    (gguf-py has no K-quant quantizer): a plain min/max fit per 32 (Q6_K: per 16) weights, the
    block layouts of llama.cpp's ``ggml-common.h``. Not llama.cpp's error-minimizing search;
    the tests need valid blocks of sensible weights, not the best ones."""
    n, k = t.shape
    x = t.reshape(-1, 8, 32).astype(np.float32)  # super-blocks of 8 sub-blocks
    nb = x.shape[0]
    if qtype == Q.Q6_K:
        g = x.reshape(nb, 16, 16)
        amax = np.abs(g).max(-1)
        d = (amax.max(-1) / 31 / 127).astype(_F16)
        dd = np.where(d == 0, 1, d).astype(np.float32)
        sc = np.clip(np.round(amax / 31 / dd[:, None]), -128, 127).astype(np.int8)
        step = d.astype(np.float32)[:, None] * sc.astype(np.float32)
        q = np.clip(np.round(g / np.where(step == 0, 1, step)[..., None]) + 32, 0, 63)
        q = q.astype(np.uint8).reshape(nb, 2, 4, 32)  # [half, sub-block, l]
        ql = np.concatenate([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4),
                             (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)], axis=-1)
        qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) \
            | ((q[:, :, 3] >> 4) << 6)
        out = np.concatenate([ql.reshape(nb, 128), qh.reshape(nb, 64), sc.view(np.uint8),
                              d.reshape(nb, 1).view(np.uint8)], axis=-1)
        return out.reshape(n, -1)
    nmax = 15 if qtype == Q.Q4_K else 31
    lo, hi = np.minimum(x.min(-1), 0), x.max(-1)
    scale, mins = (hi - lo) / nmax, -lo
    d, dmin = (scale.max(-1) / 63).astype(_F16), (mins.max(-1) / 63).astype(_F16)
    fd, fm = np.where(d == 0, 1, d).astype(np.float32), np.where(dmin == 0, 1, dmin)
    sc = np.clip(np.round(scale / fd[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(mins / fm.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[:, None] * sc
    off = dmin.astype(np.float32)[:, None] * m
    q = np.clip(np.round((x + off[..., None]) / np.where(step == 0, 1, step)[..., None]),
                0, nmax).astype(np.uint8)  # [B, 8, 32]
    qs = ((q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)).reshape(nb, 128)
    head = [d.reshape(nb, 1).view(np.uint8), dmin.reshape(nb, 1).view(np.uint8),
            _pack_k_scales(sc, m)]
    if qtype == Q.Q5_K:
        qh = np.zeros((nb, 32), dtype=np.uint8)
        for s_ in range(8):
            qh |= ((q[:, s_] >> 4) & 1) << s_
        head.append(qh)
    return np.concatenate([*head, qs], axis=-1).reshape(n, -1)


# The low-bit types a Q2_K / Q3_K_M / IQ4_XS file holds, none of them with int8 panels: every
# module mixes them, and the tied embedding is Q3_K.
LOWBIT = {"attn_q": Q.IQ4_XS, "attn_k": Q.Q3_K, "attn_v": Q.IQ4_NL, "attn_output": Q.Q2_K,
          "ffn_gate": Q.Q3_K, "ffn_up": Q.IQ4_XS, "ffn_down": Q.Q2_K}
_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                  dtype=np.float32)


def _nearest_iq4(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Indices into kvalues_iq4nl of ``x / step`` (``step`` broadcast), uint8."""
    y = x / np.where(step == 0, 1, step)
    return np.abs(y[..., None] - _IQ4NL).argmin(-1).astype(np.uint8)


def _nibbles(idx: np.ndarray) -> np.ndarray:
    """32 indices per row ``[..., 32]`` as 16 bytes: weight l low nibble, l + 16 high."""
    return idx[..., :16] | (idx[..., 16:] << 4)


def lowbit_quantize(t: np.ndarray, qtype) -> np.ndarray:
    """``[n, k]`` float32 as Q2_K, Q3_K, IQ4_NL or IQ4_XS blocks ``[n, row_bytes]`` (gguf-py
    has no quantizer for them): plain max / min-max fits, llama.cpp's block layouts
    (``ggml-common.h``), valid blocks of sensible weights for the tests."""
    n, k = t.shape
    if qtype == Q.IQ4_NL:
        x = t.reshape(-1, 32).astype(np.float32)
        d = (np.abs(x).max(-1) / 127).astype(_F16)
        idx = _nearest_iq4(x, d.astype(np.float32)[:, None])
        return np.concatenate([d.reshape(-1, 1).view(np.uint8), _nibbles(idx)], -1).reshape(n, -1)
    x = t.reshape(-1, 256).astype(np.float32)
    nb = x.shape[0]
    if qtype == Q.IQ4_XS:
        sub = x.reshape(nb, 8, 32)
        scale = np.abs(sub).max(-1) / 127
        d = (scale.max(-1) / 31).astype(_F16)
        sc = np.clip(np.round(scale / np.where(d == 0, 1, d).astype(np.float32)[:, None]),
                     -32, 31).astype(np.int32)
        idx = _nearest_iq4(sub, (d.astype(np.float32)[:, None] * sc)[..., None])
        ls = (sc + 32).astype(np.uint16)
        sh = np.zeros(nb, dtype=np.uint16)
        for s_ in range(8):
            sh |= (ls[:, s_] >> 4) << (2 * s_)
        sl = ((ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)).astype(np.uint8)
        return np.concatenate([d.reshape(nb, 1).view(np.uint8), sh.reshape(nb, 1).view(np.uint8),
                               sl, _nibbles(idx).reshape(nb, 128)], -1).reshape(n, -1)
    g = x.reshape(nb, 16, 16)
    q2 = np.zeros((nb, 64), dtype=np.uint8)  # weight 128 j + 32 s + l: byte 32 j + l, bits 2 s
    if qtype == Q.Q2_K:
        lo, hi = np.minimum(g.min(-1), 0), g.max(-1)
        scale, mins = (hi - lo) / 3, -lo
        d, dmin = (scale.max(-1) / 15).astype(_F16), (mins.max(-1) / 15).astype(_F16)
        fd, fm = (np.where(v == 0, 1, v).astype(np.float32)[:, None] for v in (d, dmin))
        sc = np.clip(np.round(scale / fd), 0, 15).astype(np.uint8)
        m = np.clip(np.round(mins / fm), 0, 15).astype(np.uint8)
        step = d.astype(np.float32)[:, None] * sc
        off = dmin.astype(np.float32)[:, None] * m
        q = np.clip(np.round((g + off[..., None]) / np.where(step == 0, 1, step)[..., None]),
                    0, 3).astype(np.uint8).reshape(nb, 2, 4, 32)
        for s_ in range(4):
            q2 |= (q[:, :, s_] << (2 * s_)).reshape(nb, 64)
        return np.concatenate([sc | (m << 4), q2, d.reshape(nb, 1).view(np.uint8),
                               dmin.reshape(nb, 1).view(np.uint8)], -1).reshape(n, -1)
    # Q3_K: q in -4..3, q + 4 = 4 * hbit + q2; signed 6-bit scales per 16
    scale = np.abs(g).max(-1) / 4
    d = (scale.max(-1) / 31).astype(_F16)
    sc = np.clip(np.round(scale / np.where(d == 0, 1, d).astype(np.float32)[:, None]),
                 -32, 31).astype(np.int32)
    step = d.astype(np.float32)[:, None] * sc
    q = (np.clip(np.round(g / np.where(step == 0, 1, step)[..., None]), -4, 3) + 4).astype(
        np.uint8).reshape(nb, 8, 32)  # [sub-block s, l]
    hmask = np.zeros((nb, 32), dtype=np.uint8)
    for s_ in range(8):
        hmask |= (q[:, s_] >> 2) << s_
    qq = (q & 3).reshape(nb, 2, 4, 32)
    for s_ in range(4):
        q2 |= (qq[:, :, s_] << (2 * s_)).reshape(nb, 64)
    ls = (sc + 32).astype(np.uint8)
    scales = np.zeros((nb, 12), dtype=np.uint8)
    scales[:, :8] = (ls[:, :8] & 15) | ((ls[:, 8:] & 15) << 4)
    for i in range(4):
        scales[:, 8 + i] = sum((ls[:, 4 * j + i] >> 4) << (2 * j) for j in range(4))
    return np.concatenate([hmask, q2, scales, d.reshape(nb, 1).view(np.uint8)], -1).reshape(n, -1)


def _add_experts(add, state: dict, i: int, num_experts: int, types: dict) -> None:
    """Layer ``i``'s router and its experts stacked on a leading axis (llama.cpp's layout)."""
    prefix = f"model.layers.{i}.mlp"
    add(f"blk.{i}.ffn_gate_inp.weight", state[f"{prefix}.gate.weight"], None)
    for short, (proj, qtype) in EXPERTS.items():
        stacked = np.stack([state[f"{prefix}.experts.{e}.{proj}.weight"]
                            for e in range(num_experts)])
        add(f"blk.{i}.{short}.weight", stacked, types.get(short, qtype))


def _phi3_keys(w: GGUFWriter, config, add) -> None:
    """What llama.cpp's ``convert_hf_to_gguf.py`` (``Phi3MiniModel``) writes of a Phi3
    config beyond the common keys: the original context, the window (0: none), and for
    longrope the attention factor and the two factor sets as float32 tensors."""
    import math

    rope = config.rope_parameters
    original = rope.get("original_max_position_embeddings",
                        config.original_max_position_embeddings)
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_sliding_window(config.sliding_window or 0)
    if rope.get("rope_type") != "longrope":
        return
    scale = config.max_position_embeddings / original
    w.add_rope_scaling_attn_factors(
        math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    add("rope_factors_long.weight", np.array(rope["long_factor"]), None)
    add("rope_factors_short.weight", np.array(rope["short_factor"]), None)


def _add_gemma_keys(w: GGUFWriter, config) -> None:
    """The keys llama.cpp's converter writes for Gemma 2 / 3 beyond Llama's: the window, the
    soft-caps (Gemma 2 both; Gemma 3 the final one when set) and Gemma 3's global RoPE
    scaling. Not the local RoPE base nor the 5:1 layer pattern: llama.cpp fixes both."""
    w.add_sliding_window(config.sliding_window)
    if config.model_type == "gemma2":
        w.add_attn_logit_softcapping(config.attn_logit_softcapping or 0.0)
    if config.final_logit_softcapping:
        w.add_final_logit_softcapping(config.final_logit_softcapping)
    full = (config.rope_parameters or {}).get("full_attention", {})
    if full.get("rope_type") == "linear":
        from gguf import RopeScalingType

        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])


def write_tiny_gguf(model_dir: Path, tokenizer_gguf: Path, out: Path, config,
                    types: dict | None = None, embedding=Q.Q8_0) -> Path:
    """``model_dir``'s float32 safetensors as ``out`` (a .gguf file); ``types``: GGUF short
    name -> block type, overriding ``_LAYER``'s (e.g. ``MIXED``); ``embedding``: the (tied)
    ``token_embd``'s type."""
    state = load_file(str(model_dir / "model.safetensors"))
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    # A Qwen2 config is written as llama.cpp's ``qwen2`` (q/k not interleaved, q/k/v
    # biases); a Qwen3 one as ``qwen3``: q/k not interleaved, q/k norms, the head size as its
    # own keys; Gemma's as ``gemma2`` / ``gemma3``; a Phi3 one as ``phi3`` (``_phi3_keys``).
    arch = _ARCHS.get(config.model_type, "llama")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    w = GGUFWriter(str(out), arch)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    if arch != "llama":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "qwen3moe":
        w.add_expert_count(config.num_experts)
        w.add_expert_used_count(config.num_experts_per_tok)
        w.add_expert_feed_forward_length(config.moe_intermediate_size)
    rope = getattr(config, "rope_parameters", None) or {}
    if arch.startswith("gemma"):
        _add_gemma_keys(w, config)
        rope = rope.get("full_attention", rope)
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(config.vocab_size)
    _copy_tokenizer(tokenizer_gguf, w)

    def add(name: str, t: np.ndarray, qtype) -> None:
        t = np.ascontiguousarray(t, dtype=np.float32)
        if qtype is None:
            w.add_tensor(name, t)
        elif qtype == Q.F16:
            w.add_tensor(name, t.astype(np.float16))
        elif qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K, Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS):
            # row by row: a 3-D expert tensor's rows too, its leading dims kept
            fn = kquantize if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else lowbit_quantize
            rows = fn(t.reshape(-1, t.shape[-1]), qtype)
            w.add_tensor(name, rows.reshape(*t.shape[:-1], -1), raw_dtype=qtype)
        else:
            w.add_tensor(name, quants.quantize(t, qtype), raw_dtype=qtype)

    if rope.get("rope_type") == "llama3":
        # As llama.cpp's converter stores Llama 3.x's scaling: per-frequency divisors.
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
        base = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
        add("rope_freqs.weight", base / scaled.double().numpy(), None)
    if arch == "phi3":
        _phi3_keys(w, config, add)
    shift = 1.0 if arch.startswith("gemma") else 0.0
    add("token_embd.weight", state["model.embed_tokens.weight"], embedding)
    if "lm_head.weight" in state and not config.tie_word_embeddings:
        add("output.weight", state["lm_head.weight"], embedding)
    add("output_norm.weight", state["model.norm.weight"] + shift, None)
    for i in range(config.num_hidden_layers):
        moe = f"model.layers.{i}.mlp.gate.weight" in state
        if moe:
            _add_experts(add, state, i, config.num_experts, types or {})
        for suffix, (short, qtype) in (_PHI3_LAYER if arch == "phi3" else _LAYER).items():
            if moe and suffix.startswith("mlp."):
                continue
            if shift and short in ("attn_norm", "ffn_norm"):
                continue  # Gemma's norms: below
            qtype = (types or {}).get(short, qtype)
            t = state[f"model.layers.{i}.{suffix}"]
            if short in ("attn_q", "attn_k") and arch == "llama":
                t = _permute(t, heads if short == "attn_q" else kv_heads)
            add(f"blk.{i}.{short}.weight", t, qtype)
        for suffix, short in _BIASES.items():
            if f"model.layers.{i}.{suffix}" in state:
                add(f"blk.{i}.{short}.bias", state[f"model.layers.{i}.{suffix}"], None)
        if shift:
            for suffix, short in _GEMMA_NORMS.items():
                add(f"blk.{i}.{short}.weight", state[f"model.layers.{i}.{suffix}"] + shift, None)
        if arch in ("qwen3", "qwen3moe", "gemma3"):
            for short, ours in (("attn_q_norm", "q_norm"), ("attn_k_norm", "k_norm")):
                add(f"blk.{i}.{short}.weight",
                    state[f"model.layers.{i}.self_attn.{ours}.weight"] + shift, None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
