"""SmolLM2's linear layers, as the model calls them, every way we can multiply them, at decode and
prefill row counts: the figures behind ``--cpu-linear-mode auto``'s table
(``gpu/cpu/linear_bands.py``) and ``GGUFLinear``'s paths (``gpu/gguf_linear.py``).

Shapes (out x in, fused as ``read_blocks`` fuses them): qkv 960x576, o 576x576, gate_up
3072x576, down 576x1536, lm_head 49152x576 (the file's types: Q4_1 layers, a Q8_0 lm_head).
Paths: ``exact`` (``gguf_linear``, float32 activations), ``int8`` (``gguf_q8_linear``, its
fastest variant), dense float32 ``F.linear`` (oneDNN/MKL) and, where the CPU has bfloat16
units, oneDNN's pre-packed bfloat16 (``cpu_gemm.PackedLinear``). The paths alternate within
each repeat and the median of ``--repeats`` is printed, so a loaded machine slows them alike.
``--json`` prints one line per (rows, path) with the summed time over the layer shapes of one
decoder layer (x30 for the model) and the lm_head apart.

    .venv/bin/python loadtest/bench_gguf_linear.py --rows 1,2,4,8,16,32,64,128,512
    PAGEDSERVE_CPU_ISA=avx2 .venv/bin/python loadtest/bench_gguf_linear.py
"""

from __future__ import annotations

# ruff: noqa: E402  (cap_torch_env() must run before torch is imported)
import argparse
import json
import statistics
import time

from pagedserve.kernels.cpu_isa import cap_torch_env

# PAGEDSERVE_CPU_ISA=avx2 caps torch (ATen, oneDNN, MKL) as well as our kernels, so an AVX-512
# machine measures the AVX2 tier; torch reads those caps only if they are set before its import.
cap_torch_env()

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from pagedserve.gpu import loader
from pagedserve.gpu.cpu import gemm as cpu_gemm
from pagedserve.gpu.cpu.threads import cpu_threads
from pagedserve.kernels import cpu_ops, gguf_ops

# Our name -> the GGUF tensors fused into it (layer 0).
SHAPES = {
    "qkv": ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"],
    "o": ["blk.0.attn_output.weight"],
    "gate_up": ["blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"],
    "down": ["blk.0.ffn_down.weight"],
    "lm_head": ["token_embd.weight"],
}


def _ms(fn, seconds: float) -> float:
    fn()
    start, reps = time.perf_counter(), 0
    while time.perf_counter() - start < seconds or reps < 2:
        fn()
        reps += 1
    return (time.perf_counter() - start) / reps * 1e3


def _layers(tensors: dict) -> dict:
    out = {}
    for name, parts in SHAPES.items():
        ts = [tensors[p] for p in parts]
        blocks = torch.cat([torch.from_numpy(np.array(t.data)) for t in ts])
        weight = torch.cat([torch.from_numpy(dequantize(t.data, t.tensor_type)).float()
                            for t in ts])
        dense = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        dense.weight.data = weight.bfloat16()
        packed = cpu_gemm.PackedLinear(dense) if cpu_gemm.can_pack(
            torch.bfloat16, torch.device("cpu")) else None
        qtype = int(ts[0].tensor_type)
        repacked = gguf_ops.gguf_q8_repack(blocks, qtype, weight.shape[1])
        out[name] = (blocks, qtype, weight, packed, repacked)
    return out


def _paths(layer, x: torch.Tensor, variant: str | None) -> dict:
    blocks, qtype, weight, packed, repacked = layer
    n = weight.shape[0]
    paths = {"exact": lambda: gguf_ops.gguf_linear(x, blocks, qtype),
             "int8": lambda: gguf_ops.gguf_q8_linear(x, repacked, qtype, n, variant),
             "dense_f32": lambda: torch.nn.functional.linear(x, weight)}
    if packed is not None:
        xb = x.bfloat16()
        paths["exact_bf16"] = lambda: gguf_ops.gguf_linear(xb, blocks, qtype)
        paths["int8_bf16"] = lambda: gguf_ops.gguf_q8_linear(xb, repacked, qtype, n, variant)
        paths["dense_bf16"] = lambda: packed(xb)
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", default="1,2,4,8,16,32,64,128,512")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seconds", type=float, default=0.05, help="per timing slice")
    p.add_argument("--json", action="store_true")
    p.add_argument("--threads", type=int, default=0, help="0: what the server takes")
    p.add_argument("--int8-variant", default=None, choices=gguf_ops.Q8_VARIANTS,
                   help="simd: the maddubs loop a CPU without VNNI runs (default: the fastest)")
    args = p.parse_args()
    torch.set_num_threads(args.threads or cpu_threads())
    layers = _layers({t.name: t for t in GGUFReader(str(loader.embedded_gguf_path())).tensors})
    tier, variants = cpu_ops.isa(), gguf_ops.q8_variants()
    variant = args.int8_variant or variants[-1]
    print(f"# tier {tier}, torch {torch.backends.cpu.get_cpu_capability()}, int8 variant "
          f"{variant}, {torch.get_num_threads()} threads", flush=True)
    for rows in (int(r) for r in args.rows.split(",")):
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.repeats):  # alternate: every path once per repeat
            for name, layer in layers.items():
                x = torch.randn(rows, layer[2].shape[1])
                for path, fn in _paths(layer, x, variant).items():
                    times.setdefault((name, path), []).append(_ms(fn, args.seconds))
        med = {key: statistics.median(v) for key, v in times.items()}
        paths = sorted({path for _, path in med})
        for path in paths:
            body = sum(med[(n, path)] for n in SHAPES if n != "lm_head")
            row = {"tier": tier, "int8_variant": variant, "rows": rows, "path": path,
                   "layer_ms": round(body, 4),
                   "lm_head_ms": round(med[("lm_head", path)], 4),
                   **{n: round(med[(n, path)], 4) for n in SHAPES}}
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(f"rows={rows:4d} {path:11s} layer {body:8.3f} ms  lm_head "
                      f"{med[('lm_head', path)]:8.3f} ms  "
                      + "  ".join(f"{n} {med[(n, path)]:.3f}" for n in SHAPES), flush=True)


if __name__ == "__main__":
    main()
