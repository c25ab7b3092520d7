"""``/score`` and ``/rerank`` (issue 32): a cross-encoder's scores equal transformers'
``BertForSequenceClassification`` sigmoid of each pair, an embedding model's equal the cosine
of transformers' embeddings; vLLM's pairing rules and errors."""

from __future__ import annotations

import pytest
import torch

from tests.server.pooling_models import (
    hf_cross_scores,
    hf_embeddings,
    save_bert,
    save_cross_encoder,
)
from tests.server.test_embeddings import serve_pooling

QUERY = "what is the capital of france?"
DOCS = ["paris is the capital of france.", "a cat sat on the mat.", "the river was cold."]


@pytest.fixture(scope="module")
def cross_dir(tmp_path_factory):
    return save_cross_encoder(tmp_path_factory.mktemp("tiny-cross"))


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return save_bert(tmp_path_factory.mktemp("tiny-bert"))


async def test_cross_encoder_score_and_rerank_equal_transformers(cross_dir):
    want = hf_cross_scores(cross_dir, [(QUERY, d) for d in DOCS])
    async with serve_pooling(cross_dir, runner="auto") as (client, _):
        r = await client.post("/score", json={"text_1": QUERY, "text_2": DOCS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-5)
        pairs = (await client.post("/v1/score", json={"queries": [QUERY, DOCS[0]],
                                                      "documents": DOCS[1:]})).json()
        want_nn = hf_cross_scores(cross_dir, [(QUERY, DOCS[1]), (DOCS[0], DOCS[2])])
        assert [d["score"] for d in pairs["data"]] == pytest.approx(want_nn, abs=1e-5)
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            ranked = (await client.post(path, json={"query": QUERY, "documents": DOCS,
                                                    "top_n": 2})).json()
            order = sorted(range(3), key=lambda i: -want[i])[:2]
            assert [x["index"] for x in ranked["results"]] == order
            assert [x["relevance_score"] for x in ranked["results"]] == pytest.approx(
                [want[i] for i in order], abs=1e-5)
            assert ranked["results"][0]["document"]["text"] == DOCS[order[0]]
            assert ranked["usage"]["total_tokens"] > 0
        r = await client.post("/v1/embeddings", json={"input": "x"})
        assert r.json()["error"]["message"] == "The model does not support Embeddings API"
        raw = (await client.post("/pooling", json={"input": QUERY})).json()
        assert len(raw["data"][0]["data"]) == 1


async def test_embedding_model_scores_by_cosine(bert_dir):
    q, *docs = hf_embeddings(bert_dir, [QUERY, *DOCS], "CLS")
    want = [torch.nn.functional.cosine_similarity(q, d, dim=0).item() for d in docs]
    async with serve_pooling(bert_dir) as (client, _):
        body = (await client.post("/score", json={"text_1": QUERY, "text_2": DOCS})).json()
        assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-5)
        ranked = (await client.post("/rerank", json={"query": QUERY, "documents": DOCS})).json()
        assert [x["relevance_score"] for x in ranked["results"]] == pytest.approx(
            sorted(want, reverse=True), abs=1e-5)
        for bad, message in (
                ({"text_1": ["a", "b"], "text_2": ["a", "b", "c"]},
                 "Input lengths must be either 1:1, 1:N or N:N"),
                ({"text_1": [], "text_2": ["a"]}, "At least one text element must be given"),
                ({"text_1": "a", "text_2": []}, "At least one text_pair element must be given"),
                ({"text_1": "a"}, "give one pair of inputs")):
            r = await client.post("/score", json=bad)
            assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
        r = await client.post("/rerank", json={"query": "a", "documents": "b"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "documents"
