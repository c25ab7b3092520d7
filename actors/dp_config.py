"""Data-parallel settings (vLLM's flag names): how many whole engines serve behind one API
server, and how the router picks one per request (``actors/dp_router.py``).

A field whose metadata has ``help`` is a ``pagedserve serve`` flag (``server/engine_args.py``);
this module imports nothing heavy, so ``--help`` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROUTING_CHOICES = ("prefix", "least-load", "round-robin")  # DPRouter's ROUTING_POLICIES


@dataclass(slots=True)
class DataParallelConfig:
    """``--data-parallel-size N`` engines (each its own scheduler, KV cache and executor)
    behind the one API server; the CPU threads are split between them."""

    data_parallel_size: int = field(default=1, metadata={
        "help": "engines behind the API server, each with its own scheduler, KV cache and "
                "executor; the CPU threads are shared out (PAGEDSERVE_CPU_THREADS / N each, one "
                "at least)",
        "aliases": ("-dp",),
    })
    data_parallel_routing: str = field(default="prefix", metadata={
        "help": "which engine gets a request: prefix = the one caching the longest run of its "
                "prompt's blocks unless it has 8 more requests than the lightest, least-load, "
                "or round-robin",
        "choices": ROUTING_CHOICES,
    })
