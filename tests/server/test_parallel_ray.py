"""The ray backend (``--distributed-executor-backend ray``): the same workers as Ray actors on
a local one-node Ray instance that the executor starts; with tp=2 the Done-means checks of
``test_parallel_serving.py`` (greedy equal to transformers' for batched, chunked-prefill,
prefix-cached and preempted requests), and once the server has stopped no Ray process
(gcs_server, raylet, its agents and workers) of this session is left.

Ray is a test dependency (pyproject's ``test`` extra) and an optional one to serve with
(``pip install 'pagedserve[ray]'``)."""

from __future__ import annotations

import asyncio
import os
import time

from pagedserve.gpu.config import ParallelConfig
from tests import process_leaks
from tests.conftest import serve, stats
from tests.server.test_parallel_serving import (
    SMALL_KV,
    check_batched_chunked_preempted,
    check_layout,
    check_prefix_cached,
)


def ray_processes() -> list[process_leaks.Proc]:
    """This session's live Ray processes (its marker variable, or pytest's descendants)."""
    session = os.environ.get(process_leaks.SESSION_ENV, str(os.getpid()))
    return [p for p in process_leaks.leaked(os.getpid(), session) if process_leaks.is_ray(p)]


async def test_ray_tp2_matrix_then_no_ray_process_left(tiny_model_dir):
    assert not ray_processes()  # none before: the ones after are this test's
    async with serve(tiny_model_dir, parallel=ParallelConfig(2, 1, "ray"), **SMALL_KV) as c:
        layout = (await stats(c))["model"]["parallel"]
        check_layout(layout, 2, 1)
        assert ray_processes()  # the local instance this server started, and its actors
        await check_batched_chunked_preempted(c, tiny_model_dir)
        await check_prefix_cached(c, tiny_model_dir)
    deadline = time.monotonic() + 30  # Ray's shutdown signals its processes: a leak only
    while (left := ray_processes()) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert not left, [f"{p.pid}: {p.cmdline[:100]}" for p in left]
