"""The forward pass's thread count comes from the CPUs the process may use and its cgroup's CPU
quota (real cgroup-format files, a real affinity set in a child process), and the OpenMP spin
default yields to whatever the user set."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.gpu.cpu import threads as cpu_threads


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_cgroup_v2_quota_is_the_lowest_along_the_path(tmp_path):
    proc = _tree(tmp_path, {"proc": "0::/kubepods/pod1/app\n"}) / "proc"
    fs = _tree(tmp_path / "fs", {"kubepods/pod1/app/cpu.max": "150000 100000\n",
                                 "kubepods/pod1/cpu.max": "max 100000\n",
                                 "kubepods/cpu.max": "400000 100000\n"})
    assert cpu_threads.cgroup_cpu_quota(proc, fs) == 1.5
    (fs / "kubepods/pod1/cpu.max").write_text("50000 100000\n")  # a parent's limit binds too
    assert cpu_threads.cgroup_cpu_quota(proc, fs) == 0.5


def test_cgroup_v2_inside_a_container_and_without_a_limit(tmp_path):
    proc = _tree(tmp_path, {"proc": "0::/\n"}) / "proc"
    fs = _tree(tmp_path / "fs", {"cpu.max": "200000 100000\n"})
    assert cpu_threads.cgroup_cpu_quota(proc, fs) == 2.0
    (fs / "cpu.max").write_text("max 100000\n")
    assert cpu_threads.cgroup_cpu_quota(proc, fs) is None


def test_cgroup_v1_cfs_quota(tmp_path):
    proc = _tree(tmp_path, {"proc": "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n"})
    fs = _tree(tmp_path / "fs", {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "250000\n",
                                 "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
                                 "cpu,cpuacct/docker/cpu.cfs_quota_us": "-1\n",
                                 "cpu,cpuacct/docker/cpu.cfs_period_us": "100000\n"})
    assert cpu_threads.cgroup_cpu_quota(proc / "proc", fs) == 2.5
    (fs / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_threads.cgroup_cpu_quota(proc / "proc", fs) is None


def test_no_cgroup_files_means_no_quota(tmp_path):
    assert cpu_threads.cgroup_cpu_quota(tmp_path / "missing", tmp_path) is None
    proc = _tree(tmp_path, {"proc": "0::/a\n"}) / "proc"
    assert cpu_threads.cgroup_cpu_quota(proc, tmp_path / "fs") is None


@pytest.mark.parametrize(("ncpus", "quota", "threads"),
                         [(4, None, 4), (4, 1.5, 1), (4, 2.0, 2), (4, 8.0, 4), (4, 0.5, 1),
                          (1, None, 1)])
def test_available_cpus_is_affinity_capped_by_whole_cores_of_quota(ncpus, quota, threads):
    assert cpu_threads.available_cpus(set(range(ncpus)), quota) == threads


def _in_child(code: str, cpus: set[int], **env: str) -> dict:
    """Run ``code`` (which prints one JSON line) in a fresh Python pinned to ``cpus``."""
    script = f"import os\nos.sched_setaffinity(0, {sorted(cpus)!r})\n{code}"
    child_env = {k: v for k, v in os.environ.items() if k != cpu_threads.THREADS_ENV}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       env={**child_env, **env}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


_COUNT = """import json
from pagedserve.gpu.cpu import threads as cpu_threads
print(json.dumps({"threads": cpu_threads.cpu_threads(), "quota": cpu_threads.cgroup_cpu_quota(),
                  "cpus": sorted(cpu_threads.affinity_cpus())}))
"""


def _expected(ncpus: int, quota: float | None) -> int:
    return max(1, min(ncpus, math.floor(quota))) if quota is not None else ncpus


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_thread_count_follows_a_real_affinity_set():
    mine = sorted(os.sched_getaffinity(0))
    for cpus in ({mine[0]}, set(mine[:2])):
        got = _in_child(_COUNT, cpus)
        assert got["cpus"] == sorted(cpus)
        assert got["threads"] == _expected(len(cpus), got["quota"])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_the_runner_pins_torch_to_one_thread_on_one_cpu_and_the_user_overrides():
    code = """import json, torch
from pagedserve.gpu.cpu.thread_governor import ThreadGovernor
g = ThreadGovernor.start()
print(json.dumps({"torch": torch.get_num_threads(), "adaptive": g.cpus is not None}))
"""
    cpu = min(os.sched_getaffinity(0))
    assert _in_child(code, {cpu}) == {"torch": 1, "adaptive": False}
    # The user's count wins over the affinity, and is never adapted at run time.
    assert _in_child(code, {cpu}, PAGEDSERVE_CPU_THREADS="3") == {"torch": 3, "adaptive": False}


def test_user_thread_count_must_be_a_positive_integer(monkeypatch):
    monkeypatch.setenv(cpu_threads.THREADS_ENV, "2")
    assert cpu_threads.cpu_threads() == 2
    for bad in ("0", "-1", "two"):
        monkeypatch.setenv(cpu_threads.THREADS_ENV, bad)
        with pytest.raises(ValueError, match="PAGEDSERVE_CPU_THREADS"):
            cpu_threads.cpu_threads()


def test_openmp_defaults_yield_to_the_user():
    assert cpu_threads.openmp_defaults({}) == cpu_threads.OPENMP_DEFAULTS
    assert cpu_threads.openmp_defaults({"GOMP_SPINCOUNT": "5"}) == {}
    # libgomp derives the spin from a user's wait policy unless GOMP_SPINCOUNT is set.
    assert cpu_threads.openmp_defaults({"OMP_WAIT_POLICY": "active"}) == {}
