"""The tiny GGUF with mixed types inside fused modules, an F16 layer and a quantized tied
embedding, served from the file in place: greedy output and the prompt's and generated tokens'
logprobs in the exact mode equal transformers' own GGUF loading (its de-quantized float32
model), and ``/admin/stats`` says what is resident."""

from __future__ import annotations

from tests.conftest import (
    WITH_LOGPROBS,
    chat,
    chat_prompt_ids,
    check_served_answer,
    hf_gguf_model,
    serve,
    stats,
)

PROMPT = "Name three colours of the rainbow."


async def test_mixed_gguf_greedy_parity_with_transformers(mixed_gguf_path, default_model_dir):
    async with serve(mixed_gguf_path, quantization="gguf", max_model_len=144,
                     dtype="float32") as c:
        model = (await stats(c))["config"]["model"]
        body = await chat(c, PROMPT, max_tokens=12, ignore_eos=True, **WITH_LOGPROBS)
    resident = model["weights_resident"]
    assert resident["dequantized_types"] == ["F16"] and resident["dequantized_tensors"] == 2
    assert resident["quantized_bytes"] + resident["float_bytes"] \
        <= 1.1 * resident["file_tensor_bytes"]
    assert model["cpu_linear_paths"][0]["path"] == "exact"
    ids = chat_prompt_ids(default_model_dir, PROMPT)  # the same SmolLM2 tokenizer
    check_served_answer(body, hf_gguf_model(mixed_gguf_path), ids, 12)
