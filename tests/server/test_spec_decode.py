"""n-gram speculative decoding: greedy output equals transformers' (and plain decoding's) with
fewer steps; requests that cannot be speculated run beside them; stops inside accepted drafts
end the output exactly; bad configs are refused."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys

import pytest

from pagedserve.actors.dp.launch import SAFE_PATH
from pagedserve.actors.spec_decode.proposer import SpeculativeConfig
from tests.conftest import TINY_NAME, chat, chat_prompt_ids, hf_greedy, serve, stats

GUIDE = "(fox jumps over dog ){4}"
REPEAT = ("Repeat this line four times: the quick brown fox jumps over the lazy dog. "
          "the quick brown fox jumps over the lazy dog.")


def test_cli_refuses_a_bad_speculative_config():
    r = subprocess.run([sys.executable, *SAFE_PATH, "-m", "pagedserve.server.cli", "serve",
                        "--speculative-config", '{"method": "medusa"}'],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "--speculative-config" in r.stderr and "'ngram' or 'draft_model'" in r.stderr


async def test_tiny_greedy_equals_hf_with_fewer_steps(tiny_model_dir):
    prompts = [REPEAT, "1 2 3 4 5 6 7 8 9 10 11 12", "What is the capital of France?"]
    wants = [hf_greedy(tiny_model_dir, chat_prompt_ids(tiny_model_dir, p), 40) for p in prompts]
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1)
    async with serve(tiny_model_dir, speculative=spec) as client:
        before = (await stats(client))["scheduler"]
        bodies = await asyncio.gather(*(chat(client, p, max_tokens=40) for p in prompts))
        after = (await stats(client))["scheduler"]
        # Beside greedy ones: a sampled request, one with logprobs, a guided one (all drafted
        # too: the guided one's drafts are masked per position, else its grammar would refuse
        # a token and end it with an error).
        mixed = await asyncio.gather(
            chat(client, REPEAT, max_tokens=40), chat(client, REPEAT, max_tokens=40,
                                                      temperature=1.0, seed=3),
            chat(client, REPEAT, max_tokens=40, logprobs=True),
            chat(client, REPEAT, max_tokens=60, temperature=0.8, seed=1,
                 guided_regex=GUIDE))
        idle = (await stats(client))["scheduler"]
        metrics = (await client.get("/metrics")).text
    for body, want in zip([*bodies, mixed[0]], [*wants, wants[0]], strict=True):
        tokens = body["choices"][0]["token_ids"]
        assert tokens == want[: len(tokens)] and len(tokens) == min(40, len(want))
    assert len(mixed[1]["choices"][0]["token_ids"]) == 40
    assert len(mixed[2]["choices"][0]["logprobs"]["content"]) == 40
    guided = mixed[3]["choices"][0]
    assert guided["finish_reason"] == "stop" and re.fullmatch(GUIDE, guided["message"]["content"])
    assert idle["num_running"] == idle["num_waiting"] == 0
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    assert 0 < accepted <= drafted
    assert (f"pagedserve:spec_decode_num_accepted_tokens_total{{model_name=\"{TINY_NAME}\"}} "
            f"{float(idle['spec_decode_num_accepted_tokens'])}") in metrics
    sd = idle["spec_decode"]
    assert sd["num_accepted_tokens"] == idle["spec_decode_num_accepted_tokens"]
    assert sum(sd["num_accepted_tokens_per_pos"]) == sd["num_accepted_tokens"]
    assert len(sd["acceptance_rate_per_pos"]) == 4 and sd["acceptance_rate_per_pos"][0] > 0
    assert sd["mean_acceptance_length"] == pytest.approx(
        1 + sd["num_accepted_tokens"] / sd["num_drafts"], abs=1e-5)
    assert sd["draft_time_s"] > 0 and sd["verify_time_s"] > 0
    label = f'model_name="{TINY_NAME}"'
    drafts = float(sd["num_drafts"])
    assert f"pagedserve:spec_decode_num_drafts_total{{{label}}} {drafts}" in metrics
    assert (f'pagedserve:spec_decode_num_accepted_tokens_per_pos_total{{{label},position="0"}} '
            f"{float(sd['num_accepted_tokens_per_pos'][0])}") in metrics
    assert "pagedserve:spec_decode_verify_seconds_total" in metrics
    # 40 tokens each would take 40 steps (plus prefill) one token at a time.
    assert after["num_steps_total"] - before["num_steps_total"] < 40


@pytest.mark.parametrize("max_tokens", [1, 6, 13])
async def test_max_tokens_is_exact_when_drafts_run_past_it(tiny_model_dir, max_tokens):
    want = hf_greedy(tiny_model_dir, chat_prompt_ids(tiny_model_dir, REPEAT), 13)
    spec = SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_min=1)
    async with serve(tiny_model_dir, speculative=spec) as client:
        body = await chat(client, REPEAT, max_tokens=max_tokens, ignore_eos=True)
        s = await stats(client)
    assert body["choices"][0]["token_ids"] == want[:max_tokens]
    assert body["usage"]["completion_tokens"] == max_tokens
    assert s["kv_cache"]["num_free_blocks"] == s["kv_cache"]["num_blocks"]


async def test_smollm2_greedy_equals_hf_and_accepts_drafts(default_model_dir):
    """The real model copies the line it is asked to repeat: most drafts are accepted."""
    want = hf_greedy(default_model_dir, chat_prompt_ids(default_model_dir, REPEAT), 48)
    spec = SpeculativeConfig(num_speculative_tokens=3)
    async with serve(default_model_dir, name="smollm2", speculative=spec) as client:
        before = (await stats(client))["scheduler"]
        body = await chat(client, REPEAT, max_tokens=48, model="smollm2")
        after = (await stats(client))["scheduler"]
    tokens = body["choices"][0]["token_ids"]
    assert tokens == want[: len(tokens)] and len(tokens) == min(48, len(want))
    steps = after["num_steps_total"] - before["num_steps_total"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert accepted >= len(tokens) // 3  # measured: about two tokens per step
    assert steps <= len(tokens) - accepted + 1


WEEK = "Continue this list: " + "Monday Tuesday Wednesday Thursday Friday Saturday Sunday " * 3


async def _stop_inside_drafts(client, stream: bool) -> tuple[str, list[int], int, int]:
    """(text, token ids, usage's completion tokens, logprobs entries) of a request whose stop
    string completes mid-line, where n-gram drafts run on past it."""
    body = {"messages": [{"role": "user", "content": WEEK}], "model": "smollm2",
            "max_tokens": 20, "temperature": 0, "stop": ["Wedn"], "logprobs": True,
            "return_token_ids": True, "stream": stream}
    if not stream:
        r = await client.post("/v1/chat/completions", json=body)
        c = r.json()["choices"][0]
        assert c["finish_reason"] == "stop"
        return (c["message"]["content"], c["token_ids"], r.json()["usage"]["completion_tokens"],
                len(c["logprobs"]["content"]))
    body["stream_options"] = {"include_usage": True}
    text, ids, entries, usage, finish = "", [], 0, None, None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: "):])
            usage = chunk.get("usage") or usage
            for c in chunk["choices"]:
                text += c["delta"].get("content", "")
                ids += c.get("token_ids") or []
                entries += len((c.get("logprobs") or {}).get("content") or [])
                finish = c["finish_reason"] or finish
    assert finish == "stop"
    return text, ids, usage["completion_tokens"], entries


async def test_a_stop_string_inside_accepted_drafts_cuts_every_field(default_model_dir):
    """The verify step that completes "Wedn" accepts drafts past it (measured: 7 tokens
    came back for 3); text, token ids, logprobs and usage all end at the third."""
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1)
    async with serve(default_model_dir, name="smollm2") as client:
        plain = await _stop_inside_drafts(client, stream=False)
    async with serve(default_model_dir, name="smollm2", speculative=spec) as client:
        before = (await stats(client))["scheduler"]
        whole = await _stop_inside_drafts(client, stream=False)
        streamed = await _stop_inside_drafts(client, stream=True)
        after = (await stats(client))["scheduler"]
    text, ids, usage, entries = plain
    assert text == "Monday Tuesday " and len(ids) == usage == entries == 3
    assert whole == plain and streamed == plain
    # The drafts did run past the stop: more than the two a request could keep (measured 8).
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert accepted > 2 * 2
