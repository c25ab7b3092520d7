"""Every GGUF type's int8 kernel (``gguf_ops.gguf_q8_linear``) and exact kernel
(``gguf_linear``) at SmolLM2-1.7B's decode and prefill row counts, on every tier and int8
variant this CPU runs: what a Q4_K_M file costs against a Q4_0 one, and what the AVX2 tier
without VNNI gets (the maddubs loop).

Shape: one 1.7B ``ffn_up``-like matrix, 2048 in x 2048 out by default (``--k``, ``--n``).
Random blocks of each type (``tests/kernels/gguf_blocks.py``'s generator: gguf-py's
quantizer where it has one). The variants alternate within each repeat and the median of
``--repeats`` is printed with the weight bytes read per second, so a loaded machine slows
them alike. One thread unless ``--threads``.

    .venv/bin/python loadtest/bench_gguf_types.py --rows 1,8,32 --types Q4_0,Q4_K,Q6_K
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for the block generator

from pagedserve.kernels import cpu_isa, cpu_ops, gguf_ops  # noqa: E402
from tests.kernels.gguf_blocks import random_blocks  # noqa: E402

NAMES = {v[0]: t for t, v in gguf_ops.GGUF_TYPES.items()}


def _time(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--types", default=",".join(NAMES))
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--exact", action="store_true", help="also time the exact kernel")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# cpu supports {cpu_isa.select_level()}, k={args.k} n={args.n}, "
          f"{args.threads} thread(s); median us per call (weight GB/s)")
    for name in args.types.split(","):
        qtype = NAMES[name]
        blocks, _ = random_blocks(qtype, args.n, args.k, seed=0)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, args.k)
            runs: dict[str, list[float]] = {}
            cases = []
            int8 = qtype in gguf_ops.GGUF_PACKED_BYTES  # else only the exact kernel reads it
            for isa in cpu_isa.supported():
                with cpu_ops.use_isa(isa):
                    for variant in gguf_ops.q8_variants() if int8 else ():
                        if variant == "generic" and isa != "generic":
                            continue
                        packed = gguf_ops.gguf_q8_repack(blocks, qtype, args.k)
                        cases.append((f"{isa}/{variant}", isa, variant, packed))
                    if args.exact or not int8:
                        cases.append((f"{isa}/exact", isa, None, blocks))
            calls = max(3, int(2e8 / (args.n * args.k * max(rows, 4))))
            for _ in range(args.repeats):
                for label, isa, variant, w in cases:
                    with cpu_ops.use_isa(isa):
                        if variant is None:
                            def fn(w=w, x=x, qtype=qtype):
                                return gguf_ops.gguf_linear(x, w, qtype)
                        else:
                            def fn(w=w, variant=variant, x=x, qtype=qtype):
                                return gguf_ops.gguf_q8_linear(x, w, qtype, args.n,
                                                               variant=variant)
                        fn()
                        runs.setdefault(label, []).append(_time(fn, calls))
            cells = []
            for label, _, _, w in cases:
                t = statistics.median(runs[label])
                cells.append(f"{label} {t * 1e6:7.0f} ({w.nbytes / t / 1e9:4.1f})")
            print(f"{name:5s} rows {rows:3d}: " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
