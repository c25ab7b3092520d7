"""Speculative decoding at temperature > 0 keeps the output distribution (rejection sampling,
``gpu/spec_decode/rejection_sampler.py``), keeps the seed contract, and a broken verifier is caught.

The loop is the engine's step without the actors: the real ``Scheduler`` (n-gram drafts, block
bookkeeping) and the real ``ModelRunner`` on a tiny random Llama, called in turn. The model
has a 32-token vocabulary so the distribution of the first three tokens sits on a few hundred
sequences (a 49k vocabulary at temperature 1 is near uniform: nothing to compare with 5,000
samples), and its weights are spread so top_p 0.9 keeps a handful of tokens per position.

The test: a two-sample chi-square on the joint of the first three tokens, cells with fewer
than 10 samples in both runs together pooled into one; two runs are indistinguishable when
its p-value is above 0.001. Runs are seeded (seed = the request's index), so the verdict is
the same every time.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from pagedserve.actors.actor import Actor
from pagedserve.actors.core.config import SchedulerConfig
from pagedserve.actors.core.request import Request
from pagedserve.actors.core.scheduler import Scheduler
from pagedserve.actors.kv.kv_cache_manager import KVCacheManager
from pagedserve.actors.spec_decode.proposer import SpeculativeConfig
from pagedserve.gpu.config import CacheConfig, ModelConfig
from pagedserve.gpu.model_runner import ModelRunner
from pagedserve.gpu.sample.sampling_params import SamplingParams
from pagedserve.gpu.spec_decode import rejection_sampler

N = 5000
# Picked among random prompts for drafts this model often takes (about 40% accepted).
PROMPT = [25, 29, 25, 6, 20, 13, 10, 29, 27, 27, 25, 6, 20, 13, 10, 29, 27, 27, 25, 29]
PROMPT_LEN = len(PROMPT)
SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2, prompt_lookup_min=1)
MAX_SEQS = 1024


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[ModelRunner, list[int]]:
    """The runner on a 32-token-vocabulary Llama, and the prompt."""
    path: Path = tmp_path_factory.mktemp("vocab32-llama")
    torch.manual_seed(7)
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=32, max_position_embeddings=128, bos_token_id=1,
        eos_token_id=2, pad_token_id=2, tie_word_embeddings=True, initializer_range=0.4,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(path)
    runner = ModelRunner(
        ModelConfig(model=str(path), dtype="float32", max_model_len=64, device="cpu"),
        CacheConfig(num_gpu_blocks_override=2 * MAX_SEQS, block_size=16),
        max_num_batched_tokens=MAX_SEQS * PROMPT_LEN, max_num_seqs=MAX_SEQS,
    )
    runner.load()
    return runner, PROMPT


def generate(runner: ModelRunner, prompt: list[int], tag: str, seeds: range,
             spec: SpeculativeConfig | None, **params) -> tuple[list[Request], Scheduler]:
    """One finished request per seed (4 tokens, temperature 1, top_p 0.9 unless ``params``
    say), and the scheduler (its draft counters)."""
    kv = KVCacheManager(runner.num_blocks, runner.block_size, enable_caching=False)
    config = SchedulerConfig(max_num_seqs=MAX_SEQS, max_num_batched_tokens=MAX_SEQS * PROMPT_LEN,
                             speculative=spec)
    sched = Scheduler(config, kv, Actor(), runner.max_model_len)
    sp = {"temperature": 1.0, "top_p": 0.9, "max_tokens": 4, "ignore_eos": True, **params}
    requests = [Request(f"{tag}-{s}", prompt, SamplingParams(seed=s, **sp), asyncio.Queue())
                for s in seeds]
    for r in requests:
        sched.add_request(r)
    while sched.has_unfinished_requests():
        so = sched.schedule()
        sched.update_from_output(so, runner.execute_model(so))
    runner.execute_model(sched.schedule())  # hands the runner the finished ids: RNGs freed
    return requests, sched


def chi_square_p(a: Counter, b: Counter, min_count: int = 10) -> float:
    """p-value of the two-sample chi-square test that ``a`` and ``b`` (equal totals) come from
    one distribution; rare cells pooled."""
    cells, pooled = [], [0, 0]
    for key in a.keys() | b.keys():
        x, y = a[key], b[key]
        if x + y < min_count:
            pooled[0] += x
            pooled[1] += y
        else:
            cells.append((x, y))
    if sum(pooled) >= min_count:
        cells.append(tuple(pooled))
    stat = sum((x - y) ** 2 / (x + y) for x, y in cells)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def first3(requests: list[Request]) -> Counter:
    return Counter(tuple(r.output_token_ids[:3]) for r in requests)


def outputs(requests: list[Request]) -> list[list[int]]:
    return [r.output_token_ids for r in requests]


def test_speculation_keeps_the_distribution_and_a_broken_verifier_is_caught(model, monkeypatch):
    runner, prompt = model
    off_a, _ = generate(runner, prompt, "off-a", range(0, N), None)
    off_b, _ = generate(runner, prompt, "off-b", range(N, 2 * N), None)
    on, sched = generate(runner, prompt, "on", range(2 * N, 3 * N), SPEC)
    assert all(len(o) == 4 for o in outputs(on))
    # Drafts were scored and both verdicts happened often.
    assert sched.num_draft_tokens > N
    assert 0.2 < sched.num_accepted_tokens / sched.num_draft_tokens < 0.8
    assert chi_square_p(first3(off_a), first3(off_b)) > 1e-3
    assert chi_square_p(first3(off_a), first3(on)) > 1e-3
    monkeypatch.setattr(rejection_sampler, "acceptance_probability", lambda p, q: 1.0)
    broken, _ = generate(runner, prompt, "broken", range(2 * N, 3 * N), SPEC)
    assert chi_square_p(first3(off_a), first3(broken)) < 1e-6


def test_the_same_seed_gives_the_same_output_with_speculation(model):
    runner, prompt = model
    seeds = range(300)
    first, s1 = generate(runner, prompt, "again-1", seeds, SPEC, max_tokens=12)
    second, _ = generate(runner, prompt, "again-2", seeds, SPEC, max_tokens=12)
    assert outputs(first) == outputs(second) and s1.num_accepted_tokens > 0
    assert len({tuple(o) for o in outputs(first)}) > 100  # seeds differ: the outputs do


def test_penalties_min_tokens_and_bias_apply_at_every_drafted_position(model):
    """Greedy with history-dependent processing: speculation gives plain decoding's output,
    which proves every verified row saw the drafts before it as history."""
    params = {"temperature": 0.0, "max_tokens": 16, "repetition_penalty": 1.3,
              "frequency_penalty": 0.4, "min_tokens": 16, "logit_bias": {7: 2.0, 2: 5.0},
              "ignore_eos": False}
    runner, prompt = model
    plain, _ = generate(runner, prompt, "pen-off", range(1), None, **params)
    spec, sched = generate(runner, prompt, "pen-on", range(1), SPEC, **params)
    assert outputs(spec) == outputs(plain) and sched.num_draft_tokens > 0
    assert 2 not in plain[0].output_token_ids  # min_tokens masked the biased EOS


def test_logprobs_of_accepted_drafts_are_plain_decodings(model):
    runner, prompt = model
    params = {"temperature": 0.0, "max_tokens": 12, "logprobs": 3, "presence_penalty": 0.5}
    logprobs = []
    for tag, spec in (("lp-off", None), ("lp-on", SPEC)):
        (request,), sched = generate(runner, prompt, tag, range(1), spec, **params)
        items = []
        while not request.output_queue.empty():
            items += request.output_queue.get_nowait().logprobs or []
        assert len(items) == 12
        logprobs.append(items)
    assert sched.num_accepted_tokens > 0
    for plain, spec in zip(*logprobs, strict=True):
        assert spec.top_ids == plain.top_ids and spec.rank == plain.rank
        assert spec.logprob == pytest.approx(plain.logprob, abs=1e-5)
