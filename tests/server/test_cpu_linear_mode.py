"""``--cpu-linear-mode`` through a real server on the tiny GGUF: ``/admin/stats`` says which
path each batch band runs, int8 serves greedy output close to the exact mode's, and ``auto``
with ``--dtype float32`` is the exact mode (the setting the parity tests use)."""

from __future__ import annotations

from pagedserve.kernels import cpu_ops
from tests.conftest import serve, stats, stream_chat

PROMPT = "Name three colours of the rainbow."


async def _greedy(path, **kw) -> tuple[list[dict], list[int]]:
    async with serve(path, quantization="gguf", max_model_len=144, **kw) as c:
        paths = (await stats(c))["config"]["model"]["cpu_linear_paths"]
        _, tokens, _ = await stream_chat(c, PROMPT, max_tokens=16, ignore_eos=True)
        return paths, tokens


async def test_int8_and_exact_modes_through_the_server(tiny_gguf_path):
    tier, isa = cpu_ops.isa(), cpu_ops.isa_level()
    paths, exact = await _greedy(tiny_gguf_path, dtype="float32")  # auto + explicit float32
    assert paths == [{"mode": "exact", "tier": tier, "isa": isa, "rows": "1+", "path": "exact"}]
    paths, int8 = await _greedy(tiny_gguf_path, dtype="float32", cpu_linear_mode="int8")
    assert paths == [{"mode": "int8", "tier": tier, "isa": isa, "rows": "1+", "path": "int8"}]
    assert len(int8) == len(exact) == 16
    # Different arithmetic, the same model: the first tokens agree on this prompt.
    assert int8[:2] == exact[:2]
