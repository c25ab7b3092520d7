"""``--generation-config`` / ``--override-generation-config`` (vLLM's): the generation config's
values are the defaults of the fields a request omits; its ``max_new_tokens`` is the default
``max_tokens`` (from the model's own file) or a cap on every request (from the override or a
folder given to the flag). Through a real server on the tiny random Llama."""

from __future__ import annotations

import json

import httpx
import pytest

from pagedserve.server.cli import build_parser
from pagedserve.server.generation_config import load_generation_defaults
from pagedserve.server.openai.serving import ServingConfig
from tests.conftest import TINY_NAME, serve


def _folder(tmp_path, **config):
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


async def _chat(client: httpx.AsyncClient, **body) -> dict:
    r = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Tell me a story."}], "ignore_eos": True,
        "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


async def test_the_models_file_fills_only_what_the_request_omits(tiny_model_dir, tmp_path):
    """``auto``: ``max_new_tokens`` 6 and ``temperature`` 0 from the model's file apply to a
    request without them; a request's own ``max_tokens`` (9, above 6) and ``temperature``
    are kept."""
    defaults = load_generation_defaults(
        "auto", None, _folder(tmp_path, max_new_tokens=6, temperature=0.0, bos_token_id=1), False)
    assert defaults.max_tokens == 6 and defaults.max_tokens_cap is None
    async with serve(tiny_model_dir, serving=ServingConfig(
            TINY_NAME, generation_defaults=defaults)) as client:
        default = await _chat(client, seed=3)
        assert len(default["token_ids"]) == 6 and default["finish_reason"] == "length"
        assert len((await _chat(client, max_tokens=9))["token_ids"]) == 9
        greedy = await _chat(client, temperature=0, max_tokens=6)
        assert default["token_ids"] == greedy["token_ids"]  # the default temperature: 0
        sampled = await _chat(client, temperature=1.0, seed=3, max_tokens=6)
        assert sampled["token_ids"] != greedy["token_ids"]  # the request's own temperature
        r = await client.post("/v1/completions", json={"prompt": "Once upon a time",
                                                       "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 6


async def test_an_override_caps_every_request(tiny_model_dir, tmp_path):
    """``--generation-config vllm --override-generation-config '{"max_new_tokens": 4}'``
    (the flags as parsed): 4 tokens with or without the request's ``max_tokens``; a smaller
    ``max_tokens`` is kept."""
    args = build_parser().parse_args(["serve", "--generation-config", "vllm",
                                      "--override-generation-config", '{"max_new_tokens": 4}'])
    defaults = load_generation_defaults(args.generation_config,
                                        args.override_generation_config, tiny_model_dir, True)
    async with serve(tiny_model_dir, serving=ServingConfig(
            TINY_NAME, generation_defaults=defaults)) as client:
        assert len((await _chat(client))["token_ids"]) == 4
        assert len((await _chat(client, max_tokens=9))["token_ids"]) == 4
        assert len((await _chat(client, max_tokens=2))["token_ids"]) == 2


def test_where_the_defaults_come_from(tiny_model_dir, tmp_path):
    folder = _folder(tmp_path, max_new_tokens=20, top_p=0.5, top_k=7)
    # A folder given to the flag: its max_new_tokens is a cap too, as in vLLM.
    from_folder = load_generation_defaults(str(folder), None, tiny_model_dir, False)
    assert from_folder.sampling == {"top_p": 0.5, "top_k": 7}
    assert (from_folder.max_tokens, from_folder.max_tokens_cap) == (20, 20)
    # The override merges over the file; `vllm` reads no file.
    merged = load_generation_defaults(str(folder), {"top_k": 3, "repetition_penalty": 1.1},
                                      tiny_model_dir, False)
    assert merged.sampling == {"top_p": 0.5, "top_k": 3, "repetition_penalty": 1.1}
    assert load_generation_defaults("vllm", None, folder, True).max_tokens is None
    # The embedded model's file has no max_new_tokens: auto gives it 512, a default only.
    embedded = load_generation_defaults("auto", None, tiny_model_dir, True)
    assert (embedded.max_tokens, embedded.max_tokens_cap) == (512, None)
    assert load_generation_defaults("auto", None, tiny_model_dir, False).max_tokens is None
    with pytest.raises(ValueError, match="no generation_config.json"):
        load_generation_defaults(str(tmp_path / "missing"), None, tiny_model_dir, False)
    with pytest.raises(ValueError, match="temperature=5"):
        load_generation_defaults("vllm", {"temperature": 5}, tiny_model_dir, False)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        load_generation_defaults("vllm", {"max_new_tokens": 0}, tiny_model_dir, False)


def test_a_bad_override_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--override-generation-config", "[1]"])
    assert "a JSON object is needed" in capsys.readouterr().err
