"""The shared-memory CPU all-reduce and gather (``gpu/parallel/shm_all_reduce.py``) between
real spawned ranks: the same bits as the rank-order sum on every rank (the gather: every
rank's tensor on the first), for the shapes and dtypes a model sends, many calls in a row
(both buffer sets reused); a tensor larger than a slot is left to gloo; a peer that exits
mid-call is reported, not waited for forever."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch

from pagedserve.gpu.parallel import shm_all_reduce

pytestmark = pytest.mark.skipif(not shm_all_reduce.available(), reason="x86-64 only")


def _partial(rank: int, call: int, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * call + rank)
    return torch.randn(shape, generator=g).to(dtype)


def _rank(rank: int, world: int, port: int, calls, results, die_at: int | None) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    comm = shm_all_reduce.ShmAllReduce.create_for_group(dist.group.WORLD, list(range(world)))
    out = []
    try:
        for call, (shape, dtype) in enumerate(calls):
            if die_at is not None and call == die_at and rank == world - 1:
                os._exit(3)
            x = _partial(rank, call, shape, dtype)
            parts = comm.gather(x.clone())  # interleaved with the all-reduces, as in a step
            if parts is not False:
                want_parts = [_partial(r, call, shape, dtype) for r in range(world)]
                assert (parts is None) == (rank != 0)
                assert parts is None or all(torch.equal(p, w) for p, w in zip(parts, want_parts,
                                                                              strict=True))
            done = comm.all_reduce(x)
            want = _partial(0, call, shape, dtype) + _partial(1, call, shape, dtype)
            for r in range(2, world):
                want += _partial(r, call, shape, dtype)
            mine = _partial(rank, call, shape, dtype)
            # Tensors do not cross the queue (their storage would leave with this process).
            out.append((done, torch.equal(x, want), torch.equal(x, mine)))
        results.put((rank, out))
    except shm_all_reduce.PeerGone as e:
        results.put((rank, str(e)))


def _run(world: int, calls, die_at: int | None = None) -> dict:
    from pagedserve.gpu.parallel.comm import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, calls, results, die_at))
             for r in range(world)]
    for p in procs:
        p.start()
    expected = world - (die_at is not None)
    got = dict(results.get(timeout=120) for _ in range(expected))
    for p in procs:
        p.join(timeout=60)
    return got


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_the_rank_order_sum(world):
    calls = [((1, 576), torch.float32), ((32, 576), torch.float32), ((7, 64), torch.bfloat16),
             ((1024, 576), torch.float32), ((3, 5), torch.float16)] * 3
    got = _run(world, calls)
    for rank in range(world):
        assert [done and equal for done, equal, _ in got[rank]] == [True] * len(calls), rank


def test_a_tensor_larger_than_a_slot_is_left_to_gloo():
    big = (shm_all_reduce.MAX_BYTES // 4 + 1,)
    got = _run(2, [(big, torch.float32), ((4, 4), torch.float32)])
    for rank in (0, 1):
        (done_big, _, untouched), (done_small, summed, _) = got[rank]
        assert (done_big, untouched, done_small, summed) == (False, True, True, True)


def test_a_peer_that_exits_mid_call_is_reported():
    got = _run(2, [((8, 8), torch.float32)] * 3, die_at=1)
    assert "rank 1" in got[0] and "exited during an all-reduce" in got[0]
