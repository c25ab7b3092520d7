"""``POST /score`` and ``/rerank`` (``/v1/score``, ``/v1/rerank``, ``/v2/rerank``): how well
texts match, by a cross-encoder or by the cosine of embeddings (vLLM's
``vllm/entrypoints/pooling/score/serving.py``, read to learn).

- A cross-encoder (``BertForSequenceClassification``, one label) reads each pair as one
  prompt, ``[CLS] text_1 [SEP] text_2 [SEP]`` with its segment ids, as the tokenizer builds a
  sentence pair; the score is its logit's sigmoid (``use_activation``, on by default).
- An embedding model embeds every text once; the score is the cosine similarity of the pair.

Inputs pair 1:1, 1:N (the one first text against each second one) or N:N, as vLLM's
``validate_score_input`` allows. ``/rerank`` is Jina's and Cohere's shape: ``query`` against
``documents``, ranked by relevance, ``top_n`` kept.
"""

from __future__ import annotations

import math
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from pagedserve.actors.engine.pooling import PoolingOutput
from pagedserve.gpu.pooling.pooling_params import PoolingParams
from pagedserve.server.errors import OpenAIError
from pagedserve.server.openai.prompts import truncate_ids
from pagedserve.server.pooling.protocol import RerankRequest, ScoreRequest
from pagedserve.server.pooling.serving import PoolingServing, usage
from pagedserve.server.request_body import parse_body


def pair_up(first: list[str], second: list[str]) -> list[tuple[str, str]]:
    """vLLM's pairing rules and its messages."""
    if len(first) > 1 and len(first) != len(second):
        raise OpenAIError("Input lengths must be either 1:1, 1:N or N:N")
    if not first:
        raise OpenAIError("At least one text element must be given")
    if not second:
        raise OpenAIError("At least one text_pair element must be given")
    return list(zip(first * len(second) if len(first) == 1 else first, second, strict=True))


def cosine(a: list[float], b: list[float]) -> float:
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / max(norm, 1e-8)  # torch's cosine_similarity eps


class Scoring:
    """``/score`` and ``/rerank`` over a ``PoolingServing``'s engine and checks."""

    def __init__(self, pooling: PoolingServing):
        self.p = pooling

    def routes(self) -> list[Route]:
        return [Route(path, self.score, methods=["POST"]) for path in ("/score", "/v1/score")] + [
            Route(path, self.rerank, methods=["POST"])
            for path in ("/rerank", "/v1/rerank", "/v2/rerank")]

    async def _scores(self, request: Request, body: ScoreRequest | RerankRequest,
                      pairs: list[tuple[str, str]]) -> tuple[list[float], int] | JSONResponse:
        """Each pair's score and the prompt tokens used (or the 499 of a client gone)."""
        if self.p.info.is_cross_encoder:
            return await self._cross_encoded(request, body, pairs)
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))  # each embedded once
        prompts = [self.p.tokenize(t, True, body) for t in texts]
        for ids in prompts:
            self.p.check_length(ids, "input")
        params = PoolingParams(task="embed", normalize=True)
        outs = await self.p.run(request, "score", prompts, [params] * len(prompts), body)
        if isinstance(outs, JSONResponse):
            return outs
        vec = {t: o.data for t, o in zip(texts, outs, strict=True)}
        return ([cosine(vec[a], vec[b]) for a, b in pairs],
                sum(o.num_prompt_tokens for o in outs))

    async def _cross_encoded(self, request: Request, body, pairs) -> tuple | JSONResponse:
        if self.p.info.num_labels != 1:
            raise OpenAIError(f"scoring needs a classifier with one label; this model has "
                              f"{self.p.info.num_labels}")
        use = body.use_activation if body.use_activation is not None else True
        prompts, params = [], []
        for a, b in pairs:
            enc = self.p.tokenizer(text=a, text_pair=b)
            ids, types = list(enc["input_ids"]), enc.get("token_type_ids")
            keep = len(ids)
            ids = self._truncated(ids, body)
            if types is not None and len(ids) < keep:  # the same tokens' segment ids
                start = 0 if body.truncation_side == "right" else keep - len(ids)
                types = list(types)[start:start + len(ids)]
            self.p.check_length(ids, "input")
            prompts.append(ids)
            params.append(PoolingParams(task="classify", use_activation=use,
                                        token_type_ids=list(types) if types else None))
        outs: list[PoolingOutput] | JSONResponse = await self.p.run(
            request, "score", prompts, params, body)
        if isinstance(outs, JSONResponse):
            return outs
        return [o.data[0] for o in outs], sum(o.num_prompt_tokens for o in outs)

    def _truncated(self, ids: list[int], body) -> list[int]:
        return truncate_ids(ids, body.truncate_prompt_tokens, body.truncation_side,
                            self.p.serving.max_model_len)

    async def score(self, request: Request):
        body: ScoreRequest = await parse_body(request, ScoreRequest)
        self.p.require("score")
        self.p.serving.check_model(body.model)
        pairs = pair_up(*body.pair())
        got = await self._scores(request, body, pairs)
        if isinstance(got, JSONResponse):
            return got
        scores, tokens = got
        return JSONResponse({
            "id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": self.p.serving.config.model_name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": usage(tokens)})

    async def rerank(self, request: Request):
        body: RerankRequest = await parse_body(request, RerankRequest)
        self.p.require("rerank")
        self.p.serving.check_model(body.model)
        if body.top_n < 0:
            raise OpenAIError("top_n must be 0 (all) or more", param="top_n")
        pairs = pair_up([body.query], body.documents)
        got = await self._scores(request, body, pairs)
        if isinstance(got, JSONResponse):
            return got
        scores, tokens = got
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        top = order[: body.top_n] if body.top_n > 0 else order
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": body.documents[i]}} if body.return_documents
                       else {})} for i in top]
        return JSONResponse({
            "id": f"rerank-{uuid.uuid4().hex}", "model": self.p.serving.config.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "results": results})
