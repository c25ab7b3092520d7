"""Which ISA tier of our CPU kernels runs, and whether the int8 kernel's VNNI loop does: the
best the CPU reports, capped by ``PAGEDSERVE_CPU_ISA`` (``avx2``/``avx512``: no VNNI;
``avx2_vnni``/``avx512_vnni``: where the CPU has it; torch capped to the tier when set before
it is imported); a tier the CPU lacks is refused with the flags it lacks; the build is cached
per tier and degrades to None (the torch fallback) when there is no compiler."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import structlog
import torch

from pagedserve.kernels import cpu_isa, cpu_ops, gguf_ops
from tests.kernels.test_cpu_ops import _setup

ZEN3 = frozenset("fpu sse2 avx avx2 fma f16c bmi2".split())  # AVX2, no AVX-512, no VNNI
ALDER_LAKE = ZEN3 | {"avx_vnni"}  # AVX2 + AVX-VNNI
SKYLAKE_SP = ZEN3 | {"avx512f", "avx512bw", "avx512dq", "avx512vl"}  # AVX-512, no VNNI
ZEN4 = SKYLAKE_SP | {"avx512_bf16", "avx512_vnni"}  # AVX512-VNNI, no AVX-VNNI
SAPPHIRE_RAPIDS = ZEN4 | {"avx_vnni", "amx_int8", "amx_bf16", "amx_tile"}


@pytest.fixture
def fresh(monkeypatch):
    """cpu_ops as before its first load(), restored afterwards."""
    for attr, value in (("_tried", False), ("_lib", None), ("_isa", None), ("_vnni", False),
                        ("_error", None)):
        monkeypatch.setattr(cpu_ops, attr, value)
    monkeypatch.delenv(cpu_isa.ISA_ENV, raising=False)
    return monkeypatch


def test_selection_is_the_best_tier_under_the_cap():
    assert cpu_isa.supported(ZEN3) == ("generic", "avx2")
    assert cpu_isa.supported(ZEN4) == ("generic", "avx2", "avx512")
    assert cpu_isa.supported(frozenset()) == ("generic",)  # e.g. aarch64: no x86 flags
    assert cpu_isa.select(None, ZEN4) == "avx512" and cpu_isa.select("amx", ZEN4) == "avx512"
    assert cpu_isa.select("avx2", ZEN4) == "avx2" and cpu_isa.select("generic", ZEN4) == "generic"
    assert cpu_isa.select("avx512", ZEN3) == "avx2"  # a cap above the CPU is no promotion
    assert cpu_isa.select(None, frozenset({"avx2", "fma"})) == "generic"  # no F16C
    assert cpu_isa.select("avx2_vnni", ZEN4) == "avx2"
    assert cpu_isa.select("avx512_vnni", ZEN3) == "avx2"


@pytest.mark.parametrize(("cap", "flags", "runs"), [
    # uncapped: each CPU class as it is
    (None, ZEN3, "avx2"), (None, ALDER_LAKE, "avx2_vnni"), (None, SKYLAKE_SP, "avx512"),
    (None, ZEN4, "avx512_vnni"), (None, SAPPHIRE_RAPIDS, "avx512_vnni"),
    ("amx", SAPPHIRE_RAPIDS, "avx512_vnni"), (None, frozenset(), "generic"),
    # avx2 and avx512 run no vpdpbusd even where the CPU has it
    ("avx2", SAPPHIRE_RAPIDS, "avx2"), ("avx2", ALDER_LAKE, "avx2"),
    ("avx512", SAPPHIRE_RAPIDS, "avx512"), ("avx512", ZEN4, "avx512"),
    ("generic", SAPPHIRE_RAPIDS, "generic"),
    # the _vnni caps allow it where the CPU reports the tier's flag
    ("avx2_vnni", SAPPHIRE_RAPIDS, "avx2_vnni"), ("avx512_vnni", SAPPHIRE_RAPIDS, "avx512_vnni"),
    ("avx2_vnni", ZEN4, "avx2"),  # Zen 4 has AVX512-VNNI but not its VEX form
    # a cap above the CPU runs the best it has
    ("avx512_vnni", ZEN3, "avx2"), ("avx512_vnni", ALDER_LAKE, "avx2_vnni"),
    ("avx512_vnni", SKYLAKE_SP, "avx512"), ("avx2_vnni", ZEN3, "avx2"),
])
def test_levels_resolve_as_cpus_have_them(cap, flags, runs):
    assert cpu_isa.select_level(cap, flags) == runs
    tier = cpu_isa.select(cap, flags)
    assert cpu_isa.level(tier, cpu_isa.vnni_allowed(tier, cap, flags)) == runs


@pytest.mark.parametrize("cap", cpu_isa.LEVELS)
def test_cap_is_obeyed_and_logged(fresh, cap):
    if cpu_isa.select_level(cap) != cap:
        pytest.skip(f"this CPU cannot run {cap} (it runs {cpu_isa.select_level(cap)})")
    fresh.setenv(cpu_isa.ISA_ENV, cap.upper())
    tier, vnni = cpu_isa.CAP_LIMITS[cap]
    with structlog.testing.capture_logs() as logs:
        lib = cpu_ops.load()
    assert lib is not None, cpu_ops.error()
    assert cpu_ops.isa() == tier and lib.cpu_ops_isa() == tier.encode()
    assert cpu_ops.isa_level() == cap and cpu_ops.vnni() == vnni
    (loaded,) = [e for e in logs if e["event"] == "cpu_kernels_loaded"]
    assert (loaded["isa"], loaded["tier"], loaded["vnni"], loaded["cap"]) == (
        cap, tier, vnni, cap)
    assert loaded["cpu_supports"] == cpu_isa.select_level()
    assert cpu_ops.prefill_supported(64) == (cap != "generic")
    assert ("vnni" in gguf_ops.q8_variants()) == vnni


def test_a_no_vnni_cap_hides_the_vnni_loop(fresh):
    """``PAGEDSERVE_CPU_ISA=avx512`` on an AVX512-VNNI CPU (avx2 on an AVX-VNNI one): what an
    AVX-512 CPU without VNNI runs; ``use_isa`` (the kernel tests) still reaches every loop."""
    tier = next((t for t in ("avx512", "avx2") if cpu_isa.select_level(f"{t}_vnni")
                 == f"{t}_vnni"), None)
    if tier is None:
        pytest.skip("this CPU has no VNNI")
    fresh.setenv(cpu_isa.ISA_ENV, tier)
    assert cpu_ops.isa() == tier and cpu_ops.isa_level() == tier and not cpu_ops.vnni()
    assert gguf_ops.q8_variants() == ("generic", "simd")
    blocks = torch.zeros(16, 34, dtype=torch.uint8)  # Q8_0 rows of zeros: scale 0
    packed = gguf_ops.gguf_q8_repack(blocks, 8, 32)
    x = torch.randn(1, 32)
    with pytest.raises(ValueError, match="'vnni' does not run here"):
        gguf_ops.gguf_q8_linear(x, packed, 8, 16, variant="vnni")
    assert gguf_ops.gguf_q8_linear(x, packed, 8, 16).abs().max() == 0  # the simd loop
    with cpu_ops.use_isa(tier):
        assert gguf_ops.q8_variants() == ("generic", "simd", "vnni")
        assert cpu_ops.isa_level() == f"{tier}_vnni"
        assert gguf_ops.gguf_q8_linear(x, packed, 8, 16, variant="vnni").abs().max() == 0
    with cpu_ops.use_isa(tier, vnni=False):
        assert gguf_ops.q8_variants() == ("generic", "simd")
    assert cpu_ops.isa_level() == tier  # restored


def test_unset_cap_takes_the_best_tier(fresh):
    assert cpu_ops.isa() == cpu_isa.supported()[-1]


def test_unknown_cap_is_an_error(fresh):
    fresh.setenv(cpu_isa.ISA_ENV, "avx10")
    with pytest.raises(ValueError, match="PAGEDSERVE_CPU_ISA='avx10' is not one of"):
        cpu_ops.load()


def test_a_tier_the_cpu_lacks_is_refused(fresh):
    fresh.setattr(cpu_isa, "cpu_flags", lambda: ZEN3)  # as on an AVX2-only CPU
    with pytest.raises(ValueError, match="cannot run the avx512 kernels .*avx512bw"):
        cpu_ops.load_isa("avx512")
    with pytest.raises(ValueError, match="cannot run the avx512"), cpu_ops.use_isa("avx512"):
        pass
    fresh.setenv(cpu_isa.ISA_ENV, "avx512")
    assert cpu_ops.isa() == "avx2"
    with pytest.raises(ValueError, match="unknown CPU ISA tier 'sse3'"):
        cpu_ops.load_isa("sse3")


def test_use_isa_switches_and_restores():
    before = cpu_ops.isa()
    with cpu_ops.use_isa("generic") as lib:
        assert cpu_ops.isa() == "generic" and cpu_ops.load() is lib
        assert not cpu_ops.prefill_supported(64)
    assert cpu_ops.isa() == before


@pytest.mark.parametrize("user_set", [False, True])
def test_cap_reaches_torch_when_set_before_its_import(user_set):
    if "avx2" not in cpu_isa.supported():
        pytest.skip("this CPU cannot run AVX2")
    env = {k: v for k, v in os.environ.items() if k not in cpu_isa.TORCH_ENV["avx2"]}
    env[cpu_isa.ISA_ENV] = "avx2"
    if user_set:
        env["ATEN_CPU_CAPABILITY"] = "default"  # a value the user set wins
    code = ("import json, os; from pagedserve.kernels.cpu_isa import cap_torch_env; "
            "set_now = cap_torch_env(); import torch; print(json.dumps([set_now, "
            "torch.backends.cpu.get_cpu_capability(), os.environ['ONEDNN_MAX_CPU_ISA']]))")
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                         capture_output=True, text=True).stdout
    set_now, capability, onednn = json.loads(out)
    assert capability == ("DEFAULT" if user_set else "AVX2") and onednn == "AVX2"
    assert ("ATEN_CPU_CAPABILITY" in set_now) == (not user_set)


def test_cap_torch_env_is_a_no_op_once_torch_is_imported(monkeypatch):
    monkeypatch.setenv(cpu_isa.ISA_ENV, "avx2")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    assert "torch" in sys.modules and cpu_isa.cap_torch_env() == {}
    assert "ATEN_CPU_CAPABILITY" not in os.environ


def test_build_is_cached_and_failure_falls_back(fresh, tmp_path):
    monkeypatch = fresh
    monkeypatch.setenv(cpu_ops.CACHE_ENV, str(tmp_path))
    with structlog.testing.capture_logs() as events:
        assert cpu_ops.load() is not None
    built = list(tmp_path.glob("cpu_ops-*.so"))
    assert len(built) == 1
    # The first start's ~15 s of compiling is announced, then timed.
    names = [e["event"] for e in events]
    start = names.index("building CPU kernels (first start only)")
    done = names.index("cpu_kernels_built")
    assert start < done and events[start]["cache"] == str(tmp_path)
    assert 0 < events[done]["seconds"] < 600 and events[done]["library"] == str(built[0])
    mtime = built[0].stat().st_mtime_ns
    monkeypatch.setattr(cpu_ops, "_tried", False)
    with structlog.testing.capture_logs() as events:
        assert cpu_ops.load() is not None
    assert built[0].stat().st_mtime_ns == mtime  # loaded from the cache, not rebuilt
    assert not {"building CPU kernels (first start only)", "cpu_kernels_built"} & {
        e["event"] for e in events}
    # A compiler that fails: load() says None and why; nothing half-built is left behind.
    monkeypatch.setenv(cpu_ops.CACHE_ENV, str(tmp_path / "other"))
    monkeypatch.setenv("CXX", "false")
    monkeypatch.setattr(cpu_ops, "_tried", False)
    monkeypatch.setattr(cpu_ops, "_lib", None)
    assert cpu_ops.load() is None
    assert "false failed" in cpu_ops.error()
    assert list((tmp_path / "other").iterdir()) == []
    with pytest.raises(RuntimeError, match="unavailable"):
        q, kc, vc, table, lens = _setup([2], 2, 2, 8, 4, torch.float32)
        cpu_ops.paged_decode_attention(q, kc, vc, table, lens, 1.0)


def test_loading_keeps_subnormals():
    """Linking with -ffast-math would set flush-to-zero for the whole process on load (gcc's
    crtfastmath.o): torch, numpy and hypothesis would all see subnormals vanish."""
    assert cpu_ops.load() is not None
    assert (torch.tensor(1e-40) * 1.0).item() != 0.0
