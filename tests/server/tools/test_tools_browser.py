"""The chat page with tools, in a real headless Chromium against a real server on the tiny
model: a forced call shows as a readable block, the next message typed goes back as the call's
``tool`` result, and the conversation carries both."""

from __future__ import annotations

import json

from pagedserve.server.openai.serving import ServingConfig
from tests.conftest import TINY_NAME, serve
from tests.server.test_browser import ARTIFACTS, assert_offline, browser, watch_requests

__all__ = ["browser"]  # the fixture, shared with the page's other tests

TOOL = {"type": "function", "function": {
    "name": "set_mode", "description": "Set the driving mode",
    "parameters": {"type": "object", "required": ["mode"],
                   "properties": {"mode": {"enum": ["eco", "normal", "sport"]}}}}}


async def test_chat_page_shows_tool_calls_and_sends_results_back(browser, tiny_model_dir):
    from playwright.async_api import expect

    serving = ServingConfig(TINY_NAME, enable_auto_tool_choice=True, tool_call_parser="hermes")
    async with serve(tiny_model_dir, serving=serving, max_model_len=2048) as client:
        base = str(client.base_url).rstrip("/")
        page = await browser.new_page(viewport={"width": 1100, "height": 760})
        seen = watch_requests(page, base)
        await page.goto(base + "/")
        await expect(page.locator("#model-name")).to_have_text(TINY_NAME)
        await page.click("#settings summary")
        await page.fill("#tools", json.dumps([TOOL]))
        await page.select_option("#tool-choice", "required")
        await page.fill("#max-tokens", "200")
        await page.fill("#prompt", "Switch to eco mode.")
        await page.press("#prompt", "Enter")
        await expect(page.locator("#gen-stats")).to_contain_text("finished: tool_calls")
        call = page.locator(".msg.assistant .tool-call").first
        await expect(call).to_contain_text('set_mode {"mode": "')
        await expect(page.locator("#prompt")).to_have_attribute(
            "placeholder", "Result of set_mode (sent as a tool message)")

        calls = page.locator(".msg.assistant .tool-call")
        n = await calls.count()  # parallel calls allowed: each gets its own result

        await page.select_option("#tool-choice", "none")
        await page.fill("#max-tokens", "8")
        for i in range(n):
            await page.fill("#prompt", f'{{"ok": {i}}}')
            await page.press("#prompt", "Enter")
        await expect(page.locator("#gen-stats")).to_contain_text("finished: length")
        tool = page.locator(".msg.tool")
        await expect(tool).to_have_count(n)
        await expect(tool.first.locator(".who")).to_have_text("tool · set_mode")
        await expect(tool.first.locator(".content")).to_have_text('{"ok": 0}')
        await expect(page.locator(".msg")).to_have_count(3 + n)  # user, calls, results, answer
        await page.screenshot(path=ARTIFACTS / "chat-tools.png")

        posts = [r for r in seen if not isinstance(r, Exception) and r.method == "POST"]
        assert len(posts) == 2
        first, second = (json.loads(p.post_data) for p in posts)
        assert first["tools"] == [TOOL] and first["tool_choice"] == "required"
        history = second["messages"]
        assert [m["role"] for m in history] == ["user", "assistant"] + ["tool"] * n
        made = history[1]["tool_calls"]
        assert len(made) == n and all(c["function"]["name"] == "set_mode" for c in made)
        assert json.loads(made[0]["function"]["arguments"])["mode"] in ("eco", "normal", "sport")
        assert [m["tool_call_id"] for m in history[2:]] == [c["id"] for c in made]
        assert second["tool_choice"] == "none"
        assert call_text(await call.inner_text()) == made[0]["function"]["arguments"]
        assert_offline(seen, base)
        await page.close()


def call_text(shown: str) -> str:
    """The arguments part of a shown ``name {arguments}`` block."""
    return shown.split(" ", 1)[1]
