"""The request body of ``POST /v1/responses`` (OpenAI's Responses API), as a pydantic model,
and its reduction to what the chat path already takes: chat messages, sampling fields and a
structured-output constraint.

Names, defaults and ranges follow OpenAI's ``ResponseCreateParams`` (the ``openai`` package's
``types/responses/response_create_params.py``) and vLLM's ``ResponsesRequest`` in
``vllm/entrypoints/openai/protocol.py``, which adds the extra sampling fields (``top_k``,
``min_p``, ``repetition_penalty``, ``seed``, ...) we also accept on the chat endpoint. Unknown
fields are ignored, as elsewhere; fields we cannot honour (``background``, images, files,
hosted tools) are a 400 naming them, never silently dropped.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pagedserve.gpu.sample.sampling_params import StructuredOutputsParams
from pagedserve.server.errors import OpenAIError
from pagedserve.server.openai.protocol import _SamplingBody


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class ContentPart(_Body):
    """One part of an input message's content: text in (``input_text``), or a previous
    assistant turn's text (``output_text``), which OpenAI's clients send back as history."""

    type: Literal["input_text", "output_text", "text", "input_image", "input_file",
                  "input_audio", "refusal"]
    text: str | None = None
    refusal: str | None = None


class InputMessage(_Body):
    """An ``EasyInputMessage`` or a full ``ResponseInputItem.Message``/``ResponseOutputMessage``
    (the ``id`` and ``status`` of a replayed output message are accepted and ignored)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]

    def text(self, index: int) -> str:
        """The content's text parts, in order; ``index`` names the item in errors."""
        return parts_text(self.content, f"input[{index}].content")


def parts_text(content: str | list[ContentPart], where: str) -> str:
    """Text content, or its text parts joined; ``where`` names it in errors."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type == "refusal":
            texts.append(part.refusal or "")
        elif part.text is None:
            raise OpenAIError(f"{where}[{j}]: {part.type} is not supported by this server; "
                              "send text", param="input")
        else:
            texts.append(part.text)
    return "".join(texts)


class FunctionCallInput(_Body):
    """A ``function_call`` output item sent back as history (its ``id`` and ``status`` are
    accepted and ignored); ``arguments`` is JSON text."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputInput(_Body):
    """A ``function_call_output`` item: the result of the call ``call_id``, for the model."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[ContentPart]


def history_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """One call of an assistant turn as chat templates take it (``arguments`` an object, which
    they render with ``tojson``). Raises ``ValueError`` when ``arguments`` is not JSON."""
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.loads(arguments)}}


class OtherInputItem(_Body):
    """Any other input item (``reasoning``, ``file_search_call``, ...), or a malformed
    ``message``/``function_call``/``function_call_output``: parsed so that the error can name
    its type."""

    type: str


class FunctionTool(_Body):
    """OpenAI's ``FunctionToolParam``: the Responses API's flat spelling of a function."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class HostedTool(_Body):
    """A tool OpenAI runs itself (``web_search``, ``file_search``, ...): a 400 here."""

    type: str


class NamedFunctionChoice(_Body):
    type: Literal["function"]
    name: str = Field(min_length=1)


ToolChoice = Literal["none", "auto", "required"] | NamedFunctionChoice


class TextFormat(_Body):
    """``text.format``: plain text, any JSON object, or JSON following ``schema``."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    # ``schema`` shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat = Field(default_factory=TextFormat)


_ITEM_NEEDS = {
    "message": "role user, assistant, system or developer; text content",
    "function_call": "'call_id', 'name' and 'arguments', a JSON string",
    "function_call_output": "'call_id' and 'output', text",
}


class ResponsesRequest(_Body):
    """``POST /v1/responses``; ``input`` is a string (one user message) or a list of items."""

    model: str | None = None
    input: str | list[InputMessage | FunctionCallInput | FunctionCallOutputInput
                      | OtherInputItem] = Field(min_length=1)
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, min_length=1)
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    background: bool = False
    text: TextConfig = Field(default_factory=TextConfig)
    tools: list[FunctionTool | HostedTool] = Field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    # vLLM's extra sampling fields, as on the chat endpoint.
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    priority: int = 0
    cache_salt: str | None = Field(default=None, min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_absent(cls, data: Any) -> Any:
        # Clients send ``"temperature": null`` and the like for "not set".
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _check(self) -> ResponsesRequest:
        if self.background:
            raise ValueError("background: background responses are not supported")
        if isinstance(self.input, list):
            for i, item in enumerate(self.input):
                if isinstance(item, OtherInputItem) and item.type in _ITEM_NEEDS:
                    raise ValueError(f"input: item {i} is not a valid {item.type} "
                                     f"({_ITEM_NEEDS[item.type]})")
                if isinstance(item, OtherInputItem):
                    raise ValueError(
                        f"input: item {i} has type {item.type!r}; this server takes message, "
                        "function_call and function_call_output items")
        for i, tool in enumerate(self.tools):
            if isinstance(tool, HostedTool) and tool.type == "function":
                raise ValueError(f"tools: tool {i} is not a valid function tool (a non-empty "
                                 "'name'; 'parameters' a JSON schema object)")
            if isinstance(tool, HostedTool):
                raise ValueError(f"tools: tool type {tool.type!r} is not supported; only "
                                 "'function' tools")
        fmt = self.text.format
        if fmt.type == "json_schema" and (fmt.json_schema is None or not fmt.name):
            raise ValueError("text.format: type json_schema needs 'name' and 'schema'")
        return self

    def messages(self) -> list[dict[str, Any]]:
        """``input`` as chat messages (``{"role", "content"}``), ``instructions`` not included:
        a follow-up turn does not inherit them (as OpenAI documents). ``function_call`` items
        join the assistant turn before them (or start one) as its ``tool_calls``; a
        ``function_call_output`` is a ``tool`` turn with its ``tool_call_id``."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict[str, Any]] = []
        for i, item in enumerate(self.input):
            if isinstance(item, InputMessage):
                out.append({"role": item.role, "content": item.text(i)})
            elif isinstance(item, FunctionCallOutputInput):
                out.append({"role": "tool", "tool_call_id": item.call_id,
                            "content": parts_text(item.output, f"input[{i}].output")})
            elif isinstance(item, FunctionCallInput):
                try:
                    call = history_call(item.call_id, item.name, item.arguments)
                except ValueError as e:
                    raise OpenAIError(f"input[{i}].arguments: not JSON: {e}",
                                      param="input") from e
                if not out or out[-1]["role"] != "assistant":
                    out.append({"role": "assistant", "content": ""})
                out[-1].setdefault("tool_calls", []).append(call)
        return out

    def structured_outputs_params(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """``text.format`` as the guided-decoding constraint, and ``text.format`` as the
        ``param`` of a compile error (the same duck type as the chat bodies' method)."""
        fmt = self.text.format
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True), "text.format"
        if fmt.type == "json_schema":
            return StructuredOutputsParams(json=fmt.json_schema), "text.format"
        return None, None

    def sampling_body(self) -> _SamplingBody:
        """The chat path's sampling fields, for ``Serving``'s validation and ``_start``."""
        # Only the fields sent: the others take the generation config's defaults there.
        names = ("model", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "seed", "stop", "priority",
                 "cache_salt")
        return _SamplingBody(**{k: getattr(self, k) for k in names if k in self.model_fields_set})


def chat_tools(tools: list[FunctionTool], tool_choice: ToolChoice
               ) -> tuple[list[dict[str, Any]], str | dict[str, Any]]:
    """The Responses API's ``tools`` and ``tool_choice`` in the chat-completions shape
    (``{"type": "function", "function": {"name", "description", "parameters"}}`` and
    ``"auto"``/``"none"``/``"required"``/``{"type": "function", "function": {"name"}}``).

    This is the one place the two spellings meet: ``tool_calling.plan_tools`` renders and
    constrains tool calls from the chat-completions shape, and ``responses_tools`` passes it
    this function's result.

    Raises:
        OpenAIError: a named ``tool_choice`` that is not among ``tools``; ``tool_choice``
            other than ``none`` with no tools (400, ``param="tool_choice"``).
    """
    converted = []
    for tool in tools:
        function: dict[str, Any] = {"name": tool.name}
        if tool.parameters is not None:  # none: no arguments (``tool_calling.parameters_of``)
            function["parameters"] = tool.parameters or {"type": "object"}
        if tool.description is not None:
            function["description"] = tool.description
        if tool.strict is not None:
            function["strict"] = tool.strict
        converted.append({"type": "function", "function": function})
    names = {t.name for t in tools}
    if isinstance(tool_choice, NamedFunctionChoice):
        if tool_choice.name not in names:
            raise OpenAIError(f"tool_choice: function {tool_choice.name!r} is not in tools",
                              param="tool_choice")
        return converted, {"type": "function", "function": {"name": tool_choice.name}}
    if tool_choice == "required" and not tools:
        raise OpenAIError("tool_choice: 'required' needs at least one tool in tools",
                          param="tool_choice")
    return converted, tool_choice
