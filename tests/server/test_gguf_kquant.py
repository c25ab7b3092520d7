"""A ``_K_M``-style GGUF (Q4_K/Q5_K/Q6_K with the Q5_0/Q5_1 fallbacks, mixed inside the fused
q/k/v and gate/up modules, a tied Q6_K embedding) served from the file with every tensor kept
quantized: greedy output and the prompt's and generated tokens' logprobs in the exact mode
equal transformers' own GGUF loading, and the int8 mode (the CPU default) serves it with no
de-quantized tensor either, within 1.1x the file.
The same for a low-bit mix (Q2_K, Q3_K, IQ4_NL, IQ4_XS, tied Q3_K embedding), whose types the
exact kernel reads in every mode."""

from __future__ import annotations

from tests.conftest import (
    WITH_LOGPROBS,
    chat,
    chat_prompt_ids,
    check_served_answer,
    hf_gguf_model,
    serve,
    stats,
    stream_chat,
)

PROMPT = "Name three colours of the rainbow."


def _resident(model: dict) -> dict:
    resident = model["weights_resident"]
    assert resident["dequantized_tensors"] == 0 and resident["dequantized_types"] == []
    assert resident["quantized_bytes"] + resident["float_bytes"] \
        <= 1.1 * resident["file_tensor_bytes"]
    return resident


async def test_kquant_gguf_greedy_parity_with_transformers(kquant_gguf_path,
                                                          default_model_dir):
    async with serve(kquant_gguf_path, quantization="gguf", max_model_len=144,
                     dtype="float32") as c:
        model = (await stats(c))["config"]["model"]
        body = await chat(c, PROMPT, max_tokens=12, ignore_eos=True, **WITH_LOGPROBS)
    _resident(model)
    assert model["cpu_linear_paths"][0]["path"] == "exact"
    ids = chat_prompt_ids(default_model_dir, PROMPT)  # the same SmolLM2 tokenizer
    check_served_answer(body, hf_gguf_model(kquant_gguf_path), ids, 12)


async def test_kquant_gguf_int8_mode_keeps_every_tensor_quantized(kquant_gguf_path):
    async with serve(kquant_gguf_path, quantization="gguf", max_model_len=144,
                     dtype="bfloat16", cpu_linear_mode="int8") as c:
        model = (await stats(c))["config"]["model"]
        text, tokens, _ = await stream_chat(c, PROMPT, max_tokens=8, ignore_eos=True)
    resident = _resident(model)
    assert model["cpu_linear_paths"][0]["path"] == "int8"
    # Q4_K / Q5_K panels carry their scales decoded: a few percent over the file, no more.
    assert resident["quantized_bytes"] > 0.9 * resident["file_tensor_bytes"]
    assert len(tokens) == 8 and text


async def test_lowbit_gguf_greedy_parity_and_kept_in_place(lowbit_gguf_path, default_model_dir):
    async with serve(lowbit_gguf_path, quantization="gguf", max_model_len=144,
                     dtype="float32") as c:  # float32: the exact kernel, every tensor in place
        _resident((await stats(c))["config"]["model"])
        body = await chat(c, PROMPT, max_tokens=12, ignore_eos=True, **WITH_LOGPROBS)
    ids = chat_prompt_ids(default_model_dir, PROMPT)
    check_served_answer(body, hf_gguf_model(lowbit_gguf_path), ids, 12)


async def test_lowbit_types_without_panels_are_dequantized_in_int8_mode(lowbit_gguf_path):
    """No int8 panels for these types: the int8 mode (the CPU default) de-quantizes them (the
    exact kernel's decoder would be slower than the copy), names them, and still serves."""
    async with serve(lowbit_gguf_path, quantization="gguf", max_model_len=144,
                     dtype="bfloat16", cpu_linear_mode="int8") as c:
        resident = (await stats(c))["config"]["model"]["weights_resident"]
        text, tokens, _ = await stream_chat(c, PROMPT, max_tokens=6, ignore_eos=True)
    assert sorted(resident["dequantized_types"]) == ["IQ4_NL", "IQ4_XS", "Q2_K", "Q3_K"]
    assert resident["dequantized_tensors"] == 2 * 7 + 1  # every layer tensor, the embedding
    assert len(tokens) == 6 and text
