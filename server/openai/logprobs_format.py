"""Logprobs as the OpenAI API (and vLLM's extensions) shape them.

- Completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``; each
  ``top_logprobs`` entry is a dict ``{token text: logprob}`` holding the chosen token and the
  top alternatives (so ``logprobs: 0`` gives the chosen token's entry alone), ``None`` for an
  echoed prompt's first token, whose logprob is ``None`` too.
- Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``.
- ``prompt_logprobs`` (vLLM): ``[None, {"<token id>": {"logprob", "rank", "decoded_token"}},
  ...]``, one per prompt token, the prompt token's own entry first, then the top ones.

``return_tokens_as_token_ids`` writes every token of the logprobs as ``token_id:N`` (vLLM's
``_get_decoded_token``), for tokens whose text alone is not valid UTF-8. Logprobs below
-9999 (``-inf`` of a masked token) are written as -9999, which JSON can carry (vLLM's clamp).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from pagedserve.gpu.sample.sampler import TokenLogprobs

_FLOOR = -9999.0


def _clamp(v: float) -> float:
    return v if v > _FLOOR else _FLOOR


@dataclass(slots=True)
class LogprobsFormatter:
    """Token texts (cached per id) and the three logprob shapes of one response."""

    tokenizer: PreTrainedTokenizerBase
    as_token_ids: bool = False  # return_tokens_as_token_ids
    _text: dict[int, str] = field(default_factory=dict)

    def text(self, token_id: int) -> str:
        """The token's own text: what it adds to the output when decoded alone."""
        if token_id not in self._text:
            self._text[token_id] = self.tokenizer.decode([token_id])
        return self._text[token_id]

    def token(self, token_id: int) -> str:
        """The token as the logprobs name it."""
        return f"token_id:{token_id}" if self.as_token_ids else self.text(token_id)

    def completion(self, token_ids: list[int], lps: list[TokenLogprobs | None],
                   offset: int) -> dict:
        """Completions' logprobs of ``token_ids`` (``None`` entries: an echoed prompt's first
        token); ``offset``: where the first token's text starts in the choice's text."""
        tokens, values, tops, offsets = [], [], [], []
        for t, lp in zip(token_ids, lps):
            tokens.append(self.token(t))
            offsets.append(offset)
            offset += len(self.text(t))
            if lp is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(_clamp(lp.logprob))
            top = {self.token(t): _clamp(lp.logprob)}
            for i, v in zip(lp.top_ids, lp.top_logprobs):
                top.setdefault(self.token(i), _clamp(v))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}

    def chat(self, token_ids: list[int], lps: list[TokenLogprobs]) -> dict:
        content = []
        for t, lp in zip(token_ids, lps):
            tok = self.token(t)
            content.append({
                "token": tok, "logprob": _clamp(lp.logprob), "bytes": list(tok.encode()),
                "top_logprobs": [
                    {"token": self.token(i), "logprob": _clamp(v),
                     "bytes": list(self.token(i).encode())}
                    for i, v in zip(lp.top_ids, lp.top_logprobs)],
            })
        return {"content": content}

    def prompt(self, prompt_ids: list[int], lps: list[TokenLogprobs]) -> list[dict | None]:
        """vLLM's ``prompt_logprobs``: ``lps`` holds one entry per prompt token after the
        first; the token's own entry carries its rank, the top ones ranks 1, 2, ..."""
        out: list[dict | None] = [None]
        for t, lp in zip(prompt_ids[1:], lps):
            entry = {str(t): {"logprob": _clamp(lp.logprob), "rank": lp.rank,
                              "decoded_token": self.text(t)}}
            for rank, (i, v) in enumerate(zip(lp.top_ids, lp.top_logprobs), start=1):
                entry.setdefault(str(i), {"logprob": _clamp(v), "rank": rank,
                                          "decoded_token": self.text(i)})
            out.append(entry)
        return out
