"""Guided decoding on the default model (SmolLM2-135M-Instruct) sampled at temperature 1.0:
every output parses and validates, whatever the sample.

Each case sends its samples as separate concurrent requests (one batch), each with its own
seed, so a failure reproduces.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import pytest
import pytest_asyncio
import xgrammar as xgr

from tests.conftest import hf_tokenizer, serve

NAME = "smol"
SAMPLES = 20
PROMPT = "Reply with a short example that fits the requested format."

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


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def client(default_model_dir):
    async with serve(default_model_dir, NAME, max_model_len=512, num_blocks=1800,
                     max_num_seqs=256, max_num_batched_tokens=2048) as c:
        yield c


async def sample(client: httpx.AsyncClient, n: int, max_tokens: int, **guide) -> list[dict]:
    """``n`` concurrent chat requests at temperature 1.0, seeds 0..n-1; their choices."""

    async def one(seed: int) -> dict:
        r = await client.post("/v1/chat/completions", json={
            "model": NAME, "messages": [{"role": "user", "content": PROMPT}],
            "temperature": 1.0, "seed": seed, "max_tokens": max_tokens,
            "return_token_ids": True, **guide})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    return list(await asyncio.gather(*(one(s) for s in range(n))))


async def test_json_schemas_always_validate(client):
    cases = [(name, schema, sample(client, SAMPLES, 96, response_format={
        "type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}))
        for name, schema in SCHEMAS.items()]
    results = await asyncio.gather(*(c for _, _, c in cases))
    for (name, schema, _), choices in zip(cases, results):
        for c in choices:
            text = c["message"]["content"]
            assert c["finish_reason"] == "stop", (name, text)
            jsonschema.validate(json.loads(text), schema)  # raises on any violation
        # temperature 1.0 really sampled: the outputs differ
        assert len({c["message"]["content"] for c in choices}) > 1, name


async def test_json_object_parses_and_ends_at_the_closing_brace(client, default_model_dir):
    tok = hf_tokenizer(str(default_model_dir))
    choices = await sample(client, SAMPLES, 160, response_format={"type": "json_object"})
    for c in choices:
        text = c["message"]["content"]
        assert c["finish_reason"] == "stop", text
        assert isinstance(json.loads(text), dict)
        # xgrammar's JSON grammar allows no whitespace after the root value: the model must end
        # its turn right after the closing brace instead of padding until max_tokens.
        assert text.endswith("}"), text
        assert c["token_ids"][-1] == tok.convert_tokens_to_ids("<|im_end|>")
        assert not tok.decode(c["token_ids"][-2:-1]).endswith((" ", "\n"))


async def test_regex_outputs_fullmatch(client):
    pattern = r"[a-z]{3,8}@[a-z]{3,8}\.(com|org|net)"
    choices = await sample(client, SAMPLES, 48,
                           structured_outputs={"regex": pattern})
    for c in choices:
        assert c["finish_reason"] == "stop"
        assert re.fullmatch(pattern, c["message"]["content"]), c["message"]["content"]
    assert len({c["message"]["content"] for c in choices}) > 1


async def test_choice_outputs_are_one_of_the_choices(client):
    options = ["yes", "no", "maybe later", "ça dépend"]
    legacy, current = await asyncio.gather(
        sample(client, SAMPLES // 2, 16, guided_choice=options),
        sample(client, SAMPLES // 2, 16, structured_outputs={"choice": options}))
    outputs = [c["message"]["content"] for c in legacy + current]
    assert all(o in options for o in outputs), outputs
    assert len(set(outputs)) > 1


GRAMMAR = r"""
root ::= pair | pair "," pair | pair "," pair "," pair
pair ::= key "=" value
key ::= [a-z] | [a-z] [a-z] | [a-z] [a-z] [a-z]
value ::= [0-9] | [1-9] [0-9]
"""
GRAMMAR_RE = r"[a-z]{1,3}=([0-9]|[1-9][0-9])(,[a-z]{1,3}=([0-9]|[1-9][0-9])){0,2}"


async def test_ebnf_grammar_outputs_are_accepted(client, default_model_dir):
    choices = await sample(client, SAMPLES, 32, structured_outputs={"grammar": GRAMMAR})
    tok = hf_tokenizer(str(default_model_dir))
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=49152,
                                              stop_token_ids=[tok.eos_token_id])
    compiled = xgr.GrammarCompiler(info).compile_grammar(GRAMMAR)
    for c in choices:
        assert c["finish_reason"] == "stop"
        assert re.fullmatch(GRAMMAR_RE, c["message"]["content"]), c["message"]["content"]
        # an independent matcher accepts the exact token sequence, ending with the stop token
        matcher = xgr.GrammarMatcher(compiled)
        assert all(matcher.accept_token(t) for t in c["token_ids"])
        assert matcher.is_terminated()
