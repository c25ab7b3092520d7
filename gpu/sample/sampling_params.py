"""Per-request sampling parameters (vLLM's ``vllm/sampling_params.py``, trimmed).

Ranges are checked at the HTTP layer; these are plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class StructuredOutputsParams:
    """A guided-decoding constraint (vLLM's ``StructuredOutputsParams``); exactly one of
    ``json``, ``regex``, ``choice``, ``grammar`` (xgrammar's EBNF), ``json_object`` or
    ``structural_tag`` is set.

    Attributes:
        json: a JSON schema (dict or its text).
        regex: the whole output matches this regular expression.
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar in xgrammar's dialect (start rule ``root``).
        json_object: any JSON object.
        structural_tag: an xgrammar structural tag, as JSON text (free text with constrained
            regions, e.g. tool calls once their opening tag is written).
        disable_any_whitespace: JSON in its compact form, no free whitespace between tokens.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None
    disable_any_whitespace: bool = False

    def kinds(self) -> list[str]:
        """The constraint kinds that are set (valid params have exactly one)."""
        set_ = {"json": self.json is not None, "regex": self.regex is not None,
                "choice": self.choice is not None, "grammar": self.grammar is not None,
                "json_object": self.json_object,
                "structural_tag": self.structural_tag is not None}
        return [k for k, on in set_.items() if on]


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    Attributes:
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_p: nucleus sampling mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; 0 or -1 disables it.
        min_p: drop tokens whose probability is below ``min_p`` times the top one's.
        presence_penalty, frequency_penalty: subtracted from the logits of tokens already in
            the output, once / once per occurrence (OpenAI's definitions).
        repetition_penalty: > 1 discourages tokens of the prompt and output (CTRL's rule:
            positive logits divided, negative multiplied).
        logit_bias: token id → bias added to its logit.
        seed: per-request seed; the same seed and prompt give the same output.
        max_tokens: output tokens at most; ``None`` means up to ``max_model_len``.
        min_tokens: EOS and ``stop_token_ids`` are masked until this many tokens exist.
        stop: strings that end the output, matched across token boundaries.
        include_stop_str_in_output: keep the matched stop string in the text.
        stop_token_ids: token ids that end the output besides EOS.
        ignore_eos: keep generating past EOS (benchmarks).
        skip_special_tokens: leave special tokens out of the text.
        logprobs: return this many top alternatives per token (``None`` = no logprobs; 0 = only
            the sampled token's). Values are ``log_softmax`` of the logits sampled from: after
            logit bias, min_tokens, penalties and temperature, before top-k/top-p/min-p.
        logprob_token_ids: with ``logprobs``, the alternatives are these token ids (in this
            order) instead of the top ones (vLLM's ``logprob_token_ids``).
        prompt_logprobs: the logprob of every prompt token and this many top alternatives,
            from the model's raw logits (``None`` = none): ``gpu/sample/prompt_logprobs.py``.
        structured_outputs: a guided-decoding constraint, or ``None``.
        n: the client request's ``n``, for the ``request_params_n`` metric only: a request
            with ``n > 1`` runs as ``n`` engine requests, the first carries ``n``, the others
            0 (not counted), so the metric sees each client request once.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    n: int = 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_history(self) -> bool:
        """Whether sampling looks at the tokens so far (penalties)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
