"""GGUF blocks split across ranks (``gpu/parallel/gguf_shard.py``): each rank's blocks are
exactly its slice of the file's weights, the tp=2 and pp=2 logits with blocks kept equal the
one-process GGUF model's (float32), and a split that would cut a 32-element block is refused
naming the layer."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os

import pytest
import torch

from pagedserve.gpu import gguf_linear, loader
from pagedserve.gpu.config import CacheConfig, ModelConfig
from pagedserve.gpu.model_runner import ModelRunner
from pagedserve.gpu.parallel import gguf_ranks
from pagedserve.gpu.parallel.comm import ParallelContext, free_port
from pagedserve.gpu.parallel.gguf_shard import CopiedBytes, check_gguf_split, shard_blocks
from pagedserve.gpu.parallel.layout import rank_layout
from pagedserve.gpu.step_inputs import prepare_inputs
from pagedserve.kernels import gguf_ops
from tests.gpu.test_tensor_parallel import _steps

LAYOUTS = [(2, 1), (1, 2)]


def _runner(path: str, parallel: ParallelContext | None = None) -> ModelRunner:
    return ModelRunner(ModelConfig(model=path, dtype="float32", max_model_len=64,
                                   quantization="gguf"),
                       CacheConfig(num_gpu_blocks_override=8, block_size=8), 64, 4,
                       parallel=parallel)


def _logits(runner: ModelRunner) -> tuple[str | None, int, list[torch.Tensor | None]]:
    runner.load()
    kept = sum(isinstance(m, gguf_linear.GGUFLinear) for m in runner.model.modules())
    with torch.inference_mode():
        return runner.quantization, kept, [
            runner.model(prepare_inputs(s, runner.block_size, runner.device), runner.kv_caches)
            for s in _steps()]


def _rank(path: str, rank: int, ports: list[int], results) -> None:
    os.environ["PAGEDSERVE_CPU_THREADS"] = "1"
    torch.set_num_threads(1)
    config = loader.load_config(loader.resolve_model(path).path)
    for (tp, pp), port in zip(LAYOUTS, ports, strict=True):
        layout = rank_layout(config, tp, pp, rank)
        parallel = ParallelContext.init(layout, f"tcp://127.0.0.1:{port}", torch.device("cpu"))
        try:
            quant, kept, out = _logits(_runner(path, parallel))
        finally:
            parallel.destroy()
        results.put(((tp, pp), rank, quant, kept,
                     [t.numpy() for t in out] if layout.is_driver else None))


def _values(qtype: int, rows: torch.Tensor) -> torch.Tensor:
    """``[out, row_bytes]`` blocks → ``[out, in]`` float32 (in from the row's block count)."""
    blocks = rows.shape[1] // gguf_ops.GGUF_BLOCK_BYTES[qtype]
    return gguf_ops.gguf_dequantize(rows, qtype, blocks * gguf_ops.GGUF_BLOCK_SIZE)


def test_rank_blocks_are_the_slices_of_the_files_weights(tiny_gguf_path):
    """De-quantized, rank r's blocks are rows (q/k/v, gate/up, vocabulary) or input columns
    (o_proj, down_proj) of the whole layer's: the same weights, none cut or shifted."""
    config = loader.load_config(loader.resolve_model(str(tiny_gguf_path)).path)
    blocks, kept = gguf_ranks.read_blocks(tiny_gguf_path, config)
    assert kept == [] and len(blocks) == 2 * 4 + 1
    full = {n: _values(q, w) for n, (q, w) in blocks.items()}
    hs = 16
    for r in range(2):
        lay = rank_layout(config, 2, 1, r)
        mine = shard_blocks(blocks, config, lay)
        assert mine.keys() == blocks.keys()
        got = {n: _values(q, w) for n, (q, w) in mine.items()}
        a, b = lay.intermediate
        q0, q1 = lay.q_heads[0] * hs, lay.q_heads[1] * hs
        k0, k1 = lay.kv_heads[0] * hs, lay.kv_heads[1] * hs
        for i in range(2):
            p = f"model.layers.{i}."
            qkv = full[p + "self_attn.qkv_proj"]
            want = torch.cat((qkv[q0:q1], qkv[64 + k0:64 + k1], qkv[96 + k0:96 + k1]))
            assert torch.equal(got[p + "self_attn.qkv_proj"], want)
            gu = full[p + "mlp.gate_up_proj"]
            assert torch.equal(got[p + "mlp.gate_up_proj"],
                               torch.cat((gu[a:b], gu[128 + a:128 + b])))
            assert torch.equal(got[p + "self_attn.o_proj"],
                               full[p + "self_attn.o_proj"][:, q0:q1])
            assert torch.equal(got[p + "mlp.down_proj"], full[p + "mlp.down_proj"][:, a:b])
        v0, v1 = lay.vocab
        assert torch.equal(got["lm_head"], full["lm_head"][v0:v1])
    # A vocabulary that tp does not divide: the last rank's rows padded with all-zero blocks.
    padded = dataclasses.replace(lay, vocab_per_rank=lay.vocab_per_rank + 5)
    head = _values(*shard_blocks(blocks, config, padded)["lm_head"])
    assert head.shape[0] == padded.vocab_per_rank and not head[-5:].any()
    assert torch.equal(head[:-5], full["lm_head"][lay.vocab[0]:lay.vocab[1]])
    # A second pipeline stage holds only its layer's blocks and the lm_head.
    assert shard_blocks(blocks, config, rank_layout(config, 1, 2, 1)).keys() == {
        "model.layers.1.self_attn.qkv_proj", "model.layers.1.self_attn.o_proj",
        "model.layers.1.mlp.gate_up_proj", "model.layers.1.mlp.down_proj", "lm_head"}


def test_a_rank_copies_only_its_share_from_the_file_and_from_the_cache(tiny_gguf_path,
                                                                       tmp_path):
    """Loading with a layout copies exactly the rank's blocks out of the memory-mapped GGUF
    file (or the blocks cache), not the whole set: with tp=2 half of every layer's bytes
    and of the vocabulary's; pp=2's second stage its one layer and the lm_head. The blocks
    equal the in-memory split of the whole set (``shard_blocks``)."""
    config = loader.load_config(loader.resolve_model(str(tiny_gguf_path)).path)
    everything = CopiedBytes()
    blocks, _ = gguf_ranks.read_blocks(tiny_gguf_path, config, copied=everything)
    assert everything.total == sum(w.numel() for _, w in blocks.values())
    gguf_ranks.load_blocks(tiny_gguf_path, config, tmp_path)  # writes the cache (tp=1)
    assert (tmp_path / gguf_ranks.BLOCKS_CACHE).exists()
    for cache_dir in (None, tmp_path):
        for tp, pp, rank in ((2, 1, 0), (2, 1, 1), (1, 2, 1)):
            lay = rank_layout(config, tp, pp, rank)
            copied = CopiedBytes()
            mine, kept = gguf_ranks.load_blocks(tiny_gguf_path, config, cache_dir, lay,
                                                 copied)
            want = shard_blocks(blocks, config, lay)
            assert kept == [] and mine.keys() == want.keys(), (cache_dir, lay)
            for name, (qtype, rows) in want.items():
                assert mine[name][0] == qtype and torch.equal(mine[name][1], rows), name
            assert copied.total == sum(w.numel() for _, w in want.values())
            if tp == 2:  # 2 KV heads, 4 heads, MLP 128, vocab 49152: all split in halves
                assert 2 * copied.total == everything.total, cache_dir
            else:
                layer0 = sum(w.numel() for n, (_, w) in blocks.items() if ".0." in n)
                assert copied.total == everything.total - layer0, cache_dir


def test_gguf_parallel_logits_equal_one_process(tiny_gguf_path):
    path = str(tiny_gguf_path)
    quant, kept, single = _logits(_runner(path))
    assert quant == "gguf" and kept == 2 * 4 + 1
    ctx = mp.get_context("spawn")
    results, ports = ctx.Queue(), [free_port() for _ in LAYOUTS]
    procs = [ctx.Process(target=_rank, args=(path, r, ports, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = [results.get(timeout=300) for _ in range(2 * len(LAYOUTS))]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    # Every rank kept blocks: tp=2 all 9 layers' halves, each pp stage its layer (+ lm_head).
    assert {(lay, r, q, k) for lay, r, q, k, _ in got} == {
        ((2, 1), 0, "gguf", 9), ((2, 1), 1, "gguf", 9), ((1, 2), 0, "gguf", 4),
        ((1, 2), 1, "gguf", 5)}
    for lay, _, _, _, out in got:
        if out is None:
            continue
        for step, (want, have) in enumerate(zip(single, out, strict=True)):
            have = torch.from_numpy(have)
            assert have.shape == want.shape
            torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-4,
                                       msg=f"{lay} step {step}")
            assert torch.equal(have.argmax(-1), want.argmax(-1))


def test_a_split_that_cuts_a_block_is_refused_naming_the_layer(tiny_model_dir):
    config = loader.load_config(tiny_model_dir)  # 4 heads of 16, MLP 128
    check_gguf_split(config, 2)  # o_proj 32, down_proj 64 per rank: whole blocks
    with pytest.raises(ValueError, match=r"o_proj's input per rank is 16 elements, not a "
                                         r"multiple of the GGUF block size 32.*sizes that "
                                         r"work for this model: 1, 2$"):
        check_gguf_split(config, 4)
