"""Tool calls on ``/v1/responses``: the request's ``tools``/``tool_choice`` planned exactly as
the chat path plans them (``tool_calling.plan_tools``: the same flags, constraints, parsers and
errors), a call's ``function_call`` output item, and the assistant turn a finished response
adds to the stored conversation.

A function call is an output item of its own in the Responses API (the ``openai`` package's
``ResponseFunctionToolCall``): ``{"type": "function_call", "id", "call_id", "name",
"arguments", "status"}``, ``arguments`` JSON text; the client answers it with a
``function_call_output`` input item naming ``call_id``. (vLLM's
``vllm/entrypoints/openai/serving_responses.py`` builds the same items from its tool parsers.)
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from pagedserve.server.responses.protocol import (
    FunctionTool,
    ResponsesRequest,
    chat_tools,
    history_call,
)
from pagedserve.server.tools.calling import ToolPlan, check_tool_schemas, plan_tools
from pagedserve.server.tools.parsers import ToolCall
from pagedserve.server.tools.protocol import ToolFields

if TYPE_CHECKING:
    from pagedserve.server.openai.serving import Serving


async def plan_response_tools(body: ResponsesRequest, serving: Serving) -> ToolPlan | None:
    """The request's ``ToolPlan`` (``None`` without function tools). Raises ``OpenAIError``
    (400) as the chat path does: ``auto`` where the server serves none, a named tool not in
    ``tools``, duplicate names, a parameter schema xgrammar cannot compile."""
    tools = [t for t in body.tools if isinstance(t, FunctionTool)]
    converted, choice = chat_tools(tools, body.tool_choice)
    if not tools:  # chat_tools refused a choice that needs tools
        return None
    fields = ToolFields.model_validate({"tools": converted, "tool_choice": choice,
                                        "parallel_tool_calls": body.parallel_tool_calls})
    plan = plan_tools(fields, serving.auto_tools)
    await check_tool_schemas(fields.tools or [], serving.engine.compile_grammar)
    return plan


def function_call_item(call_id: str, name: str, arguments: str, status: str,
                       item_id: str | None = None) -> dict[str, Any]:
    """A ``function_call`` output item; ``item_id`` ``None`` = a fresh ``fc_`` id."""
    return {"type": "function_call", "id": item_id or f"fc_{uuid.uuid4().hex}",
            "call_id": call_id, "name": name, "arguments": arguments, "status": status}


def call_items(calls: list[ToolCall], status: str) -> list[dict[str, Any]]:
    return [function_call_item(c.id, c.name, c.arguments, status) for c in calls]


def assistant_turn(output: list[dict[str, Any]]) -> dict[str, Any]:
    """A finished response's output items as the chat turn that continues its conversation:
    the messages' text as ``content``, the calls as ``tool_calls``. A call's arguments that
    are not JSON (cut by ``max_output_tokens``) stay text."""
    text = "".join(part["text"] for item in output if item["type"] == "message"
                   for part in item["content"])
    turn: dict[str, Any] = {"role": "assistant", "content": text}
    calls = []
    for item in output:
        if item["type"] != "function_call":
            continue
        try:
            calls.append(history_call(item["call_id"], item["name"], item["arguments"]))
        except ValueError:
            calls.append({"id": item["call_id"], "type": "function",
                          "function": {"name": item["name"], "arguments": item["arguments"]}})
    if calls:
        turn["tool_calls"] = calls
    return turn
