"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` through a real server and the
official ``anthropic`` client: the embedded SmolLM2 (greedy) answers as the chat completion of
the same conversation, whole and streamed, with ``stop_sequences``, and through a tool round
trip; ``count_tokens`` is the chat template's length; errors have Anthropic's shape and
statuses; ``x-api-key`` is the API key; a client leaving mid-stream frees every block; the
metrics count messages as they count chat completions (tiny random Llama where the text itself
does not matter)."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
import pytest_asyncio

from pagedserve.server.config import ServingConfig
from tests.conftest import TINY_NAME, hf_tokenizer, serve, stats
from tests.server.admin.test_admin import wait_idle
from tests.server.compat.test_vllm_compat import samples

SMOL = "smollm2"
KEY = "sk-messages"
QUESTION = "What is the capital of France?"
SYSTEM = "Answer in one sentence."
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "required": ["city"], "additionalProperties": False,
                            "properties": {"city": {"type": "string", "maxLength": 20}}}}
CHAT_WEATHER = {"type": "function", "function": {
    "name": WEATHER["name"], "description": WEATHER["description"],
    "parameters": WEATHER["input_schema"]}}
TEXT_EVENTS = ["message_start", "ping", "content_block_start"]
# The client (2.x) has no sampling arguments any more; the API still takes them in the body.
GREEDY = {"temperature": 0}
END_EVENTS = ["content_block_stop", "message_delta", "message_stop"]


def _client(http: httpx.AsyncClient, **kw) -> anthropic.AsyncAnthropic:
    kw.setdefault("api_key", "unused")
    return anthropic.AsyncAnthropic(base_url=str(http.base_url).rstrip("/"), max_retries=0,
                                    **kw)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def smol(default_model_dir):
    async with serve(default_model_dir, SMOL, max_model_len=1024,
                     serving=ServingConfig(SMOL)) as http:
        yield http, _client(http)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def tiny(tiny_model_dir):
    serving = ServingConfig(TINY_NAME, api_key=KEY, enable_server_load_tracking=True)
    async with serve(tiny_model_dir, serving=serving) as http:
        http.headers["Authorization"] = f"Bearer {KEY}"  # the admin routes take the bearer
        yield http, _client(http, api_key=KEY)


async def _chat(http: httpx.AsyncClient, messages: list[dict], **body) -> dict:
    r = await http.post("/v1/chat/completions", json={
        "model": SMOL, "messages": messages, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


async def test_a_message_equals_the_chat_completion(smol):
    http, client = smol
    m = await client.messages.create(model=SMOL, system=SYSTEM, max_tokens=24, extra_body=GREEDY,
                                     messages=[{"role": "user", "content": QUESTION}],
                                     metadata={"user_id": "u-1"})
    chat = await _chat(http, [{"role": "system", "content": SYSTEM},
                              {"role": "user", "content": QUESTION}], max_tokens=24)
    [block] = m.content
    assert block.type == "text" and block.text == chat["choices"][0]["message"]["content"]
    assert "Paris" in block.text
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert m.model == SMOL
    assert m.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert m.usage.output_tokens == chat["usage"]["completion_tokens"]
    # System as text blocks, the same prompt.
    blocks = await client.messages.create(
        model=SMOL, system=[{"type": "text", "text": SYSTEM}], max_tokens=24, extra_body=GREEDY,
        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}])
    assert blocks.content[0].text == block.text


async def test_a_last_assistant_turn_is_continued_and_system_turns_fold_in(smol):
    http, client = smol
    prefix = "The capital of France is"
    turns = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "easy", "signature": "s"},
        {"type": "text", "text": prefix}]}]
    m = await client.messages.create(model=SMOL, max_tokens=8, extra_body=GREEDY,
                                     messages=[{"role": "system", "content": SYSTEM}, *turns])
    chat = await _chat(http, [{"role": "system", "content": SYSTEM}, turns[0],
                              {"role": "assistant", "content": prefix}], max_tokens=8,
                       add_generation_prompt=False, continue_final_message=True)
    assert m.content[0].text == chat["choices"][0]["message"]["content"]
    assert "Paris" in m.content[0].text and not m.content[0].text.startswith(prefix)
    assert m.usage.input_tokens == chat["usage"]["prompt_tokens"]


async def test_max_tokens_cuts_with_its_stop_reason(smol):
    _, client = smol
    m = await client.messages.create(model=SMOL, max_tokens=3, extra_body=GREEDY,
                                     messages=[{"role": "user", "content": QUESTION}])
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


async def test_the_stream_says_what_the_whole_message_says(smol):
    _, client = smol
    kw = {"model": SMOL, "system": SYSTEM, "max_tokens": 24, "extra_body": GREEDY,
          "messages": [{"role": "user", "content": QUESTION}]}
    whole = await client.messages.create(**kw)
    async with client.messages.stream(**kw) as stream:
        events = [e async for e in stream]
        final = await stream.get_final_message()
    raw = [e for e in events if e.type in (*TEXT_EVENTS, "content_block_delta", *END_EVENTS)]
    deltas = [e.delta.text for e in raw if e.type == "content_block_delta"]
    kinds = [e.type for e in raw if e.type != "ping"]
    assert kinds == ["message_start", "content_block_start", *["content_block_delta"] * len(
        deltas), *END_EVENTS]
    assert len(deltas) > 3  # really streamed, piece by piece
    assert "".join(deltas) == final.content[0].text == whole.content[0].text
    start = raw[0].message
    assert start.id == final.id and start.content == [] and start.stop_reason is None
    assert start.usage.input_tokens == whole.usage.input_tokens
    assert final.stop_reason == whole.stop_reason == "end_turn"
    assert final.usage.output_tokens == whole.usage.output_tokens


async def test_raw_sse_lines_name_each_event(smol):
    http, _ = smol
    body = {"model": SMOL, "max_tokens": 5, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": QUESTION}]}
    pairs, name = [], None
    async with http.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                pairs.append((name, json.loads(line[len("data: "):])))
    assert all(name == data["type"] for name, data in pairs)
    assert [n for n, _ in pairs[:2]] == ["message_start", "ping"]
    assert pairs[-1][0] == "message_stop" and "data: [DONE]" not in str(pairs)
    delta = pairs[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 5


async def test_stop_sequences_end_the_text_before_them(smol):
    _, client = smol
    kw = {"model": SMOL, "system": SYSTEM, "max_tokens": 24, "extra_body": GREEDY,
          "messages": [{"role": "user", "content": QUESTION}]}
    full = (await client.messages.create(**kw)).content[0].text
    assert "Paris" in full
    cut = await client.messages.create(**kw, stop_sequences=["Nowhere", "Paris"])
    assert cut.content[0].text == full.split("Paris")[0]
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == "Paris"
    async with client.messages.stream(**kw, stop_sequences=["Paris"]) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text == cut.content[0].text
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "Paris"


async def test_a_tool_round_trip_with_tool_choice_any(smol):
    http, client = smol
    ask = {"role": "user", "content": "What is the weather in Paris?"}
    first = await client.messages.create(model=SMOL, max_tokens=64, extra_body=GREEDY,
                                         tools=[WEATHER], tool_choice={"type": "any"},
                                         messages=[ask])
    assert first.stop_reason == "tool_use"
    [call] = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    # The same call streamed: a tool_use block whose input arrives as JSON pieces.
    async with client.messages.stream(model=SMOL, max_tokens=64, extra_body=GREEDY,
                                      tools=[WEATHER], tool_choice={"type": "any"},
                                      messages=[ask]) as stream:
        events = [e async for e in stream]
        streamed = await stream.get_final_message()
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    [s_call] = [b for b in streamed.content if b.type == "tool_use"]
    assert json.loads("".join(pieces)) == call.input
    assert (s_call.name, s_call.input, streamed.stop_reason) == (call.name, call.input,
                                                                  "tool_use")
    # The result goes back; the answer is the chat completion of the same history.
    result = "18 degrees and sunny"
    turn = {"model": SMOL, "max_tokens": 40, "extra_body": GREEDY, "tools": [WEATHER],
            "messages": [ask, {"role": "assistant", "content": first.content},
                         {"role": "user", "content": [{"type": "tool_result",
                                                       "tool_use_id": call.id,
                                                       "content": result}]}]}
    answer = await client.messages.create(**turn)  # tool_choice auto: the hermes parser reads
    async with client.messages.stream(**turn) as stream:
        streamed_text = "".join([t async for t in stream.text_stream])
    chat = await _chat(http, [
        ask, {"role": "assistant", "content": None, "tool_calls": [{
            "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": result}],
        tools=[CHAT_WEATHER], max_tokens=40)
    message = chat["choices"][0]["message"]
    assert not message["tool_calls"] and answer.stop_reason == "end_turn"
    assert [b.type for b in answer.content] == ["text"]
    assert answer.content[0].text == message["content"] == streamed_text and streamed_text
    assert answer.usage.input_tokens == chat["usage"]["prompt_tokens"]


async def test_tool_choice_tool_and_none(smol):
    _, client = smol
    ask = [{"role": "user", "content": "Weather in Rome?"}]
    named = await client.messages.create(
        model=SMOL, max_tokens=64, extra_body=GREEDY, tools=[WEATHER], messages=ask,
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    [call] = named.content
    assert call.type == "tool_use" and named.stop_reason == "tool_use"
    jsonschema.validate(call.input, WEATHER["input_schema"])
    never = await client.messages.create(model=SMOL, max_tokens=24, extra_body=GREEDY,
                                         tools=[WEATHER], tool_choice={"type": "none"},
                                         messages=ask)
    assert [b.type for b in never.content] == ["text"] and never.stop_reason != "tool_use"


async def test_count_tokens_is_the_chat_templates_length(smol, default_model_dir):
    http, client = smol
    turns = [{"role": "user", "content": QUESTION}]
    counted = await client.messages.count_tokens(model=SMOL, system=SYSTEM, messages=turns)
    tok = hf_tokenizer(str(default_model_dir))
    text = tok.apply_chat_template([{"role": "system", "content": SYSTEM}, *turns],
                                   tokenize=False, add_generation_prompt=True)
    assert counted.input_tokens == len(tok.encode(text, add_special_tokens=False))
    made = await client.messages.create(model=SMOL, system=SYSTEM, messages=turns,
                                        max_tokens=1)
    assert made.usage.input_tokens == counted.input_tokens
    # With tools: the prompt /tokenize renders for the same chat request.
    with_tools = await client.messages.count_tokens(model=SMOL, messages=turns, tools=[WEATHER])
    r = await http.post("/tokenize", json={"model": SMOL, "messages": turns,
                                           "tools": [CHAT_WEATHER]})
    assert with_tools.input_tokens == r.json()["count"] > counted.input_tokens


TURN = [{"role": "user", "content": "Hi"}]
BAD = [  # (body, status, error type, words the message holds)
    ({"model": TINY_NAME, "messages": TURN}, 400, "invalid_request_error", "max_tokens"),
    ({"model": TINY_NAME, "max_tokens": 4, "messages": [{"role": "tool", "content": "x"}]},
     400, "invalid_request_error", "messages"),
    ({"model": "nope", "max_tokens": 4, "messages": TURN}, 404, "not_found_error", "nope"),
    ({"model": TINY_NAME, "max_tokens": 4, "messages": TURN, "tools": [WEATHER],
      "tool_choice": {"type": "sometimes"}}, 400, "invalid_request_error", "tool_choice"),
    ({"model": TINY_NAME, "max_tokens": 4, "messages": TURN, "tools": [WEATHER],
      "tool_choice": {"type": "tool"}}, 400, "invalid_request_error", "name"),
    ({"model": TINY_NAME, "max_tokens": 4, "messages": TURN, "tools": [WEATHER],
      "tool_choice": {"type": "tool", "name": "nope"}}, 400, "invalid_request_error", "nope"),
    ({"model": TINY_NAME, "max_tokens": 4, "messages": TURN, "tool_choice": {"type": "any"}},
     400, "invalid_request_error", "tools"),
    ({"model": TINY_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]},
     400, "invalid_request_error", "image"),
    ({"model": TINY_NAME, "max_tokens": 4, "messages": TURN,
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     400, "invalid_request_error", "server tool"),
    ({"model": TINY_NAME, "max_tokens": 100_000, "messages": TURN}, 400,
     "invalid_request_error", "context length"),
    ({"model": TINY_NAME, "max_tokens": 0, "messages": TURN}, 400, "invalid_request_error",
     "max_tokens"),
    ({"model": TINY_NAME, "max_tokens": 4, "messages": []}, 400, "invalid_request_error",
     "messages"),
]


@pytest.mark.parametrize(("body", "status", "kind", "says"), BAD)
async def test_bad_requests_get_anthropic_errors(tiny, body, status, kind, says):
    http, _ = tiny
    r = await http.post("/v1/messages", json=body)
    assert r.status_code == status, r.text
    err = r.json()
    assert set(err) == {"type", "error"} and err["type"] == "error"
    assert err["error"]["type"] == kind and says in err["error"]["message"], err


async def test_the_client_raises_the_statuses_errors(tiny):
    http, client = tiny
    with pytest.raises(anthropic.BadRequestError) as bad:
        await client.messages.create(model=TINY_NAME, max_tokens=4, messages=TURN,
                                     tools=[WEATHER], tool_choice={"type": "tool", "name": "x"})
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        await client.messages.create(model="claude-nope", max_tokens=4, messages=TURN)
    with pytest.raises(anthropic.NotFoundError):
        await client.messages.count_tokens(model="claude-nope", messages=TURN)
    # Not JSON, a wrong method, a path under /v1/messages that is none: the same shape.
    r = await http.post("/v1/messages", content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = await http.get("/v1/messages")
    assert r.status_code == 405 and r.json()["type"] == "error"
    r = await http.post("/v1/messages/batches", json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


async def test_x_api_key_is_the_api_key(tiny):
    http, client = tiny
    m = await client.messages.create(model=TINY_NAME, max_tokens=2, messages=TURN)
    assert m.usage.output_tokens == 2
    bearer = _client(http, api_key=None, auth_token=KEY)  # Authorization: Bearer, as well
    assert (await bearer.messages.count_tokens(model=TINY_NAME, messages=TURN)).input_tokens
    with pytest.raises(anthropic.AuthenticationError) as denied:
        await _client(http, api_key="sk-wrong").messages.create(model=TINY_NAME, max_tokens=2,
                                                                 messages=TURN)
    assert denied.value.body["error"]["type"] == "authentication_error"
    # The other APIs take the header too, and keep their own error shape.
    for key, status in ((KEY, 200), ("sk-wrong", 401)):
        r = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                            headers={"Authorization": "", "x-api-key": key})
        assert r.status_code == status
    assert r.json()["error"]["code"] == 401
    r = await http.post("/v1/messages", json={"model": TINY_NAME, "max_tokens": 1,
                                              "messages": TURN}, headers={"Authorization": ""})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


async def test_leaving_mid_stream_frees_every_block(tiny):
    http, _ = tiny
    body = {"model": TINY_NAME, "max_tokens": 400, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Tell me a long story."}]}
    async with http.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and '"content_block_delta"' in line:
                break  # one piece of text in: the request is running; leave
        load = (await http.get("/load")).json()["server_load"]
    assert load == 1  # counted by /load as a chat request is, while it streams
    idle = await wait_idle(http)
    assert idle["kv_cache"]["num_free_blocks"] == idle["kv_cache"]["num_blocks"]


async def test_the_metrics_count_messages_as_chat_requests(tiny):
    http, client = tiny

    async def counts() -> tuple[float, float, float]:
        found = samples((await http.get("/metrics")).text)
        ok = sum(s.value for s in found["pagedserve:request_success_total"]
                 if s.labels["finished_reason"] == "length")
        return (ok, found["pagedserve:prompt_tokens_total"][0].value,
                found["pagedserve:generation_tokens_total"][0].value)

    before = await counts()
    m = await client.messages.create(model=TINY_NAME, max_tokens=3, messages=TURN,
                                     extra_body=GREEDY)
    assert m.stop_reason == "max_tokens"
    after = await counts()
    assert after[0] - before[0] == 1
    assert after[1] - before[1] == m.usage.input_tokens
    assert after[2] - before[2] == m.usage.output_tokens == 3
    assert (await stats(http))["scheduler"]["num_running"] == 0


async def test_openapi_and_docs_list_the_messages_routes(tiny):
    http, _ = tiny
    spec = (await http.get("/openapi.json")).json()
    docs = (await http.get("/docs")).text
    for path, model in (("/v1/messages", "MessagesRequest"),
                        ("/v1/messages/count_tokens", "CountTokensRequest")):
        op = spec["paths"][path]["post"]
        schema = op["requestBody"]["content"]["application/json"]["schema"]
        assert schema["$ref"] == f"#/components/schemas/{model}"
        assert op["responses"]["4XX"]["content"]["application/json"]["schema"]["$ref"] == \
            "#/components/schemas/AnthropicErrorResponse"
        assert f'id="{model}"' in docs and path in docs
    props = spec["components"]["schemas"]["MessagesRequest"]["properties"]
    assert {"max_tokens", "system", "stop_sequences", "tools", "tool_choice"} <= set(props)
    assert "max_tokens" in spec["components"]["schemas"]["MessagesRequest"]["required"]
