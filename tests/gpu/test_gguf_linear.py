"""Keeping the embedded GGUF's quantized blocks: every swapped layer holds exactly the weights
transformers de-quantizes from the file (q/k rows un-interleaved, q/k/v and gate/up stacked in
order), small batches read the blocks and large bfloat16 ones the dense copy, and
``--quantization`` resolves and refuses as documented."""

from __future__ import annotations

import pytest
import torch

from pagedserve.gpu import gguf_linear, loader
from pagedserve.gpu.attention import get_attention_backend
from pagedserve.gpu.dtype_choice import pick_quantization
from pagedserve.gpu.models.llama import LlamaForCausalLM
from pagedserve.kernels import gguf_ops

CPU = torch.device("cpu")


def _float_model(path, dtype=torch.float32) -> LlamaForCausalLM:
    config = loader.load_config(path)
    model = LlamaForCausalLM(config, get_attention_backend(CPU), 64)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    loader.load_weights(model, path)
    return model.to(dtype)


@pytest.fixture(scope="module")
def quantized(default_model_dir):
    model = _float_model(default_model_dir)
    dense = {n: m.weight.detach().clone() for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear)}
    swapped = gguf_linear.quantize_model(model, loader.embedded_gguf_path(),
                                         loader.load_config(default_model_dir))
    return model, dense, swapped


def test_every_linear_holds_the_files_weights_exactly(quantized):
    model, dense, swapped = quantized
    layers = {n: m for n, m in model.named_modules() if isinstance(m, gguf_linear.GGUFLinear)}
    assert swapped == len(layers) == 30 * 4 + 1  # qkv, o, gate_up, down per layer; lm_head
    assert layers["lm_head"].qtype == 8  # the tied token_embd is Q8_0 in this file
    assert layers["model.layers.0.self_attn.qkv_proj"].qtype == 3  # Q4_1
    for name, layer in layers.items():
        values = gguf_ops.gguf_dequantize(layer.qweight, layer.qtype, layer.in_features)
        assert torch.equal(values, dense[name]), name
    # The embedding lookup keeps its de-quantized table.
    assert isinstance(model.model.embed_tokens, torch.nn.Embedding)


def test_small_batches_read_blocks_large_bfloat16_ones_the_dense_copy(quantized):
    model, _, _ = quantized
    f32 = model.model.layers[3].mlp.down_proj
    assert f32.max_rows > 10**6  # float32: the kernel at every size
    bf16 = gguf_linear.GGUFLinear(torch.nn.Linear(f32.in_features, f32.out_features,
                                                  bias=False).bfloat16(), f32.qweight, f32.qtype)
    bf16.dense.weight.data.copy_(gguf_ops.gguf_dequantize(f32.qweight, f32.qtype,
                                                         f32.in_features))
    assert bf16.max_rows == 4
    for rows in (1, 4, 5, 64):
        x = torch.randn(rows, f32.in_features).bfloat16()
        kernel = gguf_ops.gguf_linear(x, f32.qweight, f32.qtype)
        want = kernel if rows <= 4 else bf16.dense(x)
        assert torch.equal(bf16(x), want), rows
        # Either way the same weights: float32 ones in the kernel, rounded to bfloat16 dense.
        torch.testing.assert_close(bf16(x).float(), kernel.float(), rtol=0.05, atol=0.05)


def test_quantization_flag_resolution(default_model_dir, tiny_model_dir):
    gguf = loader.resolve_model(None)
    assert gguf.gguf_file == loader.embedded_gguf_path()
    assert pick_quantization(None, gguf, CPU) == "gguf"
    assert pick_quantization("gguf", gguf, CPU) == "gguf"
    assert pick_quantization("none", gguf, CPU) is None
    hf = loader.resolve_model(str(tiny_model_dir))
    assert hf.gguf_file is None and pick_quantization(None, hf, CPU) is None
    with pytest.raises(ValueError, match="needs a .gguf model"):
        pick_quantization("gguf", hf, CPU)
    with pytest.raises(ValueError, match="needs a .gguf model"):
        pick_quantization("gguf", gguf, torch.device("cuda"))
    # Our kernels take float32 or bfloat16 activations: float16 de-quantizes, or is refused.
    assert pick_quantization(None, gguf, CPU, torch.float16) is None
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        pick_quantization("gguf", gguf, CPU, torch.float16)
    with pytest.raises(ValueError, match="unknown quantization"):
        pick_quantization("awq", gguf, CPU)


def test_blocks_are_cached_beside_the_converted_model(default_model_dir, tmp_path):
    config = loader.load_config(default_model_dir)
    gguf = loader.embedded_gguf_path()
    fresh, kept = gguf_linear.load_blocks(gguf, config, tmp_path)
    assert (tmp_path / gguf_linear.BLOCKS_CACHE).exists() and kept == []
    cached, kept_again = gguf_linear.load_blocks(gguf, config, tmp_path)
    assert kept_again == [] and cached.keys() == fresh.keys() and len(cached) == 121
    for name, (qtype, rows) in fresh.items():
        assert cached[name][0] == qtype and torch.equal(cached[name][1], rows), name
