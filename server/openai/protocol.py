"""Request bodies of the OpenAI API, as pydantic models.

vLLM's ``vllm/entrypoints/openai/protocol.py`` is the reference for names, defaults and ranges;
where it and OpenAI differ we follow vLLM (extra sampling fields such as ``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``; ``max_tokens`` absent means "up to the
context limit"). Unknown fields are ignored, as vLLM does.

Types are strict, as OpenAI's are: ``"max_tokens": "12"`` is a 400, not silently coerced (an
integer is still a valid float). Booleans are the exception, lax as in vLLM's models (pydantic's
default): ``"logprobs": "true"``, ``"yes"``, ``1`` are true, and clients that send them (vLLM's
own tests do) work here too; ``"maybe"`` or ``5`` is still a 400.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator, model_validator

from pagedserve.server.openai.structured_output_fields import StructuredOutputFields
from pagedserve.server.tools.protocol import (
    ToolCallInHistory,
    ToolDefinition,
    ToolFields,
    check_tool_names,
)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


# pydantic's lax booleans ("true"/"false", "1"/"0", "yes"/"no", "on"/"off", 0/1), as vLLM takes.
LaxBool = Annotated[bool, Strict(False)]

_TOKEN_ID_KEY = re.compile(r"-?[0-9]+")  # ASCII digits only: int() also takes "٣", not "²"


EMPTY_PROMPT = "Either prompt or prompt_embeds must be provided and non-empty."  # vLLM's words


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    # Any role: the chat template renders what it knows (vLLM passes custom roles through).
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallInHistory] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        # Before the union's own errors ("Input should be a valid string"), which mislead.
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(f"this server takes text content parts only, not "
                                     f"{ascii(kind)} parts")
        return content

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        # As OpenAI: only an assistant turn may come without content.
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs 'content'")
        return self

    def text(self) -> str:
        """All text parts, in order."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(_Body):
    include_usage: LaxBool = False
    continuous_usage_stats: LaxBool = False


class _SamplingBody(StructuredOutputFields, _Body):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # int64, as vLLM
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: LaxBool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    include_stop_str_in_output: LaxBool = False
    skip_special_tokens: LaxBool = True
    n: int = Field(default=1, ge=1, le=128)
    stream: LaxBool = False
    stream_options: StreamOptions | None = None
    priority: int = 0  # vLLM: lower runs earlier; needs --scheduling-policy priority
    cache_salt: str | None = Field(default=None, min_length=1)  # prefix-cache isolation
    return_token_ids: LaxBool = False  # vLLM: choices carry token_ids, the answer prompt_token_ids
    # vLLM's disaggregated prefill/decode fields (do_remote_decode, do_remote_prefill,
    # remote_engine_id, remote_block_ids, remote_host, remote_port), for the KV connector;
    # the answer carries the connector's reply under the same name.
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's logprob and prompt fields (checks needing the vocabulary: server/openai/prompts.py).
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = Field(default=None, min_length=1)
    return_tokens_as_token_ids: LaxBool = False
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, lt=2**63)
    truncation_side: Literal["left", "right"] | None = None
    # Beam search (vLLM's fields; n is the width; server/openai/beam_search.py).
    use_beam_search: LaxBool = False
    # Finite and within ±10 (vLLM takes any float): past that, length ** penalty leaves
    # float32 for a few thousand tokens and only the length ranks (actors/beam/search.py).
    length_penalty: float = Field(default=1.0, ge=-10.0, le=10.0, allow_inf_nan=False)
    early_stopping: bool | Literal["never"] = False

    @model_validator(mode="after")
    def _check(self) -> Any:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.logit_bias:
            for key, bias in self.logit_bias.items():
                if not _TOKEN_ID_KEY.fullmatch(key):
                    raise ValueError(f"logit_bias: key {key!r} is not a token id")
                if not -100 <= bias <= 100:
                    raise ValueError(f"logit_bias: bias {bias} not in [-100, 100]")
        k = self.prompt_logprobs
        if k is not None and k < -1:
            raise ValueError("prompt_logprobs: `prompt_logprobs` must be a positive value or -1.")
        if k is not None and self.stream and k != 0:  # as vLLM: no prompt logprobs in a stream
            raise ValueError("prompt_logprobs: `prompt_logprobs` are not available when "
                             "`stream=True`.")
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(ToolFields, _SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: LaxBool = False
    top_logprobs: int | None = None  # -1: the whole vocabulary (capped: --max-logprobs)
    add_generation_prompt: LaxBool = True
    continue_final_message: LaxBool = False
    echo: LaxBool = False  # vLLM: the last message, if the assistant's, prefixes the answer
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> Any:
        k = self.top_logprobs
        if k is not None and k < -1:
            raise ValueError("top_logprobs: `top_logprobs` must be a positive value or -1.")
        if k and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        check_continuation(self.messages, self.add_generation_prompt,
                           self.continue_final_message)
        return self


def check_continuation(messages: list[ChatMessage], add_generation_prompt: bool,
                       continue_final_message: bool) -> None:
    """``continue_final_message`` continues the last turn: it must be the assistant's, and no
    new turn may be opened after it. Raises ``ValueError`` (a 400 on that field)."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message: cannot be used with add_generation_prompt")
    if continue_final_message and messages[-1].role != "assistant":
        raise ValueError("continue_final_message: the last message must be the assistant's")


class CompletionRequest(_SamplingBody):
    # One prompt (text or token ids) or a batch of them: one choice per prompt and n. Missing
    # or empty: a 400 in words (server/openai/prompts.py), not pydantic's.
    prompt: str | list[int] | list[str] | list[list[int]] | None = None
    echo: LaxBool = False
    logprobs: int | None = None  # -1: the whole vocabulary (capped: --max-logprobs)

    @model_validator(mode="after")
    def _check_prompt(self) -> Any:
        if not self.prompt:
            raise ValueError(f"prompt: {EMPTY_PROMPT}")
        if self.logprobs is not None and self.logprobs < -1:
            raise ValueError("logprobs: `logprobs` must be a positive value or -1.")
        return self


class TokenizeRequest(_Body):
    """vLLM's ``/tokenize``: a ``prompt``, or chat ``messages`` (with the chat request's
    ``tools``, ``add_generation_prompt``, ``continue_final_message`` and
    ``chat_template_kwargs``), rendered as the chat endpoint renders them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDefinition] | None = None
    add_special_tokens: LaxBool = True
    add_generation_prompt: LaxBool = True
    continue_final_message: LaxBool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: LaxBool = False

    @model_validator(mode="after")
    def _one_input(self) -> Any:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give exactly one of prompt or messages")
        if self.messages is None:
            if self.tools is not None:
                raise ValueError("tools: only with messages")
            return self
        check_tool_names(self.tools)
        check_continuation(self.messages, self.add_generation_prompt,
                           self.continue_final_message)
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
