"""What a chat request's ``tools`` and ``tool_choice`` mean: validation, the constraint that
makes forced calls valid, the parser that reads the output, and the messages as chat templates
want them. Reusable by any endpoint that takes OpenAI tools (``plan_tools``,
``ToolPlan.parser.extract(text)`` / ``.streamer()``).

The four choices:

* ``none``: the tools are rendered in the prompt, the output is plain content.
* ``auto``: the model decides; the server's tool-call parser (``--tool-call-parser``, else
  the one ``tool_parser_choice`` picks for the model) reads its calls out of the text (a 400
  that says what to set where there is none, or with ``--disable-tool-parser-detection`` and
  not both vLLM flags, as vLLM answers). Where the
  format has a structural tag (hermes, llama3_json), the text is free until the model opens a
  call, and the call is then constrained like a forced one (``tools/parsers/structural.py``); a
  request's own ``response_format`` (or other constraint) takes the place of that one.
* ``required``: the output is constrained (xgrammar, a JSON schema built from the tools'
  parameter schemas) to a JSON array of one or more calls,
  ``[{"name": ..., "arguments": {...}}]`` (one call at most with ``parallel_tool_calls:
  false``), so every call is well formed and its arguments validate, at any temperature.
* a named function: the output is constrained to that function's arguments object.

Forced calls do not need a parser: their format is the grammar's, whatever the model family
(vLLM's choice too).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

from pagedserve.actors.structured_output.manager import GrammarError
from pagedserve.gpu.sample.sampling_params import StructuredOutputsParams
from pagedserve.server.errors import OpenAIError
from pagedserve.server.tools.parser_choice import AutoToolChoice
from pagedserve.server.tools.parsers import TOOL_PARSERS, JsonArrayToolParser, ToolParser
from pagedserve.server.tools.parsers.named import NamedCallParser
from pagedserve.server.tools.protocol import NamedToolChoice, ToolDefinition, ToolFields

Mode = Literal["none", "auto", "required", "named"]
# OpenAI: a function declared without ``parameters`` takes an empty parameter list, so its
# arguments can only be ``{}`` (not any object: a forced call then wrote junk keys).
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {},
                                "additionalProperties": False}


@dataclass(slots=True)
class ToolPlan:
    """One request's tool handling.

    Attributes:
        mode: the effective ``tool_choice``.
        tools: the definitions as the chat template takes them (OpenAI's dicts).
        constraint: the grammar making calls valid (``required``, named, auto where the
            format allows), else ``None``.
        parser: reads calls out of the output; ``None`` for ``none`` (content only).
        forced: the constraint is the request's meaning (``required``, named), so another
            constraint in the request is a conflict; in auto mode it yields to one.
    """

    mode: Mode
    tools: list[dict[str, Any]]
    constraint: StructuredOutputsParams | None
    parser: ToolParser | None
    forced: bool = True


def plan_tools(body: ToolFields, auto: AutoToolChoice) -> ToolPlan | None:
    """The request's plan, ``None`` when it has no tools and no choice; ``auto``: how the
    server serves ``tool_choice: "auto"`` (``tool_parser_choice``). Raises ``OpenAIError``
    (400, ``param`` set) for a choice without tools, an unknown named tool, duplicate names,
    and ``auto`` where the server serves none."""
    tools, choice = body.tools or [], body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise OpenAIError("tool_choice: needs tools (none were given)", param="tool_choice")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise OpenAIError("tools: function names must be unique", param="tools")
    defs = tool_dicts(tools)
    max_calls = None if body.parallel_tool_calls else 1
    if choice is None or choice == "auto":
        if not auto.enabled or auto.parser is None:
            raise OpenAIError(auto.refusal, param="tool_choice")
        parser = TOOL_PARSERS[auto.parser](max_calls=max_calls)
        tag = parser.structural_tag([(t.function.name, parameters_of(t)) for t in tools])
        constraint = None if tag is None else StructuredOutputsParams(structural_tag=tag)
        return ToolPlan("auto", defs, constraint, parser, forced=False)
    if choice == "none":
        return ToolPlan("none", defs, None, None, forced=False)
    if choice == "required":
        schema = required_schema(tools, body.parallel_tool_calls)
        return ToolPlan("required", defs, compact_json(schema),
                        JsonArrayToolParser(max_calls=max_calls, lenient=True))
    if not isinstance(choice, NamedToolChoice):  # pydantic admits nothing else
        raise OpenAIError(f"tool_choice: {choice!r} is not a valid choice", param="tool_choice")
    named = next((t for t in tools if t.function.name == choice.function.name), None)
    if named is None:
        raise OpenAIError(f"tool_choice: no tool named {choice.function.name!r} in tools",
                          param="tool_choice")
    return ToolPlan("named", defs, compact_json(parameters_of(named)),
                    NamedCallParser(named.function.name))


def tool_dicts(tools: list[ToolDefinition]) -> list[dict[str, Any]]:
    """The definitions as chat templates take them (OpenAI's dicts, unset fields left out)."""
    return [t.model_dump(exclude_none=True) for t in tools]


def parameters_of(tool: ToolDefinition) -> dict[str, Any]:
    """The JSON schema a call's arguments must match: the tool's ``parameters``, or
    ``NO_ARGUMENTS`` (only ``{}``) when it declares none."""
    return tool.function.parameters if tool.function.parameters is not None else NO_ARGUMENTS


def compact_json(schema: dict[str, Any]) -> StructuredOutputsParams:
    # Compact: no free whitespace for a model to pad a forced call with.
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def required_schema(tools: list[ToolDefinition], parallel: bool) -> dict[str, Any]:
    """A JSON array of calls, each ``{"name": <one of the tools>, "arguments": <its schema>}``
    (name first, so the arguments stream while the call is being written)."""
    calls = [{
        "type": "object",
        "properties": {"name": {"const": t.function.name}, "arguments": parameters_of(t)},
        "required": ["name", "arguments"], "additionalProperties": False,
    } for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


async def check_tool_schemas(
    tools: list[ToolDefinition],
    compile_grammar: Callable[[StructuredOutputsParams], Awaitable[Any]],
) -> None:
    """Compile each tool's parameter schema (cached): one xgrammar cannot compile is a 400
    naming the tool, whatever the tool choice."""
    for i, tool in enumerate(tools):
        if tool.function.parameters is None:
            continue
        try:
            await compile_grammar(compact_json(tool.function.parameters))
        except GrammarError as e:
            raise OpenAIError(f"tools[{i}].function.parameters ({tool.function.name}): {e}",
                              param="tools") from e


def keeps_special_tokens(parser: ToolParser | None, tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the parser's markers are special tokens of this tokenizer (then the output must
    keep special tokens, or the markers never reach the parser)."""
    if parser is None or not parser.special_markers:
        return False
    special = set(tokenizer.all_special_tokens) | {
        t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    return any(m in special for m in parser.special_markers)


def template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Chat messages as templates take them: text content, an assistant turn's ``tool_calls``
    with ``arguments`` as an object (templates render it with ``tojson``), a tool turn's
    ``tool_call_id``. Raises ``OpenAIError`` for a tool turn without ``tool_call_id`` or
    arguments that are not JSON."""
    out = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.role == "tool":
            if not m.tool_call_id:
                raise OpenAIError(f"messages[{i}]: a tool message needs 'tool_call_id'",
                                  param="messages")
            msg["tool_call_id"] = m.tool_call_id
        if m.name:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [_template_call(c, i) for c in m.tool_calls]
        out.append(msg)
    return out


def _template_call(call: Any, i: int) -> dict[str, Any]:
    try:
        args = json.loads(call.function.arguments)
    except ValueError as e:
        raise OpenAIError(f"messages[{i}].tool_calls: arguments are not JSON: {e}",
                          param="messages") from e
    return {"id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": args}}


def shape_message(message: dict[str, Any], parser: ToolParser, text: str) -> bool:
    """Set a whole answer's ``content`` and ``tool_calls``; whether it has calls."""
    out = parser.extract(text)
    if not out.calls:
        return False
    message["content"] = out.content
    message["tool_calls"] = [c.to_openai() for c in out.calls]
    return True


def finish_reason(finish: str | None, has_calls: bool) -> str | None:
    """OpenAI's ``tool_calls`` for a turn that ended by calling tools."""
    return "tool_calls" if has_calls and finish == "stop" else finish
