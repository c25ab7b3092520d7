"""TCPConnector's two halves over real sockets and real KV tensors (no model): the consumer gets
exactly the producer's bytes of the prompt's full blocks, on every rank; a corrupted byte, a
producer gone mid-transfer or a silent one is a failed load (never a hang, never a wrong
block); a hold that timed out is served no more."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from pagedserve.gpu.kv_connector.base import KVRole, KVTransferConfig
from pagedserve.gpu.kv_connector.tcp_connector import TCPConnectorScheduler, TCPConnectorWorker
from pagedserve.server.launch import free_port
from tests.kv_relay import Relay

BLOCK = 16
LAYERS, BLOCKS, HEADS, HEAD = 3, 12, 2, 8


@dataclass
class Req:
    """What a connector reads of a request (``ConnectorRequest``)."""

    request_id: str
    prompt_token_ids: list[int]
    kv_transfer_params: dict | None = None
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)


def kv_caches(fill: bool, heads: int = HEADS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (BLOCKS, BLOCK, heads, HEAD)
    make = (lambda: torch.randn(shape)) if fill else (lambda: torch.zeros(shape))
    return [(make(), make()) for _ in range(LAYERS)]


def config(role: KVRole, port: int, timeout_s: float = 10.0, hold_s: float = 120.0):
    return KVTransferConfig("TCPConnector", role, {"port": port, "timeout_s": timeout_s},
                            kv_hold_timeout_s=hold_s, engine_id=f"engine-{role.value}")


def until(check: Callable[[], object], what: str, timeout: float = 60.0):
    """Poll until ``check()`` is truthy (the timeout only catches a hang)."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"never {what}"
        time.sleep(0.005)
    return value


class Pair:
    """A producer and a consumer (both halves each) on one tp rank layout."""

    def __init__(self, world_size: int = 1, timeout_s: float = 10.0, hold_s: float = 120.0):
        self.port = free_port() if world_size == 1 else _free_port_run(world_size)
        pc, cc = config(KVRole.PRODUCER, self.port, timeout_s, hold_s), config(
            KVRole.CONSUMER, 0, timeout_s)
        self.p_sched = TCPConnectorScheduler(pc, BLOCK)
        self.c_sched = TCPConnectorScheduler(cc, BLOCK)
        self.p_workers = [TCPConnectorWorker(pc, r, world_size) for r in range(world_size)]
        self.c_workers = [TCPConnectorWorker(cc, r, world_size) for r in range(world_size)]
        heads = HEADS // world_size
        self.p_kv = [kv_caches(True, heads) for _ in range(world_size)]
        self.c_kv = [kv_caches(False, heads) for _ in range(world_size)]
        for w, kv in zip(self.p_workers + self.c_workers, self.p_kv + self.c_kv, strict=True):
            w.register_kv_caches(kv)

    def prefill(self, rid: str, prompt_len: int, block_ids: list[int]) -> dict:
        req = Req(rid, list(range(prompt_len)), {"do_remote_decode": True}, prompt_len)
        hold, params = self.p_sched.request_finished(req, block_ids)
        assert hold
        self.step(self.p_sched, self.p_workers)
        return params

    def decode(self, rid: str, prompt_len: int, params: dict, local_ids: list[int],
               num_computed: int = 0) -> tuple[int, bool]:
        req = Req(rid, list(range(prompt_len)), params, num_computed)
        matched = self.c_sched.get_num_new_matched_tokens(req, num_computed)
        if matched[0]:
            self.c_sched.update_state_after_alloc(req, local_ids, matched[0])
        self.step(self.c_sched, self.c_workers)
        return matched

    @staticmethod
    def step(sched: TCPConnectorScheduler, workers: list[TCPConnectorWorker]) -> None:
        meta = sched.build_connector_meta()
        if meta is not None:
            for w in workers:
                w.start_load_kv(meta)

    def close(self) -> None:
        for w in self.p_workers + self.c_workers:
            w.shutdown()


def _free_port_run(n: int) -> int:
    """A base port with ``n`` free ports from it (rank r listens on base + r)."""
    while True:
        base = free_port()
        try:
            socks = [socket.create_server(("127.0.0.1", base + i)) for i in range(n)]
        except OSError:
            continue
        for s in socks:
            s.close()
        return base


def wait_recved(worker: TCPConnectorWorker, rid: str) -> None:
    got: set[str] = set()

    def check() -> bool:
        failed = worker.get_failed_loads()
        assert not failed, failed
        got.update(worker.get_finished()[1])
        return rid in got

    until(check, f"loaded {rid}")


def wait_failed(worker: TCPConnectorWorker, rid: str) -> str:
    failed: set[str] = set()

    def check() -> bool:
        failed.update(worker.get_failed_loads())
        assert rid not in worker.get_finished()[1], "a broken transfer counted as loaded"
        return rid in failed

    until(check, f"failed {rid}")
    return worker.failure_reasons[rid]


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


def test_pulls_exactly_the_prompts_full_blocks(pair):
    params = pair.prefill("r1", 50, [3, 8, 1, 6])  # 50 tokens: 3 full blocks + 2 tokens
    assert params["remote_block_ids"] == [3, 8, 1]
    assert params["remote_port"] == pair.port and params["do_remote_prefill"]
    # 49 tokens before the last: 3 full blocks load; the last token is computed to sample.
    assert pair.decode("r1", 50, params, [10, 2, 5, 0]) == (48, True)
    wait_recved(pair.c_workers[0], "r1")
    for (pk, pv), (ck, cv) in zip(pair.p_kv[0], pair.c_kv[0], strict=True):
        for p, c in ((pk, ck), (pv, cv)):
            assert torch.equal(c[[10, 2, 5]], p[[3, 8, 1]])
            assert not c[0].any()  # the partial block is not touched
    until(lambda: "r1" in pair.p_workers[0].get_finished()[0], "finished_sending r1")


def test_local_prefix_hits_are_not_pulled_and_the_producer_is_released(pair):
    params = pair.prefill("r2", 40, [4, 5, 6])
    assert pair.decode("r2", 40, params, [7, 9, 11], num_computed=16) == (16, True)
    wait_recved(pair.c_workers[0], "r2")
    for (pk, _), (ck, _) in zip(pair.p_kv[0], pair.c_kv[0], strict=True):
        assert torch.equal(ck[9], pk[5]) and not ck[7].any()
    params = pair.prefill("r3", 40, [4, 5, 6])
    assert pair.decode("r3", 40, params, [7, 9, 11], num_computed=32) == (0, False)
    until(lambda: "r3" in pair.p_workers[0].get_finished()[0], "released r3")


def test_tensor_parallel_ranks_pull_their_own_heads():
    pair = Pair(world_size=2)
    try:
        params = pair.prefill("tp", 33, [2, 4, 9])
        pair.decode("tp", 33, params, [1, 3, 5])
        for rank in range(2):
            wait_recved(pair.c_workers[rank], "tp")
            for (pk, _), (ck, _) in zip(pair.p_kv[rank], pair.c_kv[rank], strict=True):
                assert torch.equal(ck[[1, 3]], pk[[2, 4]])
        assert not torch.equal(pair.c_kv[0][0][0][1], pair.c_kv[1][0][0][1])
    finally:
        pair.close()


def test_under_tp_a_failure_on_one_rank_fails_the_load_on_every_rank():
    """Only one rank's report reaches the scheduler: each rank reports a load only when every
    rank's part of it succeeded."""
    pair = Pair(world_size=2, timeout_s=2.0)
    try:
        params = pair.prefill("tp-bad", 33, [2, 4, 9])
        pair.p_workers[1].shutdown()  # rank 1's producer is gone
        pair.decode("tp-bad", 33, params, [1, 3, 5])
        assert "ConnectionRefusedError" in wait_failed(pair.c_workers[1], "tp-bad")
        assert "another tensor-parallel rank" in wait_failed(pair.c_workers[0], "tp-bad")
        # Rank 0's producer served its half, and lets go only once rank 1's side has ended.
        until(lambda: "tp-bad" in pair.p_workers[0].get_finished()[0], "finished_sending")
    finally:
        pair.close()


HEADER_BYTES = 200  # past the producer's header frame: the blocks' bytes


def test_a_corrupted_block_is_detected(pair):
    params = pair.prefill("bad", 40, [1, 2, 3])

    relay = Relay(pair.port, flip_at=HEADER_BYTES)
    try:
        pair.decode("bad", 40, {**params, "remote_port": relay.port}, [4, 5, 6])
        assert "checksum mismatch in 1 of 2 blocks" in wait_failed(pair.c_workers[0], "bad")
        # The stream itself was whole: the producer is told and lets the blocks go.
        until(lambda: "bad" in pair.p_workers[0].get_finished()[0], "finished_sending bad")
    finally:
        relay.close()


@pytest.mark.parametrize("close", [True, False], ids=["producer-gone", "producer-silent"])
def test_a_transfer_cut_mid_way_fails_never_hangs(close):
    pair = Pair(timeout_s=1.0)
    try:
        params = pair.prefill("cut", 40, [1, 2, 3])
        relay = Relay(pair.port, limit=HEADER_BYTES + 1000, close=close)
        pair.decode("cut", 40, {**params, "remote_port": relay.port}, [4, 5, 6])
        reason = wait_failed(pair.c_workers[0], "cut")
        assert ("closed" in reason) if close else ("timed out" in reason), reason
        relay.close()
    finally:
        pair.close()


def test_a_dead_producer_is_a_failed_load(pair):
    params = pair.prefill("dead", 40, [1, 2, 3])
    pair.p_workers[0].shutdown()
    pair.decode("dead", 40, params, [4, 5, 6])
    assert "ConnectionRefusedError" in wait_failed(pair.c_workers[0], "dead")


def test_a_timed_out_hold_is_withdrawn_before_the_blocks_are_freed():
    pair = Pair(hold_s=0.2)
    try:
        params = pair.prefill("late", 40, [1, 2, 3])

        def withdrawal():
            meta = pair.p_sched.build_connector_meta()
            return meta if meta is not None and "late" in meta.withdrawals else None

        pair.p_workers[0].start_load_kv(until(withdrawal, "withdrawal of the expired hold"))
        pair.decode("late", 40, params, [4, 5, 6])
        assert "no such blocks held" in wait_failed(pair.c_workers[0], "late")
    finally:
        pair.close()


def test_a_prefill_that_did_not_finish_its_prompt_holds_nothing(pair):
    """Aborted mid-prompt (its client left): no consumer is coming, the blocks go at once."""
    req = Req("gone", list(range(40)), {"do_remote_decode": True}, num_computed_tokens=16)
    assert pair.p_sched.request_finished(req, [1, 2, 3]) == (False, None)
    plain = Req("plain", list(range(40)), None, num_computed_tokens=40)
    assert pair.p_sched.request_finished(plain, [1, 2, 3]) == (False, None)
