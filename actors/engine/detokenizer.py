"""Incremental detokenization and stop strings, on the request task's side.

Text comes from tokenizers' ``DecodeStream``, which never emits half a multibyte character.
Text that could be the start of a stop string is held back until it is known not to be one,
so a stop string never reaches the client, even when it spans several tokens
(vLLM's ``vllm/v1/engine/detokenizer.py`` does the same).
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

from pagedserve.gpu.sample.sampling_params import SamplingParams

# Prompt tokens fed as context so the first output token decodes as it would mid-text.
_PROMPT_CONTEXT = 6


class IncrementalDetokenizer:
    """Turns a request's output token ids into text deltas.

    Attributes:
        stop_reason: ``"stop"`` once a stop string matched (the output ends there).
        stop_string: which stop string matched (vLLM's ``CompletionOutput.stop_reason``).
        num_kept: how many of the last ``update``'s tokens belong to the output: all of them,
            or those up to and including the one that completed a stop string (a verify step
            of speculative decoding can accept tokens past it).
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int],
        params: SamplingParams,
    ):
        self._tokenizer = getattr(tokenizer, "backend_tokenizer", None) or tokenizer._tokenizer
        self._stream = DecodeStream(
            ids=list(prompt_token_ids[-_PROMPT_CONTEXT:]),
            skip_special_tokens=params.skip_special_tokens,
        )
        self._stops = [s for s in params.stop if s]
        self._include_stop = params.include_stop_str_in_output
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self.text = ""
        self._emitted = 0
        self.stop_reason: str | None = None
        self.stop_string: str | None = None
        self.num_kept = 0

    def update(self, token_ids: list[int], final: bool) -> str:
        """Feed new tokens; return the text that is safe to send now.

        ``final`` flushes held-back text (the request ended on EOS or a length limit).
        """
        self.num_kept = len(token_ids)
        for i, token_id in enumerate(token_ids):
            piece = self._stream.step(self._tokenizer, token_id)
            if not piece:
                continue
            before = len(self.text)
            self.text += piece
            if self._stops and self._match_stop(max(0, before - self._max_stop + 1)):
                self.num_kept = i + 1
                final = True
                break
        end = len(self.text) if final else len(self.text) - self._holdback()
        delta = self.text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta

    def _match_stop(self, search_from: int) -> bool:
        hits = [(i, s) for s in self._stops if (i := self.text.find(s, search_from)) >= 0]
        if not hits:
            return False
        at, stop = min(hits)
        self.text = self.text[: at + len(stop) if self._include_stop else at]
        self.stop_reason = "stop"
        self.stop_string = stop
        return True

    def _holdback(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        for k in range(min(len(self.text), self._max_stop - 1), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
