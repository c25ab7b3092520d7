"""The attention backends: chosen by device or by PAGEDSERVE_ATTENTION_BACKEND; Triton equals
the torch backend on a mixed step, and the whole engine gives the same greedy tokens with the
torch, cpu and Triton backends, with caches in the model's dtype and in 8 bits.

Without CUDA the kernels run in Triton's interpreter (see ``tests/triton_interpreter.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import pytest
import torch

from pagedserve.actors.engine.async_engine import AsyncEngine
from pagedserve.gpu.attention import (
    BACKEND_ENV,
    AttentionMetadata,
    CpuAttentionBackend,
    TorchAttentionBackend,
    TritonAttentionBackend,
    get_attention_backend,
)
from pagedserve.gpu.batch import BatchLayout, ScheduledRequest
from pagedserve.gpu.cuda_graph import DecodeBatch
from pagedserve.gpu.sample.sampling_params import SamplingParams
from pagedserve.kernels import kv_quant
from pagedserve.server.launch import running_server
from pagedserve.server.openai.serving import ServingConfig
from tests.conftest import TINY_NAME, chat, engine_config
from tests.triton_interpreter import KERNEL_DEVICE as DEVICE


def test_backend_selection(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert get_attention_backend(torch.device("cpu")).name == "cpu"  # g++ is on CI's machines
    # Our C++ kernels take float32 and bfloat16; float16 on the CPU runs the torch reference.
    assert get_attention_backend(torch.device("cpu"), torch.float16).name == "torch"
    if DEVICE == "cuda":
        assert get_attention_backend(torch.device("cuda")).name == "triton"
    monkeypatch.setenv(BACKEND_ENV, "triton")
    assert isinstance(get_attention_backend(torch.device(DEVICE)), TritonAttentionBackend)
    monkeypatch.setenv(BACKEND_ENV, "Torch")
    assert isinstance(get_attention_backend(torch.device(DEVICE)), TorchAttentionBackend)
    monkeypatch.setenv(BACKEND_ENV, "flash")
    with pytest.raises(ValueError, match="flash"):
        get_attention_backend(torch.device(DEVICE))


def test_cpu_backend_falls_back_to_torch_without_a_compiler(monkeypatch):
    from pagedserve.kernels import cpu_ops

    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.setattr(cpu_ops, "load", lambda: None)
    monkeypatch.setattr(cpu_ops, "_error", "no C++ compiler (g++) on PATH")
    assert get_attention_backend(torch.device("cpu")).name == "torch"
    monkeypatch.setenv(BACKEND_ENV, "cpu")  # forced: say why it cannot run
    with pytest.raises(ValueError, match="no C\\+\\+ compiler"):
        get_attention_backend(torch.device("cpu"))


def test_triton_on_cpu_without_interpreter_says_how(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        TritonAttentionBackend(torch.device("cpu"))


@pytest.mark.parametrize("kv_dtype", [None, *kv_quant.DTYPES])
def test_mixed_step_matches_torch_backend(kv_dtype):
    """Two decodes then two prefill chunks (one after cached context), in one step; with an
    8-bit cache (``--kv-cache-dtype``) too: the same bytes written, the same values read."""
    g = torch.Generator().manual_seed(7)
    block_size, kv_heads, heads, head_size = 4, 2, 4, 16
    seq_lens = [9, 4, 6, 12]  # after this step
    q_lens = [1, 1, 6, 5]
    table = torch.randperm(16, generator=g)[:12].view(4, 3).int()
    kc = torch.randn(16, block_size, kv_heads, head_size, generator=g)
    vc = torch.randn(16, block_size, kv_heads, head_size, generator=g)
    if kv_dtype is not None:
        kc, vc = kv_quant.quantize(kc, kv_dtype), kv_quant.quantize(vc, kv_dtype)
    slots = []
    for i, (s, n) in enumerate(zip(seq_lens, q_lens, strict=True)):
        slots += [int(table[i, p // block_size]) * block_size + p % block_size
                  for p in range(s - n, s)]
    t = sum(q_lens)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor([0, 1, 2, 8, 13]).int(),
        seq_lens=torch.tensor(seq_lens).int(), block_table=table,
        layout=BatchLayout(num_decodes=2, num_prefills=2, num_prefill_tokens=11),
        max_query_len=6, max_seq_len=12,
    )
    q = torch.randn(t, heads, head_size, generator=g)
    k = torch.randn(t, kv_heads, head_size, generator=g)
    v = torch.randn(t, kv_heads, head_size, generator=g)
    outs, caches = [], []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend(torch.device(DEVICE))):
        cache = (kc.clone().to(DEVICE), vc.clone().to(DEVICE))
        m = dataclasses.replace(meta, **{
            f.name: getattr(meta, f.name).to(DEVICE) for f in dataclasses.fields(meta)
            if isinstance(getattr(meta, f.name), torch.Tensor)})
        backend.write_kv(k.to(DEVICE), v.to(DEVICE), cache, m)
        outs.append(backend.forward(q.to(DEVICE), cache, m, head_size**-0.5).cpu())
        caches.append([c.cpu() for c in cache])
    caches = [[c.view(torch.uint8) if kv_dtype else c for c in pair] for pair in caches]
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    before = kc.view(torch.uint8) if kv_dtype else kc
    assert not torch.equal(caches[0][0], before)  # the step's K really was written
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)


def test_cpu_backend_with_draft_queries_matches_torch_backend():
    """A decode, a decode with 3 drafts (4 queries, the kernel) and a prefill chunk after
    cached context (the reference), in one step: equal to the pure-torch backend."""
    g = torch.Generator().manual_seed(11)
    block_size, kv_heads, heads, head_size = 4, 2, 4, 16
    seq_lens, q_lens = [9, 10, 12], [1, 4, 5]
    table = torch.randperm(16, generator=g)[:12].view(3, 4).int()
    kc = torch.randn(16, block_size, kv_heads, head_size, generator=g)
    vc = torch.randn(16, block_size, kv_heads, head_size, generator=g)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(10, dtype=torch.int64),  # unused: no write here
        query_start_loc=torch.tensor([0, 1, 5, 10]).int(), seq_lens=torch.tensor(seq_lens).int(),
        block_table=table, max_query_len=5, max_seq_len=12,
        layout=BatchLayout(num_decodes=1, num_spec_decodes=1, num_spec_decode_tokens=4,
                           num_prefills=1, num_prefill_tokens=5),
    )
    q = torch.randn(sum(q_lens), heads, head_size, generator=g)
    want = TorchAttentionBackend().forward(q, (kc, vc), meta, 0.25)
    got = CpuAttentionBackend().forward(q, (kc, vc), meta, 0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _decode(req_id: str, pos: int, block_ids: list[int]) -> ScheduledRequest:
    return ScheduledRequest(req_id, [100 + pos], pos, block_ids, SamplingParams(0.0), True)


def test_decode_batch_copies_rows_and_only_changed_block_tables():
    batch = DecodeBatch(max_batch=4, max_blocks_per_seq=3, device=torch.device("cpu"))
    reqs = [_decode("a", 5, [7, 2]), _decode("b", 0, [3])]
    batch.update(reqs, padded=4, block_size=4)
    inputs = batch.inputs(4)
    meta = inputs.attn
    assert inputs.input_ids.tolist() == [105, 100, 0, 0]
    assert inputs.positions.tolist() == [5, 0, 0, 0]
    assert meta.slot_mapping.tolist() == [2 * 4 + 1, 3 * 4 + 0, -1, -1]  # padding never written
    assert meta.seq_lens.tolist() == [6, 1, 1, 1]
    assert meta.block_table[:2].tolist() == [[7, 2, 0], [3, 0, 0]]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert meta.layout == BatchLayout(num_decodes=4)
    assert inputs.logits_indices.tolist() == [0, 1, 2, 3]
    # Next step: "a" keeps its blocks (row not copied again), "b" gained a block (copied).
    batch.block_table[0, 0] = -7
    batch.update([_decode("a", 6, [7, 2]), _decode("b", 4, [3, 9])], padded=2, block_size=4)
    assert batch.block_table[:2].tolist() == [[-7, 2, 0], [3, 9, 0]]
    assert batch.inputs(2).attn.slot_mapping.tolist() == [2 * 4 + 2, 9 * 4 + 0]
    batch.invalidate()  # after an eager step every row is copied again
    batch.update([_decode("a", 7, [7, 2])], padded=1, block_size=4)
    assert batch.block_table[0].tolist() == [7, 2, 0]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
async def test_engine_greedy_tokens_same_as_torch_backend(tiny_model_dir, monkeypatch,
                                                          kv_cache_dtype):
    prompts = ["What is the capital of France?", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17"]
    tokens = {}
    for name in ("torch", "cpu", "triton"):
        monkeypatch.setenv(BACKEND_ENV, name)
        engine = await AsyncEngine.start(engine_config(tiny_model_dir, block_size=8,
                                                       kv_cache_dtype=kv_cache_dtype))
        try:
            assert engine.info.attention_backend == name
            async with running_server(engine, ServingConfig(TINY_NAME)) as url:
                async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                    bodies = await asyncio.gather(
                        *(chat(client, p, max_tokens=8, ignore_eos=True) for p in prompts)
                    )
        finally:
            await engine.shutdown()
        tokens[name] = [b["choices"][0]["token_ids"] for b in bodies]
    assert all(len(t) == 8 for t in tokens["torch"])
    assert tokens["triton"] == tokens["torch"]
    assert tokens["cpu"] == tokens["torch"]
