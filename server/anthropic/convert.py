"""A Messages API body as the chat path's ``ChatCompletionRequest``: the same template, tool
plan, sampling fields and guided decoding as ``/v1/chat/completions`` (vLLM's
``AnthropicServingMessages`` converts its requests to chat ones the same way).

=========================================  ============================================
Anthropic                                   chat
=========================================  ============================================
``system`` (text or text blocks), and       one ``system`` message first
``system`` turns (vLLM's extension)
a user turn's ``tool_result`` blocks        a ``tool`` message each (``tool_call_id``)
a user turn's text blocks                   a ``user`` message (text parts)
an assistant turn's ``tool_use`` blocks     its ``tool_calls`` (``arguments`` as JSON)
a last assistant turn (a prefill)           ``continue_final_message``: the answer
                                            continues that text
``tools`` (``input_schema``)                functions (``parameters``)
``tool_choice`` auto / any / tool / none    ``auto`` / ``required`` / named / ``none``
``disable_parallel_tool_use``               ``parallel_tool_calls: false``
``stop_sequences``, ``max_tokens``,         ``stop``, ``max_tokens``, ``temperature``,
``temperature``, ``top_p``, ``top_k``       ``top_p``, ``top_k``
``output_config.format`` (JSON schema)      ``response_format``
=========================================  ============================================

Image and document blocks are 400s naming the block (the models served here read text).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from pagedserve.server.anthropic.protocol import (
    CountTokensRequest,
    Message,
    MessagesRequest,
    TextBlock,
    ToolResultBlock,
)
from pagedserve.server.errors import OpenAIError
from pagedserve.server.openai.protocol import ChatCompletionRequest
from pagedserve.server.request_body import validation_error

# Claude Code's first system block: a per-request hash that would defeat prefix caching
# (vLLM drops it too).
_BILLING_HEADER = "x-anthropic-billing-header"


def chat_request(body: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat request ``body`` means (only the sampling fields it sets, so that the others
    take the generation config's defaults). Raises ``OpenAIError`` (400) for content this
    server cannot read."""
    messages = chat_messages(body)
    last = body.messages[-1]
    prefill = last.role == "assistant" and not _has(last, "tool_use")
    data: dict[str, Any] = {"model": body.model, "messages": messages,
                            "add_generation_prompt": not prefill,
                            "continue_final_message": prefill}
    if body.chat_template_kwargs is not None:
        data["chat_template_kwargs"] = body.chat_template_kwargs
    data.update(_tool_fields(body))
    if isinstance(body, MessagesRequest):
        data.update(_sampling_fields(body))
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from e


def _sampling_fields(body: MessagesRequest) -> dict[str, Any]:
    data: dict[str, Any] = {"max_tokens": body.max_tokens, "stream": body.stream}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(body, name) is not None:
            data[name] = getattr(body, name)
    if body.stop_sequences:
        data["stop"] = list(body.stop_sequences)
    fmt = body.output_config.format if body.output_config else None
    if fmt is not None:
        data["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": fmt.json_schema}}
    return data


def _tool_fields(body: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    data: dict[str, Any] = {}
    if body.tools:
        data["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description,
            "parameters": {"type": "object", **(t.input_schema or {})}}} for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        named = {"type": "function", "function": {"name": choice.name}}
        data["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
            choice.type, named)
        data["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return data


def system_text(body: MessagesRequest | CountTokensRequest) -> str:
    """The top-level ``system`` and the ``system`` turns' text, one block per line."""
    parts = [] if body.system is None else (
        [body.system] if isinstance(body.system, str) else [b.text for b in body.system])
    for m in body.messages:
        if m.role == "system":
            parts.extend([m.content] if isinstance(m.content, str) else
                         [b.text for b in m.content if isinstance(b, TextBlock)])
    return "\n".join(p for p in parts if p and not p.startswith(_BILLING_HEADER))


def chat_messages(body: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages (dicts of ``ChatMessage``'s fields)."""
    system = system_text(body)
    out: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    for i, m in enumerate(body.messages):
        if m.role == "system":
            continue
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "user":
            out.extend(_user_turn(m, i))
        else:
            out.append(_assistant_turn(m, i))
    return out


def _has(m: Message, kind: str) -> bool:
    return not isinstance(m.content, str) and any(b.type == kind for b in m.content)


def _refuse(block: Any, where: str, role: str) -> None:
    """Raise the 400 for a block this server cannot render in a ``role`` turn."""
    if block.type in ("image", "document"):
        raise OpenAIError(f"{where}: {block.type} content blocks are not supported by this "
                          "server (its model reads text); send text", param="messages")
    raise OpenAIError(f"{where}: a {block.type} block cannot be in a {role} turn",
                      param="messages")


def _user_turn(m: Message, i: int) -> list[dict[str, Any]]:
    """Tool results as ``tool`` messages, the text between them as ``user`` messages, in
    order (Anthropic puts the results first)."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, str]] = []
    for j, block in enumerate(m.content):
        where = f"messages[{i}].content[{j}]"
        if isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ToolResultBlock):
            if parts:
                out.append({"role": "user", "content": parts})
                parts = []
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": _result_text(block, where)})
        elif block.type not in ("thinking", "redacted_thinking"):
            _refuse(block, where, "user")
    if parts or not out:
        out.append({"role": "user", "content": parts})
    return out


def _result_text(block: ToolResultBlock, where: str) -> str:
    if block.content is None or isinstance(block.content, str):
        return block.content or ""
    texts = []
    for k, part in enumerate(block.content):
        if not isinstance(part, TextBlock):
            _refuse(part, f"{where}.content[{k}]", "user")
        texts.append(part.text)
    return "\n".join(texts)


def _assistant_turn(m: Message, i: int) -> dict[str, Any]:
    """Text blocks as the content, ``tool_use`` blocks as its calls; thinking dropped."""
    parts: list[dict[str, str]] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(m.content):
        if isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif block.type == "tool_use":
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input)}})
        elif block.type not in ("thinking", "redacted_thinking"):
            _refuse(block, f"messages[{i}].content[{j}]", "assistant")
    turn: dict[str, Any] = {"role": "assistant", "content": parts if parts or not calls
                            else None}
    if calls:
        turn["tool_calls"] = calls
    return turn
