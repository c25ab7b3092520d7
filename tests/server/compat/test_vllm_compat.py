"""What a vLLM user meets besides the OpenAI routes, through a real server on the tiny model:
the access log, ``/load``, ``/ping``, ``/invocations``, ``/openapi.json`` and ``/docs``, and
``/metrics`` under vLLM's names as its example Grafana dashboard queries them."""

from __future__ import annotations

import asyncio

import structlog
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.server.config import ServingConfig
from tests.conftest import TINY_NAME, serve

KEY = "k-test"
AUTH = {"Authorization": f"Bearer {KEY}"}

# Every metric the vLLM example dashboard queries, as sample names: vllm-project/vllm,
# examples/online_serving/prometheus_grafana/grafana.json at commit e88892c9080b, read
# 2026-12-01 (its "expr" fields), plus kv_cache_usage_perc (the newer copy of that dashboard
# queries it in place of gpu_cache_usage_perc).
GRAFANA_SAMPLES = frozenset({
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count",
    "vllm:num_requests_running", "vllm:num_requests_swapped", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:gpu_cache_usage_perc", "vllm:cpu_cache_usage_perc", "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
})
# Also named in issue 16 (vLLM's other per-request histograms and its cache info).
ISSUE_SAMPLES = frozenset({
    "vllm:request_inference_time_seconds_count", "vllm:request_params_n_count",
    "vllm:cache_config_info",
})


def samples(text: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def value(found: dict[str, list], name: str) -> float:
    (s,) = found[name]
    return s.value


async def test_the_access_log_has_every_request_and_no_body(tiny_model_dir):
    config = ServingConfig(TINY_NAME, api_key=KEY)
    async with serve(tiny_model_dir, serving=config) as client:
        with structlog.testing.capture_logs() as events:
            ok = await client.post("/v1/completions", headers=AUTH, json={
                "prompt": "secret words", "max_tokens": 2, "temperature": 0})
            bad = await client.post("/v1/completions", headers=AUTH, json={"max_tokens": 2})
            denied = await client.get("/v1/models")
            missing = await client.get("/nowhere", headers=AUTH)
            wrong_type = await client.post("/v1/completions", headers=AUTH | {
                "content-type": "text/plain"}, content=b"secret words")
    assert [ok.status_code, bad.status_code, denied.status_code, missing.status_code,
            wrong_type.status_code] == [200, 400, 401, 404, 415]
    access = [e for e in events if e["event"] == "access"]
    assert [(e["method"], e["path"], e["status"]) for e in access] == [
        ("POST", "/v1/completions", 200), ("POST", "/v1/completions", 400),
        ("GET", "/v1/models", 401), ("GET", "/nowhere", 404), ("POST", "/v1/completions", 415)]
    assert access[0]["request_id"] == ok.headers["x-request-id"]
    assert all(e["duration_ms"] >= 0 and e["client"].startswith("127.0.0.1:") for e in access)
    assert not any("secret" in repr(e) for e in events)


async def test_load_counts_generation_requests_until_their_stream_ends(tiny_model_dir):
    config = ServingConfig(TINY_NAME, enable_server_load_tracking=True)
    async with serve(tiny_model_dir, serving=config) as client:
        assert (await client.get("/load")).json() == {"server_load": 0}
        body = {"prompt": "Once upon", "max_tokens": 40, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.aiter_lines()
            assert (await anext(lines)).startswith("data: ")  # the stream has started
            assert (await client.get("/load")).json() == {"server_load": 1}
            async for _ in lines:
                pass
        for _ in range(500):  # the guard lets go once the response has been sent
            if (await client.get("/load")).json()["server_load"] == 0:
                break
            await asyncio.sleep(0.01)
        assert (await client.get("/load")).json() == {"server_load": 0}


async def test_load_is_zero_without_tracking_and_sagemaker_routes_dispatch(tiny_model_dir):
    async with serve(tiny_model_dir) as client:
        r = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
        assert r.status_code == 200 and (await client.get("/load")).json()["server_load"] == 0
        assert (await client.get("/ping")).status_code == 200
        assert (await client.post("/ping")).status_code == 200
        chat = await client.post("/invocations", json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0})
        assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
        direct = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0})
        assert chat.json()["choices"][0]["message"] == direct.json()["choices"][0]["message"]
        text = await client.post("/invocations", json={"prompt": "Hi", "max_tokens": 3})
        assert text.status_code == 200 and text.json()["object"] == "text_completion"
        neither = await client.post("/invocations", json={"input": "Hi"})
        assert neither.status_code == 400
        assert "ChatCompletionRequest" in neither.json()["error"]["message"]
        assert (await client.post("/invocations", content=b"{oops",
                                  headers={"content-type": "application/json"})).status_code \
            == 400


async def test_openapi_describes_the_routes_with_the_protocol_models(tiny_model_dir):
    async with serve(tiny_model_dir) as client:
        spec = (await client.get("/openapi.json")).json()
        docs = await client.get("/docs")
        icon = await client.get("/favicon.ico")
        css = await client.get("/static/style.css")
    assert icon.status_code == 200 and icon.headers["content-type"].startswith("image/")
    assert icon.content.startswith(b"<svg")
    assert spec["openapi"].startswith("3.")
    schemas = spec["components"]["schemas"]
    chat = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]
    ref = chat["application/json"]["schema"]["$ref"]
    assert ref == "#/components/schemas/ChatCompletionRequest"
    assert "messages" in schemas["ChatCompletionRequest"]["properties"]
    assert "prompt" in schemas["CompletionRequest"]["properties"]
    for path in ("/v1/completions", "/v1/models", "/tokenize", "/metrics", "/load",
                 "/invocations", "/health", "/openapi.json"):
        assert path in spec["paths"], path
    assert "get" in spec["paths"]["/v1/models/{model}"]
    assert docs.status_code == 200 and docs.headers["content-type"].startswith("text/html")
    assert "/v1/chat/completions" in docs.text and 'id="CompletionRequest"' in docs.text
    # /v1/responses has its request schema, from the pydantic model like the others.
    responses = spec["paths"]["/v1/responses"]["post"]
    assert responses["requestBody"]["content"]["application/json"]["schema"]["$ref"] == \
        "#/components/schemas/ResponsesRequest"
    assert {"input", "instructions", "previous_response_id"} <= set(
        schemas["ResponsesRequest"]["properties"])
    assert 'id="ResponsesRequest"' in docs.text and 'href="#ResponsesRequest"' in docs.text
    # The "what" column describes each route instead of repeating its path.
    for path, op in ((p, o) for p, ops in spec["paths"].items() for o in ops.values()):
        assert op["summary"] and op["summary"] != path, path
    # Styled like the pages, with the icon; the page's CSP lets both load.
    assert '<link rel="stylesheet" href="/static/style.css">' in docs.text
    assert 'rel="icon"' in docs.text and ".docs table.routes" in css.text
    assert "style-src 'self'" in docs.headers["content-security-policy"]


async def test_vllm_prefix_serves_every_name_of_vllms_dashboard(tiny_model_dir):
    config = ServingConfig(TINY_NAME, metrics_prefix="vllm")
    async with serve(tiny_model_dir, serving=config, block_size=16) as client:
        r = await client.post("/v1/completions", json={
            "prompt": "Once upon a time", "max_tokens": 6, "ignore_eos": True, "temperature": 0})
        usage = r.json()["usage"]
        found = samples((await client.get("/metrics")).text)
    missing = (GRAFANA_SAMPLES | ISSUE_SAMPLES) - found.keys()
    assert not missing, sorted(missing)
    assert not [n for n in found if not n.startswith("vllm:")]
    assert value(found, "vllm:request_prompt_tokens_sum") == usage["prompt_tokens"]
    assert value(found, "vllm:request_generation_tokens_sum") == 6
    assert value(found, "vllm:request_max_num_generation_tokens_sum") == 6
    assert value(found, "vllm:request_params_n_sum") == 1
    # Five gaps between six tokens, per token and once for the request.
    assert value(found, "vllm:time_per_output_token_seconds_count") == 5
    assert value(found, "vllm:request_time_per_output_token_seconds_count") == 1
    prefill = value(found, "vllm:request_prefill_time_seconds_sum")
    decode = value(found, "vllm:request_decode_time_seconds_sum")
    inference = value(found, "vllm:request_inference_time_seconds_sum")
    assert prefill > 0 and decode > 0 and abs(prefill + decode - inference) < 1e-6
    assert value(found, "vllm:num_requests_swapped") == 0
    assert value(found, "vllm:gpu_cache_usage_perc") == value(found, "vllm:kv_cache_usage_perc")
    (info,) = found["vllm:cache_config_info"]
    assert info.value == 1 and info.labels["block_size"] == "16"
    assert info.labels["num_blocks"] == "256"


async def test_default_prefix_is_pagedserve(tiny_model_dir):
    async with serve(tiny_model_dir) as client:
        await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        names = samples((await client.get("/metrics")).text).keys()
    assert "pagedserve:request_prompt_tokens_count" in names
    assert all(n.startswith("pagedserve:") for n in names)


# (method, path, body, status without the key, status with it): every route, with --api-key
# set and no --admin-key (the admin routes then take the API key).
MSGS = [{"role": "user", "content": "Hi"}]
ROUTE_ACCESS = [
    ("GET", "/health", None, 200, 200), ("GET", "/ping", None, 200, 200),
    ("POST", "/ping", None, 200, 200), ("GET", "/load", None, 200, 200),
    ("GET", "/", None, 200, 200), ("GET", "/admin", None, 200, 200),
    ("GET", "/favicon.ico", None, 200, 200),
    ("GET", "/docs", None, 200, 200), ("GET", "/openapi.json", None, 200, 200),
    ("GET", "/admin/stats", None, 401, 200), ("GET", "/admin/events", None, 401, 200),
    ("GET", "/metrics", None, 401, 200),
    ("POST", "/v1/chat/completions", {"messages": MSGS, "max_tokens": 1}, 401, 200),
    ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1}, 401, 200),
    ("POST", "/v1/responses", {"input": "Hi", "max_output_tokens": 1}, 401, 200),
    ("GET", "/v1/responses/resp_none", None, 401, 404),
    ("POST", "/v1/messages", {"model": TINY_NAME, "messages": MSGS, "max_tokens": 1}, 401, 200),
    ("POST", "/v1/messages/count_tokens", {"model": TINY_NAME, "messages": MSGS}, 401, 200),
    ("GET", "/v1/models", None, 401, 200), ("GET", "/v1/models/tiny-llama", None, 401, 200),
    ("POST", "/tokenize", {"prompt": "Hi"}, 401, 200),
    ("POST", "/detokenize", {"tokens": [1, 2]}, 401, 200),
    ("GET", "/version", None, 401, 200), ("POST", "/reset_prefix_cache", None, 401, 200),
    ("POST", "/invocations", {"prompt": "Hi", "max_tokens": 1}, 401, 200),
    # The pooling routes: a generation model answers vLLM's 400 (test_embeddings.py).
    ("POST", "/v1/embeddings", {"input": "Hi"}, 401, 400),
    ("POST", "/pooling", {"input": "Hi"}, 401, 400),
    *[("POST", p, {"text_1": "a", "text_2": "b"}, 401, 400) for p in ("/score", "/v1/score")],
    *[("POST", p, {"query": "a", "documents": ["b"]}, 401, 400)
      for p in ("/rerank", "/v1/rerank", "/v2/rerank")],
]


async def _status(client, method: str, path: str, body: dict | None, headers: dict) -> int:
    async with client.stream(method, path, json=body, headers=headers) as r:
        return r.status_code  # not read: /admin/events streams until closed


async def test_api_key_guards_every_route_but_probes_and_pages(tiny_model_dir):
    """The ``--api-key`` row of docs/serving.md, route by route: probes, pages and the API's
    schema answer without the key, the admin routes take it (no --admin-key), the rest need it; and
    the table covers every route /openapi.json lists."""
    async with serve(tiny_model_dir, serving=ServingConfig(TINY_NAME, api_key=KEY)) as client:
        got = [(m, p, await _status(client, m, p, b, {}), await _status(client, m, p, b, AUTH))
               for m, p, b, _, _ in ROUTE_ACCESS]
        wrong = await _status(client, "GET", "/v1/models", None, {"Authorization": "Bearer no"})
        spec = (await client.get("/openapi.json")).json()
        pages = {p: (await client.get(p)).text for p in ("/", "/admin")}
        assets = {}
        for asset in ("style.css", "chat.js", "admin.js", "sse.js", "charts.js"):
            assets[asset] = (await client.get(f"/static/{asset}")).status_code
    assert got == [(m, p, without, with_) for m, p, _, without, with_ in ROUTE_ACCESS]
    assert wrong == 401
    listed = {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}
    covered = {(m, p.replace("resp_none", "{response_id}").replace("tiny-llama", "{model}"))
               for m, p, *_ in ROUTE_ACCESS}
    assert listed - covered == set()
    # The pages are usable with a key: what they load comes without one (they send the key
    # from their own field on the API calls).
    assert all('src="/static/' in page for page in pages.values())
    assert assets == dict.fromkeys(assets, 200)
