"""The scheduler's KV connector side (``actors/kv/transfer.py``) step by step: a real
``KVCacheManager`` and ``Scheduler``, a connector written against the contract
(``gpu/kv_connector/base.py``) that loads asynchronously, and hand-made runner outputs that play
its worker half (``finished_recving``, ``finished_sending``, ``failed_recving``). After every
request has ended, every block is free again: a leaked or early-freed block shows there."""

from __future__ import annotations

from typing import Any

from pagedserve.actors.actor import Actor
from pagedserve.actors.core.config import SchedulerConfig
from pagedserve.actors.core.request import RequestStatus
from pagedserve.actors.core.scheduler import Scheduler
from pagedserve.actors.kv.kv_cache_manager import KVCacheManager
from pagedserve.gpu.batch import ModelRunnerOutput, SchedulerOutput
from pagedserve.gpu.kv_connector.base import (
    ConnectorRequest,
    KVConnectorMetadata,
    KVConnectorScheduler,
    KVRole,
    KVTransferConfig,
    LoadFailurePolicy,
)
from tests.actors.core.test_scheduler import BS, TOKEN, outputs, req

NUM_BLOCKS = 32


class RemoteConnector(KVConnectorScheduler):
    """A decode instance's connector: a request with ``do_remote_prefill`` has every full
    prompt block on a remote producer, loaded asynchronously; a finished request's blocks are
    held when it asked for ``do_remote_decode``."""

    def __init__(self, config: KVTransferConfig, block_size: int):
        super().__init__(config, block_size)
        self.allocs: list[tuple[str, list[int], int]] = []

    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        if not (request.kv_transfer_params or {}).get("do_remote_prefill"):
            return 0, False
        return len(request.prompt_token_ids) - num_computed_tokens, True  # capped by the caller

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        self.allocs.append((request.request_id, list(block_ids), num_external_tokens))

    def build_connector_meta(self) -> KVConnectorMetadata | None:
        return KVConnectorMetadata() if self.allocs else None

    def request_finished(self, request: ConnectorRequest,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        hold = bool((request.kv_transfer_params or {}).get("do_remote_decode"))
        return hold, {"remote_block_ids": block_ids} if hold else None


def make(policy: LoadFailurePolicy = LoadFailurePolicy.RECOMPUTE,
         timeout: float = 120.0) -> tuple[Scheduler, KVCacheManager, RemoteConnector]:
    kv = KVCacheManager(NUM_BLOCKS, BS, enable_caching=True)
    config = KVTransferConfig("RemoteConnector", KVRole.BOTH, kv_load_failure_policy=policy,
                              kv_hold_timeout_s=timeout)
    conn = RemoteConnector(config, BS)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), kv, Actor(),
                      256, kv_connector=conn)
    return sched, kv, conn


def step(sched: Scheduler, **reports: set[str]) -> SchedulerOutput:
    so = sched.schedule()
    out = ModelRunnerOutput({sr.req_id: [TOKEN] for sr in so.scheduled if sr.sample}, **reports)
    sched.update_from_output(so, out)
    return so


def free(kv: KVCacheManager) -> int:
    return kv.block_pool.get_num_free_blocks()


def test_an_async_load_parks_the_request_until_it_lands_then_only_the_rest_is_computed():
    sched, kv, conn = make()
    r = req("a", 18, max_tokens=2)
    r.kv_transfer_params = {"do_remote_prefill": True}
    sched.add_request(r)
    so = step(sched)
    assert so.scheduled == [] and so.kv_connector_metadata is not None
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and sched.has_unfinished_requests()
    assert conn.allocs == [("a", kv.get_block_ids("a"), 16)]  # 4 full blocks, 1 token left
    assert free(kv) == NUM_BLOCKS - 4
    step(sched)  # nothing landed yet: still parked
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    so = step(sched, finished_recving={"a"})  # landed after that step: admitted next step
    so = step(sched)
    (sr,) = so.scheduled
    assert (sr.num_computed_tokens, len(sr.token_ids)) == (16, 2)
    assert sr.prefix_token_ids == r.prompt_token_ids[:16]
    assert sr.block_ids[:4] == conn.allocs[0][1] and len(sr.block_ids) == 5
    assert len(conn.allocs) == 1  # not asked again on re-admission
    step(sched)
    assert outputs(r) == [([TOKEN], None), ([TOKEN], "length")]
    assert free(kv) == NUM_BLOCKS
    assert sched.transfer.stats.num_loaded_prompt_tokens_total == 16
    assert sched.transfer.stats.num_computed_prompt_tokens_total == 2


def test_an_abort_while_parked_keeps_the_blocks_until_the_load_lands():
    sched, kv, _ = make()
    r = req("a", 18)
    r.kv_transfer_params = {"do_remote_prefill": True}
    sched.add_request(r)
    step(sched)
    sched.abort_request("a")
    assert not sched.has_unfinished_requests()
    assert free(kv) == NUM_BLOCKS - 4  # a late write must not land in someone else's block
    assert sched.transfer.snapshot().num_held_blocks == 4
    step(sched, finished_recving={"a"})
    assert free(kv) == NUM_BLOCKS and not sched.transfer.in_flight


def test_a_failed_async_load_is_recomputed_whole_or_fails_the_request():
    sched, kv, _ = make()
    r = req("a", 18, max_tokens=1)
    r.kv_transfer_params = {"do_remote_prefill": True}
    sched.add_request(r)
    step(sched)
    step(sched, failed_recving={"a"})
    assert r.status == RequestStatus.WAITING
    (sr,) = step(sched).scheduled  # from the first token, no connector this time
    assert (sr.num_computed_tokens, len(sr.token_ids)) == (0, 18)
    assert outputs(r) == [([TOKEN], "length")] and free(kv) == NUM_BLOCKS

    sched, kv, _ = make(LoadFailurePolicy.FAIL)
    r = req("b", 18)
    r.kv_transfer_params = {"do_remote_prefill": True}
    sched.add_request(r)
    step(sched)
    step(sched, failed_recving={"b"})
    ((tokens, finish),) = outputs(r)
    assert (tokens, finish, r.status) == ([], "error", RequestStatus.FINISHED_ERROR)
    assert free(kv) == NUM_BLOCKS


def test_a_failed_synchronous_load_drops_the_steps_output_and_recomputes_from_the_local_hits():
    sched, kv, conn = make()
    conn.get_num_new_matched_tokens = lambda request, n: (8, False)  # type: ignore[method-assign]
    r = req("a", 10, max_tokens=1)
    sched.add_request(r)
    (sr,) = step(sched, failed_recving={"a"}).scheduled
    assert (sr.num_computed_tokens, len(sr.token_ids)) == (8, 2)
    assert outputs(r) == [] and r.num_computed_tokens == 0  # its token rested on bad K/V
    (sr,) = step(sched).scheduled
    assert (sr.num_computed_tokens, len(sr.token_ids)) == (0, 10)
    assert outputs(r) == [([TOKEN], "length")] and free(kv) == NUM_BLOCKS
    assert sched.transfer.stats.num_failed_loads_total == 1


def test_held_blocks_go_when_the_consumer_confirms_or_the_timeout_passes():
    sched, kv, _ = make()
    r = req("a", 10, max_tokens=1)
    r.kv_transfer_params = {"do_remote_decode": True}
    sched.add_request(r)
    step(sched)
    assert r.kv_transfer_params == {"remote_block_ids": [0, 1, 2]}  # what the response carries
    assert free(kv) == NUM_BLOCKS - 3 and sched.transfer.in_flight
    step(sched, finished_sending={"a"})
    assert free(kv) == NUM_BLOCKS and not sched.transfer.in_flight

    sched, kv, _ = make(timeout=1e-9)  # expired by the time the next step is built
    r = req("b", 10, max_tokens=1)
    r.kv_transfer_params = {"do_remote_decode": True}
    sched.add_request(r)
    step(sched)
    assert free(kv) == NUM_BLOCKS - 3
    step(sched)
    assert free(kv) == NUM_BLOCKS and sched.transfer.stats.num_hold_timeouts_total == 1


def test_without_a_connector_nothing_of_it_runs():
    sched = Scheduler(SchedulerConfig(), KVCacheManager(8, BS), Actor(), 64)
    sched.add_request(req("a", 5, max_tokens=1))
    so = sched.schedule()
    assert sched.transfer is None and sched.planner.transfer is None
    assert so.kv_connector_metadata is None
