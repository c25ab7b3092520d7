"""``/score`` and ``/rerank`` (issue 32): a cross-encoder's scores equal transformers'
``BertForSequenceClassification`` sigmoid of each pair, an embedding model's equal the cosine
of transformers' embeddings; vLLM's pairing rules and errors."""

from __future__ import annotations

import pytest
import torch

from tests.server.pooling.test_embeddings import serve_pooling
from tests.server.pooling_models import (
    hf_cross_scores,
    hf_embeddings,
    save_bert,
    save_cross_encoder,
)

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


BAD_BODIES = {
    "/v1/embeddings": [{}, {"input": None}, {"input": 5}, {"input": [[]]}, {"input": [-1]},
                       {"input": [["a"]]}, {"input": "a", "dimensions": "8"},
                       {"input": "a", "dimensions": 0},
                       {"input": "a", "truncate_prompt_tokens": -2},
                       {"input": "a", "truncate_prompt_tokens": 10**6},
                       {"input": "a", "priority": 3}, {"input": "a", "cache_salt": ""}],
    "/pooling": [{"input": {}}, {"input": [1.5]}],
    "/score": [{"text_1": 1, "text_2": "a"}, {"text_1": "a", "text_2": [None]},
               {"text_1": "a", "text_2": "b", "queries": "c", "documents": "d"}],
    "/rerank": [{"query": "a"}, {"query": ["a"], "documents": ["b"]},
                {"query": "a", "documents": ["b"], "top_n": -1},
                {"query": "a", "documents": [1]}],
}


async def test_bad_bodies_are_4xx_and_leak_nothing(bert_dir):
    async with serve_pooling(bert_dir) as (client, _):
        for path, bodies in BAD_BODIES.items():
            for body in bodies:
                r = await client.post(path, json=body)
                assert 400 <= r.status_code < 500, (path, body, r.text)
                error = r.json()["error"]
                assert error["code"] == r.status_code and error["message"], (path, body)
        s = (await client.get("/admin/stats")).json()
        assert s["kv_cache"]["num_free_blocks"] == s["kv_cache"]["num_blocks"]
        assert s["scheduler"]["num_running"] == s["scheduler"]["num_waiting"] == 0
