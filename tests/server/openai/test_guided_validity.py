"""Guided decoding on the default model (SmolLM2-135M-Instruct) sampled at temperature 1.0:
every output parses and validates, whatever the sample.

All cases are sampled in one batch (a module fixture), as separate concurrent requests each with
its own seed, so a failure reproduces; the tests then check each case. JSON schemas are sent
with ``disable_any_whitespace`` to keep outputs short (free whitespace is exercised by the
``json_object`` case, through ``response_format``).
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
import pytest_asyncio
import xgrammar as xgr

from tests.conftest import hf_tokenizer, serve

NAME = "smol"
SAMPLES = 20
MAX_TOKENS = 160
PROMPT = "Reply with a short example that fits the requested format."
JSON_PROMPT = "Reply with a short JSON object describing a person."

SCHEMAS = {
    "nested_objects_and_pattern": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                },
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    "array_bounds_and_enum": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                     "minItems": 1, "maxItems": 3},
            "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
        },
        "required": ["tags", "size"],
    },
    "any_of": {
        "type": "object",
        "properties": {
            "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                {"type": "boolean"}, {"type": "null"}]},
            "label": {"anyOf": [{"type": "string", "maxLength": 6},
                                {"type": "integer", "minimum": -5, "maximum": 5}]},
        },
        "required": ["value", "label"],
    },
    "ref_into_defs": {
        "$defs": {"point": {"type": "object",
                            "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                           "y": {"type": "integer", "minimum": -9, "maximum": 9}},
                            "required": ["x", "y"]}},
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
    },
    "integer_ranges_required_optional": {
        "type": "object",
        "properties": {
            "count": {"type": "integer", "minimum": 1, "maximum": 100},
            "offset": {"type": "integer", "exclusiveMinimum": -10, "exclusiveMaximum": 10},
            "note": {"type": "string", "maxLength": 8},
            "active": {"type": "boolean"},
        },
        "required": ["count", "offset"],
    },
    "string_pattern_array": {
        "type": "array",
        "items": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
        "minItems": 2,
        "maxItems": 4,
    },
}


GRAMMAR = r"""
root ::= pair | pair "," pair | pair "," pair "," pair
pair ::= key "=" value
key ::= [a-z] | [a-z] [a-z] | [a-z] [a-z] [a-z]
value ::= [0-9] | [1-9] [0-9]
"""
GRAMMAR_RE = r"[a-z]{1,3}=([0-9]|[1-9][0-9])(,[a-z]{1,3}=([0-9]|[1-9][0-9])){0,2}"


REGEX = r"[a-z]{3,8}@[a-z]{3,8}\.(com|org|net)"
CHOICES = ["yes", "no", "maybe later", "ça dépend"]
GUIDES = {
    **{name: {"structured_outputs": {"json": schema, "disable_any_whitespace": True}}
       for name, schema in SCHEMAS.items()},
    # As with OpenAI's JSON mode, the prompt asks for JSON: the grammar guarantees the syntax,
    # not that the model wants to stop writing a string.
    "json_object": {"response_format": {"type": "json_object"},
                    "messages": [{"role": "user", "content": JSON_PROMPT}]},
    "regex": {"structured_outputs": {"regex": REGEX}},
    "choice": {"guided_choice": CHOICES},
    "grammar": {"structured_outputs": {"grammar": GRAMMAR}},
}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def samples(default_model_dir) -> dict[str, list[dict]]:
    """``SAMPLES`` choices per case, all sampled concurrently at temperature 1.0."""
    async with serve(default_model_dir, NAME, max_model_len=512, num_blocks=2400,
                     max_num_seqs=256, max_num_batched_tokens=2048) as client:

        async def one(guide: dict, seed: int) -> dict:
            r = await client.post("/v1/chat/completions", json={
                "model": NAME, "messages": [{"role": "user", "content": PROMPT}],
                "temperature": 1.0, "seed": seed, "max_tokens": MAX_TOKENS,
                "return_token_ids": True, **guide}, timeout=900)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        cases = [(name, seed) for name in GUIDES for seed in range(SAMPLES)]
        results = await asyncio.gather(*(one(GUIDES[name], seed) for name, seed in cases))
    out: dict[str, list[dict]] = {name: [] for name in GUIDES}
    for (name, _), choice in zip(cases, results):
        out[name].append(choice)
    return out


def texts(choices: list[dict]) -> list[str]:
    return [c["message"]["content"] for c in choices]


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_samples_validate(samples, name):
    for c in samples[name]:
        assert c["finish_reason"] == "stop", c["message"]["content"]
        jsonschema.validate(json.loads(c["message"]["content"]), SCHEMAS[name])
    assert len(set(texts(samples[name]))) > 1  # temperature 1.0 really sampled


def test_json_object_parses_and_ends_at_the_closing_brace(samples, default_model_dir):
    """Every finished sample is one JSON object ending at its closing brace; a free-form object
    may also be cut by max_tokens (``length``), and is then a valid prefix of one."""
    tok = hf_tokenizer(str(default_model_dir))
    end_of_turn = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=49152, stop_token_ids=end_of_turn)
    compiled = xgr.GrammarCompiler(info).compile_builtin_json_grammar()
    stopped = 0
    for c in samples["json_object"]:
        text = c["message"]["content"]
        if c["finish_reason"] == "length":
            assert len(c["token_ids"]) == MAX_TOKENS and text.lstrip().startswith("{")
            matcher = xgr.GrammarMatcher(compiled)
            assert all(matcher.accept_token(t) for t in c["token_ids"]), text
            continue
        assert c["finish_reason"] == "stop"
        stopped += 1
        assert isinstance(json.loads(text), dict)
        # No whitespace is allowed after the root object: the model ends its turn right after
        # the closing brace instead of padding until max_tokens.
        assert text.endswith("}") and c["token_ids"][-1] in end_of_turn, text
    # A 135M model at temperature 1.0 often writes objects longer than max_tokens (8 of 20
    # stopped when this was written); the finished ones must end right at the brace.
    assert stopped >= SAMPLES // 4


def test_regex_samples_fullmatch(samples):
    for c in samples["regex"]:
        assert c["finish_reason"] == "stop"
        assert re.fullmatch(REGEX, c["message"]["content"]), c["message"]["content"]
    assert len(set(texts(samples["regex"]))) > 1


def test_choice_samples_are_one_of_the_choices(samples):
    assert all(t in CHOICES for t in texts(samples["choice"])), texts(samples["choice"])
    assert len(set(texts(samples["choice"]))) > 1


def test_grammar_samples_are_accepted(samples, default_model_dir):
    tok = hf_tokenizer(str(default_model_dir))
    end_of_turn = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=49152, stop_token_ids=end_of_turn)
    compiled = xgr.GrammarCompiler(info).compile_grammar(GRAMMAR)
    for c in samples["grammar"]:
        assert c["finish_reason"] == "stop"
        assert re.fullmatch(GRAMMAR_RE, c["message"]["content"]), c["message"]["content"]
        # an independent matcher accepts the exact token sequence, ending with the stop token
        matcher = xgr.GrammarMatcher(compiled)
        assert all(matcher.accept_token(t) for t in c["token_ids"]), c["token_ids"]
        assert matcher.is_terminated() and c["token_ids"][-1] in end_of_turn
