"""Prompts as the engine takes them: batched completion prompts, truncation, and the checks of
the logprob fields that need the vocabulary (vLLM's ``vllm/v1/engine/processor.py``
``_validate_logprobs`` and its renderer's truncation).

A completion's ``prompt`` is a string, a list of token ids, a list of strings or a list of
token-id lists; each prompt of a batch is one engine request per ``n`` (choice index
``prompt_index * n + i``, as vLLM and OpenAI index them).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from pagedserve.server.errors import OpenAIError
from pagedserve.server.openai.protocol import EMPTY_PROMPT

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs; `logprobs` and `prompt_logprobs` both


@dataclass(slots=True)
class PromptInput:
    """One prompt of a request.

    Attributes:
        token_ids: what the engine computes (after truncation).
        text: the prompt's text (echoed, logged): as given, or decoded from the ids.
    """

    token_ids: list[int]
    text: str


def completion_prompts(prompt: Any) -> list[str | list[int]]:
    """The batch of a completion's ``prompt`` field (one entry when it is a single prompt).
    Raises ``OpenAIError`` (400) for a missing or empty one."""
    if not prompt:
        raise OpenAIError(f"prompt: {EMPTY_PROMPT}", param="prompt")
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return list(prompt)


def check_token_ids(ids: Iterable[int], vocab_size: int, param: str) -> None:
    """A 400 on ``param`` naming the first id outside ``[0, vocab_size)``, and the size."""
    for t in ids:
        if not 0 <= t < vocab_size:
            raise OpenAIError(f"{param}: token id {t} is out of vocabulary (the vocabulary "
                              f"has {vocab_size} tokens, ids 0 to {vocab_size - 1})",
                              param=param)


def tokenize(prompt: str | list[int], tokenizer: PreTrainedTokenizerBase, vocab_size: int,
             truncate: int | None, side: str | None, max_model_len: int) -> PromptInput:
    """Token ids (checked against the vocabulary) and text of one prompt, truncated to
    ``truncate`` tokens when set. Raises ``OpenAIError`` (400)."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    else:
        check_token_ids(prompt, vocab_size, "prompt")
        ids = list(prompt)
    if not ids:
        raise OpenAIError(f"prompt: {EMPTY_PROMPT}", param="prompt")
    cut = truncate_ids(ids, truncate, side, max_model_len)
    if isinstance(prompt, str) and len(cut) == len(ids):
        return PromptInput(cut, prompt)
    return PromptInput(cut, tokenizer.decode(cut))


def truncate_ids(ids: list[int], truncate: int | None, side: str | None,
                 max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: keep ``truncate`` tokens (-1: ``max_model_len``),
    the last ones (``side`` ``left``, the default) or the first ones (``right``).
    Raises ``OpenAIError`` for a size over ``max_model_len`` or 0."""
    if truncate is None:
        return ids
    if truncate == -1:
        truncate = max_model_len
    if truncate > max_model_len:
        raise OpenAIError(
            f"truncate_prompt_tokens value ({truncate}) is greater than max_model_len "
            f"({max_model_len}). Please, select a smaller truncation size.",
            param="truncate_prompt_tokens")
    if truncate == 0:
        raise OpenAIError("truncate_prompt_tokens: 0 leaves an empty prompt; give at least 1",
                          param="truncate_prompt_tokens")
    if len(ids) <= truncate:
        return ids
    return ids[:truncate] if side == "right" else ids[-truncate:]


def whole_vocab(k: int | None, vocab_size: int) -> int | None:
    """vLLM's ``-1`` for ``logprobs``/``top_logprobs``/``prompt_logprobs``: every token."""
    return vocab_size if k == -1 else k


def check_logprobs_cap(k: int | None, max_logprobs: int, vocab_size: int, kind: str,
                       param: str) -> None:
    """vLLM's ``--max-logprobs`` rule (``-1``: the vocabulary is the cap), with its words.
    ``k`` is already resolved (``whole_vocab``). Raises ``OpenAIError`` (400)."""
    cap = whole_vocab(max_logprobs, vocab_size)
    if k is not None and k > cap:
        raise OpenAIError(f"Requested {kind} logprobs of {k}, which is greater than max "
                          f"allowed: {cap}", param=param)


def check_logprob_fields(body: Any, vocab_size: int, logprobs: int | None,
                         max_logprobs: int = MAX_LOGPROBS) -> None:
    """``prompt_logprobs`` (-1 means the whole vocabulary, over the default cap: a 400 as in
    vLLM; ``logprobs`` comes resolved and checked by the caller) and ``logprob_token_ids``
    (need ``logprobs``; ids in the vocabulary). Raises ``OpenAIError`` (400)."""
    check_logprobs_cap(whole_vocab(body.prompt_logprobs, vocab_size), max_logprobs,
                       vocab_size, "prompt", "prompt_logprobs")
    ids = body.logprob_token_ids
    if ids is not None:
        if logprobs is None:
            raise OpenAIError("when using `logprob_token_ids`, `logprobs` must be set.",
                              param="logprob_token_ids")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise OpenAIError(f"logprob_token_ids: token id {bad[0]} is out of vocabulary "
                              f"(vocab size {vocab_size})", param="logprob_token_ids")
