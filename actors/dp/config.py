"""Data-parallel settings, named as vLLM's flags (``vllm/engine/arg_utils.py``): how many
engines serve behind one API server, where they run, and how the router picks one per request
(``actors/dp/router.py``).

A field whose metadata has ``help`` is also a ``pagedserve serve`` flag (``server/engine_args.py``
builds the flags from these fields). Ranks ``0..data_parallel_size-1`` are whole engines (each
its own scheduler, KV pool and executor, in its own process); a node runs
``data_parallel_size_local`` of them, ranks ``data_parallel_start_rank`` on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_RPC_PORT = 29550  # vLLM's default --data-parallel-rpc-port
ROUTING_CHOICES = ("prefix", "least-load", "round-robin")  # DPRouter's ROUTING_POLICIES


@dataclass(slots=True)
class DataParallelConfig:
    """How many engines serve, where they run and how they find the API server."""

    data_parallel_size: int = field(default=1, metadata={
        "help": "engines (replicas), each its own process, scheduler and KV cache, behind one "
                "API server; 1 = the engine runs in the server's process",
        "aliases": ("-dp",),
    })
    data_parallel_size_local: int | None = field(default=None, metadata={
        "help": "engines this node runs (the others run on --headless nodes)",
        "default_text": "--data-parallel-size",
    })
    data_parallel_address: str = field(default="127.0.0.1", metadata={
        "help": "address of the API server's node, where engines register (bound there)",
    })
    data_parallel_rpc_port: int = field(default=DEFAULT_RPC_PORT, metadata={
        "help": "port engines connect to at --data-parallel-address (unused when every engine "
                "is local: a free port is picked)",
    })
    data_parallel_start_rank: int = field(default=0, metadata={
        "help": "rank of this node's first engine (a --headless node's)",
    })
    headless: bool = field(default=False, metadata={
        "help": "run this node's engines and no API server; they register with the API server "
                "at --data-parallel-address:--data-parallel-rpc-port",
    })
    data_parallel_routing: str = field(default="prefix", metadata={
        "help": "which engine gets a request: prefix = the one caching the longest run of its "
                "prompt's blocks unless it has 8 more requests than the lightest, least-load, "
                "or round-robin",
        "choices": ROUTING_CHOICES,
    })

    @property
    def size_local(self) -> int:
        if self.data_parallel_size_local is None:
            return self.data_parallel_size
        return self.data_parallel_size_local

    @property
    def local_ranks(self) -> range:
        start = self.data_parallel_start_rank
        return range(start, start + self.size_local)

    @property
    def in_processes(self) -> bool:
        """Engines run in their own processes (else the one engine runs in the server's)."""
        return self.headless or self.data_parallel_size > 1

    def check(self) -> None:
        """Raises ``ValueError`` for a layout that cannot be served."""
        size, local, start = self.data_parallel_size, self.size_local, self.data_parallel_start_rank
        if size < 1:
            raise ValueError(f"--data-parallel-size {size}: give 1 or more")
        if not 0 <= local <= size:
            raise ValueError(f"--data-parallel-size-local {local}: between 0 and "
                             f"--data-parallel-size ({size})")
        if start < 0 or start + local > size:
            raise ValueError(f"--data-parallel-start-rank {start} with {local} local engines "
                             f"goes past --data-parallel-size {size}")
        if self.headless and local == 0:
            raise ValueError("--headless with no local engine: set --data-parallel-size-local")
        if not self.headless and start != 0:
            raise ValueError("--data-parallel-start-rank is for --headless nodes: the API "
                             "server's own engines are ranks 0 on")
