"""``gpu/gguf_metadata.py``: transformers' GGUF config and tokenizer read through the fast
header reader equal what its legacy ``GGUFReader`` path gives, key for key and token for
token, on a Q8_0/Q4_0/Q4_1 file and a K-quant mix."""

from __future__ import annotations

from transformers import AutoConfig, AutoTokenizer

from pagedserve.gpu import gguf_metadata

TEXT = "Hello, world! <|im_start|>user\nCafé 1234 ünïcødé<|im_end|>"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def _both(path, read):
    legacy = read(path.parent, gguf_file=path.name)
    with gguf_metadata.fast_reader():  # raises where the adapter does not fit
        fast = read(path.parent, gguf_file=path.name)
    return legacy, fast


def test_config_equals_the_legacy_readers(tiny_gguf_path, kquant_gguf_path):
    for path in (tiny_gguf_path, kquant_gguf_path):
        legacy, fast = _both(path, AutoConfig.from_pretrained)
        assert fast.to_dict() == legacy.to_dict(), path.name
        assert fast.vocab_size == 49152 and fast.num_hidden_layers == 2


def test_tokenizer_equals_the_legacy_readers(tiny_gguf_path):
    legacy, fast = _both(tiny_gguf_path, AutoTokenizer.from_pretrained)
    assert type(fast) is type(legacy)
    assert fast.encode(TEXT) == legacy.encode(TEXT) and len(fast.encode(TEXT)) > 10
    assert fast.apply_chat_template(CHAT, tokenize=False) == legacy.apply_chat_template(
        CHAT, tokenize=False)
    assert fast.special_tokens_map == legacy.special_tokens_map
    assert fast.get_vocab() == legacy.get_vocab()


def test_read_config_and_tokenizer_takes_the_fast_path(tiny_gguf_path, monkeypatch):
    def legacy_reader(*_a, **_k):
        raise AssertionError("gguf.GGUFReader opened")

    import gguf
    monkeypatch.setattr(gguf, "GGUFReader", legacy_reader)
    config, tokenizer = gguf_metadata.read_config_and_tokenizer(
        tiny_gguf_path.parent, tiny_gguf_path.name)
    assert config.model_type == "llama" and tokenizer.eos_token == "<|im_end|>"
