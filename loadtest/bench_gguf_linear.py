"""One linear layer of the embedded GGUF, four ways, at decode and prefill row counts.

``gguf_linear`` on the file's blocks (float32 and bfloat16 activations) against the
de-quantized weights through oneDNN's pre-packed bfloat16 kernel and float32 ``F.linear``:
the figures behind ``GGUFLinear``'s choice of path (``gpu/gguf_linear.py``). Small layers fit
in cache when timed alone, so the whole-model effect is in ``profile_decode.py
--quantization gguf,none``.

    .venv/bin/python loadtest/bench_gguf_linear.py --rows 1,4,8,32,512
"""

from __future__ import annotations

# ruff: noqa: E402  (cap_torch_env() must run before torch is imported)
import argparse
import time

from pagedserve.kernels.cpu_isa import cap_torch_env

# PAGEDSERVE_CPU_ISA=avx2 caps torch (ATen, oneDNN, MKL) as well as our kernels, so an AVX-512
# machine measures the AVX2 tier; torch reads those caps only if they are set before its import.
cap_torch_env()

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from pagedserve.gpu import cpu_gemm, loader
from pagedserve.gpu.cpu_threads import cpu_threads
from pagedserve.kernels import gguf_ops


def _ms(fn, seconds: float = 0.3) -> float:
    fn()
    start, reps = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        fn()
        reps += 1
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", default="1,2,4,8,16,32,128,512")
    p.add_argument("--tensors", default="blk.0.ffn_gate.weight,blk.0.ffn_down.weight,"
                                        "token_embd.weight")
    args = p.parse_args()
    torch.set_num_threads(cpu_threads())
    tensors = {t.name: t for t in GGUFReader(str(loader.embedded_gguf_path())).tensors}
    for name in args.tensors.split(","):
        t = tensors[name]
        blocks, qtype, k = torch.from_numpy(np.array(t.data)), int(t.tensor_type), int(t.shape[0])
        weight = torch.from_numpy(dequantize(t.data, t.tensor_type)).float()
        dense = torch.nn.Linear(k, weight.shape[0], bias=False)
        dense.weight.data = weight.bfloat16()
        packed = cpu_gemm.PackedLinear(dense) if cpu_gemm.can_pack(
            torch.bfloat16, torch.device("cpu")) else dense
        print(f"{name} {t.tensor_type.name} {tuple(weight.shape)}: {blocks.numel() / 1e6:.2f} MB "
              f"of blocks, {weight.numel() * 2 / 1e6:.2f} MB in bfloat16")
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k)
            xb = x.bfloat16()
            q32 = _ms(lambda: gguf_ops.gguf_linear(x, blocks, qtype))
            q16 = _ms(lambda: gguf_ops.gguf_linear(xb, blocks, qtype))
            bf16 = _ms(lambda: packed(xb))
            f32 = _ms(lambda: torch.nn.functional.linear(x, weight))
            print(f"  rows={rows:4d}  gguf f32 {q32:7.3f} ms  gguf bf16 {q16:7.3f} ms  "
                  f"oneDNN bf16 {bf16:7.3f} ms  F.linear f32 {f32:7.3f} ms")


if __name__ == "__main__":
    main()
