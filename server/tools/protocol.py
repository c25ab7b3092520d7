"""The tool-calling fields of a chat request, as OpenAI's Chat Completions API spells them:
``tools`` (function definitions with JSON-schema parameters), ``tool_choice`` and
``parallel_tool_calls``; and, in the history, an assistant turn's ``tool_calls`` and a
``tool`` turn's ``tool_call_id``. What they mean for a request is ``tool_calling``'s job.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class FunctionDefinition(_Body):
    name: str = Field(default="", max_length=64)  # required: checked in ToolFields
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none = no arguments (`{}`)
    strict: bool | None = None


class ToolDefinition(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: FunctionName


class FunctionCallInHistory(_Body):
    name: str
    arguments: str  # JSON text, as the server sent it


class ToolCallInHistory(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallInHistory


class ToolFields(BaseModel):
    """Mixed into the chat request body. ``tool_choice`` absent means ``auto`` when there are
    tools, else ``none`` (OpenAI's defaults)."""

    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _named_tools(self) -> ToolFields:
        check_tool_names(self.tools)
        return self


def check_tool_names(tools: list[ToolDefinition] | None) -> None:
    """Every function needs a name. Raises ``ValueError`` (a 400 on ``tools``)."""
    for i, tool in enumerate(tools or []):
        if not tool.function.name:
            raise ValueError(f"tools: tools[{i}].function.name is required")
