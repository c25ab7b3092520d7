"""The tool-call parsers on outputs written the way each model family writes them: whole,
streamed in every split (every split point of each, and random multi-way splits), and malformed
(which comes back as content, never an error)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.server.tools.parsers import TOOL_PARSERS, JsonArrayToolParser, ToolParser

WEATHER = {"city": "Paris", "unit": "celsius"}

# (parser, model output, expected content, expected [(name, arguments)])
CASES = [
    ("hermes",  # Qwen2.5-7B-Instruct
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
     '</tool_call>', None, [("get_weather", WEATHER)]),
    ("hermes",  # Hermes-2-Pro: text first, then two calls
     'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
     '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
     '{"tz": "Europe/Paris"}}\n</tool_call>',
     "Let me check both.", [("get_weather", WEATHER), ("get_time", {"tz": "Europe/Paris"})]),
    ("hermes", "The weather in Paris is mild today.", "The weather in Paris is mild today.", []),
    ("hermes",  # braces and a closing tag inside a string argument
     '<tool_call>\n{"name": "note", "arguments": {"text": "a {b} </tool_call> \\"c\\""}}\n'
     '</tool_call>', None, [("note", {"text": 'a {b} </tool_call> "c"'})]),
    ("llama3_json",  # Llama-3.1-8B-Instruct
     '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
     None, [("get_weather", WEATHER)]),
    ("llama3_json",  # with the python tag kept, two calls
     '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
     '; {"name": "get_time", "parameters": {"tz": "UTC"}}',
     None, [("get_weather", WEATHER), ("get_time", {"tz": "UTC"})]),
    ("llama3_json", "It is sunny in Paris.", "It is sunny in Paris.", []),
    ("mistral",  # Mistral-7B-Instruct-v0.3
     '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
     '{"name": "get_time", "arguments": {"tz": "CET"}}]',
     None, [("get_weather", WEATHER), ("get_time", {"tz": "CET"})]),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "ping", "arguments": {}}]', "Sure.",
     [("ping", {})]),
    ("mistral", "No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
    ("phi4_mini_json",  # Phi-4-mini-instruct (vLLM's template): two calls in one list
     'functools[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
     '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}]',
     None, [("get_weather", WEATHER), ("get_time", {"tz": "Europe/Paris"})]),
    ("phi4_mini_json", 'I will look it up.\nfunctools[{"name": "ping", "arguments": {}}]',
     "I will look it up.", [("ping", {})]),
    ("phi4_mini_json", "Paris is the capital of France.", "Paris is the capital of France.", []),
    ("pythonic",  # Llama-3.2-3B-Instruct
     '[get_weather(city="Paris", unit="celsius"), get_time(tz=\'Europe/Paris\')]',
     None, [("get_weather", WEATHER), ("get_time", {"tz": "Europe/Paris"})]),
    ("pythonic", '[search(query="a (b) [c]", limit=3, exact=True, tags=["x", "y"], '
                 'filters={"lang": "en"}, score=-0.5, extra=None)]',
     None, [("search", {"query": "a (b) [c]", "limit": 3, "exact": True, "tags": ["x", "y"],
                        "filters": {"lang": "en"}, "score": -0.5, "extra": None})]),
    ("pythonic", "Paris is in France.", "Paris is in France.", []),
]

MALFORMED = [
    ("hermes", '<tool_call>\nnot json at all\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}'),  # cut short
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}} trailing</tool_call>'),
    ("llama3_json", '{"answer": 42}'),
    ("llama3_json", '{"name": "f", "parameters": [1, 2]}'),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}} and some prose'),
    ("mistral", '[TOOL_CALLS] here is what I would call'),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}'),  # never closed
    ("phi4_mini_json", "Python's functools module has lru_cache."),
    ("phi4_mini_json", 'functools[{"name": "f", "arguments": {"a": 1}}'),  # never closed
    ("phi4_mini_json", 'functools[{"name": "f"}]'),  # no arguments
    ("pythonic", '[1, 2, 3]'),
    ("pythonic", '[get_weather("Paris")]'),
    ("pythonic", '[f(x=open("/etc/passwd"))]'),
    ("pythonic", '[Note] this is prose'),
]


def streamed(parser: ToolParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]], int]:
    """Feed the pieces; returns (content, [(name, arguments)], number of id-carrying deltas),
    checking the OpenAI delta shape on the way."""
    s = parser.streamer()
    content, calls, heads = "", [], 0
    for k, piece in enumerate(pieces):
        d = s.feed(piece, final=k == len(pieces) - 1)
        content += d.content
        for tc in d.tool_calls:
            if "id" in tc:
                assert tc["index"] == len(calls) and tc["type"] == "function"
                assert tc["function"]["arguments"] == ""
                calls.append([tc["function"]["name"], ""])
                heads += 1
            else:
                assert set(tc) == {"index", "function"}
                assert set(tc["function"]) == {"arguments"}
                calls[tc["index"]][1] += tc["function"]["arguments"]
    return content, [tuple(c) for c in calls], heads


def whole(parser: ToolParser, text: str) -> tuple[str, list[tuple[str, str]]]:
    out = parser.extract(text)
    return out.content or "", [(c.name, c.arguments) for c in out.calls]


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_extract_whole_output(name, text, content, calls):
    out = TOOL_PARSERS[name]().extract(text)
    assert out.content == content
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == calls
    assert len({c.id for c in out.calls}) == len(calls)


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_every_two_way_split_streams_the_same_answer(name, text, content, calls):
    parser = TOOL_PARSERS[name]()
    expected = whole(parser, text)
    for cut in range(len(text) + 1):
        got = streamed(parser, [text[:cut], text[cut:]])
        assert got[:2] == expected, cut
        assert got[2] == len(calls)


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_token_by_token_stream_sends_arguments_in_pieces(name, text, content, calls):
    parser = TOOL_PARSERS[name]()
    s = parser.streamer()
    arg_deltas = 0
    for k, ch in enumerate(text):
        d = s.feed(ch, final=k == len(text) - 1)
        arg_deltas += sum(1 for tc in d.tool_calls if "id" not in tc)
    assert s.num_calls == len(calls)
    if calls and name != "pythonic":  # pythonic calls stream whole, once closed
        # one piece per character of the arguments: they stream as they are written
        assert arg_deltas == sum(len(json.dumps(args)) for _, args in calls) or all(
            len(c.arguments) == 2 for c in parser.extract(text).calls)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(CASES), st.lists(st.integers(0, 400), max_size=12))
def test_random_splits_stream_the_same_answer(case, cuts):
    name, text = case[0], case[1]
    cuts = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    parser = TOOL_PARSERS[name]()
    assert streamed(parser, pieces)[:2] == whole(parser, text)


@pytest.mark.parametrize(("name", "text"), MALFORMED)
def test_malformed_output_is_content(name, text):
    parser = TOOL_PARSERS[name]()
    out = parser.extract(text)
    assert out.content == text and out.calls == []
    for cut in range(len(text) + 1):  # never raises; whatever was not sent as a call is text
        content, calls, _ = streamed(parser, [text[:cut], text[cut:]])
        if not calls:
            assert content == text


def test_required_output_array():
    text = '[{"name": "a", "arguments": {"x": [1, {"y": "]"}]}}, {"name": "b", "arguments": {}}]'
    parser = JsonArrayToolParser()
    assert whole(parser, text) == ("", [("a", '{"x": [1, {"y": "]"}]}'), ("b", "{}")])
    for cut in range(len(text) + 1):
        assert streamed(parser, [text[:cut], text[cut:]])[:2] == whole(parser, text)


def test_mistral_ids_fit_its_template():
    call = TOOL_PARSERS["mistral"]().extract('[TOOL_CALLS][{"name": "f", "arguments": {}}]')
    assert len(call.calls[0].id) == 9 and call.calls[0].id.isalnum()


def test_control_characters_in_strings_come_out_escaped():
    # A grammar's string rule can let a model write a raw control character; clients read the
    # arguments with strict JSON, so they come out escaped, the same whole and streamed.
    text = '[{"name": "a", "arguments": {"s": "x\x00y\ty"}}]'
    parser = JsonArrayToolParser()
    name, args = whole(parser, text)[1][0]
    assert json.loads(args) == {"s": "x\x00y\ty"} and "\x00" not in args
    for cut in range(len(text) + 1):
        assert streamed(parser, [text[:cut], text[cut:]])[:2] == whole(parser, text)
