"""The OpenAI protocol through HTTP on the tiny model: sampling fields against a transformers
oracle, n > 1, logprobs, usage, chat options, extra endpoints, limits and errors."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import pytest_asyncio
import torch

from pagedserve.server.openai.serving import ServingConfig
from tests.conftest import (
    _hf_model,
    chat,
    chat_prompt_ids,
    hf_greedy,
    hf_tokenizer,
    serve,
    stats,
    until_stats,
)

MSG = [{"role": "user", "content": "Tell me about the weather today."}]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def client(tiny_model_dir):
    async with serve(tiny_model_dir, max_model_len=256) as c:
        yield c


def hf_logits(model_dir, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return _hf_model(str(model_dir))(torch.tensor([ids])).logits[0, -1].float()


def penalized_greedy(model_dir, prompt: list[int], n: int, rep=1.0, freq=0.0, pres=0.0):
    """The oracle for penalties: vLLM's rules applied to transformers' logits."""
    out: list[int] = []
    for _ in range(n):
        logits = hf_logits(model_dir, prompt + out)
        seen = torch.tensor(sorted(set(prompt + out)))
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / rep, vals * rep)
        for t in set(out):
            logits[t] -= freq * out.count(t) + pres
        out.append(int(logits.argmax()))
    return out


async def post(client, path: str, **body) -> httpx.Response:
    return await client.post(path, json=body)


async def test_penalties_match_oracle(client, tiny_model_dir):
    prompt = chat_prompt_ids(tiny_model_dir, MSG[0]["content"])
    for kw, oracle in [
        ({"repetition_penalty": 1.5}, {"rep": 1.5}),
        ({"frequency_penalty": 1.5, "presence_penalty": 0.5}, {"freq": 1.5, "pres": 0.5}),
    ]:
        body = await chat(client, MSG[0]["content"], max_tokens=12, ignore_eos=True, **kw)
        assert body["choices"][0]["token_ids"] == penalized_greedy(tiny_model_dir, prompt, 12,
                                                                   **oracle)
    plain = hf_greedy(tiny_model_dir, prompt, 12)
    assert plain != penalized_greedy(tiny_model_dir, prompt, 12, rep=1.5)  # they do something


async def test_logit_bias_min_tokens_min_p_top_p(client, tiny_model_dir):
    forced = (await chat(client, "x", max_tokens=5, ignore_eos=True,
                         logit_bias={"1234": 100}))["choices"][0]["token_ids"]
    assert forced == [1234] * 5
    greedy = (await chat(client, "x", max_tokens=10, ignore_eos=True))["choices"][0]["token_ids"]
    first = greedy[0]
    stopped = await chat(client, "x", max_tokens=10, stop_token_ids=[first])
    assert stopped["choices"][0]["token_ids"] == [first]
    delayed = await chat(client, "x", max_tokens=10, stop_token_ids=[first], min_tokens=3)
    ids = delayed["choices"][0]["token_ids"]
    assert len(ids) >= 3 and first not in ids[:3]
    for kw in ({"min_p": 1.0}, {"top_p": 1e-6}):  # both leave only the top token
        hot = await chat(client, "x", max_tokens=10, ignore_eos=True, temperature=1.5, seed=3,
                         **kw)
        assert hot["choices"][0]["token_ids"] == greedy


async def test_include_stop_str_in_output(client):
    text = (await chat(client, "stop test", max_tokens=20, ignore_eos=True))["choices"][0][
        "message"]["content"]
    stop = text[6:9]
    kept = await chat(client, "stop test", max_tokens=20, ignore_eos=True, stop=stop,
                      include_stop_str_in_output=True)
    assert kept["choices"][0]["message"]["content"] == text[: text.index(stop) + len(stop)]


async def test_n_choices_share_prompt_blocks(client, tiny_model_dir):
    long = " ".join(f"fact{i}" for i in range(50))
    before = (await stats(client))["kv_cache"]["prefix_cache_hits"]
    body = await chat(client, long, n=3, temperature=1.0, seed=11, max_tokens=8,
                      ignore_eos=True)
    hits = (await stats(client))["kv_cache"]["prefix_cache_hits"] - before
    n_prompt = len(chat_prompt_ids(tiny_model_dir, long))
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert hits >= 2 * ((n_prompt - 1) // 16 * 16)  # choices 1 and 2 reuse choice 0's blocks
    usage = dict(body["usage"])
    assert usage.pop("prompt_tokens_details") is None  # without --enable-prompt-tokens-details
    assert usage == {"prompt_tokens": n_prompt, "completion_tokens": 24,
                     "total_tokens": n_prompt + 24}
    again = await chat(client, long, n=3, temperature=1.0, seed=11, max_tokens=8,
                       ignore_eos=True)
    ids = [c["token_ids"] for c in body["choices"]]
    assert ids == [c["token_ids"] for c in again["choices"]]  # seeded: reproducible
    assert len({tuple(x) for x in ids}) > 1  # each choice its own seed

    payload = {"messages": [{"role": "user", "content": long}], "n": 2, "stream": True,
               "max_tokens": 6, "ignore_eos": True, "temperature": 0}
    seen: dict[int, list] = {0: [], 1: []}
    async with client.stream("POST", "/v1/chat/completions", json=payload) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    seen[c["index"]].append(c)
    for i in (0, 1):
        assert seen[i][0]["delta"]["role"] == "assistant"
        assert seen[i][-1]["finish_reason"] == "length"


async def test_chat_logprobs_equal_log_softmax(client, tiny_model_dir):
    prompt = chat_prompt_ids(tiny_model_dir, "logprobs please")
    for temperature in (0.0, 0.5):
        body = await chat(client, "logprobs please", max_tokens=4, ignore_eos=True,
                          logprobs=True, top_logprobs=5, temperature=temperature, seed=1)
        choice = body["choices"][0]
        content = choice["logprobs"]["content"]
        ids = choice["token_ids"]
        assert len(content) == len(ids) == 4
        for pos, (tok, entry) in enumerate(zip(ids, content)):
            logits = hf_logits(tiny_model_dir, prompt + ids[:pos])
            if temperature:
                logits = logits / temperature
            want = torch.log_softmax(logits, -1)
            assert entry["logprob"] == pytest.approx(float(want[tok]), abs=1e-4)
            top = [t["logprob"] for t in entry["top_logprobs"]]
            assert len(top) == 5 and top == sorted(top, reverse=True)
            assert top == pytest.approx(want.topk(5).values.tolist(), abs=1e-4)
            if temperature == 0:
                assert entry["top_logprobs"][0]["token"] == entry["token"]


async def test_completion_logprobs_echo_and_token_prompt(client, tiny_model_dir):
    r = await post(client, "/v1/completions", prompt="Once upon", max_tokens=3, logprobs=2,
                   temperature=0, echo=True, ignore_eos=True)
    c = r.json()["choices"][0]
    assert c["text"].startswith("Once upon")
    lp = c["logprobs"]  # echo: the prompt's tokens first, the first one without a logprob
    n_prompt = len(hf_tokenizer(str(tiny_model_dir)).encode("Once upon"))
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == (
        n_prompt + 3)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert "".join(lp["tokens"]) == c["text"] and lp["text_offset"][0] == 0
    assert all(1 <= len(t) <= 3 for t in lp["top_logprobs"][1:])  # the token's own + top 2
    ids = [49, 50, 51, 52]
    by_ids = await post(client, "/v1/completions", prompt=ids, max_tokens=5, temperature=0,
                        return_token_ids=True)
    assert by_ids.json()["choices"][0]["token_ids"] == hf_greedy(tiny_model_dir, ids, 5)
    bad = await post(client, "/v1/completions", prompt=[10**9], max_tokens=2)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"


async def test_stream_options_usage(client):
    payload = {"messages": MSG, "stream": True, "max_tokens": 5, "ignore_eos": True,
               "temperature": 0, "stream_options": {"include_usage": True}}
    chunks = []
    async with client.stream("POST", "/v1/chat/completions", json=payload) as r:
        chunks = [json.loads(ln[6:]) async for ln in r.aiter_lines() if ln.startswith("data: {")]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert all(c["usage"] is None for c in chunks[:-1])
    payload["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    async with client.stream("POST", "/v1/chat/completions", json=payload) as r:
        chunks = [json.loads(ln[6:]) async for ln in r.aiter_lines() if ln.startswith("data: {")]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 5 and all(c["usage"] for c in chunks)
    r = await post(client, "/v1/chat/completions", messages=MSG,
                   stream_options={"include_usage": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


async def test_chat_message_forms(client, tiny_model_dir):
    as_str = await chat(client, "Hello there friend", max_tokens=6)
    parts = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello there"},
                                                   {"type": "text", "text": " friend"}]}],
        "max_tokens": 6, "temperature": 0, "return_token_ids": True})
    assert parts.json()["choices"][0]["token_ids"] == as_str["choices"][0]["token_ids"]
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello! The"}]
    r = await post(client, "/v1/chat/completions", messages=conv, max_tokens=4,
                   temperature=0, continue_final_message=True, add_generation_prompt=False,
                   return_token_ids=True)
    prompt = r.json()["prompt_token_ids"]
    from tests.conftest import hf_tokenizer

    tok = hf_tokenizer(str(tiny_model_dir))
    assert tok.decode(prompt).endswith("Hello! The")  # no end-of-turn after the last message
    r = await post(client, "/v1/chat/completions", messages=conv[:2], max_tokens=2,
                   add_generation_prompt=False, return_token_ids=True)
    assert not tok.decode(r.json()["prompt_token_ids"]).endswith("assistant\n")
    r = await post(client, "/v1/chat/completions", messages=conv[:2], max_tokens=2,
                   continue_final_message=True, add_generation_prompt=False)
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


async def test_request_id_header_and_extra_endpoints(client, tiny_model_dir):
    r = await client.post("/v1/chat/completions", headers={"X-Request-Id": "my-req-42"},
                          json={"messages": MSG, "max_tokens": 2})
    assert r.headers["x-request-id"] == "my-req-42" and r.json()["id"] == "my-req-42"
    tok = (await post(client, "/tokenize", prompt="Hello world")).json()
    from tests.conftest import hf_tokenizer

    assert tok["tokens"] == hf_tokenizer(str(tiny_model_dir)).encode("Hello world")
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 256
    chat_tok = (await post(client, "/tokenize", messages=MSG)).json()
    assert chat_tok["tokens"] == chat_prompt_ids(tiny_model_dir, MSG[0]["content"])
    assert (await post(client, "/detokenize", tokens=tok["tokens"])).json() == {
        "prompt": "Hello world"}
    assert (await client.get("/version")).json()["version"]
    assert (await client.get("/v1/models/tiny-llama")).json()["id"] == "tiny-llama"
    missing = await client.get("/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


async def test_every_served_name_is_listed_and_accepted_the_first_reported(tiny_model_dir):
    """``--served-model-name tiny-llama org/tiny``, through the openai client: both listed,
    both accepted as ``model`` (chat, completions, responses), answers report the first, an
    unknown name is a 404 naming both."""
    import openai

    serving = ServingConfig(("tiny-llama", "org/tiny"))
    async with serve(tiny_model_dir, serving=serving) as client:
        oai = openai.AsyncOpenAI(base_url=f"{str(client.base_url).rstrip('/')}/v1",
                                 api_key="unused")
        assert [m.id for m in (await oai.models.list()).data] == ["tiny-llama", "org/tiny"]
        assert (await oai.models.retrieve("org/tiny")).id == "org/tiny"
        msgs = [{"role": "user", "content": "Hi"}]
        for name in ("tiny-llama", "org/tiny"):
            chat_ = await oai.chat.completions.create(model=name, messages=msgs, max_tokens=2)
            text = await oai.completions.create(model=name, prompt="Hi", max_tokens=2)
            resp = await oai.responses.create(model=name, input="Hi", max_output_tokens=2)
            assert chat_.model == text.model == resp.model == "tiny-llama"
        with pytest.raises(openai.NotFoundError) as e:
            await oai.chat.completions.create(model="tiny", messages=msgs, max_tokens=2)
        assert e.value.body["param"] == "model"
        assert "`tiny-llama`, `org/tiny`" in e.value.body["message"]


@pytest.mark.parametrize("field,value", [
    ("temperature", "hot"), ("temperature", -0.1), ("top_p", 0), ("top_p", 1.5),
    ("top_k", -2), ("min_p", 1.5), ("presence_penalty", 2.5), ("frequency_penalty", -3),
    ("repetition_penalty", 0), ("max_tokens", 1.5), ("n", 0), ("seed", "x"),
    ("logit_bias", {"abc": 1}), ("logit_bias", {"5": 101}), ("logit_bias", {"999999": 1}),
    ("min_tokens", -1), ("stop", 5), ("stop_token_ids", ["a"]), ("top_logprobs", 21),
    ("messages", "hi"), ("stream", [1]), ("cache_salt", 3), ("min_tokens", 300),
])
async def test_every_bad_field_is_a_400_naming_it(client, field, value):
    r = await post(client, "/v1/chat/completions", **{"messages": MSG, "logprobs": True,
                                                      field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


async def test_size_and_content_type_limits(tiny_model_dir):
    async with serve(tiny_model_dir, app_kwargs={"max_request_body_bytes": 2000}) as client:
        big = {"messages": [{"role": "user", "content": "x" * 5000}]}
        r = await client.post("/v1/chat/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == 413

        async def chunked():  # no Content-Length: refused once the limit is passed
            for _ in range(10):
                yield b" " * 500

        try:
            r = await client.post("/v1/chat/completions", content=chunked(),
                                  headers={"content-type": "application/json"})
            assert r.status_code == 413
        except (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError):
            pass  # the server answered 413 and closed while the client was still sending
        r = await client.post("/v1/chat/completions", content=b"messages=hi",
                              headers={"content-type": "application/x-www-form-urlencoded"})
        assert r.status_code == 415
        # Rendered like every other error (Starlette's compact JSON).
        bad_model = await client.post("/v1/chat/completions", json={**{"messages": MSG},
                                                                   "model": "nope"})
        assert r.content.startswith(b'{"error":{"message":') and bad_model.content.startswith(
            b'{"error":{"message":')
        assert (await chat(client, "fine", max_tokens=2))["choices"]


async def test_overload_gets_503_with_retry_after(tiny_model_dir):
    async with serve(tiny_model_dir, max_num_seqs=1, max_waiting_requests=1) as client:
        long = {"messages": MSG, "max_tokens": 200, "ignore_eos": True, "temperature": 0}
        running = asyncio.create_task(client.post("/v1/chat/completions", json=long))
        await until_stats(client, lambda s: s["scheduler"]["num_running"] == 1, "one running")
        waiting = asyncio.create_task(client.post("/v1/chat/completions", json=long))
        await until_stats(client, lambda s: s["scheduler"]["num_waiting"] == 1, "one waiting")
        r = await client.post("/v1/chat/completions", json={**long, "stream": True})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "ServiceUnavailableError"
        assert (await running).status_code == 200 and (await waiting).status_code == 200


async def test_api_key(tiny_model_dir):
    serving = ServingConfig("tiny-llama", api_key="s3cret")
    async with serve(tiny_model_dir, serving=serving) as client:
        assert (await client.get("/health")).status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = await client.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        r = await client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 1},
                              headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200
        assert (await client.get("/admin/stats")).status_code == 401


async def test_chat_template_kwargs_reach_the_template(tiny_model_dir):
    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if shout %}LOUD {% endif %}assistant:")
    serving = ServingConfig("tiny-llama", chat_template=template)
    async with serve(tiny_model_dir, serving=serving) as client:
        from tests.conftest import hf_tokenizer

        tok = hf_tokenizer(str(tiny_model_dir))
        for kwargs, tail in (({"shout": True}, "LOUD assistant:"), ({}, "\nassistant:")):
            r = await post(client, "/v1/chat/completions", messages=MSG, max_tokens=1,
                           chat_template_kwargs=kwargs, return_token_ids=True)
            assert tok.decode(r.json()["prompt_token_ids"]).endswith(tail)


async def test_prompt_text_is_logged_only_when_asked(tiny_model_dir, capsys):
    secret = "my-private-prompt-text"
    for verbose in (False, True):
        serving = ServingConfig("tiny-llama", enable_log_requests=verbose)
        async with serve(tiny_model_dir, serving=serving) as client:
            await chat(client, secret, max_tokens=2)
        out = capsys.readouterr().out
        assert "request_done" in out and "ttft_s=" in out and "finish_reason=" in out
        assert (secret in out) == verbose


def test_api_key_from_environment(monkeypatch):
    from pagedserve.server.cli import build_parser

    monkeypatch.setenv("PAGEDSERVE_API_KEY", "from-env")
    assert build_parser().parse_args(["serve"]).api_key == "from-env"
    assert build_parser().parse_args(["serve", "--api-key", "flag"]).api_key == "flag"
