"""The one place a conversation becomes a prompt: the chat endpoint, ``/v1/responses`` and
``/tokenize`` all render through ``ChatPrompts``, so the ids ``/tokenize`` shows are the ids
the engine computes (vLLM's ``/tokenize`` shares its renderer with the chat endpoint too).

A conversation with tools, or with tool turns in its history, renders with the tool template
(``tool_template``: the tokenizer's when it knows tools, else pagedserve's Hermes ChatML);
any other with ``--chat-template`` or the tokenizer's own.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from pagedserve.server.errors import OpenAIError
from pagedserve.server.openai.prompts import PromptInput
from pagedserve.server.tools.calling import template_messages
from pagedserve.server.tools.template import tool_template


def has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    """Whether a template-shaped conversation holds calls or results."""
    return any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


class ChatPrompts:
    """Renders and tokenizes conversations for one tokenizer and ``--chat-template``."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_template: str | None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.tool_chat_template = tool_template(tokenizer, chat_template)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               kwargs: dict[str, Any] | None = None) -> PromptInput:
        """The prompt's text and ids (not truncated) of template-shaped ``messages``
        (``tool_calling.template_messages``); ``tools``: OpenAI's function dicts, rendered in
        the prompt. Raises ``OpenAIError`` (400, ``param="messages"``) when the template
        rejects the conversation (a role or an order it does not allow)."""
        with_tools = bool(tools) or has_tool_turns(messages)
        template = self.tool_chat_template if with_tools else self.chat_template
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tools=tools or None,
                chat_template=template, **(kwargs or {}))
        except Exception as e:  # jinja raises for roles/orders the template rejects
            raise OpenAIError(f"chat template failed: {e}", param="messages") from e
        # The template writes the special tokens (BOS included) itself.
        return PromptInput(self.tokenizer.encode(text, add_special_tokens=False), text)

    def for_messages(self, messages: list[Any], tools: list[dict[str, Any]] | None = None,
                     add_generation_prompt: bool = True, continue_final_message: bool = False,
                     kwargs: dict[str, Any] | None = None) -> PromptInput:
        """``render`` of a request's ``ChatMessage`` list. Raises ``OpenAIError`` (400) as
        ``render`` and ``template_messages`` do."""
        return self.render(template_messages(messages), tools, add_generation_prompt,
                           continue_final_message, kwargs)
