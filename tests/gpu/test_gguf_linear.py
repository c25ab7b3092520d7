"""A GGUF file read in place (``gpu/gguf_load.py``): every layer holds exactly the weights
transformers de-quantizes from the file (q/k un-interleaved, parts in order), mixed types
inside one fused module each run their own kernel, the quantized embedding looks up
de-quantized rows, a tied ``lm_head`` shares its tensor, weights stay within 1.1x the file's
tensor bytes, nothing but the small artifacts is written to the cache, and ``--quantization``
resolves and refuses as documented."""

from __future__ import annotations

import pytest
import torch
from gguf import GGUFReader, quants

from pagedserve.gpu import gguf_file, gguf_linear, gguf_load, loader
from pagedserve.gpu.attention import get_attention_backend
from pagedserve.gpu.cpu import linear_bands, memory
from pagedserve.gpu.dtype_choice import pick_quantization
from pagedserve.gpu.layer_ops import get_layer_ops
from pagedserve.kernels import gguf_ops

CPU = torch.device("cpu")
EXACT = linear_bands.exact_plan()
INT8 = linear_bands.LinearPlan("int8", ((linear_bands.ALL, "int8"),))


def _load(path, plan, dtype=torch.float32):
    config = loader.load_config(loader.resolve_model(str(path)).path)
    backend = get_attention_backend(CPU, dtype)
    return gguf_load.load_gguf_model(path, config, backend, 64,
                                     get_layer_ops(backend.name, dtype), CPU, dtype, plan)


def _hf_state(path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                              dtype=torch.float32)
    return hf.state_dict()


def _dense(layer: gguf_linear.GGUFLinear) -> torch.Tensor:
    """The layer's weights, de-quantized, in the model's row order (through its forward)."""
    if isinstance(layer, torch.nn.Linear):
        return layer.weight
    return layer(torch.eye(layer.in_features)).T - (0 if layer.bias is None else
                                                    layer.bias[:, None])


@pytest.mark.parametrize("plan", [EXACT, INT8], ids=["exact", "int8"])
def test_every_layer_holds_the_files_weights(mixed_gguf_path, plan):
    model, weights = _load(mixed_gguf_path, plan)
    state = _hf_state(mixed_gguf_path)
    qkv = model.model.layers[0].self_attn.qkv_proj
    # q, k Q4_0 (one int8 panel set when stacked), v Q8_0: a kernel each.
    want = ["exact"] * 3 if plan is EXACT else ["int8", "int8"]
    assert [p.path for p in qkv.parts] == want
    assert {p.qtype for p in qkv.parts} == {2, 8}
    down = model.model.layers[0].mlp.down_proj  # F16: de-quantized for that tensor only
    assert isinstance(down, torch.nn.Linear) and down.weight.dtype == torch.float32
    assert weights.dequantized == {f"blk.{i}.ffn_down.weight": "F16" for i in range(2)}
    if plan is EXACT:  # file rows, kept in the file's (interleaved) order: no copy
        assert qkv.parts[0].interleaved_heads == 4 and qkv.parts[1].interleaved_heads == 2
        for i in range(2):
            layer = model.model.layers[i]
            for name, module in (("self_attn.qkv_proj", layer.self_attn.qkv_proj),
                                 ("mlp.gate_up_proj", layer.mlp.gate_up_proj),
                                 ("self_attn.o_proj", layer.self_attn.o_proj),
                                 ("mlp.down_proj", layer.mlp.down_proj)):
                prefix = f"model.layers.{i}.{name.split('.')[0]}."
                parts = {"self_attn.qkv_proj": ["q_proj", "k_proj", "v_proj"],
                         "mlp.gate_up_proj": ["gate_proj", "up_proj"]}.get(
                    name, [name.split(".")[1]])
                hf = torch.cat([state[f"{prefix}{p}.weight"] for p in parts])
                torch.testing.assert_close(_dense(module), hf, rtol=0, atol=1e-5,
                                           msg=name)
    # tied lm_head and embedding: one tensor
    assert model.lm_head.parts[0].weight is model.model.embed_tokens.part.weight


def test_the_embedding_looks_up_dequantized_rows(mixed_gguf_path):
    reader = GGUFReader(str(mixed_gguf_path))
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    table = torch.from_numpy(quants.dequantize(emb.data, emb.tensor_type))
    ids = torch.tensor([[0, 5, 49151], [17, 17, 300]])
    for plan in (EXACT, INT8):
        model, _ = _load(mixed_gguf_path, plan)
        got = model.model.embed_tokens(ids)
        assert got.shape == (2, 3, 64) and torch.equal(got, table[ids]), plan.path
        with pytest.raises(IndexError):
            model.model.embed_tokens(torch.tensor([49152]))


def test_resident_weights_within_1_1x_the_files_tensors(mixed_gguf_path, tiny_gguf_path):
    for path in (mixed_gguf_path, tiny_gguf_path):
        for plan in (EXACT, INT8):
            model, w = _load(path, plan)
            total = memory.weights_bytes(model)
            assert w.quantized + w.float == total
            assert total <= 1.1 * w.file_tensor_bytes, (path.name, plan.path, total)
    # F16 down_proj de-quantized to float32: twice its bytes, the only float weights but norms
    # and the RoPE tables.


def test_only_small_artifacts_are_cached(mixed_gguf_path, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    resolved = loader.resolve_model(str(mixed_gguf_path))
    _load(mixed_gguf_path, EXACT)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert files and all(p.stat().st_size < 4 * 2**20 for p in files)
    assert not [p for p in files if p.suffix == ".safetensors"]
    assert (resolved.path / "config.json").exists()
    assert (resolved.path / "generation_config.json").exists()


def test_embedded_model_keeps_its_eos_ids_and_template():
    resolved = loader.resolve_model(None)
    from transformers import GenerationConfig

    tok = loader.load_tokenizer(resolved.path)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    eos = GenerationConfig.from_pretrained(resolved.path).eos_token_id
    assert eos == tok.convert_tokens_to_ids("<|im_end|>")


def test_mixed_parts_run_their_own_kernels(mixed_gguf_path):
    model, _ = _load(mixed_gguf_path, EXACT)
    qkv = model.model.layers[1].self_attn.qkv_proj
    x = torch.randn(5, qkv.in_features)
    f = gguf_file.open_gguf(mixed_gguf_path)
    q = gguf_file.rows_view(f.tensors["blk.1.attn_q.weight"])
    v = gguf_file.rows_view(f.tensors["blk.1.attn_v.weight"])
    want_v = gguf_ops.gguf_linear(x, v.contiguous(), 8)
    assert torch.equal(qkv(x)[:, 96:], want_v)
    want_q = gguf_ops.gguf_linear(x, gguf_linear.unpermute(q, 4), 2)
    assert torch.equal(qkv(x)[:, :64], want_q)


def test_quantization_flag_resolution(tiny_model_dir):
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
