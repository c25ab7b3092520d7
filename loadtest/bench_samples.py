"""What one benchmark request measured, and the summary of a level (TTFT, TPOT, ITL, e2e:
mean, median and p99 in milliseconds; throughputs per second), as ``vllm bench serve`` reports
them. Shared by the server client and the transformers baseline in ``bench_serving.py``."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


@dataclass(slots=True)
class Sample:
    """What one request measured (seconds, from the moment it was sent)."""

    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float = 0.0
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)


def _percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"mean": None, "median": None, "p99": None}
    s = sorted(xs)
    k = (len(s) - 1) * 0.99
    lo = math.floor(k)
    p99 = s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)
    return {"mean": round(statistics.fmean(s) * 1e3, 2),
            "median": round(statistics.median(s) * 1e3, 2), "p99": round(p99 * 1e3, 2)}


def summarize(samples: list[Sample], wall: float, **extra) -> dict:
    ok = [s for s in samples if s.ok]
    out_tokens = sum(s.output_tokens for s in ok)
    tpot = [(s.e2e - s.ttft) / (s.output_tokens - 1) for s in ok if s.output_tokens > 1]
    return {
        **extra,
        "completed": len(ok),
        "failed": len(samples) - len(ok),
        "errors": sorted({s.error for s in samples if s.error})[:3],
        "duration_s": round(wall, 3),
        "output_tokens": out_tokens,
        "request_throughput": round(len(ok) / wall, 3),
        "output_throughput": round(out_tokens / wall, 2),
        "ttft_ms": _percentiles([s.ttft for s in ok if s.ttft is not None]),
        "tpot_ms": _percentiles(tpot),
        "itl_ms": _percentiles([g for s in ok for g in s.itls]),
        "e2e_ms": _percentiles([s.e2e for s in ok]),
    }


def acceptance_length(before: dict | None, after: dict | None) -> float | None:
    """Speculative decoding's tokens per verify pass during a level, from pagedserve's
    ``/admin/stats`` ``spec_decode`` totals before and after it: 1 + accepted drafts / verify
    passes with drafts; ``None`` without drafts (or another server)."""
    if not before or not after or after["num_drafts"] == before["num_drafts"]:
        return None
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    return round(1 + accepted / (after["num_drafts"] - before["num_drafts"]), 3)
