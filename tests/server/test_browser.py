"""The chat page and the dashboard in a real headless Chromium (Debian's, driven by playwright),
against a real server on the tiny model. Screenshots go to ``artifacts/``."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from pagedserve.server.openai.serving import ServingConfig
from tests.conftest import TINY_NAME, serve, stats

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def browser():
    try:
        from playwright.async_api import async_playwright, expect
    except ImportError:
        async_playwright = None
    if async_playwright is None or not os.access(CHROMIUM, os.X_OK):
        why = f"needs the playwright package and {CHROMIUM} (make test installs both)"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    ARTIFACTS.mkdir(exist_ok=True)
    expect.set_options(timeout=60_000)  # a deadline for a hung page, not for a slow machine
    async with async_playwright() as p:
        b = await p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        await b.close()


def watch_requests(page, base: str) -> list:
    seen: list = []
    page.on("request", lambda r: seen.append(r))
    page.on("pageerror", lambda e: seen.append(RuntimeError(f"page error: {e}")))
    return seen


def assert_offline(seen: list, base: str) -> None:
    """Every request the page made went to pagedserve itself, and no script failed."""
    errors = [e for e in seen if isinstance(e, Exception)]
    assert not errors, errors
    assert seen and all(r.url.startswith(base) for r in seen), [r.url for r in seen]


async def wait_for(check, timeout: float = 120.0, what: str = ""):
    """Until ``check()`` is true; ``timeout`` only catches a hung page or server, not a slow
    machine."""
    deadline = time.monotonic() + timeout
    while True:
        result = await check()
        if result:
            return result
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def _at_least(value, n: int) -> bool:
    return (await value) >= n


async def abort_count(client: httpx.AsyncClient, headers=None) -> float:
    text = (await client.get("/metrics", headers=headers)).text
    line = f'pagedserve:request_success_total{{finished_reason="abort",model_name="{TINY_NAME}"}}'
    return next(float(x.split()[-1]) for x in text.splitlines() if x.startswith(line))


async def tokens_shown(page) -> int:
    return int(await page.locator("#gen-stats").get_attribute("data-tokens") or 0)


async def test_chat_page_streams_keeps_conversation_and_stop_aborts(browser, tiny_model_dir):
    # Long enough to still be streaming when Stop is clicked on a fast machine (the tiny model
    # makes ~1,200 tokens/s on one).
    async with serve(tiny_model_dir, max_model_len=20480, num_blocks=1400) as client:
        base = str(client.base_url).rstrip("/")
        page = await browser.new_page(viewport={"width": 1100, "height": 760})
        seen = watch_requests(page, base)
        answer = await _first_turn_streams(page, client, base)
        stopped_text = await _stop_aborts(page, client, answer)
        await _second_turn_carries_the_conversation(page, seen, stopped_text)
        assert_offline(seen, base)
        await page.close()


async def _first_turn_streams(page, client: httpx.AsyncClient, base: str):
    """Tokens stream into the page while the server is still generating; returns the answer."""
    from playwright.async_api import expect

    await page.goto(base + "/")
    await expect(page.locator("#model-name")).to_have_text(TINY_NAME)
    await page.click("#settings summary")
    await page.fill("#api-key", "sk-page")
    await page.fill("#max-tokens", "20000")
    await page.fill("#temperature", "0")
    await page.check("#ignore-eos")
    await page.fill("#prompt", "Tell me a very long story about paged attention.")
    await page.press("#prompt", "Enter")
    await wait_for(lambda: _at_least(tokens_shown(page), 20), what="20 streamed tokens")
    answer = page.locator(".msg.assistant .content").last
    assert len(await answer.inner_text()) > 0
    busy = await stats(client)
    assert busy["scheduler"]["num_running"] == 1
    assert busy["kv_cache"]["num_free_blocks"] < busy["kv_cache"]["num_blocks"]
    assert busy["scheduler"]["requests"][0]["output_tokens"] >= 20
    await expect(page.locator("#stop")).to_be_enabled()
    await page.screenshot(path=ARTIFACTS / "chat-streaming.png")
    return answer


async def _stop_aborts(page, client: httpx.AsyncClient, answer) -> str:
    """Stop aborts the request (its blocks come back) and the page stops counting; returns the
    partial answer."""
    from playwright.async_api import expect

    await page.click("#stop")
    idle = await wait_for(lambda: _idle(client), what="the aborted request's blocks")
    assert idle["kv_cache"]["usage"] == 0.0 and idle["scheduler"]["requests"] == []
    assert await abort_count(client) == 1
    await expect(page.locator("#gen-stats")).to_contain_text("stopped")
    shown = await tokens_shown(page)
    await asyncio.sleep(0.3)
    assert await tokens_shown(page) == shown
    assert float(await page.locator("#gen-stats").get_attribute("data-tokens-per-s")) > 0
    stopped_text = await answer.inner_text()
    await page.screenshot(path=ARTIFACTS / "chat-stopped.png")
    return stopped_text


async def _second_turn_carries_the_conversation(page, seen: list, stopped_text: str) -> None:
    """A second turn sends the conversation, the partial answer included."""
    from playwright.async_api import expect

    await page.uncheck("#ignore-eos")
    await page.fill("#max-tokens", "8")
    await page.fill("#prompt", "And then?")
    await page.click("#send")
    await expect(page.locator("#gen-stats")).to_contain_text("finished", timeout=120_000)
    await expect(page.locator(".msg")).to_have_count(4)
    posts = [r for r in seen if not isinstance(r, Exception) and r.method == "POST"]
    assert len(posts) == 2
    second = json.loads(posts[1].post_data)
    assert [m["role"] for m in second["messages"]] == ["user", "assistant", "user"]
    assert second["messages"][1]["content"] == stopped_text
    assert second["stream"] is True and second["max_tokens"] == 8
    assert all(r.headers.get("authorization") == "Bearer sk-page" for r in posts)
    await page.screenshot(path=ARTIFACTS / "chat-conversation.png")


async def _idle(client: httpx.AsyncClient, headers=None) -> dict | None:
    s = (await client.get("/admin/stats", headers=headers)).json()
    kv = s["kv_cache"]
    done = s["scheduler"]["num_running"] == 0 and kv["num_free_blocks"] == kv["num_blocks"]
    return s if done else None


async def long_stream(client: httpx.AsyncClient, i: int) -> None:
    payload = {"prompt": f"{i} little pigs", "max_tokens": 8000, "ignore_eos": True,
               "stream": True}
    async with client.stream("POST", "/v1/completions", json=payload) as r:
        async for _ in r.aiter_lines():
            pass


async def snapshots(page) -> int:
    return await page.evaluate("window.pagedserveDashboard.snapshots")


async def test_dashboard_charts_follow_a_live_load(browser, tiny_model_dir):
    from playwright.async_api import expect

    key = {"Authorization": "Bearer sk-admin"}
    serving = ServingConfig(TINY_NAME, admin_key="sk-admin")
    # 8,000-token answers: the first four still run (and four wait) seconds later on a fast CPU.
    async with serve(tiny_model_dir, serving=serving, max_num_seqs=4, max_model_len=8192,
                     num_blocks=2200) as client:
        base = str(client.base_url).rstrip("/")
        page = await browser.new_page(viewport={"width": 1280, "height": 1100})
        seen = watch_requests(page, base)
        await page.goto(base + "/admin")
        await expect(page.locator("#key-form")).to_be_visible()  # 401 → the page asks
        await page.fill("#admin-key", "sk-admin")
        await page.click("#key-form button")
        await expect(page.locator("#conn")).to_have_attribute("data-state", "live")
        await expect(page.locator("#num-running")).to_have_text("0")
        await expect(page.locator("#config")).to_contain_text("max_num_seqs")
        config = page.locator("#config")  # quantization and the tool parser (issue 33)
        await expect(config.locator("dt", has_text="quantization")).to_have_count(1)
        await expect(config.locator("dt:text-is('quantization') + dd")).to_have_text("none")
        await expect(config.locator("dt:text-is('tool_call_parser') + dd")).to_have_text(
            "hermes (chat template)")
        assert await page.locator('link[rel="icon"]').count() == 1
        await expect(page.locator("#engines-panel")).to_be_hidden()  # one engine: no panel

        queues = page.locator("#chart-queues")
        before = await queues.evaluate("c => c.toDataURL()")
        tasks = [asyncio.create_task(long_stream(client, i)) for i in range(8)]
        try:
            await expect(page.locator("#num-running")).to_have_text("4", timeout=120_000)
            await expect(page.locator("#num-waiting")).to_have_text("4")
            await expect(page.locator("#requests tbody tr")).to_have_count(8)
            n0 = await snapshots(page)
            # the charts keep moving under load: three more snapshots, however long they take
            await wait_for(lambda: _at_least(snapshots(page), n0 + 3), what="3 more snapshots")
            assert await queues.evaluate("c => c.toDataURL()") != before
            for chart in ("#chart-kv", "#chart-tps", "#chart-step"):
                blank = await page.evaluate(
                    "id => { const c = document.querySelector(id); const d = document"
                    ".createElement('canvas'); d.width = c.width; d.height = c.height;"
                    " return c.toDataURL() === d.toDataURL(); }", chart)
                assert not blank, chart
            assert float(await page.inner_text("#gen-tps")) > 0
            assert (await page.inner_text("#kv-usage")) != "0.0%"
            # The KV chart's axis follows the data (1.2x the window's peak, rounded up),
            # not a fixed 0-100 %.
            ymax, peak = await page.evaluate(
                "() => { const k = window.pagedserveDashboard.charts.kv; return [k.ymax,"
                " Math.max(...k.points.map(p => p.values[0] ?? 0))]; }")
            assert 0 < peak and peak * 1.2 <= ymax <= max(1, peak * 2.4) and ymax < 100, (
                ymax, peak)
            await page.screenshot(path=ARTIFACTS / "admin-load.png", full_page=True)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await wait_for(lambda: _idle(client, key), what="idle after the load is cancelled")
        await expect(page.locator("#num-running")).to_have_text("0")
        await expect(page.locator("#num-waiting")).to_have_text("0")
        await expect(page.locator("#requests tbody tr")).to_have_count(0)
        await expect(page.locator("#kv-usage")).to_have_text("0.0%")
        await page.screenshot(path=ARTIFACTS / "admin-idle.png", full_page=True)
        events = [r for r in seen if not isinstance(r, Exception) and r.url.endswith("/events")]
        assert events and events[-1].headers.get("authorization") == "Bearer sk-admin"
        assert_offline(seen, base)
        await page.close()


async def test_dashboard_shows_engines_side_by_side(browser, tiny_model_dir, tmp_path):
    """Data parallelism (two engine processes): the engines panel has a column per engine,
    and the request sent shows up in one engine's routed count."""
    import httpx
    from playwright.async_api import expect

    from tests.server.dp_servers import dp_server

    with dp_server(tiny_model_dir, logs=tmp_path) as (_, base):
        client = httpx.AsyncClient(base_url=base, timeout=120)
        page = await browser.new_page(viewport={"width": 1280, "height": 1100})
        seen = watch_requests(page, base)
        await page.goto(base + "/admin")
        await expect(page.locator("#engines-panel")).to_be_visible()
        await expect(page.locator("#engines thead th")).to_have_count(3)  # label + 2 engines
        await expect(page.locator("#dp-routing")).to_contain_text("prefix")
        r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 200
        routed = page.locator("#engines tbody tr", has_text="routed")
        await expect(routed).to_contain_text("1")
        await page.screenshot(path=ARTIFACTS / "admin-dp.png", full_page=True)
        assert_offline(seen, base)
        await page.close()
        await client.aclose()
