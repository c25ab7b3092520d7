"""vLLM's ``zephyr-lora`` behaviours against SmolLM2-135M with random rank-8 adapters, through
the official ``openai`` client: listing with ``parent``, choosing an adapter by ``model``
(greedy output equals transformers + peft, float32, with base-model and other-adapter
requests in the same steps, prompts chunked), runtime load/unload and their errors."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pytest

from pagedserve.actors.engine.async_engine import AsyncEngine
from pagedserve.gpu.lora.config import LoRAConfig
from pagedserve.server.launch import running_server
from pagedserve.server.lora_modules import RUNTIME_UPDATING_ENV, LoRAModulePath
from pagedserve.server.openai.serving import ServingConfig
from tests.conftest import chat_prompt_ids, engine_config, hf_greedy
from tests.lora_adapters import make_adapter, peft_greedy

NAME = "smollm2"
MAX_TOKENS = 8
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def zephyr(tmp_path_factory, default_model_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("zephyr")
    return {"zephyr-lora": make_adapter(default_model_dir, root / "zephyr-lora", 11, std=0.08),
            "zephyr-lora2": make_adapter(default_model_dir, root / "zephyr-lora2", 12, std=0.08),
            "rank32": make_adapter(default_model_dir, root / "rank32", 13, rank=32)}


@pytest.fixture
async def client(default_model_dir, zephyr, monkeypatch):
    monkeypatch.setenv(RUNTIME_UPDATING_ENV, "True")
    config = engine_config(default_model_dir, max_num_batched_tokens=16)
    config.model.lora = LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=16)
    config.scheduler.max_loras = 2
    engine = await AsyncEngine.start(config)
    serving = ServingConfig((NAME,), metrics_prefix="vllm", lora_modules=(
        LoRAModulePath("zephyr-lora", str(zephyr["zephyr-lora"])),
        LoRAModulePath("zephyr-lora2", str(zephyr["zephyr-lora2"]), "custom-parent")))
    try:
        async with running_server(engine, serving) as url:
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none",
                                          max_retries=0) as c:
                yield c
    finally:
        await engine.shutdown()


async def _chat_ids(client: openai.AsyncOpenAI, model: str) -> list[int]:
    r = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTION}], temperature=0,
        max_tokens=MAX_TOKENS, extra_body={"return_token_ids": True, "ignore_eos": True})
    return r.choices[0].model_extra["token_ids"]


async def test_lists_adapters_with_parent(client, zephyr):
    models = {m.id: m for m in (await client.models.list()).data}
    assert set(models) == {NAME, "zephyr-lora", "zephyr-lora2"}
    assert models["zephyr-lora"].root == str(zephyr["zephyr-lora"])
    assert models["zephyr-lora"].model_extra["parent"] == NAME
    assert models["zephyr-lora2"].model_extra["parent"] == "custom-parent"
    assert (await client.models.retrieve("zephyr-lora")).root == str(zephyr["zephyr-lora"])


async def test_choose_by_name_in_mixed_steps_equals_peft(client, zephyr, default_model_dir):
    ids = chat_prompt_ids(default_model_dir, QUESTION)
    want = {NAME: hf_greedy(default_model_dir, ids, MAX_TOKENS)}
    for name in ("zephyr-lora", "zephyr-lora2"):
        want[name] = peft_greedy(default_model_dir, zephyr[name], ids, MAX_TOKENS)
    assert len({tuple(w) for w in want.values()}) == 3  # each adapter changes the answer
    names = [NAME, "zephyr-lora", "zephyr-lora2", "zephyr-lora", NAME]
    got = await asyncio.gather(*(_chat_ids(client, n) for n in names))
    assert got == [want[n] for n in names]
    with pytest.raises(openai.NotFoundError):
        await _chat_ids(client, "no-such-lora")


async def _post(client: openai.AsyncOpenAI, path: str, body: dict):
    return await client._client.post(f"{client.base_url}{path}", json=body)


async def test_load_use_unload_and_errors(client, zephyr, default_model_dir):
    path = str(zephyr["zephyr-lora"])
    r = await _post(client, "load_lora_adapter", {"lora_name": "loaded", "lora_path": path})
    assert r.status_code == 200, r.text
    assert "loaded" in {m.id for m in (await client.models.list()).data}
    first = await _chat_ids(client, "loaded")
    assert first == await _chat_ids(client, "zephyr-lora")  # the same weights

    errors = {
        "taken": ({"lora_name": "loaded", "lora_path": path}, 400, "already been loaded"),
        "missing": ({"lora_name": "x", "lora_path": "/no/such/adapter"}, 404, "does not exist"),
        "no path": ({"lora_name": "x"}, 400, "must be given"),
        "rank": ({"lora_name": "x", "lora_path": str(zephyr["rank32"])}, 400,
                 "--max-lora-rank 16"),
    }
    for why, (body, status, text) in errors.items():
        r = await _post(client, "load_lora_adapter", body)
        assert r.status_code == status, (why, r.text)
        assert text in r.json()["error"]["message"], why
    # A target module the model lacks.
    bad = Path(zephyr["rank32"]).parent / "bad-target"
    bad.mkdir(exist_ok=True)
    cfg = json.loads((zephyr["zephyr-lora"] / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "c_attn"]
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    (bad / "adapter_model.safetensors").write_bytes(
        (zephyr["zephyr-lora"] / "adapter_model.safetensors").read_bytes())
    r = await _post(client, "load_lora_adapter", {"lora_name": "x", "lora_path": str(bad)})
    assert r.status_code == 400 and "c_attn" in r.json()["error"]["message"]

    r = await _post(client, "unload_lora_adapter", {"lora_name": "loaded"})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        await _chat_ids(client, "loaded")
    r = await _post(client, "unload_lora_adapter", {"lora_name": "loaded"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    # Reloaded under the same name: a new load, the same output.
    r = await _post(client, "load_lora_adapter", {"lora_name": "loaded", "lora_path": path})
    assert r.status_code == 200
    assert await _chat_ids(client, "loaded") == first


async def test_lora_requests_info_metric(client):
    """vLLM's ``vllm:lora_requests_info``: a running adapter request shows in its labels."""
    stream = await client.chat.completions.create(
        model="zephyr-lora", messages=[{"role": "user", "content": QUESTION}],
        max_tokens=400, stream=True, extra_body={"ignore_eos": True})
    try:
        await anext(aiter(stream))  # running now, until the stream closes
        text = (await client._client.get(str(client.base_url).removesuffix("v1/")
                                         + "metrics")).text
    finally:
        await stream.close()
    line = next(x for x in text.splitlines() if x.startswith("vllm:lora_requests_info{"))
    assert 'max_lora="2"' in line and 'running_lora_adapters="zephyr-lora"' in line, line
    assert 'waiting_lora_adapters=""' in line
