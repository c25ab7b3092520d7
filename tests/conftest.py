"""Shared fixtures: the real default model, a tiny random Llama with the real tokenizer, the
transformers oracle, and a real Hypercorn server on a loopback port."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import lru_cache
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig

from pagedserve.actors.core.config import SchedulerConfig
from pagedserve.actors.engine.async_engine import AsyncEngine
from pagedserve.actors.engine.config import EngineConfig
from pagedserve.actors.structured_output.config import StructuredOutputConfig
from pagedserve.gpu import loader
from pagedserve.gpu.config import CacheConfig, ModelConfig, ParallelConfig
from pagedserve.server.launch import running_server
from pagedserve.server.openai.serving import ServingConfig
from tests import (
    process_leaks,
    triton_interpreter,  # noqa: F401  (TRITON_INTERPRET before triton loads)
)

TINY_NAME = "tiny-llama"


@pytest.fixture(scope="session", autouse=True)
def no_orphan_processes():
    """Set up before every other fixture, torn down after them all: the session's servers and
    workers (``tests/process_leaks.py``) must all be gone at its end, or the session errors."""
    if not process_leaks.available():
        yield
        return
    session = str(os.getpid())
    os.environ[process_leaks.SESSION_ENV] = session  # inherited by every process started
    yield
    left = process_leaks.wait_none_leaked(os.getpid(), session)
    assert not left, "processes left after the suite: " + "; ".join(
        f"{p.pid} (parent {p.ppid}): {p.cmdline[:120]}" for p in left)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as a Hugging Face folder: transformers' de-quantized
    copy of the GGUF (cached), the oracle and a float model to serve."""
    return loader.convert_gguf(loader.embedded_gguf_path())


def _random_llama(path: Path, seed: int, hidden: int, intermediate: int) -> Path:
    """A 2-layer random Llama (4 heads, 2 KV heads, SmolLM2's vocabulary size, tied
    embeddings) saved in ``path``."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
        max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        tie_word_embeddings=True,
        initializer_range=0.1,  # spread logits so greedy argmax has no near-ties
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> Path:
    """A 2-layer random Llama (hidden 64, 4 heads, 2 KV heads) with SmolLM2's tokenizer."""
    path = _random_llama(tmp_path_factory.mktemp("tiny-llama"), 1234, 64, 128)
    AutoTokenizer.from_pretrained(default_model_dir).save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_gguf_path(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny Llama written as a .gguf (Q8_0/Q4_0/Q4_1 blocks; ``tests/gguf_tiny.py``)."""
    from tests.gguf_tiny import write_tiny_gguf

    out = tmp_path_factory.mktemp("tiny-gguf") / "tiny-llama.gguf"
    return write_tiny_gguf(tiny_model_dir, loader.embedded_gguf_path(), out,
                           loader.load_config(tiny_model_dir))


@pytest.fixture(scope="session")
def mixed_gguf_path(tmp_path_factory, tiny_model_dir) -> Path:
    """The tiny Llama with mixed types inside fused modules and an F16 down_proj
    (``gguf_tiny.MIXED``), its tied embedding Q8_0."""
    from tests.gguf_tiny import MIXED, write_tiny_gguf

    out = tmp_path_factory.mktemp("mixed-gguf") / "tiny-mixed.gguf"
    return write_tiny_gguf(tiny_model_dir, loader.embedded_gguf_path(), out,
                           loader.load_config(tiny_model_dir), MIXED)


@pytest.fixture(scope="session")
def kquant_gguf_path(tmp_path_factory, default_model_dir) -> Path:
    """A 2-layer random Llama wide enough for K-quant blocks (hidden 256, MLP 512, 4 heads of
    64, 2 KV heads), written with ``gguf_tiny.KQUANT``'s Q4_K/Q5_K/Q6_K/Q5_0/Q5_1 mix and a
    tied Q6_K embedding, as llama.cpp's ``_K_M`` files are."""
    from tests.gguf_tiny import KQUANT, Q, write_tiny_gguf

    path = _random_llama(tmp_path_factory.mktemp("kquant-llama"), 4321, 256, 512)
    out = tmp_path_factory.mktemp("kquant-gguf") / "tiny-kquant.gguf"
    return write_tiny_gguf(path, loader.embedded_gguf_path(), out, loader.load_config(path),
                           KQUANT, embedding=Q.Q6_K)


@pytest.fixture(scope="session")
def lowbit_gguf_path(tmp_path_factory, default_model_dir) -> Path:
    """The K-quant fixture's random Llama written with ``gguf_tiny.LOWBIT``'s Q2_K / Q3_K /
    IQ4_NL / IQ4_XS mix and a tied Q3_K embedding: types with no int8 panels."""
    from tests.gguf_tiny import LOWBIT, Q, write_tiny_gguf

    path = _random_llama(tmp_path_factory.mktemp("lowbit-llama"), 4321, 256, 512)
    out = tmp_path_factory.mktemp("lowbit-gguf") / "tiny-lowbit.gguf"
    return write_tiny_gguf(path, loader.embedded_gguf_path(), out, loader.load_config(path),
                           LOWBIT, embedding=Q.Q3_K)


@lru_cache(maxsize=4)
def _hf_model(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_model(path: Path):
    """transformers' float32 model saved in ``path`` (loaded once: cached)."""
    return _hf_model(str(path))


@lru_cache(maxsize=4)
def hf_tokenizer(path: str):
    return AutoTokenizer.from_pretrained(path)


def hf_gguf_model(gguf: Path, config=None):
    """transformers' own GGUF loading of file ``gguf``: its de-quantized float32 model.
    ``config`` replaces the one transformers reads off the file's metadata, where that misses
    what a family needs (Gemma's caps and query scale, Llama 3.x's RoPE scaling)."""
    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, config=config,
                                                dtype=torch.float32).eval()


def model_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """``model``'s greedy ``generate``: its new tokens for ``prompt_ids`` (stops after EOS,
    included)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        )
    return out[0, len(prompt_ids):].tolist()


def hf_greedy(path: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The oracle: transformers' greedy ``generate`` in float32 (stops after EOS, included)."""
    return model_greedy(hf_model(path), prompt_ids, max_new_tokens)


def model_logprobs(model, ids: list[int], start: int) -> list[float]:
    """The logprob of each token of ``ids`` from index ``start`` (at least 1) on: log-softmax
    of ``model``'s full (uncached) float32 forward over ``ids`` at the position before it."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits[start - 1 : len(ids) - 1], -1)
    return lp.gather(1, torch.tensor(ids[start:])[:, None])[:, 0].tolist()


def hf_logprobs(path: Path, ids: list[int], n_prompt: int) -> list[float]:
    """``model_logprobs`` of transformers' float32 model in ``path`` after ``n_prompt``
    tokens."""
    return model_logprobs(hf_model(path), ids, n_prompt)


# A chat request's body keys for ``check_served_logprobs``: every generated token's logprob
# and every prompt token's (vLLM's ``prompt_logprobs``; 0: its own entry alone). Completions
# take ``logprobs: 0`` instead.
WITH_LOGPROBS = {"logprobs": True, "prompt_logprobs": 0, "return_token_ids": True}


def served_logprobs(answer: dict) -> tuple[list[int], list[float]]:
    """A chat or text completion asked ``WITH_LOGPROBS``: its first choice's prompt and
    generated ids, and the logprob served for each of them after the first."""
    choice = answer["choices"][0]
    if "message" in choice:  # chat: the prompt's ids and logprobs are the answer's
        prompt_ids, prompt_lps = answer["prompt_token_ids"], answer["prompt_logprobs"]
        generated = [e["logprob"] for e in choice["logprobs"]["content"]]
    else:
        prompt_ids, prompt_lps = choice["prompt_token_ids"], choice["prompt_logprobs"]
        generated = choice["logprobs"]["token_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) == len(prompt_ids)
    prompt = [entry[str(t)]["logprob"] for t, entry in zip(prompt_ids[1:], prompt_lps[1:],
                                                           strict=True)]
    return prompt_ids + choice["token_ids"], prompt + generated


def check_served_logprobs(answer: dict, model, tol: float = 1e-4) -> None:
    """The logprobs ``answer`` (``served_logprobs``) gives every token after the first, prompt
    and generated, equal transformers ``model``'s full float32 forward's (``model_logprobs``)
    within ``tol``."""
    ids, got = served_logprobs(answer)
    want = model_logprobs(model, ids, 1)
    worst = max(abs(g - w) for g, w in zip(got, want, strict=True))
    assert worst <= tol, f"logprobs differ by up to {worst:.2e} (> {tol:.0e}) over {len(ids)} ids"


def check_served_answer(answer: dict, model, prompt_ids: list[int], max_tokens: int) -> None:
    """``answer``, a greedy completion of ``prompt_ids`` asked ``WITH_LOGPROBS``, equals
    transformers ``model``: its tokens ``model``'s greedy ``max_tokens`` (``model_greedy``),
    its logprobs ``model``'s forward's (``check_served_logprobs``)."""
    assert answer["choices"][0]["token_ids"] == model_greedy(model, prompt_ids, max_tokens)
    check_served_logprobs(answer, model)


def chat_prompt_ids(path: Path, content: str) -> list[int]:
    tok = hf_tokenizer(str(path))
    text = tok.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    return tok.encode(text, add_special_tokens=False)


def engine_config(model_dir: Path, **kw) -> EngineConfig:
    return EngineConfig(
        # float32: greedy parity with transformers' float32 generate is exact only there.
        model=ModelConfig(model=str(model_dir), max_model_len=kw.pop("max_model_len", 512),
                          dtype=kw.pop("dtype", "float32"),
                          quantization=kw.pop("quantization", None),
                          cpu_linear_mode=kw.pop("cpu_linear_mode", "auto")),
        cache=CacheConfig(
            num_gpu_blocks_override=kw.pop("num_blocks", 256),
            block_size=kw.pop("block_size", 16),
            kv_transfer_config=kw.pop("kv_transfer_config", None),
            kv_cache_dtype=kw.pop("kv_cache_dtype", "auto"),
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=kw.pop("max_num_seqs", 64),
            max_num_batched_tokens=kw.pop("max_num_batched_tokens", 512),
            policy=kw.pop("policy", "fcfs"),
            max_waiting_requests=kw.pop("max_waiting_requests", None),
            speculative=kw.pop("speculative", None),
            async_scheduling=kw.pop("async_scheduling", False),
        ),
        structured_output=StructuredOutputConfig(
            compile_timeout_s=kw.pop("compile_timeout_s", 30.0)),
        parallel=kw.pop("parallel", ParallelConfig()),
    )


@asynccontextmanager
async def serve(model_dir: Path, name: str = TINY_NAME, app_kwargs: dict | None = None,
                serving: ServingConfig | None = None, **kw) -> AsyncIterator[httpx.AsyncClient]:
    """Start an engine and a real Hypercorn server on a free loopback port; yield a client.

    ``serving`` chooses keys and template; ``app_kwargs`` go to ``build_app``; the rest to
    ``engine_config``.
    """
    config = engine_config(model_dir, **kw)
    engine = await AsyncEngine.start(config)
    try:
        serving = serving or ServingConfig(name)
        async with running_server(engine, serving, **(app_kwargs or {})) as url:
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                yield client
    finally:
        await engine.shutdown()


async def chat(client: httpx.AsyncClient, content: str, **body) -> dict:
    body.setdefault("temperature", 0)
    body.setdefault("return_token_ids", True)
    r = await client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": content}], **body}
    )
    assert r.status_code == 200, r.text
    return r.json()


async def stream_chat(client: httpx.AsyncClient, content: str, **body) -> tuple[str, list, list]:
    """Returns (text, token_ids, chunks) of a streamed chat completion."""
    body.setdefault("temperature", 0)
    body.setdefault("return_token_ids", True)
    payload = {"messages": [{"role": "user", "content": content}], "stream": True, **body}
    chunks: list = []
    async with client.stream("POST", "/v1/chat/completions", json=payload) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                chunks.append(data if data == "[DONE]" else json.loads(data))
    assert chunks[-1] == "[DONE]"
    body_chunks = chunks[:-1]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in body_chunks)
    tokens = [t for c in body_chunks for t in c["choices"][0].get("token_ids", [])]
    return text, tokens, body_chunks


async def stats(client: httpx.AsyncClient) -> dict:
    r = await client.get("/admin/stats")
    assert r.status_code == 200
    return r.json()


async def until_stats(client: httpx.AsyncClient, check, what: str,
                      timeout: float = 120.0) -> dict:
    """Poll /admin/stats until ``check(stats)`` holds and return those stats. A state, however
    long a slow or loaded machine takes: ``timeout`` only catches a hung server."""
    deadline = time.monotonic() + timeout
    while not check(s := await stats(client)):
        assert time.monotonic() < deadline, f"never {what}: {s['scheduler']}"
        await asyncio.sleep(0.01)
    return s
