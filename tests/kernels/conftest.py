"""``isa``: run a kernel test once per ISA tier of our CPU kernels (``kernels/cpu_isa.py``);
tiers this CPU cannot execute are skipped, saying which flags it lacks. Whatever
``PAGEDSERVE_CPU_ISA`` says, each tier offers every int8 loop the CPU runs (``use_isa``: its
VNNI one where the CPU has it, and the simd one beside it), so the q8 tests reach them all."""

from __future__ import annotations

import pytest

from pagedserve.kernels import cpu_isa, cpu_ops


@pytest.fixture(params=cpu_isa.ISAS)
def isa(request: pytest.FixtureRequest):
    name = request.param
    if name not in cpu_isa.supported():
        missing = sorted(cpu_isa.REQUIRED_FLAGS[name] - cpu_isa.cpu_flags())
        pytest.skip(f"this CPU cannot run the {name} kernels (it lacks {', '.join(missing)})")
    with cpu_ops.use_isa(name):
        yield name
