"""The request bodies of Anthropic's Messages API, as pydantic models: ``POST /v1/messages``
(``MessagesRequest``) and ``POST /v1/messages/count_tokens`` (``CountTokensRequest``).

Names and meanings follow Anthropic's ``MessageCreateParams`` (the ``anthropic`` package's
``types/message_create_params.py``) and vLLM's ``vllm/entrypoints/anthropic/protocol.py``,
which also takes ``system`` turns inside ``messages`` (folded into the system prompt) and
``chat_template_kwargs``. Types are strict as on the OpenAI bodies (``server/openai/protocol.py``),
unknown fields are ignored (``cache_control``, ``thinking``, ``service_tier``, ...), and content
this server cannot honour (image and document blocks, server tools) is a 400 naming it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pagedserve.server.openai.protocol import LaxBool


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ImageBlock(_Body):
    """Accepted by the schema so that the 400 can say what is wrong (a text-only model)."""

    type: Literal["image"]
    source: dict[str, Any] | None = None


class DocumentBlock(_Body):
    """Like ``ImageBlock``: named in a 400, never read."""

    type: Literal["document"]
    source: dict[str, Any] | None = None


class ToolUseBlock(_Body):
    """An assistant turn's call, sent back as history; ``input`` is the arguments object."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any] = Field(default_factory=dict)


ToolResultPart = Annotated[TextBlock | ImageBlock | DocumentBlock, Field(discriminator="type")]


class ToolResultBlock(_Body):
    """A user turn's answer to the call ``tool_use_id``. ``is_error`` is accepted and, as in
    vLLM, not rendered (the content says what went wrong)."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[ToolResultPart] | None = None
    is_error: LaxBool = False


class ThinkingBlock(_Body):
    """A previous turn's reasoning, sent back by clients that keep the whole turn: dropped
    from the prompt (this server makes none, and reasoning of past turns is not context)."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


ContentBlock = Annotated[TextBlock | ImageBlock | DocumentBlock | ToolUseBlock
                         | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class Message(_Body):
    # ``system`` as vLLM takes it (Anthropic's own API wants the top-level field).
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class Tool(_Body):
    """A client tool (``type`` absent or ``custom``); server tools (``bash_...``,
    ``web_search_...``: any other ``type``) are refused by the request's validator."""

    type: str | None = None
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoice(_Body):
    """``auto`` (the model decides), ``any`` (some call, any tool), ``tool`` (a call of
    ``name``), ``none``; ``disable_parallel_tool_use``: at most one call (exactly one for
    ``any`` and ``tool``)."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: LaxBool = False

    @model_validator(mode="after")
    def _name_for_tool(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice: a choice of type 'tool' needs the tool's 'name'")
        if self.type != "tool" and self.name is not None:
            raise ValueError(f"tool_choice: 'name' is only for type 'tool', not {self.type!r}")
        return self


class JsonOutputFormat(_Body):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    """``output_config.format``: the answer's JSON schema (guided decoding, as vLLM maps it
    onto ``response_format``)."""

    format: JsonOutputFormat | None = None


class Metadata(_Body):
    user_id: str | None = None


class _Conversation(_Body):
    """What both bodies render: the model, the system prompt, the turns and the tools."""

    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extra field

    @model_validator(mode="after")
    def _client_tools(self) -> Any:
        for i, tool in enumerate(self.tools or []):
            if tool.type not in (None, "custom"):
                raise ValueError(f"tools: tools[{i}] ({tool.name}) is a server tool of type "
                                 f"{tool.type!r}, which this server does not run; declare a "
                                 "client tool with an input_schema")
            if tool.input_schema is None:
                raise ValueError(f"tools: tools[{i}] ({tool.name}) needs an input_schema")
        return self


class CountTokensRequest(_Conversation):
    """``POST /v1/messages/count_tokens``: the prompt ``POST /v1/messages`` would build."""


class MessagesRequest(_Conversation):
    """``POST /v1/messages``. ``max_tokens`` is required, as in Anthropic's API; the sampling
    fields left out take the generation config's defaults, as on the chat endpoint.
    ``temperature`` and ``top_p`` take the chat endpoint's ranges (vLLM passes them on)."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None
    stream: LaxBool = False
    output_config: OutputConfig | None = None
