"""The tool-call parser each family gets out of the box (no ``--tool-call-parser``), read off
its chat template and vocabulary (``tests/server/family_templates.py``: templates modelled on
the real ones): Qwen2.5 / Qwen3 / Hermes → ``hermes``, Llama 3.x → ``llama3_json``, Mistral
v0.3 → ``mistral``, Phi-4-mini → ``phi4_mini_json`` (its tools rendered by pagedserve's
``PHI4_MINI_TOOLS``); Gemma 2/3, Phi-3.5 and Mistral v0.1 name no format, so ``auto`` needs
the flag (Gemma 3: ``pythonic`` with a pythonic template, as vLLM runs it). Through a real
server: the choice in ``/admin/stats``, an ``auto`` request served or refused by it, and
Phi-4-mini's and Gemma 3's calls read out of the text for the official ``openai`` client."""

from __future__ import annotations

import json
import re

import openai
import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from pagedserve.server.config import ServingConfig
from pagedserve.server.tools.parser_choice import detect_tool_parser
from pagedserve.server.tools.template import tool_template
from tests.conftest import hf_tokenizer, serve, stats
from tests.server.family_templates import (
    FAMILIES,
    GEMMA3_PYTHONIC,
    LLAMA3,
    MISTRAL_V03,
    PHI4_MINI,
)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CALL = [{"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "abcDEF123", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "abcDEF123", "content": '{"celsius": 21}'}]


def family_tokenizer(template: str, special: list[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose vocabulary holds the family's special tokens."""
    vocab = {"<unk>": 0, **{t: i + 1 for i, t in enumerate(special)}}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
        unk_token="<unk>", bos_token=special[0], eos_token=special[1])
    tok.chat_template = template
    return tok


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_gets_its_parser_from_its_template(family):
    template, special, parser, call_format = FAMILIES[family]
    tok = family_tokenizer(template, special)
    with_tools = tool_template(tok, None)  # what a conversation with tools renders with
    found = detect_tool_parser(tok, with_tools)
    assert (found[0] if found else None) == parser, family
    if parser is not None:
        assert found[1] == "chat template"  # the call format, not the vocabulary, decided
    if call_format is not None:  # the template writes calls in the format the parser reads
        text = tok.apply_chat_template(CALL, tools=TOOLS, tokenize=False,
                                       chat_template=with_tools)
        assert call_format in text and "get_weather" in text


def test_the_vocabulary_decides_when_the_template_names_no_format():
    # A Llama 3 model whose template (a plain one) writes no call: its header tokens decide.
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
    tok = family_tokenizer(plain, FAMILIES["llama3.x"][1])
    assert detect_tool_parser(tok, None) == ("llama3_json", "vocabulary")


@pytest.mark.parametrize(("template", "parser"), [(LLAMA3, "llama3_json"),
                                                 (MISTRAL_V03, "mistral")])
async def test_the_server_serves_auto_with_the_chosen_parser(tiny_model_dir, template, parser):
    """``--chat-template`` of a family on SmolLM2's ChatML vocabulary: the template's call
    format decides, and ``auto`` (tools without ``tool_choice``) is served."""
    name = "tiny"
    async with serve(tiny_model_dir, name, max_model_len=512,
                     serving=ServingConfig(name, chat_template=template)) as client:
        serving = (await stats(client))["serving"]
        r = await client.post("/v1/chat/completions", json={
            "model": name, "messages": CALL[:1], "tools": TOOLS, "max_tokens": 4,
            "temperature": 0})
    assert (serving["tool_call_parser"], serving["tool_call_parser_source"]) == (
        parser, "chat template")
    assert serving["auto_tool_choice"] and r.status_code == 200, r.text


def test_a_family_with_no_format_refuses_auto_naming_the_flag():
    from pagedserve.server.tools.parser_choice import resolve_auto_tool_choice

    template, special, _, _ = FAMILIES["gemma2/gemma3"]
    tok = family_tokenizer(template, special)
    choice = resolve_auto_tool_choice(tok, tool_template(tok, None), None, False, False)
    assert (choice.parser, choice.enabled, choice.source) == (None, False, "none")
    assert "--tool-call-parser" in choice.refusal
    forced = resolve_auto_tool_choice(tok, None, "pythonic", False, False)  # the override
    assert (forced.parser, forced.enabled) == ("pythonic", True)


def _openai(http) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(http.base_url).rstrip("/") + "/v1", api_key="unused",
                              max_retries=0)


async def _forced_auto_call(client: openai.AsyncOpenAI, regex: str) -> tuple:
    """An ``auto`` request whose output a regex makes the random model write (the format's
    call), whole and streamed: (the whole choice, the streamed final message, prompt ids)."""
    args = dict(model="tiny", messages=CALL[:1], tools=TOOLS, max_tokens=64,
                extra_body={"guided_regex": regex, "return_token_ids": True})
    r = await client.chat.completions.create(**args)
    async with client.chat.completions.stream(**args) as stream:
        final = await stream.get_final_completion()
    return r.choices[0], final.choices[0].message, r.model_extra["prompt_token_ids"]


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


async def test_phi4_mini_calls_reach_the_openai_client(tmp_path, tiny_model_dir):
    """A model whose tokenizer has Phi-4-mini's template, no flag: pagedserve renders the
    request's tools with ``PHI4_MINI_TOOLS``, picks ``phi4_mini_json``, and a ``functools[...]``
    answer reaches the client as its calls, whole and streamed; the call and its result go
    back into the next prompt in that format."""
    for f in tiny_model_dir.iterdir():  # the tiny model, with Phi-4-mini's template
        if not f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (tmp_path / f.name).symlink_to(f)
    tok = hf_tokenizer(str(tiny_model_dir))
    tok.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(PHI4_MINI)
    call = 'functools[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    async with serve(tmp_path, "tiny", max_model_len=1024) as http:
        serving = (await stats(http))["serving"]
        whole, streamed, prompt_ids = await _forced_auto_call(
            _openai(http), "Sure\\. " + re.escape(call))
        r = await http.post("/v1/chat/completions", json={
            "messages": CALL, "tools": TOOLS, "max_tokens": 2, "return_token_ids": True})
    assert (serving["tool_call_parser"], serving["tool_call_parser_source"]) == (
        "phi4_mini_json", "chat template")
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Sure."
    assert _calls(whole.message) == _calls(streamed) == [("get_weather", {"city": "Paris"})]
    prompt = tok.decode(prompt_ids)
    assert prompt.startswith("<|system|>") and '"name": "get_weather"' in prompt
    assert prompt.endswith("<|user|>Weather in Paris?<|end|><|assistant|>")
    history = tok.decode(r.json()["prompt_token_ids"])
    assert f"<|assistant|>{call}<|end|><|tool|>{{\"celsius\": 21}}<|end|>" in history


async def test_gemma3_calls_with_the_pythonic_parser(tiny_model_dir):
    """Gemma 3 as vLLM serves its tools: ``--tool-call-parser pythonic`` and a template that
    asks for a Python list of calls; ``[get_weather(city="Paris")]`` reaches the client."""
    serving = ServingConfig("tiny", chat_template=GEMMA3_PYTHONIC, tool_call_parser="pythonic")
    async with serve(tiny_model_dir, "tiny", max_model_len=1024, serving=serving) as http:
        chosen = (await stats(http))["serving"]
        whole, streamed, prompt_ids = await _forced_auto_call(
            _openai(http), re.escape('[get_weather(city="Paris")]'))
    assert (chosen["tool_call_parser"], chosen["auto_tool_choice"]) == ("pythonic", True)
    assert whole.finish_reason == "tool_calls" and not whole.message.content
    assert _calls(whole.message) == _calls(streamed) == [("get_weather", {"city": "Paris"})]
    prompt = hf_tokenizer(str(tiny_model_dir)).decode(prompt_ids)
    assert "python list of the calls" in prompt and '"name": "get_weather"' in prompt
