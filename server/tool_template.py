"""Which chat template renders a conversation with tools.

A tokenizer whose template knows tools (it reads the ``tools`` variable: Qwen2.5, Llama 3.1+,
Mistral v0.3, Hermes 2 Pro) renders them itself. One that does not would drop the tools
silently and fail on an assistant turn without content (SmolLM2's, for one); for a ChatML
model (``<|im_start|>``) pagedserve then renders with ``HERMES_CHATML``, its own template in
the Hermes ``<tool_call>`` format that the ``hermes`` parser reads. The choice is logged once.
"""

from __future__ import annotations

import structlog
from transformers import PreTrainedTokenizerBase

log = structlog.get_logger(__name__)

# ChatML with the tools listed in the system turn, calls in <tool_call> blocks and results
# in <tool_response> blocks of a user turn (the Hermes function-calling convention).
HERMES_CHATML = """\
{%- if messages and messages[0].role in ['system', 'developer'] -%}
  {%- set system = messages[0].content -%}{%- set rest = messages[1:] -%}
{%- else -%}
  {%- set system = 'You are a helpful assistant.' -%}{%- set rest = messages -%}
{%- endif -%}
{{- '<|im_start|>system\\n' + system -}}
{%- if tools -%}
  {{- '\\n\\n# Tools\\n\\nYou can call functions to help with the user\\'s request. Their '
      'signatures, as JSON, inside <tools></tools>:\\n<tools>' -}}
  {%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
  {{- '\\n</tools>\\n\\nTo call a function, answer with one block per call, each holding a '
      'JSON object with the function\\'s name and arguments:\\n<tool_call>\\n{\\"name\\": '
      '<function name>, \\"arguments\\": <arguments as a JSON object>}\\n</tool_call>' -}}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- for message in rest -%}
  {%- if message.role == 'assistant' -%}
    {{- '<|im_start|>assistant\\n' + (message.content or '') -}}
    {%- for call in message.tool_calls or [] -%}
      {%- if message.content or not loop.first -%}{{- '\\n' -}}{%- endif -%}
      {{- '<tool_call>\\n{\\"name\\": ' + (call.function.name | tojson) + ', \\"arguments\\": '
          + (call.function.arguments | tojson) + '}\\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\\n' -}}
  {%- elif message.role == 'tool' -%}
    {{- '<|im_start|>user\\n<tool_response>\\n' + message.content
        + '\\n</tool_response><|im_end|>\\n' -}}
  {%- else -%}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""


def knows_tools(template: str | None) -> bool:
    """Whether a chat template renders tool definitions (it reads ``tools``)."""
    return template is not None and "tools" in template


def tool_template(tokenizer: PreTrainedTokenizerBase, configured: str | None) -> str | None:
    """The template for conversations with tools: ``--chat-template`` when given, else the
    tokenizer's (``None``) when it knows tools, else ``HERMES_CHATML`` for a ChatML model."""
    if configured is not None:
        return configured
    own = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
    if knows_tools(own):
        log.info("tool_chat_template", template="the tokenizer's")
        return None
    if own is not None and "<|im_start|>" in own:
        log.info("tool_chat_template", template="pagedserve's hermes_chatml",
                 why="the tokenizer's template ignores tools")
        return HERMES_CHATML
    log.warning("tool_chat_template", template="the tokenizer's",
                why="it ignores tools and is not ChatML; pass --chat-template with one that "
                    "renders them")
    return None
