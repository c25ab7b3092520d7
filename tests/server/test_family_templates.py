"""The tool-call parser each family gets out of the box (no ``--tool-call-parser``), read off
its chat template and vocabulary (``tests/server/family_templates.py``: templates modelled on
the real ones): Qwen2.5 / Qwen3 / Hermes → ``hermes``, Llama 3.x → ``llama3_json``, Mistral
v0.3 → ``mistral``; Gemma 2/3, Phi-3.5, Phi-4-mini and Mistral v0.1 name no format pagedserve
reads, so ``auto`` needs the flag. Through a real server: the choice in ``/admin/stats`` and
an ``auto`` request served or refused by it."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from pagedserve.server.config import ServingConfig
from pagedserve.server.tool_parser_choice import detect_tool_parser
from pagedserve.server.tool_template import tool_template
from tests.conftest import serve, stats
from tests.server.family_templates import FAMILIES, LLAMA3, MISTRAL_V03

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
    from pagedserve.server.tool_parser_choice import resolve_auto_tool_choice

    template, special, _, _ = FAMILIES["gemma2/gemma3"]
    tok = family_tokenizer(template, special)
    choice = resolve_auto_tool_choice(tok, tool_template(tok, None), None, False, False)
    assert (choice.parser, choice.enabled, choice.source) == (None, False, "none")
    assert "--tool-call-parser" in choice.refusal
    forced = resolve_auto_tool_choice(tok, None, "pythonic", False, False)  # the override
    assert (forced.parser, forced.enabled) == ("pythonic", True)
