"""What an 8-bit ``--kv-cache-dtype`` costs in output agreement: the greedy chat completions
of ``int8_agreement.py`` (16 prompts, 64 tokens each, EOS ignored, all at once) on the default
model with ``--kv-cache-dtype auto`` and with each 8-bit dtype, token for token against
``auto``. One server per dtype; the other flags are the server's defaults plus ``--extra``.

Prints one JSON line per dtype (``auto`` first, a second server: the control): per prompt
the first position where its tokens leave ``auto``'s (64 = never), their mean, the prompts
identical throughout, and the token agreement (tokens equal up to the first divergence over
all tokens). Speed at 32 streams with long
contexts: ``bench_serving.py --launch --server-args "--kv-cache-dtype int8" --dataset random
--input-len 1500:2000 --output-len 64:64 --max-concurrency 32 --num-prompts 32 --ignore-eos``.

    .venv/bin/python loadtest/kv_dtype_agreement.py [--tokens 64] [--extra "--dtype float32"]
"""

from __future__ import annotations

import argparse
import json
import shlex

from int8_agreement import agreement, greedy_run

# "auto" again first: the control (a second server, same flags; 1.0 where runs repeat).
DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--extra", default="", help="more serve flags for every server")
    args = p.parse_args()
    extra = shlex.split(args.extra)
    auto = greedy_run([*extra, "--kv-cache-dtype", "auto"], args.tokens)
    for kv_dtype in DTYPES:
        got = greedy_run([*extra, "--kv-cache-dtype", kv_dtype], args.tokens)
        print(json.dumps({"kv_cache_dtype": kv_dtype, **agreement(auto, got, args.tokens),
                          "extra": args.extra}), flush=True)


if __name__ == "__main__":
    main()
