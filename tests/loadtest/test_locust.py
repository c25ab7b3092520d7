"""The locust load test, headless for a few seconds against a real ``pagedserve serve`` process
on the tiny model: streaming users, a share of them hanging up mid-stream. Afterwards no request
failed and every KV block is free again."""

from __future__ import annotations

import csv
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pagedserve.server.launch import start_server_process

BIN = Path(sys.executable).parent
LOCUSTFILE = Path(__file__).parents[2] / "loadtest" / "locustfile.py"


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("locust-server") / "server.log"
    with log.open("w") as out:
        try:
            proc, url = start_server_process(
                [str(tiny_model_dir), "--served-model-name", "tiny", "--max-model-len", "512",
                 "--dtype", "float32", "--num-gpu-blocks-override", "256"],
                stdout=out, stderr=subprocess.STDOUT)
        except RuntimeError as e:
            pytest.fail(f"{e}:\n{log.read_text()}")
        yield url
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_locust_headless_with_disconnects(tiny_server, tmp_path):
    prefix = tmp_path / "run"
    r = subprocess.run(
        [str(BIN / "locust"), "-f", str(LOCUSTFILE), "--headless", "-u", "6", "-r", "6",
         "-t", "12s", "--host", tiny_server, "--model", "tiny", "--max-tokens", "32",
         "--disconnect-share", "0.5", "--csv", str(prefix), "--only-summary",
         "--stop-timeout", "10"],
        capture_output=True, text=True, timeout=120,
    )
    with open(f"{prefix}_stats.csv", newline="") as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    total = rows["Aggregated"]
    assert int(total["Failure Count"]) == 0, r.stderr[-2000:]
    assert int(rows["chat"]["Request Count"]) > 0
    assert int(rows["chat [disconnect]"]["Request Count"]) > 0
    assert int(rows["ttft"]["Request Count"]) > 0 and int(rows["itl"]["Request Count"]) > 0
    # The hung-up requests were aborted: once the server is idle every block is free again.
    deadline = time.monotonic() + 120  # a hung server, not a slow one
    while time.monotonic() < deadline:
        kv = httpx.get(f"{tiny_server}/admin/stats", timeout=60).json()["kv_cache"]
        if kv["num_free_blocks"] == kv["num_blocks"]:
            break
        time.sleep(0.1)
    assert kv["num_free_blocks"] == kv["num_blocks"], kv
