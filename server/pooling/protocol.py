"""Request bodies of the pooling endpoints, as pydantic models: ``/v1/embeddings`` (OpenAI's
shape), ``/pooling``, ``/score`` and ``/rerank`` (vLLM's, Jina's and Cohere's shapes).

Names, defaults and ranges after vLLM's ``vllm/entrypoints/pooling/*/protocol.py`` (read to
learn, not copied). Unknown fields are ignored and types are strict, as in ``protocol.py``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from pagedserve.server.openai.protocol import LaxBool, _Body

# A string, a list of strings, a list of token ids, or a list of token-id lists (OpenAI's).
EmbeddingInput = str | list[str] | list[int] | list[list[int]]
ScoreInputs = str | list[str]


class _PoolingBody(_Body):
    """What every pooling endpoint takes (vLLM's ``PoolingBasicRequestMixin``)."""

    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    priority: int = 0
    cache_salt: Annotated[str, Field(min_length=1, max_length=1024)] | None = None


class EmbeddingRequest(_PoolingBody):
    """``POST /v1/embeddings``: one vector per input.

    ``dimensions``: a Matryoshka model's shorter vectors (others refuse it);
    ``encoding_format``: ``float`` lists or ``base64`` of the float32 bytes (little-endian, as
    OpenAI's client decodes them); ``normalize``: vLLM's L2 switch (its newer name is
    ``use_activation``); ``None`` takes the model's default.
    """

    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    add_special_tokens: LaxBool = True
    normalize: LaxBool | None = None
    use_activation: LaxBool | None = None


class PoolingRequest(EmbeddingRequest):
    """``POST /pooling``: vLLM's raw pooling output per input (for an embedding model, the
    embedding; for a classifier, its class scores)."""


class _ScoreOptions(_PoolingBody):
    use_activation: LaxBool | None = None  # a cross-encoder's sigmoid / softmax (default on)


class ScoreRequest(_ScoreOptions):
    """``POST /score`` (``/v1/score``): ``text_1`` against ``text_2``, 1:1, 1:N or N:N.
    vLLM's other spellings are taken too: ``data_1``/``data_2``, ``queries``/``documents``,
    ``queries``/``items``."""

    text_1: ScoreInputs | None = None
    text_2: ScoreInputs | None = None
    data_1: ScoreInputs | None = None
    data_2: ScoreInputs | None = None
    queries: ScoreInputs | None = None
    documents: ScoreInputs | None = None
    items: ScoreInputs | None = None

    @model_validator(mode="after")
    def _one_pair(self) -> ScoreRequest:
        pairs = [(self.text_1, self.text_2), (self.data_1, self.data_2),
                 (self.queries, self.documents if self.documents is not None else self.items)]
        given = [p for p in pairs if p[0] is not None or p[1] is not None]
        if len(given) != 1 or given[0][0] is None or given[0][1] is None:
            raise ValueError("give one pair of inputs: text_1 and text_2 (or data_1 and data_2, "
                             "or queries and documents)")
        return self

    def pair(self) -> tuple[list[str], list[str]]:
        """The two sides, each as a list."""
        for first, second in ((self.text_1, self.text_2), (self.data_1, self.data_2),
                              (self.queries, self.documents or self.items)):
            if first is not None and second is not None:
                return _as_list(first), _as_list(second)
        raise AssertionError("validated by _one_pair")


class RerankRequest(_ScoreOptions):
    """``POST /rerank``, ``/v1/rerank``, ``/v2/rerank`` (Jina's and Cohere's shape): the
    documents ranked by relevance to ``query``; ``top_n`` > 0 keeps that many."""

    query: str
    documents: list[str]
    top_n: int = 0
    return_documents: LaxBool = True


def _as_list(x: ScoreInputs) -> list[str]:
    return [x] if isinstance(x, str) else list(x)
