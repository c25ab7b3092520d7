"""The structured-output manager on the real SmolLM2 tokenizer: keys, keyword checks, stop
tokens, the LRU, a padded vocabulary, and JSON's end; and the scheduler parking a request whose
grammar is still compiling (``WAITING_FOR_GRAMMAR``) on the tiny model."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import pytest
import torch
import xgrammar as xgr

from pagedserve.actors.engine.async_engine import AsyncEngine
from pagedserve.actors.errors import EngineError
from pagedserve.actors.structured_output.config import StructuredOutputConfig
from pagedserve.actors.structured_output.manager import (
    GrammarError,
    StructuredOutputManager,
    cache_key,
    check_json_schema,
)
from pagedserve.gpu.sample.grammar_bitmask import apply_grammar_bitmask
from pagedserve.gpu.sample.sampling_params import SamplingParams
from pagedserve.gpu.sample.sampling_params import StructuredOutputsParams as Spec
from tests.conftest import chat_prompt_ids, engine_config, hf_tokenizer

VOCAB = 49152
PADDED = VOCAB + 64  # a model whose embedding is larger than its tokenizer


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return hf_tokenizer(str(default_model_dir))


@pytest.fixture(scope="module")
def manager(tokenizer):
    m = StructuredOutputManager(tokenizer, PADDED, [2], StructuredOutputConfig(cache_size=2))
    yield m
    m.shutdown()


def test_cache_key_is_canonical_text_but_keeps_property_order():
    a = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "string"}}}
    b = {"type": "object", "properties": {"y": {"type": "string"}, "x": {"type": "integer"}}}
    assert cache_key(Spec(json=a)) == cache_key(Spec(json=json.dumps(a, indent=4)))
    assert cache_key(Spec(json=a)) != cache_key(Spec(json=b))  # order fixes the output order
    assert cache_key(Spec(json=a)) != cache_key(Spec(json=a, disable_any_whitespace=True))
    with pytest.raises(GrammarError, match="got regex, choice"):
        cache_key(Spec(regex="a", choice=["a"]))
    with pytest.raises(GrammarError, match="non-empty list"):
        cache_key(Spec(choice=[]))


def test_keyword_check_walks_schemas_not_property_names():
    check_json_schema({"type": "object", "properties": {"contains": {"type": "string"},
                                                        "if": {"type": "integer"}}})
    with pytest.raises(GrammarError, match=r"'uniqueItems' at #/\$defs/t/items/anyOf/1"):
        check_json_schema({"$defs": {"t": {"type": "array", "items": {"anyOf": [
            {"type": "integer"}, {"type": "array", "uniqueItems": True}]}}}})


def test_stop_tokens_include_every_end_of_turn_token(manager, tokenizer):
    ids = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert set(ids) <= set(manager.stop_token_ids)
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") not in manager.stop_token_ids


def test_lru_shares_and_evicts(manager):
    a, b, c = (Spec(regex=r) for r in ("a+", "b+", "c+"))
    fa = manager.submit(a)
    assert manager.submit(Spec(regex="a+")) is fa  # concurrent requests share one compile
    manager.submit(b)
    manager.submit(a)  # a is now the most recent
    manager.submit(c)  # evicts b
    assert manager.submit(a) is fa
    assert manager.submit(b).result() is not None
    with pytest.raises(GrammarError, match="Unclosed"):
        manager.submit(Spec(regex="[a-")).result()


def test_padded_vocabulary_is_never_allowed(manager, tokenizer):
    so = manager.request_for(Spec(json_object=True))
    so._future.result()
    assert so.vocab_size == PADDED
    bitmask = xgr.allocate_token_bitmask(1, so.vocab_size)
    so.matcher.fill_next_token_bitmask(bitmask, 0)
    logits = torch.zeros(2, PADDED)
    apply_grammar_bitmask(logits, bitmask, {"g": 0}, ["u", "g"])
    assert torch.isinf(logits[1, VOCAB:]).all()  # ids past the tokenizer: masked
    assert torch.isfinite(logits[1]).sum() > 0 and torch.isfinite(logits[0]).all()  # unguided
    assert torch.isfinite(logits[1, tokenizer.convert_tokens_to_ids("{")])


def test_json_ends_at_the_closing_brace(manager, tokenizer):
    for spec in (Spec(json_object=True), Spec(json={"type": "object"})):
        matcher = manager.request_for(spec).matcher
        assert matcher.accept_string('{"a": [1, {"b": null}]}')
        assert not matcher.accept_string(" ") and not matcher.accept_string("\n")
        assert matcher.accept_token(tokenizer.convert_tokens_to_ids("<|im_end|>"))
        assert matcher.is_terminated()
    # free whitespace is capped, so padding inside the object cannot run to max_tokens
    matcher = manager.request_for(Spec(json_object=True)).matcher
    assert matcher.accept_string("{" + " " * 16)
    assert not matcher.accept_string(" ")


async def test_the_engine_is_ready_only_after_the_tokenizer_set_up(tiny_model_dir):
    """The set-up runs before the engine says ready, not beside its first forward passes."""
    engine = await AsyncEngine.start(engine_config(tiny_model_dir))
    try:
        assert engine.structured_output._compiler.done()
        assert engine.structured_output._compiler.exception() is None
    finally:
        await engine.shutdown()


async def test_a_failed_tokenizer_set_up_is_logged_not_raised(tokenizer):
    """Only guided requests need the set-up: ``wait_ready`` logs its error and returns."""
    m = StructuredOutputManager(tokenizer, -1, [2])  # xgrammar refuses a vocabulary this small
    try:
        await m.wait_ready()
        assert "vocab_size (-1)" in str(m._compiler.exception())
    finally:
        m.shutdown()


async def test_waiting_for_grammar_then_runs(tiny_model_dir):
    """A caller that skips the handler's compile: the scheduler parks the request, not itself.
    The compile threads are held busy until the plain request is done, so the grammar is still
    compiling when the scheduler sees the request, however fast the machine compiles."""
    config = engine_config(tiny_model_dir)
    engine = await AsyncEngine.start(config)
    gate = threading.Event()
    try:
        for _ in range(config.structured_output.num_compile_threads):
            engine.structured_output._pool.submit(gate.wait)
        spec = Spec(json={"type": "object", "properties": {
            f"k{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 5 + 1}}}-[0-9]{{2}}$"}
            for i in range(80)}}, disable_any_whitespace=True)
        ids = chat_prompt_ids(tiny_model_dir, "json")
        params = SamplingParams(temperature=0, max_tokens=300, structured_outputs=spec)

        async def run(rid: str, p: SamplingParams) -> str:
            return "".join([d.text async for d in engine.generate(rid, ids, p)])

        task = asyncio.create_task(run("guided", params))
        await asyncio.sleep(0)  # the task sends AddRequest, then waits for output
        s = await engine.get_stats()
        assert s.scheduler.num_waiting_for_grammar == 1
        plain = await run("plain", SamplingParams(temperature=0, max_tokens=5))
        assert plain
        assert (await engine.get_stats()).scheduler.num_waiting_for_grammar == 1
        gate.set()
        out = json.loads(await task)
        assert all(re.fullmatch(r"[a-z]{1,5}-[0-9]{2}", v) for v in out.values())
        assert (await engine.get_stats()).scheduler.num_waiting_for_grammar == 0
        bad = SamplingParams(max_tokens=5, structured_outputs=Spec(regex="[a-"))
        with pytest.raises(EngineError, match="Unclosed"):
            await run("bad", bad)
    finally:
        gate.set()
        await engine.shutdown()


async def test_the_checked_compile_is_the_one_the_requests_run_on(tiny_model_dir):
    """``compile_grammar``'s result starts the requests as is: no second look-up, so neither a
    recompile nor ``WAITING_FOR_GRAMMAR`` once the cache has evicted it; each request its own
    matcher over the one grammar."""
    config = engine_config(tiny_model_dir)
    config.structured_output.cache_size = 1
    engine = await AsyncEngine.start(config)
    try:
        spec, other = Spec(regex="[a-z]{3}"), Spec(regex="[0-9]{3}")
        grammar = await engine.compile_grammar(spec)
        await engine.compile_grammar(other)  # evicts spec's entry
        ids = chat_prompt_ids(tiny_model_dir, "three letters")
        params = SamplingParams(temperature=0, max_tokens=10, structured_outputs=spec)
        streams = [await engine.add_request(f"r{i}", ids, params, grammar=grammar)
                   for i in range(2)]
        assert (await engine.get_stats()).scheduler.num_waiting_for_grammar == 0
        for stream in streams:
            assert re.fullmatch("[a-z]{3}", "".join([d.text async for d in stream]))
        assert list(engine.structured_output._cache) == [cache_key(other)]  # no recompile
        with pytest.raises(ValueError, match="another constraint"):
            await engine.add_request("r2", ids, SamplingParams(structured_outputs=other),
                                     grammar=grammar)
    finally:
        await engine.shutdown()
