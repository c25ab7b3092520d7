"""``gguf_file.open_gguf``'s own header index equals gguf-py's ``GGUFReader`` on real files
(the embedded SmolLM2 file, with its 49k-token vocabulary, and the test GGUFs of every block
type): the same tensors, types, shapes, byte counts and mapped bytes; a file that is not GGUF
still gets gguf-py's error."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from pagedserve.gpu import gguf_file as gf
from pagedserve.gpu import loader


def _same_as_gguf_py(path) -> None:
    arch, tensors, _ = gf._read_index(path)
    reader = GGUFReader(str(path))
    field = reader.fields["general.architecture"]
    assert arch == bytes(field.parts[field.data[0]]).decode()
    assert list(tensors) == [t.name for t in reader.tensors]
    for want in reader.tensors:
        got = tensors[want.name]
        assert (got.tensor_type, got.n_bytes, got.data_offset) == (
            want.tensor_type, want.n_bytes, want.data_offset), want.name
        assert got.shape.tolist() == want.shape.tolist()
        assert got.data.dtype == want.data.dtype and got.data.shape == want.data.shape
        assert np.array_equal(np.asarray(got.data), np.asarray(want.data)), want.name


def test_index_equals_gguf_py_on_the_embedded_file():
    _same_as_gguf_py(loader.embedded_gguf_path())


def test_index_equals_gguf_py_on_every_block_type(mixed_gguf_path, kquant_gguf_path):
    _same_as_gguf_py(mixed_gguf_path)  # Q4_0 Q4_1 Q8_0 F16 F32
    _same_as_gguf_py(kquant_gguf_path)  # Q4_K Q5_K Q6_K Q5_0 Q5_1


def test_a_file_that_is_not_gguf_gets_gguf_pys_error(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf file at all, just bytes" * 4)
    with pytest.raises(ValueError):
        gf.open_gguf(bad)


def test_gemma_config_reads_what_transformers_drops(tmp_path):
    """llama.cpp's Gemma keys: the caps (0: none), Gemma 3's global RoPE scaling and fixed
    local base, the 27B's hidden / heads scale (by its layer count), and ``<end_of_turn>``
    beside the file's EOS."""
    from gguf import GGUFWriter, RopeScalingType

    path = tmp_path / "gemma3.gguf"
    w = GGUFWriter(str(path), "gemma3")
    w.add_final_logit_softcapping(30.0)
    w.add_rope_scaling_type(RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(8.0)
    w.add_token_list(["<pad>", "<eos>", "<bos>", "hi", "<end_of_turn>"])
    w.add_eos_token_id(1)
    w.add_tensor("blk.0.attn_q.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    config = {"num_attention_heads": 32, "hidden_size": 5376, "head_dim": 128,
              "num_hidden_layers": 62, "rope_parameters": {
                  "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                  "sliding_attention": {"rope_type": "default", "rope_theta": 1e6}}}
    fields = gf.gemma_config(path, config)
    assert fields["final_logit_softcapping"] == 30.0 and "attn_logit_softcapping" not in fields
    assert fields["query_pre_attn_scalar"] == 168  # 5376 / 32, not the head size 128
    assert fields["rope_parameters"] == {
        "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    assert fields["eos_token_id"] == [1, 4]
    assert gf.gemma_config(path, {**config, "num_hidden_layers": 26})[
        "query_pre_attn_scalar"] == 128
