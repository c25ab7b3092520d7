"""``PAGEDSERVE_CPU_ISA`` set for the server caps torch's kernels too (the server sets the torch
variables before its imports load torch), and ``--dtype auto`` then picks what a CPU of that
tier would get: float32 below avx512, where there is no bfloat16 hardware, except for a GGUF
file multiplied in place (our kernels take bfloat16 at no cost; attention reads half the KV). ``/admin/stats``
names what runs: ``avx2`` on a VNNI CPU capped to it runs no VNNI loop in its int8 layers."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from pagedserve.gpu.dtype_choice import pick_dtype
from pagedserve.kernels import cpu_isa, cpu_ops, gguf_ops
from tests.conftest import serve, stats, stream_chat

CPU = torch.device("cpu")


def _server_torch(**env: str) -> str:
    """torch's CPU capability as seen after importing the server's CLI, in a fresh process."""
    base = {k: v for k, v in os.environ.items() if k not in (
        cpu_isa.ISA_ENV, "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")}
    code = ("import pagedserve.server.cli, torch, os;"
            "print(torch.backends.cpu.get_cpu_capability(), os.environ.get('ONEDNN_MAX_CPU_ISA'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**base, **env}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip()


def test_the_server_caps_torch_to_avx2():
    if "avx2" not in cpu_isa.supported():
        return  # nothing to cap to: the CPU has no AVX2, torch runs below it anyway
    assert _server_torch(PAGEDSERVE_CPU_ISA="avx2") == "AVX2 AVX2"
    # the user's own torch setting wins over ours
    assert _server_torch(PAGEDSERVE_CPU_ISA="avx2", ATEN_CPU_CAPABILITY="default").startswith(
        "DEFAULT ")


def test_dtype_auto_is_float32_on_a_capped_tier(monkeypatch):
    monkeypatch.setenv(cpu_isa.ISA_ENV, "avx2")
    assert pick_dtype("auto", CPU) == torch.float32
    monkeypatch.setenv(cpu_isa.ISA_ENV, "generic")
    assert pick_dtype("auto", CPU) == torch.float32
    monkeypatch.delenv(cpu_isa.ISA_ENV)
    has_bf16 = bool(cpu_isa.cpu_flags() & {"amx_bf16", "avx512_bf16"})
    assert pick_dtype("auto", CPU) == (torch.bfloat16 if has_bf16 else torch.float32)
    assert pick_dtype("bfloat16", CPU) == torch.bfloat16  # an explicit dtype is kept
    monkeypatch.setenv(cpu_isa.ISA_ENV, "avx2")
    assert pick_dtype("auto", CPU, gguf_in_place=True) == torch.bfloat16
    assert pick_dtype("float32", CPU, gguf_in_place=True) == torch.float32


async def test_stats_name_what_runs_under_the_cap(tiny_gguf_path, monkeypatch):
    if "avx2" not in cpu_isa.supported():
        return  # nothing to cap to
    for attr, value in (("_tried", False), ("_lib", None), ("_isa", None), ("_vnni", False)):
        monkeypatch.setattr(cpu_ops, attr, value)  # load() again, under the cap
    monkeypatch.setenv(cpu_isa.ISA_ENV, "avx2")
    async with serve(tiny_gguf_path, quantization="gguf", max_model_len=64,
                     cpu_linear_mode="int8", dtype="auto") as c:
        model = (await stats(c))["config"]["model"]
        _, tokens, _ = await stream_chat(c, "Hi", max_tokens=2, ignore_eos=True)
    async with serve(tiny_gguf_path, quantization="none", max_model_len=64, dtype="auto") as c:
        dequantized = (await stats(c))["config"]["model"]
    assert model["cpu_isa"] == "avx2"  # not avx2_vnni, even where the CPU has AVX-VNNI
    # auto: bfloat16 for the blocks kept in place, float32 (no bfloat16 units) de-quantized
    assert (model["dtype"], dequantized["dtype"]) == ("bfloat16", "float32")
    assert [(p["tier"], p["isa"], p["path"]) for p in model["cpu_linear_paths"]] == [
        ("avx2", "avx2", "int8")]
    assert gguf_ops.q8_variants() == ("generic", "simd") and len(tokens) == 2
