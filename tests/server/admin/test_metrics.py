"""/metrics after a known workload on the tiny model: the counters equal what was sent and
generated, by finish reason, and the exposition parses as Prometheus text."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import TINY_NAME, chat, serve, stats


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    """Samples by name and labels (``name{k=v,...}``; only the label ``model_name`` dropped)."""
    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        assert family.name.startswith("pagedserve:"), family.name
        for s in family.samples:
            assert s.labels.pop("model_name") == TINY_NAME, s
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            key = f"{s.name}{{{labels}}}" if labels else s.name
            out[key] = s.value
    return out


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after[key] - before.get(key, 0.0)


@dataclass(slots=True)
class Sent:
    """What the sequential requests of phase 1 sent and got back, by their usage."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    computed_tokens: int = 0  # the last sampled token of each request is never computed
    outputs: list[int] = field(default_factory=list)

    def add(self, body: dict) -> None:
        p, g = body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]
        self.prompt_tokens += p
        self.generation_tokens += g
        self.computed_tokens += p + g - 1
        self.outputs.append(g)


async def test_metrics_count_a_known_workload(tiny_model_dir):
    # 16 blocks of 16 tokens: room for the sequential phase, too few for the concurrent one.
    async with serve(tiny_model_dir, num_blocks=16, max_model_len=256) as client:
        m0 = await scrape(client)
        assert m0["pagedserve:request_success_total{finished_reason=stop}"] == 0
        assert m0["pagedserve:num_requests_running"] == 0
        m1, full = await finish_in_the_engine(client)
        m2 = await finish_on_a_stop_string(client, m1, full)
        await preempt_under_load(client, m2)
        await abort_mid_stream(client)


async def finish_in_the_engine(client: httpx.AsyncClient) -> tuple[dict[str, float], dict]:
    """Phase 1: requests that end inside the engine (max_tokens, a stop token id). Returns the
    scrape after them, and the answer of the 12-token story."""
    sent = Sent()
    for text, n in [("Hi", 5), ("What is the capital of France?", 8), ("List colours", 3)]:
        body = await chat(client, text, max_tokens=n, ignore_eos=True)
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == n
        sent.add(body)
    full = await chat(client, "Tell me a story", max_tokens=12, ignore_eos=True)
    stop_id = full["choices"][0]["token_ids"][4]
    cut = await chat(client, "Tell me a story", max_tokens=12, ignore_eos=True,
                     stop_token_ids=[stop_id])
    assert cut["choices"][0]["finish_reason"] == "stop"
    sent.add(full)
    sent.add(cut)
    assert sent.outputs[3] == 12

    m1 = await scrape(client)
    assert m1["pagedserve:prompt_tokens_total"] == sent.prompt_tokens
    assert m1["pagedserve:generation_tokens_total"] == sent.generation_tokens
    assert m1["pagedserve:request_success_total{finished_reason=length}"] == 4
    assert m1["pagedserve:request_success_total{finished_reason=stop}"] == 1
    assert m1["pagedserve:request_success_total{finished_reason=abort}"] == 0
    # every computed token went through exactly one step (prefix-cache hits are not computed)
    s1 = await stats(client)
    hits = s1["kv_cache"]["prefix_cache_hits"]
    assert m1["pagedserve:iteration_tokens_total_sum"] == sent.computed_tokens - hits
    assert m1["pagedserve:prefix_cache_hits_total"] == hits > 0
    steps = s1["scheduler"]["num_steps_total"]
    assert m1["pagedserve:iteration_tokens_total_count"] == steps == sum(sent.outputs)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert m1[f"pagedserve:{name}_count"] == 5, name
        assert m1[f"pagedserve:{name}_sum"] > 0, name
    assert m1["pagedserve:inter_token_latency_seconds_count"] == sum(
        n - 1 for n in sent.outputs)
    assert m1["pagedserve:e2e_request_latency_seconds_sum"] > (
        m1["pagedserve:time_to_first_token_seconds_sum"])
    return m1, full


async def finish_on_a_stop_string(client: httpx.AsyncClient, m1: dict[str, float],
                                  full: dict) -> dict[str, float]:
    """Phase 2: a stop string ends the request in the request task (the scheduler sees an
    abort), yet the client and the metrics see `stop`."""
    text = full["choices"][0]["message"]["content"]
    body = await chat(client, "Tell me a story", max_tokens=12, ignore_eos=True,
                      stop=[text[10:13]])
    assert body["choices"][0]["finish_reason"] == "stop"
    m2 = await scrape(client)
    assert delta(m2, m1, "pagedserve:request_success_total{finished_reason=stop}") == 1
    assert delta(m2, m1, "pagedserve:request_success_total{finished_reason=abort}") == 0
    assert delta(m2, m1, "pagedserve:prompt_tokens_total") == body["usage"]["prompt_tokens"]
    assert delta(m2, m1, "pagedserve:generation_tokens_total") == (
        body["usage"]["completion_tokens"])
    return m2


async def preempt_under_load(client: httpx.AsyncClient, m2: dict[str, float]) -> None:
    """Phase 3: four at once outgrow the 16 blocks: preemptions recompute, yet each prompt
    and each generated token counts once."""
    results = await asyncio.gather(*(
        chat(client, f"{i} bottles of milk on the wall", max_tokens=40, ignore_eos=True)
        for i in range(4)))
    m3 = await scrape(client)
    s = await stats(client)
    assert s["scheduler"]["num_preempted_total"] > 0
    assert m3["pagedserve:num_preemptions_total"] == s["scheduler"]["num_preempted_total"]
    assert delta(m3, m2, "pagedserve:prompt_tokens_total") == sum(
        b["usage"]["prompt_tokens"] for b in results)
    assert delta(m3, m2, "pagedserve:generation_tokens_total") == 4 * 40
    assert delta(m3, m2, "pagedserve:request_success_total{finished_reason=length}") == 4
    assert delta(m3, m2, "pagedserve:request_queue_time_seconds_count") == 4


async def abort_mid_stream(client: httpx.AsyncClient) -> None:
    """Phase 4: a client that goes away mid-stream counts as `abort`."""
    payload = {"messages": [{"role": "user", "content": "x"}], "stream": True,
               "max_tokens": 200, "ignore_eos": True}
    async with client.stream("POST", "/v1/chat/completions", json=payload) as r:
        n = 0
        async for line in r.aiter_lines():
            n += line.startswith("data: {")
            if n == 4:
                break
        m_busy = await scrape(client)
        assert m_busy["pagedserve:num_requests_running"] == 1
        assert m_busy["pagedserve:kv_cache_usage_perc"] > 0
    deadline = time.monotonic() + 120  # a hung server, not a slow one
    while True:
        m4 = await scrape(client)
        if m4["pagedserve:request_success_total{finished_reason=abort}"] == 1:
            break
        assert time.monotonic() < deadline, m4
        await asyncio.sleep(0.02)
    assert m4["pagedserve:num_requests_running"] == 0
    assert m4["pagedserve:num_requests_waiting"] == 0
    assert m4["pagedserve:kv_cache_usage_perc"] == 0
    hits, queries = "pagedserve:prefix_cache_hits", "pagedserve:prefix_cache_queries"
    assert m4[f"{hits}_total"] <= m4[f"{queries}_total"]
    assert m4["pagedserve:request_success_total{finished_reason=error}"] == 0


async def test_two_servers_keep_their_own_registries(tiny_model_dir):
    async with serve(tiny_model_dir, name="a") as a, serve(tiny_model_dir, name="b") as b:
        await a.post("/v1/completions", json={"model": "a", "prompt": "Hi", "max_tokens": 3,
                                              "ignore_eos": True})
        ra, rb = (await a.get("/metrics")).text, (await b.get("/metrics")).text
        assert 'pagedserve:generation_tokens_total{model_name="a"} 3.0' in ra
        assert 'pagedserve:generation_tokens_total{model_name="b"} 0.0' in rb


async def test_request_params_n_counts_each_client_request_once(tiny_model_dir):
    """n = 3 is three engine requests, but one ``request_params_n`` observation of 3; the
    per-request token histograms still count all three."""
    async with serve(tiny_model_dir) as client:
        before = await scrape(client)
        body = await chat(client, "Three of them", n=3, max_tokens=4, ignore_eos=True)
        assert len(body["choices"]) == 3
        mid = await scrape(client)
        await chat(client, "Just one", max_tokens=2)
        after = await scrape(client)
    assert delta(mid, before, "pagedserve:request_params_n_count") == 1
    assert delta(mid, before, "pagedserve:request_params_n_sum") == 3
    assert delta(mid, before, "pagedserve:request_params_n_bucket{le=2.0}") == 0
    assert delta(mid, before, "pagedserve:request_params_n_bucket{le=5.0}") == 1
    assert delta(mid, before, "pagedserve:request_generation_tokens_count") == 3
    assert delta(after, mid, "pagedserve:request_params_n_count") == 1
    assert delta(after, mid, "pagedserve:request_params_n_sum") == 1
