"""Which tool-call parser reads a model's ``tool_choice: "auto"`` calls, decided once at start.

vLLM answers every ``auto`` request (the default whenever a request has ``tools``, so every
framework's second turn of a tool loop) with a 400 unless the server was started with
``--enable-auto-tool-choice --tool-call-parser NAME``. pagedserve picks the parser itself when
no flag names one: from the chat template that renders tools (the format it writes calls in),
else from the tokenizer's special tokens (the model family):

============================================  =============
template writes / vocabulary has               parser
============================================  =============
``<tool_call>`` (Qwen2/2.5/3, Hermes, our
ChatML template: SmolLM2)                      ``hermes``
``[TOOL_CALLS]`` (Mistral v0.3, Mixtral)       ``mistral``
``<|start_header_id|>`` (Llama 3.x)            ``llama3_json``
``functools[`` (Phi-4-mini: pagedserve's
``PHI4_MINI_TOOLS``, vLLM's Phi-4-mini
tool template)                                 ``phi4_mini_json``
``<|im_start|>`` (other ChatML models)          ``hermes``
none of them (Gemma 2/3, Phi-3/3.5,
Mistral v0.1/v0.2)                             none
============================================  =============

Gemma 2/3 have no call format of their own (vLLM has no parser for them either); vLLM's users
run Gemma 3 with ``--tool-call-parser pythonic`` and a template that asks for Python-style
calls (vLLM's ``examples/tool_chat_template_gemma3_pythonic.jinja``), which works here the same
way (``--chat-template``).

(``tests/server/test_family_templates.py`` checks each on a template modelled on the family's.)

``--tool-call-parser`` overrides the choice; ``--disable-tool-parser-detection`` restores
vLLM's rule (``auto`` needs both flags).
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
from transformers import PreTrainedTokenizerBase

log = structlog.get_logger(__name__)

# (marker, parser): a template's call format first, most specific first; the same markers
# then name the family from the vocabulary.
_MARKERS: tuple[tuple[str, str], ...] = (
    ("<tool_call>", "hermes"),
    ("functools[", "phi4_mini_json"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|start_header_id|>", "llama3_json"),
    ("<|im_start|>", "hermes"),
)


@dataclass(slots=True, frozen=True)
class AutoToolChoice:
    """How ``tool_choice: "auto"`` is served.

    Attributes:
        parser: the ``--tool-call-parser`` name that reads auto calls; ``None``: none.
        enabled: whether ``auto`` is served at all (else a 400 with ``refusal``).
        source: where ``parser`` came from: ``"--tool-call-parser"``, ``"chat template"``,
            ``"vocabulary"``, or ``"none"``.
        refusal: the 400's message when not ``enabled``.
    """

    parser: str | None
    enabled: bool
    source: str
    refusal: str = ""


def detect_tool_parser(tokenizer: PreTrainedTokenizerBase, template: str | None,
                       ) -> tuple[str, str] | None:
    """(parser, ``"chat template"`` or ``"vocabulary"``) for a model whose tool template is
    ``template`` (``None``: the tokenizer's own); ``None`` when nothing names a format."""
    own = tokenizer.chat_template
    texts = [template] if template is not None else (
        list(own.values()) if isinstance(own, dict) else [own])
    text = "\n".join(t for t in texts if isinstance(t, str))
    for marker, parser in _MARKERS:
        if marker in text:
            return parser, "chat template"
    vocab = tokenizer.get_vocab()
    for marker, parser in _MARKERS:
        if marker in vocab:
            return parser, "vocabulary"
    return None


def resolve_auto_tool_choice(tokenizer: PreTrainedTokenizerBase, tool_template: str | None,
                             tool_call_parser: str | None, enable_auto_tool_choice: bool,
                             disable_detection: bool) -> AutoToolChoice:
    """The server's ``AutoToolChoice`` from its flags and model (logged once as
    ``tool_call_parser``). ``tool_template``: the template conversations with tools render
    with (``tool_template.tool_template``)."""
    if disable_detection:  # vLLM's rule: both flags, or no auto
        enabled = enable_auto_tool_choice and tool_call_parser is not None
        choice = AutoToolChoice(
            tool_call_parser, enabled, "--tool-call-parser" if tool_call_parser else "none",
            "" if enabled else '"auto" tool choice requires --enable-auto-tool-choice and '
            "--tool-call-parser to be set on the server (or send tool_choice \"required\", a "
            'named function, or "none")')
    elif tool_call_parser is not None:
        choice = AutoToolChoice(tool_call_parser, True, "--tool-call-parser")
    elif (found := detect_tool_parser(tokenizer, tool_template)) is not None:
        choice = AutoToolChoice(found[0], True, found[1])
    else:
        choice = AutoToolChoice(
            None, False, "none",
            '"auto" tool choice needs a tool-call parser, and none matches this model\'s chat '
            "template: start the server with --tool-call-parser NAME (or send tool_choice "
            '"required", a named function, or "none")')
    if choice.enabled:
        log.info("tool_call_parser", parser=choice.parser, source=choice.source,
                 auto_tool_choice=True)
    else:
        log.warning("tool_call_parser", parser=choice.parser, source=choice.source,
                    auto_tool_choice=False, hint=choice.refusal)
    return choice
