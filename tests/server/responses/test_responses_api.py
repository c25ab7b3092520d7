"""``POST /v1/responses`` through a real server and the official ``openai`` client: the text
round trip equals the chat completion (SmolLM2, greedy), the stream's events and deltas,
``previous_response_id`` conversations and the store, ``text.format`` as guided decoding, and
OpenAI-shaped errors (tiny random Llama where the text itself does not matter)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
import pytest_asyncio
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from pagedserve.server.config import ServingConfig
from pagedserve.server.responses.protocol import FunctionTool, NamedFunctionChoice, chat_tools
from tests.conftest import TINY_NAME, hf_tokenizer, serve

SMOL = "smollm2"
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"], "additionalProperties": False}
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added"]
DONE_EVENTS = ["response.output_text.done", "response.content_part.done",
               "response.output_item.done"]
STREAM_EVENT: TypeAdapter = TypeAdapter(ResponseStreamEvent)
FORECAST = {"type": "function", "name": "forecast", "description": "Days of weather",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                "required": ["city", "days"], "additionalProperties": False}}
CLOCK = {"type": "function", "name": "clock", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
    "additionalProperties": False}}
TOOL_TOKENS = 160  # room for a forced call whose strings are bounded, from random weights
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}


def _openai(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{str(http.base_url).rstrip('/')}/v1",
                              api_key="unused", max_retries=0)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def tiny(tiny_model_dir):
    # vLLM's rule for auto (both flags), so that its 400 is tested here too.
    serving = ServingConfig(TINY_NAME, max_stored_responses=8,
                            disable_tool_parser_detection=True)
    async with serve(tiny_model_dir, serving=serving) as http:
        yield http, _openai(http)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def smol(default_model_dir):
    serving = ServingConfig(SMOL, enable_auto_tool_choice=True, tool_call_parser="hermes")
    async with serve(default_model_dir, SMOL, max_model_len=512, serving=serving) as http:
        yield _openai(http)


async def test_text_round_trip_equals_the_chat_completion(smol):
    question = "What is the capital of France?"
    r = await smol.responses.create(model=SMOL, instructions="Answer in one sentence.",
                                    input=[{"role": "user", "content": question}],
                                    temperature=0, max_output_tokens=24)
    chat = await smol.chat.completions.create(
        model=SMOL, temperature=0, max_tokens=24,
        messages=[{"role": "system", "content": "Answer in one sentence."},
                  {"role": "user", "content": question}])
    assert r.output_text == chat.choices[0].message.content
    assert "Paris" in r.output_text
    assert r.status == "completed" and r.object == "response" and r.id.startswith("resp_")
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "Answer in one sentence." and r.max_output_tokens == 24
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"


async def test_stream_helper_deltas_make_the_final_text(smol):
    kw = {"model": SMOL, "input": "What is the capital of France?", "temperature": 0,
          "max_output_tokens": 24}
    full = await smol.responses.create(**kw)
    async with smol.responses.stream(**kw) as stream:
        events = [e async for e in stream]
        final = await stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds == TEXT_EVENTS + ["response.output_text.delta"] * len(deltas) + DONE_EVENTS + [
        "response.completed"]
    assert len(deltas) > 3  # really streamed, token by token
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(deltas) == final.output_text == full.output_text
    assert events[-4].text == full.output_text
    assert final.usage.output_tokens == full.usage.output_tokens
    assert final.id == events[0].response.id and final.status == "completed"


async def test_auto_with_a_parser_answers_as_the_chat_path(smol):
    # SmolLM2-135M answers this in text: the parser reads no call, streamed or not.
    kw = {"model": SMOL, "input": "What is the weather in Paris? Use the get_weather tool.",
          "tools": [WEATHER], "temperature": 0, "max_output_tokens": 60}
    whole = await smol.responses.create(**kw)
    chat = await smol.chat.completions.create(
        model=SMOL, messages=[{"role": "user", "content": kw["input"]}], temperature=0,
        tools=[_chat_tool(WEATHER)], max_tokens=60)
    assert whole.output_text == chat.choices[0].message.content and whole.output_text
    assert not chat.choices[0].message.tool_calls and whole.tool_choice == "auto"
    assert whole.usage.input_tokens == chat.usage.prompt_tokens and whole.status == "completed"
    async with smol.responses.stream(**kw) as stream:
        events = [e async for e in stream]
        final = await stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert [e.type for e in events] == TEXT_EVENTS + ["response.output_text.delta"] * len(
        deltas) + DONE_EVENTS + ["response.completed"]
    assert "".join(deltas) == final.output_text == whole.output_text


async def test_raw_stream_cut_by_max_output_tokens_is_incomplete(tiny):
    http, _ = tiny
    lines = []
    async with http.stream("POST", "/v1/responses", json={
            "input": "Count", "temperature": 0, "max_output_tokens": 5,
            "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln async for ln in r.aiter_lines() if ln and not ln.startswith(":")]
    names = [ln.removeprefix("event: ") for ln in lines if ln.startswith("event: ")]
    data = [json.loads(ln.removeprefix("data: ")) for ln in lines if ln.startswith("data: ")]
    assert names == [d["type"] for d in data]  # the event: line repeats the type
    assert names[-1] == "response.incomplete" and "[DONE]" not in lines
    last = data[-1]["response"]
    assert last["status"] == "incomplete"
    assert last["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["usage"]["output_tokens"] == 5 and last["output"][0]["status"] == "incomplete"
    for event in data:  # every event has the shape the openai package declares
        STREAM_EVENT.validate_python(event)


def _prompt_len(tiny_model_dir, messages: list[dict]) -> int:
    tok = hf_tokenizer(str(tiny_model_dir))
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tok.encode(text, add_special_tokens=False))


async def test_previous_response_id_continues_the_conversation(tiny, tiny_model_dir):
    _, client = tiny
    kw = {"temperature": 0, "max_output_tokens": 6}
    first = await client.responses.create(input="Hi", instructions="Be terse.", **kw)
    second = await client.responses.create(input="And then?", previous_response_id=first.id,
                                           **kw)
    third = await client.responses.create(
        input=[{"role": "user", "content": "Last one"}], previous_response_id=second.id, **kw)
    turns = [{"role": "user", "content": "Hi"},
             {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "And then?"}]
    # Instructions are not carried over to the next turn (as OpenAI documents).
    assert first.usage.input_tokens == _prompt_len(
        tiny_model_dir, [{"role": "system", "content": "Be terse."}, turns[0]])
    assert second.usage.input_tokens == _prompt_len(tiny_model_dir, turns)
    assert third.usage.input_tokens == _prompt_len(tiny_model_dir, [
        *turns, {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "Last one"}])
    assert second.previous_response_id == first.id
    fetched = await client.responses.retrieve(second.id)
    assert fetched.output_text == second.output_text and fetched.id == second.id


async def test_store_false_is_not_kept(tiny):
    _, client = tiny
    r = await client.responses.create(input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError) as e:
        await client.responses.create(input="More", previous_response_id=r.id,
                                      max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id" and r.id in e.value.message
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(r.id)


async def test_the_store_drops_the_least_recently_used(tiny):
    _, client = tiny  # this server keeps 8
    ids = [(await client.responses.create(input="Hi", max_output_tokens=1)).id
           for _ in range(9)]
    await client.responses.retrieve(ids[1])  # touched: now the most recent
    await client.responses.create(input="Hi", max_output_tokens=1)  # drops ids[2]
    for gone in (ids[0], ids[2]):
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(gone)
    assert (await client.responses.retrieve(ids[1])).id == ids[1]


async def test_text_format_json_schema_and_json_object(tiny):
    _, client = tiny
    r = await client.responses.create(
        input="A person", temperature=0, max_output_tokens=64,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                         "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema" and r.text.format.name == "person"
    r = await client.responses.create(input="Any object", temperature=0, max_output_tokens=64,
                                      text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(r.output_text), dict)


async def test_string_input_equals_one_user_message_and_tool_choice_none(tiny):
    _, client = tiny
    kw = {"temperature": 0, "max_output_tokens": 8}
    a = await client.responses.create(input="Hello there", **kw)
    b = await client.responses.create(input=[{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "Hello "}, {"type": "input_text", "text": "there"}]}],
        tools=[WEATHER], tool_choice="none", **kw)
    assert a.output_text and a.usage.input_tokens < b.usage.input_tokens  # tools rendered
    chat = await client.chat.completions.create(  # as chat renders tools for "none"
        model=TINY_NAME, messages=[{"role": "user", "content": "Hello there"}],
        tools=[_chat_tool(WEATHER)], tool_choice="none", temperature=0, max_tokens=8)
    assert b.output_text == chat.choices[0].message.content
    assert b.usage.input_tokens == chat.usage.prompt_tokens
    assert [i.type for i in b.output] == ["message"]
    assert b.tools[0].name == "get_weather" and b.tool_choice == "none"
    http, _ = tiny  # nulls mean "not set", and the raw body is a valid Response
    raw = await http.post("/v1/responses", json={"input": "Hello there", "temperature": 0,
                                                 "max_output_tokens": 8, "top_p": None,
                                                 "text": None, "tools": None})
    assert raw.status_code == 200, raw.text
    assert Response.model_validate(raw.json()).output_text == a.output_text


@pytest.mark.parametrize("body, status, param", [
    ({"previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    ({"model": "gpt-4o"}, 404, "model"),
    ({"temperature": 3}, 400, "temperature"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"max_output_tokens": 100_000}, 400, "max_output_tokens"),
    ({"input": []}, 400, "input"),
    ({"input": [{"type": "function_call_output", "output": "1"}]}, 400, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
     400, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, 400, "input"),
    ({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x"}]}]}, 400, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input"),
    ({"tools": [WEATHER]}, 400, "tool_choice"),  # auto (the default) needs a parser
    ({"tools": [WEATHER], "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, 400, "text.format"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, 400, "tools"),
    ({"tools": [{**WEATHER, "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "(["}}}}], "tool_choice": "none"}, 400, "tools"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"tools": [{"type": "function", "name": ""}]}, 400, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, 400,
     "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, 400, "text.format"),
    ({"background": True}, 400, "background"),
    ({"stream": True, "top_p": 0}, 400, "top_p"),  # before any stream starts
])
async def test_bad_requests_get_openai_errors(tiny, body, status, param):
    http, _ = tiny
    r = await http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 2, **body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == status and err["message"]


async def test_auto_without_a_parser_names_the_flags(tiny):
    _, client = tiny
    with pytest.raises(openai.BadRequestError) as e:
        await client.responses.create(input="Weather in Paris?", tools=[WEATHER])
    assert e.value.body["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in e.value.message
    assert "--tool-call-parser" in e.value.message


def _chat_tool(tool: dict) -> dict:
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def _call(response: Response):
    [item] = response.output
    assert item.type == "function_call" and item.status == "completed"
    assert item.id.startswith("fc_") and item.call_id.startswith("call_")
    return item


async def test_required_gives_a_function_call_that_validates(tiny):
    _, client = tiny
    r = await client.responses.create(input="Forecast for Paris", tools=[FORECAST, CLOCK],
                                      tool_choice="required", parallel_tool_calls=False,
                                      temperature=1.0, extra_body={"seed": 3},
                                      max_output_tokens=TOOL_TOKENS)
    call = _call(r)
    schema = {t["name"]: t["parameters"] for t in (FORECAST, CLOCK)}[call.name]
    jsonschema.validate(json.loads(call.arguments), schema)
    assert r.status == "completed" and r.output_text == "" and r.tool_choice == "required"


async def test_named_choice_streams_the_same_call(tiny):
    _, client = tiny
    kw = {"model": TINY_NAME, "input": "Forecast for Paris", "tools": [WEATHER, FORECAST],
          "temperature": 0,
          "tool_choice": {"type": "function", "name": "forecast"},
          "max_output_tokens": TOOL_TOKENS}
    whole = _call(await client.responses.create(**kw))
    assert whole.name == "forecast"
    jsonschema.validate(json.loads(whole.arguments), FORECAST["parameters"])
    async with client.responses.stream(**kw) as stream:
        events = [e async for e in stream]
        final = await stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * len(deltas),
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]
    assert len(deltas) > 3 and [e.sequence_number for e in events] == list(range(len(events)))
    added, done = events[2].item, events[-2].item
    assert (added.type, added.arguments, added.status) == ("function_call", "", "in_progress")
    assert "".join(deltas) == events[-3].arguments == done.arguments == whole.arguments
    assert done.id == added.id == events[3].item_id and done.call_id == added.call_id
    assert _call(final).arguments == whole.arguments and final.output[0].id == done.id
    assert all(e.output_index == 0 for e in events[2:-1])
    http, _ = tiny  # every raw event has the shape the openai package declares
    async with http.stream("POST", "/v1/responses", json={**kw, "stream": True}) as r:
        data = [json.loads(ln.removeprefix("data: ")) async for ln in r.aiter_lines()
                if ln.startswith("data: ")]
    for event in data:
        STREAM_EVENT.validate_python(event)
    assert _call(Response.model_validate(data[-1]["response"])).arguments == whole.arguments


async def test_a_function_call_output_round_trip(tiny):
    _, client = tiny
    kw = {"tools": [FORECAST], "temperature": 0, "max_output_tokens": TOOL_TOKENS}
    first = await client.responses.create(input="Forecast for Paris", tool_choice="required",
                                          parallel_tool_calls=False, **kw)
    call = _call(first)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21C"}
    kw.update(tool_choice="none", max_output_tokens=8)
    chained = await client.responses.create(previous_response_id=first.id, input=[result], **kw)
    replayed = await client.responses.create(input=[  # the same history, sent back whole
        {"role": "user", "content": "Forecast for Paris"},
        {"type": "function_call", "id": call.id, "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments, "status": "completed"}, result], **kw)
    chat = await client.chat.completions.create(
        model=TINY_NAME, tools=[_chat_tool(FORECAST)], tool_choice="none", temperature=0,
        max_tokens=8, messages=[
            {"role": "user", "content": "Forecast for Paris"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": call.call_id, "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21C"}])
    for r in (chained, replayed):
        [item] = r.output
        assert item.type == "message" and r.output_text
        assert r.output_text == chat.choices[0].message.content
        assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_chat_tools_converts_to_the_chat_completions_shape():
    tool = FunctionTool.model_validate({**WEATHER, "strict": True})
    tools, choice = chat_tools([tool], NamedFunctionChoice(type="function", name="get_weather"))
    assert tools == [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": WEATHER["parameters"], "strict": True}}]
    assert choice == {"type": "function", "function": {"name": "get_weather"}}
    bare = FunctionTool(type="function", name="now")
    assert chat_tools([bare], "auto") == ([{"type": "function", "function": {
        "name": "now"}}], "auto")  # no parameters: only {} (tool_calling.parameters_of)
