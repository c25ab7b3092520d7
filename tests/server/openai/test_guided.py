"""Guided decoding through a real server on the tiny random Llama (greedy): how guided requests
live with the rest of the engine — batchmates, streaming, max_tokens, preemption, errors — and
the compile timeout (``WAITING_FOR_GRAMMAR``:
``tests/actors/structured_output/test_structured_output.py``)."""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest
import pytest_asyncio

from tests.conftest import chat, chat_prompt_ids, hf_greedy, serve, stats, stream_chat

WORD = r"[a-z]{4,12}"
INTS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
        "minItems": 20, "maxItems": 20}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"]}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def client(tiny_model_dir):
    async with serve(tiny_model_dir) as c:
        yield c


async def test_unguided_batchmates_are_unaffected(client, tiny_model_dir):
    prompts = ["Hi", "What is the capital of France?", "List three colours."]
    refs = [hf_greedy(tiny_model_dir, chat_prompt_ids(tiny_model_dir, p), 20) for p in prompts]
    guided, *plain = await asyncio.gather(
        chat(client, prompts[0], max_tokens=20, guided_regex=WORD),
        *(chat(client, p, max_tokens=20, ignore_eos=True) for p in prompts),
    )
    for body, want in zip(plain, refs):
        assert body["choices"][0]["token_ids"] == want
    text = guided["choices"][0]["message"]["content"]
    assert re.fullmatch(WORD, text), text
    assert guided["choices"][0]["finish_reason"] == "stop"
    assert guided["choices"][0]["token_ids"] != refs[0]  # the mask really applied


async def test_stream_equals_non_stream_and_max_tokens_cuts_with_length(client):
    guide = {"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}}
    full = (await chat(client, "Who?", max_tokens=64, **guide))["choices"][0]
    person = json.loads(full["message"]["content"])
    assert set(person) == {"name", "age"} and 0 <= person["age"] <= 120
    assert full["finish_reason"] == "stop"
    text, tokens, chunks = await stream_chat(client, "Who?", max_tokens=64, **guide)
    assert text == full["message"]["content"] and tokens == full["token_ids"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    n = len(full["token_ids"]) // 2
    cut = (await chat(client, "Who?", max_tokens=n, **guide))["choices"][0]
    assert cut["finish_reason"] == "length"
    assert cut["token_ids"] == full["token_ids"][:n]


async def test_completions_endpoint_and_response_format(client):
    r = await client.post("/v1/completions", json={
        "prompt": "Answer:", "max_tokens": 64, "temperature": 0,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "p", "schema": PERSON, "strict": True}}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert set(json.loads(choice["text"])) == {"name", "age"}
    for guide in ({"guided_choice": ["alpha", "beta"]},
                  {"structured_outputs": {"choice": ["alpha", "beta"]}}):
        body = await chat(client, "Pick", max_tokens=8, **guide)
        assert body["choices"][0]["message"]["content"] in ("alpha", "beta")


async def test_stop_string_still_applies(client):
    full = (await chat(client, "Go", max_tokens=40, guided_regex="[a-z]{20,30}"))["choices"][0]
    text = full["message"]["content"]
    stop = text[6:8]
    cut = (await chat(client, "Go", max_tokens=40, guided_regex="[a-z]{20,30}",
                      stop=[stop]))["choices"][0]
    assert cut["message"]["content"] == text[: text.index(stop)]
    assert cut["finish_reason"] == "stop"


BAD = [
    ({"guided_json": {"type": "objekt"}}, "guided_json", 'Unsupported type "objekt"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}},
     "response_format", "unsupported JSON schema keyword 'uniqueItems' at #"),
    ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {
        "if": {"type": "integer"}}}}}},
     "structured_outputs", "unsupported JSON schema keyword 'if' at #/properties/a"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "Unclosed '['"),
    ({"guided_regex": "(ab"}, "guided_regex", "parenthesis is not closed"),
    ({"guided_grammar": "root ::= "}, "guided_grammar", "EBNF parser error"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": {"$ref": "#/$defs/missing"}}, "guided_json", "$defs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "exactly one of"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex",
     "only one structured-output constraint"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "schema is required"),
]


@pytest.mark.parametrize("guide,param,reason", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
async def test_bad_constraint_is_400_with_the_reason(client, guide, param, reason):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                       ("/v1/completions", {"prompt": "x"})):
        for stream in (False, True):
            r = await client.post(path, json={**body, **guide, "stream": stream, "max_tokens": 4})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == param and reason in err["message"], err
    ok = await chat(client, "still serving?", max_tokens=8, guided_regex="[a-z]{3}")
    assert re.fullmatch("[a-z]{3}", ok["choices"][0]["message"]["content"])


async def test_preemption_keeps_guided_outputs(tiny_model_dir):
    prompts = [f"Request {i}: numbers please" for i in range(5)]
    guide = {"structured_outputs": {"json": INTS, "disable_any_whitespace": True}}
    # 12 blocks of 16 tokens: a request needs ~7 at the end, so five at once must preempt.
    async with serve(tiny_model_dir, num_blocks=12, max_model_len=160) as client:
        alone = [(await chat(client, p, max_tokens=100, **guide))["choices"][0]["token_ids"]
                 for p in prompts]
        assert (await stats(client))["scheduler"]["num_preempted_total"] == 0
        results = await asyncio.gather(
            *(stream_chat(client, p, max_tokens=100, **guide) for p in prompts))
        s = await stats(client)
    assert s["scheduler"]["num_preempted_total"] > 0
    assert s["kv_cache"]["num_free_blocks"] == 12
    for (text, tokens, chunks), want in zip(results, alone):
        assert tokens == want
        values = json.loads(text)
        assert len(values) == 20 and all(0 <= v <= 99 for v in values)
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_compile_timeout_is_400_and_the_compile_finishes_later(tiny_model_dir):
    schema = {"type": "object", "properties": {
        f"field_{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}[0-9]+$"}
        for i in range(60)}}
    async with serve(tiny_model_dir, compile_timeout_s=0.001) as client:
        # The tokenizer info is built and a trivial grammar compiled: even that compile may
        # outlast 1 ms on a loaded machine, so wait for the state (cached), not for a time.
        await _until_ok(client, {"messages": [{"role": "user", "content": "warm"}],
                                 "max_tokens": 2, "guided_regex": "a"})
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
                "guided_json": schema}
        r = await client.post("/v1/chat/completions", json=body)  # 60 patterns: ≫ 1 ms always
        assert r.status_code == 400, r.text
        assert "took longer than 0.001s" in r.json()["error"]["message"]
        assert (await chat(client, "still serving?", max_tokens=3))["choices"][0]["message"]
        # The compile kept running and was cached: a retry succeeds once it ends.
        await _until_ok(client, body)


async def _until_ok(client, body: dict) -> None:
    """Post ``body`` until it answers 200 (its grammar compiled and cached); only a 400 for
    the compile timeout may come before. 120 s catches a hung compile, not a slow machine."""
    deadline = time.monotonic() + 120
    while (r := await client.post("/v1/chat/completions", json=body)).status_code != 200:
        assert r.status_code == 400 and "took longer" in r.text, r.text
        assert time.monotonic() < deadline, r.text
        await asyncio.sleep(0.05)


async def test_n_choices_each_follow_the_grammar(client):
    body = await chat(client, "Pick", n=3, temperature=1.0, seed=3, max_tokens=20,
                      guided_regex=WORD)
    texts = [c["message"]["content"] for c in body["choices"]]
    assert len(texts) == 3 and all(re.fullmatch(WORD, t) for t in texts), texts
    assert all(c["finish_reason"] == "stop" for c in body["choices"])
