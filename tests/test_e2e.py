"""End to end: a real ``pagedserve serve`` process on the embedded default model, queried with
the official ``openai`` client and with raw HTTP."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from pagedserve.server.launch import start_server_process
from tests.conftest import chat_prompt_ids, hf_greedy, hf_tokenizer
from tests.server.openai.test_beam_search import hf_beams

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
ALIAS = "SmolLM2-135M-Instruct"
PAGEDSERVE = str(Path(sys.executable).parent / "pagedserve")


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("e2e") / "server.log"
    with log.open("w") as out:
        try:  # parity with transformers is exact in float32
            proc, url = start_server_process(["--max-model-len", "2048", "--dtype", "float32"],
                                             stdout=out, stderr=subprocess.STDOUT)
        except RuntimeError as e:
            pytest.fail(f"{e}:\n{log.read_text()}")
        yield url
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused")


def test_capital_of_france(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
    )
    assert r.choices[0].message.content == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 8  # 7 tokens of text and <|im_end|>


def _max_tokens_observed(server: str) -> tuple[float, float]:
    """(count, sum) of the finished requests' ``max_tokens`` histogram in ``/metrics``."""
    text = httpx.get(f"{server}/metrics", timeout=30).text
    found = [float(re.search(rf"^pagedserve:request_max_num_generation_tokens_{part}"
                             r"(?:\{[^}]*\})? (\S+)$", text, re.M).group(1))
             for part in ("count", "sum")]
    return found[0], found[1]


def test_a_chat_without_max_tokens_gets_the_embedded_models_default(server):
    """The README's first curl had no ``max_tokens`` and ran to the context (8,155 tokens):
    ``--generation-config auto`` gives the embedded model ``max_new_tokens`` 512 as the default,
    while a request's own ``max_tokens`` (600, above it) is kept."""
    for asked, want in ((None, 512), (600, 600)):
        count, total = _max_tokens_observed(server)
        body = {"model": MODEL, "temperature": 0,
                "messages": [{"role": "user", "content": "Name the capital of France."}]}
        r = httpx.post(f"{server}/v1/chat/completions", timeout=120,
                       json=body if asked is None else {**body, "max_tokens": asked})
        assert r.json()["choices"][0]["finish_reason"] == "stop"
        deadline = time.monotonic() + 30  # observed once the request has finished
        while _max_tokens_observed(server)[0] == count and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _max_tokens_observed(server) == (count + 1, total + want)


@pytest.mark.parametrize("prompt", [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning to cook.",
])
def test_greedy_parity_with_transformers(server, default_model_dir, prompt):
    r = httpx.post(f"{server}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": prompt}],
        "temperature": 0, "max_tokens": 40, "return_token_ids": True})
    ids = chat_prompt_ids(default_model_dir, prompt)
    assert r.json()["choices"][0]["token_ids"] == hf_greedy(default_model_dir, ids, 40)


def test_openai_streaming_equals_non_streaming(client):
    messages = [{"role": "user", "content": "Name two planets and say why they are interesting."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          max_tokens=48)
    stream = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                            max_tokens=48, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert len(chunks) > 10  # really streamed, token by token
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_openai_completions_and_models(client):
    """The embedded model is served by its hub id and by the slash-free alias too."""
    assert [m.id for m in client.models.list().data] == [MODEL, ALIAS]
    for name in (MODEL, ALIAS):
        r = client.completions.create(model=name, prompt="The capital of France is",
                                      max_tokens=5, temperature=0)
        assert r.choices[0].text.strip().startswith("Paris") and r.model == MODEL


def test_agents_sdk_runs_by_the_slash_free_alias(server):
    """The OpenAI Agents SDK reads ``a/b`` as provider/model: the hub id is refused before any
    request, the alias runs a turn (the README's snippet)."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    agents.set_default_openai_client(openai.AsyncOpenAI(base_url=f"{server}/v1",
                                                        api_key="unused"))
    settings = agents.ModelSettings(max_tokens=32, temperature=0)
    with pytest.raises(agents.exceptions.UserError, match="Unknown prefix"):
        agents.Runner.run_sync(agents.Agent(name="a", model=MODEL, model_settings=settings), "Hi")
    agent = agents.Agent(name="assistant", model=ALIAS, model_settings=settings)
    result = agents.Runner.run_sync(agent, "What is the capital of France?")
    assert "Paris" in result.final_output


def test_openai_client_sees_errors(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    assert "gpt-4" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=0)
    assert e.value.body["param"] == "max_tokens"


def test_raw_sse_format(server):
    lines = []
    with httpx.stream("POST", f"{server}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Say hi"}],
            "stream": True, "max_tokens": 8, "temperature": 0}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        # ": ping" comments (sse-starlette's keep-alive, every 15 s) are legal SSE; skip them
        lines = [ln for ln in r.iter_lines() if ln and not ln.startswith(":")]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    first = json.loads(lines[0][6:])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = json.loads(lines[-2][6:])
    assert last["choices"][0]["finish_reason"] in ("stop", "length")


def test_unreachable_hub_model_is_a_one_line_error(tmp_path):
    env = {**os.environ, "HF_HOME": str(tmp_path)}  # an empty cache; no internet here
    r = subprocess.run([PAGEDSERVE, "serve", "no-such-org/no-such-model"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    err = r.stderr.strip().splitlines()
    assert err[-1].startswith("pagedserve: error: model 'no-such-org/no-such-model' is not in "
                              "the local Hugging Face cache")
    assert "Traceback" not in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_a_one_line_error():
    r = subprocess.run([PAGEDSERVE, "serve", "--device", "cuda", "--port", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(
        "pagedserve: error: --device cuda, but torch sees no CUDA device here")


def test_help_lists_flags_with_defaults():
    out = subprocess.run([PAGEDSERVE, "serve", "--help"], capture_output=True, text=True).stdout
    for flag in ["--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--block-size",
                 "--kv-cache-memory-bytes", "--num-gpu-blocks-override", "--dtype",
                 "--served-model-name", "--seed", "--host", "--port", "--chat-template"]:
        assert flag in out
    assert "(default: 8000)" in out and "(default: 16)" in out


def test_openai_n_logprobs_and_usage(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}], n=2,
        logprobs=True, top_logprobs=3, max_tokens=6, temperature=0.8, seed=5)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        content = c.logprobs.content
        assert 1 <= len(content) <= 6
        assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
        assert "".join(t.token for t in content).startswith(c.message.content)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=6,
        temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert chunks[-1].usage.total_tokens == (chunks[-1].usage.prompt_tokens
                                             + chunks[-1].usage.completion_tokens)


def test_openai_echo_prompt_logprobs_and_batch_equal_transformers(client, default_model_dir):
    """SmolLM2, greedy: the echoed prompt's logprobs (and vLLM's prompt_logprobs) are
    transformers' float32 forward pass; a batch of two prompts answers each as alone."""
    from tests.conftest import _hf_model, hf_tokenizer

    tok = hf_tokenizer(str(default_model_dir))
    prompts = ["The capital of France is", "Water boils at a temperature of"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0,
                                  echo=True, logprobs=1,
                                  extra_body={"prompt_logprobs": 1, "return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1]
    for c, prompt in zip(r.choices, prompts):
        ids = tok.encode(prompt)
        out = hf_greedy(default_model_dir, ids, 6)
        assert c.token_ids == out and c.prompt_token_ids == ids
        assert c.text == prompt + tok.decode(out)
        with torch.no_grad():
            want = _hf_model(str(default_model_dir))(torch.tensor([ids])).logits[0].float()
        want = want[:-1].log_softmax(-1)
        got = c.logprobs.token_logprobs[: len(ids)]
        assert got[0] is None and c.prompt_logprobs[0] is None
        # Measured: within 1.2e-5 of transformers (the GGUF kernels' float32 sums differ).
        assert got[1:] == pytest.approx([float(want[j, ids[j + 1]])
                                         for j in range(len(ids) - 1)], abs=1e-3)
        for j, entry in enumerate(c.prompt_logprobs[1:]):
            assert entry[str(ids[j + 1])]["logprob"] == got[j + 1]
            (best,) = [k for k, v in entry.items() if v["rank"] == 1]
            assert int(best) == int(want[j].argmax())
    assert r.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)


def test_openai_beam_search_equals_transformers(client, default_model_dir):
    """vLLM's ``use_beam_search`` through the official client (``extra_body``): the ``n``
    choices are transformers' ``num_beams=n`` hypotheses, best first."""
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=8,
                                  extra_body={"use_beam_search": True, "return_token_ids": True})
    ids = hf_tokenizer(str(default_model_dir)).encode(prompt)
    assert [c.token_ids for c in r.choices] == hf_beams(default_model_dir, ids, 3, 8)

