"""Beam search through the real server: the choices equal transformers' ``generate(num_beams=k,
num_return_sequences=k)`` in float32, the beams share KV blocks while they run, and every block
is free afterwards."""

from __future__ import annotations

import asyncio
import re

import pytest
import pytest_asyncio
import torch

from tests.conftest import _hf_model, chat_prompt_ids, hf_tokenizer, serve, stats, until_stats


def hf_beams(path, prompt_ids: list[int], k: int, max_new_tokens: int, length_penalty: float = 1.0,
             early_stopping: bool | str = False, eos: list[int] | None = None) -> list[list[int]]:
    """The oracle: transformers' beam search, the ``k`` hypotheses best first, each cut after
    its first EOS (the rest is padding)."""
    model = _hf_model(str(path))
    eos = eos or [model.generation_config.eos_token_id]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), num_beams=k, num_return_sequences=k, do_sample=False,
            max_new_tokens=max_new_tokens, length_penalty=length_penalty,
            early_stopping=early_stopping, eos_token_id=eos,
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        )
    beams = []
    for row in out[:, len(prompt_ids):].tolist():
        end = next((i for i, t in enumerate(row) if t in eos), None)
        beams.append(row if end is None else row[: end + 1])
    return beams


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def client(tiny_model_dir):
    async with serve(tiny_model_dir) as c:
        yield c


async def beam_completion(client, prompt, **body) -> dict:
    r = await client.post("/v1/completions", json={
        "prompt": prompt, "use_beam_search": True, "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.mark.parametrize(("k", "length_penalty", "early_stopping"), [
    (2, 1.0, False), (3, 0.0, True), (4, 2.0, "never"), (3, -1.0, False), (1, 1.0, False),
])
async def test_completion_beams_equal_transformers(client, tiny_model_dir, k, length_penalty,
                                                   early_stopping):
    tok = hf_tokenizer(str(tiny_model_dir))
    prompt_ids = tok.encode(PROMPT)
    # A frequent token as a second EOS, so hypotheses also end early, not only at max_tokens.
    stop = hf_beams(tiny_model_dir, prompt_ids, 1, 4)[0][2]
    body = await beam_completion(client, PROMPT, n=k, max_tokens=10, stop_token_ids=[stop],
                                 length_penalty=length_penalty, early_stopping=early_stopping)
    want = hf_beams(tiny_model_dir, prompt_ids, k, 10, length_penalty, early_stopping,
                    eos=[2, stop])
    got = [c["token_ids"] for c in body["choices"]]
    assert got == want
    assert [c["index"] for c in body["choices"]] == list(range(k))
    for c in body["choices"]:
        assert c["finish_reason"] == ("stop" if c["token_ids"][-1] in (2, stop) else "length")
        assert c["text"] == tok.decode(c["token_ids"], skip_special_tokens=True)
    assert body["usage"]["completion_tokens"] == sum(len(g) for g in got)


async def test_chat_beams_equal_transformers(client, tiny_model_dir):
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Tell me about paged attention."}],
        "use_beam_search": True, "n": 3, "max_tokens": 8, "return_token_ids": True,
        "stream": True,  # as vLLM: a beam search is answered whole, never streamed
    })
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    want = hf_beams(tiny_model_dir, chat_prompt_ids(tiny_model_dir,
                                                    "Tell me about paged attention."), 3, 8)
    assert [c["token_ids"] for c in body["choices"]] == want


async def finished_with_length(client) -> float:
    """The request counter for ``finish_reason=length`` in /metrics (whatever the prefix)."""
    text = (await client.get("/metrics")).text
    m = re.search(r'request_success_total\{[^}]*finished_reason="length"[^}]*\} (\S+)', text)
    assert m is not None, text
    return float(m.group(1))


async def test_beams_share_blocks_and_free_them_all(client):
    counted = await finished_with_length(client)
    before = await stats(client)
    kv0 = before["kv_cache"]
    # 40 prompt tokens (2 full blocks of 16 + a partial one) shared by 4 beams for 96 tokens.
    task = asyncio.create_task(beam_completion(
        client, list(range(100, 140)), n=4, max_tokens=96, ignore_eos=True))
    seen = await until_stats(
        client, lambda s: s["kv_cache"]["num_shared_blocks"] > 0 or task.done(),
        "shared blocks during the beam search")
    assert seen["kv_cache"]["num_shared_blocks"] >= 2, "the prompt's full blocks are shared"
    body = await task
    assert len(body["choices"]) == 4 and all(len(c["token_ids"]) == 96 for c in body["choices"])
    after = await until_stats(client, lambda s: s["scheduler"]["num_running"] == 0, "idle")
    kv = after["kv_cache"]
    assert kv["num_free_blocks"] == kv["num_blocks"] and kv["num_shared_blocks"] == 0
    # A forked beam copied at most its last partial block (copy-on-write), never the prefix.
    copies = kv["num_copied_blocks_total"] - kv0["num_copied_blocks_total"]
    forks = (after["scheduler"]["num_beam_forks_total"]
             - before["scheduler"]["num_beam_forks_total"])
    assert 0 < copies <= forks
    assert await finished_with_length(client) == counted + 1  # one request, in the metrics


@pytest.mark.parametrize(("field", "value"), [
    ("logprobs", 2), ("logprobs", 0), ("stop", ["."]), ("presence_penalty", 0.5), ("min_tokens", 2),
    ("response_format", {"type": "json_object"}),
])
async def test_fields_a_beam_search_cannot_honour_are_a_400(client, field, value):
    r = await client.post("/v1/completions", json={
        "prompt": "Hi", "use_beam_search": True, "n": 2, "max_tokens": 4, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and "use_beam_search" in err["message"]
    s = await stats(client)
    assert s["kv_cache"]["num_free_blocks"] == s["kv_cache"]["num_blocks"]


async def test_beams_under_block_pressure_still_equal_transformers(tiny_model_dir):
    """A pool far too small for 4 beams of 88 tokens at once: beams are preempted and parked
    beams' blocks released, and the answer does not change."""
    prompt_ids = list(range(100, 140))
    async with serve(tiny_model_dir, num_blocks=9, max_model_len=128) as c:
        body = await beam_completion(c, prompt_ids, n=4, max_tokens=48)
        s = await until_stats(c, lambda s: s["scheduler"]["num_running"] == 0, "idle")
    assert s["scheduler"]["num_preempted_total"] > 0
    assert s["kv_cache"]["num_free_blocks"] == s["kv_cache"]["num_blocks"]
    assert [ch["token_ids"] for ch in body["choices"]] == hf_beams(tiny_model_dir, prompt_ids,
                                                                  4, 48)


async def test_a_client_that_goes_away_mid_search_frees_every_block(client):
    task = asyncio.create_task(beam_completion(client, list(range(200, 240)), n=4,
                                               max_tokens=400, ignore_eos=True))
    await until_stats(client, lambda s: s["kv_cache"]["num_shared_blocks"] > 0,
                      "the beam search running")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await until_stats(client, lambda s: s["kv_cache"]["num_free_blocks"]
                      == s["kv_cache"]["num_blocks"], "every block free after the disconnect")


@pytest.mark.parametrize("raw", [b"1000", b"-1000", b"1e308", b"-1e308", b"-Infinity", b"NaN"])
async def test_a_length_penalty_out_of_range_is_a_400(client, raw):
    """Issue 33: ``length_penalty: 1000`` killed the scheduler; now a 400 naming the field, and
    the engine serves the next search."""
    body = (b'{"prompt": "Hi", "use_beam_search": true, "n": 2, "max_tokens": 4, '
            b'"length_penalty": ' + raw + b"}")
    r = await client.post("/v1/completions", content=body,
                          headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "length_penalty"
    ok = await beam_completion(client, "Hi", n=2, max_tokens=4, length_penalty=-10.0)
    assert len(ok["choices"]) == 2


async def test_a_list_of_prompts_runs_one_search_per_prompt(client, tiny_model_dir):
    """vLLM's beam search takes a completion's batch: prompt p's beams are choices p*n.."""
    tok = hf_tokenizer(str(tiny_model_dir))
    prompts = [PROMPT, "Once upon a time there was"]
    body = await beam_completion(client, prompts, n=2, max_tokens=6, echo=True)
    ids = [tok.encode(p) for p in prompts]
    want = [b for p in ids for b in hf_beams(tiny_model_dir, p, 2, 6)]
    assert [c["token_ids"] for c in body["choices"]] == want
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"].startswith(prompts[c["index"] // 2]) for c in body["choices"]] == [True] * 4
    assert body["usage"]["prompt_tokens"] == sum(map(len, ids))
    assert body["usage"]["completion_tokens"] == sum(map(len, want))
    s = await until_stats(client, lambda s: s["scheduler"]["num_running"] == 0, "idle")
    assert s["kv_cache"]["num_free_blocks"] == s["kv_cache"]["num_blocks"]
