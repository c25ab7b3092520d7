"""Which chat template renders a conversation with tools.

A tokenizer whose template knows tools (it reads the ``tools`` variable: Qwen2.5, Llama 3.1+,
Mistral v0.3, Hermes 2 Pro) renders them itself. One that does not would drop the tools
silently and fail on an assistant turn without content (SmolLM2's, for one); for a ChatML
model (``<|im_start|>``) pagedserve then renders with ``HERMES_CHATML``, its own template in
the Hermes ``<tool_call>`` format that the ``hermes`` parser reads. Phi-4-mini's template
takes tools only as a JSON string in a system message's own ``tools`` field (between
``<|tool|>`` and ``<|/tool|>``), never a request's ``tools``: it renders with
``PHI4_MINI_TOOLS`` instead, Phi-4-mini's turns with calls written ``functools[...]``, the
format of vLLM's Phi-4-mini tool template that the ``phi4_mini_json`` parser reads. The choice
is logged once.
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

# Phi-4-mini's turns (``<|role|>content<|end|>``, no newlines), the tools in the system turn
# as JSON schemas with how to call them, calls as one ``functools[...]`` JSON list, results
# as ``tool`` turns (Phi-4-mini's template writes every role as ``<|role|>``).
PHI4_MINI_TOOLS = """\
{%- if messages and messages[0].role in ['system', 'developer'] -%}
  {%- set system = messages[0].content -%}{%- set rest = messages[1:] -%}
{%- else -%}
  {%- set system = 'You are a helpful assistant.' -%}{%- set rest = messages -%}
{%- endif -%}
{{- '<|system|>' + system -}}
{%- if tools -%}
  {{- '\\n\\nYou can call functions when the answer needs them. To call one or more, '
      'answer with the marker functools and one JSON list of the calls, each an object with '
      'the function\\'s name and its arguments: functools[{\\"name\\": <function name>, '
      '\\"arguments\\": <arguments as a JSON object>}, ...]\\nThe functions:' -}}
  {%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
{%- endif -%}
{{- '<|end|>' -}}
{%- for message in rest -%}
  {{- '<|' + message.role + '|>' + (message.content or '') -}}
  {%- if message.role == 'assistant' and message.tool_calls -%}
    {{- 'functools[' -}}
    {%- for call in message.tool_calls -%}
      {%- if not loop.first -%}{{- ', ' -}}{%- endif -%}
      {{- '{\\"name\\": ' + (call.function.name | tojson) + ', \\"arguments\\": ' -}}
      {%- if call.function.arguments is string -%}{{- call.function.arguments -}}
      {%- else -%}{{- call.function.arguments | tojson -}}{%- endif -%}
      {{- '}' -}}
    {%- endfor -%}
    {{- ']' -}}
  {%- endif -%}
  {{- '<|end|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- else -%}{{- eos_token -}}{%- endif -%}
"""


def takes_tools_in_system_turn(template: str | None) -> bool:
    """Whether ``template`` is Phi-4-mini's (tools only inside a system message, between its
    ``<|tool|>`` and ``<|/tool|>`` tokens)."""
    return template is not None and "<|tool|>" in template and "<|/tool|>" in template


def knows_tools(template: str | None) -> bool:
    """Whether a chat template renders tool definitions (it reads ``tools``)."""
    return template is not None and "tools" in template


def tool_template(tokenizer: PreTrainedTokenizerBase, configured: str | None) -> str | None:
    """The template for conversations with tools: ``--chat-template`` when given, else
    ``PHI4_MINI_TOOLS`` for Phi-4-mini's, the tokenizer's (``None``) when it knows tools, else
    ``HERMES_CHATML`` for a ChatML model."""
    if configured is not None:
        return configured
    own = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
    if takes_tools_in_system_turn(own):
        log.info("tool_chat_template", template="pagedserve's phi4_mini_tools",
                 why="the tokenizer's template takes tools only inside a system message")
        return PHI4_MINI_TOOLS
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
