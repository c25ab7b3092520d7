"""A user's first tool loop on the default flags (no ``--enable-auto-tool-choice``, no
``--tool-call-parser``), with the embedded SmolLM2-135M, the real server and the ``openai``
client: turn 1 calls a tool, turn 2 sends the tools again without ``tool_choice`` (``auto``,
as every framework's loop does) with the tool's result and gets an answer. ``/tokenize`` of the
same conversation gives the chat endpoint's prompt ids. The OpenAI Agents SDK's and LangChain's
loops run the same way (LiteLLM is left out: a 44 MB wheel that pulls boto3 and aiohttp)."""

from __future__ import annotations

import copy
import json

import openai
import pytest
import pytest_asyncio

from pagedserve.server.config import ServingConfig
from pagedserve.server.tools.parser_choice import (
    AutoToolChoice,
    detect_tool_parser,
    resolve_auto_tool_choice,
)
from tests.conftest import hf_tokenizer, serve

SMOL = "smollm2"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def smol(default_model_dir):
    async with serve(default_model_dir, SMOL, max_model_len=1024,
                     serving=ServingConfig(SMOL)) as http:
        yield http, openai.AsyncOpenAI(base_url=f"{str(http.base_url).rstrip('/')}/v1",
                                       api_key="unused", max_retries=0)


def second_turn(call) -> list[dict]:
    return [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21, "sky": "clear"}'}]


async def test_a_full_tool_loop_on_the_default_flags(smol):
    _, client = smol
    first = await client.chat.completions.create(
        model=SMOL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = first.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    # Turn 2 as the frameworks send it: the tools again, no tool_choice (= "auto").
    second = await client.chat.completions.create(
        model=SMOL, messages=second_turn(call), tools=[WEATHER], temperature=0, max_tokens=40,
        extra_body={"return_token_ids": True})
    answer = second.choices[0]
    assert answer.message.content and not answer.message.tool_calls
    assert answer.finish_reason in ("stop", "length")
    # Auto mode, streamed: the same answer.
    text = ""
    async for chunk in await client.chat.completions.create(
            model=SMOL, messages=second_turn(call), tools=[WEATHER], temperature=0,
            max_tokens=40, stream=True):
        text += chunk.choices[0].delta.content or ""
    assert text == answer.message.content


async def test_auto_turn_one_reads_a_call_out_of_the_text(smol):
    # Auto on turn 1: SmolLM2 opens a <tool_call> for this prompt; the hermes parser (chosen
    # from its template) reads it and the grammar holds it to the schema.
    _, client = smol
    r = await client.chat.completions.create(
        model=SMOL, temperature=0, max_tokens=60, tools=[WEATHER],
        messages=[{"role": "system", "content": "Call get_weather to answer."}, *ASK])
    choice = r.choices[0]
    if choice.message.tool_calls:  # the model's pick; either way the answer is well formed
        assert choice.finish_reason == "tool_calls"
        assert json.loads(choice.message.tool_calls[0].function.arguments)["city"]
    else:
        assert choice.message.content


async def test_tokenize_with_tools_gives_the_chat_prompt_ids(smol):
    http, client = smol
    call = type("Call", (), {"id": "call_1", "function": type("F", (), {
        "name": "get_weather", "arguments": '{"city": "Paris"}'})})
    messages = second_turn(call)
    r = await client.chat.completions.create(
        model=SMOL, messages=messages, tools=[WEATHER], tool_choice="none", temperature=0,
        max_tokens=1, extra_body={"return_token_ids": True})
    chat_ids = r.model_extra["prompt_token_ids"]
    tok = await http.post("/tokenize", json={"messages": messages, "tools": [WEATHER]})
    assert tok.status_code == 200, tok.text
    assert tok.json()["tokens"] == chat_ids and tok.json()["count"] == r.usage.prompt_tokens
    bare = (await http.post("/tokenize", json={"messages": messages})).json()
    assert bare["count"] < len(chat_ids)  # without tools: no tool list in the system turn
    bad = await http.post("/tokenize", json={"prompt": "Hi", "tools": [WEATHER]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"


@pytest.mark.parametrize(("template", "parser", "source"), [
    ("{{ '<|start_header_id|>' }}{{ tools | tojson }}", "llama3_json", "chat template"),
    ("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}", "mistral", "chat template"),
    ("{{ '<tool_call>' }}{{ '<|start_header_id|>' }}", "hermes", "chat template"),
    ("{{ messages[0].content }}", "hermes", "vocabulary"),  # SmolLM2's <|im_start|> token
])
def test_the_parser_is_chosen_from_the_template_then_the_vocabulary(default_model_dir,
                                                                    template, parser, source):
    tok = copy.deepcopy(hf_tokenizer(str(default_model_dir)))
    tok.chat_template = template
    assert detect_tool_parser(tok, None) == (parser, source)
    assert resolve_auto_tool_choice(tok, None, None, False, False) == AutoToolChoice(
        parser, True, source)
    # Flags: an explicit parser wins; without detection, vLLM's two-flag rule.
    assert resolve_auto_tool_choice(tok, None, "pythonic", False, False).parser == "pythonic"
    off = resolve_auto_tool_choice(tok, None, None, True, True)
    assert not off.enabled and "--tool-call-parser" in off.refusal
    assert resolve_auto_tool_choice(tok, None, "hermes", True, True).enabled


async def test_the_agents_sdk_tool_loop(smol):
    # The OpenAI Agents SDK's loop on the chat endpoint: turn 1 forced (tool_choice names the
    # tool), the SDK runs it, then turn 2 sends the tools again with no tool_choice.
    agents = pytest.importorskip("agents")
    http, client = smol
    agents.set_tracing_disabled(True)  # its traces go to OpenAI's servers
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return '{"celsius": 21, "sky": "clear"}'

    agent = agents.Agent(
        name="weather", instructions="Answer with the weather.", tools=[get_weather],
        model=agents.OpenAIChatCompletionsModel(model=SMOL, openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="get_weather", temperature=0,
                                            max_tokens=40))
    result = await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4)
    assert seen and result.final_output  # the tool ran, then the model answered in text


async def test_the_langchain_bind_tools_loop(smol):
    # LangChain's loop: bind_tools with the tool forced, run it, send a ToolMessage back
    # through bind_tools without tool_choice (auto).
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    http, _ = smol

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return '{"celsius": 21, "sky": "clear"}'

    llm = lc.ChatOpenAI(model=SMOL, base_url=f"{str(http.base_url).rstrip('/')}/v1",
                        api_key="unused", temperature=0, max_tokens=40, max_retries=0)
    history = [HumanMessage("What is the weather in Paris?")]
    first = await llm.bind_tools([get_weather], tool_choice="get_weather").ainvoke(history)
    [call] = first.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"]
    history += [first, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    answer = await llm.bind_tools([get_weather]).ainvoke(history)
    assert answer.content and not answer.tool_calls
