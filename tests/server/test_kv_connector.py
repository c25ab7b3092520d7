"""Disaggregated prefill/decode through the SharedStorageConnector, on real servers: a producer
instance prefills and writes the prompt's blocks to a directory, a consumer instance loads them
and computes only the rest; its greedy output equals a single instance's. Bad block files are
recomputed or fail the request (``kv_load_failure_policy``), never a wrong answer or a hang;
blocks held for a consumer that never comes are freed after ``kv_hold_timeout_s``."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pagedserve.gpu.kv_connector.base import ConnectorRequest, KVTransferConfig
from pagedserve.gpu.kv_connector.config import parse_kv_transfer_config
from pagedserve.gpu.kv_connector.registry import ConnectorEntry, register_connector
from pagedserve.gpu.kv_connector.shared_storage import SharedStorageScheduler, SharedStorageWorker
from tests.conftest import serve, stats, until_stats

BS = 16
LONG_LEN = 2100  # > 2,048: the prefill is chunked (512-token steps) on both instances
MAX_MODEL_LEN = 2304


def connector(role: str, path: Path, **extra) -> KVTransferConfig:
    import json

    return parse_kv_transfer_config(json.dumps({
        "kv_connector": extra.pop("name", "SharedStorageConnector"), "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(path)}, **extra}))


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49000) for _ in range(n)]


def server(model_dir: Path, kv: KVTransferConfig | None = None):
    return serve(model_dir, max_model_len=MAX_MODEL_LEN, num_blocks=400,
                 kv_transfer_config=kv)


async def complete(client, ids: list[int], max_tokens: int = 8, **body) -> dict:
    r = await client.post("/v1/completions", json={
        "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def all_free(s: dict) -> bool:
    return s["kv_cache"]["num_free_blocks"] == s["kv_cache"]["num_blocks"]


def loaded_tokens(n: int) -> int:
    """Full prompt blocks, all but the one holding the last token (its logits are needed)."""
    return (n - 1) // BS * BS


async def test_consumer_loads_the_producers_blocks_and_answers_the_same(tiny_model_dir,
                                                                         tmp_path):
    prompts = [prompt(70, 1), prompt(LONG_LEN, 2)]
    async with server(tiny_model_dir) as client:  # one instance, no connector
        want = [(await complete(client, p))["choices"][0]["token_ids"] for p in prompts]
        assert (await stats(client))["scheduler"]["kv_transfer"] is None
    async with server(tiny_model_dir, connector("kv_producer", tmp_path)) as client:
        params = []
        for p in prompts:
            body = await complete(client, p, max_tokens=1,
                                  kv_transfer_params={"do_remote_decode": True})
            kv = body["kv_transfer_params"]
            assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
            assert len(kv["remote_block_ids"]) == -(-(len(p) + 1) // BS)
            assert body["choices"][0]["token_ids"] == want[prompts.index(p)][:1]
            params.append(kv)
        s = await until_stats(client, all_free, "all blocks free on the producer")
        assert s["scheduler"]["kv_transfer"]["num_loaded_prompt_tokens_total"] == 0
    assert len(list(tmp_path.glob("*.kv"))) == sum(len(p) // BS for p in prompts)
    async with server(tiny_model_dir, connector("kv_consumer", tmp_path)) as client:
        for p, w, kv in zip(prompts, want, params, strict=True):
            body = await complete(client, p, kv_transfer_params=kv)
            assert body["choices"][0]["token_ids"] == w
        s = await until_stats(client, all_free, "all blocks free on the consumer")
    t = s["scheduler"]["kv_transfer"]
    loaded = sum(loaded_tokens(len(p)) for p in prompts)
    assert t["num_loaded_prompt_tokens_total"] == loaded
    assert t["num_computed_prompt_tokens_total"] == sum(len(p) for p in prompts) - loaded
    assert t["num_failed_loads_total"] == 0 and t["num_held_blocks"] == 0


def _payload_offset(data: bytes) -> int:
    import struct

    from pagedserve.gpu.kv_connector.shared_storage import MAGIC

    (hlen,) = struct.unpack_from("<I", data, len(MAGIC))
    return len(MAGIC) + 4 + hlen


async def test_bad_block_files_are_recomputed_or_fail_the_request(tiny_model_dir, tmp_path):
    """One block file corrupt (a payload byte flipped), one truncated, one removed, between
    the producer's save and the consumer's load."""
    from pagedserve.gpu.kv_connector.shared_storage import block_file

    prompts = [prompt(100, 10 + i) for i in range(4)]
    async with server(tiny_model_dir, connector("kv_producer", tmp_path)) as client:
        want = [(await complete(client, p))["choices"][0]["token_ids"] for p in prompts]
    from pagedserve.actors.kv.hashing import HASH_FUNCTIONS, extend_block_hashes

    def third_block(p: list[int]) -> Path:  # the file of a prompt's third block
        out: list[bytes] = []
        extend_block_hashes(HASH_FUNCTIONS["sha256"], out, p, BS, None)
        return block_file(tmp_path, out[2])

    corrupt, truncated, removed, corrupt_fail = (third_block(p) for p in prompts)
    for path in (corrupt, corrupt_fail):
        data = bytearray(path.read_bytes())
        data[_payload_offset(bytes(data)) + 100] ^= 0xFF
        path.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:-10])
    removed.unlink()
    async with server(tiny_model_dir, connector("kv_consumer", tmp_path)) as client:
        for p, w in zip(prompts[:3], want[:3], strict=True):
            assert (await complete(client, p))["choices"][0]["token_ids"] == w
        s = await until_stats(client, all_free, "all blocks free after the recomputes")
    t = s["scheduler"]["kv_transfer"]
    assert t["num_failed_loads_total"] == 2  # corrupt, truncated: recomputed from scratch
    assert t["num_loaded_prompt_tokens_total"] == 2 * BS  # removed: the two blocks before it
    async with server(tiny_model_dir, connector("kv_consumer", tmp_path,
                                                kv_load_failure_policy="fail")) as client:
        r = await client.post("/v1/completions", json={
            "prompt": prompts[3], "max_tokens": 4, "temperature": 0})
        assert r.status_code == 500 and "KV transfer failed" in r.json()["error"]["message"]
        assert (await complete(client, prompts[2]))["choices"][0]["token_ids"] == want[2]
        await until_stats(client, all_free, "all blocks free after the failed request")


class HoldingScheduler(SharedStorageScheduler):
    """A producer whose consumer never confirms: it holds every finished request's blocks."""

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]):
        _, params = super().request_finished(request, block_ids)
        return True, params


__all__ = ["HoldingScheduler", "SharedStorageWorker"]  # the test connector's two halves
register_connector("HoldingTestConnector", ConnectorEntry(
    __name__, "HoldingScheduler", "SharedStorageWorker"))


async def test_blocks_held_for_a_consumer_that_never_comes_are_freed_after_the_timeout(
        tiny_model_dir, tmp_path):
    kv = connector("kv_producer", tmp_path, name="HoldingTestConnector", kv_hold_timeout_s=0.5)
    async with server(tiny_model_dir, kv) as client:
        await complete(client, prompt(100, 20), max_tokens=1,
                       kv_transfer_params={"do_remote_decode": True})
        s = await stats(client)
        held = s["scheduler"]["kv_transfer"]["num_held_blocks"]
        assert held == -(-101 // BS)  # the prompt's blocks and the sampled token's
        assert s["kv_cache"]["num_free_blocks"] == s["kv_cache"]["num_blocks"] - held
        s = await until_stats(client, all_free, "the held blocks freed after the timeout")
        assert s["scheduler"]["kv_transfer"]["num_hold_timeouts_total"] == 1
        assert s["scheduler"]["kv_transfer"]["num_held_requests"] == 0


@pytest.mark.parametrize("text, message", [
    ("{", "--kv-transfer-config is not JSON"),
    ('{"kv_connector": "Nope"}', "unknown kv_connector 'Nope'; known: "),
    ('{"kv_connector": "SharedStorageConnector", "kv_role": "kv_sender"}', "kv_role 'kv_sender'"),
    ('{"kv_connector": "SharedStorageConnector", "kv_load_failure_policy": "retry"}',
     "kv_load_failure_policy 'retry'"),
    ('{"kv_connector": "SharedStorageConnector", "kv_hold_timeout_s": 0}', "kv_hold_timeout_s"),
    ('{"kv_connector": "SharedStorageConnector", "kv_bogus": 1}', "unknown keys ['kv_bogus']"),
])
def test_bad_kv_transfer_config_is_a_one_line_error(text, message):
    with pytest.raises(ValueError) as e:
        parse_kv_transfer_config(text)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_kv_transfer_config_takes_vllms_keys():
    c = parse_kv_transfer_config(
        '{"kv_connector": "SharedStorageConnector", "kv_role": "kv_consumer", "kv_rank": 1,'
        ' "kv_parallel_size": 2, "kv_buffer_device": "cuda", "engine_id": "dec-0"}')
    assert (c.kv_role.value, c.kv_load_failure_policy.value, c.kv_hold_timeout_s,
            c.engine_id) == ("kv_consumer", "recompute", 120.0, "dec-0")


async def test_tensor_parallel_ranks_each_keep_their_heads_and_a_bad_file_on_any_fails(
        tiny_model_dir, tmp_path):
    """tp=2: one file per block and rank (each its rank's KV heads). A corrupt file of rank 1,
    which does not sample, still fails the load (the ranks' reports are gathered)."""
    from pagedserve.gpu.config import ParallelConfig

    prompts = [prompt(60, 30), prompt(60, 31)]

    def tp2(role: str):
        return serve(tiny_model_dir, max_model_len=256, num_blocks=64,
                     parallel=ParallelConfig(2, 1), kv_transfer_config=connector(role, tmp_path))

    async with tp2("kv_producer") as client:
        want = [(await complete(client, p))["choices"][0]["token_ids"] for p in prompts]
    rank1 = sorted(tmp_path.glob("*.r1.kv"))
    assert len(rank1) == len(list(tmp_path.glob("*.r0.kv"))) == 2 * (60 // BS)
    from pagedserve.actors.kv.hashing import HASH_FUNCTIONS, extend_block_hashes

    hashes: list[bytes] = []
    extend_block_hashes(HASH_FUNCTIONS["sha256"], hashes, prompts[1], BS, None)
    path = tmp_path / f"{hashes[0].hex()}.r1.kv"
    data = bytearray(path.read_bytes())
    data[_payload_offset(bytes(data)) + 7] ^= 0xFF
    path.write_bytes(bytes(data))
    async with tp2("kv_consumer") as client:
        for p, w in zip(prompts, want, strict=True):
            assert (await complete(client, p))["choices"][0]["token_ids"] == w
        s = await until_stats(client, all_free, "all blocks free on the tp consumer")
    t = s["scheduler"]["kv_transfer"]
    assert t["num_failed_loads_total"] == 1
    assert t["num_loaded_prompt_tokens_total"] == loaded_tokens(60)
