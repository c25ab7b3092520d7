"""Request bodies of the OpenAI API, as pydantic models (vLLM's ``entrypoints/openai/protocol.py``
is the reference for names and ranges). Unknown fields are ignored, as vLLM does."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from server.structured_output import StructuredOutputFields


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _SamplingBody(StructuredOutputFields, _Body):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    priority: int = 0  # vLLM: lower runs earlier; needs --scheduling-policy priority
    cache_salt: str | None = Field(default=None, min_length=1)  # prefix-cache isolation
    return_token_ids: bool = False  # vLLM: choices carry token_ids, the answer prompt_token_ids


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class CompletionRequest(_SamplingBody):
    prompt: str = Field(min_length=1)
