"""Tool calling through a real server and the official ``openai`` client, on the tiny random
model: forced calls (``required``, a named function) are valid whatever the weights and the
temperature, because the grammar makes them so; streaming and whole answers agree; ``none``
and ``parallel_tool_calls: false`` hold; a conversation carrying a tool result renders and
answers; bad tool input is a 400 that names the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import pytest_asyncio
import xgrammar as xgr

from pagedserve.actors.structured_output.manager import StructuredOutputManager
from pagedserve.gpu.sample.sampling_params import StructuredOutputsParams
from pagedserve.server.openai.serving import ServingConfig
from pagedserve.server.tools.calling import parameters_of
from pagedserve.server.tools.parsers import TOOL_PARSERS
from pagedserve.server.tools.protocol import ToolDefinition
from tests.conftest import TINY_NAME, hf_tokenizer, serve

SAMPLES = 20
MAX_TOKENS = 300

SCHEMAS = {
    "book_trip": {  # nested objects
        "type": "object",
        "properties": {
            "traveller": {"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 10},
                "address": {"type": "object", "properties": {
                    "city": {"type": "string", "maxLength": 10},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]}},
                "required": ["name", "address"]},
        },
        "required": ["traveller"],
    },
    "set_mode": {  # enums
        "type": "object",
        "properties": {"mode": {"type": "string", "enum": ["eco", "normal", "sport"]},
                       "level": {"enum": [1, 2, 3]}},
        "required": ["mode", "level"],
    },
    "tag_items": {  # arrays
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                "minItems": 1, "maxItems": 4},
                       "ids": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                          "maximum": 99}, "maxItems": 3}},
        "required": ["tags", "ids"],
    },
    "set_thermostat": {  # numbers with bounds
        "type": "object",
        "properties": {"celsius": {"type": "integer", "minimum": 5, "maximum": 30},
                       "offset": {"type": "integer", "exclusiveMinimum": -3,
                                  "exclusiveMaximum": 3},
                       "fan": {"type": "integer", "minimum": 0, "maximum": 4}},
        "required": ["celsius", "offset"],
    },
}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} tool",
                                           "parameters": schema}}
         for name, schema in SCHEMAS.items()]
ASK = [{"role": "user", "content": "Use a tool, please."}]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(tiny_model_dir):
    serving = ServingConfig(TINY_NAME, enable_auto_tool_choice=True, tool_call_parser="hermes")
    async with serve(tiny_model_dir, serving=serving, max_model_len=2048,
                     num_blocks=1024) as http:
        yield http


@pytest.fixture
def client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(server.base_url).rstrip("/") + "/v1", api_key="unused",
                              max_retries=0)


def assert_valid(calls, only: str | None = None) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id
        assert only is None or call.function.name == only
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("name", list(SCHEMAS))
async def test_named_choice_always_validates(client, name):
    r = await client.chat.completions.create(
        model=TINY_NAME, messages=ASK, tools=TOOLS, n=SAMPLES, temperature=1.0, seed=7,
        max_tokens=MAX_TOKENS, tool_choice={"type": "function", "function": {"name": name}})
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert len(choice.message.tool_calls) == 1
        assert_valid(choice.message.tool_calls, only=name)


@pytest.mark.parametrize("name", list(SCHEMAS))
async def test_required_choice_always_validates(client, name):
    others = [t for t in TOOLS if t["function"]["name"] != name][:1]
    tools = [t for t in TOOLS if t["function"]["name"] == name] + others
    r = await client.chat.completions.create(
        model=TINY_NAME, messages=ASK, tools=tools, n=SAMPLES, temperature=1.0, seed=11,
        max_tokens=MAX_TOKENS, tool_choice="required", parallel_tool_calls=False)
    for choice in r.choices:  # one call each: parallel_tool_calls false holds too
        assert choice.finish_reason == "tool_calls"
        assert len(choice.message.tool_calls) == 1
        assert_valid(choice.message.tool_calls)
        assert choice.message.content is None


async def test_required_parallel_calls_are_each_valid(client):
    r = await client.chat.completions.create(
        model=TINY_NAME, messages=ASK, tools=TOOLS, n=8, temperature=1.0, seed=13,
        max_tokens=150, tool_choice="required")
    for choice in r.choices:
        calls = choice.message.tool_calls
        if choice.finish_reason == "length":  # cut short: the last call may be unfinished
            calls = calls[:-1]
        else:
            assert choice.finish_reason == "tool_calls"
        assert_valid(calls)
    assert max(len(c.message.tool_calls) for c in r.choices) > 1


GET_TIME = {"type": "function", "function": {"name": "get_time", "description": "Now"}}


@pytest.mark.parametrize("tool_choice", [
    {"type": "function", "function": {"name": "get_time"}}, "required"])
async def test_a_tool_without_parameters_is_called_with_exactly_empty_arguments(client,
                                                                                tool_choice):
    # OpenAI: no `parameters` is an empty parameter list, so "{}" is the only valid call.
    r = await client.chat.completions.create(
        model=TINY_NAME, messages=ASK, tools=[GET_TIME], n=8, temperature=1.0, seed=23,
        max_tokens=60, tool_choice=tool_choice, parallel_tool_calls=False)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        assert calls_of(choice.message) == [("get_time", "{}")]


def calls_of(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


@pytest.mark.parametrize("tool_choice", ["required",
                                         {"type": "function", "function": {"name": "tag_items"}}])
async def test_streamed_deltas_add_up_to_the_whole_answer(client, tool_choice):
    args = dict(model=TINY_NAME, messages=ASK, tools=TOOLS, temperature=1.0, seed=3,
                max_tokens=MAX_TOKENS, tool_choice=tool_choice)
    whole = (await client.chat.completions.create(**args)).choices[0]
    calls: dict[int, list[str]] = {}
    finish, content = None, ""
    async for chunk in await client.chat.completions.create(stream=True, **args):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            if tc.index not in calls:  # the first delta of a call names it
                assert tc.id and tc.type == "function" and tc.function.name
                calls[tc.index] = [tc.function.name, ""]
            calls[tc.index][1] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert [tuple(calls[i]) for i in sorted(calls)] == calls_of(whole.message)
    assert content == (whole.message.content or "") and finish == whole.finish_reason


async def test_the_client_stream_helper_accumulates_the_calls(client):
    args = dict(model=TINY_NAME, messages=ASK, tools=TOOLS, temperature=1.0, seed=5,
                max_tokens=MAX_TOKENS, tool_choice="required")
    whole = (await client.chat.completions.create(**args)).choices[0]
    async with client.chat.completions.stream(**args) as stream:
        done = [e async for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = await stream.get_final_completion()
    assert calls_of(final.choices[0].message) == calls_of(whole.message)
    assert [(e.name, e.arguments) for e in done] == calls_of(whole.message)


async def test_choice_none_never_calls(client):
    r = await client.chat.completions.create(
        model=TINY_NAME, messages=ASK, tools=TOOLS, n=8, temperature=1.0, seed=17,
        max_tokens=40, tool_choice="none")
    for choice in r.choices:
        # vLLM's ChatMessage: no calls is [] in a whole answer, not null.
        assert choice.message.tool_calls == [] and choice.finish_reason != "tool_calls"


CALL = ('<tool_call>\n{"name": "set_mode", "arguments": {"mode": "eco", "level": 2}}\n'
        '</tool_call>')


async def test_auto_reads_calls_out_of_the_text(client):
    # A regex makes the random model write a hermes call; the parser reads it out.
    args = dict(model=TINY_NAME, messages=ASK, tools=TOOLS, max_tokens=MAX_TOKENS,
                extra_body={"guided_regex": "Sure\\. " + CALL.replace("{", "\\{")
                            .replace("}", "\\}").replace("\n", "\\n")})
    r = (await client.chat.completions.create(**args)).choices[0]
    assert r.finish_reason == "tool_calls" and r.message.content == "Sure."
    assert calls_of(r.message) == [("set_mode", '{"mode": "eco", "level": 2}')]
    async with client.chat.completions.stream(**args) as stream:
        final = await stream.get_final_completion()
    assert calls_of(final.choices[0].message) == calls_of(r.message)
    assert final.choices[0].message.content == "Sure."


async def test_a_tool_result_in_the_history_renders_and_answers(client, tiny_model_dir):
    messages = [
        {"role": "user", "content": "Set eco mode."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "set_mode", "arguments": '{"mode": "eco", "level": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"ok": true}'},
    ]
    r = await client.chat.completions.create(
        model=TINY_NAME, messages=messages, tools=TOOLS, tool_choice="none", temperature=0,
        max_tokens=8, extra_body={"return_token_ids": True})
    assert r.choices[0].message.content and r.choices[0].finish_reason == "length"
    prompt = hf_tokenizer(str(tiny_model_dir)).decode(r.model_extra["prompt_token_ids"])
    assert '<tool_call>\n{"name": "set_mode", "arguments": {"mode": "eco", "level": 2}}' in prompt
    assert '<tool_response>\n{"ok": true}\n</tool_response>' in prompt
    assert '"name": "tag_items"' in prompt and prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools", "name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(["}}}}}]},
     "tools", "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "tools", "unique"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "forced tool_choice"),
])
async def test_bad_tool_input_is_a_400_naming_the_field(server, body, param, says):
    r = await server.post("/v1/chat/completions", json={"messages": ASK, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"]


async def test_auto_without_detection_names_the_flags(tiny_model_dir):
    # vLLM's rule, kept behind --disable-tool-parser-detection: auto needs both flags.
    serving = ServingConfig(TINY_NAME, disable_tool_parser_detection=True)
    async with serve(tiny_model_dir, max_model_len=1024, num_blocks=128,
                     serving=serving) as http:
        r = await http.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in err["message"]
        assert "--tool-call-parser" in err["message"]
        r = await http.post("/v1/chat/completions", json={
            "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"]


@pytest.mark.parametrize(("parser", "prefix", "good", "bad"), [
    ("hermes", 'Let me set that. <tool_call>\n{"name": "set_mode", "arguments": {"mode": "',
     'eco", "level": 2}}\n</tool_call> Done.', 'turbo"'),
    ("hermes", "Let me set that. <tool_call>\n", '{"name": "set_mode", "arguments": ',
     '{"name": "launch_rockets"'),
    ("llama3_json", 'Sure. {"name": ', '"set_mode", "parameters": {"mode": "eco", "level": 2}}',
     '"launch_rockets"'),
])
async def test_auto_calls_are_constrained_once_opened(tiny_model_dir, parser, prefix, good,
                                                      bad):
    """The auto-mode grammar, compiled as the server compiles it, lets text through, then holds
    an opened call to the tools' schemas: an unknown tool or a value outside the schema cannot
    be written, a valid call can, and text may follow it."""
    tools = [ToolDefinition.model_validate(t) for t in TOOLS]
    tag = TOOL_PARSERS[parser]().structural_tag(
        [(t.function.name, parameters_of(t)) for t in tools])
    tok = hf_tokenizer(str(tiny_model_dir))
    manager = StructuredOutputManager(tok, 49152, [tok.eos_token_id])
    try:
        grammar = (await manager.compile(StructuredOutputsParams(structural_tag=tag))).future
        for text, accepted in ((good, True), (bad, False)):
            matcher = xgr.GrammarMatcher(grammar.result())
            assert matcher.accept_string(prefix)
            assert matcher.accept_string(text) is accepted, text
    finally:
        manager.shutdown()


async def test_auto_mode_generates_under_its_grammar(client):
    r = await client.chat.completions.create(
        model=TINY_NAME, messages=ASK, tools=TOOLS, n=4, temperature=1.0, seed=19,
        max_tokens=40)
    for choice in r.choices:  # text, or calls that validate: never a broken call
        assert choice.finish_reason in ("stop", "length", "tool_calls")
        if choice.message.tool_calls:
            assert_valid(choice.message.tool_calls)
