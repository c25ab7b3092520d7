"""Where our Triton kernels run in tests: compiled on CUDA, else in Triton's CPU interpreter.

``@triton.jit`` reads ``TRITON_INTERPRET`` when it decorates a function, i.e. when a module is
first imported, and Triton's own modules (``triton.language``, imported lazily, e.g. by
transformers' model classes) must agree with our kernels. So without CUDA the variable is set
once, from the root conftest, before anything imports triton, and stays set for the session.
The CPU path never imports triton (the torch backend does not), so other tests, including the
``pagedserve serve`` subprocess of the end-to-end tests, are unaffected.
"""

from __future__ import annotations

import os
import sys

import torch


def configure() -> str:
    """Set up the session; returns the device kernel tests run on (``cuda`` or ``cpu``)."""
    if torch.cuda.is_available():
        return "cuda"
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 could be set")
    os.environ["TRITON_INTERPRET"] = "1"
    return "cpu"


KERNEL_DEVICE = configure()
