"""vLLM's request fields through a real server (tiny model, chunked prefill of 16 tokens) and
the official ``openai`` client: prompt logprobs against transformers in float32 (chunked, and
for a prompt whose blocks the prefix cache holds), batched prompts, echo, token-id tokens,
``logprob_token_ids``, truncation, the response shapes and ``cached_tokens``."""

from __future__ import annotations

import json

import openai
import pytest
import pytest_asyncio
import torch

from pagedserve.server.config import ServingConfig
from tests.conftest import TINY_NAME, _hf_model, hf_greedy, hf_tokenizer, serve

LONG = "The quick brown fox jumps over the lazy dog while " + " ".join(
    f"word{i}" for i in range(30))


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def client(tiny_model_dir):
    # 16-token steps: every prompt here is prefilled in several chunks.
    serving = ServingConfig(TINY_NAME, enable_prompt_tokens_details=True)
    async with serve(tiny_model_dir, max_model_len=256, max_num_batched_tokens=16,
                     serving=serving) as c:
        yield c


@pytest.fixture(scope="module")
def oai(client):
    return openai.AsyncOpenAI(base_url=f"{str(client.base_url).rstrip('/')}/v1", api_key="unused")


def hf_prompt_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    """``[P - 1, V]``: row ``j`` is the log-distribution of token ``j + 1`` (float32)."""
    with torch.no_grad():
        logits = _hf_model(str(model_dir))(torch.tensor([ids])).logits[0].float()
    return logits[:-1].log_softmax(-1)


def check_prompt_logprobs(got: list, ids: list[int], want: torch.Tensor, k: int,
                          tol: float = 1e-4) -> None:
    assert got[0] is None and len(got) == len(ids)
    for j, entry in enumerate(got[1:]):
        row, token = want[j], ids[j + 1]
        own = entry[str(token)]
        assert own["logprob"] == pytest.approx(float(row[token]), abs=tol)
        # A random model's tail is flat: the rank is exact up to float noise there.
        v = row[token]
        assert int((row > v + tol).sum()) < own["rank"] <= int((row > v - tol).sum()) + 1
        top = row.topk(k)
        for rank, (i, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
            assert entry[str(i)]["logprob"] == pytest.approx(v, abs=tol)
            assert entry[str(i)]["rank"] == rank
        assert len(entry) == k + (str(token) not in {str(i) for i in top.indices.tolist()})


async def completion(client, **body) -> dict:
    body.setdefault("temperature", 0)
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def test_prompt_logprobs_match_transformers_chunked_and_cached(client, tiny_model_dir):
    ids = hf_tokenizer(str(tiny_model_dir)).encode(LONG)
    assert len(ids) > 3 * 16  # several prefill chunks
    want = hf_prompt_logprobs(tiny_model_dir, ids)
    first = await completion(client, prompt=ids, max_tokens=3, prompt_logprobs=4,
                             ignore_eos=True, return_token_ids=True)
    check_prompt_logprobs(first["choices"][0]["prompt_logprobs"], ids, want, 4)
    assert first["choices"][0]["token_ids"] == hf_greedy(tiny_model_dir, ids, 3)
    # Its blocks are cached now: a plain request hits them; one asking for prompt logprobs
    # recomputes the prompt (no hit) and gets the same values.
    plain = await completion(client, prompt=ids, max_tokens=1)
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] >= 3 * 16
    assert plain["choices"][0]["prompt_logprobs"] is None
    again = await completion(client, prompt=ids, max_tokens=3, prompt_logprobs=0,
                             ignore_eos=True)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    check_prompt_logprobs(again["choices"][0]["prompt_logprobs"], ids, want, 0)


async def test_chat_prompt_logprobs_and_errors(client, tiny_model_dir):
    msgs = [{"role": "user", "content": LONG}]
    r = await client.post("/v1/chat/completions", json={
        "messages": msgs, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2,
        "return_token_ids": True})
    body = r.json()
    ids = body["prompt_token_ids"]
    check_prompt_logprobs(body["prompt_logprobs"], ids, hf_prompt_logprobs(tiny_model_dir, ids),
                          2)
    for bad, words in [(-1, "greater than max allowed: 20"), (21, "max allowed: 20"),
                       (-2, "positive value or -1")]:
        r = await client.post("/v1/completions", json={"prompt": "hi", "prompt_logprobs": bad})
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "prompt_logprobs"
    r = await client.post("/v1/completions", json={"prompt": "hi", "prompt_logprobs": 1,
                                                    "stream": True})
    assert r.status_code == 400 and "stream" in r.json()["error"]["message"]


async def test_batched_prompts_with_openai_client(oai, tiny_model_dir):
    tok = hf_tokenizer(str(tiny_model_dir))
    texts = ["Once upon a time", "The weather today is"]
    r = await oai.completions.create(model="tiny-llama", prompt=texts, n=2, max_tokens=4,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        want = tok.decode(hf_greedy(tiny_model_dir, tok.encode(texts[c.index // 2]), 4))
        assert c.text == want
    assert r.usage.prompt_tokens == sum(len(tok.encode(t)) for t in texts)
    assert r.usage.completion_tokens == 16
    # Token-id prompts, streamed: each choice's text arrives under its own index.
    ids = [tok.encode(t) for t in texts]
    stream = await oai.completions.create(model="tiny-llama", prompt=ids, max_tokens=4,
                                          temperature=0, stream=True,
                                          stream_options={"include_usage": True},
                                          extra_body={"ignore_eos": True})
    got, usage = {0: "", 1: ""}, None
    async for chunk in stream:
        for c in chunk.choices:
            got[c.index] += c.text
        usage = chunk.usage or usage
    assert got == {i: tok.decode(hf_greedy(tiny_model_dir, ids[i], 4)) for i in (0, 1)}
    assert usage.completion_tokens == 8 and usage.prompt_tokens == sum(map(len, ids))


async def test_echo_with_logprobs_openai_client(oai, client, tiny_model_dir):
    tok = hf_tokenizer(str(tiny_model_dir))
    prompt = "Once upon a time there"
    ids = tok.encode(prompt)
    want = hf_prompt_logprobs(tiny_model_dir, ids)
    r = await oai.completions.create(model="tiny-llama", prompt=prompt, max_tokens=3,
                                     temperature=0, echo=True, logprobs=2,
                                     extra_body={"ignore_eos": True})
    c = r.choices[0]
    out = hf_greedy(tiny_model_dir, ids, 3)
    assert c.text == prompt + tok.decode(out)
    lp = c.logprobs
    assert lp.tokens == [tok.decode([t]) for t in ids + out]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for j in range(1, len(ids)):
        assert lp.token_logprobs[j] == pytest.approx(float(want[j - 1][ids[j]]), abs=1e-4)
        assert tok.decode([ids[j]]) in lp.top_logprobs[j]
        assert 2 <= len(lp.top_logprobs[j]) <= 3
    offsets = [0]
    for t in (ids + out)[:-1]:
        offsets.append(offsets[-1] + len(tok.decode([t])))
    assert lp.text_offset == offsets
    # Streamed: the first chunk carries the prompt and its logprobs.
    payload = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True,
               "logprobs": 1, "stream": True, "ignore_eos": True}
    chunks = []
    async with client.stream("POST", "/v1/completions", json=payload) as resp:
        chunks = [json.loads(ln[6:]) async for ln in resp.aiter_lines()
                  if ln.startswith("data: {")]
    text = "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"])
    assert text == c.text
    first = chunks[0]["choices"][0]["logprobs"]
    assert first["token_logprobs"][0] is None and len(first["tokens"]) >= len(ids)
    streamed = [v for ch in chunks for v in ch["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)


async def test_token_ids_as_tokens_logprobs_zero_and_chosen_ids(client, tiny_model_dir):
    ids = hf_tokenizer(str(tiny_model_dir)).encode("Tell me a story")
    body = await completion(client, prompt=ids, max_tokens=3, logprobs=0, ignore_eos=True,
                            return_tokens_as_token_ids=True, return_token_ids=True)
    c = body["choices"][0]
    out = c["token_ids"]
    lp = c["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in out]
    assert [list(d) for d in lp["top_logprobs"]] == [[f"token_id:{t}"] for t in out]
    assert [d[f"token_id:{t}"] for d, t in zip(lp["top_logprobs"], out)] == (
        lp["token_logprobs"])
    # logprob_token_ids: the alternatives are exactly those ids, with their true logprobs.
    chosen = [5, 17, 300]
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0,
        "logprobs": True, "logprob_token_ids": chosen, "return_tokens_as_token_ids": True,
        "return_token_ids": True, "ignore_eos": True})
    body = r.json()
    prompt = body["prompt_token_ids"]
    for pos, entry in enumerate(body["choices"][0]["logprobs"]["content"]):
        row = hf_prompt_logprobs(tiny_model_dir, prompt + body["choices"][0]["token_ids"])[
            len(prompt) - 1 + pos]
        assert [t["token"] for t in entry["top_logprobs"]] == [f"token_id:{i}" for i in chosen]
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(
            [float(row[i]) for i in chosen], abs=1e-4)
    for extra, param in [({"logprob_token_ids": [1]}, "logprob_token_ids"),
                         ({"logprob_token_ids": [10**6], "logprobs": 1}, "logprob_token_ids")]:
        r = await client.post("/v1/completions", json={"prompt": "hi", **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


async def test_truncate_prompt_tokens(client, tiny_model_dir):
    ids = hf_tokenizer(str(tiny_model_dir)).encode(LONG)
    for side, kept in [(None, ids[-7:]), ("left", ids[-7:]), ("right", ids[:7])]:
        extra = {"truncation_side": side} if side else {}
        body = await completion(client, prompt=LONG, max_tokens=3, truncate_prompt_tokens=7,
                                ignore_eos=True, return_token_ids=True, **extra)
        c = body["choices"][0]
        assert body["usage"]["prompt_tokens"] == 7 and c["prompt_token_ids"] == kept
        assert c["token_ids"] == hf_greedy(tiny_model_dir, kept, 3)
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": LONG}], "max_tokens": 1,
        "truncate_prompt_tokens": 5})
    assert r.json()["usage"]["prompt_tokens"] == 5
    r = await client.post("/v1/completions", json={"prompt": "hi",
                                                    "truncate_prompt_tokens": 10**4})
    assert r.status_code == 400 and "max_model_len (256)" in r.json()["error"]["message"]


async def test_response_shapes_and_chat_echo(client):
    body = await completion(client, prompt="hello", max_tokens=2)
    c = body["choices"][0]
    for key in ("token_ids", "prompt_token_ids", "prompt_logprobs", "logprobs"):
        assert key in c and c[key] is None
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    body = r.json()
    assert body["prompt_logprobs"] is None and body["prompt_token_ids"] is None
    assert body["choices"][0]["token_ids"] is None
    # Chat echo: the last assistant message prefixes the answer (whole and streamed).
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well, "}]
    payload = {"messages": msgs, "max_tokens": 3, "temperature": 0, "echo": True,
               "add_generation_prompt": False, "continue_final_message": True}
    whole = (await client.post("/v1/chat/completions", json=payload)).json()
    content = whole["choices"][0]["message"]["content"]
    assert content.startswith("Well, ") and len(content) > len("Well, ")
    async with client.stream("POST", "/v1/chat/completions",
                             json={**payload, "stream": True}) as resp:
        chunks = [json.loads(ln[6:]) async for ln in resp.aiter_lines()
                  if ln.startswith("data: {")]
    assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks) == content
    # continuous_usage_stats alone does nothing: usage needs include_usage.
    async with client.stream("POST", "/v1/chat/completions", json={
            "messages": msgs[:1], "max_tokens": 2, "stream": True,
            "stream_options": {"continuous_usage_stats": True}}) as resp:
        chunks = [json.loads(ln[6:]) async for ln in resp.aiter_lines()
                  if ln.startswith("data: {")]
    assert all("usage" not in ch for ch in chunks)


async def test_lax_booleans_any_role_and_vllms_messages(client, oai, tiny_model_dir):
    """vLLM's tests send ``"logprobs": "true"`` and custom roles; its seed and empty-prompt
    messages are what its tests match."""
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0,
        "logprobs": "true", "top_logprobs": 3, "stream": "false"})
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and all(len(e["top_logprobs"]) == 3 for e in content)
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "logprobs": "maybe"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
    # A custom role goes through the chat template as it is.
    msgs = [{"role": "narrator", "content": "Once upon a time"},
            {"role": "user", "content": "go on"}]
    r = await client.post("/v1/chat/completions", json={
        "messages": msgs, "max_tokens": 1, "return_token_ids": True})
    assert r.status_code == 200, r.text
    tok = hf_tokenizer(str(tiny_model_dir))
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert "narrator\nOnce upon a time" in text
    assert r.json()["prompt_token_ids"] == tok.encode(text, add_special_tokens=False)
    for seed, words in [(2**63, "less_than_equal"), (-(2**63) - 1, "greater_than_equal")]:
        with pytest.raises(openai.BadRequestError, match=words) as e:
            await oai.completions.create(model="tiny-llama", prompt="hi", max_tokens=1,
                                         seed=seed)
        assert e.value.body["param"] == "seed"
    ok = await oai.completions.create(model="tiny-llama", prompt="hi", max_tokens=1,
                                      seed=2**63 - 1)
    assert ok.choices[0].finish_reason == "length"
    for prompt in ("", []):
        with pytest.raises(openai.BadRequestError, match="Either prompt or prompt_embeds must "
                                                         "be provided and non-empty.") as e:
            await oai.completions.create(model="tiny-llama", prompt=prompt, max_tokens=1)
        assert e.value.status_code == 400 and e.value.body["param"] == "prompt"


async def test_whole_answers_carry_vllms_null_keys(client):
    msgs = [{"role": "user", "content": "hi"}]
    nulls = {"service_tier": None, "system_fingerprint": None}
    for path in ("/v1/chat/completions", "/invocations"):
        body = (await client.post(path, json={"messages": msgs, "max_tokens": 2})).json()
        assert {k: body[k] for k in nulls} == nulls, path
        message = body["choices"][0]["message"]
        assert {k: v for k, v in message.items() if k != "content"} == {
            "role": "assistant", "refusal": None, "annotations": None, "audio": None,
            "function_call": None, "tool_calls": []}, path
        assert isinstance(message["content"], str)
    for path in ("/v1/completions", "/invocations"):
        body = (await client.post(path, json={"prompt": "hi", "max_tokens": 2})).json()
        assert body["object"] == "text_completion"
        assert {k: body[k] for k in nulls} == nulls, path
    # A stream's chunks have none of them (vLLM leaves unset keys out of chunks).
    async with client.stream("POST", "/v1/chat/completions", json={
            "messages": msgs, "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}) as resp:
        chunks = [json.loads(ln[6:]) async for ln in resp.aiter_lines()
                  if ln.startswith("data: {")]
    assert not any("system_fingerprint" in ch for ch in chunks)
    # --enable-prompt-tokens-details is on here: the stream's usage has them too (the same
    # 31-token prompt ran above, so its first whole block is cached).
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}


async def test_prompt_tokens_details_only_with_the_flag(tiny_model_dir):
    msgs = [{"role": "user", "content": LONG}]
    async with serve(tiny_model_dir, max_model_len=256) as plain:
        for _ in range(2):  # the second would hit the cache: still no details
            body = (await plain.post("/v1/chat/completions", json={
                "messages": msgs, "max_tokens": 1})).json()
            assert body["usage"]["prompt_tokens_details"] is None
        async with plain.stream("POST", "/v1/chat/completions", json={
                "messages": msgs, "max_tokens": 1, "stream": True,
                "stream_options": {"include_usage": True}}) as resp:
            chunks = [json.loads(ln[6:]) async for ln in resp.aiter_lines()
                      if ln.startswith("data: {")]
        assert "prompt_tokens_details" not in chunks[-1]["usage"]
        assert chunks[-1]["usage"]["prompt_tokens"] == body["usage"]["prompt_tokens"]


async def test_max_logprobs_and_the_whole_vocabulary(client, tiny_model_dir):
    """vLLM's ``--max-logprobs``: 20 by default (above it, and -1 = the 49152-token vocabulary,
    are 400s in vLLM's words); ``-1`` lifts the cap, and -1 then gives every token."""
    msgs = [{"role": "user", "content": "hi"}]
    for path, body, param, asked in [
            ("/v1/chat/completions", {"messages": msgs, "logprobs": True, "top_logprobs": 21},
             "top_logprobs", 21),
            ("/v1/chat/completions", {"messages": msgs, "logprobs": True, "top_logprobs": -1},
             "top_logprobs", 49152),
            ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs", 21),
            ("/v1/completions", {"prompt": "hi", "logprobs": -1}, "logprobs", 49152)]:
        r = await client.post(path, json={**body, "max_tokens": 1})
        assert r.status_code == 400, r.text
        assert r.json()["error"] == {
            "message": f"Requested sample logprobs of {asked}, which is greater than max "
                       "allowed: 20", "type": "BadRequestError", "param": param, "code": 400}
    for path, body, param in [
            ("/v1/chat/completions", {"messages": msgs, "logprobs": True, "top_logprobs": -2},
             "top_logprobs"),
            ("/v1/completions", {"prompt": "hi", "logprobs": -2}, "logprobs")]:
        r = await client.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "positive value or -1" in r.json()["error"]["message"]
    ok = await client.post("/v1/chat/completions", json={
        "messages": msgs, "max_tokens": 1, "logprobs": True, "top_logprobs": 20})
    assert len(ok.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 20
    ids = hf_tokenizer(str(tiny_model_dir)).encode("Once upon a")
    serving = ServingConfig(TINY_NAME, max_logprobs=-1)
    async with serve(tiny_model_dir, max_model_len=256, serving=serving) as uncapped:
        r = await uncapped.post("/v1/chat/completions", json={
            "messages": msgs, "max_tokens": 1, "temperature": 0, "logprobs": True,
            "top_logprobs": -1})
        assert r.status_code == 200, r.text
        entry = r.json()["choices"][0]["logprobs"]["content"][0]
        tops = [t["logprob"] for t in entry["top_logprobs"]]
        assert len(tops) == 49152 and tops == sorted(tops, reverse=True)
        assert tops[0] == entry["logprob"]  # greedy: the chosen token is the top one
        r = await uncapped.post("/v1/completions", json={
            "prompt": ids, "max_tokens": 1, "prompt_logprobs": -1})
        got = r.json()["choices"][0]["prompt_logprobs"]
        assert got[0] is None and [len(e) for e in got[1:]] == [49152] * (len(ids) - 1)
        want = hf_prompt_logprobs(tiny_model_dir, ids)
        assert got[1][str(ids[1])]["logprob"] == pytest.approx(float(want[0][ids[1]]),
                                                                abs=1e-4)
