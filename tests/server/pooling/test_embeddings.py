"""Pooling models served for real (issue 32): embeddings of SmolLM2 (last-token and mean
pooling) and of a tiny random BERT equal transformers' hidden states pooled the same way
(float32, 1e-5), batched and alone, through the official ``openai`` client on a loopback
server; chunked prefill and prefix caching leave them unchanged; the errors vLLM gives."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import httpx
import numpy as np
import openai
import pytest
import torch

from pagedserve.actors.engine.async_engine import AsyncEngine
from pagedserve.gpu.pooling.pooling_params import PoolerConfig, PoolingType
from pagedserve.server.launch import running_server
from pagedserve.server.openai.serving import ServingConfig
from tests.conftest import TINY_NAME, engine_config, stats
from tests.server.pooling_models import hf_embeddings, save_bert

TEXTS = ["The capital of France is Paris, a city on a river.",
         "A cat sat on the mat in the warm sun.",
         "Cold blue rain."]
ATOL = 1e-5


@asynccontextmanager
async def serve_pooling(model_dir, runner="pooling", convert="auto", pooler=None, **kw):
    """An engine for ``model_dir`` with the pooling flags, behind a real Hypercorn server;
    yields ``(httpx client, openai client)``."""
    config = engine_config(model_dir, **kw)
    config.model.runner, config.model.convert, config.model.pooler_config = (
        runner, convert, pooler)
    engine = await AsyncEngine.start(config)
    try:
        async with running_server(engine, ServingConfig(TINY_NAME)) as url:
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                yield client, openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
    finally:
        await engine.shutdown()


def assert_close(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(g, dtype=torch.float32), w, atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return save_bert(tmp_path_factory.mktemp("tiny-bert"))


async def test_smollm2_last_token_embeddings_equal_transformers(default_model_dir):
    want = hf_embeddings(default_model_dir, TEXTS, "LAST")
    async with serve_pooling(default_model_dir, convert="embed", max_num_batched_tokens=64,
                             max_model_len=256) as (client, oai):
        batch = await oai.embeddings.create(model=TINY_NAME, input=TEXTS)  # base64 on the wire
        assert [d.index for d in batch.data] == [0, 1, 2]
        assert_close([d.embedding for d in batch.data], want)
        alone = await oai.embeddings.create(model=TINY_NAME, input=TEXTS[1],
                                            encoding_format="float")
        assert_close([alone.data[0].embedding], want[1:2])
        # Twice: the second reads the first's full blocks from the prefix cache (LAST pooling
        # takes hits; only the tail is computed) and gets the same vector.
        long = " ".join(TEXTS * 2)
        want_long = hf_embeddings(default_model_dir, [long], "LAST")
        for hits in (False, True):
            before = (await stats(client))["kv_cache"]["prefix_cache_hits"]
            again = await oai.embeddings.create(model=TINY_NAME, input=long,
                                                encoding_format="float")
            assert ((await stats(client))["kv_cache"]["prefix_cache_hits"] > before) is hits
            assert_close([again.data[0].embedding], want_long)
        assert batch.usage.prompt_tokens == batch.usage.total_tokens > 20


async def test_smollm2_mean_pooling_chunked_equals_transformers(default_model_dir):
    """16-token steps split every prompt into chunks: the mean is accumulated across them;
    repeated prompts read no cached block (MEAN needs every token's hidden state)."""
    want = hf_embeddings(default_model_dir, TEXTS, "MEAN")
    async with serve_pooling(default_model_dir, convert="embed", max_num_batched_tokens=16,
                             max_model_len=256, pooler=PoolerConfig(PoolingType.MEAN)) as (
            client, oai):
        for _ in range(2):
            batch = await oai.embeddings.create(model=TINY_NAME, input=TEXTS,
                                                encoding_format="float")
            assert_close([d.embedding for d in batch.data], want)
        assert (await stats(client))["kv_cache"]["prefix_cache_hits"] == 0


async def test_bert_embeddings_equal_transformers(bert_dir):
    want = hf_embeddings(bert_dir, TEXTS, "CLS")
    ids = [[2, 40, 41, 42, 3], [2, 50, 3]]
    want_ids = hf_embeddings(bert_dir, [], "CLS", ids=ids)
    # A budget smaller than a prompt: an encoder's prompts still run whole (never chunked).
    async with serve_pooling(bert_dir, runner="auto", max_num_batched_tokens=8,
                             max_model_len=128) as (client, oai):
        batch = await oai.embeddings.create(model=TINY_NAME, input=TEXTS)
        assert_close([d.embedding for d in batch.data], want)
        for text, w in zip(TEXTS, want, strict=True):
            alone = await oai.embeddings.create(model=TINY_NAME, input=text)
            assert_close([alone.data[0].embedding], [w])
        by_ids = await oai.embeddings.create(model=TINY_NAME, input=ids)
        assert_close([d.embedding for d in by_ids.data], want_ids)
        one = await oai.embeddings.create(model=TINY_NAME, input=ids[0])
        assert_close([one.data[0].embedding], want_ids[:1])
        raw = (await client.post("/v1/embeddings", json={
            "input": TEXTS[0], "normalize": False})).json()
        unnormed = hf_embeddings(bert_dir, TEXTS[:1], "CLS", normalize=False)
        assert_close([raw["data"][0]["embedding"]], unnormed)
        assert raw["object"] == "list" and raw["usage"]["completion_tokens"] == 0
        pooled = (await client.post("/pooling", json={"input": TEXTS[:2]})).json()
        assert_close([d["data"] for d in pooled["data"]], want[:2])
        s = await stats(client)
        assert s["kv_cache"]["num_free_blocks"] == s["kv_cache"]["num_blocks"]


async def test_base64_is_the_float32_bytes(bert_dir):
    async with serve_pooling(bert_dir) as (client, _):
        floats = (await client.post("/v1/embeddings", json={"input": TEXTS[0]})).json()
        b64 = (await client.post("/v1/embeddings", json={
            "input": TEXTS[0], "encoding_format": "base64"})).json()
    import base64

    decoded = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(decoded, np.float32(floats["data"][0]["embedding"]))


async def test_matryoshka_dimensions(tmp_path):
    """``dimensions`` where the config allows it (the first values, renormalised), else
    vLLM's 400."""
    path = save_bert(tmp_path)
    want_full = hf_embeddings(path, TEXTS[:1], "CLS", normalize=False)[0]
    async with serve_pooling(path) as (client, _):
        r = await client.post("/v1/embeddings", json={"input": TEXTS[0], "dimensions": 8})
        assert r.status_code == 400, r.text
        assert "does not support matryoshka representation" in r.json()["error"]["message"]
    import json

    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [8, 16]}))
    async with serve_pooling(path) as (client, oai):
        got = await oai.embeddings.create(model=TINY_NAME, input=TEXTS[0], dimensions=8)
        assert_close([got.data[0].embedding], [torch.nn.functional.normalize(
            want_full[:8], dim=-1)])
        r = await client.post("/v1/embeddings", json={"input": TEXTS[0], "dimensions": 12})
        assert r.status_code == 400 and "only supports [8, 16]" in r.json()["error"]["message"]


async def test_errors_as_vllm_gives_them(tiny_model_dir, bert_dir):
    async with serve_pooling(tiny_model_dir, runner="generate") as (client, oai):
        with pytest.raises(openai.BadRequestError) as e:
            await oai.embeddings.create(model=TINY_NAME, input="hi")
        assert e.value.body["message"] == "The model does not support Embeddings API"
        r = await client.post("/score", json={"text_1": "a", "text_2": "b"})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "The model does not support Score API"
    async with serve_pooling(bert_dir, max_model_len=32) as (client, _):
        r = await client.post("/v1/chat/completions",
                              json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == "The model does not support Chat Completions API"
        for body, where in (({"input": []}, "input"), ({"input": [[5, 10**6]]}, "input"),
                            ({"input": "the " * 40}, "input"),
                            ({"input": "x", "encoding_format": "int8"}, "encoding_format")):
            r = await client.post("/v1/embeddings", json=body)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == where, r.text
        long = (await client.post("/v1/embeddings", json={"input": "the " * 40})).json()
        assert "maximum context length is 32 tokens" in long["error"]["message"]
        r = await client.post("/v1/embeddings", json={"input": "x", "model": "other"})
        assert r.status_code == 404
        s = await stats(client)
        assert s["kv_cache"]["num_free_blocks"] == s["kv_cache"]["num_blocks"]
        assert (await client.post("/v1/embeddings", json={"input": "the cat"})).status_code == 200


async def test_pooling_requests_are_counted_apart(bert_dir):
    """/metrics and /admin/stats count pooling requests apart from generation ones."""
    async with serve_pooling(bert_dir) as (client, oai):
        await oai.embeddings.create(model=TINY_NAME, input=TEXTS)
        s = (await stats(client))["scheduler"]
        assert s["num_pooling_finished_total"] == 3 and s["num_pooling_running"] == 0
        text = (await client.get("/metrics")).text
    assert 'pagedserve:pooling_request_success_total{finished_reason="stop",' in text
    line = next(x for x in text.splitlines()
                if x.startswith("pagedserve:pooling_request_success_total")
                and 'finished_reason="stop"' in x)
    assert line.endswith(" 3.0")
    assert "pagedserve:pooling_request_latency_seconds_count" in text
    gen = [x for x in text.splitlines()
           if x.startswith("pagedserve:request_success_total") and 'reason="stop"' in x]
    assert all(x.endswith(" 0.0") for x in gen)


def test_cli_serves_the_embedded_gguf_as_an_embedding_model(default_model_dir, tmp_path):
    """``pagedserve serve --convert embed``: the embedded GGUF, kept quantized (exact
    products), answers the openai client with transformers' vectors on its de-quantized
    weights; ``/v1/chat/completions`` gets vLLM's refusal."""
    import signal
    import subprocess

    from pagedserve.server.launch import start_server_process

    log = (tmp_path / "server.log").open("w")
    proc, url = start_server_process(
        ["--convert", "embed", "--dtype", "float32", "--cpu-linear-mode", "exact",
         "--max-model-len", "512"], stdout=log, stderr=subprocess.STDOUT)
    try:
        oai = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        got = oai.embeddings.create(model="HuggingFaceTB/SmolLM2-135M-Instruct", input=TEXTS)
        chat = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "hi"}]})
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    want = hf_embeddings(default_model_dir, TEXTS, "LAST")
    for d, w in zip(got.data, want, strict=True):
        torch.testing.assert_close(torch.tensor(d.embedding), w, atol=1e-4, rtol=0)
    assert chat.status_code == 400
    assert chat.json()["error"]["message"] == "The model does not support Chat Completions API"


async def test_a_client_gone_mid_batch_frees_every_block(tiny_model_dir):
    """A client that leaves while its 64 inputs are prefilled in 64-token steps: the rest are
    aborted, every block comes back, and the server serves on."""
    from tests.conftest import until_stats

    ids = [[(7 * i + j) % 40000 + 100 for j in range(100)] for i in range(64)]
    async with serve_pooling(tiny_model_dir, convert="embed", max_num_batched_tokens=64) as (
            client, _):
        # Leave once the engine runs the inputs (a state, not a timer: any machine's speed).
        post = asyncio.create_task(client.post("/v1/embeddings", json={"input": ids}))
        await until_stats(client, lambda s: s["scheduler"]["num_running"] > 0, "running")
        post.cancel()
        with pytest.raises(asyncio.CancelledError):
            await post
        s = await until_stats(client, lambda s: s["scheduler"]["num_running"] == 0
                              and s["scheduler"]["num_waiting"] == 0, "idle")
        assert s["kv_cache"]["num_free_blocks"] == s["kv_cache"]["num_blocks"]
        # Aborted, not run to the end: 100 steps of 64 tokens were needed for all 64.
        assert s["scheduler"]["num_pooling_finished_total"] < len(ids)
        r = await client.post("/v1/embeddings", json={"input": ids[:2]})
        assert r.status_code == 200 and len(r.json()["data"]) == 2


def test_pooling_with_data_parallelism_is_refused_at_start():
    import subprocess
    import sys
    from pathlib import Path

    exe = str(Path(sys.executable).parent / "pagedserve")
    out = subprocess.run([exe, "serve", "--convert", "embed", "-dp", "2"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1
    assert "not served with data parallelism yet: drop -dp" in out.stderr
