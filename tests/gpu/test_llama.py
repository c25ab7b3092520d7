"""The model sets up its own buffers (RoPE tables in float32 whatever the dtype, lm_head tied to
the embeddings) and runs one path whichever layer ops it is given: torch's and our CPU
kernels' give the same q, k, v, norms and MLP activations."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from pagedserve.gpu.attention import TorchAttentionBackend
from pagedserve.gpu.layer_ops import CpuLayerOps, TorchLayerOps, get_layer_ops
from pagedserve.gpu.models.llama import LlamaForCausalLM, RotaryEmbedding
from pagedserve.kernels import cpu_ops

CPU = torch.device("cpu")
CONFIG = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                     tie_word_embeddings=True)


def test_build_sets_up_buffers_and_ties_lm_head():
    model = LlamaForCausalLM.build(CONFIG, TorchAttentionBackend(), 64, TorchLayerOps(), CPU,
                                   torch.bfloat16)
    rotary = model.model.rotary_emb
    want = RotaryEmbedding(CONFIG, 16, 64)  # built for real, on the CPU
    assert rotary.cos.dtype == torch.float32 and rotary.cos.device == CPU
    assert torch.equal(rotary.cos, want.cos) and torch.equal(rotary.sin, want.sin)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_layer_ops_follow_the_attention_backend():
    assert get_layer_ops("cpu", torch.float32).name == "cpu"
    assert get_layer_ops("cpu", torch.bfloat16).name == "cpu"
    assert get_layer_ops("cpu", torch.float16).name == "torch"  # the kernels do not take it
    assert get_layer_ops("torch", torch.float32).name == "torch"
    assert get_layer_ops("triton", torch.bfloat16).name == "torch"


@pytest.mark.skipif(cpu_ops.load() is None, reason="no C++ compiler")
def test_cpu_kernels_and_torch_ops_agree():
    g = torch.Generator().manual_seed(5)
    rope = RotaryEmbedding(CONFIG, 16, 64).step(torch.tensor([0, 7, 63, 2, 2]))
    qkv = torch.randn(5, (4 + 2 * 2) * 16, generator=g)
    x, residual = torch.randn(5, 64, generator=g), torch.randn(5, 64, generator=g)
    weight = torch.randn(64, generator=g)
    gate_up = torch.randn(5, 256, generator=g)
    got, want = [], []
    for ops, out in ((CpuLayerOps(), got), (TorchLayerOps(), want)):
        out.extend(ops.rotary_qkv(qkv.clone(), rope, 4, 2, 16))
        out.extend(ops.add_rms_norm(x, residual.clone(), weight, 1e-5))
        out.append(ops.rms_norm(x, weight, 1e-5))
        out.append(ops.silu_and_mul(gate_up))
    assert [t.shape for t in got] == [t.shape for t in want]
    assert [t.shape for t in got[:3]] == [(5, 4, 16), (5, 2, 16), (5, 2, 16)]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(want[4], x + residual)  # the residual sum comes back


@pytest.mark.parametrize("partial", [1.0, 0.75])
@pytest.mark.parametrize(("max_positions", "positions"), [(128, range(0, 60)),
                                                          (512, range(130, 190))])
def test_phi3_rope_equals_transformers(partial, max_positions, positions):
    """Phi-3.5 / Phi-4-mini RoPE (longrope, partial rotary 0.75) through ``TorchLayerOps``
    equals transformers' ``Phi3RotaryEmbedding`` + ``apply_rotary_pos_emb``: within the
    original 128 positions with the short factors, and at 130+ with a 512-position table,
    where both take the long ones (transformers because the positions pass 128)."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    n = int(16 * partial) // 2
    config = Phi3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=512, original_max_position_embeddings=128,
                        partial_rotary_factor=partial, rope_scaling={
                            "type": "longrope", "short_factor": [1 + 0.2 * i for i in range(n)],
                            "long_factor": [1 + 3.0 * i for i in range(n)]})
    pos = torch.tensor(list(positions))
    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, 4, len(pos), 16, generator=g)
    k = torch.randn(1, 2, len(pos), 16, generator=g)
    cos, sin = Phi3RotaryEmbedding(config)(q, pos[None])
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    qkv = torch.cat([q[0].transpose(0, 1).reshape(len(pos), -1),
                     k[0].transpose(0, 1).reshape(len(pos), -1), torch.zeros(len(pos), 32)], -1)
    rope = RotaryEmbedding(config, 16, max_positions).step(pos)
    got_q, got_k, _ = TorchLayerOps().rotary_qkv(qkv, rope, 4, 2, 16)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
